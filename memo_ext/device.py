"""Asynchronous device<->host copies: the overlap protocol behind MEMO's activation offloading.

The protocol (docs/memo.md "Rounding buffers and streams") has three actors: *compute* (the stream or
thread that runs the layers), a *D2H* ("offload") copy queue and an *H2D* ("prefetch") copy queue.
Each copy queue is FIFO; the two queues run independently of each other and of compute.
Ordering between actors is expressed only through :class:`CopyEvent` objects:

- ``offload(dst_host, src_device)`` first waits for the compute issued so far (so it reads
  activations that were actually produced), then copies; it returns at once with an event.
- ``after=event`` on a copy: the copy starts only once ``event`` completed. This is how "prefetch
  into rounding buffer i%2 only after its previous offload finished" is written.
- ``wait(event)``: compute issued from now on runs after ``event``. Compute must ``wait`` on an
  offload's event before it overwrites the copied device buffer, and on a prefetch's event before
  it reads the prefetched data. Forgetting either is a race, not an error message.
- ``record_compute()``: an event for "compute issued so far", to hand to a copy as ``after``.

On CUDA this maps one-to-one onto two side streams, ``torch.cuda.Event`` and page-locked host
memory.
On CPU there are no streams, so the protocol would collapse into synchronous copies and a missing
``wait`` could never be observed in a test. Instead each direction gets a real single-thread
worker (``ThreadPoolExecutor(max_workers=1)``, hence FIFO) and an event wraps a ``Future``;
``Tensor.copy_`` releases the GIL, so copies really overlap with compute, and ``copy_delay_s``
(or the environment variable ``MEMO_COPY_DELAY_S``) sleeps in the worker before each copy so that
a forgotten ``wait`` reads stale data every time. No library offers a CPU stand-in with the same
event/stream protocol (PyTorch's CPU ``Stream``/``Event`` are no-ops that run copies
synchronously), which is why this module is hand-written.

All sizes are bytes; all buffers are 1-D ``torch.uint8`` tensors (callers pass slices of bigger
buffers and reinterpret them with ``Tensor.view(dtype)``); all times are seconds.
"""
from __future__ import annotations

import abc
import math
import mmap
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

import torch

from memo_ext.device_memory import device_memory, record_stream

__all__ = ["CopyEngine", "CopyEvent", "CopyStats", "measure_offload_bandwidth",
           "cuda_memory_headroom", "COPY_DELAY_ENV"]

# Environment variable read when CopyEngine is built without an explicit copy_delay_s: seconds
# each copy waits before it starts. Tests set it to make missing waits visible; keep it unset
# (0) in real runs.
COPY_DELAY_ENV = "MEMO_COPY_DELAY_S"

# Default transfer size for measure_offload_bandwidth: 64 MiB is large enough that per-copy
# launch and thread hand-off costs are negligible, and small against any rank's memory.
DEFAULT_BANDWIDTH_PROBE_BYTES = 64 * 1024 * 1024

# Share of the device's memory that cuda_memory_headroom keeps back: the caching allocator's
# blocks do not pack perfectly (rounding, splitting), so not every free byte above the peak can
# serve MEMO's larger rounding buffers.
CUDA_FRAGMENTATION_RESERVE = 0.05

# torch.cuda._sleep counts GPU clock cycles, not seconds; this approximate SM clock (Hz) turns
# copy_delay_s into cycles on CUDA. The delay is only a test aid, so "roughly" is enough.
_APPROX_GPU_CLOCK_HZ = 1.5e9

# cudaHostRegisterDefault: with unified virtual addressing (every 64-bit platform CUDA supports)
# the registered range is portable and mapped for every device (CUDA runtime API,
# cudaHostRegister).
_HOST_REGISTER_DEFAULT = 0

OFFLOAD = "offload"    # device -> host (D2H)
PREFETCH = "prefetch"  # host -> device (H2D)


# --------------------------------------------------------------------------------------- events

class CopyEvent(abc.ABC):
    """Completion of one asynchronous copy (or of compute issued up to some point)."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True once the copy has finished (successfully or not); never blocks."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the copy finished; re-raise the copy's error, if any."""


class _DoneEvent(CopyEvent):
    """An event that completed before it was created (CPU compute is synchronous)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class _FutureEvent(CopyEvent):
    """CPU: the future of a copy submitted to a copy worker."""

    def __init__(self, future: Future):
        self._future = future

    def query(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        self._future.result()  # re-raises the worker's exception


class _CudaEvent(CopyEvent):
    """CUDA: a torch.cuda.Event recorded on a copy stream or on the compute stream."""

    def __init__(self, event: "torch.cuda.Event"):
        self.event = event

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


# ---------------------------------------------------------------------------------------- stats

@dataclass
class CopyStats:
    """Completed copies per direction. Seconds are time spent inside the copies themselves
    (CPU: wall time of ``copy_`` in the worker, without ``copy_delay_s``; CUDA: elapsed time
    between timing events around the copy on its stream), so bytes / seconds is the achieved
    bandwidth, including contention with whatever else shared the link."""
    offload_copies: int = 0
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    prefetch_copies: int = 0
    prefetch_bytes: int = 0
    prefetch_seconds: float = 0.0

    @property
    def total_seconds(self) -> float:
        """Seconds spent copying in both directions."""
        return self.offload_seconds + self.prefetch_seconds

    def add(self, direction: str, nbytes: int, seconds: float) -> None:
        if direction == OFFLOAD:
            self.offload_copies += 1
            self.offload_bytes += nbytes
            self.offload_seconds += seconds
        else:
            self.prefetch_copies += 1
            self.prefetch_bytes += nbytes
            self.prefetch_seconds += seconds


# -------------------------------------------------------------------------------------- backends

class _CpuCopier:
    """Two single-thread workers, one per direction; FIFO because each has one thread."""

    def __init__(self, delay_s: float, stats: CopyStats, lock: threading.Lock):
        self._delay_s = delay_s
        self._stats = stats
        self._lock = lock
        self._workers = {
            OFFLOAD: ThreadPoolExecutor(max_workers=1, thread_name_prefix="memo-d2h"),
            PREFETCH: ThreadPoolExecutor(max_workers=1, thread_name_prefix="memo-h2d"),
        }
        self._last: dict[str, Future | None] = {OFFLOAD: None, PREFETCH: None}

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    alloc_host_cached = alloc_host

    def submit(self, direction: str, dst: torch.Tensor, src: torch.Tensor,
               after: CopyEvent | None) -> CopyEvent:
        # The tensors travel in a list the copy empties: the pool's work item keeps its
        # arguments until after the event completes, which would keep a buffer freed right
        # after waiting for its copy alive a little longer (CUDA's allocator has it back then).
        future = self._workers[direction].submit(self._copy, direction, [dst, src], after)
        self._last[direction] = future
        return _FutureEvent(future)

    def _copy(self, direction: str, tensors: list, after: CopyEvent | None) -> None:
        dst, src = tensors
        tensors.clear()
        # An `after` event always belongs to an earlier submission and each queue runs in
        # submission order, so waiting here cannot deadlock the two workers.
        if after is not None:
            after.synchronize()
        if self._delay_s > 0:
            time.sleep(self._delay_s)
        start = time.perf_counter()
        dst.copy_(src)
        seconds = time.perf_counter() - start
        with self._lock:
            self._stats.add(direction, dst.numel(), seconds)

    def wait(self, event: CopyEvent) -> None:
        event.synchronize()  # CPU compute runs in the calling thread: block it.

    def record_compute(self) -> CopyEvent:
        return _DoneEvent()  # CPU compute already happened when this is called.

    def synchronize(self) -> None:
        # FIFO: the last submission of a direction finishing means all of them did. Errors of
        # individual copies are reported by their own events, not here.
        for future in list(self._last.values()):
            if future is not None:
                future.exception()

    def refresh_stats(self) -> None:
        return None  # the workers update stats as copies finish

    def close(self) -> None:
        for worker in self._workers.values():
            worker.shutdown(wait=True)


class _PageLock:
    """The page-locked range under one buffer of :meth:`_CudaCopier.alloc_host`."""

    def __init__(self, cudart, ptr: int, mapping: mmap.mmap):
        self.cudart = cudart
        self.ptr = ptr
        self.mapping = mapping  # stays mapped until unregistered
        self.last_copy: torch.cuda.Event | None = None

    def release(self) -> None:
        """Unregister once the last copy queued on the range has finished, then unmap it.
        PyTorch records no event for host memory outside its pinned allocator (its copy
        kernel ignores CachingHostAllocator_recordEvent's refusal), so the wait is ours."""
        if self.last_copy is not None:
            self.last_copy.synchronize()
        status = self.cudart.cudaHostUnregister(self.ptr)
        if status != self.cudart.cudaError.success:
            warnings.warn(f"cudaHostUnregister of a MEMO host buffer failed: "
                          f"{self.cudart.cudaGetErrorString(status)}")
        self.mapping = None  # munmap: the pages go back to the OS, nothing is cached


def _release_page_lock(page_locks: dict[int, _PageLock], ptr: int) -> None:
    page_locks.pop(ptr).release()


class _CudaCopier:
    """Two side streams (D2H and H2D) on the engine's device; events and page-locked host
    memory."""

    def __init__(self, device: torch.device, delay_s: float, stats: CopyStats,
                 lock: threading.Lock):
        self._device = device
        self._delay_cycles = int(delay_s * _APPROX_GPU_CLOCK_HZ)
        self._stats = stats
        self._lock = lock
        self._streams = {
            OFFLOAD: torch.cuda.Stream(device=device),
            PREFETCH: torch.cuda.Stream(device=device),
        }
        # (direction, nbytes, start event, end event) of copies not yet counted in stats.
        self._pending: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
        # alloc_host's live buffers by address: what a copy into or out of one must wait for.
        self._page_locks: dict[int, _PageLock] = {}

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        # Not torch.empty(pin_memory=True): PyTorch's pinned CachingHostAllocator rounds every
        # block up to a power of two and keeps freed blocks (docs/estimate.md "Host memory"),
        # so an 8 GiB + 64 MiB slot would hold 16 GiB. An anonymous mapping starts on a page, so
        # registering it locks exactly its own pages. Tensor.is_pinned() is True for registered
        # memory (cudaPointerGetAttributes reports it as host memory) and non_blocking copies
        # from and to it are asynchronous.
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)  # cudaHostRegister refuses an empty range
        mapping = mmap.mmap(-1, nbytes)
        # The tensor's storage keeps the object it was made from (torch.frombuffer), here a
        # memoryview, and drops it when the storage dies: the view's finalizer is the storage's.
        view = memoryview(mapping)
        host = torch.frombuffer(view, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        status = cudart.cudaHostRegister(host.data_ptr(), nbytes, _HOST_REGISTER_DEFAULT)
        if status != cudart.cudaError.success:
            raise RuntimeError(
                f"MEMO could not page-lock a host buffer of {nbytes} bytes (cudaHostRegister: "
                f"{cudart.cudaGetErrorString(status)}); lower --memo-host-memory-gb or raise the "
                "locked-memory limit (ulimit -l)")
        self._page_locks[host.data_ptr()] = _PageLock(cudart, host.data_ptr(), mapping)
        # Not at exit: the driver drops a process's registrations with its context.
        weakref.finalize(view, _release_page_lock, self._page_locks,
                         host.data_ptr()).atexit = False
        return host

    def alloc_host_cached(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def submit(self, direction: str, dst: torch.Tensor, src: torch.Tensor,
               after: CopyEvent | None) -> CopyEvent:
        stream = self._streams[direction]
        # The copy reads what compute produced so far (D2H) / writes a buffer compute may still
        # be reading (H2D): either way it starts after the compute issued up to now.
        stream.wait_stream(torch.cuda.current_stream(self._device))
        if isinstance(after, _CudaEvent):
            stream.wait_event(after.event)
        elif after is not None:
            after.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            if self._delay_cycles > 0:
                torch.cuda._sleep(self._delay_cycles)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        # The caching allocator must not hand the device side to someone else before the copy
        # stream is done with it. A pluggable allocator (--memo-plan,
        # --memo-stitching-allocator) hears of it only through memo_ext.device_memory.
        record_stream((src if direction == OFFLOAD else dst), stream)
        # The host side: alloc_host's buffer stays locked and mapped until this copy ends; an
        # alloc_host_cached one is guarded by the event the copy records with PyTorch's
        # pinned allocator.
        host = dst if direction == OFFLOAD else src
        page_lock = self._page_locks.get(host.untyped_storage().data_ptr())
        if page_lock is not None:
            page_lock.last_copy = end
        self.refresh_stats()
        self._pending.append((direction, dst.numel(), start, end))
        return _CudaEvent(end)

    def wait(self, event: CopyEvent) -> None:
        if isinstance(event, _CudaEvent):
            torch.cuda.current_stream(self._device).wait_event(event.event)
        else:
            event.synchronize()

    def record_compute(self) -> CopyEvent:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return _CudaEvent(event)

    def synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()
        self.refresh_stats()

    def refresh_stats(self) -> None:
        still_pending = []
        with self._lock:
            for direction, nbytes, start, end in self._pending:
                if end.query():
                    self._stats.add(direction, nbytes, start.elapsed_time(end) / 1e3)
                else:
                    still_pending.append((direction, nbytes, start, end))
            self._pending = still_pending

    def close(self) -> None:
        self.synchronize()


# ---------------------------------------------------------------------------------------- engine

class CopyEngine:
    """One per process. D2H ('offload') and H2D ('prefetch') copies run asynchronously with
    respect to compute, each direction FIFO-ordered.

    ``device`` is the compute device: ``cpu`` (copy worker threads) or ``cuda[:N]`` (side
    streams). ``copy_delay_s`` (seconds, test aid) delays the start of every copy; ``None`` reads
    the environment variable ``MEMO_COPY_DELAY_S`` (default 0). Use as a context manager or call
    :meth:`close`.
    """

    def __init__(self, device: torch.device | str, copy_delay_s: float | None = None):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"CopyEngine: unsupported compute device {device}; use 'cpu' or "
                             "'cuda[:N]'")
        if copy_delay_s is None:
            raw = os.environ.get(COPY_DELAY_ENV, "0") or "0"
            try:
                copy_delay_s = float(raw)
            except ValueError:
                raise ValueError(f"{COPY_DELAY_ENV}={raw!r} is not a number of seconds") from None
        if not copy_delay_s >= 0 or math.isinf(copy_delay_s):
            raise ValueError(f"CopyEngine: copy_delay_s must be finite and >= 0 seconds, got "
                             f"{copy_delay_s}")
        self.device = device
        self.copy_delay_s = float(copy_delay_s)
        self._stats = CopyStats()
        self._lock = threading.Lock()
        self._closed = False
        if device.type == "cpu":
            self._copier = _CpuCopier(self.copy_delay_s, self._stats, self._lock)
        else:
            self._copier = _CudaCopier(device, self.copy_delay_s, self._stats, self._lock)

    # --- buffers
    def alloc_device(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 buffer of ``nbytes`` bytes on the compute device."""
        return torch.empty(_check_nbytes(nbytes), dtype=torch.uint8, device=self.device)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of ``nbytes`` bytes (contents undefined), on CUDA page-locked at
        its own size (whole pages) so copies can be asynchronous; it goes back to the OS when
        its storage dies, once the last copy queued on it has finished. For long-lived buffers
        such as MEMO's host slots: each allocation registers its pages with the driver."""
        return self._copier.alloc_host(_check_nbytes(nbytes))

    def alloc_host_cached(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 host buffer of ``nbytes`` bytes from PyTorch's pinned
        CachingHostAllocator on CUDA: each block rounded up to a power of two and, once freed,
        kept for the next request of its size. For buffers allocated anew every iteration
        (SPPO's offloaded tensors), where re-registering pages each time would cost more."""
        return self._copier.alloc_host_cached(_check_nbytes(nbytes))

    # --- copies
    def offload(self, dst_host: torch.Tensor, src_device: torch.Tensor,
                after: CopyEvent | None = None) -> CopyEvent:
        """Queue a device -> host copy of ``src_device`` into ``dst_host`` (equal-size uint8 1-D
        tensors) behind the compute issued so far and behind ``after``; returns at once.
        Compute must ``wait()`` on the returned event before overwriting ``src_device``."""
        self._check_copy("offload", dst_host, "dst_host", torch.device("cpu"),
                         src_device, "src_device", self.device, after)
        return self._copier.submit(OFFLOAD, dst_host, src_device, after)

    def prefetch(self, dst_device: torch.Tensor, src_host: torch.Tensor,
                 after: CopyEvent | None = None) -> CopyEvent:
        """Queue a host -> device copy of ``src_host`` into ``dst_device`` (equal-size uint8 1-D
        tensors) behind the compute issued so far and behind ``after``; returns at once.
        Compute must ``wait()`` on the returned event before reading ``dst_device``."""
        self._check_copy("prefetch", dst_device, "dst_device", self.device,
                         src_host, "src_host", torch.device("cpu"), after)
        return self._copier.submit(PREFETCH, dst_device, src_host, after)

    # --- ordering
    def wait(self, event: CopyEvent | None) -> None:
        """Make compute issued from now on wait for ``event`` (CUDA: the current stream waits on
        it without blocking the host; CPU: block until done, re-raising a copy error).
        ``None`` is a no-op."""
        if event is not None:
            self._copier.wait(event)

    def record_compute(self) -> CopyEvent:
        """An event marking the compute issued so far (CUDA: recorded on the current stream;
        CPU: already completed)."""
        return self._copier.record_compute()

    def synchronize(self) -> None:
        """Block until every copy queued so far has finished (errors stay with their events)."""
        self._copier.synchronize()

    @property
    def stats(self) -> CopyStats:
        """A snapshot of the completed-copy counters (copies, bytes, seconds per direction)."""
        self._copier.refresh_stats()
        with self._lock:
            return replace(self._stats)

    # --- lifetime
    def close(self) -> None:
        """Finish queued copies and stop the copy workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._copier.close()

    def __enter__(self) -> "CopyEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CopyEngine(device={self.device}, copy_delay_s={self.copy_delay_s}"
                f"{', closed' if self._closed else ''})")

    def _check_copy(self, op: str, dst: torch.Tensor, dst_name: str, dst_device: torch.device,
                    src: torch.Tensor, src_name: str, src_device: torch.device,
                    after: CopyEvent | None) -> None:
        if self._closed:
            raise RuntimeError(f"CopyEngine.{op}: the engine is closed")
        for tensor, name, device in ((dst, dst_name, dst_device), (src, src_name, src_device)):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"CopyEngine.{op}: {name} must be a torch.Tensor, got "
                                 f"{type(tensor).__name__}")
            if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
                raise ValueError(f"CopyEngine.{op}: {name} must be a contiguous 1-D uint8 tensor "
                                 f"(a byte slice of a buffer from alloc_host/alloc_device), got "
                                 f"dtype={tensor.dtype} shape={tuple(tensor.shape)}")
            if tensor.device != device:
                raise ValueError(f"CopyEngine.{op}: {name} must live on {device}, got "
                                 f"{tensor.device}")
        if dst.numel() != src.numel():
            raise ValueError(f"CopyEngine.{op}: {dst_name} holds {dst.numel()} bytes but "
                             f"{src_name} holds {src.numel()}; slice both to the same size")
        if after is not None and not isinstance(after, CopyEvent):
            raise ValueError(f"CopyEngine.{op}: after must be a CopyEvent or None, got "
                             f"{type(after).__name__}")


def _check_nbytes(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"buffer size must be a non-negative int number of bytes, got {nbytes!r}")
    return nbytes


# ------------------------------------------------------------------------------------ bandwidth

def measure_offload_bandwidth(engine: CopyEngine, nbytes: int = DEFAULT_BANDWIDTH_PROBE_BYTES,
                              repeats: int = 3,
                              barrier: Callable[[], None] | None = None) -> float:
    """Achieved device -> host bandwidth in bytes/s: ``repeats`` offloads of ``nbytes`` bytes
    from a device buffer into a (page-locked, on CUDA) host buffer, timed per copy by the engine
    (``stats``, so ``copy_delay_s`` is not counted).

    MEMO's alpha must use the bandwidth a rank gets while every rank of its node copies at once
    (they share the host link), so pass ``barrier`` (e.g. a ``torch.distributed.barrier`` over
    the node's local ranks): it is called after a warm-up copy, right before the timed copies.
    """
    if repeats < 1:
        raise ValueError(f"measure_offload_bandwidth: repeats must be >= 1, got {repeats}")
    if _check_nbytes(nbytes) == 0:
        raise ValueError("measure_offload_bandwidth: nbytes must be > 0")
    src = engine.alloc_device(nbytes)
    src.fill_(1)
    dst = engine.alloc_host(nbytes)
    # Warm-up: first touch of the host pages, stream/worker start-up.
    engine.wait(engine.offload(dst, src))
    engine.synchronize()
    before = engine.stats
    if barrier is not None:
        barrier()
    for _ in range(repeats):
        engine.offload(dst, src)
    engine.synchronize()
    after = engine.stats
    copied = after.offload_bytes - before.offload_bytes
    seconds = after.offload_seconds - before.offload_seconds
    # A copy too fast for the clock's resolution still took at least one tick.
    seconds = max(seconds, time.get_clock_info("perf_counter").resolution)
    return copied / seconds


# ------------------------------------------------------------------------------ device memory

def cuda_memory_headroom(device: torch.device) -> int:
    """Bytes the device's allocator could still reserve above its peak so far, minus
    CUDA_FRAGMENTATION_RESERVE of the device: ``free + reserved - peak reserved`` from the driver's
    and the allocator's counters (memo_ext.device_memory: PyTorch's caching allocator or the
    allocator that replaced it; memory held by other processes, NCCL and cuBLAS workspaces is
    outside ``free`` and so already excluded). Exercised on CPU against tests/cuda_double.py."""
    free, total = torch.cuda.mem_get_info(device)
    memory = device_memory(device)
    unused_reservation = memory.reserved - memory.peak_reserved
    return int(free + unused_reservation - CUDA_FRAGMENTATION_RESERVE * total)
