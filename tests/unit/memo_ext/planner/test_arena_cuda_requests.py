"""The planned arena keeps its plan under the requests a CUDA run makes (issue 42, finding 3).

PyTorch's pluggable allocator calls the arena's hook for every tensor, zero-byte ones included,
and the CUDA attention kernels allocate a few small tensors the trace never recorded. The
hook runs for real here (memo_ext._C's memo_arena_malloc, against the fake CUDA runtime):
through tests/cuda_double.py's pluggable allocator, which calls it as PyTorch does, and through
bench/arena_requests.py's replay of a CUDA-faithful request sequence (a small synthetic trace of
two layers, with the untraced requests the kernels make; bench/planning.py --cuda-requests
replays real traces of the model make gpu-check trains)."""
from __future__ import annotations

import itertools

import pytest

from bench.arena_requests import (
    ARENA_BASE,
    KERNELS,
    cuda_requests,
    replay_through_hooks,
)
from memo_ext import _C
from memo_ext.attention.kernels import TILE_BACKWARD_OP, TILE_FORWARD_OP
from memo_ext.planner.arena import ArenaRuntime, install_cuda_allocator
from memo_ext.planner.plan import plan_trace
from memo_ext.planner.trace import Trace

BASE = 1 << 40  # the hooks only compute addresses inside the arena, never touch them


class Plan:
    """One forward phase kind: 1 KiB at 0, 2 KiB at 1 KiB, 512 B at 3 KiB, 1 KiB at 3.5 KiB."""

    level1 = [{"peak": 4608, "phases": [[0, "forward", None, 0]],
               "table": [[1024, 0], [2048, 1024], [512, 3072], [1024, 3584]]}]


@pytest.fixture
def arena(cuda_double, loaded_fake_cuda_runtime):
    """The arena's hooks as PyTorch's CUDA allocator (through the double), serving Plan's
    forward phase of layer 0 on the double's current stream (handle 0)."""
    install_cuda_allocator()
    runtime = ArenaRuntime(Plan())
    _C.set_cuda_arena(runtime.arena, BASE, cuda_double._current[0].cuda_stream)
    runtime.enter(0, "forward")
    yield cuda_double, runtime
    _C.set_cuda_arena(None, 0, 0)


def test_zero_byte_requests_never_touch_the_arena(arena):
    double, runtime = arena
    empty = double.allocate(0)   # the hook is called, as PyTorch's pluggable allocator calls it
    first = double.allocate(1000)
    assert (empty, first) == (0, BASE)  # null, as the caching allocator answers 0 bytes
    assert 0 in double.pluggable.metadata  # PyTorch records the null pointer too
    double.free(empty)  # a null DataPtr's deleter never runs: no free hook call
    assert runtime.stats()["served"] == 1 and runtime.stats()["size_mismatches"] == 0
    double.free(first)


def test_a_small_untraced_request_leaves_the_plan_in_place(arena):
    """flash attention's 16-byte RNG state between two planned requests: refused (the pool
    serves it) without using up a position, and without resyncing onto the 512-byte entry
    two positions ahead."""
    double, runtime = arena
    addresses = [double.allocate(n) for n in (1000, 16, 2000, 500, 1024)]
    first, rng_state, second, small, last = addresses
    assert (first, second, small, last) == (BASE, BASE + 1024, BASE + 3072, BASE + 3584)
    assert not BASE <= rng_state < BASE + 4608
    stats = runtime.stats()
    assert (stats["served"], stats["size_mismatches"], stats["resyncs"]) == (4, 1, 0)
    for address in addresses:
        double.free(address)


# ------------------------------------------------------------- a CUDA-faithful replay
def small_trace() -> Trace:
    """Two layers' forward and backward as tools/trace.py records them (one micro-batch): in
    each forward a tile_forward (out, lse, then the 16-byte RNG state its CUDA rules record)
    followed by a 4-byte reduction (a 512-byte planned entry right after the kernels' own
    requests), in each backward a tile_backward (dq, dk, dv) with its declared workspaces."""
    events, ids, live = [], itertools.count(), {}

    def alloc(nbytes, layer, phase, op, category="activation"):
        i = next(ids)
        live[i] = nbytes
        events.append({"id": i, "action": "alloc", "bytes": nbytes, "stream": 0, "layer": layer,
                       "phase": phase, "category": category,
                       "microbatch": None if phase == "init" else 0, "pool": "device",
                       "module": None, "op": op})
        return i

    def free(i, layer, phase):
        events.append({"id": i, "action": "free", "bytes": live.pop(i), "stream": 0,
                       "layer": layer, "phase": phase, "category": "activation",
                       "microbatch": 0, "pool": "device", "module": None, "op": None})

    for layer in range(2):
        alloc(65536, None, "init", None, "parameter")
    kept = {}
    for layer in range(2):
        f = "forward"
        x = alloc(8192, layer, f, "aten.mm.default")
        t = alloc(4096, layer, f, "aten.mul.Tensor")
        out = alloc(8192, layer, f, TILE_FORWARD_OP)
        lse = alloc(1024, layer, f, TILE_FORWARD_OP)
        rng_state = alloc(16, layer, f, TILE_FORWARD_OP, "workspace")  # the CUDA rules' record
        free(rng_state, layer, f)
        s = alloc(4, layer, f, "aten.sum.default")
        y = alloc(8192, layer, f, "aten.mm.default")
        free(s, layer, f)
        free(t, layer, f)
        h = alloc(16384, layer, f, "aten.gelu.default")
        free(h, layer, f)
        kept[layer] = (x, out, lse, y)
    for layer in reversed(range(2)):
        b = "backward"
        g = alloc(8192, layer, b, "aten.mm.default")
        grads = [alloc(8192, layer, b, TILE_BACKWARD_OP) for _ in range(3)]
        softmax_d = alloc(1024, layer, b, TILE_BACKWARD_OP, "workspace")
        dq_accum = alloc(16384, layer, b, TILE_BACKWARD_OP, "workspace")
        free(dq_accum, layer, b)
        free(softmax_d, layer, b)
        r = alloc(4, layer, b, "aten.sum.default")
        free(r, layer, b)
        for i in (*kept[layer], *grads, g):
            free(i, layer, b)
    return Trace(header={}, events=events)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_cuda_faithful_replay_serves_the_plan_at_its_offsets(kernels, loaded_fake_cuda_runtime):
    trace = small_trace()
    plan = plan_trace(trace, use_mip=False)
    requests = cuda_requests(trace, kernels, iterations=2)
    result = replay_through_hooks(plan, requests, kernels)
    # the kernels' untraced requests are zero-byte ones only: their RNG state is traced
    assert result.untraced_zero > 0 and result.untraced_small == 0
    assert result.planned > 20 and result.share >= 0.99, (result.at_plan, result.planned)
    assert result.zero_byte_non_null == 0
    assert (result.stats["overlaps"], result.stats["beyond_plan"]) == (0, 0)
    assert _C.cuda_arena_hooks()["serving"] is False and ARENA_BASE  # the replay cleaned up
