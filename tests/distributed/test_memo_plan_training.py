"""--memo-plan in the trainer (CPU): auto warms up one iteration, traces and plans the second,
and serves every later iteration's layer requests from the arena (as a shadow on CPU) with the
losses of a run without a plan; a plan file for another run is refused before training.

Under DP every layer request is served as planned. Under TP + SP, gloo's worker threads drop
the buffers of asynchronous all-gathers at times that vary between iterations, so a block the
plan expects freed can still be live: the arena refuses those requests (counted as overlaps)
and they take the normal allocator; the losses stay identical."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, TINY_GPT_ARGS, read_losses, run_trainer, subprocess_env

pytestmark = pytest.mark.distributed

COMMON = TINY_GPT_ARGS + ["--deterministic-mode", "--train-iters", "8"]
TP_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _arena_counts(stdout: str) -> tuple[int, int, int, int]:
    lines = re.findall(r"MEMO arena: served (\d+) layer requests.*?(\d+) size mismatches, "
                       r"(\d+) overlaps, (\d+) beyond plan", stdout)
    assert lines, stdout[-3000:]
    return tuple(map(int, lines[-1]))


# TP + SP is slow: dp2 keeps the trainer's plan, arena and identical losses in the default suite
# (with the stricter no-overlap count), and the arena's refusal of an overlapping request is
# tests/unit/memo_ext/planner/test_planned_arena_tagger.py's (default).
@pytest.mark.parametrize("layout", [[], pytest.param(TP_SP, marks=pytest.mark.slow)],
                         ids=["dp2", "tp2_sp"])
def test_auto_plan_trains_with_identical_losses_and_serves_the_layers(layout, tmp_path):
    baseline_metrics = tmp_path / "baseline.jsonl"
    run_trainer(2, COMMON + layout + ["--log-metrics-jsonl", str(baseline_metrics)])
    planned_metrics = tmp_path / "planned.jsonl"
    result = run_trainer(2, COMMON + layout + ["--memo-plan", "auto", "--log-metrics-jsonl",
                                                str(planned_metrics)])
    assert read_losses(planned_metrics) == read_losses(baseline_metrics)
    assert "> MEMO plan (" in result.stdout and "MEMO plan: warming up" in result.stdout
    served, mismatches, overlaps, beyond = _arena_counts(result.stdout)
    # 6 planned iterations x 4 micro-batches x 4 layers x (forward + backward).
    assert served > 6 * 4 * 4 * 2
    assert (mismatches, beyond) == (0, 0)
    if not layout:
        assert overlaps == 0


@pytest.mark.slow  # ~50 s: a trace, a plan and a refused launch
def test_a_plan_for_another_run_is_refused_before_training(tmp_path):
    trace = tmp_path / "trace.jsonl.gz"
    plan = tmp_path / "plan.json"
    for command in (
        [str(REPO_ROOT / "tools" / "trace.py"), "--num-layers", "4", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "128", "--vocab-size", "512",
         "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2",
         "--use-distributed-optimizer", "--quiet", "-o", str(trace)],
        [str(REPO_ROOT / "tools" / "memo_plan.py"), "--trace", str(trace), "-o", str(plan)],
    ):
        done = subprocess.run([sys.executable, *command], cwd=REPO_ROOT, env=subprocess_env(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    with pytest.raises(AssertionError) as failure:  # run_trainer asserts exit status 0
        run_trainer(2, COMMON + ["--memo-plan", str(plan)])
    assert "planned for model.seq_length=128, this run has 64" in str(failure.value)
    corrupted = tmp_path / "corrupted.json"
    corrupted.write_text(json.dumps({"format": "memo-plan", "version": 1}))
    with pytest.raises(AssertionError) as failure:
        run_trainer(2, COMMON + ["--memo-plan", str(corrupted)])
    assert "corrupted plan" in str(failure.value)
