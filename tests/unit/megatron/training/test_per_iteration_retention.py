"""No training iteration leaves memory behind that the next one does not free (the soak lesson:
anything that runs every iteration must not accumulate).

An RSS soak (bench/soak.py) sees growth of a few KiB per iteration only over thousands of
iterations, through allocator noise, and cannot see less. tracemalloc sees every Python
allocation exactly: the trainer (pretrain_gpt.main, in this process) runs a few warm-up
iterations, then tracing starts, and two snapshots ``CHECKED`` iterations apart are compared,
each after a full collection (cyclic garbage awaiting the collector is not retained memory).
What is alive at both points (the iteration in flight, caches already filled) cancels out; a
place in the code that keeps one block per iteration (a list that only grows) gains
``CHECKED`` blocks under one traceback. Only blocks that this project's code (megatron.training,
memo_ext) allocates itself on the training thread count: torch's and megatron-core's own
caches, which a tiny run is still filling after many iterations, are theirs to soak; so are the
tensors compat/'s CUDA shims create on their behalf; and the RSS sampler thread's reads are in
flight whenever a snapshot is taken.

Found this way: the loop appended each iteration's loss to TrainState.losses, a list nothing
read (a float and its list slot, about 32 bytes per iteration: 32 MB over a million
iterations, far below what the soak's RSS slope resolves).
"""

from __future__ import annotations

import gc
import tracemalloc

from tests.conftest import REPO_ROOT, TINY_GPT_ARGS
from tests.gloo_ranks import free_port

WARMUP, CHECKED = 6, 8
OURS = (str(REPO_ROOT / "megatron" / "training"), str(REPO_ROOT / "memo_ext"))
ON_BEHALF = str(REPO_ROOT / "megatron" / "training" / "compat")


def _ours(traceback) -> bool:
    allocating, oldest = traceback[-1].filename, traceback[0].filename
    return (allocating.startswith(OURS) and not allocating.startswith(ON_BEHALF)
            and not oldest.endswith("threading.py"))


# Two layers, 64 tokens, one micro-batch of 2: a few hundredths of a second per iteration.
FLAGS = [*TINY_GPT_ARGS, "--num-layers", "2", "--global-batch-size", "2",
         "--train-iters", str(WARMUP + 2 * CHECKED), "--log-interval", "1000"]


def test_iterations_keep_no_python_memory_of_ours(monkeypatch, capsys):
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.arguments import run_main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("RANK", raising=False)
    log, snapshots, gained = training.TrainingLogger.log, [], []

    def traced_log(self, iteration, *args, **kwargs):
        # Called once per iteration, after the step and the loop's own bookkeeping.
        if iteration == WARMUP:
            tracemalloc.start(25)
        elif iteration in (WARMUP + CHECKED, WARMUP + 2 * CHECKED):
            gc.collect()
            snapshots.append(tracemalloc.take_snapshot())
        if len(snapshots) == 2 and not gained:
            tracemalloc.stop()
            gained.extend(
                stat for stat in snapshots[1].compare_to(snapshots[0], "traceback")
                if _ours(stat.traceback))
        return log(self, iteration, *args, **kwargs)

    monkeypatch.setattr(training.TrainingLogger, "log", traced_log)
    try:
        run_main(pretrain_gpt.main, FLAGS)  # destroys the process group when it returns
    finally:
        tracemalloc.stop()
        parallel_state.destroy_model_parallel()  # for the next test's initialisation
    capsys.readouterr()
    assert gained, "tracing saw no allocation of ours: the check did not run"
    per_iteration = [stat for stat in gained if stat.count_diff >= CHECKED]
    assert not per_iteration, "\n".join(
        f"{stat.count_diff} blocks ({stat.size_diff} B) gained over {CHECKED} iterations, "
        "allocated at:\n"
        + "\n".join(stat.traceback.format(limit=3)) for stat in per_iteration)
