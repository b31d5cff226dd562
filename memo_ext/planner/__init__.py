"""MEMO's memory planning: allocation traces of one training iteration, the bi-level plan made
from them, and the planned arena that serves it.

Public entry points (see docs/tracing.md and docs/planning.md):

- :class:`MemoPlanner`: ``--memo-plan`` for the trainer (trace, plan, serve).
- :func:`plan_trace` / :func:`write_plan` / :func:`read_plan` / :func:`validate_plan`: the
  bi-level plan (memo_ext.planner.plan, on memo_ext.planner.dsa's placements) and its file.
- :class:`ArenaRuntime`: a plan's layer-phase tables in the C++ arena (memo_ext.planner.arena).

- :class:`AllocationRecorder`: a storage-level dispatch mode that records every device
  allocation and free with its phase, layer, micro-batch and category.
- :func:`record_iteration`: one training iteration of a model chunk (persistent state,
  forward and backward of the micro-batches in flight, gradient sync) under the recorder.
- :func:`fake_distributed`: a fake process group + megatron parallel state, so one process
  produces the per-rank trace of any layout; inside it, :func:`fake_tensors` (FakeTensorMode on
  the CPU device) traces any size without allocating its memory.
- :func:`persistent_tensors` / :func:`allocate_optimizer_states`: what a rank holds besides
  activations (DDP's parameter and gradient buffers, the optimizer's shards).
- :func:`write_trace` / :func:`read_trace` / :func:`summarize`: the gzipped JSON-lines format.
- :func:`write_snapshot` / :func:`trace_to_snapshot`: the same trace as a PyTorch memory
  snapshot pickle, for PyTorch's memory_viz.
- :func:`record_cuda_trace`: the same event format from a real CUDA run
  (``torch.cuda.memory._record_memory_history`` + memo_ext.alloc's snapshot reader).
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
from memo_ext.planner.trace import (
    CATEGORIES,
    PHASES,
    AllocationRecorder,
    ProcessConstants,
    Trace,
    TraceSummary,
    allocate_optimizer_states,
    communicators_for_layout,
    fake_distributed,
    fake_tensors,
    persistent_tensors,
    read_trace,
    record_cuda_trace,
    record_iteration,
    skeletal_formula_bytes,
    summarize,
    tagged_allocations,
    trace_from_snapshot,
    trace_to_snapshot,
    write_snapshot,
    write_trace,
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
    "CATEGORIES",
    "PHASES",
    "AllocationRecorder",
    "ProcessConstants",
    "Trace",
    "TraceSummary",
    "allocate_optimizer_states",
    "communicators_for_layout",
    "fake_distributed",
    "fake_tensors",
    "persistent_tensors",
    "read_trace",
    "record_cuda_trace",
    "record_iteration",
    "skeletal_formula_bytes",
    "summarize",
    "tagged_allocations",
    "trace_from_snapshot",
    "trace_to_snapshot",
    "write_snapshot",
    "write_trace",
]
