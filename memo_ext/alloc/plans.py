"""Arena plans for the allocator models' "arena" policy: :class:`ArenaPlan` (request index ->
offset), read from a plan file (:func:`load_plan`) or made from the trace itself by online best
fit (:func:`best_fit_plan`, C++ memo_ext._C.plan_best_fit in
csrc/allocator_models/online_best_fit.cpp), and turned into the per-event arrays the C++ model
reads. All sizes are bytes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memo_ext import _C
from memo_ext.alloc.traces import ALLOC, AllocatorTrace

__all__ = ["ArenaPlan", "PlanError", "best_fit_plan", "load_plan"]

# Requests are rounded to this many bytes (the C++ models' kMinBlockSize).
KMIN_BLOCK = _C.ALLOCATOR_CONSTANTS["kMinBlockSize"]


class PlanError(ValueError):
    """An arena plan file could not be read or does not fit the trace."""


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


def best_fit_plan(trace: AllocatorTrace) -> ArenaPlan:
    """A plan made from the trace itself by online best fit in one arena (no lifetime knowledge):
    what the arena policy uses when no plan file is given; a real MEMO plan peaks lower or equal.
    """
    r = _C.plan_best_fit(trace.actions, trace.ids, trace.sizes)
    offsets = r["offsets"][trace.actions == ALLOC]
    return ArenaPlan(dict(enumerate(offsets.tolist())), {}, int(r["arena_bytes"]),
                     source="best-fit plan of the trace")


def _plan_arrays(trace: AllocatorTrace, plan: ArenaPlan) -> tuple[np.ndarray, np.ndarray, int]:
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
