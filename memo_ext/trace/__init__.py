"""Allocation traces of one training iteration: the request sequence the memory planner and the
allocator models consume. This package's entry point: import the public names from here.

Three ways to produce the same event format (docs/tracing.md has the details and the figures):

(a) live on CUDA: :func:`record_cuda_trace` runs a callable under
    ``torch.cuda.memory._record_memory_history`` and converts the snapshot (read with
    memo_ext.alloc.snapshot's restricted unpickler) into events. Sizes are the caching
    allocator's; there are no phase/layer tags.
(b) live on CPU with real tensors (small models): :func:`record_iteration` with an
    :class:`AllocationRecorder`, a TorchDispatchMode that records the *storages* every aten op
    creates and, through ``weakref.finalize``, when they die.
(c) offline: the same, under ``FakeTensorMode`` on the CPU device and a fake process group
    (:func:`fake_distributed`), so one process produces the per-rank trace of any layout at any
    size without allocating its memory. (b) and (c) give identical sizes and order.

What one rank holds is recorded, not only activations: parameters, megatron DDP's contiguous
gradient buffer (``main_grad``), the optimizer's fp32 master weights and Adam moments (sharded
over the data-parallel x context-parallel group with the distributed optimizer), activations and
their gradients, transient workspaces, and named constants for memory that never passes through
PyTorch's allocator (:class:`ProcessConstants`).

The traced model is the trainer's own, built by the same spec: its attention is
memo_ext.attention, whose tile kernels are custom ops with fake rules that allocate their
outputs -- ``out`` and the fp32 log-sum-exp ``[b, heads, s_q]`` in forward; ``dq``, ``dk``,
``dv`` in backward -- and never an ``s x s`` tensor; with
:func:`memo_ext.attention.kernels.declared_workspaces` the CUDA rules add what the flash
kernels allocate besides (workspaces, split-KV accumulators, GQA's expanded K/V).

One concern per module:

- ``format``: the vocabulary, the event format, :class:`Trace` and its file I/O;
- ``constants``: memory no traced op allocates (CUDA context, NCCL buffers);
- ``tagging``: the category/module tags of allocations and of autograd nodes;
- ``recorder``: :class:`AllocationRecorder`, events from aten ops;
- ``model_state``: parameters, gradient buffers and optimizer states a rank holds;
- ``iteration``: :func:`record_iteration`, one training iteration under the recorder;
- ``offline``: fake process group, fake tensors, untraced host-side blocks;
- ``summary``: :func:`summarize` and the skeletal-activation formula;
- ``cuda_snapshot``: PyTorch memory snapshots to and from traces, live CUDA recording;
- ``cuda_rules``: what a CUDA run of an op allocates that the CPU run does not
  (:class:`CudaTarget`, the GPU and PyTorch release a trace stands for), with ``cuda_reduce``,
  the reduction kernels' workspace sizes;
- ``request``: :class:`TraceRequest` and :class:`TracedModel`, what a trace is asked for (the
  estimator's and ``tools/trace.py``'s requests, the trace cache's key);
- ``work``: the FLOPs and bytes each phase of the iteration does, counted while recording (the
  estimator's cost model reads them, memo_ext.estimate.cost).
"""

from memo_ext.trace.constants import (
    NCCL_BYTES_PER_COMMUNICATOR,
    ProcessConstants,
    communicators_for_layout,
)
from memo_ext.trace.cuda_snapshot import (
    record_cuda_trace,
    trace_from_snapshot,
    trace_to_snapshot,
    write_snapshot,
)
from memo_ext.trace.format import (
    BACKWARD,
    CATEGORIES,
    EVENT_FIELDS,
    FORWARD,
    INIT,
    OPTIMIZER_STEP,
    PHASES,
    POOL_DEVICE,
    POOL_EXTERNAL,
    POOL_HOST,
    RECOMPUTE,
    TRACE_FORMAT,
    MiB,
    Trace,
    read_trace,
    write_trace,
)
from memo_ext.trace.iteration import record_iteration
from memo_ext.trace.model_state import (
    PINNED_MARK,
    OptimizerOffload,
    OptimizerShard,
    allocate_offloaded_optimizer_states,
    allocate_optimizer_states,
    offloaded_elements,
    persistent_tensors,
)
from memo_ext.trace.offline import fake_distributed, fake_tensors
from memo_ext.trace.recorder import AllocationRecorder
from memo_ext.trace.summary import TraceSummary, skeletal_formula_bytes, summarize
from memo_ext.trace.tagging import tagged_allocations

__all__ = [
    "BACKWARD", "CATEGORIES", "EVENT_FIELDS", "FORWARD", "INIT", "MiB",
    "NCCL_BYTES_PER_COMMUNICATOR", "OPTIMIZER_STEP", "PHASES", "POOL_DEVICE", "POOL_EXTERNAL",
    "POOL_HOST", "RECOMPUTE", "TRACE_FORMAT", "AllocationRecorder", "ProcessConstants", "Trace",
    "OptimizerOffload", "OptimizerShard", "PINNED_MARK", "TraceSummary",
    "allocate_offloaded_optimizer_states", "allocate_optimizer_states",
    "communicators_for_layout", "fake_distributed", "offloaded_elements",
    "fake_tensors", "persistent_tensors", "read_trace", "record_cuda_trace", "record_iteration",
    "skeletal_formula_bytes", "summarize", "tagged_allocations", "trace_from_snapshot",
    "trace_to_snapshot", "write_snapshot", "write_trace",
]
