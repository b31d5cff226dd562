"""A CPU test double of the ``torch.cuda`` surface our CUDA-only code touches.

It makes ``torch.cuda.is_available()`` true on a machine without a GPU and answers the calls
listed in docs/gpu.md as PyTorch documents them, raising where PyTorch raises:

- devices: ``device_count``, ``current_device``, ``set_device``, ``get_device_name``,
  ``get_device_properties``, ``mem_get_info``, ``synchronize``, ``_sleep``;
- random state: ``get_rng_state`` / ``set_rng_state`` of each device's generator (a ByteTensor
  of 16 bytes, Philox's seed and offset; anything but a ByteTensor raises TypeError);
- streams and events: ``Stream`` (each with its own ``cuda_stream`` handle), ``current_stream``,
  ``stream`` (context manager), ``Event`` (``record``, ``query``, ``synchronize``,
  ``elapsed_time``, which raises unless both events were created with ``enable_timing`` and
  recorded), ``Tensor.record_stream``; an NCCL stream (:meth:`CudaDouble.nccl_stream`) stands
  for the internal stream a process group's collectives run on;
- pinned host memory: ``torch.empty(..., pin_memory=True)`` gives ordinary host memory, counted;
- page-locked host memory: ``cuda.cudart()``'s ``cudaHostRegister`` / ``cudaHostUnregister``
  (:class:`FakeCudart`: every call recorded, overlapping or unknown ranges refused with the
  runtime's error codes, an optional cap on locked bytes as the driver's refusal);
- memory statistics (``memory_allocated``, ``memory_reserved``, ``max_memory_*``,
  ``reset_peak_memory_stats``, ``memory_stats``, ``empty_cache``,
  ``set_per_process_memory_fraction``) and snapshots (``memory._record_memory_history``,
  ``_snapshot``, ``_dump_snapshot``) of the native caching allocator, modelled by
  :meth:`CudaDouble.allocate` / :meth:`CudaDouble.free`;
- pluggable allocators: ``memory.CUDAPluggableAllocator`` loads the library and looks its two
  functions up with ctypes, as PyTorch does; ``memory.change_current_allocator`` refuses once
  the current allocator is initialized (PyTorch initializes it at the first CUDA allocation);
  from then on :meth:`CudaDouble.allocate` calls the library's functions with the stream's
  handle as torch/csrc/cuda/CUDAPluggableAllocator.cpp does: the alloc hook for every size, 0
  included; whatever it returns, null included, becomes the tensor's address and is recorded
  by address without replacing an entry already there; the free hook runs for non-null
  addresses only (a DataPtr's deleter is never called for null) with the recorded size, device
  and stream, and an address with no record raises "Trying to free a pointer not allocated
  here". A C++ exception the hook throws becomes the Python exception PyTorch's binding layer
  makes of it (c10::OutOfMemoryError: torch.OutOfMemoryError; another c10::Error or
  std::exception: RuntimeError), through tests/pluggable_shim.cpp (ctypes cannot catch C++
  exceptions; built on first use against the installed torch's c10). The statistics and
  snapshot calls raise PyTorch's RuntimeError ("CUDAPluggableAllocator does not yet support
  ..."), ``set_per_process_memory_fraction`` and ``empty_cache`` do nothing, and
  ``Tensor.record_stream`` no longer reaches the allocator (the Python API cannot set the
  pluggable allocator's record-stream hook);
- the native caching allocator gives 0 bytes a null address without allocating
  (NativeCachingAllocator::allocate), as the double does.

- the CUDA flash-attention kernels (:class:`FlashKernelDouble`): torch's FlashAttention-2 build
  (``aten._scaled_dot_product_flash_attention`` and its backward) and flash-attn's
  ``_wrapped_flash_attn_forward`` / ``_backward``, computed by torch's CPU flash kernel but with
  their operands read the way the CUDA code reads them: the log-sum-exp by raw pointer as a
  contiguous ``[b, heads, s_q]``, whatever its strides, so a sliced log-sum-exp gives the wrong
  gradients a GPU gives.

- cuDNN's fused attention (:class:`CudnnAttentionDouble`): CPU kernels registered for
  ``aten._scaled_dot_product_cudnn_attention`` and its backward, so calls go through the ops'
  real schemas, with the ``[b, heads, s_q, 1]`` log-sum-exp, GQA K/V in their group count, the
  undefined-vs-empty rules of their ``Tensor`` arguments, and operands read as cuDNN's cached
  graphs read them.

Everything runs synchronously on the CPU: an event recorded is complete. What this cannot show
is a GPU's timing or a kernel's arithmetic; the ``gpu``-marked tests are for that.
"""
from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import hashlib
import itertools
import math
import os
import pickle
import shutil
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

#: What the pluggable allocator says for every statistic (torch/csrc/cuda/CUDAPluggableAllocator.cpp).
PLUGGABLE_UNSUPPORTED = ("CUDAPluggableAllocator does not yet support {}. If you need it, please "
                         "file an issue describing your use case.")
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                            ctypes.c_void_p)
# The caching allocator rounds requests to 512 bytes and reserves 2 MiB segments for small ones
# (c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, kSmallBuffer); that is all the double models.
_MIN_BLOCK, _SMALL_SEGMENT, _SMALL_SIZE = 512, 2 << 20, 1 << 20
# A CUDA generator's state: Philox's 64-bit seed and 64-bit offset (CUDAGeneratorImpl::get_state).
_RNG_STATE_BYTES = 16


class FakeStream:
    """``torch.cuda.Stream``: a handle (``cuda_stream``) and the ordering calls."""

    _handles = itertools.count(0x1000, 0x10)

    def __init__(self, device=None, priority: int = 0, *, handle: Optional[int] = None):
        self.device = torch.device("cuda", 0 if device is None else _index(device))
        self.priority = priority
        self.cuda_stream = next(self._handles) if handle is None else handle
        self.waited_for: list = []  # streams and events this stream was ordered after

    def wait_stream(self, other: "FakeStream") -> None:
        self.waited_for.append(other)

    def wait_event(self, event: "FakeEvent") -> None:
        self.waited_for.append(event)

    def record_event(self, event: Optional["FakeEvent"] = None) -> "FakeEvent":
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self) -> int:
        return hash(self.cuda_stream)

    def __repr__(self) -> str:
        return f"<FakeStream {self.cuda_stream:#x} on {self.device}>"


class FakeEvent:
    """``torch.cuda.Event``: complete once recorded (nothing runs asynchronously here)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing
        self.stream: Optional[FakeStream] = None
        self._time: Optional[float] = None

    def record(self, stream: Optional[FakeStream] = None) -> None:
        self.stream = stream if stream is not None else torch.cuda.current_stream()
        self._time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Optional[FakeStream] = None) -> None:
        (stream if stream is not None else torch.cuda.current_stream()).wait_event(self)

    def elapsed_time(self, end: "FakeEvent") -> float:
        """Milliseconds, as CUDA's; raises as CUDA does for events without timing."""
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("CUDA error: invalid resource handle")
        if self._time is None or end._time is None:
            raise RuntimeError("CUDA error: device not ready")
        return (end._time - self._time) * 1e3


class FakeCudaError(enum.IntEnum):
    """``torch.cuda.cudart().cudaError``; PyTorch's binding names only ``success``, the other
    values come back unnamed from the runtime (driver_types.h)."""

    success = 0
    invalid_value = 1
    memory_allocation = 2
    host_memory_already_registered = 712
    host_memory_not_registered = 713


_CUDA_ERROR_STRINGS = {
    FakeCudaError.success: "no error",
    FakeCudaError.invalid_value: "invalid argument",
    FakeCudaError.memory_allocation: "out of memory",
    FakeCudaError.host_memory_already_registered:
        "part or all of the requested memory range is already mapped",
    FakeCudaError.host_memory_not_registered:
        "pointer does not correspond to a registered memory region",
}


class FakeCudart:
    """``torch.cuda.cudart()`` (torch/csrc/cuda/shared/cudart.cpp): host registration returns
    a ``cudaError`` instead of raising. ``lockable_bytes`` caps the bytes registered at once
    (None: no cap), standing for the driver refusing to lock more."""

    cudaError = FakeCudaError

    def __init__(self):
        self.registered: dict[int, int] = {}  # address -> bytes
        self.register_calls: list[tuple[int, int, int]] = []  # (address, bytes, flags)
        self.unregister_calls: list[int] = []
        self.lockable_bytes: Optional[int] = None

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> FakeCudaError:
        self.register_calls.append((ptr, size, flags))
        if size == 0:
            return FakeCudaError.invalid_value
        if any(ptr < start + length and start < ptr + size
               for start, length in self.registered.items()):
            return FakeCudaError.host_memory_already_registered
        if (self.lockable_bytes is not None
                and sum(self.registered.values()) + size > self.lockable_bytes):
            return FakeCudaError.memory_allocation
        self.registered[ptr] = size
        return FakeCudaError.success

    def cudaHostUnregister(self, ptr: int) -> FakeCudaError:
        self.unregister_calls.append(ptr)
        if self.registered.pop(ptr, None) is None:
            return FakeCudaError.host_memory_not_registered
        return FakeCudaError.success

    def cudaGetErrorString(self, error: FakeCudaError) -> str:
        return _CUDA_ERROR_STRINGS[error]


def _index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    index = getattr(device, "index", None)
    return torch.cuda.current_device() if index is None else index


@dataclass
class _Caching:
    """The native caching allocator's counters of one device (bytes)."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    blocks: dict = field(default_factory=dict)  # fake address -> rounded size


SHIM_SOURCE = Path(__file__).with_name("pluggable_shim.cpp")
SHIM_BUILD_DIR = Path(__file__).resolve().parents[1] / "build" / "test_shims"
#: What tests/pluggable_shim.cpp reports a hook's exception as (kind 1: c10::OutOfMemoryError).
_EXCEPTION_KINDS = {1: torch.OutOfMemoryError, 2: RuntimeError, 3: RuntimeError, 4: RuntimeError}


@functools.lru_cache(maxsize=None)
def _shim() -> ctypes.CDLL:
    """tests/pluggable_shim.cpp built (once per source and torch, under build/test_shims/) and
    loaded."""
    from memo_ext import torch_build

    include, lib_dir = torch_build.torch_dirs()
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes() + str(include).encode()).hexdigest()[:16]
    library = SHIM_BUILD_DIR / f"libmemo_pluggable_shim_{digest}.so"
    if not library.is_file():
        SHIM_BUILD_DIR.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([shutil.which("g++") or "c++", "-std=c++17", "-O1", "-shared", "-fPIC",
                        *torch_build.compile_flags(), str(SHIM_SOURCE), "-o", str(partial),
                        *torch_build.link_flags()], check=True, capture_output=True, timeout=300)
        os.replace(partial, library)
    shim = ctypes.CDLL(str(library))
    shim.memo_test_call_alloc_hook.restype = ctypes.c_void_p
    shim.memo_test_call_alloc_hook.argtypes = [
        ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_size_t]
    return shim


def call_alloc_hook(hook: int, nbytes: int, device: int, stream: int) -> int:
    """``hook`` (an alloc function's address) called as CUDAPluggableAllocator::malloc calls
    it: its pointer as an int (0 for null, passed on unchecked), or the Python exception
    PyTorch's binding layer raises for the C++ exception it threw."""
    kind, message = ctypes.c_int(0), ctypes.create_string_buffer(4096)
    address = _shim().memo_test_call_alloc_hook(hook, nbytes, device, stream,
                                                ctypes.byref(kind), message, len(message))
    if kind.value:
        raise _EXCEPTION_KINDS[kind.value](message.value.decode(errors="replace"))
    return address or 0


class _Pluggable:
    """What ``torch._C._cuda_customAllocator`` keeps: the library's two functions, and the
    table of live allocations CUDAPluggableAllocator keeps by address."""

    def __init__(self, path: str, alloc_fn_name: str, free_fn_name: str):
        library = ctypes.CDLL(path)
        alloc_fn = ctypes.cast(getattr(library, alloc_fn_name), ctypes.c_void_p).value
        free_fn = ctypes.cast(getattr(library, free_fn_name), ctypes.c_void_p).value
        if alloc_fn is None:
            raise AssertionError(f"alloc_fn '{alloc_fn_name}' is None")
        if free_fn is None:
            raise AssertionError(f"free_fn '{free_fn_name}' is None")
        self.path = path
        self.alloc_fn = alloc_fn
        self.free = _FREE_FN(free_fn)
        self.metadata: dict[int, tuple[int, int, int]] = {}  # address -> (size, device, stream)

    def malloc(self, nbytes: int, device: int, stream: int) -> int:
        """CUDAPluggableAllocator::malloc: the hook's pointer, unchecked, recorded with
        emplace (an address already recorded keeps its first entry: null is one)."""
        address = call_alloc_hook(self.alloc_fn, nbytes, device, stream)
        self.metadata.setdefault(address, (nbytes, device, stream))
        return address

    def raw_delete(self, address: int) -> None:
        """CUDAPluggableAllocator::raw_delete, reached from a DataPtr's deleter (so never for
        null): the free hook with the recorded size, device and stream. PyTorch raises this
        inside a deleter, which terminates the process; the double raises it."""
        if address not in self.metadata:
            raise RuntimeError("Trying to free a pointer not allocated here")
        nbytes, device, stream = self.metadata.pop(address)
        self.free(address, nbytes, device, stream)

    def allocator(self) -> "_Pluggable":
        return self


class CudaDouble:
    """The fake CUDA of one process: ``device_count`` devices of ``total_memory`` bytes each.
    :meth:`install` patches torch (use the ``cuda_double`` fixture, which undoes it)."""

    def __init__(self, device_count: int = 1, total_memory: int = 80 * 2**30,
                 name: str = "NVIDIA H100 80GB HBM3 (CPU test double)"):
        self.device_count = device_count
        self.total_memory = total_memory
        self.name = name
        self.device = 0
        self.caching = [_Caching() for _ in range(device_count)]
        self.pluggable: Optional[_Pluggable] = None
        self.initialized = False     # the current allocator served its first allocation
        self.history_enabled = False
        self.memory_fraction = [1.0] * device_count
        self.pinned_bytes = 0
        self.cudart = FakeCudart()
        self.recorded_streams: list[tuple[int, int]] = []  # (data_ptr, stream) the allocator saw
        self.dropped_record_streams = 0  # record_stream calls a pluggable allocator never saw
        self._default = [FakeStream(d, handle=0) for d in range(device_count)]
        self._current = list(self._default)
        self._nccl = [FakeStream(d) for d in range(device_count)]
        self._live: dict[int, tuple[int, int, int]] = {}  # address -> (bytes, device, stream)
        self.rng_states = [torch.zeros(_RNG_STATE_BYTES, dtype=torch.uint8)
                           for _ in range(device_count)]
        self._next_address = itertools.count(0x7F0000000000, 1 << 21)

    # ------------------------------------------------------------------ allocations
    def allocate(self, nbytes: int, device: Optional[int] = None,
                 stream: Optional[FakeStream] = None) -> int:
        """A CUDA tensor of ``nbytes`` on ``device``, allocated on ``stream`` (default: the
        current one) by the current allocator: its data pointer, 0 for null. A pluggable
        allocator's hook is called for every size and its pointer is not checked (PyTorch
        does not check it either): a hook that answers a request with null gives a tensor at
        address 0. The caching allocator answers 0 bytes with null, allocating nothing, and
        raises torch.OutOfMemoryError past the device's memory."""
        device = self.device if device is None else device
        stream = stream or self._current[device]
        self.initialized = True
        if self.pluggable is not None:
            address = self.pluggable.malloc(nbytes, device, stream.cuda_stream)
        elif nbytes == 0:
            address = 0
        else:
            address = self._caching_malloc(nbytes, device)
        if address:
            self._live[address] = (nbytes, device, stream.cuda_stream)
        return address

    def free(self, address: int) -> None:
        """The tensor at ``address`` is gone: the allocator frees it with the size, device and
        stream of its allocation, as PyTorch's deleter does; nothing for a null address."""
        if not address:
            return
        nbytes, device, stream = self._live.pop(address)
        if self.pluggable is not None:
            self.pluggable.raw_delete(address)
            return
        state = self.caching[device]
        state.allocated -= state.blocks.pop(address)

    def _caching_malloc(self, nbytes: int, device: int) -> int:
        state = self.caching[device]
        rounded = max(_MIN_BLOCK, -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK)
        if state.allocated + rounded > state.reserved:
            segment = _SMALL_SEGMENT if rounded <= _SMALL_SIZE else rounded
            limit = self.memory_fraction[device] * self.total_memory
            if state.reserved + segment > limit:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {rounded} bytes")
            state.reserved += segment
        state.allocated += rounded
        state.peak_allocated = max(state.peak_allocated, state.allocated)
        state.peak_reserved = max(state.peak_reserved, state.reserved)
        address = next(self._next_address)
        state.blocks[address] = rounded
        return address

    def nccl_stream(self, device: Optional[int] = None) -> FakeStream:
        """The internal stream a process group's collectives run on."""
        return self._nccl[self.device if device is None else device]

    # ------------------------------------------------------------------ torch.cuda surface
    def _device_index(self, device) -> int:
        index = _index(device)
        if not 0 <= index < self.device_count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return index

    def _stats(self, what: str, device) -> _Caching:
        if self.pluggable is not None:
            raise RuntimeError(PLUGGABLE_UNSUPPORTED.format(what))
        return self.caching[self._device_index(device)]

    def memory_stats(self, device=None) -> dict:
        s = self._stats("getDeviceStats", device)
        return {"allocated_bytes.all.current": s.allocated, "allocated_bytes.all.peak":
                s.peak_allocated, "reserved_bytes.all.current": s.reserved,
                "reserved_bytes.all.peak": s.peak_reserved}

    def reset_peak_memory_stats(self, device=None) -> None:
        s = self._stats("resetPeakStats", device)
        s.peak_allocated, s.peak_reserved = s.allocated, s.reserved

    def get_device_name(self, device=None) -> str:
        self._device_index(device)
        return self.name

    def mem_get_info(self, device=None) -> tuple[int, int]:
        index = self._device_index(device)
        if self.pluggable is not None:
            held = sum(n for n, d, _ in self._live.values() if d == index)
        else:
            held = self.caching[index].reserved
        return self.total_memory - held, self.total_memory

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        index = self._device_index(device)
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        if self.pluggable is None:  # a pluggable allocator without memory_fraction_fn ignores it
            self.memory_fraction[index] = fraction

    def empty_cache(self) -> None:
        if self.pluggable is None:
            for s in self.caching:
                s.reserved = s.allocated

    def record_memory_history(self, enabled="all", *args, **kwargs) -> None:
        if self.pluggable is not None:
            raise RuntimeError(PLUGGABLE_UNSUPPORTED.format("recordHistory"))
        self.history_enabled = enabled is not None

    def snapshot(self, *args, **kwargs) -> dict:
        if self.pluggable is not None:
            raise RuntimeError(PLUGGABLE_UNSUPPORTED.format("snapshot"))
        return {"segments": [], "device_traces": [[] for _ in range(self.device_count)]}

    def dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        snapshot = self.snapshot()
        with open(filename, "wb") as handle:
            pickle.dump(snapshot, handle)

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.rng_states[self._device_index(device)].clone()

    def set_rng_state(self, new_state: torch.Tensor, device="cuda") -> None:
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
            raise TypeError(f"expected a torch.ByteTensor, but got {type(new_state).__name__}")
        if new_state.numel() != _RNG_STATE_BYTES:
            raise RuntimeError(f"RNG state is wrong size: {new_state.numel()} bytes")
        self.rng_states[self._device_index(device)] = new_state.clone()

    def change_current_allocator(self, allocator) -> None:
        if self.initialized:
            raise RuntimeError("Can't swap an already initialized allocator")
        self.pluggable = allocator.allocator()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """``Tensor.record_stream``: the caching allocator keeps the block for ``stream``; a
        pluggable allocator's record-stream hook cannot be set from Python, so nothing happens."""
        if not isinstance(stream, FakeStream):
            raise TypeError(f"record_stream(): argument 'stream' must be Stream, not "
                            f"{type(stream).__name__}")
        if self.pluggable is not None:
            self.dropped_record_streams += 1
        else:
            self.recorded_streams.append((tensor.untyped_storage().data_ptr(),
                                          stream.cuda_stream))

    def install(self, monkeypatch) -> "CudaDouble":
        """Patch torch with this double for the test (``monkeypatch`` undoes it)."""
        cuda, memory = torch.cuda, torch.cuda.memory
        patches = {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "device_count": lambda: self.device_count,
            "current_device": lambda: self.device,
            "set_device": lambda d: setattr(self, "device", self._device_index(d)),
            "get_device_name": self.get_device_name,
            "get_device_properties": lambda d=None: SimpleNamespace(
                name=self.name, total_memory=self.total_memory, major=9, minor=0,
                multi_processor_count=132, index=self._device_index(d)),
            "mem_get_info": self.mem_get_info,
            "synchronize": lambda device=None: None,
            "get_rng_state": self.get_rng_state,
            "set_rng_state": self.set_rng_state,
            "_sleep": lambda cycles: None,
            "Stream": FakeStream,
            "Event": FakeEvent,
            "current_stream": lambda device=None: self._current[self._device_index(device)],
            "default_stream": lambda device=None: self._default[self._device_index(device)],
            "stream": self._stream_context,
            "memory_stats": self.memory_stats,
            "memory_allocated": lambda device=None: self.memory_stats(device)[
                "allocated_bytes.all.current"],
            "max_memory_allocated": lambda device=None: self.memory_stats(device)[
                "allocated_bytes.all.peak"],
            "memory_reserved": lambda device=None: self.memory_stats(device)[
                "reserved_bytes.all.current"],
            "max_memory_reserved": lambda device=None: self.memory_stats(device)[
                "reserved_bytes.all.peak"],
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
            "empty_cache": self.empty_cache,
            "set_per_process_memory_fraction": self.set_per_process_memory_fraction,
            "cudart": lambda: self.cudart,
        }
        for name, value in patches.items():
            monkeypatch.setattr(cuda, name, value)
            if hasattr(memory, name):
                monkeypatch.setattr(memory, name, value)
        monkeypatch.setattr(memory, "CUDAPluggableAllocator", _Pluggable)
        monkeypatch.setattr(memory, "change_current_allocator", self.change_current_allocator)
        monkeypatch.setattr(memory, "_record_memory_history", self.record_memory_history)
        monkeypatch.setattr(memory, "_snapshot", self.snapshot)
        monkeypatch.setattr(memory, "_dump_snapshot", self.dump_snapshot)
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda tensor, stream: self.record_stream(tensor, stream))
        real_empty = torch.empty

        def empty(*size, pin_memory: bool = False, **kwargs):
            tensor = real_empty(*size, **kwargs)
            if pin_memory:
                self.pinned_bytes += tensor.untyped_storage().nbytes()
            return tensor

        monkeypatch.setattr(torch, "empty", empty)
        return self

    @contextlib.contextmanager
    def _stream_context(self, stream: Optional[FakeStream]):
        if stream is None:
            yield
            return
        index = stream.device.index
        previous = self._current[index]
        self._current[index] = stream
        try:
            yield
        finally:
            self._current[index] = previous


# ------------------------------------------------------------------ the flash-attention kernels

def read_as_kernel(tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    """What a CUDA kernel sees when it reads ``tensor`` through ``data_ptr()`` as a contiguous
    ``shape``: ``prod(shape)`` elements from the tensor's storage offset on, the view's strides
    ignored (``torch.as_strided`` over the storage). Past the storage's end a kernel reads
    whatever memory follows: NaN here."""
    count = math.prod(shape)
    offset = tensor.storage_offset()
    available = max(0, min(count, tensor.untyped_storage().nbytes() // tensor.element_size()
                           - offset))
    flat = torch.as_strided(tensor, (available,), (1,), offset)
    if available < count:
        flat = torch.cat([flat, flat.new_full((count - available,), float("nan"))])
    return flat.clone().view(shape)


def _last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """mha_fwd / mha_bwd (flash_api.cpp) refuse operands whose last dimension is strided; the
    other strides (batch, row, head) they take as given."""
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise RuntimeError(f"{name}: Input tensor must have contiguous last dimension")


class FlashKernelDouble:
    """CPU stand-ins for the CUDA flash-attention kernels that memo_ext.attention.kernels calls
    on its ``cuda_flash`` path (``kernels.forced_kernel("cuda_flash")`` routes CPU tensors
    there). The arithmetic is torch's CPU flash kernel (the reference); what is modelled is how
    the CUDA code takes its operands, from the upstream sources:

    - torch (aten/src/ATen/native/transformers/cuda/attention_backward.cu):
      ``_scaled_dot_product_flash_attention_backward_cuda`` transposes its [b, heads, s, d]
      operands to [b, s, heads, d]; ``_flash_attention_backward`` makes ``grad_out`` and
      ``out`` contiguous and nothing else; a defined ``cum_seq_q`` selects the variable-length
      kernel (an empty one means a batch of -1, refused);
    - flash-attn (flash_attn/flash_attn_interface.py): ``maybe_contiguous`` copies dout, q, k,
      v and out only when their last dimension is strided; ``softmax_lse`` goes as it is;
    - both ``mha_bwd``s (flash_api.cpp): q/k/v/out/dout need a unit last stride and are read
      with their batch, row and head strides; ``softmax_lse`` is read by raw pointer as a
      contiguous [b, heads, s_q] (``row_offset_lse = (bidb * h + bidh) * seqlen_q``,
      flash_bwd_kernel.h), whatever its strides (:func:`read_as_kernel`).

    The double takes fp32 (the real kernels take fp16/bf16 only) so that tests can compare it
    with the explicit kernel at fp32 tolerance. No dropout (the double has no Philox stream).
    ``backend``: "torch" (flash-attn absent) or "flash-attn". ``calls`` counts kernel calls and
    ``strided_lse`` the backward calls whose log-sum-exp was not contiguous."""

    def __init__(self, backend: str = "torch"):
        if backend not in ("torch", "flash-attn"):
            raise ValueError(f"backend {backend!r}: 'torch' or 'flash-attn'")
        self.backend = backend
        self.calls: Counter = Counter()
        self.strided_lse = 0
        self.interface = SimpleNamespace(
            _wrapped_flash_attn_forward=self.flash_attn_forward,
            _wrapped_flash_attn_backward=self.flash_attn_backward)

    def install(self, monkeypatch) -> "FlashKernelDouble":
        """Patch torch's flash ops and memo_ext's flash-attn lookup (``monkeypatch`` undoes it)."""
        from memo_ext.attention import kernels

        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention",
                            self.sdpa_forward)
        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward",
                            self.sdpa_backward)
        interface = self.interface if self.backend == "flash-attn" else None
        monkeypatch.setattr(kernels, "_flash_attn", lambda: interface)
        return self

    # ---------------------------------------------------------------- the kernels (b, s, h, d)
    @staticmethod
    def _forward(q, k, v, causal: bool, scale: float):
        """mha_fwd on [b, s, heads, d] operands -> out [b, s, heads, d] (contiguous, as its
        empty_like of a contiguous q) and softmax_lse [b, heads, s_q] fp32 contiguous."""
        _last_dim_contiguous(q=q, k=k, v=v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
        return out.transpose(1, 2).contiguous(), lse.float().contiguous()

    def _backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        """mha_bwd on [b, s, heads, d] operands: (dq, dk, dv) [b, heads, s, d]."""
        _last_dim_contiguous(q=q, k=k, v=v, out=out, dout=dout)
        if lse.dtype != torch.float32:
            raise RuntimeError("softmax_lse must be fp32")
        batch, seq_q, heads, _ = q.shape
        if not lse.is_contiguous():
            self.strided_lse += 1
        read = read_as_kernel(lse, (batch, heads, seq_q))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            out.transpose(1, 2), read, 0.0, causal, scale=scale)

    # ---------------------------------------------------------------- torch's FA2 build
    def sdpa_forward(self, query, key, value, dropout_p=0.0, is_causal=False,
                     return_debug_mask=False, *, scale=None):
        """``aten._scaled_dot_product_flash_attention`` on [b, heads, s, d]: (out, lse,
        cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)."""
        if dropout_p:
            raise NotImplementedError("the flash kernel double has no dropout")
        self.calls["sdpa_forward"] += 1
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out, lse = self._forward(query.transpose(1, 2), key.transpose(1, 2),
                                 value.transpose(1, 2), is_causal, scale)
        no_rng = torch.empty(0, dtype=torch.int64)
        return (out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], no_rng,
                no_rng, torch.empty(0, dtype=query.dtype))

    def sdpa_backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                      max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                      scale=None):
        """``aten._scaled_dot_product_flash_attention_backward`` -> (dq, dk, dv)."""
        if dropout_p:
            raise NotImplementedError("the flash kernel double has no dropout")
        if cum_seq_q is not None:  # the variable-length kernel: batch = numel - 1
            if cum_seq_q.numel() < 2:
                raise RuntimeError("batch size must be positive")
            raise NotImplementedError("the flash kernel double has no variable-length kernel")
        self.calls["sdpa_backward"] += 1
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        # _flash_attention_backward: "CUDA code assumes that dout is contiguous"; out too.
        dout, o = grad_out.transpose(1, 2).contiguous(), out.transpose(1, 2).contiguous()
        return self._backward(dout, q, k, v, o, logsumexp, is_causal, scale)

    # ---------------------------------------------------------------- flash-attn's interface
    @staticmethod
    def _maybe_contiguous(tensor):
        return tensor.contiguous() if tensor is not None and tensor.stride(-1) != 1 else tensor

    def flash_attn_forward(self, q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                           window_size_right, softcap, alibi_slopes, return_softmax):
        """flash-attn's ``_wrapped_flash_attn_forward`` on [b, s, heads, d]: (out,
        softmax_lse, S_dmask, rng_state)."""
        if dropout_p:
            raise NotImplementedError("the flash kernel double has no dropout")
        self.calls["flash_attn_forward"] += 1
        q, k, v = (self._maybe_contiguous(t) for t in (q, k, v))
        out, lse = self._forward(q, k, v, causal, softmax_scale)
        return out, lse, torch.empty(0, dtype=q.dtype), torch.empty(2, dtype=torch.int64)

    def flash_attn_backward(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                            softmax_scale, causal, window_size_left, window_size_right, softcap,
                            alibi_slopes, deterministic, rng_state=None):
        """flash-attn's ``_wrapped_flash_attn_backward``: writes dq, dk, dv [b, s, heads, d]
        in place and returns softmax_d."""
        if dropout_p:
            raise NotImplementedError("the flash kernel double has no dropout")
        self.calls["flash_attn_backward"] += 1
        dout, q, k, v, out = (self._maybe_contiguous(t) for t in (dout, q, k, v, out))
        _last_dim_contiguous(dq=dq, dk=dk, dv=dv)
        grads = self._backward(dout, q, k, v, out, softmax_lse, causal, softmax_scale)
        for target, grad in zip((dq, dk, dv), grads):
            target.copy_(grad.transpose(1, 2))
        batch, seq_q, heads, _ = q.shape
        return torch.empty(batch, heads, seq_q, dtype=torch.float32)

# ------------------------------------------------------------------ cuDNN's fused attention

def read_with_strides(tensor: torch.Tensor, strides) -> torch.Tensor:
    """What a kernel reads from ``tensor``'s memory when it takes the tensor as ``strides``
    (from its storage offset): the view's own strides ignored; NaN past the storage's end,
    where a GPU would read whatever memory follows."""
    storage = tensor.untyped_storage().nbytes() // tensor.element_size()
    whole = torch.as_strided(tensor, (storage,), (1,), 0)
    index = torch.full(tuple(tensor.shape), tensor.storage_offset(), dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(tensor.shape, strides)):
        shape = [1] * tensor.dim()
        shape[dim] = size
        index = index + (torch.arange(size) * stride).view(shape)
    inside = index < storage
    values = whole[index.clamp(max=max(storage - 1, 0))].double()
    return values.masked_fill(~inside, float("nan"))


class CudnnAttentionDouble:
    """CPU kernels for ``aten._scaled_dot_product_cudnn_attention`` and
    ``aten._scaled_dot_product_cudnn_attention_backward`` (torch 2.11's schemas, registered on
    the CPU dispatch key, so every call is checked against the real signature), with
    ``torch.backends.cudnn`` reporting a cuDNN 9 build. The arithmetic is plain float64
    attention; what is modelled is how PyTorch's cuDNN path takes its operands, from the
    upstream sources (attention.cu / attention_backward.cu ``_cudnn_attention_forward`` /
    ``_backward``, cudnn/MHA.cpp, cudnn-frontend's SDPA nodes):

    - GQA: K/V with fewer heads than q (``h_q % h_k == 0``); dK/dV come back as
      ``empty_like(key)``/``empty_like(value)``, in the group count; out as ``empty_like(q)``;
    - the log-sum-exp: returned fp32 ``[b, heads, s_q, 1]`` contiguous; the backward refuses a
      "Stats" that is not 4-D with a unit last stride (cudnn-frontend's graph validation);
    - undefined vs empty: ``None`` arrives for the backward's undefined ``attn_bias`` /
      ``cum_seq_q`` / ``cum_seq_k``; an empty tensor is *defined*: as ``attn_bias`` it is
      expanded as a bias (a 1-D one is refused as the real code refuses it), as ``cum_seq_q``
      it selects the nested-tensor kernel (refused here: not a dense tile);
    - strides: every operand needs a unit last stride; q/k/v are read with their own strides
      (described to the cuDNN graph); the graphs are cached per thread under a key of the
      sizes and strides of q/k/v (and b, h, s, d, dtype, causal, dropout, bias), so the
      backward reads out, grad_out and the log-sum-exp with the strides of the call that
      built the graph (:func:`read_with_strides`): a caller that hands one key two layouts of
      out gets the wrong gradients a GPU gives. grad_out with a strided last dimension is
      first copied into out's layout (MHA.cpp, cuDNN >= 9.5.1; before it, whenever its
      strides differ from out's);
    - causal: top-left aligned (cudnn-frontend's ``set_causal_mask``);
    - ``max_q``/``max_k``: the backward's dense lengths; other values are refused here.

    The double takes fp32 (the real op takes fp16/bf16 only) so tests can compare at fp32
    tolerance. No dropout. ``calls`` counts calls; ``log`` keeps each call's arguments as
    (shape, strides) or None."""

    def __init__(self, cudnn_version: int = 91900):
        self.cudnn_version = cudnn_version
        self.calls: Counter = Counter()
        self.log: list[dict] = []
        self._lock = threading.Lock()
        self._graphs = threading.local()
        self._library = None

    def install(self, monkeypatch) -> "CudnnAttentionDouble":
        """Register the kernels and report cuDNN (``monkeypatch`` undoes the report; call
        :meth:`uninstall` to drop the kernels)."""
        library = torch.library.Library("aten", "IMPL")
        library.impl("_scaled_dot_product_cudnn_attention", self.forward, "CPU")
        library.impl("_scaled_dot_product_cudnn_attention_backward", self.backward, "CPU")
        self._library = library
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: self.cudnn_version)
        return self

    def uninstall(self) -> None:
        if self._library is not None:
            self._library._destroy()
            self._library = None

    # ------------------------------------------------------------------ helpers
    def _record(self, op: str, **tensors) -> None:
        with self._lock:
            self.calls[op] += 1
            self.log.append({"op": op, **{
                name: None if t is None else (tuple(t.shape), tuple(t.stride()))
                for name, t in tensors.items()}})

    @staticmethod
    def _check_operands(**tensors) -> None:
        for name, tensor in tensors.items():
            if tensor.dim() != 4:
                raise RuntimeError(f"cudnn_frontend: The dim for {name} is invalid")
            if tensor.stride(-1) != 1:
                raise RuntimeError("cudnn_frontend: The stride for the last dimension "
                                   "corresponding to the embedding size per head should be 1 "
                                   f"for {name}")

    @staticmethod
    def _bias(attn_bias, batch: int, seq_q: int, seq_k: int):
        """The additive bias as _cudnn_attention_forward/_backward expand it."""
        if attn_bias is None:
            return None
        if attn_bias.dim() in (2, 3):
            return attn_bias.expand(batch, 1, seq_q, seq_k).double()
        if attn_bias.dim() != 4:
            raise RuntimeError("cuDNN SDPA expects either a 2D, 3D, or 4D attn_bias but got "
                               f"{attn_bias.dim()}D")
        return attn_bias.expand(batch, attn_bias.size(1), seq_q, seq_k).double()

    @staticmethod
    def _scores(q, k, scale, causal, bias):
        """float64 [b, h_q, s_q, s_k] scores of q [b, h_q, s_q, d] against k [b, h_k, s_k, d]."""
        heads, groups = q.shape[1], k.shape[1]
        if heads % groups:
            raise RuntimeError("cudnn_frontend: For group-query attention, number of heads for "
                               "key and query must be a factor of number of heads for query")
        keys = k.repeat_interleave(heads // groups, dim=1)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
        if bias is not None:
            scores = scores + bias
        if causal:  # top-left aligned: query i sees keys 0..i
            rows, cols = scores.shape[-2:]
            scores = scores.masked_fill(
                torch.ones(rows, cols, dtype=torch.bool).triu(1), float("-inf"))
        return scores

    def _graph_layouts(self, key, layouts):
        """The (out, grad_out, stats) strides of the cached backward graph for ``key``:
        ``layouts`` when this thread builds it now."""
        cache = self._graphs.__dict__.setdefault("backward", {})
        return cache.setdefault(key, layouts)

    # ------------------------------------------------------------------ the ops
    def forward(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                is_causal=False, return_debug_mask=False, *, scale=None):
        """(output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
        philox_offset, debug_attn_mask)"""
        self._record("forward", query=query, key=key, value=value, attn_bias=attn_bias)
        if dropout_p:
            raise NotImplementedError("the cuDNN attention double has no dropout")
        self._check_operands(Q=query, K=key, V=value)
        batch, heads, seq_q, head_dim = query.shape
        seq_k = key.shape[2]
        scale = head_dim ** -0.5 if scale is None else scale
        scores = self._scores(query.double(), key.double(), scale, is_causal,
                              self._bias(attn_bias, batch, seq_q, seq_k))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        values = value.double().repeat_interleave(heads // value.shape[1], dim=1)
        output = torch.empty_like(query)  # alloc_with_matching_layout: q's shape and layout
        output.copy_(torch.matmul(torch.exp(scores - lse), values))
        stats = lse.float().contiguous() if compute_log_sumexp else None
        seed, offset = (torch.empty((), dtype=torch.int64) for _ in range(2))
        return output, stats, None, None, seq_q, seq_k, seed, offset, None

    def backward(self, grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
                 attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
                 scale=None):
        """(dq, dk, dv)"""
        self._record("backward", grad_out=grad_out, query=query, key=key, value=value,
                     out=out, logsumexp=logsumexp, attn_bias=attn_bias, cum_seq_q=cum_seq_q,
                     cum_seq_k=cum_seq_k)
        if cum_seq_q is not None:
            raise RuntimeError("cum_seq_q is defined: the nested-tensor (ragged) cuDNN "
                               "backward, which a dense [b, heads, s, d] tile is not")
        if dropout_p:
            raise NotImplementedError("the cuDNN attention double has no dropout")
        batch, heads, seq_q, head_dim = query.shape
        seq_k = key.shape[2]
        if (max_q, max_k) != (seq_q, seq_k):
            raise RuntimeError(f"max_q/max_k {max_q}/{max_k} are the dense lengths "
                               f"{seq_q}/{seq_k}")
        if seq_q == 1 and seq_k == 1:
            raise RuntimeError("cudnn_frontend: s_q = s_kv = 1 is not supported.")
        dout = grad_out
        if dout.stride(-1) != 1 or (self.cudnn_version < 90501
                                    and tuple(dout.stride()) != tuple(out.stride())):
            dout = torch.empty_like(out).copy_(grad_out)  # permute_to_matching_layout(o, dO)
        self._check_operands(Q=query, K=key, V=value, O=out, dO=dout, Stats=logsumexp)
        if tuple(logsumexp.shape) != (batch, heads, seq_q, 1):
            raise RuntimeError(f"cudnn_frontend: Stats must be [b, h, s_q, 1], got "
                               f"{tuple(logsumexp.shape)}")
        bias = self._bias(attn_bias, batch, seq_q, seq_k)
        graph_key = (query.dtype, tuple(query.shape), tuple(key.shape), tuple(value.shape),
                     tuple(query.stride()), tuple(key.stride()), tuple(value.stride()),
                     bool(is_causal), None if bias is None else tuple(attn_bias.stride()))
        o_strides, do_strides, lse_strides = self._graph_layouts(
            graph_key, (tuple(out.stride()), tuple(dout.stride()), tuple(logsumexp.stride())))
        o = read_with_strides(out, o_strides)
        do = read_with_strides(dout, do_strides)
        lse = read_with_strides(logsumexp, lse_strides)
        scale = head_dim ** -0.5 if scale is None else scale
        q, k, v = query.double(), key.double(), value.double()
        group = heads // key.shape[1]
        probabilities = torch.exp(self._scores(q, k, scale, is_causal, bias) - lse)
        keys, values = (t.repeat_interleave(group, dim=1) for t in (k, v))
        grad_value = torch.matmul(probabilities.transpose(-1, -2), do)
        row_dot = (do * o).sum(-1, keepdim=True)
        grad_scores = probabilities * (torch.matmul(do, values.transpose(-1, -2)) - row_dot)
        grad_query = torch.matmul(grad_scores, keys) * scale
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), q) * scale

        def grouped(grad):
            return grad.view(batch, key.shape[1], group, seq_k, head_dim).sum(dim=2)

        dq, dk, dv = (torch.empty_like(t) for t in (query, key, value))
        dq.copy_(grad_query)
        dk.copy_(grouped(grad_key))
        dv.copy_(grouped(grad_value))
        return dq, dk, dv
