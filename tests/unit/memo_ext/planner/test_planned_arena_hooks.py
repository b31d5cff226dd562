"""The planned arena's CUDA allocator hooks (memo_arena_malloc / memo_arena_free in memo_ext._C),
called on CPU through ctypes against a fake CUDA runtime (csrc/standalone/fake_cuda_runtime.c,
built as libcudart.so.13 and loaded RTLD_LOCAL, as PyTorch loads its runtime): the CUDA runtime
functions the hooks call, backed by malloc, counting its calls.
What this cannot show is a GPU's behaviour (tests/gpu/test_planned_arena_cuda.py, skipped here);
what it does show is the hooks' own decisions: which requests the arena serves, at which address,
which go to cudaMallocAsync on the request's stream, and that the stream-ordered pool is told to
keep freed memory. It runs in the test process, with the session's fake runtime
(conftest.loaded_fake_cuda_runtime), which other tests' hook calls use too: the hooks look the
runtime's symbols up once per process, so counters are read as differences (a fresh process per
case cost ~10 s of interpreter and import start-up)."""

from __future__ import annotations

import ctypes

import pytest

from memo_ext import _C
from memo_ext.planner.arena import ArenaRuntime

COMPUTE, COPY = 0x10, 0x20
BASE = 1 << 40  # the hooks only compute addresses inside the arena, never touch them


class Plan:  # one forward phase kind: 1 KiB at 0, 2 KiB at 1 KiB, 512 B kept, 1 KiB at 3 KiB
    level1 = [{"peak": 4096, "phases": [[0, "forward", None, 0]],
               "table": [[1024, 0], [2048, 1024], [512, -1], [1024, 3072]]}]


@pytest.fixture
def hooks(loaded_fake_cuda_runtime):
    library = ctypes.CDLL(_C.__file__)
    malloc, free = library.memo_arena_malloc, library.memo_arena_free
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    record = library.memo_arena_record_stream
    record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    yield malloc, free, record
    _C.set_cuda_arena(None, 0, 0)


def test_hooks_serve_the_plan_on_the_compute_stream_and_pool_everything_else(
        hooks, loaded_fake_cuda_runtime, fake_cuda_runtime):
    malloc, free, record = hooks
    _C.set_cuda_arena(None, 0, 0)
    fake = loaded_fake_cuda_runtime
    counter = lambda name: ctypes.c_int.in_dll(fake, name).value  # noqa: E731
    stream_of = lambda name: ctypes.c_void_p.in_dll(fake, name).value  # noqa: E731
    pool = _C.cuda_arena_memory(0)

    # No arena: everything goes to the stream-ordered pool, which is told to keep memory.
    mallocs, frees = counter("fake_mallocs"), counter("fake_frees")
    early = malloc(100, 0, COMPUTE)
    assert counter("fake_mallocs") == mallocs + 1 and early, "the hooks did not find the runtime"
    assert _C.cuda_runtime_library() == str(fake_cuda_runtime)
    assert counter("fake_pool_device") == 0
    assert ctypes.c_uint64.in_dll(fake, "fake_release_threshold").value == 2**64 - 1
    free(early, 100, 0, COMPUTE)
    assert counter("fake_frees") == frees + 1

    runtime = ArenaRuntime(Plan())
    _C.set_cuda_arena(runtime.arena, BASE, COMPUTE)
    runtime.enter(0, "forward")
    mallocs, frees = counter("fake_mallocs"), counter("fake_frees")
    first = malloc(1000, 0, COMPUTE)
    copy = malloc(1000, 0, COPY)            # another stream: the pool, no table position used
    second = malloc(2000, 0, COMPUTE)
    workspace = malloc(8192, 0, COMPUTE)     # never traced: refused, no table position used
    runtime.enter(None, None)                # an op outside the layers inside the phase
    outside = malloc(1024, 0, COMPUTE)
    runtime.enter(0, "forward")
    kept = malloc(512, 0, COMPUTE)           # planned -1: the pool
    last = malloc(1024, 0, COMPUTE)
    assert (first, second, last) == (BASE, BASE + 1024, BASE + 3072), (first, second, last)
    pooled = {copy: 1000, workspace: 8192, outside: 1024, kept: 512}
    assert all(not BASE <= p < BASE + 4096 for p in pooled)
    assert counter("fake_mallocs") == mallocs + len(pooled)
    assert _C.cuda_arena_memory(0)["allocated"] == pool["allocated"] + sum(pooled.values())
    for p, size in zip((first, second, last), (1000, 2000, 1024)):
        free(p, size, 0, COMPUTE)
    for p, size in pooled.items():
        free(p, size, 0, COMPUTE)
    assert counter("fake_frees") == frees + len(pooled)
    stats = runtime.stats()
    expected = {"served": 3, "other_stream": 1, "size_mismatches": 1, "outside_phase": 1,
                "unplanned": 1, "overlaps": 0, "live_blocks": 0, "peak_live_bytes": 4096}
    assert {k: stats[k] for k in expected} == expected, stats

    # A request larger than its entry finds its own entry among the next ones and goes on there.
    runtime.close()
    runtime.enter(0, "forward")
    assert malloc(2000, 0, COMPUTE) == BASE + 1024
    held = malloc(512, 0, COMPUTE)
    assert malloc(1024, 0, COMPUTE) == BASE + 3072
    assert runtime.stats()["resyncs"] == 1
    free(BASE + 1024, 2000, 0, COMPUTE)
    free(BASE + 3072, 1024, 0, COMPUTE)

    # What they handed out: the pool's blocks (the arena's are inside a buffer held anyway);
    # the fake pool caches nothing, so its reserved bytes move the same.
    memory = _C.cuda_arena_memory(0)
    assert memory["allocated"] == pool["allocated"] + 512, memory  # the one pool block left
    assert memory["reserved"] - pool["reserved"] == 512, memory
    _C.cuda_arena_reset_peak(0)
    assert _C.cuda_arena_memory(0)["peak_allocated"] == memory["allocated"]
    free(held, 512, 0, COMPUTE)

    # A pool block recorded on the copy stream is freed there, after the copy stream waited
    # for the compute stream; an arena block recorded on it makes the compute stream wait.
    runtime.close()
    runtime.enter(0, "forward")
    planned = malloc(1000, 0, COMPUTE)
    pooled_block = malloc(5000, 0, COMPUTE)
    waits, events = counter("fake_waits"), counter("fake_live_events")
    record(planned, COPY)
    free(planned, 1000, 0, COMPUTE)
    assert counter("fake_waits") == waits + 1
    assert (stream_of("fake_last_waiter"), stream_of("fake_last_waited_for")) == (COMPUTE, COPY)
    record(pooled_block, COPY)
    free(pooled_block, 5000, 0, COMPUTE)
    assert counter("fake_waits") == waits + 2
    assert (stream_of("fake_last_waiter"), stream_of("fake_last_waited_for")) == (COPY, COMPUTE)
    assert stream_of("fake_last_stream") == COPY
    assert counter("fake_live_events") == events == 0
    assert runtime.stats()["live_blocks"] == 0  # nothing left for the hooks to keep
