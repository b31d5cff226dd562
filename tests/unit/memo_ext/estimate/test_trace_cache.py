"""memo_ext.estimate.layout.TraceCache.prefetch: a layout's traces start together, each is
traced once however it is asked for, a background failure reaches the caller, and close()
waits for the traces under way. The tracer pool is replaced by a recording stand-in (the real
pool's own tests: test_tracer_pool.py)."""

from __future__ import annotations

import threading
import time

import pytest

from memo_ext.estimate import EstimateError
from memo_ext.estimate.layout import TraceCache
from memo_ext.trace.request import TracedModel, TraceRequest

TINY_MODEL = TracedModel(num_layers=2, hidden_size=64, ffn_hidden_size=256,
                         num_attention_heads=4, vocab_size=128)


class RecordingTracer:
    """Stands in for TraceCache._traced: each trace takes ``seconds``, at most ``workers`` at
    once (as the pool's servers), and is recorded."""

    def __init__(self, workers: int, seconds: float = 0.2, failing: int = -1) -> None:
        self.slots = threading.Semaphore(workers)
        self.seconds, self.failing = seconds, failing
        self.traced: list[int] = []
        self.running = self.most_at_once = 0
        self.lock = threading.Lock()

    def __call__(self, request: TraceRequest, output) -> str:
        with self.slots:
            with self.lock:
                self.traced.append(request.seq_length)
                self.running += 1
                self.most_at_once = max(self.most_at_once, self.running)
            time.sleep(self.seconds)
            with self.lock:
                self.running -= 1
            if request.seq_length == self.failing:
                raise EstimateError(f"tracing at {request.seq_length} tokens failed: boom")
            return f"trace at {request.seq_length}"


def requests(*seqs: int) -> list[TraceRequest]:
    return [TraceRequest(model=TINY_MODEL, seq_length=seq) for seq in seqs]


def cache_with(tracer: RecordingTracer, workers: int) -> TraceCache:
    cache = TraceCache(None, workers=workers)
    cache._traced = tracer
    return cache


def test_prefetched_traces_run_on_every_worker_and_are_traced_once():
    tracer = RecordingTracer(workers=2)
    with cache_with(tracer, workers=2) as cache:
        wanted = requests(1024, 2048, 4096, 8192)
        cache.prefetch(wanted)
        # asked for one at a time, as LayoutModel.build does, after the prefetch
        answers = [cache.trace(request) for request in wanted]
    assert answers == [f"trace at {seq}" for seq in (1024, 2048, 4096, 8192)]
    assert sorted(tracer.traced) == [1024, 2048, 4096, 8192]  # none twice
    assert tracer.most_at_once == 2  # both workers busy: in turn, one would be


def test_a_prefetched_trace_is_kept_until_asked_for_even_without_a_cache_directory():
    tracer = RecordingTracer(workers=2, seconds=0.05)
    with cache_with(tracer, workers=2) as cache:  # no directory: nothing on disk to reread
        first, second = requests(1024, 2048)
        cache.prefetch([first, second])
        cache.prefetch([first])  # already under way: not again
        time.sleep(0.5)  # both done before anyone asks
        assert cache.trace(second) == "trace at 2048" and cache.trace(first) == "trace at 1024"
    assert sorted(tracer.traced) == [1024, 2048]


def test_without_prefetch_the_same_requests_keep_one_worker_busy():
    tracer = RecordingTracer(workers=2)
    with cache_with(tracer, workers=2) as cache:
        for request in requests(1024, 2048):
            cache.trace(request)
    assert tracer.most_at_once == 1  # what prefetch is for


def test_a_failed_background_trace_reaches_the_caller():
    tracer = RecordingTracer(workers=1, failing=2048)
    with cache_with(tracer, workers=1) as cache:
        cache.prefetch(requests(1024, 2048))
        assert cache.trace(requests(1024)[0]) == "trace at 1024"
        with pytest.raises(EstimateError, match="2048 tokens failed"):
            cache.trace(requests(2048)[0])


def test_close_waits_for_the_traces_under_way():
    tracer = RecordingTracer(workers=2, seconds=0.3)
    cache = cache_with(tracer, workers=2)
    cache.prefetch(requests(1024, 2048))
    time.sleep(0.05)  # both started
    cache.close()
    assert tracer.running == 0 and sorted(tracer.traced) == [1024, 2048]
    assert cache._pool is None and cache._prefetcher is None
