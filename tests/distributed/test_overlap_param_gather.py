"""Issue 45, --overlap-param-gather (Megatron-LM's flag, megatron-core's overlapped parameter
all-gather of the distributed optimizer) on CPU/gloo at DP=2: the all-gather moves from the end
of the optimizer step to the next forward's pre-hooks, so the arithmetic is the same and the
training and validation losses of 20 iterations are bitwise equal to the run without it
(--clip-grad 0, as test_distributed_optimizer's bitwise case). Parameters are gathered before
each evaluation (hooks off, as Megatron-LM) and before each checkpoint: a run resumed from its
iteration-10 checkpoint continues bit for bit.

Slow (three 2-rank runs, ~60 s): the default suite's Megatron-FSDP script run
(tests/unit/megatron/training/test_upstream_scripts.py) trains with the flag at DP=2, evaluates
and saves.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import TINY_GPT_ARGS, read_losses, run_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FLAGS = TINY_GPT_ARGS + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                         "--clip-grad", "0", "--eval-interval", "5", "--eval-iters", "1"]
OVERLAP = ["--overlap-param-gather"]


def _run(tmp_path, name: str, extra: list[str]) -> tuple[dict[int, float], dict[int, float]]:
    metrics = tmp_path / f"{name}.jsonl"
    run_trainer(2, FLAGS + extra + ["--log-metrics-jsonl", str(metrics)])
    validation = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "validation_lm_loss" in record:
            validation[record["iteration"]] = record["validation_lm_loss"]
    return read_losses(metrics), validation


def test_overlapped_parameter_gather_changes_no_bit_and_resumes(tmp_path):
    from megatron.training import checkpointing

    plain, plain_validation = _run(tmp_path, "plain", [])
    checkpoints = tmp_path / "checkpoints"
    overlap, overlap_validation = _run(tmp_path, "overlap", OVERLAP + [
        "--save", str(checkpoints), "--save-interval", "10"])
    assert sorted(plain) == list(range(1, 21)) and sorted(plain_validation) == [5, 10, 15, 20]
    assert overlap == plain
    assert overlap_validation == plain_validation
    load = tmp_path / "load"  # iteration 10's checkpoint alone (the run also saved 20)
    shutil.copytree(checkpointing.checkpoint_dir(checkpoints, 10),
                    checkpointing.checkpoint_dir(load, 10))
    (load / checkpointing.TRACKER_FILENAME).write_text("10")
    resumed, _ = _run(tmp_path, "resumed", OVERLAP + ["--load", str(load)])
    assert sorted(resumed) == list(range(11, 21))
    assert resumed == {iteration: plain[iteration] for iteration in range(11, 21)}
