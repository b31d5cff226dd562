"""Symbolic traces: a rank's allocation trace (and work) as a function of the sequence length
*and* the number of transformer layers, from traces of a few-layer model.

Tracing costs the ops dispatched, not their sizes: 22 s for a 65B rank's 80 layers, 1.5 s for 5
of them. For a fixed layout the allocation sequence of an iteration does not change with the
length (:class:`memo_ext.estimate.memory.LinearTrace`: every size is linear in it), and the
layers repeat: each section of the iteration (forward or backward of a micro-batch) is a
prefix, one block of events per layer, and a tail. So a stage of N layers is traced with
a few (k) layers at two lengths (the line in the length), and its persistent state
(weights, gradient buffers, optimizer state, which grow with the depth) is traced alone at its
own depth (``persistent_only``; no iteration run); its trace at any (length, N) is that state
followed by the k-layer iteration with a middle layer's blocks repeated N - k times.

Expansion, precisely. In each section the layers appear in one order (ascending forward,
descending backward); layer l's block runs from its first event to the next layer's first
event, so it holds the late frees the autograd engine makes between layers. The prefix, the
last layer's block with what follows it (the tail), and the ``init`` and optimizer sections are
fixed: they appear once. A middle layer M's block is copied; every copy allocates fresh
blocks, and a free refers to the allocation it ends by (section, layer offset, position among
that block's allocations), so a copy's frees land on its neighbours' copies. Frees in the
prefix or tail refer relative to the adjacent layer. Layer indices in the events and module
names follow the copies.

A stage whose layers are not all alike but repeat a pattern (MEMO with half its layers in
checkpoint mode (b), spread evenly: b a b a ...) copies a run of layers, one period of the
pattern, instead of one layer; the few-layer stage is traced with the same pattern
(memo_ext.estimate.symbolic_shape finds it).

Nothing is trusted unchecked: :meth:`SymbolicTrace.check` compares the symbolic trace with a
real trace of k + 2 layers (a period more, for a run) at a longer length, event by event
outside the stepwise scratch (reductions' scratch, split-KV accumulators), and its work. Any mismatch raises :class:`SymbolicError`, and the estimator traces the whole
stage instead.

The device peak is then a closed form: the live bytes after each event are A + B·s (sizes are
exact rationals in s, N fixed), so the allocated peak at any length is a maximum of lines, and
the longest length whose allocated peak (plus the memory outside the allocator) fits the device
bounds what any allocator model can fit (:func:`live_lines`;
memo_ext.estimate.layout.StageModel.peak_bounds).

Hand-written: no library expands a recorded allocation sequence over a model's depth.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import numpy as np

from memo_ext.estimate.memory import (
    EstimateError,
    LinearTrace,
    _pair_outside_scratch,
    sized_events,
)
from memo_ext.trace.cuda_rules import STEPWISE_SCRATCH
from memo_ext.trace import OPTIMIZER_STEP, Trace

#: Layers per stage a symbolic trace is made from by default; the copied layer. Five layers
#: leave the copied layer 2 with two neighbour blocks on each side in both directions (the
#: first and last layers of a section are not blocks: the embedding's output, the final norm
#: and the loss touch them); MEMO needs that, Megatron's policies do with three
#: (memo_ext.estimate.layout.SYMBOLIC_LAYERS).
TRACED_LAYERS = 5
COPIED_LAYER = 2

_LAYER_IN_NAME = re.compile(r"(?<=layers\.)(\d+)")
#: Phases executed as part of the backward section (megatron's recompute runs inside it).
_SECTION_OF_PHASE = {"recompute": "backward"}


class SymbolicError(EstimateError):
    """A symbolic trace that cannot be made or failed its check (the caller traces in full)."""


def _section_keys(events: list[dict]) -> list[int]:
    """Section index of each event: maximal runs of one (phase, micro-batch), recompute counted
    with backward; events outside the layers keep their run's section."""
    sections, key, current = [], None, -1
    for event in events:
        phase = _SECTION_OF_PHASE.get(event["phase"], event["phase"])
        this = (phase, event["microbatch"])
        if this != key:
            key, current = this, current + 1
        sections.append(current)
    return sections


@dataclass
class _Parts:
    """Where each event sits: (section, home layer, is_block). A block's home is its layer; a
    prefix's or tail's home is the adjacent layer (None in sections without layers)."""

    section: list[int]
    home: list[Optional[int]]
    block: list[bool]
    descending: set[int]  # sections visiting the layers last to first (backward)


def _parts(events: list[dict]) -> _Parts:
    by_section: dict[int, list[int]] = {}
    sections = _section_keys(events)
    home: list[Optional[int]] = [None] * len(events)
    block = [False] * len(events)
    descending = set()
    freed = {event["id"] for event in events if event["action"] == "free"}
    for index, section in enumerate(sections):
        by_section.setdefault(section, []).append(index)
    for section, rows in by_section.items():
        starts: dict[int, int] = {}
        for row in rows:
            layer = events[row]["layer"]
            if layer is not None and layer not in starts:
                starts[layer] = row
        order = sorted(starts, key=starts.get)
        if not order:
            continue
        # A pass over the layers, forward or backward; the warm-up's leftovers (``init``) and
        # MEMO's offloads may skip layers (MEMO keeps the last layers on the device).
        if order not in (sorted(order), sorted(order, reverse=True)):
            raise SymbolicError(f"a {events[rows[0]]['phase']} section visits the layers in the "
                                f"order {order}: not a pass over the stage")
        if order != sorted(order):
            descending.add(section)
        bounds = [starts[layer] for layer in order] + [rows[-1] + 1]
        for row in rows:
            if row < bounds[0]:
                home[row] = order[0]  # prefix
        # The last layer's rows are the tail; in ``init`` (the warm-up's leftovers) only those
        # after its own last one, when none of its own is freed later (a block is freed
        # relative to the layer freeing it): a forward warm-up leaves MEMO's host slots up to
        # the copied layer and, after them, only workspaces no layer made.
        tail_from = bounds[-2]
        if events[rows[0]]["phase"] == "init":
            own = [row for row in rows if events[row]["layer"] == order[-1]]
            if not any(events[row]["id"] in freed for row in own):
                tail_from = own[-1] + 1
        for position, layer in enumerate(order):
            for row in range(bounds[position], bounds[position + 1]):
                home[row] = layer
                block[row] = row < tail_from
    return _Parts(sections, home, block, descending)


def _rename_layers(name: Optional[str], move) -> Optional[str]:
    """``name`` with each ``layers.<n>`` renumbered to ``move(n)``."""
    if name is None or "layers." not in name:
        return name
    return _LAYER_IN_NAME.sub(lambda m: str(move(int(m.group(1)))), name)


@functools.lru_cache(maxsize=1 << 16)
def _shifted_name(name: Optional[str], shift: int) -> Optional[str]:
    """``name`` with each ``layers.<n>`` moved by ``shift`` (memoised: a stage's names
    repeat in every copy of a layer)."""
    return name if not shift else _rename_layers(name, lambda layer: layer + shift)


def expand_events(events: list[dict], layers: int, target: int, copied: int = COPIED_LAYER,
                  stage: int = 0, period: int = 1) -> list[tuple[int, dict]]:
    """The events of ``events`` (pipeline stage ``stage`` of ``layers`` layers) expanded to
    ``target`` layers: [(source row, event)], ids renumbered from 0 in order of allocation.
    The run of ``period`` layers from ``copied`` is repeated (a stage whose layers differ in
    a repeating pattern, e.g. MEMO's (a) and (b) modes, copies one period of it). ``copied``
    and module names count a stage's layers from 0; events carry the model's layer numbers
    (stage x layers + local)."""
    if target < layers:
        raise SymbolicError(f"cannot shrink a {layers}-layer trace to {target} layers")
    if not (0 < copied and copied + period < layers):
        raise SymbolicError(f"layers {copied}..{copied + period - 1} of {layers} are not "
                            "middle layers")
    extra = target - layers
    if extra % period:
        raise SymbolicError(f"{extra} layers added is not a whole number of {period}-layer "
                            "periods")
    run = range(copied, copied + period)
    events = [e if e["layer"] is None else {**e, "layer": e["layer"] - stage * layers}
              for e in events]
    parts = _parts(events)

    def position(layer: int) -> int:  # where an original (not copied) layer lands
        return layer if layer < copied + period else layer + extra

    # Each allocation's key: ("fixed", row) or ("block", section, layer, index in block).
    alloc_key: dict[int, tuple] = {}
    block_count: dict[tuple, int] = {}
    for row, event in enumerate(events):
        if event["action"] != "alloc":
            continue
        if parts.block[row]:
            where = (parts.section[row], parts.home[row])
            index = block_count.get(where, 0)
            block_count[where] = index + 1
            alloc_key[event["id"]] = ("block", *where, index)
        else:
            alloc_key[event["id"]] = ("fixed", row)

    new_ids: dict[tuple, int] = {}
    freed: set[tuple] = set()
    out: list[tuple[int, dict]] = []

    def emit(row: int, at: Optional[int]) -> None:
        """Row ``row`` as seen from layer position ``at`` (its home's position)."""
        event = events[row]
        home = parts.home[row]
        key = alloc_key.get(event["id"])
        if key is None:
            raise SymbolicError(f"event {row} frees block {event['id']}, never allocated")
        if key[0] == "block":
            _, section, layer, index = key
            if home is None:
                if layer in run:
                    raise SymbolicError(f"event {row} outside the layers refers to the copied "
                                        f"layer {layer}")
                target_layer = position(layer)
            else:
                target_layer = at + (layer - home)
            key = ("block", section, target_layer, index)
        if event["action"] == "alloc":
            if key in new_ids:
                raise SymbolicError(f"expansion allocates {key} twice")
            new_ids[key] = len(new_ids)
        elif key not in new_ids:
            raise SymbolicError(f"event {row}: expansion frees {key} before allocating it")
        elif key in freed:
            raise SymbolicError(f"event {row}: expansion frees {key} twice")
        else:
            freed.add(key)
        if home is None:  # a fixed event: its layer and names point at originals
            layer = None if event["layer"] is None else position(event["layer"])
            module = _rename_layers(event["module"], position)
        else:
            layer = None if event["layer"] is None else event["layer"] + at - home
            module = _shifted_name(event["module"], at - home)
        out.append((row, {**event, "id": new_ids[key], "module": module,
                          "layer": None if layer is None else layer + stage * target}))

    rows_by_block: dict[tuple, list[int]] = {}
    for row in range(len(events)):
        if parts.block[row]:
            rows_by_block.setdefault((parts.section[row], parts.home[row]), []).append(row)
    row = 0
    while row < len(events):
        home = parts.home[row]
        if not parts.block[row]:
            emit(row, None if home is None else position(home))
            row += 1
            continue
        section = parts.section[row]
        rows = rows_by_block[(section, home)]
        if home not in run:
            for r in rows:
                emit(r, position(home))
            row = rows[-1] + 1
            continue
        # The section enters the run at its first layer in the section's order and passes
        # every layer of it, block after block; the run is emitted once per copy.
        descending = section in parts.descending
        order = list(reversed(run)) if descending else list(run)
        if home != order[0] or any((section, layer) not in rows_by_block for layer in run):
            raise SymbolicError(f"the {events[row]['phase']} section does not pass the copied "
                                f"layers {copied}..{copied + period - 1} in order")
        copies = range(0, extra + 1, period)
        for shift in (reversed(copies) if descending else copies):
            for layer in order:
                for r in rows_by_block[(section, layer)]:
                    emit(r, layer + shift)
        row = rows_by_block[(section, order[-1])][-1] + 1
    return out


def _structure(events) -> list[tuple]:
    """Events without sizes, ids numbered by first appearance (comparable across traces).
    Persistent (``init``) allocations are compared without their names: megatron names an
    optimizer-state bucket after a parameter of it, and which one moves with the depth."""
    numbers: dict[int, int] = {}
    return [(numbers.setdefault(e["id"], len(numbers)), e["action"], e["stream"], e["layer"],
             e["phase"], e["category"], e["microbatch"], e["pool"],
             None if e["phase"] == "init" else e["module"], e["op"])
            for e in events]


def _first_difference(a: list, b: list) -> str:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"event {index}: {x} != {y}"
    return f"{len(a)} events != {len(b)}"


def _layer_work(header: dict, layer: int) -> dict:
    layers = header.get("work", {}).get("layers")
    if not layers or str(layer) not in layers:
        raise SymbolicError("the trace has no per-layer work counts (traced before they "
                            "existed); trace it again")
    return layers[str(layer)]


def _phase_work(work: dict, phase: str, keep: bool = True) -> dict:
    """``work`` (a header["work"]) of ``phase`` alone, or (``keep`` False) without it."""
    return {"phases": {p: fields for p, fields in work["phases"].items()
                       if (p == phase) == keep},
            "collectives": [c for c in work["collectives"] if (c["phase"] == phase) == keep]}


def _add_work(total: dict, layer: dict, times: int) -> dict:
    """``total`` plus ``times`` x ``layer`` (header["work"] dicts; per-layer entries dropped)."""
    phases = {phase: dict(fields) for phase, fields in total["phases"].items()}
    for phase, fields in layer["phases"].items():
        into = phases.setdefault(phase, dict.fromkeys(fields, 0))
        for name, value in fields.items():
            into[name] = into.get(name, 0) + times * value
    collectives = {(c["phase"], c["op"], tuple(c["ranks"])): dict(c)
                   for c in total["collectives"]}
    for c in layer["collectives"]:
        key = (c["phase"], c["op"], tuple(c["ranks"]))
        into = collectives.setdefault(key, {**c, "bytes": 0, "calls": 0})
        into["bytes"] += times * c["bytes"]
        into["calls"] += times * c["calls"]
    return {"phases": phases, "collectives": [collectives[k] for k in sorted(collectives)]}


@dataclass
class SymbolicTrace:
    """A stage's trace at any (sequence length, layers >= TRACED_LAYERS): the k-layer line in
    the length, its iteration expanded; the persistent state (the first ``persistent``
    events: constants, weights, gradients, optimizer state) is the deeper model's own, from
    a ``persistent_only`` trace of it (memo_ext.trace.record_iteration)."""

    line: LinearTrace                  # k layers, any length
    layers: int                        # k
    persistent: int                    # events of the k-layer persistent state
    fit_headers: tuple[dict, dict]     # the k-layer traces' headers, shorter first (work)
    copied: int = COPIED_LAYER
    period: int = 1                    # layers from ``copied`` repeated as one run

    @property
    def stage(self) -> int:
        """The pipeline stage traced."""
        return self.line.base.header.get("layout", {}).get("pp_rank", 0)

    @classmethod
    def from_traces(cls, shorter: Trace, longer: Trace, copied: int = COPIED_LAYER,
                    period: int = 1) -> "SymbolicTrace":
        """``shorter``/``longer``: the stage with k layers at two lengths."""
        layers = _stage_layers(shorter.header)
        persistent = {t.header.get("persistent_events") for t in (shorter, longer)}
        if None in persistent or len(persistent) != 1:
            raise SymbolicError("the traces do not mark their persistent state (traced before "
                                "it was marked); trace them again")
        line = LinearTrace.from_traces(shorter, longer)
        fit_headers = tuple(sorted((shorter.header, longer.header),
                                   key=lambda header: header["model"]["seq_length"]))
        return cls(line, layers, persistent.pop(), fit_headers, copied, period)

    # ------------------------------------------------------------------ instantiation
    def coefficients(self, layers: int, state: Trace
                      ) -> tuple[list[dict], list[Fraction], list[Fraction]]:
        """Every event at ``layers`` layers and its size a + b·s: the persistent events of
        ``state`` (a trace of the ``layers``-layer model; fixed sizes), then this trace's
        warm-up leftovers and iteration, expanded."""
        persistent = state.events[:state.header["persistent_events"]]
        if any(e["action"] != "alloc" for e in persistent):
            raise SymbolicError("the persistent state frees something; not a persistent trace")
        rest = self.line.base.events[self.persistent:]
        expanded = expand_events(rest, self.layers, layers, self.copied, self.stage,
                                 self.period)
        offset = len(persistent)
        events = [{**e, "id": number} for number, e in enumerate(persistent)]
        intercepts = [Fraction(e["bytes"]) for e in persistent]
        slopes = [Fraction(0)] * offset
        for row, event in expanded:
            events.append({**event, "id": event["id"] + offset})
            intercepts.append(self.line.intercepts[self.persistent + row])
            slopes.append(self.line.slopes[self.persistent + row])
        return events, intercepts, slopes

    def at(self, seq: int, layers: int, state: Trace) -> Trace:
        """The trace at ``seq`` tokens with ``layers`` layers per stage, whose persistent
        state and optimizer-phase work are ``state``'s (a trace of that model, e.g.
        ``persistent_only``); sizes rounded up where the line is not integral."""
        sized = sized_events(*self.coefficients(layers, state), seq)
        header = json.loads(json.dumps(self.line.base.header))
        header["model"]["seq_length"] = seq
        header["model"]["num_layers"] = layers * header.get("layout", {}).get("pp", 1)
        header["persistent_events"] = state.header["persistent_events"]
        header["estimated_from_seq_lengths"] = list(self.line.seqs)
        header["estimated_from_layers"] = self.layers
        header["work"] = self.work_at(seq, layers, state)
        # The optimizer's options go with its state (the few layers may have been traced
        # without its offload: memo_ext.estimate.layout.LayoutModel.build).
        header.setdefault("options", {}).update(
            {key: value for key, value in state.header.get("options", {}).items()
             if key in OPTIMIZER_OPTIONS})
        return Trace(header=header, events=sized)

    def work_headers(self, layers: int, state: Trace) -> tuple[dict, dict]:
        """Headers (model.seq_length and work) at the two fitted lengths with ``layers``
        layers, for memo_ext.estimate.cost.WorkLine.from_headers: the k-layer work, the copied
        layers' times the copies added, and the optimizer phase's from ``state`` (it passes
        over the gradient buffers, which grow with the depth)."""
        optimizer = _phase_work(state.header["work"], OPTIMIZER_STEP)
        copies = (layers - self.layers) // self.period
        headers = []
        for header in self.fit_headers:
            work = _phase_work(header["work"], OPTIMIZER_STEP, keep=False)
            for layer in range(self.copied, self.copied + self.period):
                work = _add_work(work, _layer_work(header, self.stage * self.layers + layer),
                                 copies)
            headers.append({"model": {"seq_length": header["model"]["seq_length"]},
                            "work": _add_work(work, optimizer, 1)})
        return tuple(headers)

    def work_at(self, seq: int, layers: int, state: Trace) -> dict:
        from memo_ext.estimate.cost import WorkLine

        return WorkLine.from_headers(*self.work_headers(layers, state)).at(seq)

    # ------------------------------------------------------------------ the check
    def check(self, real: Trace) -> None:
        """Raise SymbolicError unless the symbolic trace at ``real``'s length and depth (with
        ``real``'s persistent state) equals ``real`` event by event outside the stepwise
        scratch (reductions' scratch, split-KV accumulators), structure and bytes, and its work equals ``real``'s."""
        seq = real.header["model"]["seq_length"]
        layers = _stage_layers(real.header)
        mine = self.at(seq, layers, real)
        where = f"at {seq} tokens, {layers} layers"
        pairs = _pair_outside_scratch(mine.events, real.events)
        if pairs is None:
            ours = [e for e in mine.events if e["module"] not in STEPWISE_SCRATCH]
            theirs = [e for e in real.events if e["module"] not in STEPWISE_SCRATCH]
            raise SymbolicError(f"{where} the symbolic trace differs from the traced one ("
                                + _first_difference(_structure(ours), _structure(theirs)) + ")")
        for symbolic, traced in pairs:
            if symbolic is not None and traced["bytes"] != symbolic["bytes"]:
                raise SymbolicError(
                    f"{where} {symbolic['module']} ({symbolic['op']}) is {symbolic['bytes']} "
                    f"bytes symbolically, {traced['bytes']} traced")
        mismatch = _work_mismatch(mine.header["work"], real.header["work"])
        if mismatch:
            raise SymbolicError(f"{where} the symbolic work differs from the traced work: "
                                f"{mismatch}")


#: The trace header's options that describe the optimizer, whose state a symbolic trace takes
#: from the deeper model's persistent trace (:meth:`SymbolicTrace.at`).
OPTIMIZER_OPTIONS = ("use_distributed_optimizer", "optimizer", "optimizer_cpu_offload",
                     "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                     "grad_buffer_fp32")


#: Relative agreement the check asks of each work count. The fitted work is exact where a count
#: is linear (quadratic for attention) in the length; the memory traffic of chunked ops steps
#: with it (0.04% off at 1M tokens for 7B TP=4 CP=2, 0.11% for 65B TP=8 CP=8 MEMO alpha 1: the
#: line through two lengths, WorkLine's own error, not the expansion's). A layer too many or
#: too few is off by 1/(k + 2) = 14% of a per-layer count.
WORK_TOLERANCE = 1e-2


def _work_mismatch(symbolic: dict, traced: dict) -> Optional[str]:
    """The first work count (phase field, collective bytes) farther apart than
    WORK_TOLERANCE, or None. Collective call counts are not compared: WorkLine takes them from
    the shorter fitted length (a latency term; the bytes carry the bandwidth)."""
    def close(x: int, y: int) -> bool:
        return abs(x - y) <= WORK_TOLERANCE * max(abs(x), abs(y))

    for phase, fields in traced["phases"].items():
        for name, value in fields.items():
            mine = symbolic["phases"].get(phase, {}).get(name, 0)
            if not close(mine, value):
                return f"{phase} {name}: {mine} symbolic, {value} traced"
    ours = {(c["phase"], c["op"], tuple(c["ranks"])): c["bytes"] for c in symbolic["collectives"]}
    theirs = {(c["phase"], c["op"], tuple(c["ranks"])): c["bytes"] for c in traced["collectives"]}
    if ours.keys() != theirs.keys():
        return "different collectives"
    for key, value in theirs.items():
        if not close(ours[key], value):
            return f"{key} bytes: {ours[key]} symbolic, {value} traced"
    return None


def live_lines(events: list[dict], intercepts: list[Fraction], slopes: list[Fraction],
               pool: str) -> tuple[np.ndarray, np.ndarray]:
    """(A, B): after each event of ``pool`` (sizes a + b·s), A + B·s bytes are live; so the
    allocated peak at a length is a maximum of lines (floats: exact to the byte below 2**53)."""
    a, b = [], []
    live: dict[int, tuple[Fraction, Fraction]] = {}
    for event, x, y in zip(events, intercepts, slopes):
        if event["pool"] != pool:
            continue
        if event["action"] == "alloc":
            live[event["id"]] = (x, y)
        else:
            x, y = live.pop(event["id"])
            x, y = -x, -y
        a.append(float(x))
        b.append(float(y))
    return np.cumsum(a), np.cumsum(b)


def _stage_layers(header: dict) -> int:
    """Transformer layers of the traced stage."""
    model, layout = header["model"], header.get("layout", {})
    return model["num_layers"] // layout.get("pp", 1)
