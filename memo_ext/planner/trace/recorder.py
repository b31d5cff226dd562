"""Allocation traces of one training iteration: the request sequence the memory planner and the
allocator models consume.

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
memo_ext.attention, whose tile kernels are custom ops with fake rules that allocate exactly what
the CUDA kernels allocate -- ``out`` and the fp32 log-sum-exp ``[b, heads, s_q]`` in forward;
``dq``, ``dk``, ``dv`` and, with :func:`memo_ext.attention.kernels.declared_workspaces`,
flash-attention 2's backward workspaces -- and never an ``s x s`` tensor.

Event format (one dict per event; :func:`write_trace` writes gzipped JSON lines)::

    {"id": 17, "action": "alloc" | "free", "bytes": 1073741824, "stream": 0,
     "layer": 3 | null, "phase": "init" | "forward" | "recompute" | "backward" | "optimizer",
     "category": "parameter" | "gradient" | "optimizer" | "activation" | "workspace",
     "microbatch": 0 | null, "pool": "device" | "host" | "external",
     "module": "decoder.layers.3.mlp.linear_fc1" | null, "op": "aten.mm.default" | null}

``id`` pairs an alloc with its free; ``bytes`` are requested bytes (no allocator rounding);
``layer`` is the global 0-based transformer layer index; ``pool`` "device" goes through the
caching allocator, "external" is device memory outside it (CUDA context, NCCL), "host" is
host memory (MEMO's offload slots, page-locked on CUDA). Allocations alive at the end of the iteration
(parameters, gradient buffer, optimizer state, persistent buffers) have no free event.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import gzip
import itertools
import json
import math
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from memo_ext.attention.kernels import WORKSPACE_OUTPUTS
from memo_ext.planner.cuda_rules import CudaKernelRules, CudaTarget, cuda_kernel_paths
from memo_ext.planner.work import WorkCounter
from memo_ext.telemetry.tracker import DEVICE, HOST, DeviceMemoryTracker, storage_of

# ---------------------------------------------------------------------------------- vocabulary

PARAMETER, GRADIENT, OPTIMIZER, ACTIVATION, WORKSPACE = (
    "parameter", "gradient", "optimizer", "activation", "workspace")
CATEGORIES = (PARAMETER, GRADIENT, OPTIMIZER, ACTIVATION, WORKSPACE)

INIT, FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER_STEP = (
    "init", "forward", "recompute", "backward", "optimizer")
PHASES = (INIT, FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER_STEP)

POOL_DEVICE, POOL_HOST, POOL_EXTERNAL = "device", "host", "external"

#: Every allocation of the traced iteration is issued on the compute stream (MEMO's copy streams
#: only copy into buffers allocated on it), so ``stream`` is always this value today.
COMPUTE_STREAM = 0

TRACE_FORMAT = "memo-alloc-trace"
TRACE_VERSION = 1

EVENT_FIELDS = ("id", "action", "bytes", "stream", "layer", "phase", "category", "microbatch",
                "pool", "module", "op")

MiB = 1 << 20

# ------------------------------------------------------------------------------- constants

#: CUDA context of one process (driver state, kernel images, cuDNN/cuBLAS handles). Not an
#: allocation of PyTorch's caching allocator; typical of CUDA 12 with lazy module loading
#: (CUDA_MODULE_LOADING=LAZY, PyTorch's default since 1.13) on A100/H100: `nvidia-smi` minus
#: `torch.cuda.memory_reserved()` right after `torch.cuda.init()` reads 500-600 MiB. An
#: assumption: measure it on the target and override.
CUDA_CONTEXT_BYTES = 512 * MiB

#: NCCL's per-connection buffer for the Simple protocol (NCCL_BUFFSIZE, default 4 MiB per the
#: NCCL environment-variable documentation).
NCCL_BUFFSIZE_BYTES = 4 * MiB
#: Channels per communicator on an NVLink/NVSwitch node (NCCL picks 16-32 on H100; an assumption,
#: see NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS) and ring peers per channel (one send, one recv).
NCCL_ASSUMED_CHANNELS = 16
NCCL_RING_PEERS = 2
#: NCCL device memory per communicator this rank uses: channels x peers x NCCL_BUFFSIZE
#: (= 128 MiB). LL/LL128 buffers and proxy FIFOs are ignored. Allocated by NCCL with cudaMalloc
#: (outside PyTorch's allocator) at the communicator's first collective. An estimate: calibrate on
#: the cluster (device memory used after the first collective minus reserved bytes).
NCCL_BYTES_PER_COMMUNICATOR = NCCL_ASSUMED_CHANNELS * NCCL_RING_PEERS * NCCL_BUFFSIZE_BYTES


@dataclass(frozen=True)
class ProcessConstants:
    """Device memory a rank holds that no traced op allocates (bytes). See the module-level
    constants for each default's source and assumption. (The cuBLAS workspaces are allocated
    by the first GEMM of each thread: memo_ext.planner.cuda_rules.)"""

    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    nccl_bytes_per_communicator: int = NCCL_BYTES_PER_COMMUNICATOR

    def entries(self, communicators: Sequence[str]) -> list[tuple[str, int, str]]:
        """(name, bytes, pool) of each constant for a rank that uses ``communicators``."""
        entries = [("constant:cuda_context", self.cuda_context_bytes, POOL_EXTERNAL)]
        entries += [(f"constant:nccl:{name}", self.nccl_bytes_per_communicator, POOL_EXTERNAL)
                    for name in communicators]
        return [e for e in entries if e[1] > 0]


def communicators_for_layout(tp: int, cp: int, pp: int, dp: int) -> list[str]:
    """NCCL communicators one training step of megatron-core initialises on a rank: TP
    (sequence-parallel gathers / reduce-scatters), CP (K/V all-gather), DPxCP (gradient
    reduce-scatter or all-reduce, distributed-optimizer parameter all-gather, loss average) and
    PP (point-to-point activations). Groups of size 1 need none."""
    names = []
    if tp > 1:
        names.append("tp")
    if cp > 1:
        names.append("cp")
    if dp * cp > 1:
        names.append("dp_cp")
    if pp > 1:
        names.append("pp")
    return names


#: ``torch.tensor(data)`` builds its tensor outside the dispatcher and then calls lift_fresh:
#: with real tensors the output is that (unseen) tensor, under FakeTensorMode a new fake one.
#: Either way it is a fresh allocation (a host-to-device copy on GPU), recorded in both modes.
_FRESH_TENSOR_OPS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)

#: The factories autograd formulas take the zeros they update in place from.
_ZERO_FACTORIES = ("aten.new_zeros.default", "aten.zeros.default", "aten.zeros_like.default")

# ------------------------------------------------------------------------------ recorder

_TAG = "memo_planner_tag"
# Per thread: tagged_allocations' (category, name) stack and _host_side's depth.
_TLS = threading.local()


@contextlib.contextmanager
def tagged_allocations(category: Optional[str] = None, name: Optional[str] = None):
    """Allocations made in this block (this thread) get ``category`` and ``module`` = ``name``
    in every active :class:`AllocationRecorder` (e.g. optimizer state, a modelled workspace)."""
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; use one of {CATEGORIES}")
    stack = getattr(_TLS, "overrides", None)
    if stack is None:
        stack = _TLS.overrides = []
    stack.append((category, name))
    try:
        yield
    finally:
        stack.pop()


def _current_override() -> tuple[Optional[str], Optional[str]]:
    """(category, name) of the innermost tagged_allocations blocks that set each."""
    category = name = None
    for entry_category, entry_name in reversed(getattr(_TLS, "overrides", None) or ()):
        category = category or entry_category
        name = name or entry_name
    return category, name


def _tensors_in(obj) -> Iterator[torch.Tensor]:
    """The tensors in nested tuples/lists/dicts (an op's arguments or outputs), in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list, dict)):
                yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)


def _tag_graph(roots: Iterable, tag: tuple) -> None:
    """Tag the autograd nodes reachable from ``roots`` (tensors or nodes) that carry no tag yet;
    stop at tagged nodes (they belong to earlier or inner modules)."""
    stack = []
    for root in roots:
        node = root.grad_fn if isinstance(root, torch.Tensor) else root
        if node is not None:
            stack.append(node)
    while stack:
        node = stack.pop()
        metadata = node.metadata
        if _TAG in metadata:
            continue
        metadata[_TAG] = tag
        for child, _ in node.next_functions:
            if child is not None:
                stack.append(child)


class _GraphTagger(TorchFunctionMode):
    """Tags the autograd node of every op's outputs with the module running it, so the backward
    of that node is attributed to the same module and layer."""

    def __init__(self, recorder: AllocationRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors_in(out) if t.grad_fn is not None]
            if tensors:
                _tag_graph(tensors, self.recorder.graph_tag())
        return out


class AllocationRecorder(DeviceMemoryTracker):
    """Records every storage allocation and free as an event with its context.

    A :class:`memo_ext.telemetry.DeviceMemoryTracker` (storage identity, ``weakref.finalize``
    frees, host marking) that also keeps an ordered event list. Context of an event:

    - phase and micro-batch: set by the driver (:meth:`phase_scope`); inside the autograd engine
      the phase is "backward", or "recompute" while a module's forward runs there (megatron's
      recompute, MEMO's drop-region recompute);
    - module and layer: forward from module hooks (:meth:`attach`); backward from the tag the
      forward left on the autograd node being executed (``torch._C._current_autograd_node()``);
    - category: "activation" unless :func:`tagged_allocations` says otherwise, an op's output is
      a known workspace (:data:`WORKSPACE_OUTPUTS`), or :meth:`retag` changes it later (the
      driver retags parameter gradients and megatron's global all-gather buffer).

    ``cuda_semantics``: the trace is the one a CUDA run on ``target`` makes
    (memo_ext.planner.cuda_rules): kernel workspaces (cuBLAS, operand copies, reduction
    scratch) are recorded as the kernel requests them, autograd's out-of-place branches taken
    only under a dispatch mode are folded into the in-place updates CUDA makes, and ops whose
    CPU/fake output dtype differs from the CUDA kernel's are recorded at the CUDA size --
    native_layer_norm's mean/rstd are fp32 on CUDA for 16-bit inputs (bf16 on CPU and under
    FakeTensorMode). False: the trace of the CPU program as it runs here.
    """

    def __init__(self, cuda_semantics: bool = True, target: Optional[CudaTarget] = None) -> None:
        super().__init__(capacity_bytes=None)
        self.cuda_semantics = cuda_semantics
        self.rules = CudaKernelRules(target) if cuda_semantics else None
        #: Tokens of zeros an autograd formula updated in place on CUDA: their output took
        #: over the block, so their own free is not an event (CudaKernelRules.folds).
        self._folded: set = set()
        self._workspace_tokens = itertools.count()
        self.events: list[list] = []
        self._ids = itertools.count()
        self._live: dict[int, list] = {}  # tracker token -> its alloc event (while alive)
        self.recording = True
        self.phase = INIT
        self.microbatch: Optional[int] = None
        self._modules: list[tuple[Optional[str], Optional[int]]] = []
        self._module_tags: dict[int, tuple[Optional[str], Optional[int]]] = {}
        self._handles: list = []
        self._last_backward_tag: tuple[Optional[str], Optional[int]] = (None, None)
        self._op = threading.local()
        self.tagger = _GraphTagger(self)
        #: FLOPs, bytes moved and collectives of the recorded iteration (the cost model's input).
        self.work = WorkCounter()

    def __enter__(self):
        self._kernel_paths = contextlib.ExitStack()
        if self.rules is not None and self.rules.target.fuses_rms_norm:
            # rms_norm as CUDA runs it (cuda_rules.cuda_kernel_paths)
            self._kernel_paths.enter_context(cuda_kernel_paths())
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            self._kernel_paths.close()

    # ------------------------------------------------------------------ context
    @contextlib.contextmanager
    def phase_scope(self, phase: str, microbatch: Optional[int] = None):
        """Events in this block get ``phase`` and ``microbatch`` (outside the autograd engine)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; use one of {PHASES}")
        previous = (self.phase, self.microbatch)
        self.phase, self.microbatch = phase, microbatch
        try:
            yield
        finally:
            self.phase, self.microbatch = previous

    def module_tag(self) -> tuple[Optional[str], Optional[int]]:
        """(module name, layer) of the innermost module running now, or (None, None)."""
        return self._modules[-1] if self._modules else (None, None)

    def graph_tag(self) -> tuple[Optional[str], Optional[int]]:
        """(module name, layer) that autograd nodes made now belong to: the innermost running
        module's; inside the autograd engine with no module running, the executing node's. A
        recompute that a backward node runs (memo_ext.tiled_mlp's tiles) builds a graph of its
        own there, and its backward belongs to that node's layer: tagged outside every layer
        (by the tile's first submodule call, which tags its inputs' graph with this), it left
        the layers' work short, and the symbolic check refused every tiled layout."""
        if self._modules:
            return self._modules[-1]
        node = torch._C._current_autograd_node()
        if node is None:
            return None, None
        tag = node.metadata.get(_TAG)
        return self._last_backward_tag if tag is None else tag

    def _context(self) -> tuple[str, Optional[str], Optional[int]]:
        node = torch._C._current_autograd_node()
        if node is None:
            name, layer = self.module_tag()
            return self.phase, name, layer
        if self._modules:
            name, layer = self._modules[-1]
            return RECOMPUTE, name, layer
        tag = node.metadata.get(_TAG)
        if tag is None:
            tag = self._last_backward_tag
        else:
            self._last_backward_tag = tag
        return BACKWARD, tag[0], tag[1]

    # ------------------------------------------------------------------ hooks
    def attach(self, model: torch.nn.Module) -> None:
        """Install module hooks (forward attribution, autograd-node tags) and parameter gradient
        hooks (their gradients are category "gradient") on ``model``."""
        from megatron.core.transformer.transformer_layer import TransformerLayer

        layers: dict[str, Optional[int]] = {}
        for raw_name, module in model.named_modules():
            name = _clean_module_name(raw_name)
            parent = raw_name.rsplit(".", 1)[0] if "." in raw_name else ""
            layer = layers.get(parent) if raw_name else None
            if isinstance(module, TransformerLayer):
                layer = module.layer_number - 1
            layers[raw_name] = layer
            self._module_tags[id(module)] = (name, layer)
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook, always_call=True))
        for param in model.parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(self._gradient_hook))

    def detach(self) -> None:
        """Remove every hook :meth:`attach` installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, module, inputs):
        if torch.is_grad_enabled():
            _tag_graph(list(_tensors_in(inputs)), self.graph_tag())
        self._modules.append(self._module_tags.get(id(module), (None, None)))

    def _post_hook(self, module, inputs, outputs):
        tag = self._modules.pop() if self._modules else (None, None)
        if torch.is_grad_enabled():
            _tag_graph(list(_tensors_in(outputs)), tag)

    def _gradient_hook(self, grad: torch.Tensor) -> None:
        self.retag(grad, GRADIENT)

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # DeviceMemoryTracker's rule (a new storage among the outputs is an allocation; an
        # input's storage coming back is a view or an in-place op), with a flattening fast
        # enough for the tens of thousands of ops of a large model's iteration.
        kwargs = kwargs or {}
        input_keys = set()
        for tensor in _tensors_in((args, kwargs)):
            st = storage_of(tensor)
            if st is not None:
                input_keys.add(st._cdata)
        name = str(func)
        out = func(*args, **kwargs)
        traced = self.recording and not getattr(_TLS, "untraced", 0)
        if traced:
            phase, _, layer = self._context()
            self.work.count(phase, func, args, kwargs, out, self.is_host, layer)
        self._op.name = name
        category = HOST if getattr(self._host_depth, "n", 0) > 0 else DEVICE
        seen = set()
        fresh = []
        try:
            for tensor in _tensors_in(out):
                st = storage_of(tensor)
                if st is None or st._cdata in seen:
                    continue
                seen.add(st._cdata)
                if st._cdata in input_keys and func not in _FRESH_TENSOR_OPS:
                    self._maybe_resized(st)
                else:
                    self._track(st, category, count_allocation=True)
                    fresh.append(st)
            if self.rules is not None and traced and category == DEVICE:
                self._apply_rules(func, args, kwargs, out, fresh)
        finally:
            self._op.name = None
        if name in WORKSPACE_OUTPUTS:
            outputs = out if isinstance(out, (tuple, list)) else (out,)
            for index in WORKSPACE_OUTPUTS[name]:
                self.retag(outputs[index], WORKSPACE)
        return out

    def _apply_rules(self, func, args, kwargs, out, fresh: list) -> None:
        """Record ``func``'s CUDA workspaces after its outputs; fold the output of an autograd
        formula's out-of-place update into the zeros it updates (memo_ext.planner.cuda_rules)."""
        in_backward = torch._C._current_autograd_node() is not None
        self.emit_workspaces(self.rules.workspaces(func, args, kwargs, out, in_backward))
        for tensor, nbytes in self.rules.cuda_sizes(func, args, out, self._op_of):
            self._set_bytes(tensor, nbytes)
        if not (in_backward and len(fresh) == 1 and self.rules.folds(func)):
            return
        target = args[0]
        target_storage = storage_of(target)
        with self._lock:
            output_entry = self._live_entry(fresh[0])
            target_entry = (self._live_entry(target_storage) if target_storage is not None
                            else None)
            if output_entry is None or target_entry is None:
                return
            output = self._live.get(output_entry.token)
            zeros = self._live.get(target_entry.token)
            if (output is None or zeros is None or zeros[2] != output[2]
                    or zeros[10] not in _ZERO_FACTORIES
                    or not self.rules.same_dense_layout(target, next(_tensors_in(out)))):
                return
            index = len(self.events) - 1
            while self.events[index] is not output:
                index -= 1
            del self.events[index]
            self._live[output_entry.token] = zeros
            self._folded.add(target_entry.token)

    def emit_workspaces(self, workspaces: Iterable) -> None:
        """Record kernel workspaces (memo_ext.planner.cuda_rules.Workspace): each allocated
        in order, the transient ones freed afterwards, the persistent ones kept."""
        transient = []
        for workspace in workspaces:
            token = ("workspace", next(self._workspace_tokens))
            with tagged_allocations(WORKSPACE, workspace.what):
                self._emit_alloc(token, workspace.nbytes, POOL_DEVICE)
            if not workspace.persistent:
                transient.append(token)
        for token in reversed(transient):
            self._emit_free(token)

    # ------------------------------------------------------------------ tracker overrides
    def _track(self, st: torch.UntypedStorage, category: str, count_allocation: bool) -> None:
        key = st._cdata
        with self._lock:
            before = self._entries.get(key)
            if before is not None and not (before.finalizer.alive
                                           and before.finalizer.peek()[0] is st):
                self._emit_free(before.token)  # the address was reused before the finalizer ran
                before = None
            super()._track(st, category, count_allocation)
            entry = self._entries.get(key)
            if entry is not None and entry is not before:
                self._emit_alloc(entry.token, entry.nbytes,
                                 POOL_HOST if category == HOST else POOL_DEVICE)

    def _on_free(self, key: int, token: int) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.token == token:
                self._emit_free(token)
            super()._on_free(key, token)

    def _maybe_resized(self, st: torch.UntypedStorage) -> None:
        with self._lock:
            entry = self._live_entry(st)
            old = entry.nbytes if entry is not None else None
            super()._maybe_resized(st)
            if entry is not None and entry.nbytes != old and entry.token in self._live:
                # A resize is a free of the old block and an allocation of the new one.
                pool = self._live[entry.token][8]
                self._emit_free(entry.token)
                self._emit_alloc(entry.token, entry.nbytes, pool)

    def mark_host(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as host memory (MEMO's offload slots): pool "host"."""
        super().mark_host(tensor)
        event = self._event_of(tensor)
        if event is not None:
            event[8] = POOL_HOST

    # ------------------------------------------------------------------ events
    def _emit_alloc(self, token, nbytes: int, pool: str) -> None:
        if not self.recording or nbytes == 0 or getattr(_TLS, "untraced", 0):
            return  # the CUDA caching allocator is not called for 0 bytes
        phase, module, layer = self._context()
        category, name = _current_override()
        event = [next(self._ids), "alloc", int(nbytes), COMPUTE_STREAM, layer, phase,
                 category or ACTIVATION, self.microbatch, pool, name or module,
                 getattr(self._op, "name", None)]
        self.events.append(event)
        self._live[token] = event

    def _emit_free(self, token) -> None:
        if token in self._folded:
            self._folded.discard(token)
            self._live.pop(token, None)  # its block lives on as the folded op's output
            return
        alloc = self._live.pop(token, None)
        if alloc is None or not self.recording:
            return
        phase, module, layer = self._context()
        self.events.append([alloc[0], "free", alloc[2], alloc[3], layer, phase, alloc[6],
                            self.microbatch, alloc[8], module, None])

    def emit_constant(self, name: str, nbytes: int, pool: str) -> None:
        """An allocation no op makes (CUDA context, NCCL buffers, cuBLAS workspace): category
        "workspace", alive to the end."""
        with self._lock:
            self.events.append([next(self._ids), "alloc", int(nbytes), COMPUTE_STREAM, None,
                                self.phase, WORKSPACE, None, pool, name, None])

    def _event_of(self, tensor: torch.Tensor) -> Optional[list]:
        st = storage_of(tensor)
        if st is None:
            return None
        with self._lock:
            entry = self._live_entry(st)
            return None if entry is None else self._live.get(entry.token)

    def retag(self, tensor: torch.Tensor, category: str, name: Optional[str] = None) -> None:
        """Change the category (and optionally module name) of ``tensor``'s live allocation."""
        event = self._event_of(tensor)
        if event is not None:
            event[6] = category
            if name is not None:
                event[9] = name

    def _op_of(self, tensor: torch.Tensor) -> Optional[str]:
        """The op that allocated ``tensor``'s live block, or None."""
        event = self._event_of(tensor)
        return None if event is None else event[10]

    def _set_bytes(self, tensor: torch.Tensor, nbytes: int) -> None:
        event = self._event_of(tensor)
        if event is not None:
            event[2] = int(nbytes)

    def register(self, tensors: Iterable[tuple[str, torch.Tensor]], category: str) -> None:
        """Record pre-existing tensors (parameters, buffers) as allocations of ``category`` now,
        one per storage, named by the first name given for it."""
        for name, tensor in tensors:
            with tagged_allocations(category, name):
                self.register_existing([tensor])

    def live_tensor_tokens(self) -> set[int]:
        """Tokens of allocations alive now (for :meth:`promote_live_to_init`)."""
        with self._lock:
            return set(self._live)

    def promote_live_to_init(self, since_event: int) -> None:
        """Turn the warm-up into steady state: drop the events from ``since_event`` on, but keep
        (as "init" allocations) those of them still alive -- buffers a first iteration creates
        and keeps (megatron's global all-gather buffer, RoPE cache, MEMO's rounding buffers)."""
        with self._lock:
            live_events = {id(e) for e in self._live.values()}
            kept = [e for e in self.events[since_event:]
                    if e[1] == "alloc" and id(e) in live_events]
            for event in kept:
                event[5] = INIT
                event[7] = None
            del self.events[since_event:]
            self.events.extend(kept)

    def trace(self, header: Optional[dict] = None) -> Trace:
        """The recorded events as a :class:`Trace` (dicts; a snapshot)."""
        with self._lock:
            events = [dict(zip(EVENT_FIELDS, e)) for e in self.events]
        return Trace(header=dict(header or {}), events=events)


def _clean_module_name(name: str) -> str:
    """Module names without the wrappers' prefixes (DDP's and Float16Module's ``module.``)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return "model" if name in ("", "module") else name


# ------------------------------------------------------------------------------- the trace

@dataclass
class Trace:
    """A header (layout, model, options: plain data) and the ordered events (dicts with
    :data:`EVENT_FIELDS`)."""

    header: dict
    events: list[dict]


def write_trace(trace: Trace, path) -> None:
    """Write ``trace`` as gzipped JSON lines: the header object first (with "format" and
    "version"), then one event per line. Deterministic bytes (no gzip name or mtime); written to
    a temporary name and renamed, so a crash never leaves half a trace."""
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **trace.header}
    partial = f"{os.fspath(path)}.partial"
    with open(partial, "wb") as raw, \
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write((json.dumps(header, sort_keys=True) + "\n").encode())
        for event in trace.events:
            record = {k: event[k] for k in EVENT_FIELDS}
            gz.write((json.dumps(record, separators=(",", ":")) + "\n").encode())
    os.replace(partial, path)


def read_trace(path) -> Trace:
    """Read a trace written by :func:`write_trace`. Raises ValueError naming the file when the
    first line is not a header of this format and version, or an event lacks a field."""
    with gzip.open(path, "rt") as f:
        first = f.readline()
        try:
            header = json.loads(first)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: first line is not JSON ({exc})") from None
        if header.get("format") != TRACE_FORMAT or header.get("version") != TRACE_VERSION:
            raise ValueError(f"{path}: not a {TRACE_FORMAT} v{TRACE_VERSION} file (header "
                             f"format={header.get('format')!r}, version={header.get('version')!r})")
        events = []
        for number, line in enumerate(f, start=2):
            event = json.loads(line)
            missing = [k for k in EVENT_FIELDS if k not in event]
            if missing:
                raise ValueError(f"{path}:{number}: event lacks {', '.join(missing)}")
            events.append(event)
    return Trace(header=header, events=events)


@dataclass
class TraceSummary:
    """What a trace says, in bytes. "Peak" counts device memory: pools "device" and "external"."""

    num_events: int
    num_allocs: int
    num_frees: int
    peak_bytes: int  # device + external
    peak_event: int  # index of the first event reaching peak_bytes
    peak_allocator_bytes: int  # pool "device" only: what a caching-allocator model must hold
    peak_by_category: dict[str, int]  # device+external bytes per category at peak_event
    category_peaks: dict[str, int]  # each category's own maximum (device+external)
    persistent_by_category: dict[str, int]  # init-phase allocations, device+external
    host_peak_bytes: int
    final_live_bytes: int
    iteration_leftover_bytes: int  # allocated in forward/recompute/backward, alive at the end
    layer_forward_skeletal_bytes: dict[int, int]  # micro-batch 0, alive when backward starts
    layer_forward_peak_bytes: dict[int, int]  # micro-batch 0: max live above the layer's start

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize(trace: Trace) -> TraceSummary:
    """Replay ``trace`` once and report peaks, categories and per-layer forward figures."""
    events = trace.events
    live: dict[int, dict] = {}
    device = {c: 0 for c in CATEGORIES}
    total = allocator = host = 0
    peak = peak_allocator = host_peak = 0
    peak_event = -1
    peak_by_category = dict(device)
    category_peaks = dict(device)
    persistent = {c: 0 for c in CATEGORIES}
    backward_start = next((i for i, e in enumerate(events)
                           if e["phase"] in (BACKWARD, RECOMPUTE)), len(events))
    skeletal_live: Optional[dict] = None
    layer_start: dict[int, int] = {}
    layer_peak: dict[int, int] = {}
    num_allocs = num_frees = 0
    for index, event in enumerate(events):
        if index == backward_start:
            skeletal_live = dict(live)
        sign = 1
        if event["action"] == "alloc":
            num_allocs += 1
            live[event["id"]] = event
        else:
            num_frees += 1
            sign = -1
            live.pop(event["id"], None)
        nbytes = sign * event["bytes"]
        if event["pool"] == POOL_HOST:
            host += nbytes
            host_peak = max(host_peak, host)
            continue
        if event["action"] == "alloc" and event["phase"] == INIT:
            persistent[event["category"]] += event["bytes"]
        device[event["category"]] += nbytes
        total += nbytes
        if event["pool"] == POOL_DEVICE:
            allocator += nbytes
            peak_allocator = max(peak_allocator, allocator)
        category_peaks[event["category"]] = max(category_peaks[event["category"]],
                                                device[event["category"]])
        if total > peak:
            peak, peak_event, peak_by_category = total, index, dict(device)
        layer = event["layer"]
        if (event["phase"] == FORWARD and layer is not None and event["microbatch"] in (0, None)
                and index < backward_start):
            if layer not in layer_start:
                layer_start[layer] = total - nbytes
            layer_peak[layer] = max(layer_peak.get(layer, 0), total - layer_start[layer])
    if skeletal_live is None:
        skeletal_live = dict(live)
    leftover = sum(e["bytes"] for e in live.values()
                   if e["phase"] in (FORWARD, RECOMPUTE, BACKWARD) and e["pool"] != POOL_HOST)
    skeletal: dict[int, int] = {}
    for event in skeletal_live.values():
        if (event["phase"] == FORWARD and event["layer"] is not None
                and event["microbatch"] in (0, None) and event["pool"] != POOL_HOST):
            skeletal[event["layer"]] = skeletal.get(event["layer"], 0) + event["bytes"]
    return TraceSummary(
        num_events=len(events), num_allocs=num_allocs, num_frees=num_frees, peak_bytes=peak,
        peak_event=peak_event, peak_allocator_bytes=peak_allocator,
        peak_by_category=peak_by_category, category_peaks=category_peaks,
        persistent_by_category=persistent, host_peak_bytes=host_peak, final_live_bytes=total,
        iteration_leftover_bytes=leftover,
        layer_forward_skeletal_bytes=dict(sorted(skeletal.items())),
        layer_forward_peak_bytes=dict(sorted(layer_peak.items())))


def skeletal_formula_bytes(micro_batch_size: int, seq_length: int, hidden_size: int,
                           tensor_parallel_size: int, context_parallel_size: int,
                           element_bytes: int = 2) -> int:
    """memo.md's skeletal activations of one pre-LN GPT layer per rank with flash attention and
    sequence parallelism: 16·b·s·h / (TP·CP) elements of ``element_bytes`` each."""
    return (16 * micro_batch_size * seq_length * hidden_size * element_bytes
            // (tensor_parallel_size * context_parallel_size))


# ----------------------------------------------------------------- persistent rank state

def persistent_tensors(model: torch.nn.Module) -> tuple[list, list]:
    """(parameter-like, gradient) (name, tensor) pairs a rank holds for ``model``: megatron DDP's
    contiguous parameter buffers (distributed optimizer) and fp32 gradient buffers
    (``main_grad``), the parameters themselves (their storage is the buffer's when it exists,
    and is then counted once), and module buffers."""
    params, grads = [], []
    buffers = list(getattr(model, "buffers", []) or [])
    buffers += list(getattr(model, "expert_parallel_buffers", []) or [])
    for index, buffer in enumerate(buffers):
        if not hasattr(buffer, "grad_data"):
            continue
        if getattr(buffer, "param_data", None) is not None:
            params.append((f"ddp.param_buffer.{index}", buffer.param_data))
        grads.append((f"ddp.grad_buffer.{index}", buffer.grad_data))
    params += [(_clean_module_name(n), p) for n, p in model.named_parameters()]
    params += [(_clean_module_name(n), b) for n, b in model.named_buffers()]
    return params, grads


def allocate_optimizer_states(model: torch.nn.Module, use_distributed_optimizer: bool,
                              adam: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Allocate what megatron's optimizer keeps per rank, in its order: fp32 master copies of
    16-bit parameters (at construction), then per parameter Adam's exp_avg and exp_avg_sq (fp32,
    at the first step; SGD with momentum: one buffer). With the distributed optimizer each rank
    holds only its shard of every gradient-buffer bucket (megatron's own range computation,
    DistributedOptimizer._build_gbuf_range_map, over the DP x CP group). Returns (name, tensor)
    pairs the caller keeps alive."""
    shards: list[tuple[str, int, torch.dtype]] = []  # (name, numel, model param dtype)
    names = {p: _clean_module_name(n) for n, p in model.named_parameters()}
    buffers = list(getattr(model, "buffers", []) or [])
    if use_distributed_optimizer and buffers:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for buffer in buffers:
            range_map = DistributedOptimizer._build_gbuf_range_map(buffer)
            for bucket_ranges in range_map.values():
                for bucket in bucket_ranges:
                    for param, ranges in bucket["param_map"].items():
                        shards.append((names.get(param, "?"), ranges["param"].size, param.dtype))
    else:
        shards = [(names[p], p.numel(), p.dtype) for p in model.parameters() if p.requires_grad]
    device = next(model.parameters()).device
    states: list[tuple[str, torch.Tensor]] = []

    def allocate(state_name: str, numel: int) -> None:
        with tagged_allocations(OPTIMIZER, state_name):
            states.append((state_name, torch.empty(numel, dtype=torch.float32, device=device)))

    for name, numel, dtype in shards:
        if dtype in (torch.float16, torch.bfloat16):
            allocate(f"optimizer:{name}.master_fp32", numel)
    for name, numel, _ in shards:
        for kind in (("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)):
            allocate(f"optimizer:{name}.{kind}", numel)
    return states


# ------------------------------------------------------------------------- the iteration

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
    untraced forward of micro-batch 0 (enough for everything created in forward), "iteration"
    a whole untraced iteration (MEMO: its buffers grow and its host slots cycle through a full
    iteration), "none" records the first iteration as it is.

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


# ------------------------------------------------------------------- fake process group

@contextlib.contextmanager
def fake_distributed(world_size: int, rank: int, tensor_parallel_size: int = 1,
                     pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1,
                     seed: int = 1234) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks seen from ``rank`` (collectives are no-ops)
    with megatron's parallel state (no gloo groups, which the fake backend cannot create) and
    its model-parallel RNG tracker seeded. Everything is torn down on exit."""
    from megatron.core import parallel_state, tensor_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_distributed: torch.distributed is already initialised in this "
                           "process; trace in a fresh process")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            context_parallel_size=context_parallel_size,
            create_gloo_process_groups=False,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def _host_side() -> Iterator[None]:
    """Host-side bookkeeping: real tensors even under FakeTensorMode, and no events."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    depth = getattr(_TLS, "untraced", 0)
    _TLS.untraced = depth + 1
    try:
        with unset_fake_temporarily():
            yield
    finally:
        _TLS.untraced = depth


@contextlib.contextmanager
def untraced_rng_forks() -> Iterator[None]:
    """Run the bookkeeping of megatron's RNG tracker ``fork()`` (saving, swapping and comparing
    generator states: CPU tensors, on GPU too) host-side: not recorded, and with real tensors
    under FakeTensorMode, where its ``.item()`` on a state comparison could not be answered.
    The forked region's own ops are recorded as usual."""
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = megatron_random.get_cuda_rng_tracker()
    original = tracker.fork

    @contextlib.contextmanager
    def fork(*args, **kwargs):
        manager = original(*args, **kwargs)
        with _host_side():
            manager.__enter__()
        try:
            yield
        except BaseException:
            with _host_side():
                if not manager.__exit__(*sys.exc_info()):
                    raise
        else:
            with _host_side():
                manager.__exit__(None, None, None)

    had_own = "fork" in vars(tracker)
    saved = vars(tracker).get("fork")
    tracker.fork = fork
    try:
        yield
    finally:
        if had_own:
            tracker.fork = saved
        else:
            del tracker.fork


@contextlib.contextmanager
def fake_tensors() -> Iterator[Any]:
    """``FakeTensorMode`` on the CPU device for offline traces (mode (c)), entered, with
    megatron's RNG forks made host-side (:func:`untraced_rng_forks`). Enter it inside
    :func:`fake_distributed` (the RNG tracker must exist)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with untraced_rng_forks(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


# ------------------------------------------------------------------------ (a) live on CUDA

def trace_from_snapshot(snapshot: dict, device: int = 0, header: Optional[dict] = None) -> Trace:
    """Events of one device's trace in a PyTorch memory snapshot (a dict as returned by
    memo_ext.alloc.snapshot.load_snapshot): "alloc" and "free_completed" actions, ids paired by
    address, sizes as the snapshot records them (the caching allocator's rounded block sizes).
    No layer/phase tags (null); category "activation" for everything."""
    traces = snapshot.get("device_traces", [])
    trace_events = traces[device] if device < len(traces) else []
    ids = itertools.count()
    live: dict[int, int] = {}
    events = []
    for raw in trace_events:
        action = raw.get("action")
        if action == "alloc":
            event_id = next(ids)
            live[raw["addr"]] = event_id
            events.append({"id": event_id, "action": "alloc", "bytes": int(raw["size"]),
                           "stream": raw.get("stream", 0), "layer": None, "phase": None,
                           "category": ACTIVATION, "microbatch": None, "pool": POOL_DEVICE,
                           "module": None, "op": None})
        elif action == "free_completed" and raw["addr"] in live:
            events.append({"id": live.pop(raw["addr"]), "action": "free",
                           "bytes": int(raw["size"]), "stream": raw.get("stream", 0),
                           "layer": None, "phase": None, "category": ACTIVATION,
                           "microbatch": None, "pool": POOL_DEVICE, "module": None, "op": None})
    return Trace(header=dict(header or {}, mode="cuda"), events=events)


#: Where exported snapshots place their synthetic blocks (any aligned, nonzero base works:
#: memory_viz only uses addresses to pair an alloc with its free).
_SNAPSHOT_BASE_ADDRESS = 0x7F0000000000
_SNAPSHOT_ADDRESS_STRIDE = 512


def trace_to_snapshot(trace: Trace) -> dict:
    """``trace`` as a PyTorch memory snapshot (the dict ``torch.cuda.memory._snapshot()``
    returns), so PyTorch's memory_viz (https://pytorch.org/memory_viz) shows its "Active Memory
    Timeline". Device-pool events only, as a real snapshot has them: host slots are not device
    memory, and external memory (CUDA context, NCCL) never passes through the caching allocator
    (the header, kept as JSON under "memo_trace_header", names it). Every block gets its own
    synthetic address; its tags (phase, layer, micro-batch, category, module,
    op) become the one stack frame memory_viz shows for it. No "segments": the trace has no
    allocator decisions (replay it through memo_ext.alloc for those).
    :func:`trace_from_snapshot` reads it back to the same sizes and order."""
    entries = []
    for event in trace.events:
        if event["pool"] != POOL_DEVICE:
            continue
        tags = [f"{event['phase'] or 'untagged'}"]
        if event["layer"] is not None:
            tags.append(f"layer {event['layer']}")
        if event["microbatch"] is not None:
            tags.append(f"micro-batch {event['microbatch']}")
        tags.append(event["category"])
        if event["op"]:
            tags.append(str(event["op"]))
        entries.append({
            "action": "alloc" if event["action"] == "alloc" else "free_completed",
            "addr": _SNAPSHOT_BASE_ADDRESS + int(event["id"]) * _SNAPSHOT_ADDRESS_STRIDE,
            "size": int(event["bytes"]),
            "stream": int(event["stream"] or 0),
            "frames": [{"filename": event["module"] or "memo_ext.planner.trace",
                        "line": int(event["layer"] or 0), "name": ", ".join(tags)}],
        })
    return {"segments": [], "device_traces": [entries],
            "memo_trace_header": json.dumps(trace.header, sort_keys=True)}


def write_snapshot(trace: Trace, path) -> None:
    """Write :func:`trace_to_snapshot` as a pickle, as ``torch.cuda.memory._dump_snapshot``
    does (plain dicts, lists, strings and ints only, so memo_ext.alloc's restricted reader and
    memory_viz both open it). Written to a temporary name and renamed: never half a file."""
    import pickle

    path = os.fspath(path)
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        pickle.dump(trace_to_snapshot(trace), f, protocol=4)
    os.replace(partial, path)


def record_cuda_trace(function: Callable[[], Any], device: Optional[int] = None,
                      max_entries: int = 1_000_000) -> tuple[Trace, Any]:
    """Run ``function()`` on CUDA under ``torch.cuda.memory._record_memory_history`` and return
    (its allocation trace, the snapshot's memo_ext.alloc DeviceSummary). Needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("record_cuda_trace needs CUDA; use record_iteration (live CPU or "
                           "FakeTensorMode) on this machine")
    from memo_ext.device_memory import current_allocator, snapshots_supported

    if not snapshots_supported():
        raise RuntimeError(f"record_cuda_trace reads PyTorch's allocator snapshots, and "
                           f"{current_allocator().name} replaced that allocator in this process: "
                           "trace in a process without it")
    from memo_ext.alloc.snapshot import load_snapshot, summarize_snapshot

    device = torch.cuda.current_device() if device is None else device
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        function()
        torch.cuda.synchronize(device)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "snapshot.pickle")
            torch.cuda.memory._dump_snapshot(path)
            snapshot = load_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    summary = summarize_snapshot(snapshot, device)[0]
    return trace_from_snapshot(snapshot, device), summary
