"""The runtime arena (csrc/planned_arena.cpp, memo_ext._C.PlannedArena) and the "arena" allocator
model (csrc/allocator_models/arena.h, replay(trace, "arena", plan=...)) share one placement rule
(csrc/arena_ranges.h). Replaying the same plan through both must place the same requests at the
same offsets: the model at each request exactly where the runtime serves it, and both send the
others elsewhere (the runtime refuses with -1, the model falls back to its caching path)."""
import random

import pytest

from memo_ext import _C
from memo_ext.alloc import ArenaPlan, replay
from tests.alloc_traces import trace

ALIGN = 512
KIND = 0


def random_case(seed: int, requests: int = 40):
    """Events, plan and arena size: request sizes in 512-byte multiples (so the model's rounded
    request equals the planned bytes the runtime reserves), offsets inside the arena, some
    drifted so that they overlap a live block, some unplanned (-1)."""
    rng = random.Random(seed)
    arena = 64 * ALIGN
    events, live, sizes, offsets = [], [], [], []
    for k in range(requests):
        while live and rng.random() < 0.4:
            events.append(("free", live.pop(rng.randrange(len(live)))))
        size = rng.randint(1, 8) * ALIGN
        offsets.append(-1 if rng.random() < 0.1 else rng.randrange(0, arena - size + 1, ALIGN))
        sizes.append(size)
        events.append(("alloc", k, size))
        live.append(k)
    return events, sizes, offsets, arena


def runtime_offsets(events, sizes, offsets, arena_bytes) -> list[int]:
    """The runtime's answer per request (offset or -1), one phase holding the whole plan."""
    import numpy as np

    a = _C.PlannedArena(arena_bytes)
    a.add_kind(KIND, np.array(sizes, np.int64), np.array(offsets, np.int64))
    a.begin_phase(KIND)
    served, out = {}, []
    for e in events:
        if e[0] == "alloc":
            off = a.allocate(e[2])
            out.append(off)
            if off >= 0:
                served[e[1]] = off
        elif e[1] in served:
            assert a.release(served.pop(e[1]))
    return out


def model_offsets(events, sizes, offsets, arena_bytes) -> list[int]:
    """The model's answer per request: its planned offset where the model placed it in the
    arena (its "planned" counter rose at that request), else -1. The model reports counts, not
    per-request answers, so each request is read off a replay of the trace up to it."""
    plan = ArenaPlan({k: o for k, o in enumerate(offsets) if o >= 0},
                     dict(enumerate(sizes)), arena_bytes)
    out, placed, k = [], 0, 0
    for row, e in enumerate(events):
        if e[0] != "alloc":
            continue
        prefix = trace(*events[:row + 1])
        sub = ArenaPlan({i: o for i, o in plan.placements.items() if i <= k},
                        {i: s for i, s in plan.sizes.items() if i <= k}, arena_bytes)
        now = replay(prefix, "arena", plan=sub, timelines=False).counters["planned"]
        out.append(offsets[k] if now > placed else -1)
        placed, k = now, k + 1
    return out


@pytest.mark.parametrize("seed", range(6))
def test_runtime_and_model_place_the_same_requests(seed):
    events, sizes, offsets, arena = random_case(seed)
    runtime = runtime_offsets(events, sizes, offsets, arena)
    model = model_offsets(events, sizes, offsets, arena)
    assert runtime == model
    assert 0 < sum(o >= 0 for o in runtime) < len(runtime)  # both outcomes occur


def test_both_refuse_a_range_overlapping_a_live_block():
    # request 1 is planned half over request 0 (still live); request 2 touches it end to end
    events = [("alloc", 0, 2 * ALIGN), ("alloc", 1, 2 * ALIGN), ("alloc", 2, ALIGN)]
    sizes, offsets = [2 * ALIGN, 2 * ALIGN, ALIGN], [0, ALIGN, 2 * ALIGN]
    expected = [0, -1, 2 * ALIGN]
    assert runtime_offsets(events, sizes, offsets, 8 * ALIGN) == expected
    assert model_offsets(events, sizes, offsets, 8 * ALIGN) == expected
