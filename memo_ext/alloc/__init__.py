"""Allocator tooling: read real PyTorch CUDA memory snapshots, summarize them per device, and
replay traces through allocator models (PyTorch caching, expandable segments, GMLake stitching,
planned arena).

Entry points: ``summarize_snapshot(load_snapshot(path))`` (memo_ext.alloc.snapshot);
``replay(trace, policy, capacity_bytes)`` (memo_ext.alloc.models, rules in
docs/allocator_models.md) over traces from files (memo_ext.alloc.traces) or snapshots
(``snapshot_trace``), with arena plans from memo_ext.alloc.plans; ``compare_recorded(snapshot)``
(memo_ext.alloc.recorded); the real GMLake stitching allocator on host memory:
``HostStitchingAllocator`` and ``replay_host(trace)`` (memo_ext.alloc.stitching,
docs/stitching.md).
"""
from memo_ext.alloc.models import POLICIES, OomInfo, ReplayResult, replay, replay_policies
from memo_ext.alloc.plans import ArenaPlan, PlanError, best_fit_plan, load_plan
from memo_ext.alloc.recorded import (
    DecisionMismatch,
    InitialState,
    RecordedComparison,
    compare_recorded,
    infer_capacity,
    reconstruct_initial_state,
    snapshot_trace,
)
from memo_ext.alloc.snapshot import (
    DeviceSummary,
    OomEvent,
    SnapshotError,
    load_snapshot,
    summarize_snapshot,
)
from memo_ext.alloc.stitching import HostReplayResult, HostStitchingAllocator, replay_host
from memo_ext.alloc.traces import (
    AllocatorTrace,
    TraceError,
    load_trace,
    repeated_iterations,
    save_trace,
)

__all__ = [
    "POLICIES", "AllocatorTrace", "ArenaPlan", "DecisionMismatch", "DeviceSummary",
    "HostReplayResult", "HostStitchingAllocator", "InitialState", "OomEvent",
    "OomInfo", "PlanError", "RecordedComparison", "ReplayResult", "SnapshotError",
    "TraceError", "best_fit_plan", "compare_recorded", "infer_capacity", "load_plan",
    "load_snapshot", "load_trace", "reconstruct_initial_state", "repeated_iterations", "replay",
    "replay_host", "replay_policies",
    "save_trace", "snapshot_trace", "summarize_snapshot",
]
