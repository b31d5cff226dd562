"""memo_ext.estimate.tracer.TracerPool and the tracer engine's ``--serve`` loop: a typed request
traced by a long-lived worker equals the engine's trace of it in this process, errors answer
without ending the worker, a dead worker is replaced, and close() leaves no process behind."""

from __future__ import annotations

import os
import threading

import pytest

from memo_ext.estimate import EstimateError
from memo_ext.estimate.tracer import TracerPool
from memo_ext.planner.trace.request import TracedModel, TraceRequest

TINY_MODEL = TracedModel(num_layers=2, hidden_size=64, ffn_hidden_size=256,
                         num_attention_heads=4, vocab_size=128)


def tiny(seq: int, **fields) -> TraceRequest:
    return TraceRequest(model=TINY_MODEL, seq_length=seq, **fields)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def pool():
    with TracerPool(workers=1) as shared:
        yield shared


def test_pool_trace_equals_the_engines_trace_in_process(pool, tmp_path):
    from megatron.training.tracing import trace_to_file
    from memo_ext.planner.trace import read_trace

    trace_to_file(tiny(256), str(tmp_path / "direct.jsonl.gz"))
    direct = read_trace(tmp_path / "direct.jsonl.gz")
    served = pool.trace(tiny(256), tmp_path / "served.jsonl.gz")
    assert served.events == direct.events and served.header == direct.header
    assert served.header["model"]["seq_length"] == 256


def test_traces_in_a_row_reuse_the_server(pool, tmp_path):
    first = pool.trace(tiny(128), tmp_path / "a.jsonl.gz")
    pids = pool.pids
    second = pool.trace(tiny(512), tmp_path / "b.jsonl.gz")
    assert pool.pids == pids and len(pids) == 1
    assert (first.header["model"]["seq_length"], second.header["model"]["seq_length"]) \
        == (128, 512)
    assert len(first.events) == len(second.events)  # same program, other sizes


@pytest.mark.parametrize("bad, message", [
    ({"tp": 3}, r"tracing at 256 tokens failed: .*ArgumentValidationError: "
                r"--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    ({"rank": 99}, r"tracing at 256 tokens failed: error: --rank 99 is outside the world"),
    ({"extra_trainer_argv": ("--no-such-flag",)},
     r"tracing at 256 tokens failed: .*unrecognized arguments: --no-such-flag"),
], ids=["tp-3", "rank-99", "unknown-flag"])
def test_a_failed_trace_leaves_the_server_serving(pool, tmp_path, bad, message):
    output = tmp_path / "bad.jsonl.gz"
    with pytest.raises(EstimateError, match=message):
        pool.trace(tiny(256, **bad), output)
    assert not output.exists()
    pids = pool.pids
    assert pool.trace(tiny(128), tmp_path / "good.jsonl.gz").events
    assert pool.pids == pids


def test_a_dead_server_is_reported_and_replaced(pool, tmp_path):
    pool.trace(tiny(128), tmp_path / "warm.jsonl.gz")
    (pid,) = pool.pids
    os.kill(pid, 9)
    with pytest.raises(EstimateError, match=r"tracing at 128 tokens failed: .*exited with "
                                            r"status -9"):
        pool.trace(tiny(128), tmp_path / "dead.jsonl.gz")
    assert pool.pids == []
    assert pool.trace(tiny(128), tmp_path / "fresh.jsonl.gz").events
    assert pool.pids != [pid]


def test_concurrent_traces_then_close_leaves_no_process(tmp_path):
    """Two threads on two workers: each starts its own server; close() ends both."""
    results: dict[int, object] = {}
    with TracerPool(workers=2) as two:
        def work(seq: int) -> None:
            results[seq] = two.trace(tiny(seq), tmp_path / f"t{seq}.jsonl.gz")

        threads = [threading.Thread(target=work, args=(seq,)) for seq in (128, 256)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        pids = two.pids
        assert len(pids) == 2 and all(map(running, pids))
        assert {seq: t.header["model"]["seq_length"] for seq, t in results.items()} \
            == {128: 128, 256: 256}
    assert two.pids == [] and not any(map(running, pids))
    with pytest.raises(EstimateError, match="closed"):
        two.trace(tiny(128), tmp_path / "late.jsonl.gz")
