"""One recorded training iteration: :func:`record_iteration` drives a model's forwards and
backwards (with a warm-up) under an :class:`AllocationRecorder` and returns the :class:`Trace`."""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from memo_ext.trace.format import (
    BACKWARD,
    FORWARD,
    INIT,
    OPTIMIZER,
    OPTIMIZER_STEP,
    PARAMETER,
    GRADIENT,
    WORKSPACE,
    Trace,
)
from memo_ext.trace.model_state import persistent_tensors
from memo_ext.trace.offline import untraced_rng_forks
from memo_ext.trace.recorder import AllocationRecorder
from memo_ext.trace.tagging import tagged_allocations

def _retag_megatron_workspaces(recorder: AllocationRecorder) -> None:
    """megatron's GlobalMemoryBuffer (the sequence-parallel all-gather buffer, kept and reused)
    is a workspace, not an activation."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return
    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    for (name, _dtype), tensor in list(getattr(buffer, "buffer", {}).items()):
        recorder.retag(tensor, WORKSPACE, f"global_memory_buffer:{name}")


@contextlib.contextmanager
def _memo_storage_keys_by_identity():
    """MEMO's offload manager keys storages by ``data_ptr()``, which is 0 for every fake
    storage; while tracing, key them by StorageImpl identity instead (unique while alive, equal
    to data_ptr identity for real tensors)."""
    try:
        from memo_ext.offload import manager
    except ImportError:
        manager = None
    if manager is None or not hasattr(manager, "_storage_key"):
        yield
        return
    original = manager._storage_key
    manager._storage_key = lambda tensor: tensor.untyped_storage()._cdata
    try:
        yield
    finally:
        manager._storage_key = original


WARMUP_MODES = ("forward", "iteration", "none")


def record_iteration(
    model: torch.nn.Module,
    forward_step: Callable[[int], torch.Tensor],
    *,
    microbatches: int = 1,
    warmup: str = "forward",
    optimizer_states: Optional[Callable[[], list]] = None,
    after_backward: Optional[Callable[[], None]] = None,
    microbatch_backward_done: Optional[Callable[[int], None]] = None,
    abandon_warmup: Optional[Callable[[], None]] = None,
    constants: Sequence[tuple[str, int, str]] = (),
    deallocate_pipeline_outputs: bool = False,
    cuda_semantics: bool = True,
    header: Optional[dict] = None,
    recorder: Optional[AllocationRecorder] = None,
    persistent_only: bool = False,
) -> Trace:
    """Record one training iteration of ``model`` (this rank's chunk, megatron DDP-wrapped or
    not) as a rank holds it.

    Order of events: "init" -- ``constants`` (name, bytes, pool), parameters and buffers, DDP
    gradient buffers, ``optimizer_states()`` (tensors it allocates; category "optimizer"), and
    whatever the warm-up leaves allocated; then ``microbatches`` forwards (``forward_step(i)``
    returns the loss, a scalar, or on a non-last pipeline stage its output tensor), then their
    backwards in the same order (1F1B's peak on a stage with that many micro-batches in
    flight), each followed by ``microbatch_backward_done(i)`` (e.g. a pipeline stage sending its
    input gradient and dropping the received input); then "optimizer": ``after_backward()``
    (e.g. DDP's gradient reduce-scatter). The optimizer step allocates nothing on GPU (fused
    Adam updates in place) and is not run.

    ``warmup`` makes the trace the steady state rather than the first iteration: buffers a
    first iteration creates and keeps (megatron's global all-gather buffer, the RoPE cache,
    MEMO's rounding buffers and host slots) become "init" allocations. "forward" runs one
    untraced forward of micro-batch 0 (enough for everything created in forward), then
    ``abandon_warmup()`` (e.g. MEMO's abandon_forward: the micro-batch's host slots back to
    the pool, its buffers as a backward leaves them), "iteration" a whole untraced iteration
    (Megatron-FSDP: its gathered-weight buckets are freed in backward), "none" records the
    first iteration as it is.

    A non-scalar stage output gets a received gradient of its shape (``torch.ones``) and,
    with ``deallocate_pipeline_outputs``, has its data freed after "sending" as megatron's
    schedules do. Python's garbage collector is off while recording (cyclic garbage is
    collected once after the warm-up and once at the end), so live and fake runs free in the
    same order. Returns the :class:`Trace`; its header's ``persistent_events`` counts the
    events before the warm-up (constants, parameters, gradients, optimizer states), which
    ``persistent_only`` records alone, with the work of the optimizer phase (zeroing the
    gradient buffers, ``after_backward``) and no warm-up or iteration: what a symbolic trace of
    a deeper model takes from the model itself (memo_ext.estimate.symbolic).
    """
    if warmup not in WARMUP_MODES:
        raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {warmup!r}")
    recorder = recorder or AllocationRecorder(cuda_semantics=cuda_semantics)
    params, grads = persistent_tensors(model)
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    kept_states: list = []
    try:
        recorder.attach(model)
        with _memo_storage_keys_by_identity(), untraced_rng_forks(), recorder, \
                recorder.phase_scope(INIT):
            for name, nbytes, pool in constants:
                recorder.emit_constant(name, nbytes, pool)
            recorder.register(params, PARAMETER)
            recorder.register(grads, GRADIENT)
            if optimizer_states is not None:
                with tagged_allocations(OPTIMIZER):
                    kept_states = optimizer_states()
            persistent_events = len(recorder.events)
            if persistent_only:  # and the optimizer phase's work, which grows with them
                recorder.work.reset()
                with recorder.phase_scope(OPTIMIZER_STEP):
                    _zero_grad_buffers(model)
                    if after_backward is not None:
                        after_backward()
                recorder.recording = False
                return recorder.trace({**(header or {}), "work": recorder.work.as_dict(),
                                       "persistent_events": persistent_events})
            if warmup != "none":
                start = len(recorder.events)
                if warmup == "forward":
                    with recorder.phase_scope(FORWARD, 0), recorder.tagger:
                        output = forward_step(0)
                    del output
                    if microbatch_backward_done is not None:
                        microbatch_backward_done(0)  # the micro-batch is abandoned: done
                    if abandon_warmup is not None:
                        abandon_warmup()
                else:
                    _run_iteration(recorder, model, forward_step, microbatches, after_backward,
                                   microbatch_backward_done, deallocate_pipeline_outputs)
                gc.collect()
                _retag_megatron_workspaces(recorder)
                if recorder.rules is not None:
                    # a previous iteration's backward bound the autograd thread's cuBLAS
                    # workspace too
                    recorder.emit_workspaces(recorder.rules.steady_state_workspaces())
                recorder.promote_live_to_init(start)
            recorder.work.reset()  # the work of the recorded iteration only
            _run_iteration(recorder, model, forward_step, microbatches, after_backward,
                           microbatch_backward_done, deallocate_pipeline_outputs)
            with recorder.phase_scope(OPTIMIZER_STEP):
                gc.collect()
            _retag_megatron_workspaces(recorder)
            recorder.recording = False
        header = {**(header or {}), "work": recorder.work.as_dict(),
                  "persistent_events": persistent_events}
        return recorder.trace(header)
    finally:
        recorder.recording = False
        recorder.detach()
        del kept_states
        if gc_was_enabled:
            gc.enable()


def _zero_grad_buffers(model: torch.nn.Module) -> None:
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()


def _run_iteration(recorder: AllocationRecorder, model, forward_step, microbatches: int,
                   after_backward, microbatch_backward_done,
                   deallocate_pipeline_outputs: bool) -> None:
    with recorder.phase_scope(OPTIMIZER_STEP):
        _zero_grad_buffers(model)
    outputs = []
    for mb in range(microbatches):
        with recorder.phase_scope(FORWARD, mb), recorder.tagger:
            output = forward_step(mb)
            shape = tuple(output.shape)
            if output.numel() != 1 and deallocate_pipeline_outputs and output._base is None:
                # megatron's deallocate_output_tensor, once the output was sent on.
                output.data = torch.empty((1,), device=output.device, dtype=output.dtype)
            outputs.append((output, shape))
            del output
    for mb in range(microbatches):
        output, shape = outputs[mb]
        outputs[mb] = None
        with recorder.phase_scope(BACKWARD, mb), recorder.tagger:
            if math.prod(shape) == 1:
                output.backward()
            else:
                # The next stage's input gradient, received into a fresh tensor.
                grad = torch.ones(shape, dtype=output.dtype, device=output.device)
                if output.numel() == 1:
                    from megatron.core.pipeline_parallel.schedules import (
                        custom_backward,
                    )

                    custom_backward(output, grad)
                else:
                    output.backward(grad)
                del grad
            del output
            if microbatch_backward_done is not None:
                microbatch_backward_done(mb)
    with recorder.phase_scope(OPTIMIZER_STEP):
        if after_backward is not None:
            after_backward()
