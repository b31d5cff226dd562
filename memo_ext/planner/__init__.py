"""MEMO's memory planning: the bi-level plan made from an allocation trace of one training
iteration (memo_ext.trace records it), and the planned arena that serves it.

Public entry points (see docs/planning.md; the traces: docs/tracing.md):

- :class:`MemoPlanner`: ``--memo-plan`` for the trainer (trace, plan, serve).
- :func:`plan_trace` / :func:`write_plan` / :func:`read_plan` / :func:`validate_plan`: the
  bi-level plan (memo_ext.planner.plan, on memo_ext.planner.dsa's placements) and its file.
- :class:`ArenaRuntime`: a plan's layer-phase tables in the C++ arena (memo_ext.planner.arena).
"""

from memo_ext.planner.arena import (
    ArenaPhaseTagger,
    ArenaRuntime,
    ArenaShadow,
    CudaArena,
    MemoPlanner,
    install_cuda_allocator,
)
from memo_ext.planner.plan import (
    MemoryPlan,
    PlanFileError,
    plan_for_trace,
    plan_trace,
    read_plan,
    validate_plan,
    write_plan,
)

__all__ = [
    "ArenaPhaseTagger",
    "ArenaRuntime",
    "ArenaShadow",
    "CudaArena",
    "install_cuda_allocator",
    "MemoPlanner",
    "MemoryPlan",
    "PlanFileError",
    "plan_for_trace",
    "plan_trace",
    "read_plan",
    "validate_plan",
    "write_plan",
]
