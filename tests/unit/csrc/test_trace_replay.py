"""Tests of the C++ trace replay memo_ext._C.replay_live_bytes on synthetic traces."""
import numpy as np
import pytest

from memo_ext import _C

A, F, O = _C.ALLOC, _C.FREE, _C.OTHER
SA, SF, SM, SU = _C.SEGMENT_ALLOC, _C.SEGMENT_FREE, _C.SEGMENT_MAP, _C.SEGMENT_UNMAP


def arrays(events):
    """(action, addr, size) triples -> three int64 arrays."""
    cols = np.array(events, dtype=np.int64).reshape(-1, 3)
    return cols[:, 0].copy(), cols[:, 1].copy(), cols[:, 2].copy()


def python_replay(actions, addrs, sizes, live0, reserved0):
    """Reference: the replay written as plainly as possible."""
    live, allocated, reserved = {}, live0, reserved0
    out = {"allocated": [], "reserved": [], "peak_allocated": live0, "peak_reserved": reserved0,
           "peak_allocated_index": -1, "num_allocs": 0, "num_frees": 0, "num_unmatched_frees": 0,
           "num_segment_allocs": 0, "num_segment_frees": 0, "num_segment_maps": 0,
           "num_segment_unmaps": 0}
    for i, (act, addr, size) in enumerate(zip(actions.tolist(), addrs.tolist(), sizes.tolist())):
        if act == A:
            out["num_allocs"] += 1
            live[addr] = size
            allocated += size
        elif act == F:
            out["num_frees"] += 1
            if addr in live:
                allocated -= live.pop(addr)
            else:
                out["num_unmatched_frees"] += 1
                allocated -= size
        elif act in (SA, SM):
            out["num_segment_allocs" if act == SA else "num_segment_maps"] += 1
            reserved += size
        elif act in (SF, SU):
            out["num_segment_frees" if act == SF else "num_segment_unmaps"] += 1
            reserved -= size
        out["allocated"].append(allocated)
        out["reserved"].append(reserved)
        if allocated > out["peak_allocated"]:
            out["peak_allocated"], out["peak_allocated_index"] = allocated, i
        out["peak_reserved"] = max(out["peak_reserved"], reserved)
    out["final_allocated"], out["final_reserved"] = allocated, reserved
    return out


def test_action_codes():
    assert (A, F, SA, SF, SM, SU, O) == (0, 1, 2, 3, 4, 5, 6)


def test_known_trace():
    events = [
        (SA, 0x9000, 4096),
        (A, 0x1, 512),
        (A, 0x2, 1024),
        (F, 0x1, 0),  # matched: subtracts the recorded 512, not the event's size
        (F, 0x99, 50),  # allocated before the trace: subtracts the event's size
        (O, 0, 123),  # e.g. free_requested or oom: moves nothing
        (SM, 0xA000, 2048),
        (SU, 0xA000, 2048),
        (SF, 0x9000, 4096),
    ]
    r = _C.replay_live_bytes(*arrays(events), 100, 1000)
    assert r["allocated"].dtype == np.int64
    assert r["allocated"].tolist() == [100, 612, 1636, 1124, 1074, 1074, 1074, 1074, 1074]
    assert r["reserved"].tolist() == [5096, 5096, 5096, 5096, 5096, 5096, 7144, 5096, 1000]
    assert (r["peak_allocated"], r["peak_allocated_index"], r["peak_reserved"]) == (1636, 2, 7144)
    assert (r["final_allocated"], r["final_reserved"]) == (1074, 1000)
    counts = [r[k] for k in ("num_allocs", "num_frees", "num_unmatched_frees", "num_segment_allocs",
                             "num_segment_frees", "num_segment_maps", "num_segment_unmaps")]
    assert counts == [2, 2, 1, 1, 1, 1, 1]


def test_realloc_at_same_address_and_initial_peak():
    events = [(F, 0x1, 700), (A, 0x1, 300), (F, 0x1, 999), (A, 0x1, 200)]
    r = _C.replay_live_bytes(*arrays(events), initial_live_bytes=1000)
    assert r["allocated"].tolist() == [300, 600, 300, 500]
    # nothing rose above the 1000 bytes live before the trace
    assert (r["peak_allocated"], r["peak_allocated_index"]) == (1000, -1)
    assert r["num_unmatched_frees"] == 1


def test_empty_trace():
    empty = np.zeros(0, dtype=np.int64)
    r = _C.replay_live_bytes(empty, empty, empty, 7, 9)
    assert r["allocated"].shape == (0,) and r["reserved"].shape == (0,)
    assert (r["peak_allocated"], r["peak_reserved"], r["peak_allocated_index"]) == (7, 9, -1)
    assert (r["final_allocated"], r["final_reserved"]) == (7, 9)


def test_length_mismatch_raises_value_error():
    actions, addrs, sizes = arrays([(A, 1, 8), (F, 1, 8)])
    with pytest.raises(ValueError, match="same length"):
        _C.replay_live_bytes(actions, addrs[:1], sizes, 0, 0)
    with pytest.raises(ValueError, match="same length"):
        _C.replay_live_bytes(actions, addrs, sizes[:1], 0, 0)


@pytest.mark.parametrize(
    "events, initial, message",
    [
        ([(7, 1, 8)], 0, "not an action code"),
        ([(A, 1, -8)], 0, "negative"),
        ([(A, 1, 8)], -1, ">= 0"),
    ],
)
def test_invalid_input_raises_value_error(events, initial, message):
    with pytest.raises(ValueError, match=message):
        _C.replay_live_bytes(*arrays(events), initial, 0)


def test_two_dimensional_input_raises_value_error():
    grid = np.zeros((2, 2), dtype=np.int64)
    with pytest.raises(ValueError, match="1-D"):
        _C.replay_live_bytes(grid, grid, grid, 0, 0)


@pytest.mark.parametrize("seed", range(5))
def test_random_traces_match_python_reference(seed):
    rng = np.random.default_rng(seed)
    n = 3000
    actions = rng.choice([A, A, A, F, F, F, SA, SF, SM, SU, O], size=n).astype(np.int64)
    addrs = rng.integers(0, 64, size=n, dtype=np.int64) * 512  # few addresses: much reuse
    sizes = rng.integers(0, 1 << 20, size=n, dtype=np.int64)
    live0, reserved0 = int(rng.integers(0, 1 << 30)), int(rng.integers(0, 1 << 30))
    got = _C.replay_live_bytes(actions, addrs, sizes, live0, reserved0)
    want = python_replay(actions, addrs, sizes, live0, reserved0)
    assert got["allocated"].tolist() == want.pop("allocated")
    assert got["reserved"].tolist() == want.pop("reserved")
    assert {k: got[k] for k in want} == want
    assert want["num_unmatched_frees"] > 0
