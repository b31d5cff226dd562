"""Device memory statistics from whichever CUDA allocator serves this process.

PyTorch's statistics (``torch.cuda.memory_allocated``, ``memory_reserved``,
``max_memory_allocated``, ``reset_peak_memory_stats``, ``memory_stats``) and its snapshot calls
(``torch.cuda.memory._record_memory_history`` / ``_snapshot`` / ``_dump_snapshot``) come from
the native caching allocator. Once ``torch.cuda.memory.change_current_allocator`` has installed
a ``CUDAPluggableAllocator`` (``--memo-plan``'s arena, ``--memo-stitching-allocator``), every
one of them raises ``RuntimeError: CUDAPluggableAllocator does not yet support ...``
(torch/csrc/cuda/CUDAPluggableAllocator.cpp), and ``Tensor.record_stream`` becomes a silent
no-op: the Python wrapper cannot set the allocator's record-stream hook. So every caller that
reads device memory or hands a tensor to another stream goes through this module: the
allocator that replaced PyTorch's registers an :class:`AllocatorBackend` here right after
installing itself, and this module asks it instead of PyTorch.

All sizes are bytes. Nothing here runs without CUDA except the registry itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

__all__ = ["AllocatorBackend", "DeviceMemory", "current_allocator", "device_memory",
           "record_stream", "register_allocator", "reset_peak", "snapshots_supported",
           "unregister_allocator"]


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory as its allocator counts it (bytes).

    allocated: held by live tensors; reserved: what the allocator holds from the driver
    (allocated plus its cache); the peaks are since the last :func:`reset_peak`."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int


class AllocatorBackend(Protocol):
    """What an allocator that replaced PyTorch's CUDA allocator tells this module."""

    #: Shown in logs, e.g. "MEMO planned arena".
    name: str

    def memory(self, device: int) -> DeviceMemory:
        """The counters of ``device`` (a CUDA device index)."""

    def reset_peak(self, device: int) -> None:
        """Peaks of ``device`` back to the current values."""

    def record_stream(self, data_ptr: int, stream_handle: int) -> None:
        """The block at ``data_ptr`` is in use on the stream ``stream_handle`` (a
        ``cudaStream_t`` as an integer): do not hand it out again before the work queued there
        so far has finished."""


_backend: Optional[AllocatorBackend] = None


def register_allocator(backend: AllocatorBackend) -> None:
    """Make ``backend`` the source of every statistic (call it right after
    ``torch.cuda.memory.change_current_allocator``). Raises RuntimeError when another
    allocator is registered: PyTorch allows one allocator per process."""
    global _backend
    if _backend is not None and _backend is not backend:
        raise RuntimeError(f"{backend.name}: {_backend.name} already replaced PyTorch's CUDA "
                           "allocator in this process; use one of them")
    _backend = backend


def unregister_allocator() -> None:
    """Forget the registered allocator (tests; a process cannot uninstall a CUDA allocator)."""
    global _backend
    _backend = None


def current_allocator() -> Optional[AllocatorBackend]:
    """The registered allocator, or None while PyTorch's caching allocator serves CUDA."""
    return _backend


def _index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


def device_memory(device=None) -> DeviceMemory:
    """The counters of ``device`` (index, ``torch.device`` or None for the current one)."""
    index = _index(device)
    if _backend is not None:
        return _backend.memory(index)
    return DeviceMemory(torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index),
                        torch.cuda.max_memory_allocated(index),
                        torch.cuda.max_memory_reserved(index))


def reset_peak(device=None) -> None:
    """Start new peaks on ``device`` (as ``torch.cuda.reset_peak_memory_stats``)."""
    index = _index(device)
    if _backend is not None:
        _backend.reset_peak(index)
    else:
        torch.cuda.reset_peak_memory_stats(index)


def record_stream(tensor: torch.Tensor, stream) -> None:
    """``tensor.record_stream(stream)`` that also reaches a registered allocator, for which
    PyTorch's own call does nothing."""
    tensor.record_stream(stream)
    if _backend is not None:
        _backend.record_stream(tensor.untyped_storage().data_ptr(), int(stream.cuda_stream))


def snapshots_supported() -> bool:
    """Whether ``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot`` work: only
    under PyTorch's own caching allocator."""
    return _backend is None
