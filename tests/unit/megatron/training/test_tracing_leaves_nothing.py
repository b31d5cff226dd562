"""A trace leaves nothing of itself behind in the process that made it (the estimator's
tracer workers make hundreds): megatron-core's RotaryEmbedding.forward is an lru_cache keyed
by the module, and the RoPE table it holds keeps the storage whose free-finalizer is bound to
the trace's recorder, so each trace's recorder, with every event it recorded, stayed alive
until 32 newer models had pushed it out of the cache."""

from __future__ import annotations

import gc

from megatron.training import tracing
from memo_ext.trace.recorder import AllocationRecorder
from tests.conftest import trace_request

SHAPE = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
         "--vocab-size", "512", "--bf16", "--memo-offload"]


def _live_recorders() -> int:
    gc.collect()
    return sum(isinstance(obj, AllocationRecorder) for obj in gc.get_objects())


def test_no_recorder_outlives_its_trace():
    before = _live_recorders()
    for seq in (1024, 2048):
        trace, _ = tracing.record(trace_request(SHAPE, seq))
        assert trace.events  # the trace itself is the caller's
        del trace
    assert _live_recorders() == before
