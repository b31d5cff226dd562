"""Where every saved-for-backward tensor of a MEMO layer goes, and how it comes back.

A MEMO layer runs its forward under ``torch.autograd.graph.saved_tensors_hooks`` bound to an
:class:`OffloadManager`. Each tensor autograd wants to keep is classified when it is saved:

- a parameter (or a view of one): kept by reference, nothing to move;
- saved inside a *drop region* (the position-wise part of the layer run on the dropped
  tokens): discarded; the region is recomputed from its inputs right before the layer's
  backward needs it, like non-reentrant checkpointing, but with the inputs themselves read
  back from host memory instead of pinned on the device;
- a view of a registered tensor (the layer input and the attention output, offloaded whole;
  the merged q/k/v, rebuilt from their offloaded kept part and recomputed dropped part):
  stored as a view description;
- anything else (the kept tokens' activations, attention statistics): copied into the layer's
  *rounding buffer*.

Rounding buffers: two device buffers, layer i writes buffer i % 2. When a layer's forward ends
its buffer is copied to a host slot (one fixed slot per layer and micro-batch in flight) on the
copy engine's D2H queue; the next layer with the same parity waits for that copy before it
overwrites the buffer. In backward, when layer i+1's backward starts, layer i's host slot is
prefetched into buffer i % 2 on the H2D queue; layer i's first unpack waits for it. Device
memory for activations therefore stays at two layers' worth however deep the model is.

With one buffer (``--memo-offload-buffers 1``) every layer uses it in turn: a layer's forward
waits for the previous layer's copy to host, and a layer's backward prefetches its own data
when it starts (nothing is prefetched ahead: the buffer is still the running layer's). The
buffer is sized to each layer as it takes it (known from the first iteration), so a MEMO (a)
layer's larger data and a checkpoint (b) layer's smaller input never hold the larger size at
once: device memory is one layer's data, at the price of copies that no compute hides. It is
freed when the chunk's first layer's backward ends (nothing needs it until the next forward).

Everything here is written against :class:`memo_ext.device.CopyEngine`, so the same protocol
runs on CUDA streams and on the CPU copy worker used in tests.

Lifetimes. A layer's saved-tensor handles (buffer slices, view descriptions, recomputed
entries) point at its :class:`LayerRecord`; autograd holds the handles, so the record lives as
long as the layer's part of the graph and is freed by reference counting when that part is.
The record must therefore never point back at its handles once autograd has them: a
record <-> handle cycle outlives the graph until Python's full collection, which in a training
process (hundreds of thousands of long-lived objects) runs rarely, and every record waiting for
it pins its copy events and storage headers (issue 42: host memory grew every iteration). The
record's lookup tables (``registered``, ``stored_whole``) serve only its forward and are emptied
when the forward ends; its drop regions are held weakly. tests/unit/megatron/training/test_reference_cycles.py
checks that no iteration leaves anything of ours to the cycle collector.
"""

from __future__ import annotations

import abc
import contextlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memo_ext.device import CopyEngine, CopyEvent
from memo_ext.offload import fp8
from memo_ext.offload.buffers import HostSlotPool, RoundingBuffer
from memo_ext.offload.tokens import TokenSplit

# Offsets inside a rounding buffer are rounded up to this many bytes so that every restored
# tensor is as aligned as a fresh allocation would be for vectorised kernels.
BUFFER_ALIGNMENT_BYTES = 256


def _align(nbytes: int) -> int:
    return (nbytes + BUFFER_ALIGNMENT_BYTES - 1) // BUFFER_ALIGNMENT_BYTES * BUFFER_ALIGNMENT_BYTES


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _owns_storage(tensor: torch.Tensor) -> bool:
    """Contiguous and filling its storage from the start: its copy is its whole storage."""
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


@dataclass
class _BufferSlice:
    """A saved tensor copied into its layer's rounding buffer (restored contiguous), in fp8
    with per-block scales when ``compressed`` (memo_ext.offload.fp8)."""

    record: "LayerRecord"
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    compressed: bool = False

    def value(self) -> torch.Tensor:
        stored = self.record.resident_buffer()[self.offset : self.offset + self.nbytes]
        if self.compressed:
            return fp8.decompress(stored, self.dtype, self.shape)
        return stored.view(self.dtype).view(self.shape)


@dataclass
class _ViewOf:
    """A saved tensor that is a view of a registered tensor."""

    entry: "_Registered"
    size: tuple
    stride: tuple
    relative_offset: int

    def value(self) -> torch.Tensor:
        base = self.entry.value()
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.relative_offset)


@dataclass
class _RecomputedSaved:
    region: "DropRegion"
    index: int

    def value(self) -> torch.Tensor:
        return self.region.saved(self.index)


class _Registered(abc.ABC):
    """A tensor whose views are saved by reference to it."""

    base_offset: int
    dtype: torch.dtype

    @abc.abstractmethod
    def value(self) -> torch.Tensor:
        """The tensor's contents, restored (backward)."""


class _WholeTensor(_Registered):
    """Offloaded whole: the layer input and the attention output."""

    def __init__(self, stored: _BufferSlice, base: torch.Tensor):
        self.stored = stored
        self.base_offset = base.storage_offset()
        self.dtype = base.dtype

    def value(self) -> torch.Tensor:
        return self.stored.value()


class _MergedTensor(_Registered):
    """q, k or v: kept tokens offloaded, dropped tokens recomputed, merged on demand."""

    def __init__(self, merged: torch.Tensor, split: TokenSplit, kept: Optional[_BufferSlice],
                 region: Optional["DropRegion"], output_index: int):
        self.split = split
        self.kept = kept
        self.region = region
        self.output_index = output_index
        self.base_offset = merged.storage_offset()
        self.dtype = merged.dtype

    def value(self) -> torch.Tensor:
        kept = self.kept.value() if self.kept is not None else None
        dropped = self.region.output(self.output_index) if self.region is not None else None
        return self.split.merge(kept, dropped)


@dataclass
class _RngSnapshot:
    cpu: torch.Tensor
    tracker: dict
    cuda: Optional[torch.Tensor]

    @classmethod
    def take(cls) -> "_RngSnapshot":
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        return cls(
            cpu=torch.get_rng_state(),
            tracker=get_cuda_rng_tracker().get_states(),
            cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        )

    def restore(self) -> None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        torch.set_rng_state(self.cpu)
        get_cuda_rng_tracker().set_states(self.tracker)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


class DropRegion:
    """The position-wise part of a layer run on the dropped tokens; recomputed on demand."""

    def __init__(self, function: Callable, inputs: Sequence, input_requires_grad: Sequence[bool],
                 keep_outputs: bool = True):
        self.function = function
        # A checkpoint-offloaded layer's region output is the layer output, which its backward
        # never reads: keeping the recomputed copy would hold one more activation.
        self.keep_outputs = keep_outputs
        self.inputs = list(inputs)  # _ViewOf descriptions or small device tensors
        self.input_requires_grad = list(input_requires_grad)
        self.rng = _RngSnapshot.take()
        self.saved_count = 0
        self.recomputed_saved: Optional[list] = None
        self.recomputed_outputs: Optional[list] = None

    def _recompute(self) -> None:
        inputs = [
            None if ref is None
            else (ref.value() if isinstance(ref, _ViewOf) else ref).detach().requires_grad_(needs_grad)
            for ref, needs_grad in zip(self.inputs, self.input_requires_grad)
        ]
        recorded: list = []
        current_rng = _RngSnapshot.take()
        self.rng.restore()
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                lambda tensor: recorded.append(tensor) or len(recorded) - 1,
                lambda index: recorded[index],
            ):
                outputs = self.function(*inputs)
        finally:
            current_rng.restore()
        if len(recorded) != self.saved_count:
            raise RuntimeError(
                f"MEMO recompute saved {len(recorded)} tensors where the forward saved "
                f"{self.saved_count}: the layer's forward is not deterministic in what it saves"
            )
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        # Keep values only. The recompute's own graph refers back to ``recorded`` through the
        # hook closure; emptying the list breaks that cycle so the graph and everything it
        # holds is freed by reference counting as soon as this layer's backward is done,
        # instead of waiting for Python's cycle collector.
        self.recomputed_saved = [tensor.detach() for tensor in recorded]
        recorded.clear()
        self.recomputed_outputs = [o.detach() for o in outputs] if self.keep_outputs else []

    def saved(self, index: int) -> torch.Tensor:
        """Recomputed saved tensor ``index``, handed over once: autograd unpacks each saved
        tensor a single time per backward, so dropping our reference here lets the layer's
        backward free recomputed activations op by op, as it does for ordinary ones."""
        return self._hand_over("recomputed_saved", index)

    def output(self, index: int) -> torch.Tensor:
        """Recomputed output ``index`` (q, k or v), handed over once like :meth:`saved`: a v
        that is a view of the fused QKV output would otherwise keep that whole output alive
        until the layer's backward ends."""
        return self._hand_over("recomputed_outputs", index)

    def _hand_over(self, which: str, index: int) -> torch.Tensor:
        if getattr(self, which) is None:
            self._recompute()
        tensors = getattr(self, which)
        tensor = tensors[index]
        if tensor is None:
            raise RuntimeError("MEMO recomputed tensor unpacked twice (retain_graph is not "
                               "supported with --memo-offload)")
        tensors[index] = None
        return tensor

    def release(self) -> None:
        self.recomputed_saved = None
        self.recomputed_outputs = None


@dataclass
class LayerRecord:
    """One offloaded layer's forward for one micro-batch."""

    manager: "OffloadManager"
    layer: int
    buffer: RoundingBuffer
    to_host: bool = True
    used_bytes: int = 0
    stored_tensors: int = 0
    host_slot: Optional[torch.Tensor] = None
    offload_event: Optional[CopyEvent] = None
    prefetch_event: Optional[CopyEvent] = None
    resident: bool = True
    previous: Optional["LayerRecord"] = None
    # Storage key -> registered tensor (forward only: emptied by end_layer, see the module
    # docstring's "Lifetimes").
    registered: dict = field(default_factory=dict)
    # Weak references to the layer's drop regions: their handles in autograd's graph keep them
    # alive while anything can unpack them, and a region refers back to this record (through
    # its inputs' buffer slices), so a strong list would be a cycle.
    regions: list = field(default_factory=list)
    current_region: Optional[DropRegion] = None
    checkpoint: bool = False
    # Storage key -> (weak reference to the storage of, slice of) a saved tensor stored whole
    # (it filled its storage), which register_whole can then reuse instead of storing the
    # same bytes again. Forward only, like ``registered``: emptied by end_layer.
    stored_whole: dict = field(default_factory=dict)

    def store(self, tensor: torch.Tensor, compress: bool = False) -> _BufferSlice:
        """Copy ``tensor`` into this layer's rounding buffer (forward); ``compress``: as fp8
        with per-block scales (lossy; floating-point tensors only)."""
        compress = compress and fp8.compressible(tensor)
        nbytes = (fp8.stored_bytes(tensor.numel()) if compress
                  else tensor.numel() * tensor.element_size())
        offset = self.used_bytes
        self.buffer.ensure_capacity(offset + _align(nbytes), keep_bytes=offset)
        destination = self.buffer.tensor[offset : offset + nbytes]
        if compress:
            fp8.compress(tensor, destination)
        else:
            destination.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self.used_bytes = offset + _align(nbytes)
        self.stored_tensors += 1
        return _BufferSlice(self, offset, nbytes, tensor.dtype, tensor.shape, compress)

    def resident_buffer(self) -> torch.Tensor:
        """The rounding buffer holding this layer's data, prefetching it first if needed."""
        if not self.resident:
            self.manager.prefetch(self)
        if self.prefetch_event is not None:
            self.manager.engine.wait(self.prefetch_event)
            self.prefetch_event = None
        return self.buffer.tensor


class OffloadManager:
    """Saved-tensor routing, rounding buffers and host slots of one model chunk."""

    def __init__(self, engine: CopyEngine, alpha: float,
                 host_allocation_scope: Callable[[], ContextManager[None]] = contextlib.nullcontext,
                 compress_whole: bool = False, buffers: int = 2):
        if buffers not in (1, 2):
            raise ValueError(f"buffers must be 1 or 2, got {buffers}")
        self.engine = engine
        self.alpha = alpha
        # --memo-offload-fp8: the tensors offloaded whole are stored as fp8 (lossy).
        self.compress_whole = compress_whole
        self.buffers = tuple(RoundingBuffer(engine) for _ in range(buffers))
        # Bytes each layer stored in its last forward: with one buffer, the size it takes.
        self.layer_bytes: dict[int, int] = {}
        self.host_slots = HostSlotPool(engine, host_allocation_scope)
        self.parameter_storages: set[int] = set()
        self.active: Optional[LayerRecord] = None
        self.last_record: Optional[LayerRecord] = None
        # "recomputed" counts the alpha layers' dropped bytes (S_oth's measurement),
        # "checkpointed" what checkpoint-offloaded layers drop.
        self.saved_bytes = {"offloaded": 0, "recomputed": 0, "checkpointed": 0}
        self.layer_forwards = 0  # alpha (mode a) layer forwards, S_oth's denominator
        self.largest_layer_bytes = 0
        self.most_stored_tensors = 0

    def set_alpha(self, alpha: float, other_bytes: int = 0) -> None:
        """Use ``alpha`` from the next layer forward on (between iterations only).

        ``other_bytes`` (S_oth, alpha-split bytes per layer at alpha 1) sizes both rounding
        buffers for the new alpha now, while they are idle: grown tensor by tensor inside the
        next forward instead, each growth would hold the old and the new buffer at once."""
        self.engine.synchronize()
        self.alpha = alpha
        self.host_slots.reset()
        if len(self.buffers) == 1:
            # Sized per layer at its start; the (a) layers' sizes change with alpha.
            self.layer_bytes.clear()
        elif other_bytes:
            expected = (self.largest_layer_bytes + math.ceil(alpha * other_bytes)
                        + self.buffer_padding_bytes)
            for buffer in self.buffers:
                buffer.reserve(expected)

    @property
    def buffer_padding_bytes(self) -> int:
        """Bytes a layer's buffer may need beyond its tensors' bytes when alpha changes: each
        stored tensor may add up to one alignment's padding."""
        return self.most_stored_tensors * BUFFER_ALIGNMENT_BYTES

    # ---------------------------------------------------------------- forward
    def begin_layer(self, layer: int, is_first_of_chunk: bool,
                    parameters: Sequence[torch.Tensor], to_host: bool = True,
                    checkpoint: bool = False) -> LayerRecord:
        """Start a layer's forward: take its rounding buffer (wait for the D2H of the layer
        that used it last) and open a record. ``to_host=False`` (the last two layers with one
        micro-batch in flight) keeps the layer's data in the buffer until its backward;
        ``checkpoint``: the layer is checkpoint-offloaded (its whole body is one drop region)."""
        self.parameter_storages.update(_storage_key(p) for p in parameters)
        buffer = self.buffers[layer % len(self.buffers)]
        self.engine.wait(buffer.last_event)
        if len(self.buffers) == 1 and layer in self.layer_bytes:
            buffer.resize(self.layer_bytes[layer])
        record = LayerRecord(self, layer, buffer, to_host=to_host, checkpoint=checkpoint)
        self.layer_forwards += not checkpoint
        record.previous = None if is_first_of_chunk else self.last_record
        buffer.owner = record
        self.active = record
        return record

    def end_layer(self, record: LayerRecord, layer_input: torch.Tensor,
                  layer_output: torch.Tensor) -> None:
        """Finish a layer's forward: start the D2H of its buffer, hook its backward."""
        self.active = None
        self.last_record = record
        # Nothing looks tensors up by storage after the forward (backward reaches them through
        # the handles autograd saved), and the tables' entries refer back to this record: kept,
        # they would tie it in cycles to its slices until Python's full collection.
        record.registered.clear()
        record.stored_whole.clear()
        self.largest_layer_bytes = max(self.largest_layer_bytes, record.used_bytes)
        self.layer_bytes[record.layer] = record.used_bytes
        self.most_stored_tensors = max(self.most_stored_tensors, record.stored_tensors)
        if record.used_bytes and record.to_host:
            record.host_slot = self.host_slots.acquire(record.layer, record.used_bytes)
            record.offload_event = self.engine.offload(
                record.host_slot[: record.used_bytes], record.buffer.tensor[: record.used_bytes]
            )
            record.buffer.last_event = record.offload_event
        if layer_output.requires_grad:
            layer_output.register_hook(lambda grad: self._on_backward_start(record))
        if layer_input.requires_grad:
            layer_input.register_hook(lambda grad: self._on_backward_end(record))

    def hooks(self, record: LayerRecord):
        """The saved_tensors_hooks context for ``record``'s forward."""
        return torch.autograd.graph.saved_tensors_hooks(
            lambda tensor: self._pack(record, tensor), lambda handle: self._unpack(handle)
        )

    def run_drop_region(self, record: LayerRecord, function: Callable,
                        inputs: Sequence[torch.Tensor], small_inputs: Sequence[bool],
                        keep_outputs: bool = True):
        """``function(*inputs)`` with everything it saves dropped. Inputs flagged small (or
        None) are kept by reference; the others must be views of registered tensors.
        ``keep_outputs=False``: the recomputation keeps only what backward unpacks."""
        descriptions = [
            tensor if small else self._describe_view(record, tensor)
            for tensor, small in zip(inputs, small_inputs)
        ]
        region = DropRegion(function, descriptions,
                            [t is not None and t.requires_grad for t in inputs], keep_outputs)
        record.regions.append(weakref.ref(region))
        record.current_region = region
        try:
            outputs = function(*inputs)
        finally:
            record.current_region = None
        return region, outputs

    def register_whole(self, record: LayerRecord, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` whole now; saved views of it refer to the copy. A tensor already
        stored whole when autograd saved it (the core attention's output, saved inside the
        attention before the layer registers it) is not stored twice."""
        if not tensor.is_contiguous():
            raise ValueError("MEMO registers only contiguous tensors")
        key = _storage_key(tensor)
        saved, stored = record.stored_whole.pop(key, (None, None))
        # The saved tensor's storage still alive proves it is this one (not a new allocation
        # at a freed address).
        if (saved is not None and not saved.expired() and stored.dtype == tensor.dtype
                and not stored.compressed
                and stored.nbytes == tensor.numel() * tensor.element_size()):
            record.registered[key] = _WholeTensor(stored, tensor)
            return
        stored = record.store(tensor, compress=self.compress_whole)
        record.registered[_storage_key(tensor)] = _WholeTensor(stored, tensor)
        self.saved_bytes["offloaded"] += stored.nbytes

    def register_merged(self, record: LayerRecord, merged: torch.Tensor, split: TokenSplit,
                        kept: Optional[torch.Tensor], region: Optional[DropRegion],
                        output_index: int) -> None:
        """``merged`` = split.merge(kept, region output): store only the kept part."""
        stored = record.store(kept) if kept is not None and kept.numel() else None
        record.registered[_storage_key(merged)] = _MergedTensor(
            merged, split, stored, region, output_index
        )
        if stored is not None:
            self.saved_bytes["offloaded"] += stored.nbytes
        if region is not None:
            dropped = merged.numel() * merged.element_size() - (stored.nbytes if stored else 0)
            self.saved_bytes["recomputed"] += dropped

    def forget(self, record: LayerRecord, tensors: Sequence[torch.Tensor]) -> None:
        """Stop matching saved tensors against ``tensors`` (registered, and saved by now):
        the layer may then free them, and a later tensor that reuses their memory is not
        taken for a view of them."""
        for tensor in tensors:
            record.registered.pop(_storage_key(tensor), None)

    def _describe_view(self, record: LayerRecord, tensor: torch.Tensor) -> _ViewOf:
        entry = record.registered.get(_storage_key(tensor))
        if entry is None or entry.dtype != tensor.dtype:
            raise ValueError("a drop region input must be a view of a registered tensor")
        return _ViewOf(entry, tuple(tensor.size()), tuple(tensor.stride()),
                       tensor.storage_offset() - entry.base_offset)

    def _pack(self, record: LayerRecord, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if record.current_region is not None:
            region = record.current_region
            region.saved_count += 1
            # Parameters and views of this layer's registered tensors come back with the
            # recomputation without costing activation bytes: counting them would inflate S_oth.
            if key not in self.parameter_storages and key not in record.registered:
                bucket = "checkpointed" if record.checkpoint else "recomputed"
                self.saved_bytes[bucket] += tensor.numel() * tensor.element_size()
            return _RecomputedSaved(region, region.saved_count - 1)
        if key in self.parameter_storages or tensor.numel() == 0:
            return tensor
        entry = record.registered.get(key)
        if entry is not None and entry.dtype == tensor.dtype:
            return self._describe_view(record, tensor)
        self.saved_bytes["offloaded"] += tensor.numel() * tensor.element_size()
        stored = record.store(tensor.contiguous())
        if _owns_storage(tensor):
            record.stored_whole[key] = (StorageWeakRef(tensor.untyped_storage()), stored)
        return stored

    @staticmethod
    def _unpack(handle):
        if isinstance(handle, torch.Tensor):
            return handle
        return handle.value()

    # --------------------------------------------------------------- backward
    def prefetch(self, record: LayerRecord) -> None:
        """Start the H2D copy of ``record``'s host slot into its rounding buffer."""
        if record.resident:
            return
        buffer = record.buffer
        # The buffer's previous D2H (possibly of another micro-batch's forward) and this
        # record's own D2H must be complete, and so must compute that last read the buffer.
        self.engine.wait(buffer.last_event)
        self.engine.wait(record.offload_event)
        if len(self.buffers) == 1:
            buffer.resize(record.used_bytes)
        else:
            buffer.ensure_capacity(record.used_bytes)
        record.prefetch_event = self.engine.prefetch(
            buffer.tensor[: record.used_bytes], record.host_slot[: record.used_bytes],
            after=self.engine.record_compute(),
        )
        buffer.last_event = record.prefetch_event
        buffer.owner = record
        record.resident = True

    def _prefetch_if_evicted(self, record: LayerRecord) -> None:
        """Prefetch ``record`` unless its buffer still holds its data (nobody took it since)."""
        if record.used_bytes and record.buffer.owner is not record:
            if not record.to_host:
                raise RuntimeError(
                    f"MEMO: layer {record.layer}'s rounding buffer was overwritten before its "
                    "backward but the layer was not offloaded (more micro-batches in flight "
                    "than declared to MemoOffload)"
                )
            record.resident = False
            self.prefetch(record)

    def _on_backward_start(self, record: LayerRecord) -> None:
        self._prefetch_if_evicted(record)
        # One layer ahead needs a second buffer: with one, it is still this layer's.
        if record.previous is not None and len(self.buffers) > 1:
            self._prefetch_if_evicted(record.previous)

    def abandon_forward(self) -> None:
        """End the layer forwards since the last backward as their backwards would have ended
        them, for a micro-batch whose backward will not run (its output dropped after the
        forward): each record's host slot goes back to the pool and its drop regions are
        released, and one buffer is freed as after the chunk's first layer's backward. The
        next forward then starts from the state a whole iteration leaves (the tracer's
        forward warm-up relies on it: megatron.training.tracing.warmup_mode). Without it the
        records stay chained to the last one until the next forward replaces it, and their
        host slots are freed then and allocated again."""
        record, self.last_record, self.active = self.last_record, None, None
        while record is not None:
            previous = record.previous
            self._on_backward_end(record)
            record = previous
        if len(self.buffers) == 1:
            self.buffers[0].release()

    def _on_backward_end(self, record: LayerRecord) -> None:
        if len(self.buffers) == 1 and record.previous is None and record.buffer.owner is record:
            # The chunk's first layer: no layer needs the one buffer until the next forward,
            # which allocates it at its first layer's size. Freed, it costs nothing through the
            # optimizer step, and each iteration allocates and frees it alike.
            record.buffer.release()
        for reference in record.regions:
            region = reference()
            if region is not None:  # None: its handles were all unpacked, its tensors freed
                region.release()
        if record.host_slot is not None:
            for event in (record.offload_event, record.prefetch_event):
                if event is not None:
                    event.synchronize()
            self.host_slots.release(record.layer, record.host_slot)
            record.host_slot = None
        # The chain to earlier layers' records would keep them (and their events) alive for as
        # long as anything holds this one (the buffer's owner, the manager's last record).
        record.regions.clear()
        record.previous = None
