"""compare_recorded and `memory_report.py --compare-recorded`: the allocator models replaying real
snapshots must make the segment decisions the recording allocator made.

Real snapshots come from shared/data/snapshots beside the repository (see its README); tests
that need them skip where that folder is absent. The hand-made snapshots at the top run
everywhere. Expected counts were read off the files (docs/allocator_models.md "Match table").
"""
import functools

import pytest

from tests.conftest import run_memory_report, snapshot_path
from memo_ext.alloc import (
    compare_recorded,
    infer_capacity,
    load_snapshot,
    reconstruct_initial_state,
    summarize_snapshot,
)

KiB, MiB = 1 << 10, 1 << 20

# file -> {device: recorded segment decisions N}; single-stream files must match all of them
RECORDED = {
    "hf_deepseek_coder_1p3b_train_step.pickle": {0: 152},
    "hf_qwen3_train_expandable_oom.pickle": {0: 175, 1: 46, 2: 78},
    "llama_infer_multistream.pickle": {0: 1163},
    "transformer_medium_ctx512_train_warm.pickle": {0: 1},
    "transformer_small_from_empty.pickle": {0: 9},
}
# multi-stream, multi-device or expandable: the issue asks for >= 95%
AT_LEAST_95 = {"hf_qwen3_train_expandable_oom.pickle", "llama_infer_multistream.pickle"}
CACHING = sorted(set(RECORDED) - {"hf_qwen3_train_expandable_oom.pickle"})


@functools.lru_cache(maxsize=None)
def loaded(name: str) -> dict:
    return load_snapshot(snapshot_path(name))


@functools.lru_cache(maxsize=None)
def compared(name: str) -> dict:
    return {c.device: c for c in compare_recorded(loaded(name))}




# ---------------------------------------------------------------------- hand-made snapshots


def _block(addr, size, requested, state="active_allocated"):
    return {"address": addr, "size": size, "requested_size": requested, "state": state}


def _snapshot(trace, segments):
    return {"segments": segments, "device_traces": [trace]}


A, B, C = 0x10000000, 0x20000000, 0x30000000


def test_reorganisation_is_a_decision_and_the_capacity_is_inferred():
    trace = [
        {"action": "segment_alloc", "addr": A, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": A, "size": 5 * MiB, "stream": 0},
        {"action": "free_requested", "addr": A, "size": 5 * MiB, "stream": 0},
        {"action": "free_completed", "addr": A, "size": 5 * MiB, "stream": 0},
        # a 30 MiB request fails, the cache is freed, the retry succeeds
        {"action": "segment_free", "addr": A, "size": 20 * MiB, "stream": 0},
        {"action": "segment_alloc", "addr": B, "size": 30 * MiB, "stream": 0},
        {"action": "alloc", "addr": B, "size": 30 * MiB, "stream": 0},
    ]
    segments = [{"device": 0, "address": B, "total_size": 30 * MiB, "stream": 0,
                 "segment_type": "large", "blocks": [_block(B, 30 * MiB, 30 * MiB)]}]
    snap = _snapshot(trace, segments)
    # reached 30 MiB; failed at 20 + 30 MiB: the middle, 40 MiB
    assert infer_capacity(snap, 0)[0] == 40 * MiB
    (c,) = compare_recorded(snap)
    assert (c.matched, c.recorded, c.model_only, c.empty_cache_inputs) == (3, 3, 0, 0)
    assert c.capacity_bytes == 40 * MiB and c.result.reorganisations == 1
    # the same trace on an unlimited device never frees the segment: 2 of 3 decisions
    (c,) = compare_recorded(snap, capacity_bytes=1 << 40)
    assert (c.matched, c.recorded, c.model_only) == (2, 3, 0)
    assert [(m.event_index, m.recorded, m.model) for m in c.mismatches] == [
        (6, (("segment_free", 20 * MiB), ("segment_alloc", 30 * MiB)),
         (("segment_alloc", 30 * MiB),))]


def test_empty_cache_releases_are_inputs_not_decisions():
    small = [_block(C, 1024, 1000), _block(C + 1024, 1024, 1000),
             _block(C + 2048, 2 * MiB - 2048, 0, "inactive")]
    trace = [
        {"action": "segment_alloc", "addr": C, "size": 2 * MiB, "stream": 0},
        {"action": "alloc", "addr": C, "size": 1000, "stream": 0},
        {"action": "segment_alloc", "addr": A, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": A, "size": 5 * MiB, "stream": 0},
        {"action": "free_completed", "addr": A, "size": 5 * MiB, "stream": 0},
        {"action": "segment_free", "addr": A, "size": 20 * MiB, "stream": 0,
         "frames": [{"name": "c10::cuda::CUDACachingAllocator::emptyCache()"}]},
        {"action": "segment_alloc", "addr": B, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": B, "size": 5 * MiB, "stream": 0},
        {"action": "free_completed", "addr": B, "size": 5 * MiB, "stream": 0},
        # no frames, but no allocation was failing (an alloc follows, not a retried malloc)
        {"action": "segment_free", "addr": B, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": C + 1024, "size": 1000, "stream": 0},
    ]
    segments = [{"device": 0, "address": C, "total_size": 2 * MiB, "stream": 0,
                 "segment_type": "small", "blocks": small}]
    (c,) = compare_recorded(_snapshot(trace, segments))
    assert (c.matched, c.recorded, c.model_only, c.empty_cache_inputs) == (3, 3, 0, 2)
    assert c.capacity_bytes is None  # nothing ever failed: unlimited
    assert c.result.reorganisations == 0 and c.result.device_frees == 2


def test_mismatches_name_the_request_and_both_decisions():
    trace = [  # a recording that took a 40 MiB segment for a 5 MiB request (the model: 20 MiB)
        {"action": "segment_alloc", "addr": A, "size": 40 * MiB, "stream": 0},
        {"action": "alloc", "addr": A, "size": 5 * MiB, "stream": 0},
    ]
    segments = [{"device": 0, "address": A, "total_size": 40 * MiB, "stream": 0,
                 "segment_type": "large",
                 "blocks": [_block(A, 5 * MiB, 5 * MiB),
                            _block(A + 5 * MiB, 35 * MiB, 0, "inactive")]}]
    (c,) = compare_recorded(_snapshot(trace, segments))
    assert (c.matched, c.recorded, c.model_only) == (0, 1, 1)
    (m,) = c.mismatches
    assert m.event_index == 1
    assert m.recorded == (("segment_alloc", 40 * MiB),) and m.model == (("segment_alloc",
                                                                         20 * MiB),)


def test_blocks_from_before_the_trace_are_rebuilt_with_their_unsplit_tails():
    # a 64 MiB segment from before the trace: X (4 MiB requested) was live, then freed; while X
    # was live an 8 MiB alloc landed 0.5 MiB past X's rounded end: X kept a 0.5 MiB tail
    x = A + 20 * MiB
    trace = [
        {"action": "alloc", "addr": x + 4 * MiB + 512 * KiB, "size": 8 * MiB, "stream": 0},
        {"action": "free_completed", "addr": x, "size": 4 * MiB, "stream": 0},
    ]
    segments = [{"device": 0, "address": A, "total_size": 64 * MiB, "stream": 0,
                 "segment_type": "large",
                 "blocks": [_block(A, 20 * MiB, 20 * MiB),  # live all along
                            _block(x, 4 * MiB + 512 * KiB, 0, "inactive"),
                            _block(x + 4 * MiB + 512 * KiB, 8 * MiB, 8 * MiB),
                            _block(x + 12 * MiB + 512 * KiB, 31 * MiB + 512 * KiB, 0,
                                   "inactive")]}]
    snap = _snapshot(trace, segments)
    state = reconstruct_initial_state(snap, 0)
    assert state.segments == [(A, 64 * MiB, 0, False)]
    assert state.blocks == [(0, A, 20 * MiB, 20 * MiB, 0),
                            (0, x, 4 * MiB + 512 * KiB, 4 * MiB, 0)]
    assert state.inferred_tails == 1
    (c,) = compare_recorded(snap)
    got = [tuple(r) for r in c.result.final_layout.tolist()]
    assert got == [(b["address"], b["size"], int(b["state"] != "inactive"))
                   for b in segments[0]["blocks"]]


# ------------------------------------------------------------------------ the real snapshots


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_segment_decisions_are_reproduced(name):
    by_device = compared(name)
    assert {d: c.recorded for d, c in by_device.items()} == RECORDED[name]
    for c in by_device.values():
        assert c.recorded > 0  # every file has segment events on every traced device
        if name in AT_LEAST_95:
            assert c.matched >= 0.95 * c.recorded and c.model_only <= 0.05 * c.recorded
        else:
            assert c.matched == c.recorded and c.model_only == 0, c.mismatches[:5]


@pytest.mark.parametrize("name", CACHING)
def test_final_state_equals_the_recorded_segments_block_for_block(name):
    snap = loaded(name)
    (c,) = compared(name).values()
    recorded = sorted((b["address"], b["size"], int(b["state"] != "inactive"))
                      for s in snap["segments"] for b in s["blocks"])
    assert [tuple(r) for r in c.result.final_layout.tolist()] == recorded


def test_expandable_final_state_equals_the_recorded_segments():
    """Per virtual range (one per pool here), every mapped block's offset from the range's first
    mapped byte, size and state. The snapshot lists a range as pieces between unmapped holes;
    the model's layout has the holes as unmapped blocks (state 2) and invented addresses."""
    snap = loaded("hf_qwen3_train_expandable_oom.pickle")
    for d, c in compared("hf_qwen3_train_expandable_oom.pickle").items():
        pools = {}
        for s in snap["segments"]:
            if s["device"] == d:
                pools.setdefault(s["segment_type"], []).extend(
                    (b["address"], b["size"], int(b["state"] != "inactive")) for b in s["blocks"])
        recorded = sorted(tuple((a - min(rows)[0], s, st) for a, s, st in sorted(rows))
                          for rows in pools.values())
        ranges, cur = [], []
        for a, s, st in c.result.final_layout.tolist():
            if cur and a != cur[-1][0] + cur[-1][1]:  # ranges are contiguous, far apart
                ranges.append(cur)
                cur = []
            cur.append((a, s, st))
        ranges.append(cur)
        model = []
        for blocks in ranges:
            mapped = [b for b in blocks if b[2] != 2]
            model.append(tuple((a - mapped[0][0], s, st) for a, s, st in mapped))
        assert sorted(model) == recorded, d


def test_initial_state_matches_the_snapshot_summary():
    for name in RECORDED:
        snap = loaded(name)
        for s in summarize_snapshot(snap):
            assert reconstruct_initial_state(snap, s.device).reserved_bytes == \
                s.initial_reserved_bytes, (name, s.device)
    state = reconstruct_initial_state(loaded("hf_deepseek_coder_1p3b_train_step.pickle"), 0)
    assert len(state.segments) == 63  # the README: 63 segments existed before recording
    state = reconstruct_initial_state(loaded("transformer_medium_ctx512_train_warm.pickle"), 0)
    assert state.inferred_tails == 3  # blocks that kept < 1 MiB past their rounded size


def test_capacity_inference():
    llama = compared("llama_infer_multistream.pickle")[0]
    # largest reserved total reached 22519218176 B; the smallest failed malloc would have made
    # 22556966912 B: the model runs midway
    assert llama.capacity_bytes == (22519218176 + 22556966912) // 2
    assert llama.result.reorganisations == 39  # one per recorded release run
    qwen = compared("hf_qwen3_train_expandable_oom.pickle")
    assert qwen[1].capacity_bytes == 84202749952 + 95682560  # reserved + device_free at the oom
    assert (qwen[1].recorded_ooms, qwen[1].reproduced_ooms) == (1, 1)
    assert qwen[0].capacity_bytes is None and qwen[2].capacity_bytes is None


def test_the_comparison_is_sensitive_to_the_model():
    """Controls: a wrong capacity or the wrong page size loses most decisions."""
    snap = loaded("llama_infer_multistream.pickle")
    (unlimited,) = compare_recorded(snap, capacity_bytes=1 << 45)
    assert unlimited.matched < 0.1 * unlimited.recorded  # no reorganisations, no frees
    (small,) = compare_recorded(snap, capacity_bytes=20 << 30)
    assert small.matched < 0.6 * small.recorded and small.model_only > 0
    qwen = compare_recorded(loaded("hf_qwen3_train_expandable_oom.pickle"), large_page=2 * MiB)
    assert sum(c.matched for c in qwen) < 0.1 * sum(c.recorded for c in qwen)


@pytest.mark.parametrize("name, line", [
    ("transformer_small_from_empty.pickle", "recorded segment decisions matched: 9/9"),
    ("hf_qwen3_train_expandable_oom.pickle", "recorded segment decisions matched: 299/299"),
    ("llama_infer_multistream.pickle", "recorded segment decisions matched: 1163/1163"),
])
def test_report_prints_exactly_one_match_line(name, line):
    proc = run_memory_report(snapshot_path(name), "--compare-recorded", "--policies", "caching")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [x for x in lines if x.startswith("recorded segment decisions matched")] == [line]
    assert lines[0].startswith("| device | events |")  # the recorded table still comes first
