"""The real GMLake stitching allocator on host memory (csrc/stitching_allocator.h over memfd and
mmap; memo_ext.alloc.stitching): real stitched views, agreement with the stitching model, every
real snapshot replayed with data checks and no leaks, the randomized fuzzer against its oracle
(and, marked slow, the same fuzzer built with AddressSanitizer)."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from memo_ext import _C
from memo_ext.alloc import (
    HostStitchingAllocator,
    AllocatorTrace,
    load_snapshot,
    replay,
    replay_host,
    snapshot_trace,
)
from memo_ext.alloc.traces import ALLOC, FREE
from memo_ext.alloc.stitching import CONSTANTS
from tests.alloc_traces import trace, training_steps
from tests.conftest import REPO_ROOT, SNAPSHOTS, run_memory_report, snapshot_path

MiB = 1 << 20
REPO = REPO_ROOT


def open_fds() -> int:
    """The allocator's own descriptors: its physical chunks, memfds named ``memo-stitch``
    (csrc/stitching_host_backend.h). Not every descriptor of the process: after the whole suite
    earlier tests' threads and spawned ranks' pipes open and close descriptors at any moment,
    which counting all of them read as a leak or a give-back (42 == 41 in CI, 30 == 33 before)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between the listing and the read
            continue
        count += target.startswith("/memfd:memo-stitch")
    return count


def test_open_fds_sees_a_chunk_left_open():
    """The leak checks below can fail: one chunk-named memfd left open is counted."""
    before = open_fds()
    fd = os.memfd_create("memo-stitch", os.MFD_CLOEXEC)
    try:
        assert open_fds() == before + 1
    finally:
        os.close(fd)
    assert open_fds() == before


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)


# ------------------------------------------------------------------------- real stitched views


def test_a_stitched_block_is_one_writable_view_of_separate_physical_chunks():
    fds = open_fds()
    with HostStitchingAllocator(frag_limit_bytes=4 * MiB) as a:
        first = a.malloc(8 * MiB)
        assert a.kind(first) == "primitive"
        a.free(first)
        # 14 MiB: the only free block has 8, and the stitching pools never give one physical
        # allocation of 14 MiB here: the 8 MiB block is stitched with a new 6 MiB one (S4)
        block = a.malloc(14 * MiB)
        assert a.kind(block) == "stitched" and a.block_bytes(block) == 14 * MiB
        views = a.views(block)
        assert [(off, size) for off, _, size, _, _ in views] == [(0, 8 * MiB), (8 * MiB, 6 * MiB)]
        assert views[0][1] == first  # the first piece is the old block's own memory
        assert views[0][3] != views[1][3]  # two physical allocations (two memfds)
        s = a.stats()
        assert s["peak_reserved_bytes"] == s["backend_physical_bytes"] == 14 * MiB
        assert s["stitches"] == 1 and s["new_pblocks"] == 2
        assert open_fds() == fds + 2  # one memfd per physical chunk, counted by the leak check
        assert s["mapped_bytes"] == 28 * MiB  # each physical byte seen twice, counted once
        # write through the stitched view, read through the primitive blocks' own views
        data = pattern(14 * MiB, seed=3)
        a.buffer(block, 14 * MiB)[:] = data
        for off, va, size, _, _ in views:
            assert np.array_equal(a.buffer(va, size), data[off:off + size])
        # and the other way round, across the seam between the two chunks
        a.buffer(views[1][1], 16)[:] = 0xAB
        a.buffer(views[0][1] + 8 * MiB - 16, 16)[:] = 0xCD
        seam = a.buffer(block + 8 * MiB - 16, 32)
        assert list(seam[:16]) == [0xCD] * 16 and list(seam[16:]) == [0xAB] * 16
        assert a.check_invariants() == ""
        a.free(block)
        # exact reuse: the same stitched block again, no new memory, the data still there
        again = a.malloc(14 * MiB)
        assert again == block and a.stats()["exact_hits"] == 1
        assert a.stats()["physical_creates"] == 2
        left = a.close()
    assert left["backend_handles"] == left["backend_ranges"] == 0
    assert left["backend_physical_bytes"] == left["backend_mapped_bytes"] == 0
    assert open_fds() == fds


def test_split_pieces_are_stitched_back_and_reused_exactly():
    with HostStitchingAllocator(frag_limit_bytes=4 * MiB) as a:
        big = a.malloc(20 * MiB)
        a.free(big)
        head = a.malloc(8 * MiB)  # S2: split 20 into 8 + 12, stitch 8 + 12 back as 20
        assert head == big and a.kind(head) == "primitive"
        tail = a.malloc(12 * MiB)  # S1: the 12 MiB piece, right after the head
        assert tail == big + 8 * MiB
        a.buffer(head, 8 * MiB)[:] = 1
        a.buffer(tail, 12 * MiB)[:] = 2
        a.free(head)
        a.free(tail)
        whole = a.malloc(20 * MiB)  # S1: the stitched block over both pieces
        assert a.kind(whole) == "stitched" and whole != big
        view = a.buffer(whole, 20 * MiB)
        assert (view[:8 * MiB] == 1).all() and (view[8 * MiB:] == 2).all()
        s = a.stats()
        assert (s["splits"], s["stitches"], s["exact_hits"]) == (1, 1, 2)
        assert s["peak_reserved_bytes"] == 20 * MiB and s["physical_creates"] == 1


def test_small_requests_take_the_caching_path_in_real_segments():
    with HostStitchingAllocator() as a:
        x, y = a.malloc(1000), a.malloc(3 * MiB)
        assert a.kind(x) == a.kind(y) == "normal"
        assert a.block_bytes(x) == 1024 and a.block_bytes(y) == 3 * MiB
        assert a.stats()["backend_physical_bytes"] == 2 * MiB + 20 * MiB  # small + large segment
        a.buffer(x, 1024)[:] = 7
        a.buffer(y, 3 * MiB)[:] = 9
        z = a.malloc(2 * MiB)  # the rest of the 20 MiB segment, right after y
        assert z == y + 3 * MiB
        assert (a.buffer(x, 1024) == 7).all() and (a.buffer(y, 3 * MiB) == 9).all()


def test_capacity_reorganises_then_refuses():
    t = trace(("alloc", 1, 20 * MiB, 0), ("free", 1), ("alloc", 2, 24 * MiB, 1))
    model = replay(t, "stitching", 30 * MiB, frag_limit=4 * MiB)
    real = replay_host(t, 30 * MiB, frag_limit=4 * MiB, log=True)
    assert real.reorganisations == model.reorganisations == 1 and real.oom is None
    assert list(zip(real.decision_kinds, real.decision_sizes)) == \
        list(zip(model.decision_kinds, model.decision_sizes))
    with HostStitchingAllocator(capacity_bytes=10 * MiB, frag_limit_bytes=4 * MiB) as a:
        assert a.malloc(20 * MiB) == 0
        assert a.stats()["ooms"] == 1 and a.stats()["backend_physical_bytes"] == 0


def test_bad_arguments_and_use_after_close():
    with pytest.raises(ValueError, match="capacity"):
        HostStitchingAllocator(capacity_bytes=-1)
    a = HostStitchingAllocator()
    assert a.free(12345) == -1 and a.kind(12345) == "" and a.views(12345) == []
    a.close()
    assert a.closed
    with pytest.raises(ValueError, match="closed"):
        a.malloc(10)


# ------------------------------------------------------------------- agreement with the model


def assert_same_decisions(real, model):
    assert np.array_equal(real.decision_events, model.decision_events)
    assert np.array_equal(real.decision_kinds, model.decision_kinds)
    assert np.array_equal(real.decision_sizes, model.decision_sizes)
    assert real.peak_reserved_bytes == model.peak_reserved_bytes
    assert np.array_equal(real.reserved_timeline, model.reserved_timeline)
    assert np.array_equal(real.allocated_timeline, model.allocated_timeline)
    for key in ("exact_hits", "splits", "stitches", "stitched_bytes", "new_pblocks",
                "sblocks_dropped", "normal_path_segments"):
        if key != "normal_path_segments":  # the model counts normal segments at the end
            assert real.stats[key] == model.counters[key], key


@pytest.mark.parametrize("frag_limit", [4 * MiB, None])
def test_real_allocator_makes_the_models_decisions(frag_limit):
    t = training_steps(5)
    real = replay_host(t, frag_limit=frag_limit, log=True)
    model = replay(t, "stitching", frag_limit=frag_limit)
    assert_same_decisions(real, model)
    assert real.ok and real.checked_blocks == t.num_allocs


def test_stitch_free_drops_the_least_recently_used_views():
    # 4 MiB, then 10, 16 and 22 MiB blocks, each stitched from all the free pieces plus a new
    # 6 MiB one; with room for two stitched blocks the third drops the oldest (10 MiB)
    t = trace(("alloc", 1, 4 * MiB), ("free", 1), ("alloc", 2, 10 * MiB), ("free", 2),
              ("alloc", 3, 16 * MiB), ("free", 3), ("alloc", 4, 22 * MiB), ("free", 4))
    real = replay_host(t, frag_limit=4 * MiB, max_sblocks=2, log=True)
    model = replay(t, "stitching", frag_limit=4 * MiB, max_sblocks=2)
    assert_same_decisions(real, model)
    assert real.stats["stitches"] == 3 and real.stats["sblocks_alive"] == 2
    assert real.stats["sblocks_dropped"] == 1 and real.stats["peak_reserved_bytes"] == 22 * MiB
    assert real.ok and real.stitched_checked == 3


def _random_trace(seed: int, events: int = 4000) -> AllocatorTrace:
    """Mixed sizes on 3 streams, with frees, empty_cache calls and a few duplicate ids."""
    rng = np.random.default_rng(seed)
    live, rows, next_id = [], [], 0
    for _ in range(events):
        roll = rng.random()
        if roll < 0.005:
            rows.append((_C.EMPTY_CACHE, 0, 0, 0))
        elif live and (roll < 0.45 or len(live) > 40):
            rows.append((FREE, live.pop(int(rng.integers(len(live)))), 0, 0))
        else:
            kind = rng.integers(4)
            size = int([rng.integers(1, MiB), rng.integers(MiB, 24 * MiB),
                        rng.integers(1, 40) * 2 * MiB, rng.integers(100 * MiB, 300 * MiB)][kind])
            rows.append((ALLOC, next_id, size, int(rng.integers(3))))
            live.append(next_id)
            next_id += 1
    a = np.array(rows, np.int64)
    return AllocatorTrace(a[:, 0], a[:, 1], a[:, 2], a[:, 3], name=f"random {seed}")


@pytest.mark.parametrize("seed,capacity,frag_limit", [
    (1, None, 4 * MiB), (2, None, None), (3, 1 << 30, 4 * MiB), (4, 2 << 30, 16 * MiB)])
def test_real_allocator_makes_the_models_decisions_on_random_traces(seed, capacity, frag_limit):
    t = _random_trace(seed)
    real = replay_host(t, capacity, frag_limit=frag_limit, log=True)
    model = replay(t, "stitching", capacity, frag_limit=frag_limit)
    assert_same_decisions(real, model)
    assert real.reorganisations == model.reorganisations
    assert (real.oom is None) == (model.oom is None)
    if capacity:
        assert real.reorganisations > 0 and real.peak_reserved_bytes <= capacity
    assert real.ok, (real.first_error, real.invariant_error, real.leaked)


# -------------------------------------------------------------------------- real snapshots


_SNAPSHOTS = sorted(p.name for p in SNAPSHOTS.glob("*.pickle")) if SNAPSHOTS.is_dir() else []


@pytest.mark.parametrize("name", _SNAPSHOTS or ["(no snapshots here)"])
def test_every_snapshot_replays_through_the_real_allocator(name):
    """Peak reserved <= the caching model's and equal to the stitching model's (the same
    decisions, in the same order); every block's pattern verified; nothing left after
    teardown (no memfd open, no range reserved)."""
    snapshot = load_snapshot(snapshot_path(name))
    fds = open_fds()
    for device in range(len(snapshot.get("device_traces", []))):
        t = snapshot_trace(snapshot, device, name=name)
        if not len(t):
            continue
        real = replay_host(t, log=True)
        caching = replay(t, "caching", timelines=False)
        assert real.peak_reserved_bytes <= caching.peak_reserved_bytes
        assert_same_decisions(real, replay(t, "stitching"))
        assert real.data_errors == 0, real.first_error
        assert real.invariant_error == ""
        assert not any(real.leaked.values()), real.leaked
        assert real.checked_blocks == t.num_allocs - real.stats["ooms"]
        assert real.peak_resident_bytes < 4 << 30
    assert open_fds() == fds


def test_memory_report_runs_the_real_allocator():
    proc = run_memory_report(snapshot_path("transformer_small_from_empty.pickle"),
                             "--policies", "stitching")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "### policy stitching: real allocator on host memory (capacity unlimited)" in out
    row = out.split("real allocator on host memory")[1].splitlines()[4].split("|")
    # device 0: peak reserved equals the model's, 36 blocks verified, no error, no leak
    assert row[3] == row[4] == " 3.04 "
    assert row[11].strip().startswith("36") and row[12] == " 0 " and row[13] == " none "
    proc = run_memory_report(snapshot_path("transformer_small_from_empty.pickle"),
                             "--policies", "stitching", "--no-host-stitching")
    assert proc.returncode == 0 and "real allocator" not in proc.stdout


# ---------------------------------------------------------------------------- the fuzzer


def _assert_clean(r: dict):
    for key in ("va_overlaps", "phys_overlaps", "data_errors", "invariant_errors",
                "accounting_errors", "shape_errors", "residual_reserved", "residual_handles",
                "residual_ranges", "residual_mapped", "teardown_handles", "teardown_ranges",
                "teardown_physical"):
        assert r[key] == 0, (key, r["first_error"])


def test_fuzzer_100k_operations_against_the_oracle():
    fds = open_fds()
    r = _C.fuzz_stitching(seed=20261122, ops=100_000)
    _assert_clean(r)
    assert r["ops"] == 100_000 and r["allocs"] == r["frees"] > 40_000
    # every path is exercised: normal, primitive, stitched, StitchFree, empty_cache
    assert min(r["normal_allocs"], r["primitive_allocs"], r["stitched_allocs"]) > 5_000
    assert r["stats"]["sblocks_dropped"] > 1_000 and r["empty_caches"] > 100
    assert open_fds() == fds


def test_fuzzer_with_a_capacity_reorganises_and_refuses_cleanly():
    r = _C.fuzz_stitching(seed=5, ops=30_000, capacity=1 << 30, frag_limit=16 * MiB,
                          max_sblocks=1024, streams=3)
    _assert_clean(r)
    assert r["ooms"] > 0 and r["stats"]["reorganisations"] > 0
    assert r["stats"]["peak_reserved_bytes"] <= 1 << 30


def test_check_windows_constants():
    # the data-check scheme documented in csrc/stitching_check.h and docs/stitching.md
    assert CONSTANTS["kCheckWindow"] == 4096 and CONSTANTS["kCheckStride"] == 2 * MiB
    assert CONSTANTS["kWholeCheckLimit"] == 8192 and CONSTANTS["kGranularity"] == 2 * MiB


@pytest.mark.slow
def test_fuzzer_under_address_sanitizer(tmp_path):
    """The same fuzzer as a standalone program built with -fsanitize=address,undefined."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ on this machine")
    exe = tmp_path / "stitching_fuzz"
    subprocess.run([cxx, "-std=c++17", "-O1", "-g", "-fsanitize=address,undefined",
                    "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined",
                    f"-I{REPO / 'csrc'}", str(REPO / "csrc/standalone/stitching_fuzz_main.cpp"),
                    "-o", str(exe)], check=True, capture_output=True, timeout=600)
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0",
           "UBSAN_OPTIONS": "print_stacktrace=1"}
    for args in (["11", "100000"], ["12", "30000", str(1 << 30), str(16 * MiB), "1024"]):
        proc = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env,
                              timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
        counts = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
        assert counts["errors"] == "0" and counts["residue"] == "0"
        assert counts["leaked_fds"] == "0" and counts["ops"] == args[1]
        assert int(counts["stitched_allocs"]) > 0
        assert "AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr
