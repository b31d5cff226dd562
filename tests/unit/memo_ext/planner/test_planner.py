"""The bi-level memory planner: DSA placements (greedy, MIP, lower bound, validation), plans of
traced iterations, plan files and tools/memo_plan.py."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

from memo_ext.planner import dsa
from memo_ext.planner import plan as P
from memo_ext import trace as T
from tests.conftest import REPO_ROOT, subprocess_env

TRACE_ARGS = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "256", "--vocab-size", "512",
              "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2",
              "--use-distributed-optimizer"]
KiB = 1024


# ----------------------------------------------------------------------------------- DSA

def _random_requests(seed, n=40, horizon=40):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(horizon)
        out.append(dsa.Request(dsa.ALIGNMENT * rng.randint(1, 32), start,
                               start + rng.randint(1, horizon // 3)))
    return out


def test_times_are_counted_in_frees_and_equal_lifetimes_merge():
    # a and b are allocated with no free between them and freed one after the other: they
    # overlap; c is allocated after a's free: it overlaps b only.
    events = [("alloc", "a", 100), ("alloc", "b", 600), ("free", "a", 0), ("alloc", "c", 512),
              ("free", "b", 0), ("free", "c", 0), ("alloc", "d", 1)]
    requests, rows = dsa.requests_from_events(events)
    assert rows == [0, 1, 3, 6]
    assert [r.size for r in requests] == [512, 1024, 512, 512]
    a, b, c, d = requests
    assert (a.start, a.end, b.start, b.end, c.start, c.end) == (0, 1, 0, 2, 1, 3)
    assert d.end > d.start == 3  # never freed: alive to the end
    assert dsa.lower_bound(requests) == 1536
    with pytest.raises(ValueError, match="not live"):
        dsa.requests_from_events([("free", "x", 0)])
    with pytest.raises(ValueError, match="allocated twice"):
        dsa.requests_from_events([("alloc", "x", 1), ("alloc", "x", 1)])


@pytest.mark.parametrize("seed", range(5))
def test_greedy_placements_are_valid_and_never_below_the_bound(seed):
    requests = _random_requests(seed)
    placement = dsa.place(requests, use_mip=False)
    dsa.check_placement(requests, placement.offsets, placement.peak)
    assert placement.peak >= placement.lower_bound == dsa.lower_bound(requests)


def _reference_greedy_offsets(blocks):
    """greedy_offsets as it was in pure Python (O(n^2) interpreter steps): the reference the
    C++ one (csrc/greedy_offsets.cpp) must match exactly."""
    order = sorted(range(len(blocks)),
                   key=lambda i: (-blocks[i].size, -(blocks[i].end - blocks[i].start),
                                  blocks[i].start))
    offsets = [0] * len(blocks)
    placed = []
    for i in order:
        block = blocks[i]
        busy = sorted((offsets[j], offsets[j] + blocks[j].size) for j in placed
                      if block.start < blocks[j].end and blocks[j].start < block.end)
        offset = 0
        for low, high in busy:
            if offset + block.size <= low:
                break
            offset = max(offset, high)
        offsets[i] = offset
        placed.append(i)
    return offsets


@pytest.mark.parametrize("seed", range(6))
def test_greedy_offsets_match_the_pure_python_reference(seed):
    rng = random.Random(seed)
    horizon = rng.choice([20, 100, 400])
    blocks = []
    for _ in range(rng.randint(200, 400)):
        # Few distinct sizes and lifetimes, so ties in the placement order and equal busy
        # range ends are common.
        start = rng.randrange(horizon)
        blocks.append(dsa.Request(dsa.ALIGNMENT * rng.choice([1, 2, 3, 4, 8, 16, 33]), start,
                                  start + rng.randint(1, max(1, horizon // rng.choice([2, 8])))))
    offsets = dsa.greedy_offsets(blocks)
    assert offsets == _reference_greedy_offsets(blocks)
    assert all(type(offset) is int for offset in offsets)
    dsa.check_placement(blocks, offsets, max(o + b.size for o, b in zip(offsets, blocks)))
    # Odd inputs (sizes 0 or negative, empty lifetimes): still the same. Sizes whose sum
    # leaves int64 (the C++ placement's integers): one clear error.
    odd = [dsa.Request(rng.randint(-2, 5), s, s + rng.randint(-1, 4))
           for s in (rng.randrange(30) for _ in range(100))]
    assert dsa.greedy_offsets(odd) == _reference_greedy_offsets(odd)
    huge = [dsa.Request(b.size << 40, b.start, b.end) for b in blocks[:50]]
    assert dsa.greedy_offsets(huge) == _reference_greedy_offsets(huge)
    with pytest.raises(ValueError, match="64-bit"):
        dsa.greedy_offsets([dsa.Request(1 << 61, 0, 1)] * 3)
    assert dsa.greedy_offsets([]) == []


def _reference_check(requests, offsets, arena_bytes):
    """check_placement's overlap sweep as it was (every pair alive together), returning its
    error message or None."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].start)
    active = []
    for i in order:
        active = [j for j in active if requests[j].end > requests[i].start]
        low, high = offsets[i], offsets[i] + requests[i].size
        for j in active:
            if low < offsets[j] + requests[j].size and offsets[j] < high:
                return (f"requests {j} and {i} are alive together and overlap at "
                        f"[{max(low, offsets[j])}, {min(high, offsets[j] + requests[j].size)})")
        active.append(i)
    return None


@pytest.mark.parametrize("seed", range(3))
def test_check_placement_reports_the_same_overlap_as_the_pairwise_sweep(seed):
    rng = random.Random(seed)
    for case in range(300):
        odd = case % 5 == 0     # sizes 0 or negative, empty lifetimes
        requests = [dsa.Request(rng.randint(-2, 4) if odd else rng.randint(1, 6), s,
                                s + rng.randint(-1 if odd else 1, 6))
                    for s in (rng.randrange(20) for _ in range(rng.randint(0, 40)))]
        offsets = dsa.greedy_offsets(requests)
        for _ in range(rng.randint(0, 3)):
            if requests:
                offsets[rng.randrange(len(requests))] = rng.randint(0, 20)
        arena = max([o + r.size for o, r in zip(offsets, requests)] + [0, *offsets])
        expected = _reference_check(requests, offsets, arena)
        try:
            dsa.check_placement(requests, offsets, arena)
            found = None
        except ValueError as error:
            found = str(error)
        assert found == expected
        bound = 0
        for t in {r.start for r in requests}:
            bound = max(bound, sum(r.size for r in requests if r.start <= t < r.end))
        if not odd:
            assert dsa.lower_bound(requests) == bound


def test_mip_improves_on_a_greedy_trap_and_matches_the_optimum():
    """Largest-first greedy peaks at 12 KiB here; the optimum (found by brute force over the
    orders in which blocks stack) is 11 KiB, the lower bound. Sizes in KiB, lifetimes in
    frees (found by a random search over 6-block instances)."""
    import itertools

    requests = [dsa.Request(size * KiB, start, end) for size, start, end in
                [(5, 0, 2), (3, 2, 5), (1, 5, 9), (4, 2, 6), (1, 3, 6), (3, 1, 4)]]
    greedy = dsa.place(requests, use_mip=False)
    assert greedy.peak == 12 * KiB and greedy.lower_bound == 11 * KiB
    solved = dsa.place(requests, time_limit_s=20)
    dsa.check_placement(requests, solved.offsets, solved.peak)
    assert solved.method == "mip" and solved.num_pairs > 0
    best = min(_stacked_peak(requests, order) for order in itertools.permutations(range(6)))
    assert solved.peak == best == 11 * KiB
    assert solved.gap == 0.0


def test_a_mip_solution_that_overlaps_after_rounding_is_discarded(monkeypatch):
    """HiGHS accepts binaries within its integrality tolerance; times the big-M that let two
    blocks overlap in a 7B plan at 4M tokens. Such a solution must never reach the arena."""
    requests = [dsa.Request(size * KiB, start, end) for size, start, end in
                [(5, 0, 2), (3, 2, 5), (1, 5, 9), (4, 2, 6), (1, 3, 6), (3, 1, 4)]]
    monkeypatch.setattr(dsa, "_solve_mip", lambda blocks, *a: ([0] * len(blocks), "Optimal"))
    placement = dsa.place(requests, time_limit_s=5)
    dsa.check_placement(requests, placement.offsets, placement.peak)
    assert placement.peak == 12 * KiB and placement.method.startswith("greedy")
    assert "overlaps after rounding" in placement.status


def _stacked_peak(requests, order):
    offsets = {}
    for i in order:
        offset = 0
        for j in sorted((j for j in offsets if requests[i].start < requests[j].end
                         and requests[j].start < requests[i].end), key=lambda j: offsets[j]):
            if offset + requests[i].size <= offsets[j]:
                break
            offset = max(offset, offsets[j] + requests[j].size)
        offsets[i] = offset
    return max(offsets[i] + requests[i].size for i in offsets)


def test_check_placement_finds_overlaps_and_overflow():
    requests = [dsa.Request(1024, 0, 2), dsa.Request(1024, 1, 3)]
    with pytest.raises(ValueError, match="alive together and overlap"):
        dsa.check_placement(requests, [0, 512], 4096)
    with pytest.raises(ValueError, match="outside the arena"):
        dsa.check_placement(requests, [0, 1024], 1536)
    dsa.check_placement(requests, [0, 1024], 2048)


# ----------------------------------------------------------------------------- plans

def _trace_full_recompute(path, seq_length: int = 256):
    """The small model's trace at ``seq_length`` tokens, with full recompute (so backward phases
    recompute), written to ``path`` by tools/trace.py and read back."""
    args = [str(seq_length) if a == "256" else a for a in TRACE_ARGS]
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "trace.py"), *args,
         "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1", "--quiet", "-o", str(path)],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return T.read_trace(path)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    path = tmp_path_factory.mktemp("planner") / "trace.jsonl.gz"
    return path, _trace_full_recompute(path)


def test_layer_phases_and_level1_kinds(traced):
    _, trace = traced
    plan = P.plan_trace(trace)
    groups = {level["group"] for level in plan.level1}
    assert groups == {"forward", "backward"}
    phases = sorted(tuple(p) for level in plan.level1 for p in level["phases"])
    assert [p[:2] for p in phases] == sorted(
        [(layer, g) for layer in range(3) for g in ("forward", "backward")])
    for level in plan.level1 + [json.loads(json.dumps(vars(plan.level2)))]:
        assert level["peak"] >= level["lower_bound"] > 0
        assert level["gap"] <= 0.01, level


def test_plan_is_valid_and_reaches_the_iteration_bound(traced):
    _, trace = traced
    plan = P.plan_trace(trace)
    P.validate_plan(plan, trace)
    assert plan.arena_bytes >= plan.iteration_lower_bound
    assert plan.iteration_gap <= 0.01
    assert plan.arena_bytes <= plan.bi_level_arena_bytes
    # Parameters, gradient buffers and optimizer state are not planned.
    events = [e for e in trace.events if e["pool"] == "device"]
    planned = {events[row]["phase"] for row in plan.offsets}
    assert T.INIT not in planned and {"forward", "backward"} <= planned


def test_validator_catches_a_corrupted_placement(traced):
    _, trace = traced
    plan = P.plan_trace(trace)
    rows = sorted(plan.offsets, key=plan.offsets.get)
    plan.offsets[rows[-1]] = plan.arena_bytes  # past the end of the arena
    with pytest.raises(ValueError, match="outside the arena"):
        P.validate_plan(plan, trace)


def test_plan_file_round_trip_and_refusals(traced, tmp_path):
    path, trace = traced
    plan = P.plan_trace(trace)
    out = tmp_path / "plan.json"
    P.write_plan(plan, out)
    assert not (tmp_path / "plan.json.partial").exists()
    again = P.plan_for_trace(out, trace)
    assert again.offsets == plan.offsets and again.arena_bytes == plan.arena_bytes
    # Foreign: another trace (one event fewer).
    other = T.Trace(trace.header, trace.events[:-1])
    with pytest.raises(P.PlanFileError, match="made for trace"):
        P.plan_for_trace(out, other)
    data = json.loads(out.read_text())
    for name, mutate, message in [
        ("garbage", lambda p: p.write_text("{not json"), "not a readable JSON plan"),
        ("other format", lambda p: p.write_text(json.dumps({"format": "x"})), "not a memo-plan"),
        ("version", lambda p: p.write_text(json.dumps({**data, "version": 99})), "version 99"),
        ("truncated", lambda p: p.write_text(json.dumps({k: v for k, v in data.items()
                                                         if k != "placements"})), "corrupted"),
        ("negative", lambda p: p.write_text(json.dumps(
            {**data, "placements": [{"row": 0, "offset": -5, "size": 512}]})), "negative"),
    ]:
        bad = tmp_path / f"{name}.json"
        mutate(bad)
        with pytest.raises(P.PlanFileError) as error:
            P.plan_for_trace(bad, trace)
        assert message in str(error.value) and "\n" not in str(error.value), name
    with pytest.raises(P.PlanFileError, match="no such plan file"):
        P.read_plan(tmp_path / "missing.json")
    # The estimator's plans (digest=False) are the same placement and name no trace: never
    # written, never validated as a trace's.
    unnamed = P.plan_trace(trace, digest=False)
    assert unnamed.trace_digest is None and unnamed.offsets == plan.offsets
    with pytest.raises(ValueError, match="names no trace"):
        P.write_plan(unnamed, tmp_path / "unnamed.json")
    with pytest.raises(ValueError, match="names no trace"):
        P.validate_plan(unnamed, trace)
    assert not (tmp_path / "unnamed.json").exists()


def test_arena_policy_replays_the_plan_with_no_fallbacks(traced):
    """memo_ext.alloc's arena model serves every planned request at its offset; only the
    persistent state (not planned) goes to the caching path."""
    import memo_ext.alloc as alloc

    path, trace = traced
    plan = P.plan_trace(trace)
    replayed = alloc.replay(alloc.load_trace(path), "arena", plan=P.arena_plan(plan, trace))
    counters = replayed.counters
    assert replayed.oom is None
    assert counters["planned"] == len(plan.offsets), counters
    assert counters["fallbacks"] == 0, counters


def test_memo_plan_cli(traced, tmp_path):
    path, _ = traced
    module = _load_cli()
    out = tmp_path / "plan.json"
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert module.main(["--trace", str(path), "-o", str(out)]) == 0
    lines = buffer.getvalue().splitlines()
    assert lines[-1].startswith("plan peak ") and " lower bound " in lines[-1]
    assert lines[-1].endswith("%")
    assert sum("level 1" in line for line in lines) >= 2
    with redirect_stdout(io.StringIO()):
        assert module.main(["--trace", str(path), "--check", str(out)]) == 0
    assert module.main(["--trace", str(tmp_path / "none.gz"), "-o", str(out)]) == 2
    assert module.main(["--trace", str(path)]) == 2


def test_memory_report_replays_a_memo_plan_plan(traced, tmp_path):
    """memo-memory-report --plan takes memo-plan's output for the same trace (rows of the
    device events become request indices) and refuses one made for another trace."""
    from tests.conftest import run_memory_report

    path, trace = traced
    plan = P.plan_trace(trace)
    out = tmp_path / "plan.json"
    P.write_plan(plan, out)
    result = run_memory_report(path, "--policies", "arena", "--plan", out)
    assert result.returncode == 0, result.stderr
    assert f"planned {len(plan.offsets)}, fallbacks 0" in result.stdout, result.stdout
    other = tmp_path / "other.jsonl.gz"
    T.write_trace(T.Trace(trace.header, trace.events[:-2]), other)
    refused = run_memory_report(other, "--policies", "arena", "--plan", out)
    last = refused.stderr.strip().splitlines()[-1]  # after megatron.core's import warnings
    assert refused.returncode == 2, refused.stderr
    assert last.startswith(f"memory_report: --plan {out}: the plan was made for trace ")
    assert last.endswith(f"plan {other} with memo-plan")


def _load_cli():
    from megatron.memo_tools.cli import memo_plan

    return memo_plan


# ---------------------------------------------------------------------- runtime arena

def _served_blocks_never_overlap(runtime, trace):
    """Replay ``trace`` through ``runtime`` and check, independently of the C++ arena, that
    no two blocks it served are alive at once over the same bytes."""
    live: dict[int, tuple[int, int]] = {}
    for event in trace.events:
        if event["pool"] != "device":
            continue
        if event["action"] == "alloc":
            offset = runtime.request(event["layer"], event["phase"], event["bytes"])
            if offset >= 0:
                end = offset + dsa.align(event["bytes"])
                for other_start, other_end in live.values():
                    assert end <= other_start or other_end <= offset
                assert end <= runtime.arena_bytes
                live[event["id"]] = (offset, end)
        elif event["id"] in live:
            assert runtime.release(live.pop(event["id"])[0])
    return runtime.stats()


def test_runtime_arena_serves_every_transient_of_its_own_trace(traced):
    from memo_ext.planner.arena import ArenaRuntime

    _, trace = traced
    plan = P.plan_trace(trace)
    stats = _served_blocks_never_overlap(ArenaRuntime(plan), trace)
    transient = sum(sum(1 for size, offset in level["table"] if offset >= 0) * len(level["phases"])
                    for level in plan.level1)
    assert stats["served"] == transient > 0
    assert (stats["size_mismatches"], stats["overlaps"], stats["beyond_plan"]) == (0, 0, 0)
    assert stats["live_blocks"] == 0 and stats["peak_live_bytes"] <= stats["arena_bytes"]


def test_runtime_arena_falls_back_on_a_longer_sequence_than_planned(traced, tmp_path):
    """A plan made at 256 tokens, run at 512: requests larger than planned take the normal
    allocator (counted), the served ones still never overlap."""
    from memo_ext.planner.arena import ArenaRuntime

    _, trace = traced
    plan = P.plan_trace(trace)
    longer = _trace_full_recompute(tmp_path / "longer.jsonl.gz", seq_length=512)
    stats = _served_blocks_never_overlap(ArenaRuntime(plan), longer)
    assert stats["size_mismatches"] > 0
    with pytest.raises(ValueError, match="made for trace"):
        P.validate_plan(plan, longer)


def test_trace_digest_is_the_json_of_each_event_request(traced):
    """The digest plan files store: SHA-256 over ``json.dumps([action, alloc number, aligned
    size, phase, layer, micro-batch])`` per device event, written without a json.dumps call
    each; a real trace and events with None, booleans and escaped strings hash alike."""
    import hashlib

    def reference(events):
        order, h = {}, hashlib.sha256()
        for e in events:
            if e["action"] == "alloc":
                order[e["id"]] = len(order)
            size = dsa.align(e["bytes"]) if e["action"] == "alloc" else 0
            h.update(json.dumps([e["action"], order.get(e["id"]), size, e["phase"],
                                 e["layer"], e["microbatch"]]).encode())
        return h.hexdigest()

    odd = [{"action": "alloc", "id": 1, "bytes": 3, "phase": 'say "x"\n', "layer": None,
            "microbatch": True},
           {"action": "alloc", "id": 2, "bytes": 1 << 40, "phase": "forward", "layer": 1,
            "microbatch": 1},
           {"action": "free", "id": 7, "bytes": 0, "phase": "backward", "layer": 0,
            "microbatch": None}]
    for events in (P._device_events(traced[1]), odd):
        assert P.trace_digest(events) == reference(events)
