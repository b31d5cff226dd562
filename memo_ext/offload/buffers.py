"""The device and host memory MEMO's offload copies go through: the rounding buffers (device)
and the per-layer host slots. :mod:`memo_ext.offload.manager` decides what goes where; these
two classes only own the memory and the copy event that guards reusing it."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

import torch

from memo_ext.device import CopyEngine, CopyEvent

if TYPE_CHECKING:
    from memo_ext.offload.manager import LayerRecord


class RoundingBuffer:
    """One of the two device buffers; grows (first iteration only) to exactly the largest
    layer's bytes, so device memory is what the layers need and nothing more."""

    def __init__(self, engine: CopyEngine):
        self.engine = engine
        self.tensor: Optional[torch.Tensor] = None
        self.last_event: Optional[CopyEvent] = None
        self.owner: Optional["LayerRecord"] = None

    @property
    def capacity(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()

    def reserve(self, nbytes: int) -> None:
        """Grow an idle buffer to at least ``nbytes``, freeing the old one first, so growing
        never holds both (unlike ensure_capacity in the middle of a layer)."""
        if nbytes > self.capacity:
            self.resize(nbytes)

    def release(self) -> None:
        """Free the tensor (after the copies that use it)."""
        self.engine.wait(self.last_event)
        self.tensor, self.owner = None, None

    def resize(self, nbytes: int) -> None:
        """Exactly ``nbytes`` (one buffer shared by layers of different sizes): the old tensor
        is freed first, after the copies that use it, so the two are never held at once."""
        if nbytes != self.capacity:
            self.release()
            self.tensor = self.engine.alloc_device(nbytes)

    def ensure_capacity(self, nbytes: int, keep_bytes: int = 0) -> None:
        """Grow to at least ``nbytes``, preserving the first ``keep_bytes``."""
        if nbytes <= self.capacity:
            return
        grown = self.engine.alloc_device(nbytes)
        if keep_bytes:
            grown[:keep_bytes].copy_(self.tensor[:keep_bytes])
        self.tensor = grown


class HostSlotPool:
    """Fixed host slots per layer; a layer needs one per micro-batch in flight."""

    def __init__(self, engine: CopyEngine,
                 allocation_scope: Callable[[], ContextManager[None]] = contextlib.nullcontext):
        self.engine = engine
        self.allocation_scope = allocation_scope
        self.free: dict[int, list[torch.Tensor]] = {}
        self.allocated_bytes = 0

    def acquire(self, layer: int, nbytes: int) -> torch.Tensor:
        free = self.free.setdefault(layer, [])
        for index, slot in enumerate(free):
            if slot.numel() >= nbytes:
                return free.pop(index)
        with self.allocation_scope():
            slot = self.engine.alloc_host(nbytes)
        self.allocated_bytes += slot.numel()
        return slot

    def release(self, layer: int, slot: torch.Tensor) -> None:
        self.free.setdefault(layer, []).append(slot)

    def reset(self) -> None:
        """Drop every slot (after alpha changed, slot sizes change)."""
        self.free.clear()
        self.allocated_bytes = 0
