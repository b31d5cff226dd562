"""Allocator models: replay an allocation trace at a given capacity under four policies.

Policies (rules and constants in docs/allocator_models.md; the models and their replay loop are
C++, csrc/allocator_models/, called through ``memo_ext._C.replay_allocator``):

- ``caching``: PyTorch's CUDACachingAllocator (512-byte rounding, small/large pools, per-stream
  best fit, splitting, merging, max_split_size, reorganisation on a failed device malloc).
- ``expandable``: expandable segments (one virtual range per stream and pool, pages mapped on
  demand, unmapped on reorganisation).
- ``stitching``: GMLake virtual memory stitching (primitive and stitched blocks, exact reuse).
- ``arena``: a planned arena (offsets from a plan file; mismatches take the caching path).

This module is the replay: :func:`replay` and :func:`replay_policies` and their results
(:class:`ReplayResult`). Its inputs live beside it: :class:`AllocatorTrace` and the trace files in
memo_ext.alloc.traces, arena plans in memo_ext.alloc.plans; memo_ext.alloc.recorded reads
snapshots as traces and compares a replay with what the recording allocator did. Bytes throughout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from memo_ext import _C
from memo_ext.alloc.plans import ArenaPlan, _plan_arrays, best_fit_plan
from memo_ext.alloc.traces import AllocatorTrace

if TYPE_CHECKING:  # recorded.py imports this module
    from memo_ext.alloc.recorded import InitialState

__all__ = ["CONSTANTS", "POLICIES", "OomInfo", "ReplayResult", "replay", "replay_policies"]

POLICIES = ("caching", "expandable", "stitching", "arena")

# The C++ models' constants (bytes), e.g. CONSTANTS["kLargeBuffer"]; explained in the C++ source.
CONSTANTS: dict = dict(_C.ALLOCATOR_CONSTANTS)
KMIN_BLOCK = CONSTANTS["kMinBlockSize"]
KSMALL_SIZE = CONSTANTS["kSmallSize"]
KSMALL_BUFFER = CONSTANTS["kSmallBuffer"]


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



# ------------------------------------------------------------------------------------ replay


def replay(trace: AllocatorTrace, policy: str = "caching", capacity_bytes: int | None = None, *,
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


def replay_policies(trace: AllocatorTrace, policies=POLICIES, capacity_bytes: int | None = None,
                    **options) -> list[ReplayResult]:
    """:func:`replay` under each of ``policies``; options go to every call where they apply."""
    per_policy = {
        "caching": ("max_split_size",), "expandable": ("large_page", "small_page"),
        "stitching": ("frag_limit", "max_sblocks"), "arena": ("plan",),
    }
    return [replay(trace, p, capacity_bytes, timelines=options.get("timelines", True),
                   **{k: v for k, v in options.items() if k in per_policy[p]})
            for p in policies]
