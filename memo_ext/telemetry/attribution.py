"""Who holds the device memory: a :class:`DeviceMemoryTracker` that labels every storage with a
category and knows the phase, layer and micro-batch running when it was allocated.

Categories (:data:`CATEGORIES`), decided when the storage is created:

* ``params``, ``grads``: registered by the trainer (model parameters and buffers; megatron DDP's
  contiguous gradient buffers) with :meth:`AttributedTracker.register`.
* ``optimizer``: created while the optimizer phase runs (Adam's moments appear at the first
  step; the step's own temporaries count here too while they live).
* ``activations``: created in forward or in a recompute inside backward (saved tensors, the
  layers' outputs, the loss).
* ``backward``: created by the autograd engine outside a recompute (activation gradients,
  backward temporaries, parameter gradients before they are accumulated into the buffer).
* ``offload``: created inside :meth:`AttributedTracker.labelled` ("offload"), which the trainer
  wraps around MEMO's device-side rounding buffers.
* ``comm``: relabelled after the fact (megatron's global all-gather buffer).
* ``other``: anything else (between phases: data batches before the first forward, ...).

Host bytes (MEMO's host slots, via ``host_allocations``/``mark_host``) keep the base tracker's
"host" accounting and no device category.

Context (:meth:`AttributedTracker.context`): inside the autograd engine the phase is
"backward", or "recompute" while a transformer layer's forward runs there; outside it, the phase
the driver set ("forward" from the wrapped forward step, "optimizer", ...). The layer is the
innermost transformer layer whose forward is running, or in backward the last layer whose output
gradient arrived (a hook on each layer's output); the micro-batch is the forward-step count, or
in backward the micro-batch whose model output gradient arrived last.

Events: while a step runs, every allocation and free is kept (list entries, cheap), so an OOM
report can dump the step so far, after the storages alive at the step's start, in
memo_ext.trace's format (:meth:`AttributedTracker.step_trace_events`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator, Optional

import torch

from memo_ext.storage_tracker import (
    DEVICE,
    HOST,
    DeviceMemoryTracker,
    SimulatedOutOfMemoryError,
    storage_of,
)

PARAMS, GRADS, OPTIMIZER, ACTIVATIONS, BACKWARD, OFFLOAD, COMM, OTHER = (
    "params", "grads", "optimizer", "activations", "backward", "offload", "comm", "other")
CATEGORIES = (PARAMS, GRADS, OPTIMIZER, ACTIVATIONS, BACKWARD, OFFLOAD, COMM, OTHER)
HOST_LABEL = "host"

#: Phases the driver sets (outside the autograd engine) and the category of what they allocate.
PHASE_CATEGORY = {"idle": OTHER, "forward": ACTIVATIONS, "recompute": ACTIVATIONS,
                  "backward": BACKWARD, "optimizer": OPTIMIZER}

#: memo_ext.trace categories of ours (for the dumped trace / snapshot).
TRACE_CATEGORY = {PARAMS: "parameter", GRADS: "gradient", OPTIMIZER: "optimizer",
                  ACTIVATIONS: "activation", BACKWARD: "activation", OFFLOAD: "workspace",
                  COMM: "workspace", OTHER: "workspace"}


@dataclass
class MemoryContext:
    """Where the program was when something happened (plain data)."""

    phase: str
    layer: Optional[int]  # global 0-based transformer layer index
    microbatch: Optional[int]

    def describe(self) -> str:
        """E.g. 'backward of layer 3, micro-batch 1'."""
        text = self.phase
        if self.layer is not None:
            text += f" of layer {self.layer}"
        if self.microbatch is not None:
            text += f", micro-batch {self.microbatch}"
        return text


@dataclass
class OutOfMemoryRecord:
    """The failed request and the state at that moment (bytes)."""

    request_bytes: Optional[int]  # None where the error does not say (CUDA)
    in_use_bytes: int
    capacity_bytes: Optional[int]
    context: MemoryContext
    in_use_by_category: dict
    message: str
    op: Optional[str] = None  # the aten op whose output did not fit

    def as_dict(self) -> dict:
        return asdict(self)


class AttributedTracker(DeviceMemoryTracker):
    """A DeviceMemoryTracker with categories, context and the current step's events.

    Args:
        capacity_bytes: simulated device capacity (CPU); None: unlimited.
        record_events: keep the current step's allocation events (for OOM dumps).
    """

    def __init__(self, capacity_bytes: int | None = None, record_events: bool = True) -> None:
        super().__init__(capacity_bytes)
        self.record_events = record_events
        self.phase = "idle"
        self.microbatch: Optional[int] = None
        self._backward_microbatch: Optional[int] = None
        self._backward_layer: Optional[int] = None
        self._layers: list[int] = []
        self._forward_count = 0
        self._labels: dict[int, str] = {}  # entry token -> category
        self._category_bytes = dict.fromkeys(CATEGORIES, 0)
        self._peak_categories = dict(self._category_bytes)
        self._scopes = threading.local()
        self._op = threading.local()  # the aten op being dispatched (for events and OOMs)
        self._handles: list = []
        self._events: list[list] = []
        self._event_ids = itertools.count()
        self._event_of_token: dict[int, int] = {}
        self.last_oom: Optional[OutOfMemoryRecord] = None

    # ------------------------------------------------------------------ context
    def context(self) -> MemoryContext:
        """Phase, layer and micro-batch running now (this thread)."""
        if torch._C._current_autograd_node() is not None:
            # Until the model output's gradient arrives (the loss's own backward), the backward
            # is that of the last forward (the last pipeline stage runs F then B per micro-batch).
            microbatch = (self._backward_microbatch if self._backward_microbatch is not None
                          else self.microbatch)
            if self._layers:
                return MemoryContext("recompute", self._layers[-1], microbatch)
            return MemoryContext("backward", self._backward_layer, microbatch)
        layer = self._layers[-1] if self._layers else None
        return MemoryContext(self.phase, layer, self.microbatch)

    def _new_category(self) -> str:
        stack = getattr(self._scopes, "stack", None)
        if stack:
            return stack[-1]
        if torch._C._current_autograd_node() is not None:
            return ACTIVATIONS if self._layers else BACKWARD
        return PHASE_CATEGORY.get(self.phase, OTHER)

    @contextlib.contextmanager
    def labelled(self, category: str) -> Iterator[None]:
        """Storages created in this block (this thread) get ``category``."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; use one of {CATEGORIES}")
        stack = getattr(self._scopes, "stack", None)
        if stack is None:
            stack = self._scopes.stack = []
        stack.append(category)
        try:
            yield
        finally:
            stack.pop()

    @contextlib.contextmanager
    def phase_scope(self, phase: str) -> Iterator[None]:
        """The driver's phase in this block ("optimizer", ...); restored after."""
        if phase not in PHASE_CATEGORY:
            raise ValueError(f"unknown phase {phase!r}; use one of {tuple(PHASE_CATEGORY)}")
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def start_forward(self) -> None:
        """A micro-batch's forward step starts (outside the autograd engine)."""
        self.phase = "forward"
        self.microbatch = self._forward_count
        self._backward_microbatch = self._backward_layer = None
        self._forward_count += 1

    def register(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count pre-existing tensors (parameters, gradient buffers) as ``category`` from now."""
        with self.labelled(category):
            self.register_existing(tensors)

    def relabel(self, tensor: torch.Tensor, category: str) -> None:
        """Move a live device storage to ``category`` (e.g. a buffer recognised later)."""
        st = storage_of(tensor)
        if st is None:
            return
        with self._lock:
            entry = self._live_entry(st)
            if entry is None or entry.category != DEVICE:
                return
            old = self._labels.get(entry.token)
            if old is not None and old != category:
                self._category_bytes[old] -= entry.nbytes
                self._category_bytes[category] += entry.nbytes
                self._labels[entry.token] = category

    # ------------------------------------------------------------------ hooks
    def attach(self, chunk: torch.nn.Module) -> None:
        """Hooks on a model chunk (its output's gradient starts that micro-batch's backward) and
        on its transformer layers (layer attribution in forward, recompute and backward)."""
        from megatron.core.transformer.transformer_layer import TransformerLayer

        self._handles.append(chunk.register_forward_hook(self._chunk_output_hook))
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                layer = module.layer_number - 1
                self._handles.append(module.register_forward_pre_hook(
                    lambda _m, _i, layer=layer: self._layers.append(layer)))
                self._handles.append(module.register_forward_hook(
                    lambda _m, _i, output, layer=layer: self._layer_output_hook(layer, output),
                    always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @staticmethod
    def _first_tensor(output) -> Optional[torch.Tensor]:
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            return output[0]
        return None

    def _chunk_output_hook(self, _module, _inputs, output) -> None:
        tensor = self._first_tensor(output)
        if tensor is None or not tensor.requires_grad or not torch.is_grad_enabled():
            return
        if torch._C._current_autograd_node() is not None:
            return
        microbatch = self.microbatch

        def enter_backward(grad, microbatch=microbatch):
            self._backward_microbatch = microbatch
            self._backward_layer = None
            self.phase = "backward"
            return None

        tensor.register_hook(enter_backward)

    def _layer_output_hook(self, layer: int, output) -> None:
        if self._layers:
            self._layers.pop()
        tensor = self._first_tensor(output)
        if tensor is None or not tensor.requires_grad or not torch.is_grad_enabled():
            return

        def enter_layer(grad, layer=layer):
            self._backward_layer = layer
            return None

        tensor.register_hook(enter_layer)

    # ------------------------------------------------------------------ steps
    def begin_step(self) -> None:
        """Start a step: peaks from the current bytes, fresh events, forward count 0."""
        with self._lock:
            self.reset_peak()
            self._events.clear()
            self._event_of_token.clear()
            if self.record_events:
                # What is alive now opens the step's trace as "init" allocations (their frees
                # during the step are recorded against these ids).
                for entry in self._entries.values():
                    if entry.category == DEVICE and entry.nbytes and entry.finalizer.alive:
                        event_id = next(self._event_ids)
                        self._event_of_token[entry.token] = event_id
                        self._events.append([event_id, "alloc", entry.nbytes,
                                             self._labels.get(entry.token, OTHER), "init",
                                             None, None, None])
        self.phase = "idle"
        self.microbatch = self._backward_microbatch = self._backward_layer = None
        self._layers.clear()
        self._forward_count = 0

    def category_bytes(self) -> dict[str, int]:
        """Device bytes per category now."""
        with self._lock:
            return dict(self._category_bytes)

    def peak_category_bytes(self) -> dict[str, int]:
        """Device bytes per category at the device peak since the last reset_peak()."""
        with self._lock:
            return dict(self._peak_categories)

    def reset_peak(self) -> None:
        with self._lock:
            super().reset_peak()
            self._peak_categories = dict(self._category_bytes)

    # ------------------------------------------------------------------ overrides
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op.func = func
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except torch.OutOfMemoryError as error:  # a real device (CUDA) ran out
            if self.last_oom is None:
                self._record_oom(None, str(error))
            raise
        finally:
            self._op.func = None

    def _check_capacity(self, category: str, nbytes: int) -> None:
        try:
            super()._check_capacity(category, nbytes)
        except SimulatedOutOfMemoryError as error:
            self._record_oom(nbytes, str(error))
            raise

    def _record_oom(self, request_bytes: Optional[int], message: str) -> None:
        with self._lock:
            self.last_oom = OutOfMemoryRecord(
                request_bytes=request_bytes, in_use_bytes=self._bytes[DEVICE],
                capacity_bytes=self.capacity_bytes, context=self.context(),
                in_use_by_category=dict(self._category_bytes), message=message,
                op=None if getattr(self._op, "func", None) is None else str(self._op.func))

    def _forget(self, entry) -> None:
        """Drop an entry's category bytes (lock held)."""
        label = self._labels.pop(entry.token, None)
        if label is not None and label != HOST_LABEL:
            self._category_bytes[label] -= entry.nbytes
        if self.record_events and entry.token in self._event_of_token:
            self._events.append([self._event_of_token.pop(entry.token), "free", entry.nbytes,
                                 label, *self._context_fields(), None])

    def _context_fields(self) -> tuple:
        context = self.context()
        return context.phase, context.layer, context.microbatch

    def _entry_added(self, entry) -> None:
        if entry.category == HOST:
            self._labels[entry.token] = HOST_LABEL
            return
        label = self._new_category()
        self._labels[entry.token] = label
        self._category_bytes[label] += entry.nbytes
        if self._bytes[DEVICE] >= self._peak[DEVICE]:
            self._peak_categories = dict(self._category_bytes)
        if self.record_events and entry.nbytes:
            event_id = next(self._event_ids)
            self._event_of_token[entry.token] = event_id
            self._events.append([event_id, "alloc", entry.nbytes, label,
                                 *self._context_fields(), getattr(self._op, "func", None)])

    def _entry_freed(self, entry) -> None:
        self._forget(entry)

    def _entry_resized(self, entry, old_nbytes: int) -> None:
        if entry.category == DEVICE:
            label = self._labels.get(entry.token, OTHER)
            self._category_bytes[label] += entry.nbytes - old_nbytes
            if self._bytes[DEVICE] >= self._peak[DEVICE]:
                self._peak_categories = dict(self._category_bytes)

    def mark_host(self, tensor: torch.Tensor) -> None:
        st = storage_of(tensor)
        with self._lock:
            entry = None if st is None else self._live_entry(st)
            if entry is not None and entry.category == DEVICE:
                label = self._labels.get(entry.token)
                if label is not None and label != HOST_LABEL:
                    self._category_bytes[label] -= entry.nbytes
                self._labels[entry.token] = HOST_LABEL
            super().mark_host(tensor)

    # ------------------------------------------------------------------ dumps
    def step_trace_events(self) -> list[dict]:
        """The current step as memo_ext.trace events: the device storages alive at the
        step's start (phase "init"), then every allocation and free of the step so far."""
        with self._lock:
            recorded = list(self._events)
        return [_trace_event(*event) for event in recorded]


def _trace_event(event_id, action, nbytes, label, phase, layer, microbatch, op) -> dict:
    trace_phase = phase if phase in ("init", "forward", "recompute", "backward",
                                     "optimizer") else "init"
    return {"id": event_id, "action": action, "bytes": int(nbytes), "stream": 0, "layer": layer,
            "phase": trace_phase, "category": TRACE_CATEGORY.get(label, "workspace"),
            "microbatch": microbatch, "pool": "device", "module": f"telemetry:{label}",
            "op": None if op is None else str(op)}
