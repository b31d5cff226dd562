"""Allocator models: replay an allocation trace at a given capacity under four policies.

Policies (rules and constants in docs/allocator_models.md; the replay loop is C++,
``memo_ext._C.replay_allocator``):

- ``caching``: PyTorch's CUDACachingAllocator (512-byte rounding, small/large pools, per-stream
  best fit, splitting, merging, max_split_size, reorganisation on a failed device malloc).
- ``expandable``: expandable segments (one virtual range per stream and pool, pages mapped on
  demand, unmapped on reorganisation).
- ``stitching``: GMLake virtual memory stitching (primitive and stitched blocks, exact reuse).
- ``arena``: a planned arena (offsets from a plan file; mismatches take the caching path).

Inputs are :class:`Trace` objects: four int64 columns (action, id/address, requested bytes,
stream), read from our own trace files (:func:`load_trace`) or built from a PyTorch memory
snapshot (:func:`snapshot_trace`). Results are plain dataclasses (:class:`ReplayResult`).
:func:`compare_recorded` replays a snapshot through the model of the allocator that recorded it,
starting from the reconstructed state, and counts how many of the recorded segment decisions the
model makes too. All sizes are bytes.
"""
from __future__ import annotations

import gzip
import json
import zipfile
import zlib
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memo_ext import _C
from memo_ext.alloc.snapshot import ALLOCATED_BLOCK_STATES, SnapshotError

__all__ = [
    "ACTION_NAMES", "ALLOC", "CONSTANTS", "EMPTY_CACHE", "FAILED_ALLOC", "FREE", "OTHER",
    "POLICIES", "ArenaPlan", "DecisionMismatch", "InitialState", "OomInfo", "PlanError",
    "RecordedComparison", "ReplayResult", "Trace", "TraceError", "best_fit_plan",
    "compare_recorded", "infer_capacity", "load_plan", "load_trace", "reconstruct_initial_state",
    "replay", "replay_policies", "save_trace", "snapshot_trace",
]

POLICIES = ("caching", "expandable", "stitching", "arena")

ALLOC, FREE, OTHER = _C.ALLOC, _C.FREE, _C.OTHER
SEGMENT_ALLOC, SEGMENT_FREE = _C.SEGMENT_ALLOC, _C.SEGMENT_FREE
SEGMENT_MAP, SEGMENT_UNMAP = _C.SEGMENT_MAP, _C.SEGMENT_UNMAP
EMPTY_CACHE, FAILED_ALLOC = _C.EMPTY_CACHE, _C.FAILED_ALLOC
# The C++ models' constants (bytes), e.g. CONSTANTS["kLargeBuffer"]; explained in the C++ source.
CONSTANTS: dict = dict(_C.ALLOCATOR_CONSTANTS)
KMIN_BLOCK = CONSTANTS["kMinBlockSize"]
KSMALL_SIZE = CONSTANTS["kSmallSize"]
KSMALL_BUFFER = CONSTANTS["kSmallBuffer"]

# Action names in our trace files (and PyTorch's snapshot actions) -> codes. "free" is
# PyTorch's "free_completed": the block returns to the allocator. "oom" is a request that failed.
ACTION_NAMES = {
    "alloc": ALLOC,
    "free": FREE,
    "free_completed": FREE,
    "free_requested": OTHER,
    "segment_alloc": SEGMENT_ALLOC,
    "segment_free": SEGMENT_FREE,
    "segment_map": SEGMENT_MAP,
    "segment_unmap": SEGMENT_UNMAP,
    "empty_cache": EMPTY_CACHE,
    "oom": FAILED_ALLOC,
    "snapshot": OTHER,
    "other": OTHER,
}
_MAX_CODE = FAILED_ALLOC
_DECISION_NAMES = {
    SEGMENT_ALLOC: "segment_alloc", SEGMENT_FREE: "segment_free",
    SEGMENT_MAP: "segment_map", SEGMENT_UNMAP: "segment_unmap",
}


class TraceError(ValueError):
    """A trace file could not be read: the message names the file (and line) at fault."""


class PlanError(ValueError):
    """An arena plan file could not be read or does not fit the trace."""


# ------------------------------------------------------------------------------------ traces


@dataclass
class Trace:
    """An allocation trace: equally long int64 columns, one row per event.

    ``actions`` holds codes (ALLOC=0, FREE=1, SEGMENT_ALLOC..SEGMENT_UNMAP=2..5 recorded allocator
    decisions that the models ignore, OTHER=6, EMPTY_CACHE=7, FAILED_ALLOC=8); ``ids`` names the
    block (an address in a snapshot), ``sizes`` are requested bytes (FREE sizes are not used),
    ``streams`` the stream of the request. The first ``num_prologue`` rows are ALLOCs recreating
    the blocks that were live before a snapshot's recording started.
    """

    actions: np.ndarray
    ids: np.ndarray
    sizes: np.ndarray
    streams: np.ndarray
    name: str = ""
    device: int = 0
    num_prologue: int = 0

    def __post_init__(self):
        cols = [np.ascontiguousarray(c, dtype=np.int64) for c in
                (self.actions, self.ids, self.sizes, self.streams)]
        if any(c.ndim != 1 for c in cols) or len({len(c) for c in cols}) != 1:
            raise TraceError(f"{self.name or 'trace'}: action, addr, size and stream must be "
                             "1-D columns of equal length")
        self.actions, self.ids, self.sizes, self.streams = cols

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def num_allocs(self) -> int:
        return int(np.count_nonzero(self.actions == ALLOC))


def _codes(names, where: str) -> np.ndarray:
    try:
        return np.array([ACTION_NAMES[str(a)] for a in names], dtype=np.int64)
    except KeyError as exc:
        raise TraceError(f"{where}: unknown action {exc.args[0]!r} (expected one of "
                         f"{', '.join(sorted(ACTION_NAMES))})") from None


def load_trace(path) -> Trace:
    """Read one of our trace files (see docs/allocator_models.md, "Trace files").

    ``.npz``: int64 arrays ``action`` (codes, or action names as strings), ``addr``, ``size``,
    ``stream`` (optional, default 0), equally long. Anything else is JSON lines, optionally
    gzipped: one object per line, ``{"action": "alloc", "addr": 140, "size": 4096, "stream": 0}``;
    "action" is one of :data:`ACTION_NAMES`, "size" (bytes) is needed for "alloc" and "oom",
    "stream" defaults to 0; blank lines and lines starting with ``#`` are skipped. The files of
    memo_ext.planner's tracer (``tools/trace.py``: a header object with "format", events keyed
    "id" and "bytes", a "pool") read as they are: the header is skipped, "id"/"bytes" stand for
    "addr"/"size", and events of a pool other than "device" (host memory, memory outside the
    allocator) are left out. Raises OSError when the file cannot be opened and
    :class:`TraceError` (one line naming the file) when it is not a valid trace.
    """
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):
        return _load_npz(path)
    return _load_jsonl(path, gzipped=head.startswith(b"\x1f\x8b"))


def _load_npz(path: Path) -> Trace:
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = {"action", "addr", "size"} - set(z.files)
            if missing:
                raise TraceError(f"{path}: missing array(s) {', '.join(sorted(missing))} "
                                 "(need action, addr, size, optionally stream)")
            action, addr, size = z["action"], z["addr"], z["size"]
            stream = z["stream"] if "stream" in z.files else np.zeros(len(action), np.int64)
    except TraceError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise TraceError(f"{path}: not a readable .npz trace ({type(exc).__name__}: {exc})") \
            from exc
    if action.dtype.kind in "US":
        action = _codes(action, str(path))
    for name, col in (("action", action), ("addr", addr), ("size", size), ("stream", stream)):
        if col.dtype.kind not in "iu":
            raise TraceError(f"{path}: array {name!r} must hold integers, not {col.dtype}")
    trace = Trace(action, addr, size, stream, name=path.name)
    _check_columns(trace, str(path))
    return trace


def _load_jsonl(path: Path, gzipped: bool = False) -> Trace:
    actions, addrs, sizes, streams = [], [], [], []
    try:
        text = (gzip.decompress(path.read_bytes()) if gzipped else path.read_bytes()).decode()
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(f"{path}: not a readable gzipped trace ({exc})") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a trace (neither .npz nor UTF-8 JSON lines)") from exc
    seen_event = False
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if isinstance(rec, dict) and "format" in rec and "action" not in rec and not seen_event:
            continue  # a header line (memo_ext.planner's tracer writes one)
        if not isinstance(rec, dict) or "action" not in rec:
            raise TraceError(f"{where}: expected an object with an 'action' key")
        seen_event = True
        if rec.get("pool", "device") != "device":
            continue  # host memory or device memory outside the allocator
        code = _codes([rec["action"]], where)[0]
        try:
            addr = int(rec.get("addr", rec.get("id", 0)))
            size = int(rec.get("size", rec.get("bytes", 0)))
            stream = int(rec.get("stream", 0) or 0)
        except (TypeError, ValueError):
            raise TraceError(f"{where}: addr, size and stream must be integers") from None
        if code in (ALLOC, FAILED_ALLOC) and "size" not in rec and "bytes" not in rec:
            raise TraceError(f"{where}: an {rec['action']!r} event needs a 'size' (bytes)")
        actions.append(code)
        addrs.append(addr)
        sizes.append(size)
        streams.append(stream)
    try:
        cols = [np.array(c, np.int64) for c in (actions, addrs, sizes, streams)]
    except OverflowError:
        raise TraceError(f"{path}: a value does not fit in 64 bits") from None
    trace = Trace(*cols, name=path.name)
    _check_columns(trace, str(path))
    return trace


def _check_columns(trace: Trace, where: str) -> None:
    bad = np.flatnonzero((trace.actions < 0) | (trace.actions > _MAX_CODE))
    if bad.size:
        raise TraceError(f"{where}: event {bad[0]} has action code {trace.actions[bad[0]]} "
                         f"(expected 0..{_MAX_CODE})")
    bad = np.flatnonzero(trace.sizes < 0)
    if bad.size:
        raise TraceError(f"{where}: event {bad[0]} has a negative size")


def save_trace(trace: Trace, path) -> None:
    """Write ``trace`` as .npz (when ``path`` ends in .npz) or JSON lines (anything else)."""
    path = Path(path)
    if path.suffix == ".npz":
        with path.open("wb") as f:  # np.savez_compressed would append .npz to other names
            np.savez_compressed(f, action=trace.actions, addr=trace.ids, size=trace.sizes,
                                stream=trace.streams)
        return
    names = {code: name for name, code in reversed(ACTION_NAMES.items())}
    names[FREE], names[FAILED_ALLOC] = "free", "oom"
    with path.open("w") as f:
        for a, i, s, st in zip(trace.actions.tolist(), trace.ids.tolist(), trace.sizes.tolist(),
                               trace.streams.tolist()):
            f.write(json.dumps({"action": names[a], "addr": i, "size": s, "stream": st}) + "\n")


# ---------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class OomInfo:
    """The first request a model could not serve."""

    event_index: int  # row of the trace
    request_bytes: int  # requested bytes
    stream: int
    count: int  # requests that failed in the whole replay


@dataclass
class ReplayResult:
    """What one policy did with one trace. Bytes throughout.

    ``peak_allocated_bytes`` sums the 512-byte-rounded requests that are live at once: the same
    for every policy that serves them all, so ``fragmentation = 1 - peak allocated / peak
    reserved`` compares policies on the memory they had to reserve for it.
    """

    policy: str
    trace_name: str
    device: int
    capacity_bytes: int | None  # None: unlimited
    num_events: int
    peak_allocated_bytes: int
    peak_allocated_event: int  # first event reaching the peak; -1: the starting state
    peak_requested_bytes: int
    peak_reserved_bytes: int
    final_allocated_bytes: int
    final_reserved_bytes: int
    fragmentation: float
    device_mallocs: int  # cudaMalloc calls, page maps (expandable), physical chunk allocations
    device_frees: int  # cudaFree calls, page unmaps, physical releases
    reorganisations: int  # failed device mallocs answered by freeing the cache and retrying
    oom: OomInfo | None
    unmatched_frees: int  # frees of ids the model never allocated
    counters: dict  # policy-specific (stitching: exact_hits, ...; arena: fallbacks, ...)
    allocated_timeline: np.ndarray = field(repr=False)  # bytes after each event
    reserved_timeline: np.ndarray = field(repr=False)
    # every device malloc/free or page map/unmap the model made: event row, action code, bytes
    decision_events: np.ndarray = field(repr=False)
    decision_kinds: np.ndarray = field(repr=False)
    decision_sizes: np.ndarray = field(repr=False)
    decision_addrs: np.ndarray = field(repr=False)
    # with final_layout=True: (k, 3) rows of address, bytes, state (0 free, 1 allocated,
    # 2 unmapped) of every block at the end of the replay
    final_layout: np.ndarray | None = field(default=None, repr=False)


# --------------------------------------------------------------------------------- arena plans


@dataclass(frozen=True)
class ArenaPlan:
    """Planned arena offsets: ``placements`` maps request index k (the k-th ALLOC of the trace,
    from 0) to a byte offset; ``sizes`` optionally to the bytes the planner expected;
    ``arena_bytes`` is the arena size (None: derived from the trace as max offset + size)."""

    placements: dict
    sizes: dict = field(default_factory=dict)
    arena_bytes: int | None = None
    source: str = ""


def load_plan(path) -> ArenaPlan:
    """Read a plan file: a JSON list of ``{"request": k, "offset": bytes}`` objects (an optional
    ``"size"`` is the planned bytes: a larger request falls back), or an object
    ``{"arena_bytes": N, "placements": [...]}``. Raises OSError or :class:`PlanError`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"{path}: not a JSON plan ({exc})") from None
    arena = None
    if isinstance(data, dict):
        arena = data.get("arena_bytes")
        data = data.get("placements")
    if not isinstance(data, list):
        raise PlanError(f"{path}: expected a JSON list of {{\"request\", \"offset\"}} objects")
    placements, sizes = {}, {}
    for n, p in enumerate(data):
        try:
            k, off = int(p["request"]), int(p["offset"])
            if "size" in p:
                sizes[k] = int(p["size"])
        except (KeyError, TypeError, ValueError):
            raise PlanError(f"{path}: placement {n} needs integer 'request' and 'offset'") \
                from None
        if k < 0 or off < 0:
            raise PlanError(f"{path}: placement {n} has a negative request index or offset")
        placements[k] = off
    if arena is not None and (not isinstance(arena, int) or arena < 0):
        raise PlanError(f"{path}: arena_bytes must be a non-negative integer")
    return ArenaPlan(placements, sizes, arena, source=str(path))


def best_fit_plan(trace: Trace) -> ArenaPlan:
    """A plan made from the trace itself by online best fit in one arena (no lifetime knowledge):
    what the arena policy uses when no plan file is given; a real MEMO plan peaks lower or equal.
    """
    r = _C.plan_best_fit(trace.actions, trace.ids, trace.sizes)
    offsets = r["offsets"][trace.actions == ALLOC]
    return ArenaPlan(dict(enumerate(offsets.tolist())), {}, int(r["arena_bytes"]),
                     source="best-fit plan of the trace")


def _plan_arrays(trace: Trace, plan: ArenaPlan) -> tuple[np.ndarray, np.ndarray, int]:
    alloc_rows = np.flatnonzero(trace.actions == ALLOC)
    offsets = np.full(len(trace), -1, np.int64)
    sizes = np.full(len(trace), -1, np.int64)
    ks = np.fromiter(plan.placements.keys(), np.int64, len(plan.placements))
    if len(ks) and ks.max() >= len(alloc_rows):
        raise PlanError(f"{plan.source or 'plan'}: request {ks[ks >= len(alloc_rows)].min()} "
                        f"does not exist (the trace has {len(alloc_rows)} allocations)")
    offsets[alloc_rows[ks]] = np.fromiter(plan.placements.values(), np.int64, len(ks))
    for k, s in plan.sizes.items():
        if k < len(alloc_rows):
            sizes[alloc_rows[k]] = s
    arena = plan.arena_bytes
    if arena is None:
        rounded = np.maximum(KMIN_BLOCK, -(-trace.sizes // KMIN_BLOCK) * KMIN_BLOCK)
        planned = offsets >= 0
        arena = int((offsets[planned] + rounded[planned]).max()) if planned.any() else 0
    return offsets, sizes, arena


def repeated_iterations(trace, iterations: int) -> tuple[Trace, list[int], list[int]]:
    """The allocator's view of ``iterations`` training iterations of a memo_ext.planner trace
    (anything with ``.events``, dicts with id/action/bytes/phase/pool): the persistent
    (``init``) allocations once, then the iteration's events ``iterations`` times with its
    blocks renamed per iteration. Returns the trace, the row at which each iteration starts,
    and for each row of one iteration its row among the trace's device events."""
    device = [e for e in trace.events if e["pool"] == "device"]
    persistent = [e for e in device if e["phase"] == "init"]
    persistent_ids = {e["id"] for e in persistent}
    step_rows = [row for row, e in enumerate(device) if e["phase"] != "init"]
    step = [device[row] for row in step_rows]
    if any(e["action"] == "free" and e["id"] in persistent_ids for e in step):
        raise ValueError("the iteration frees a persistent allocation: cannot repeat it")
    id_span = 1 + max((e["id"] for e in device), default=0)
    actions = [ALLOC] * len(persistent)
    sizes = [e["bytes"] for e in persistent]
    starts = []
    step_actions = [ALLOC if e["action"] == "alloc" else FREE for e in step]
    step_ids = np.array([e["id"] for e in step], np.int64)
    step_sizes = [e["bytes"] if e["action"] == "alloc" else 0 for e in step]
    id_columns = [np.array([e["id"] for e in persistent], np.int64)]
    for iteration in range(iterations):
        starts.append(len(actions))
        actions += step_actions
        sizes += step_sizes
        id_columns.append(step_ids + (iteration + 1) * id_span)
    return (Trace(np.array(actions), np.concatenate(id_columns), np.array(sizes),
                  np.zeros(len(actions)), name=f"{iterations} iterations"), starts, step_rows)


# ------------------------------------------------------------------------------------ replay


def replay(trace: Trace, policy: str = "caching", capacity_bytes: int | None = None, *,
           max_split_size: int | None = None, plan: ArenaPlan | None = None,
           frag_limit: int | None = None, max_sblocks: int | None = None,
           large_page: int | None = None, small_page: int | None = None,
           small_split_min: int | None = None, initial_state: InitialState | None = None,
           address_hints=None, timelines: bool = True,
           final_layout: bool = False) -> ReplayResult:
    """Replay ``trace`` through one allocator model.

    capacity_bytes: device memory the allocator may reserve (None: unlimited). max_split_size
    (caching, bytes): blocks this large are not split; small_split_min (caching, bytes, default
    512): the smallest remainder split off a small-pool block. plan (arena): placements; None uses
    :func:`best_fit_plan`. frag_limit, max_sblocks (stitching): fragmentation limit in bytes and
    the cap on cached stitched blocks. large_page, small_page (expandable): mapping granularity.
    initial_state, address_hints (caching): the segments that existed before the trace and the
    recorded device-malloc addresses per event (used by :func:`compare_recorded`).
    final_layout (caching, expandable): also return every block at the end.
    Raises ValueError for an unknown policy or malformed columns.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if capacity_bytes is not None and capacity_bytes <= 0:
        raise ValueError(f"capacity must be positive bytes, got {capacity_bytes}")
    cfg: dict = {"capacity": capacity_bytes or 0, "max_split_size": max_split_size,
                 "frag_limit": frag_limit, "max_sblocks": max_sblocks,
                 "large_page": large_page, "small_page": small_page,
                 "small_split_min": small_split_min, "final_layout": int(final_layout)}
    if policy == "arena":
        plan = plan if plan is not None else best_fit_plan(trace)
        cfg["plan_offset"], cfg["plan_size"], cfg["arena_bytes"] = _plan_arrays(trace, plan)
    if policy == "caching" and initial_state is not None:
        cfg["initial_segments"], cfg["initial_blocks"] = initial_state.arrays()
    if policy == "caching" and address_hints is not None:
        cfg["hint_addr"], cfg["hint_size"] = address_hints
    r = _C.replay_allocator(policy, trace.actions, trace.ids, trace.sizes, trace.streams, cfg,
                            timelines)
    peak_reserved = int(r["peak_reserved"])
    oom = None
    if r["num_ooms"]:
        oom = OomInfo(int(r["first_oom_index"]), int(r["first_oom_request"]),
                      int(r["first_oom_stream"]), int(r["num_ooms"]))
    counters = {k: int(v) for k, v in dict(r["extra"]).items()}
    for key in ("duplicate_allocs", "failed_allocs_reproduced", "failed_allocs_succeeded"):
        counters[key] = int(r[key])
    return ReplayResult(
        policy=policy, trace_name=trace.name, device=trace.device,
        capacity_bytes=capacity_bytes, num_events=len(trace),
        peak_allocated_bytes=int(r["peak_allocated"]),
        peak_allocated_event=int(r["peak_allocated_index"]),
        peak_requested_bytes=int(r["peak_requested"]), peak_reserved_bytes=peak_reserved,
        final_allocated_bytes=int(r["final_allocated"]),
        final_reserved_bytes=int(r["final_reserved"]),
        fragmentation=1.0 - r["peak_allocated"] / peak_reserved if peak_reserved else 0.0,
        device_mallocs=int(r["device_mallocs"]), device_frees=int(r["device_frees"]),
        reorganisations=int(r["reorganisations"]), oom=oom,
        unmatched_frees=int(r["unmatched_frees"]), counters=counters,
        allocated_timeline=r["allocated"], reserved_timeline=r["reserved"],
        decision_events=r["decision_event"], decision_kinds=r["decision_kind"],
        decision_sizes=r["decision_size"], decision_addrs=r["decision_addr"],
        final_layout=r["final_layout"],
    )


def replay_policies(trace: Trace, policies=POLICIES, capacity_bytes: int | None = None,
                    **options) -> list[ReplayResult]:
    """:func:`replay` under each of ``policies``; options go to every call where they apply."""
    per_policy = {
        "caching": ("max_split_size",), "expandable": ("large_page", "small_page"),
        "stitching": ("frag_limit", "max_sblocks"), "arena": ("plan",),
    }
    return [replay(trace, p, capacity_bytes, timelines=options.get("timelines", True),
                   **{k: v for k, v in options.items() if k in per_policy[p]})
            for p in policies]


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
                   name: str = "") -> Trace:
    """One device's trace of a loaded snapshot as a :class:`Trace`.

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
    return Trace(actions, ids, sizes, streams, name=name, device=device, num_prologue=k)


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

    t = Trace(actions, ids, sizes, streams, name="", device=device, num_prologue=prologue)
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

