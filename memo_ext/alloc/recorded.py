"""A recorded PyTorch memory snapshot as allocator-model input and yardstick: its trace
(:func:`snapshot_trace`, the third trace format beside memo_ext.alloc.traces' files), the state
that trace started from (:func:`reconstruct_initial_state`), the device capacity the run behaved
as if it had (:func:`infer_capacity`), and a replay through the recording allocator's model that
counts the recorded segment decisions the model makes too (:func:`compare_recorded`). Bytes.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from memo_ext.alloc.models import KMIN_BLOCK, KSMALL_BUFFER, KSMALL_SIZE, ReplayResult, replay
from memo_ext.alloc.snapshot import ALLOCATED_BLOCK_STATES, SnapshotError
from memo_ext.alloc.traces import (
    ACTION_NAMES,
    ALLOC,
    EMPTY_CACHE,
    FAILED_ALLOC,
    OTHER,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    AllocatorTrace,
)

__all__ = [
    "DecisionMismatch", "InitialState", "RecordedComparison", "compare_recorded",
    "infer_capacity", "reconstruct_initial_state", "snapshot_trace",
]

_DECISION_NAMES = {
    SEGMENT_ALLOC: "segment_alloc", SEGMENT_FREE: "segment_free",
    SEGMENT_MAP: "segment_map", SEGMENT_UNMAP: "segment_unmap",
}


# ------------------------------------------------------------------------- snapshots as input


def _round_request(size: int) -> int:
    return max(KMIN_BLOCK, -(-size // KMIN_BLOCK) * KMIN_BLOCK)


def _device_trace(snapshot: dict, device: int) -> list:
    traces = snapshot.get("device_traces", [])
    return traces[device] if device < len(traces) else []


def _empty_cache_groups(trace: list) -> set:
    """Indices of segment_free/segment_unmap events that came from torch.cuda.empty_cache().

    Releases come in runs. A run is a reorganisation (the allocator's own decision) when an
    allocation was failing: the run is followed by the retried device malloc (segment_alloc or
    segment_map) or by an oom event. Otherwise, or when a frame names emptyCache, it is an
    empty_cache() call: an input of the replay, not a decision.
    """
    inputs, i, n = set(), 0, len(trace)
    while i < n:
        if trace[i]["action"] not in ("segment_free", "segment_unmap"):
            i += 1
            continue
        j = i
        while j < n and trace[j]["action"] in ("segment_free", "segment_unmap"):
            j += 1
        named = any("emptyCache" in str(f.get("name", "")) for e in trace[i:j]
                    for f in e.get("frames", ()) or ())
        retried = j < n and trace[j]["action"] in ("segment_alloc", "segment_map", "oom")
        if named or not retried:
            inputs.update(range(i, j))
        i = j
    return inputs


def snapshot_trace(snapshot: dict, device: int = 0, *, prologue: bool = True,
                   name: str = "") -> AllocatorTrace:
    """One device's trace of a loaded snapshot as a :class:`AllocatorTrace`.

    alloc -> ALLOC, free_completed -> FREE, oom -> FAILED_ALLOC, an empty_cache() run of
    segment_free/unmap events -> one EMPTY_CACHE, the allocator's own segment events keep their
    codes (the models ignore them), everything else -> OTHER. With ``prologue`` the blocks live
    before the recording started (see :func:`reconstruct_initial_state`) are allocated first, in
    address order, so that every policy starts holding them.
    """
    trace = _device_trace(snapshot, device)
    actions, ids, sizes, streams = _snapshot_columns(trace)
    k = 0
    if prologue:
        state = reconstruct_initial_state(snapshot, device)
        blocks = sorted(state.blocks, key=lambda b: b[1])
        k = len(blocks)
        actions = np.concatenate([np.full(k, ALLOC, np.int64), actions])
        ids = np.concatenate([np.array([b[1] for b in blocks], np.int64), ids])
        sizes = np.concatenate([np.array([b[3] for b in blocks], np.int64), sizes])
        streams = np.concatenate([np.array([b[4] for b in blocks], np.int64), streams])
    return AllocatorTrace(actions, ids, sizes, streams, name=name, device=device, num_prologue=k)


def _snapshot_columns(trace: list):
    n = len(trace)
    try:
        actions = np.fromiter((ACTION_NAMES.get(e["action"], OTHER) for e in trace), np.int64, n)
        ids = np.fromiter((e.get("addr", 0) for e in trace), np.int64, n)
        sizes = np.fromiter((e.get("size", 0) for e in trace), np.int64, n)
        streams = np.fromiter((e.get("stream", 0) for e in trace), np.int64, n)
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise SnapshotError(f"malformed trace event: {type(exc).__name__}: {exc}") from exc
    inputs = sorted(_empty_cache_groups(trace))
    for i in inputs:
        actions[i] = OTHER
    for i in inputs:  # the first release of each run stands for the whole empty_cache() call
        if i == 0 or i - 1 not in inputs:
            actions[i] = EMPTY_CACHE
    return actions, ids, sizes, streams


@dataclass
class InitialState:
    """The allocator's state before a snapshot's first event.

    ``segments``: (address, bytes, stream, small pool) rows. ``blocks``: (segment row, address,
    block bytes, requested bytes, stream) of the blocks allocated at that moment; the rest of
    each segment is free. ``inferred_tails``: blocks freed by the trace whose size had to be
    inferred and that got an unsplit tail (at most kSmallSize bytes). With expandable segments
    there are no segment rows (row -1): ``expandable_mapped_bytes`` is what was mapped.
    """

    segments: list
    blocks: list
    inferred_tails: int = 0
    expandable_mapped_bytes: int | None = None

    @property
    def reserved_bytes(self) -> int:
        if self.expandable_mapped_bytes is not None:
            return self.expandable_mapped_bytes
        return sum(s[1] for s in self.segments)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(segments (k, 4), blocks (m, 5): row, address, bytes, requested, id = address)."""
        if self.expandable_mapped_bytes is not None:
            raise ValueError("an expandable-segments state has no caching segments to start from")
        segs = np.array([(a, s, st, int(sm)) for a, s, st, sm in self.segments],
                        np.int64).reshape(-1, 4)
        blks = np.array([(row, a, s, req, a) for row, a, s, req, _ in self.blocks],
                        np.int64).reshape(-1, 5)
        return segs, blks


def reconstruct_initial_state(snapshot: dict, device: int = 0) -> InitialState:
    """Rebuild the segments and allocated blocks that existed before the first trace event.

    Segments: the final ``segments`` of the device, minus those the trace allocated, plus those
    it freed (the trace is undone from its end). Allocated blocks: each address whose first
    alloc/free event in the trace is a free (allocated before the recording; its block size is
    the rounded request plus the unsplit tail the large pool may leave, at most kSmallSize bytes:
    the gap to the next known block start when that gap is that small, since the large pool never
    holds a free block of kSmallSize bytes or less; a trace alloc at such an address while the
    block is live is a known block start too), and
    each block still allocated at the dump whose address the trace never touched (exact size from
    ``segments``). Raises SnapshotError when the trace contradicts the segments.
    """
    try:
        return _reconstruct(snapshot, device)
    except (KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"malformed snapshot: {type(exc).__name__}: {exc}") from exc


def _reconstruct(snapshot: dict, device: int) -> InitialState:
    final = [s for s in snapshot["segments"] if s["device"] == device]
    trace = _device_trace(snapshot, device)
    if _is_expandable(snapshot, trace) or any(s.get("is_expandable") for s in final):
        return _reconstruct_expandable(final, trace, device)
    segs = {s["address"]: (s["total_size"], s["stream"], s.get("segment_type") == "small")
            for s in final}
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        if e["action"] == "segment_alloc":
            if segs.pop(e["addr"], None) is None:
                raise SnapshotError(f"device {device}: trace event {i} allocates segment "
                                    f"{e['addr']:#x}, which is not among the final segments")
        elif e["action"] == "segment_free":
            segs[e["addr"]] = (e["size"], e.get("stream", 0), e["size"] == KSMALL_BUFFER)
    first: dict = {}  # address -> (event index, event) of its first alloc/free_completed
    allocs = []  # (address, event index) of every alloc
    for i, e in enumerate(trace):
        if e["action"] in ("alloc", "free_completed"):
            first.setdefault(e["addr"], (i, e))
            if e["action"] == "alloc":
                allocs.append((e["addr"], i))
    allocs.sort()
    alloc_addrs = [a for a, _ in allocs]
    starts = sorted(segs)
    segments = [(a, segs[a][0], segs[a][1], segs[a][2]) for a in starts]

    def row_of(addr: int, what: str) -> int:
        r = bisect_right(starts, addr) - 1
        if r < 0 or addr >= starts[r] + segments[r][1]:
            raise SnapshotError(f"device {device}: {what} at {addr:#x} lies in no segment that "
                                "existed before the trace")
        return r

    blocks, inferred = [], {}  # inferred: address -> event index of its first free
    for addr, (i, e) in first.items():
        if e["action"] == "free_completed":
            row = row_of(addr, "a block freed by the trace")
            blocks.append([row, addr, _round_request(e["size"]), e["size"], segments[row][2]])
            inferred[addr] = i
    for s in final:
        for b in s["blocks"]:
            if b["state"] in ALLOCATED_BLOCK_STATES and b["address"] not in first:
                row = row_of(b["address"], "a block live at the dump")
                blocks.append([row, b["address"], b["size"], b.get("requested_size", b["size"]),
                               segments[row][2]])
    blocks.sort(key=lambda b: b[1])
    tails = 0
    for idx, (row, addr, size, _, _) in enumerate(blocks):
        if addr not in inferred:
            continue
        seg_addr, seg_size, _, small = segments[row]
        nxt = blocks[idx + 1][1] if idx + 1 < len(blocks) and blocks[idx + 1][0] == row \
            else seg_addr + seg_size
        # an alloc at an address past this block's rounded end while the block is still live
        # marks where the next block started, i.e. where this one ended
        freed_at = inferred[addr]
        k = bisect_right(alloc_addrs, addr + size - 1)
        while k < len(allocs) and allocs[k][0] < min(nxt, addr + size + KSMALL_SIZE + 1):
            if allocs[k][1] < freed_at:
                nxt = allocs[k][0]
                break
            k += 1
        gap = nxt - (addr + size)
        if gap < 0:
            raise SnapshotError(f"device {device}: the block freed at {addr:#x} overlaps the "
                                "next block of its segment")
        if not small and 0 < gap <= KSMALL_SIZE:
            blocks[idx][2] += gap
            tails += 1
    return InitialState(segments, [tuple(b) for b in blocks], tails)


def _reconstruct_expandable(final: list, trace: list, device: int) -> InitialState:
    """Expandable segments: mapped bytes before the trace, and the blocks live then (requested
    bytes rounded; the pages they sat in are not recoverable)."""
    mapped = sum(s["total_size"] for s in final)
    for e in trace:
        if e["action"] == "segment_map":
            mapped -= e["size"]
        elif e["action"] == "segment_unmap":
            mapped += e["size"]
    if mapped < 0:
        raise SnapshotError(f"device {device}: the trace maps more than the final segments hold")
    first: dict = {}
    for e in trace:
        if e["action"] in ("alloc", "free_completed"):
            first.setdefault(e["addr"], e)
    blocks = [(-1, a, _round_request(e["size"]), e["size"], e.get("stream", 0))
              for a, e in first.items() if e["action"] == "free_completed"]
    for s in final:
        for b in s["blocks"]:
            if b["state"] in ALLOCATED_BLOCK_STATES and b["address"] not in first:
                blocks.append((-1, b["address"], b["size"], b.get("requested_size", b["size"]),
                               s["stream"]))
    return InitialState([], sorted(blocks, key=lambda b: b[1]), 0, mapped)


# --------------------------------------------------------------------------- compare recorded


@dataclass(frozen=True)
class DecisionMismatch:
    """Segment decisions around one request where model and recording differ."""

    event_index: int  # trace event of the request (len(trace) for decisions after the last)
    recorded: tuple  # ((action name, bytes), ...)
    model: tuple


@dataclass
class RecordedComparison:
    """How well a model reproduces the recorded allocator's segment decisions on one device."""

    device: int
    policy: str  # "caching" or "expandable" (the allocator that recorded the snapshot)
    capacity_bytes: int | None  # the capacity the replay ran at; None: unlimited
    capacity_source: str  # how it was chosen
    matched: int  # K: recorded decisions the model made too (same request, order, size)
    recorded: int  # N: segment_alloc/free/map/unmap decisions in the trace
    model_only: int  # decisions the model made that the recording did not
    empty_cache_inputs: int  # recorded releases that were empty_cache() calls (inputs)
    recorded_ooms: int
    reproduced_ooms: int
    mismatches: list
    result: ReplayResult = field(repr=False)


def infer_capacity(snapshot: dict, device: int = 0,
                   initial_reserved: int | None = None) -> tuple[int | None, str]:
    """The device capacity (bytes) the recorded run behaved as if it had, and how it was found.

    Memory snapshots do not record the capacity. Every device malloc the run made must have fit
    (lower bound: the largest reserved total reached), a release run followed by a retried malloc
    means the first attempt did not (upper bound: reserved before the release plus the retried
    size), and an oom event's ``device_free`` says how much was left. Returns the middle of the
    bounds, the oom estimate, or (None, ...) when nothing says the device was ever full.
    """
    trace = _device_trace(snapshot, device)
    if initial_reserved is None:
        initial_reserved = reconstruct_initial_state(snapshot, device).reserved_bytes
    inputs = _empty_cache_groups(trace)
    reserved = lo = initial_reserved
    hi, oom_estimate, before = None, None, None
    for i, e in enumerate(trace):
        a = e["action"]
        if a in ("segment_free", "segment_unmap"):
            if i not in inputs and before is None:
                before = reserved
            reserved -= e["size"]
        elif a in ("segment_alloc", "segment_map"):
            if before is not None:
                hi = before + e["size"] if hi is None else min(hi, before + e["size"])
            reserved += e["size"]
            lo = max(lo, reserved)
            before = None
        elif a == "oom":
            if e.get("device_free") is not None:
                est = reserved + int(e["device_free"])
                oom_estimate = est if oom_estimate is None else min(oom_estimate, est)
            before = None
        elif a == "alloc":
            before = None
    if oom_estimate is not None:
        cap = max(lo, oom_estimate if hi is None else min(oom_estimate, hi - 1))
        return cap, "reserved + device_free at the recorded oom"
    if hi is not None:
        if hi <= lo:
            return lo, "largest reserved total reached (the failure bounds are inconsistent)"
        return (lo + hi) // 2, "midway between the largest reserved total and the smallest " \
                               "failed device malloc"
    return None, "unlimited (the recorded run never failed a device malloc)"


def _is_expandable(snapshot: dict, trace: list) -> bool:
    settings = snapshot.get("allocator_settings") or {}
    return bool(settings.get("expandable_segments")) or any(
        e["action"] in ("segment_map", "segment_unmap") for e in trace)


def _lcs(a: list, b: list) -> int:
    if a == b:
        return len(a)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def compare_recorded(snapshot: dict, device: int | None = None,
                     capacity_bytes: int | None = None, **options) -> list[RecordedComparison]:
    """Replay each device's alloc/free events through the model of the recording allocator and
    compare its segment decisions with the recorded ones.

    The caching model starts from :func:`reconstruct_initial_state` and takes the addresses of
    the recorded device mallocs where its own have the same size (addresses decide best-fit
    ties); the expandable model starts with nothing mapped, and allocates the blocks live before
    the trace first when there are any (which pages held them is not recoverable). Capacity: ``capacity_bytes`` or
    :func:`infer_capacity`. Decisions (segment_alloc/segment_map, and segment_free/segment_unmap
    that are not empty_cache() calls) are attributed to the request they served, the next alloc
    or oom event; per request the recorded and model sequences of (action, bytes) are compared in
    order (longest common subsequence). Devices without events are skipped. ``options`` go to
    :func:`replay` (e.g. ``small_split_min``, ``large_page``, to test alternative rules).
    """
    traces = snapshot.get("device_traces", [])
    devices = range(len(traces)) if device is None else [device]
    out = []
    for d in devices:
        trace = _device_trace(snapshot, d)
        if trace:
            try:
                out.append(_compare_device(snapshot, d, trace, capacity_bytes, options))
            except (KeyError, TypeError, AttributeError) as exc:
                raise SnapshotError(f"malformed snapshot: {type(exc).__name__}: {exc}") from exc
    return out


def _compare_device(snapshot, device, trace, capacity_bytes, options) -> RecordedComparison:
    expandable = _is_expandable(snapshot, trace)
    policy = "expandable" if expandable else "caching"
    actions, ids, sizes, streams = _snapshot_columns(trace)
    state = reconstruct_initial_state(snapshot, device)
    prologue = 0
    if expandable and state.blocks:  # pages mapped before the trace are not recoverable
        t = snapshot_trace(snapshot, device, prologue=True)
        actions, ids, sizes, streams, prologue = (t.actions, t.ids, t.sizes, t.streams,
                                                  t.num_prologue)
    if capacity_bytes is None:
        capacity_bytes, source = infer_capacity(snapshot, device, state.reserved_bytes)
    else:
        source = "given"

    # the request each event's decisions belong to: the next alloc or oom event
    request_rows = np.flatnonzero((actions == ALLOC) | (actions == FAILED_ALLOC))
    hint_addr = np.zeros(len(actions), np.int64)
    hint_size = np.zeros(len(actions), np.int64)
    recorded: dict = {}
    num_recorded = 0
    inputs = 0
    for i, e in enumerate(trace):
        code = actions[prologue + i]
        if code == EMPTY_CACHE or (code == OTHER and e["action"] in ("segment_free",
                                                                     "segment_unmap")):
            inputs += 1
            continue
        if code not in _DECISION_NAMES:
            continue
        pos = np.searchsorted(request_rows, prologue + i)
        anchor = int(request_rows[pos]) if pos < len(request_rows) else len(actions)
        recorded.setdefault(anchor, []).append((_DECISION_NAMES[code], int(e["size"])))
        num_recorded += 1
        if code == SEGMENT_ALLOC and anchor < len(actions):
            hint_addr[anchor], hint_size[anchor] = e["addr"], e["size"]

    t = AllocatorTrace(actions, ids, sizes, streams, name="", device=device, num_prologue=prologue)
    options = {"final_layout": True, **options}
    if expandable:
        options = {k: v for k, v in options.items() if k not in ("small_split_min",
                                                                 "max_split_size")}
    result = replay(t, policy, capacity_bytes, initial_state=None if expandable else state,
                    address_hints=(hint_addr, hint_size) if not expandable else None, **options)
    model: dict = {}
    for ev, kind, size in zip(result.decision_events.tolist(), result.decision_kinds.tolist(),
                              result.decision_sizes.tolist()):
        if ev >= 0 and actions[ev] == EMPTY_CACHE:
            continue  # the model's answer to an empty_cache() input, not a decision
        model.setdefault(ev, []).append((_DECISION_NAMES[kind], size))
    matched, mismatches = 0, []
    for anchor in sorted(set(recorded) | set(model)):
        rec, mod = recorded.get(anchor, []), model.get(anchor, [])
        k = _lcs(rec, mod)
        matched += k
        if k != len(rec) or k != len(mod):
            mismatches.append(DecisionMismatch(anchor - prologue, tuple(rec), tuple(mod)))
    num_model = sum(len(v) for v in model.values())
    recorded_ooms = sum(e["action"] == "oom" for e in trace)
    return RecordedComparison(
        device=device, policy=policy, capacity_bytes=capacity_bytes, capacity_source=source,
        matched=matched, recorded=num_recorded, model_only=num_model - matched,
        empty_cache_inputs=inputs, recorded_ooms=recorded_ooms,
        reproduced_ooms=result.counters["failed_allocs_reproduced"],
        mismatches=mismatches, result=result,
    )
