"""megatron.training.tracing's warm-up: a MEMO trace warmed up by one forward (then
MemoOffload.abandon_forward) records the iteration event for event as one warmed up by a whole
iteration, about a quarter cheaper; where a forward is not enough, a whole iteration."""

from __future__ import annotations

import pytest

from megatron.training import tracing
from tests.conftest import trace_request

SHAPE = ["--num-layers", "5", "--hidden-size", "128", "--num-attention-heads", "8",
         "--vocab-size", "512", "--untie-embeddings-and-output-weights", "--bf16",
         "--use-distributed-optimizer", "--memo-offload"]


def _canonical(events: list[dict]) -> list[dict]:
    """``events`` with their ids numbered by first appearance (the warm-ups allocate different
    counts before the recorded iteration), and the autograd thread's cuBLAS workspace
    unattributed: a whole iteration's backward allocates it inside a layer, a forward
    warm-up declares it when the warm-up ends (CudaKernelRules.steady_state_workspaces);
    either way it is the same init allocation."""
    ids: dict = {}
    canonical = []
    for event in events:
        event = {**event, "id": ids.setdefault(event["id"], len(ids))}
        if event["phase"] == "init" and str(event["module"]).startswith("cuBLAS workspace"):
            event.update(layer=None, op=None)
        canonical.append(event)
    return canonical


@pytest.mark.parametrize("layout", [
    # (a) layers at alpha 1 over a CP=2 ring, two rounding buffers, tiles and head chunks
    ["--context-parallel-size", "2", "--memo-alpha", "1", "--memo-mlp-tiles", "4",
     "--memo-attention-projection-tiles", "4", "--memo-attention-head-chunks", "4"],
    # one buffer (freed after the backward), (a) and (b) layers mixed, fp8 offload
    ["--tensor-model-parallel-size", "2", "--memo-alpha", "0.5",
     "--memo-offload-buffers", "1", "--memo-checkpoint-layers", "2", "--memo-offload-fp8"],
], ids=["alpha1-cp2-tiled", "one-buffer-mixed-fp8-tp2"])
def test_a_forward_warm_up_records_memos_iteration_as_a_whole_one_does(layout):
    request = trace_request([*SHAPE, *layout], 4096)
    assert tracing.warmup_mode(request) == "forward"
    whole, _ = tracing.record(request.replace(warmup="iteration"))
    forward, _ = tracing.record(request.replace(warmup="forward"))
    assert any(event["pool"] == "host" for event in forward.events)  # MEMO's slots were traced
    assert _canonical(forward.events) == _canonical(whole.events)
    assert forward.header["options"].pop("warmup") == "forward"
    assert whole.header["options"].pop("warmup") == "iteration"
    assert forward.header == whole.header  # the work counted too


def test_a_whole_iteration_where_a_forward_is_not_enough():
    memo = trace_request(SHAPE, 4096)
    assert tracing.warmup_mode(memo.replace(microbatches_in_flight=2)) == "iteration"
    assert tracing.warmup_mode(memo.replace(megatron_fsdp="optim_grads_params")) == "iteration"
    assert tracing.warmup_mode(memo.replace(warmup="none")) == "none"
    plain = trace_request(SHAPE[:-1], 4096)
    assert tracing.warmup_mode(plain) == "forward"
