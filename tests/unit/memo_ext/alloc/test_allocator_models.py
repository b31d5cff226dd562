"""Allocator models (memo_ext.alloc.models, C++ memo_ext._C.replay_allocator) on hand-made traces
whose outcome follows from one rule each, a randomized cross-check of the caching model against
a plain Python reference, trace and plan files, and tools/memory_report.py on a trace file."""
import json
import random
import subprocess
import sys

import numpy as np
import pytest

from memo_ext import _C
from memo_ext.alloc import (
    ArenaPlan,
    PlanError,
    Trace,
    TraceError,
    best_fit_plan,
    load_plan,
    load_trace,
    replay,
    replay_policies,
    save_trace,
)
from memo_ext.alloc.models import CONSTANTS
from tests.alloc_traces import trace, training_steps
from tests.conftest import REPO_ROOT

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BASE = CONSTANTS["kSyntheticBase"]  # the first segment a model invents starts here
MEMORY_REPORT = REPO_ROOT / "tools" / "memory_report.py"
SA, SF, SM, SU = _C.SEGMENT_ALLOC, _C.SEGMENT_FREE, _C.SEGMENT_MAP, _C.SEGMENT_UNMAP


def decisions(r) -> list:
    return list(zip(r.decision_kinds.tolist(), r.decision_sizes.tolist()))


def layout(r) -> list:
    """(offset from the first invented segment, bytes, state) of every block at the end."""
    return [(a - BASE, s, st) for a, s, st in r.final_layout.tolist()]


# -------------------------------------------------------------------------- caching allocator


def test_rounding_to_512_bytes():
    r = replay(trace(("alloc", 1, 1), ("alloc", 2, 513), ("alloc", 3, 512)))
    assert r.peak_allocated_bytes == 512 + 1024 + 512
    assert r.peak_requested_bytes == 1 + 513 + 512
    assert decisions(r) == [(SA, 2 * MiB)]  # one small-pool segment holds all three


@pytest.mark.parametrize("request_bytes, segment", [
    (1, 2 * MiB),                  # small pool
    (1 * MiB, 2 * MiB),            # the largest small request
    (1 * MiB + 1, 20 * MiB),       # large pool, < 10 MiB: a 20 MiB segment
    (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB),          # >= 10 MiB: its own size rounded up to 2 MiB
    (11 * MiB + 1, 12 * MiB),
])
def test_pool_choice_and_segment_size(request_bytes, segment):
    r = replay(trace(("alloc", 1, request_bytes)))
    assert decisions(r) == [(SA, segment)]
    assert r.peak_reserved_bytes == segment


def test_best_fit_takes_the_smallest_block_that_fits():
    r = replay(trace(
        ("alloc", 1, 30 * MiB), ("alloc", 2, 24 * MiB), ("alloc", 3, 40 * MiB),
        ("free", 1), ("free", 2), ("free", 3),
        ("alloc", 4, 22 * MiB),
    ), final_layout=True)
    assert r.device_mallocs == 3
    # the 24 MiB segment (second, at offset 30 MiB) is split: 22 MiB taken, 2 MiB left free
    assert (30 * MiB, 22 * MiB, 1) in layout(r) and (52 * MiB, 2 * MiB, 0) in layout(r)


def test_best_fit_tie_goes_to_the_lowest_address():
    r = replay(trace(
        ("alloc", 1, 19 * MiB + 512 * KiB), ("alloc", 2, 19 * MiB + 512 * KiB),
        ("free", 2), ("free", 1), ("alloc", 3, 19 * MiB + 512 * KiB),
    ), final_layout=True)
    assert layout(r) == [(0, 20 * MiB, 1), (20 * MiB, 20 * MiB, 0)]


def test_large_pool_splits_only_when_more_than_1mib_remains():
    # 19 MiB in a 20 MiB segment: 1 MiB would remain, so the block keeps it (no split)
    r = replay(trace(("alloc", 1, 19 * MiB)), final_layout=True)
    assert layout(r) == [(0, 20 * MiB, 1)]
    # 18.5 MiB: 1.5 MiB remains, split off as a free block
    r = replay(trace(("alloc", 1, 18 * MiB + 512 * KiB)), final_layout=True)
    assert layout(r) == [(0, 18 * MiB + 512 * KiB, 1), (18 * MiB + 512 * KiB, 1536 * KiB, 0)]


def test_small_pool_splits_down_to_512_bytes():
    t = trace(("alloc", 1, 1 * MiB), ("alloc", 2, 1 * MiB - 512))
    r = replay(t, final_layout=True)
    assert layout(r) == [(0, 1 * MiB, 1), (1 * MiB, 1 * MiB - 512, 1), (2 * MiB - 512, 512, 0)]
    # the spec's "> 512 B" reading would keep the 512 bytes attached (an option, not the default)
    r = replay(t, small_split_min=1024, final_layout=True)
    assert layout(r) == [(0, 1 * MiB, 1), (1 * MiB, 1 * MiB, 1)]


def test_freed_blocks_merge_with_free_neighbours():
    t = [("alloc", 1, 256 * KiB), ("alloc", 2, 256 * KiB), ("alloc", 3, 256 * KiB),
         ("free", 1), ("free", 3)]
    r = replay(trace(*t), final_layout=True)
    # 1 is free on its own; 3 merged with the free rest of the segment
    assert layout(r) == [(0, 256 * KiB, 0), (256 * KiB, 256 * KiB, 1),
                         (512 * KiB, 2 * MiB - 512 * KiB, 0)]
    r = replay(trace(*t, ("free", 2)), final_layout=True)
    assert layout(r) == [(0, 2 * MiB, 0)]  # one free block spanning the segment again


def test_max_split_size_keeps_big_blocks_whole_and_for_big_requests():
    max_split = 40 * MiB
    r = replay(trace(
        ("alloc", 1, 60 * MiB), ("free", 1),
        ("alloc", 2, 10 * MiB),  # a request below max_split never takes a block above it
        ("alloc", 3, 50 * MiB),  # >= max_split: takes the 60 MiB block (within 20 MiB), unsplit
    ), max_split_size=max_split, final_layout=True)
    assert decisions(r) == [(SA, 60 * MiB), (SA, 10 * MiB)]
    assert (0, 60 * MiB, 1) in layout(r)
    # 70 MiB cached, 45 MiB asked: 25 MiB would be wasted (>= 20 MiB tolerance): new segment
    t = trace(("alloc", 1, 70 * MiB), ("free", 1), ("alloc", 2, 45 * MiB))
    assert decisions(replay(t, max_split_size=max_split)) == [(SA, 70 * MiB), (SA, 46 * MiB)]
    # without max_split_size the cached block is split and reused
    assert decisions(replay(t)) == [(SA, 70 * MiB)]


def test_streams_have_their_own_pools():
    r = replay(trace(
        ("alloc", 1, 5 * MiB, 1), ("free", 1),
        ("alloc", 2, 5 * MiB, 2),  # stream 2 cannot use stream 1's cached block
        ("alloc", 3, 5 * MiB, 1),  # stream 1 can
    ))
    assert decisions(r) == [(SA, 20 * MiB), (SA, 20 * MiB)]


def test_failed_malloc_reorganises_then_succeeds():
    r = replay(trace(
        ("alloc", 1, 5 * MiB, 1), ("free", 1),
        ("alloc", 2, 30 * MiB, 2),  # 20 MiB cached + 30 MiB > 40 MiB: free the cache, retry
    ), capacity_bytes=40 * MiB)
    assert decisions(r) == [(SA, 20 * MiB), (SF, 20 * MiB), (SA, 30 * MiB)]
    assert (r.reorganisations, r.device_mallocs, r.device_frees, r.oom) == (1, 2, 1, None)
    assert r.peak_reserved_bytes == 30 * MiB and r.final_reserved_bytes == 30 * MiB
    assert r.decision_events.tolist() == [0, 2, 2]  # both happened while serving event 2


def test_oom_names_the_failing_request():
    r = replay(trace(
        ("alloc", 1, 30 * MiB),
        ("alloc", 2, 20 * MiB, 7),  # 30 + 20 > 40 even after freeing the (empty) cache
        ("free", 2),  # the program's free of what it never got: not an unmatched free
        ("alloc", 3, 1 * KiB),  # a 2 MiB small segment still fits
        ("oom", 100 * MiB),  # a request the recorded run failed: fails here too
    ), capacity_bytes=40 * MiB)
    assert (r.oom.event_index, r.oom.request_bytes, r.oom.stream, r.oom.count) == (
        1, 20 * MiB, 7, 2)
    assert r.reorganisations == 2 and r.unmatched_frees == 0
    assert r.counters["failed_allocs_reproduced"] == 1
    assert r.peak_allocated_bytes == 30 * MiB + 1 * KiB


def test_empty_cache_releases_unused_segments_without_a_reorganisation():
    r = replay(trace(("alloc", 1, 5 * MiB), ("alloc", 2, 100), ("free", 1), ("empty_cache",)))
    assert decisions(r) == [(SA, 20 * MiB), (SA, 2 * MiB), (SF, 20 * MiB)]
    assert r.reorganisations == 0 and r.final_reserved_bytes == 2 * MiB


def test_unknown_and_duplicate_ids_are_counted():
    r = replay(trace(("free", 99), ("alloc", 1, 512), ("alloc", 1, 512)))
    assert r.unmatched_frees == 1 and r.counters["duplicate_allocs"] == 1
    assert r.final_allocated_bytes == 512


# ------------------------------------------------------------------------- expandable segments


def test_expandable_maps_pages_on_demand():
    r = replay(trace(
        ("alloc", 1, 5 * MiB),   # large pool: one 20 MiB page
        ("alloc", 2, 30 * MiB),  # 15 MiB free at the end + one more 20 MiB page
        ("alloc", 3, 1 * KiB),   # small pool: its own range, 2 MiB pages
    ), "expandable")
    assert decisions(r) == [(SM, 20 * MiB), (SM, 20 * MiB), (SM, 2 * MiB)]
    assert r.peak_reserved_bytes == 42 * MiB and r.device_frees == 0
    assert r.counters["virtual_ranges"] == 2


def test_expandable_unmaps_free_pages_when_memory_runs_out():
    r = replay(trace(
        ("alloc", 1, 50 * MiB, 1), ("free", 1),  # 60 MiB mapped on stream 1, now free
        ("alloc", 2, 30 * MiB, 2),  # stream 2 needs 40 MiB: unmap stream 1's pages, retry
    ), "expandable", capacity_bytes=60 * MiB)
    assert decisions(r) == [(SM, 60 * MiB), (SU, 60 * MiB), (SM, 40 * MiB)]
    assert (r.reorganisations, r.oom) == (1, None)


def test_expandable_unmaps_only_whole_free_pages():
    # id 2 spans [10, 40) MiB of the range; freeing id 1 leaves [0, 10) MiB free: no whole page
    r = replay(trace(
        ("alloc", 1, 10 * MiB, 1), ("alloc", 2, 30 * MiB, 1), ("free", 1),
        ("alloc", 3, 5 * MiB, 2),  # a 20 MiB page for stream 2 does not fit in 40 MiB
    ), "expandable", capacity_bytes=40 * MiB, final_layout=True)
    assert decisions(r) == [(SM, 20 * MiB), (SM, 20 * MiB)]  # nothing could be unmapped
    assert (r.reorganisations, r.oom.event_index) == (1, 3)
    # freeing id 2 too frees [0, 40) MiB: both pages go, the emptied range is released
    r = replay(trace(
        ("alloc", 1, 10 * MiB, 1), ("alloc", 2, 30 * MiB, 1), ("free", 1), ("free", 2),
        ("alloc", 3, 5 * MiB, 2),
    ), "expandable", capacity_bytes=40 * MiB)
    assert decisions(r)[2:] == [(SU, 40 * MiB), (SM, 20 * MiB)]
    assert r.oom is None and r.counters["released_ranges"] == 1


def test_expandable_partial_page_free_keeps_the_mapped_remainder():
    r = replay(trace(
        ("alloc", 1, 25 * MiB), ("alloc", 2, 10 * MiB), ("free", 1), ("empty_cache",),
    ), "expandable", final_layout=True)
    # [0, 25) MiB free: the page [0, 20) is unmapped, [20, 25) stays mapped and free
    kinds = decisions(r)
    assert kinds == [(SM, 40 * MiB), (SU, 20 * MiB)]
    states = [(s, st) for _, s, st in r.final_layout.tolist()]
    assert states[:4] == [(20 * MiB, 2), (5 * MiB, 0), (10 * MiB, 1), (5 * MiB, 0)]


# ---------------------------------------------------------------------------- GMLake stitching


def test_stitching_sends_small_requests_to_the_normal_path():
    r = replay(trace(("alloc", 1, 1 * MiB), ("alloc", 2, 1536 * KiB)), "stitching")
    assert r.counters["new_pblocks"] == 0 and r.counters["normal_path_segments"] == 2
    assert decisions(r) == [(SA, 2 * MiB), (SA, 20 * MiB)]


def test_stitching_rounds_to_2mib_chunks_and_reuses_exact_sizes():
    r = replay(trace(("alloc", 1, 3 * MiB), ("free", 1), ("alloc", 2, 4 * MiB)), "stitching",
               frag_limit=2 * MiB)
    assert decisions(r) == [(SA, 4 * MiB)] and r.counters["exact_hits"] == 1


def test_stitching_converges_to_exact_reuse_after_warm_up():
    one = replay(training_steps(1), "stitching", frag_limit=4 * MiB)
    # step 1: 20 MiB new; 8 MiB splits it (S2, 8 + 12 stitched back as 20); 12 MiB exact;
    # 6 MiB new; 26 MiB stitches 12 + 8 + 6 (S3)
    assert one.counters["new_pblocks"] == 2 and one.counters["splits"] == 1
    assert one.counters["stitches"] == 2 and one.counters["exact_hits"] == 1
    five = replay(training_steps(5), "stitching", frag_limit=4 * MiB)
    # later steps allocate nothing new: every request is an exact match (5 per step)
    assert five.device_mallocs == one.device_mallocs == 2
    assert five.peak_reserved_bytes == one.peak_reserved_bytes == 26 * MiB
    assert five.counters["exact_hits"] - one.counters["exact_hits"] == 4 * 5
    assert five.counters["stitches"] == one.counters["stitches"]
    # the caching allocator needs more for the same pattern (segments cannot be combined)
    assert replay(training_steps(5), "caching").peak_reserved_bytes > 26 * MiB


def test_stitching_tops_up_with_a_new_block():
    r = replay(trace(("alloc", 1, 8 * MiB), ("free", 1), ("alloc", 2, 14 * MiB)),
               "stitching", frag_limit=4 * MiB)
    assert decisions(r) == [(SA, 8 * MiB), (SA, 6 * MiB)]  # S4: 8 MiB + a new 6 MiB, stitched
    assert r.counters["stitches"] == 1 and r.peak_reserved_bytes == 14 * MiB


def test_stitching_below_the_fragmentation_limit_takes_the_normal_path():
    t = trace(("alloc", 1, 8 * MiB), ("free", 1), ("alloc", 2, 6 * MiB))
    r = replay(t, "stitching")  # default limit 128 MiB: the caching rules (a 20 MiB segment)
    assert decisions(r) == decisions(replay(t, "caching")) == [(SA, 20 * MiB)]
    assert r.counters["new_pblocks"] == 0 and r.counters["normal_path_segments"] == 1
    r = replay(t, "stitching", frag_limit=8 * MiB)  # 8 MiB in the pools; 6 MiB normal path
    assert decisions(r) == [(SA, 8 * MiB), (SA, 20 * MiB)] and r.counters["splits"] == 0


def test_stitching_reorganises_when_physical_memory_runs_out():
    r = replay(trace(("alloc", 1, 20 * MiB, 0), ("free", 1), ("alloc", 2, 24 * MiB, 1)),
               "stitching", capacity_bytes=30 * MiB, frag_limit=4 * MiB)
    assert decisions(r) == [(SA, 20 * MiB), (SF, 20 * MiB), (SA, 24 * MiB)]
    assert r.reorganisations == 1 and r.oom is None


# ------------------------------------------------------------------------------ planned arena

ARENA_TRACE = [("alloc", 1, 1 * MiB), ("alloc", 2, 1 * MiB), ("free", 1), ("alloc", 3, 1 * MiB)]


def test_arena_places_requests_at_planned_offsets():
    plan = ArenaPlan({0: 0, 1: 1 * MiB, 2: 0})
    r = replay(trace(*ARENA_TRACE), "arena", plan=plan)
    assert r.peak_reserved_bytes == 2 * MiB  # the arena: max offset + size
    assert (r.counters["planned"], r.counters["fallbacks"], r.counters["unplanned"]) == (3, 0, 0)
    assert r.device_mallocs == 1 and r.fragmentation == 0.0


@pytest.mark.parametrize("plan, why", [
    (ArenaPlan({0: 0, 1: 1 * MiB, 2: 1 * MiB + 512}, arena_bytes=3 * MiB), "overlaps live 2"),
    (ArenaPlan({0: 0, 1: 1 * MiB, 2: 0}, sizes={2: 512 * KiB}), "larger than planned"),
    (ArenaPlan({0: 0, 1: 1 * MiB, 2: 2 * MiB}, arena_bytes=2 * MiB), "beyond the arena"),
])
def test_arena_mismatch_falls_back_to_the_caching_path(plan, why):
    r = replay(trace(*ARENA_TRACE), "arena", plan=plan)
    assert r.counters["fallbacks"] == 1, why
    assert decisions(r)[1:] == [(SA, 2 * MiB)]  # the fallback's own segment
    assert r.oom is None


def test_arena_unplanned_requests_take_the_caching_path():
    r = replay(trace(*ARENA_TRACE), "arena", plan=ArenaPlan({0: 0, 1: 1 * MiB}))
    assert (r.counters["planned"], r.counters["unplanned"]) == (2, 1)


def test_best_fit_plan_reuses_freed_space():
    plan = best_fit_plan(trace(*ARENA_TRACE))
    assert plan.placements == {0: 0, 1: 1 * MiB, 2: 0} and plan.arena_bytes == 2 * MiB
    r = replay(trace(*ARENA_TRACE), "arena")  # no plan: the best-fit plan of the trace
    assert r.peak_reserved_bytes == 2 * MiB and r.counters["fallbacks"] == 0


def test_plan_files(tmp_path):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps([{"request": 0, "offset": 0}, {"request": 2, "offset": 0,
                                                           "size": 1 * MiB}]))
    assert load_plan(f).placements == {0: 0, 2: 0} and load_plan(f).sizes == {2: 1 * MiB}
    f.write_text(json.dumps({"arena_bytes": 4096, "placements": [{"request": 1, "offset": 512}]}))
    assert load_plan(f).arena_bytes == 4096
    for bad in ("{not json", json.dumps([{"request": 0}]), json.dumps({"placements": 3}),
                json.dumps([{"request": -1, "offset": 0}])):
        f.write_text(bad)
        with pytest.raises(PlanError, match="plan.json"):
            load_plan(f)
    with pytest.raises(PlanError, match="request 7 does not exist"):
        replay(trace(*ARENA_TRACE), "arena", plan=ArenaPlan({7: 0}))


# -------------------------------------------------------------- all policies, errors, speed


def test_every_policy_reports_the_same_allocated_bytes():
    t = training_steps(3)
    results = replay_policies(t, capacity_bytes=1 * GiB)
    assert [r.policy for r in results] == ["caching", "expandable", "stitching", "arena"]
    assert len({r.peak_allocated_bytes for r in results}) == 1
    for r in results:
        assert r.peak_reserved_bytes >= r.peak_allocated_bytes
        assert r.fragmentation == pytest.approx(1 - r.peak_allocated_bytes / r.peak_reserved_bytes)
        assert np.all(r.allocated_timeline <= r.reserved_timeline)
        assert r.reserved_timeline.max() == r.peak_reserved_bytes


def test_bad_inputs_raise_value_error():
    t = trace(("alloc", 1, 512))
    with pytest.raises(ValueError, match="unknown policy"):
        replay(t, "buddy")
    with pytest.raises(ValueError, match="capacity"):
        replay(t, capacity_bytes=-1)
    with pytest.raises(ValueError, match="not an action code"):
        replay(Trace([42], [1], [1], [0]))
    with pytest.raises(ValueError, match="negative"):
        replay(Trace([0], [1], [-5], [0]))
    with pytest.raises(TraceError, match="equal length"):
        Trace([0, 1], [1], [1], [0])


# -------------------------------------------------- randomized check against a Python reference


class ReferenceCaching:
    """The caching rules written as plainly as possible (lists, linear scans)."""

    def __init__(self, capacity):
        self.capacity, self.reserved, self.next = capacity, 0, BASE
        self.blocks = []  # [addr, size, stream, small, allocated, segment]
        self.live, self.log = {}, []

    def _segment(self, size, stream, small):
        if self.capacity and self.reserved + size > self.capacity:
            return None
        b = [self.next, size, stream, small, False, self.next]
        self.next += -(-size // (2 * MiB)) * 2 * MiB
        self.reserved += size
        self.log.append((SA, size, b[0]))
        self.blocks.append(b)
        return b

    def malloc(self, i, req, stream):
        size = max(512, -(-req // 512) * 512)
        small = size <= MiB
        fits = [b for b in self.blocks if not b[4] and b[3] == small and b[2] == stream
                and b[1] >= size]
        b = min(fits, key=lambda b: (b[1], b[0])) if fits else None
        if b is None:
            seg = 2 * MiB if small else 20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB
            b = self._segment(seg, stream, small)
            if b is None:
                self.release()
                b = self._segment(seg, stream, small)
                if b is None:
                    return False
        rest = b[1] - size
        if (small and rest >= 512) or (not small and rest > MiB):
            self.blocks.append([b[0] + size, rest, stream, small, False, b[5]])
            b[1] = size
        b[4] = True
        self.live[i] = b
        return True

    def _neighbours(self, b):
        same = sorted((x for x in self.blocks if x[5] == b[5]), key=lambda x: x[0])
        k = same.index(b)
        return (same[k - 1] if k else None), (same[k + 1] if k + 1 < len(same) else None)

    def free(self, i):
        b = self.live.pop(i)
        b[4] = False
        prev, nxt = self._neighbours(b)
        for n in (nxt, prev):
            if n is not None and not n[4]:
                b[0], b[1] = min(b[0], n[0]), b[1] + n[1]
                self.blocks.remove(n)

    def release(self):
        for small in (False, True):
            whole = [b for b in self.blocks if not b[4] and b[3] == small and b[0] == b[5]
                     and self._neighbours(b) == (None, None)]
            for b in sorted(whole, key=lambda b: (b[2], b[1], b[0])):
                self.blocks.remove(b)
                self.reserved -= b[1]
                self.log.append((SF, b[1], b[0]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_caching_model_agrees_with_a_plain_reference(seed):
    rng = random.Random(seed)
    events, live, next_id = [], [], 0
    for _ in range(1500):
        if live and rng.random() < 0.45:
            events.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            kind = rng.random()
            size = (rng.randint(1, MiB) if kind < 0.5 else rng.randint(MiB, 12 * MiB)
                    if kind < 0.85 else rng.randint(12 * MiB, 64 * MiB))
            events.append(("alloc", next_id, size, rng.choice([0, 0, 5])))
            live.append(next_id)
            next_id += 1
    t = trace(*events)
    capacity = 600 * MiB
    r = replay(t, "caching", capacity, final_layout=True)
    ref, failed = ReferenceCaching(capacity), set()
    for e in events:
        if e[0] == "alloc":
            if not ref.malloc(e[1], e[2], e[3]):
                failed.add(e[1])
        elif e[1] not in failed:
            ref.free(e[1])
    got = list(zip(r.decision_kinds.tolist(), r.decision_sizes.tolist(),
                   r.decision_addrs.tolist()))
    assert got == ref.log
    assert r.reorganisations > 0  # the capacity was tight enough to matter
    want = sorted((b[0], b[1], int(b[4])) for b in ref.blocks)
    assert [tuple(x) for x in r.final_layout.tolist()] == want
    assert (r.oom.count if r.oom else 0) == len(failed)


# ------------------------------------------------------------------------- trace files, report


def _sample() -> Trace:
    return trace(("alloc", 1, 5 * MiB), ("alloc", 2, 100, 3), ("free", 1), ("empty_cache",),
                 ("oom", 64 * GiB))


@pytest.mark.parametrize("suffix", [".npz", ".jsonl"])
def test_trace_file_round_trip(tmp_path, suffix):
    path = tmp_path / f"t{suffix}"
    save_trace(_sample(), path)
    back = load_trace(path)
    for a, b in zip((back.actions, back.ids, back.sizes, back.streams),
                    (_sample().actions, _sample().ids, _sample().sizes, _sample().streams)):
        assert a.tolist() == b.tolist()
    assert replay(back).peak_reserved_bytes == replay(_sample()).peak_reserved_bytes


def test_jsonl_trace_accepts_names_defaults_and_comments(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('# made by hand\n{"action": "alloc", "addr": 7, "size": 1000}\n\n'
                    '{"action": "free_requested", "addr": 7}\n{"action": "free", "addr": 7}\n')
    t = load_trace(path)
    assert t.actions.tolist() == [_C.ALLOC, _C.OTHER, _C.FREE] and t.streams.tolist() == [0] * 3


@pytest.mark.parametrize("content, message", [
    (b'{"action": "alloc", "addr": 1, "size": 8}\n{"action": "alloc", "addr": 2}\n',
     r"t.jsonl:2: an 'alloc' event needs a 'size'"),
    (b'{"action": "alloc", "addr": 1, "size": 8}\nnot json\n', r"t.jsonl:2: not JSON"),
    (b'{"action": "teleport", "addr": 1, "size": 8}\n', r"t.jsonl:1: unknown action 'teleport'"),
    (b'{"action": "alloc", "addr": "x", "size": 8}\n', r"must be integers"),
    (b'{"action": "alloc", "addr": 1, "size": 99999999999999999999999}\n', r"64 bits"),
    (b'{"action": "alloc", "addr": 1, "size": -8}\n', r"negative size"),
    (b"\xff\xfe garbage \x00", r"neither .npz nor UTF-8"),
    (b"PK\x03\x04 truncated zip", r"not a readable .npz trace"),
])
def test_malformed_trace_files_raise_one_line_errors(tmp_path, content, message):
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert "\n" not in str(info.value)


def test_npz_trace_refuses_pickled_objects_and_missing_columns(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, action=np.array([object()], dtype=object), addr=[1], size=[1])
    with pytest.raises(TraceError, match="not a readable .npz trace"):
        load_trace(path)
    np.savez(path, action=[0], addr=[1])
    with pytest.raises(TraceError, match="missing array"):
        load_trace(path)
    np.savez(path, action=np.array(["alloc", "free"]), addr=[1, 1], size=[512, 0])
    assert load_trace(path).actions.tolist() == [_C.ALLOC, _C.FREE]


def run_report(*args):
    return subprocess.run([sys.executable, str(MEMORY_REPORT), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_report_on_a_trace_file(tmp_path):
    path = tmp_path / "iters.jsonl"
    save_trace(training_steps(4), path)
    png = tmp_path / "timeline.png"
    proc = run_report(path, "--capacity-gb", "1", "--policies", "caching,stitching", "--plot", png)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("trace iters.jsonl: 40 events, 20 allocations, 1 stream(s)")
    assert "### policy caching (capacity 1.00 GiB)" in out
    assert "### policy stitching (capacity 1.00 GiB)" in out and "arena" not in out
    for p in (png, tmp_path / "timeline_caching.png", tmp_path / "timeline_stitching.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--compare-recorded"], "needs a memory snapshot"),
    (["--policies", "caching,buddy"], "unknown policy 'buddy'"),
    (["--capacity-gb", "-3"], "must be positive"),
    (["--device", "2"], "no device 2"),
])
def test_report_refuses_bad_options_with_one_line(tmp_path, args, message):
    path = tmp_path / "t.jsonl"
    save_trace(_sample(), path)
    proc = run_report(path, *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and message in proc.stderr


def test_report_malformed_trace_exits_2(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"action": "alloc", "addr": 1}\n')
    proc = run_report(path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "t.jsonl:1" in proc.stderr


def test_reads_the_planner_tracers_gzipped_files(tmp_path):
    """memo_ext.planner's tools/trace.py writes a header, then events keyed id/bytes/pool."""
    import gzip

    lines = [
        {"format": "memo-alloc-trace", "version": 1, "model": "7b"},
        {"id": 0, "action": "alloc", "bytes": 3 * MiB, "stream": 0, "pool": "device",
         "layer": None, "phase": "init", "category": "parameter"},
        {"id": 1, "action": "alloc", "bytes": 64 * MiB, "stream": 0, "pool": "host"},
        {"id": 2, "action": "alloc", "bytes": 100, "stream": 0, "pool": "device"},
        {"id": 2, "action": "free", "bytes": 100, "stream": 0, "pool": "device"},
    ]
    path = tmp_path / "rank0.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode()))
    t = load_trace(path)
    assert t.actions.tolist() == [_C.ALLOC, _C.ALLOC, _C.FREE]  # header and host event left out
    assert t.ids.tolist() == [0, 2, 2] and t.sizes.tolist() == [3 * MiB, 100, 100]
    proc = run_report(path, "--policies", "caching")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("trace rank0.jsonl.gz: 3 events, 2 allocations")
    path.write_bytes(b"\x1f\x8b\x08\x00 broken gzip")
    with pytest.raises(TraceError, match="not a readable gzipped trace"):
        load_trace(path)
