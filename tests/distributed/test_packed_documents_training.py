"""Packed documents in training (--reset-attention-mask): under CP=2, MEMO's offload (one
layer checkpoint-offloaded, the others token-wise at alpha 0.25) gives the losses of the same
run without it, to 1e-5 relative, over 20 iterations; and the documents do change the losses
(the mock data's samples cross document ends), so the comparison is not vacuous."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_GPT_ARGS, read_losses, run_torchrun

# Three 2-rank trainings (about 2 minutes alone, 4 on a busy 2-core machine): -m slow.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = TINY_GPT_ARGS + ["--deterministic-mode", "--position-embedding-type", "rope",
                          "--seq-length", "256", "--micro-batch-size", "1",
                          "--context-parallel-size", "2"]
MEMO = ["--memo-offload", "--memo-alpha", "0.25", "--memo-checkpoint-layers", "1"]


def _losses(tmp_path, name: str, flags: list[str]) -> dict[int, float]:
    metrics = tmp_path / f"{name}.jsonl"
    run_torchrun(2, COMMON + flags + ["--log-metrics-jsonl", str(metrics)])
    return read_losses(metrics)


def test_memo_with_packed_documents_equals_the_run_without_memo(tmp_path):
    reference = _losses(tmp_path, "documents", ["--reset-attention-mask"])
    memo = _losses(tmp_path, "documents_memo", ["--reset-attention-mask", *MEMO])
    unpacked = _losses(tmp_path, "no_documents", MEMO)
    assert sorted(memo) == sorted(reference) == list(range(1, 21))
    for iteration, loss in reference.items():
        assert memo[iteration] == pytest.approx(loss, rel=1e-5), iteration
    assert any(unpacked[i] != pytest.approx(reference[i], rel=1e-4) for i in reference)
