"""The recorder: :class:`AllocationRecorder`, a TorchDispatchMode that records the storages every
aten op creates and frees as trace events with their phase, module, layer and category."""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterable
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from memo_ext.storage_tracker import DEVICE, HOST, DeviceMemoryTracker, storage_of
from memo_ext.trace import fake_fast_path
from memo_ext.trace.cuda_rules import CudaKernelRules, CudaTarget, cuda_kernel_paths
from memo_ext.trace.format import (
    ACTIVATION,
    BACKWARD,
    COMPUTE_STREAM,
    EVENT_FIELDS,
    GRADIENT,
    INIT,
    PHASES,
    POOL_DEVICE,
    POOL_HOST,
    RECOMPUTE,
    WORKSPACE,
    Trace,
)
from memo_ext.trace.tagging import (
    _TAG,
    _TLS,
    _clean_module_name,
    _current_override,
    _tag_graph,
    _tensors_in,
    tagged_allocations,
)
from memo_ext.trace.tile_copies import repeat_tiles
from memo_ext.trace.work import WorkCounter

#: ``torch.tensor(data)`` builds its tensor outside the dispatcher and then calls lift_fresh:
#: with real tensors the output is that (unseen) tensor, under FakeTensorMode a new fake one.
#: Either way it is a fresh allocation (a host-to-device copy on GPU), recorded in both modes.
_FRESH_TENSOR_OPS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)

#: The factories autograd formulas take the zeros they update in place from.
_ZERO_FACTORIES = ("aten.new_zeros.default", "aten.zeros.default", "aten.zeros_like.default")


class _GraphTagger(TorchFunctionMode):
    """Tags the autograd node of every op's outputs with the module running it, so the backward
    of that node is attributed to the same module and layer."""

    def __init__(self, recorder: AllocationRecorder):
        super().__init__()
        # Weak: the recorder owns this tagger (``recorder.tagger``), and a strong reference
        # back would make every recorder a cycle left to Python's full collection. --memo-plan
        # makes one recorder per iteration (issue 42: tests/unit/megatron/training/test_reference_cycles.py).
        # The tagger only runs while its recorder is in use, so the reference is always live.
        self._recorder = weakref.ref(recorder)

    @property
    def recorder(self) -> AllocationRecorder:
        return self._recorder()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors_in(out) if t.grad_fn is not None]
            if tensors:
                _tag_graph(tensors, self.recorder.graph_tag())
        return out


class AllocationRecorder(DeviceMemoryTracker):
    """Records every storage allocation and free as an event with its context.

    A :class:`memo_ext.storage_tracker.DeviceMemoryTracker` (storage identity, ``weakref.finalize``
    frees, host marking) that also keeps an ordered event list. Context of an event:

    - phase and micro-batch: set by the driver (:meth:`phase_scope`); inside the autograd engine
      the phase is "backward", or "recompute" while a module's forward runs there (megatron's
      recompute, MEMO's drop-region recompute);
    - module and layer: forward from module hooks (:meth:`attach`); backward from the tag the
      forward left on the autograd node being executed (``torch._C._current_autograd_node()``);
    - category: "activation" unless :func:`tagged_allocations` says otherwise (the CUDA rules'
      kernel workspaces are "workspace"), or :meth:`retag` changes it later (the driver retags
      parameter gradients and megatron's global all-gather buffer).

    ``cuda_semantics``: the trace is the one a CUDA run on ``target`` makes
    (memo_ext.trace.cuda_rules): kernel workspaces (cuBLAS, operand copies, reduction
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
        self._inside = True
        self._kernel_paths = contextlib.ExitStack()
        if self.rules is not None and self.rules.target.fuses_rms_norm:
            # rms_norm as CUDA runs it (cuda_rules.cuda_kernel_paths)
            self._kernel_paths.enter_context(cuda_kernel_paths())
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            self._inside = False
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

    def repeat_tiles(self, count: int):
        """The iterations a loop over ``count`` equal tiles runs while this recorder records
        fake tensors, the middle ones recorded as copies (memo_ext.trace.tile_copies; install
        with memo_ext.tile_loop.repeated_by)."""
        return repeat_tiles(self, count)

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
        if func is fake_fast_path.DEVICE_QUERY:
            device = fake_fast_path.device_query(args)
            return func(*args, **(kwargs or {})) if device is fake_fast_path.NOT_HANDLED \
                else device
        kwargs = kwargs or {}
        input_keys = set()
        for tensor in _tensors_in((args, kwargs)):
            st = storage_of(tensor)
            if st is not None:
                input_keys.add(st._cdata)
        name = str(func)
        out = fake_fast_path.view(func, args, kwargs)
        if out is fake_fast_path.NOT_HANDLED:
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
        return out

    def _apply_rules(self, func, args, kwargs, out, fresh: list) -> None:
        """Record ``func``'s CUDA workspaces after its outputs; fold the output of an autograd
        formula's out-of-place update into the zeros it updates (memo_ext.trace.cuda_rules)."""
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
        """Record kernel workspaces (memo_ext.trace.cuda_rules.Workspace): each allocated
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
    def _entry_added(self, entry) -> None:
        self._emit_alloc(entry.token, entry.nbytes,
                         POOL_HOST if entry.category == HOST else POOL_DEVICE)

    def _entry_freed(self, entry) -> None:
        self._emit_free(entry.token)

    def _entry_resized(self, entry, old_nbytes: int) -> None:
        if entry.token in self._live:
            # A resize is a free of the old block and an allocation of the new one.
            pool = self._live[entry.token][8]
            self._emit_free(entry.token)
            self._emit_alloc(entry.token, entry.nbytes, pool)

    def follow_resize(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage was resized in place outside any op the recorder sees
        (megatron-core Megatron-FSDP's temporary buckets, ``untyped_storage().resize_``, made
        before recording began): an untracked one is an allocation now, a shrink to 0 bytes a
        free, a growth back from 0 an allocation. Outside the recorder's mode (the model's
        construction) ignored, as the allocations made there are."""
        if not getattr(self, "_inside", False):
            return
        st = storage_of(tensor)
        with self._lock:
            entry = self._live_entry(st)
            if entry is None:
                self._track(st, DEVICE, count_allocation=True)
                return
            self._maybe_resized(st)
            if entry.nbytes and entry.token not in self._live:
                self._emit_alloc(entry.token, entry.nbytes, POOL_DEVICE)

    def mark_host(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as host memory (MEMO's offload slots): pool "host"."""
        super().mark_host(tensor)
        event = self._event_of(tensor)
        if event is not None:
            event[8] = POOL_HOST

    # ------------------------------------------------------------------ events
    def _emit_alloc(self, token, nbytes: int, pool: str) -> None:
        if not self.recording or nbytes == 0 or getattr(_TLS, "untraced", 0):
            # Zero bytes are no request: the CUDA caching allocator is not called for them, and
            # the planned arena's hook, which PyTorch's pluggable allocator does call, answers
            # them with null without asking the arena (csrc/planned_arena.cpp), so no plan
            # table may hold one.
            return
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
