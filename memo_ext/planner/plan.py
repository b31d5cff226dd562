"""MEMO's bi-level memory plan of one training iteration, from a phase-tagged trace.

Level 1 (docs/memo.md "Bi-level memory planning"): each transformer layer's forward, and separately
its backward (its recomputation included), is a *layer phase*: the rows of the trace from its
first to its last event. A request allocated and freed inside its own layer phase is
*transient*. Layer phases whose transient request sequences are equal (same sizes, same order of
allocs and frees) share one DSA problem: one plan serves every layer of that kind.

Level 2: the whole iteration, with each layer phase replaced by one pseudo block of its level-1
peak alive over the phase, and every other request of the iteration (skeletal activations that
cross layers, embedding, head, loss, gradients of activations) as itself. Persistent state
(phase ``init``: parameters, gradient buffers, optimizer states) and memory outside the caching
allocator stay out of the plan and on the normal allocator.

The bi-level arena is the level-2 peak; request k of a layer phase lives at
``base(phase) + offset_k``, every other planned request at its level-2 offset. A pseudo block
holds its phase's level-1 peak over the whole phase, so the composition can exceed the
iteration's own lower bound (13% on 7B full recompute at 128K: a backward phase peaks while
the layer-crossing gradients are small). The paper needs the two levels to keep its MIP small;
the greedy placement scales to the whole iteration (5k requests in ~2 s), so the planner also
places the iteration in one level and keeps whichever arena is smaller ("single level" when
that wins). Both are reported. :func:`validate_plan` checks the composed
placement against the trace: no two planned requests alive together overlap, and all lie inside
the arena.

Plan files are JSON (``PLAN_FORMAT``/``PLAN_VERSION``) and carry the SHA-256 of the trace's
planned request sequence, so a plan made for another trace (another model, layout or sequence
length) is refused instead of misplacing tensors; they are written to a temporary name and
renamed, so a crash never leaves half a plan.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from memo_ext.config import MemoConfigError
from memo_ext.planner.dsa import (
    DEFAULT_TIME_LIMIT_S,
    Placement,
    align,
    check_placement,
    lower_bound,
    place,
    requests_from_events,
)
from memo_ext.trace import BACKWARD, FORWARD, INIT, POOL_DEVICE, RECOMPUTE, Trace

PLAN_FORMAT = "memo-plan"
PLAN_VERSION = 1

#: Layer phases: the forward, and the backward with the recomputation that precedes it.
PHASE_GROUPS = {FORWARD: "forward", RECOMPUTE: "backward", BACKWARD: "backward"}


class PlanFileError(MemoConfigError):
    """A plan file that cannot be used: unreadable, not a plan, another version, or made for
    another trace or run. The message is one line naming the file and the fix (a
    MemoConfigError, so the trainer exits with status 2 and that line)."""


# ------------------------------------------------------------------------------ layer phases

@dataclass
class LayerPhase:
    """One run of a layer's forward or backward: trace rows [first, last]. A layer phase ends
    where an allocation of another layer's phase comes (events outside layers do not end it),
    so the micro-batches of a step, and the iterations, are separate phases."""

    layer: int
    group: str              # "forward" or "backward"
    microbatch: Optional[int]
    index: int              # position among the phases of the trace
    first: int
    last: int
    transient_rows: list[int] = field(default_factory=list)  # alloc and free rows, in order
    alloc_rows: list[int] = field(default_factory=list)  # every alloc tagged with the phase

    @property
    def key(self) -> tuple:
        return (self.layer, self.group, self.microbatch, self.index)


def _device_events(trace: Trace) -> list[dict]:
    return [e for e in trace.events if e["pool"] == POOL_DEVICE]


def _phase_of(event: dict) -> Optional[tuple]:
    group = PHASE_GROUPS.get(event["phase"])
    if group is None or event["layer"] is None:
        return None
    return (event["layer"], group, event["microbatch"])


def layer_phases(events: list[dict]) -> list[LayerPhase]:
    """The layer phases of a device event list, in order, and their transient requests."""
    phases: list[LayerPhase] = []
    current: Optional[LayerPhase] = None
    alloc_phase: dict[int, tuple[int, LayerPhase]] = {}  # block id -> (alloc row, its phase)
    for row, event in enumerate(events):
        tag = _phase_of(event)
        # Only allocations open phases: the runtime arena sees allocations alone, and a free
        # tagged with another layer (a gradient released late) must not split a phase.
        if tag is not None and event["action"] == "alloc" and (
                current is None or tag != current.key[:3]):
            current = LayerPhase(*tag, index=len(phases), first=row, last=row)
            phases.append(current)
        if tag is not None and current is not None and tag == current.key[:3]:
            current.last = row
        if event["action"] == "alloc":
            if tag is not None:
                alloc_phase[event["id"]] = (row, current)
                current.alloc_rows.append(row)
        elif event["id"] in alloc_phase:
            alloc_row, phase = alloc_phase.pop(event["id"])
            if phase is current and tag == phase.key[:3]:
                phase.transient_rows += [alloc_row, row]
    for phase in phases:
        phase.transient_rows.sort()
    return phases


def _signature(events: list[dict], phase: LayerPhase) -> tuple:
    """What makes two layer phases share a level-1 plan and a runtime table: the transient
    sequence of actions and aligned sizes (blocks named by their order of allocation), and the
    aligned size of every request the phase makes, transient or not."""
    names: dict[int, int] = {}
    out = []
    for row in phase.transient_rows:
        event = events[row]
        if event["action"] == "alloc":
            names[event["id"]] = len(names)
            out.append(("alloc", names[event["id"]], align(event["bytes"])))
        else:
            out.append(("free", names[event["id"]], 0))
    transient = set(phase.transient_rows)
    requests = tuple((align(events[row]["bytes"]), row in transient) for row in phase.alloc_rows)
    return tuple(out), requests


# ------------------------------------------------------------------------------ the planner

@dataclass
class LevelResult:
    """One DSA problem's result, as stored in the plan file."""

    name: str
    peak: int
    lower_bound: int
    gap: float
    method: str
    status: str
    seconds: float
    requests: int
    blocks: int
    pairs: int

    @classmethod
    def of(cls, name: str, placement: Placement, requests: int) -> "LevelResult":
        return cls(name, placement.peak, placement.lower_bound, placement.gap, placement.method,
                   placement.status, placement.seconds, requests, placement.num_blocks,
                   placement.num_pairs)

    def line(self) -> str:
        return (f"plan peak {self.peak} lower bound {self.lower_bound} "
                f"gap {100 * self.gap:.2f}%")


@dataclass
class MemoryPlan:
    """A bi-level plan: ``offsets`` maps each planned alloc's row in the device event list to
    its arena offset; ``level1`` and ``level2`` say how each problem went."""

    trace_digest: Optional[str]  # None: planned without one (plan_trace(digest=False))
    arena_bytes: int
    offsets: dict[int, int]
    sizes: dict[int, int]
    level1: list[dict]          # per kind: name, layer phases, peak, offsets of its requests
    level2: LevelResult
    iteration_lower_bound: int  # max live bytes of the planned requests themselves
    header: dict = field(default_factory=dict)
    single_level: Optional[LevelResult] = None
    chosen: str = "bi-level"    # which placement the offsets are: "bi-level" or "single level"
    bi_level_arena_bytes: int = 0

    @property
    def iteration_gap(self) -> float:
        """Arena vs the max bytes the planned requests ever have alive at once."""
        bound = self.iteration_lower_bound
        return (self.arena_bytes - bound) / bound if bound else 0.0


def trace_digest(events: list[dict]) -> str:
    """SHA-256 of the device request sequence a plan depends on: actions, aligned sizes, the
    alloc each free closes, phases, layers and micro-batches; per event, the bytes of
    ``json.dumps([action, alloc number, size, phase, layer, micro-batch])`` (what plan files
    store: a 32-layer trace has ~100,000 events, so they are written here without a
    ``json.dumps`` call each)."""
    order: dict[int, int] = {}
    encoded: dict = {}

    def encode(value) -> str:
        if type(value) is int:
            return str(value)
        key = (type(value), value)  # True == 1 == 1.0 as dict keys
        if key not in encoded:
            encoded[key] = json.dumps(value)
        return encoded[key]

    parts = []
    for event in events:
        if event["action"] == "alloc":
            order[event["id"]] = len(order)
            size = align(event["bytes"])
        else:
            size = 0
        parts.append(f"[{encode(event['action'])}, {encode(order.get(event['id']))}, "
                     f"{encode(size)}, {encode(event['phase'])}, {encode(event['layer'])}, "
                     f"{encode(event['microbatch'])}]")
    return hashlib.sha256("".join(parts).encode()).hexdigest()


def plan_trace(trace: Trace, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
               use_mip: bool = True, digest: bool = True) -> MemoryPlan:
    """Plan the trace's iteration at both levels (module docstring). Without ``digest`` the
    plan names no trace (:func:`write_plan` refuses it): for a caller that replays it at once,
    as the estimator does for each length it tries (the digest of a 32-layer stage is ~0.7 s)."""
    events = _device_events(trace)
    phases = layer_phases(events)
    kinds: dict[tuple, list[LayerPhase]] = {}
    for phase in phases:
        kinds.setdefault(_signature(events, phase), []).append(phase)

    offsets: dict[int, int] = {}
    sizes: dict[int, int] = {}
    level1 = []
    phase_peak: dict[tuple, int] = {}
    phase_local: dict[tuple, list[tuple[int, int]]] = {}   # key -> [(alloc row, local offset)]
    for number, (signature, members) in enumerate(kinds.items()):
        representative = members[0]
        sequence = list(signature[0])
        requests, _ = requests_from_events(sequence)
        placement = place(requests, time_limit_s, use_mip)
        group = representative.group
        layers = sorted({p.layer for p in members})
        name = f"level 1 {group} #{number} (layers {_ranges(layers)}, {len(members)} phases)"
        transient_allocs = [row for row in representative.transient_rows
                            if events[row]["action"] == "alloc"]
        local = dict(zip(transient_allocs, placement.offsets))
        level1.append({**asdict(LevelResult.of(name, placement, len(requests))),
                       "group": group, "phases": [list(p.key) for p in members],
                       # What the runtime arena serves: every request of the phase, in order,
                       # with its offset (-1: outlives the phase, the normal allocator's).
                       "table": [[size, local.get(row, -1)] for row, (size, _) in
                                 zip(representative.alloc_rows, signature[1])],
                       # The bytes each of those requests asked for: the runtime arena serves a
                       # request of one alignment unit only if it asks for these very bytes (a
                       # kernel's untraced 16-byte RNG state must not take a 4-byte sum's entry).
                       "requested": [events[row]["bytes"] for row in representative.alloc_rows]})
        for phase in members:
            alloc_rows = [row for row in phase.transient_rows if events[row]["action"] == "alloc"]
            phase_peak[phase.key] = placement.peak
            phase_local[phase.key] = list(zip(alloc_rows, placement.offsets))

    # Level 2: every iteration request that is not transient in its layer phase, plus one pseudo
    # block per layer phase spanning it.
    transient = {row for phase in phases for row in phase.transient_rows}
    opens = {phase.first: phase for phase in phases}
    closes: dict[int, list[LayerPhase]] = {}
    for phase in phases:
        closes.setdefault(phase.last, []).append(phase)
    persistent_ids = {e["id"] for e in events if e["action"] == "alloc" and e["phase"] == INIT}
    sequence, owners = [], []   # owners[k]: ("phase", key) or ("row", alloc row) per alloc
    for row, event in enumerate(events):
        phase = opens.get(row)
        if phase is not None and phase_peak[phase.key]:
            sequence.append(("alloc", ("phase", phase.key), phase_peak[phase.key]))
            owners.append(("phase", phase.key))
        if row not in transient and event["id"] not in persistent_ids:
            sequence.append((event["action"], ("row", event["id"]), event["bytes"]))
            if event["action"] == "alloc":
                owners.append(("row", row))
        for closing in closes.get(row, []):
            if phase_peak[closing.key]:
                sequence.append(("free", ("phase", closing.key), 0))
    requests, _ = requests_from_events(sequence)
    placement = place(requests, time_limit_s, use_mip)
    level2 = LevelResult.of("level 2 whole iteration (layer phases as pseudo blocks)",
                            placement, len(requests))
    base: dict[tuple, int] = {}
    for (kind, what), offset, request in zip(owners, placement.offsets, requests):
        if kind == "phase":
            base[what] = offset
        else:
            offsets[what] = offset
            sizes[what] = request.size
    for key, local in phase_local.items():
        for row, offset in local:
            offsets[row] = base[key] + offset
            sizes[row] = align(events[row]["bytes"])
    planned = [(e["action"], e["id"], e["bytes"]) for e in events if e["id"] not in persistent_ids]
    planned_requests, planned_alloc_positions = requests_from_events(planned)
    single = place(planned_requests, time_limit_s, use_mip)
    single_level = LevelResult.of("single level whole iteration", single,
                                  len(planned_requests))
    chosen = "bi-level"
    arena = placement.peak
    if single.peak < placement.peak:
        row_of_id = {e["id"]: row for row, e in enumerate(events) if e["action"] == "alloc"}
        ids = [planned[i][1] for i in planned_alloc_positions]
        offsets = {row_of_id[i]: offset for i, offset in zip(ids, single.offsets)}
        sizes = {row_of_id[i]: r.size for i, r in zip(ids, planned_requests)}
        chosen, arena = "single level", single.peak
    plan = MemoryPlan(trace_digest=trace_digest(events) if digest else None, arena_bytes=arena,
                      offsets=offsets, sizes=sizes, level1=level1, level2=level2,
                      iteration_lower_bound=lower_bound(planned_requests),
                      header={k: trace.header.get(k) for k in ("model", "layout", "options")},
                      single_level=single_level, chosen=chosen,
                      bi_level_arena_bytes=placement.peak)
    # The digest is this very trace's: only the placement is checked (validate_plan's digest
    # is most of a 65B estimate's planning time after the placement itself).
    _validate_placement(plan, events)
    return plan


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


# ------------------------------------------------------------------------------ validation

def validate_plan(plan: MemoryPlan, trace: Trace) -> None:
    """Raise ValueError unless ``plan`` was made for ``trace`` and its composed placement is
    sound: every planned request inside the arena, no two alive at once overlapping."""
    events = _device_events(trace)
    if plan.trace_digest is None:
        raise ValueError("the plan names no trace (planned with digest=False)")
    digest = trace_digest(events)
    if digest != plan.trace_digest:
        raise ValueError(f"the plan was made for trace {plan.trace_digest[:12]}, not this one "
                         f"({digest[:12]})")
    _validate_placement(plan, events)


def _validate_placement(plan: MemoryPlan, events: list[dict]) -> None:
    """:func:`validate_plan` but the digest: ``events`` are the trace's device events."""
    rows = sorted(plan.offsets)
    for row in rows:
        if row >= len(events) or events[row]["action"] != "alloc":
            raise ValueError(f"the plan places row {row}, which is not an allocation")
    planned_ids = {events[row]["id"]: row for row in rows}
    sequence = [(e["action"], e["id"], e["bytes"]) for e in events if e["id"] in planned_ids]
    requests, alloc_rows = requests_from_events(sequence)
    id_rows = [planned_ids[sequence[i][1]] for i in alloc_rows]
    check_placement(requests, [plan.offsets[row] for row in id_rows], plan.arena_bytes)


# ------------------------------------------------------------------------------ plan files

def write_plan(plan: MemoryPlan, path) -> None:
    """Write ``plan`` as JSON through a temporary file and a rename."""
    if plan.trace_digest is None:
        raise ValueError("the plan names no trace (planned with digest=False); plan the trace "
                         "again with its digest to write it")
    payload = {
        "format": PLAN_FORMAT, "version": PLAN_VERSION, "trace_digest": plan.trace_digest,
        "arena_bytes": plan.arena_bytes,
        "iteration_lower_bound": plan.iteration_lower_bound,
        "level1": plan.level1, "level2": asdict(plan.level2), "trace_header": plan.header,
        "single_level": None if plan.single_level is None else asdict(plan.single_level),
        "chosen": plan.chosen, "bi_level_arena_bytes": plan.bi_level_arena_bytes,
        "placements": [{"row": row, "offset": plan.offsets[row], "size": plan.sizes[row]}
                       for row in sorted(plan.offsets)],
    }
    path = os.fspath(path)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(payload, f, separators=(",", ":"))
    os.replace(partial, path)


def read_plan(path) -> MemoryPlan:
    """Read a plan file; PlanFileError (one line naming the file) for anything unusable."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanFileError(f"{path}: no such plan file; make one with tools/memo_plan.py") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFileError(f"{path}: not a readable JSON plan ({exc.__class__.__name__}); "
                            "make a new one with tools/memo_plan.py") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise PlanFileError(f"{path}: not a {PLAN_FORMAT} file; make one with "
                            "tools/memo_plan.py")
    if data.get("version") != PLAN_VERSION:
        raise PlanFileError(f"{path}: plan version {data.get('version')!r}, this build reads "
                            f"{PLAN_VERSION}; re-plan with tools/memo_plan.py")
    try:
        placements = data["placements"]
        offsets = {int(p["row"]): int(p["offset"]) for p in placements}
        sizes = {int(p["row"]): int(p["size"]) for p in placements}
        level2 = LevelResult(**data["level2"])
        plan = MemoryPlan(trace_digest=str(data["trace_digest"]),
                          arena_bytes=int(data["arena_bytes"]), offsets=offsets, sizes=sizes,
                          level1=list(data["level1"]), level2=level2,
                          iteration_lower_bound=int(data["iteration_lower_bound"]),
                          header=dict(data.get("trace_header") or {}),
                          single_level=(LevelResult(**data["single_level"])
                                        if data.get("single_level") else None),
                          chosen=str(data.get("chosen", "bi-level")),
                          bi_level_arena_bytes=int(data.get("bi_level_arena_bytes", 0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanFileError(f"{path}: corrupted plan ({exc.__class__.__name__}: {exc}); "
                            "re-plan with tools/memo_plan.py") from None
    if plan.arena_bytes < 0 or any(v < 0 for v in offsets.values()):
        raise PlanFileError(f"{path}: corrupted plan (negative offset or arena); re-plan with "
                            "tools/memo_plan.py")
    return plan


def plan_for_trace(path, trace: Trace) -> MemoryPlan:
    """:func:`read_plan`, then refuse (PlanFileError) a plan made for another trace or one that
    does not validate against it."""
    plan = read_plan(path)
    try:
        validate_plan(plan, trace)
    except ValueError as exc:
        raise PlanFileError(f"{path}: {exc}; re-plan this run with tools/memo_plan.py") from None
    return plan


def arena_plan(plan: MemoryPlan, trace: Trace, iterations: Optional[int] = None):
    """The plan as memo_ext.alloc's ArenaPlan (request k = the k-th allocation), so the
    allocator models can replay it ("arena" policy): for the trace's own device events, or,
    with ``iterations``, for memo_ext.alloc.repeated_iterations(trace, iterations) (the same
    offsets in every iteration; the persistent state is not planned)."""
    import numpy as np

    from memo_ext.alloc import ArenaPlan, repeated_iterations
    from memo_ext.alloc.traces import ALLOC

    if iterations is None:
        events = _device_events(trace)
        k_of_row = {row: k for k, row in enumerate(
            row for row, e in enumerate(events) if e["action"] == "alloc")}
        return ArenaPlan({k_of_row[row]: offset for row, offset in plan.offsets.items()},
                         {k_of_row[row]: plan.sizes[row] for row in plan.offsets},
                         plan.arena_bytes, source="memo_ext.planner plan")
    repeated, starts, step_rows = repeated_iterations(trace, iterations)
    alloc_index = np.cumsum(repeated.actions == ALLOC) - 1
    placements, sizes = {}, {}
    for start in starts:
        for position, row in enumerate(step_rows):
            if row in plan.offsets:
                k = int(alloc_index[start + position])
                placements[k] = plan.offsets[row]
                sizes[k] = plan.sizes[row]
    return ArenaPlan(placements, sizes, plan.arena_bytes, source="memo_ext.planner plan")
