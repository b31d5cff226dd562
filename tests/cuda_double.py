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

Everything runs synchronously on the CPU: an event recorded is complete. What this cannot show
is a GPU's timing or a kernel's behaviour; the ``gpu``-marked tests are for that.
"""
from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import hashlib
import itertools
import os
import pickle
import shutil
import subprocess
import time
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
