"""Device-memory accounting of the CPU stand-in: a dispatch mode that tracks tensor storages.

On CPU every tensor lives in RAM, so "device" memory cannot be read from an allocator; instead
:class:`DeviceMemoryTracker` watches every aten op run while it is active (forward and, when the
mode is active during ``backward()``, the autograd engine's ops too) and records each *new
storage* an op returns:

* A storage is an allocation; views and in-place ops return an input's storage and are not.
  Storages are keyed by the identity of their C++ ``StorageImpl`` (``untyped_storage()._cdata``,
  unique while alive; also works for meta and 0-byte storages, which share ``data_ptr`` 0).
* It is freed when the storage is garbage-collected: ``weakref.finalize`` on the Python storage
  object, which PyTorch keeps alive exactly as long as the C++ storage (PyObject preservation),
  so freeing a tensor while a view survives frees nothing.
* Bytes are the storage's ``nbytes()`` (requested bytes, no allocator block rounding).

Categories: storages registered with :meth:`DeviceMemoryTracker.mark_host` (the offload host
arena) or created inside :meth:`DeviceMemoryTracker.host_allocations` count as *host*; every
other tracked storage counts as *device*. Tensors that existed before the mode was entered
(parameters, optimizer state) are invisible unless registered with
:meth:`DeviceMemoryTracker.register_existing`, which counts them as device bytes from then on
(they raise the current and peak but are not counted in ``num_allocations``).

``capacity_bytes`` simulates a device of that size: an allocation that would push device bytes
above it raises :class:`SimulatedOutOfMemoryError` (the tensor itself was already created in
RAM; it is dropped as the error propagates).

Thread safety: storages can be freed on any thread (e.g. the offload copy worker dropping its
reference), so counters are guarded by a lock. Dispatch modes are thread-local: allocations on
other threads are seen only if the autograd engine propagates the mode there (it does for
backward) -- ops the copy worker runs itself are not tracked.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DEVICE = "device"
HOST = "host"


class SimulatedOutOfMemoryError(RuntimeError):
    """An allocation would exceed the tracker's simulated device capacity (``capacity_bytes``)."""


@dataclass
class _Entry:
    nbytes: int
    category: str
    token: int  # distinguishes successive storages at the same (reused) StorageImpl address
    finalizer: weakref.finalize


def storage_of(tensor: Any) -> torch.UntypedStorage | None:
    """The untyped storage of a dense tensor, or None (sparse/nested/non-tensors have none)."""
    if not isinstance(tensor, torch.Tensor):
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class DeviceMemoryTracker(TorchDispatchMode):
    """Track device-resident and host bytes of storages allocated while the mode is active.

    Usage::

        tracker = DeviceMemoryTracker(capacity_bytes=2**30)
        tracker.register_existing(model.parameters())
        with tracker:
            loss = model(x).sum()
            loss.backward()
        tracker.stats()  # plain dict, bytes

    Args:
        capacity_bytes: simulated device capacity in bytes; None means unlimited.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        super().__init__()
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        # Re-entrant: a garbage collection inside a locked section can run _on_free on this
        # same thread.
        self._lock = threading.RLock()
        self._entries: dict[int, _Entry] = {}
        self._tokens = itertools.count()
        self._bytes = {DEVICE: 0, HOST: 0}
        self._peak = {DEVICE: 0, HOST: 0}
        self._num_allocations = 0
        self._host_depth = threading.local()

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs, _ = tree_flatten((args, kwargs))
        input_keys = set()
        for t in inputs:
            st = storage_of(t)
            if st is not None:
                input_keys.add(st._cdata)
        out = func(*args, **kwargs)
        outputs, _ = tree_flatten(out)
        category = HOST if getattr(self._host_depth, "n", 0) > 0 else DEVICE
        seen: set[int] = set()
        for t in outputs:
            st = storage_of(t)
            if st is None or st._cdata in seen:
                continue
            seen.add(st._cdata)
            if st._cdata in input_keys:
                self._maybe_resized(st)  # in-place / out= / view: not an allocation
            else:
                self._track(st, category, count_allocation=True)
        return out

    # ------------------------------------------------------------------ registration
    def register_existing(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count storages that existed before the mode (parameters, ...) as device bytes.

        Already-tracked storages are skipped; raises SimulatedOutOfMemoryError past capacity.
        """
        for t in tensors:
            st = storage_of(t)
            if st is not None:
                self._track(st, DEVICE, count_allocation=False)

    def mark_host(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as host memory (the offload host arena), never as device.

        A storage already tracked as device moves to host; an untracked one starts being tracked
        as host (not counted in ``num_allocations``).
        """
        st = storage_of(tensor)
        if st is None:
            raise TypeError(f"mark_host needs a dense tensor, got {type(tensor).__name__}")
        with self._lock:
            entry = self._live_entry(st)
            if entry is not None:
                if entry.category != HOST:
                    self._bytes[entry.category] -= entry.nbytes
                    entry.category = HOST
                    self._add(HOST, entry.nbytes)
                return
        self._track(st, HOST, count_allocation=False)

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        """Within this block (this thread), new storages count as host, e.g. the host arena.

        Use it to allocate the arena without tripping ``capacity_bytes``.
        """
        self._host_depth.n = getattr(self._host_depth, "n", 0) + 1
        try:
            yield
        finally:
            self._host_depth.n -= 1

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is tracked as host memory."""
        st = storage_of(tensor)
        with self._lock:
            entry = None if st is None else self._live_entry(st)
            return entry is not None and entry.category == HOST

    # ------------------------------------------------------------------ results
    def stats(self) -> dict[str, int]:
        """Plain-data counters, bytes: current/peak device and host bytes, allocations seen."""
        with self._lock:
            return {
                "current_device_bytes": self._bytes[DEVICE],
                "peak_device_bytes": self._peak[DEVICE],
                "current_host_bytes": self._bytes[HOST],
                "peak_host_bytes": self._peak[HOST],
                "num_allocations": self._num_allocations,
            }

    def headroom_bytes(self) -> int | None:
        """Simulated capacity minus the device peak since the last reset_peak(), bytes (what
        MEMO's alpha LP reads as the device headroom); None without a capacity."""
        if self.capacity_bytes is None:
            return None
        with self._lock:
            return self.capacity_bytes - self._peak[DEVICE]

    def reset_peak(self) -> None:
        """Set both peaks to the current bytes (e.g. at the start of each iteration)."""
        with self._lock:
            self._peak = dict(self._bytes)

    # ------------------------------------------------------------------ internals
    def _live_entry(self, st: torch.UntypedStorage) -> _Entry | None:
        """The entry of this very storage (lock held), or None; drops a stale same-key entry."""
        entry = self._entries.get(st._cdata)
        if entry is None:
            return None
        if entry.finalizer.alive and entry.finalizer.peek()[0] is st:
            return entry
        return None

    def _add(self, category: str, nbytes: int) -> None:
        """Add bytes to a category and update its peak (lock held)."""
        self._bytes[category] += nbytes
        if self._bytes[category] > self._peak[category]:
            self._peak[category] = self._bytes[category]

    def _check_capacity(self, category: str, nbytes: int) -> None:
        """Raise SimulatedOutOfMemoryError if a device allocation would exceed capacity (lock held)."""
        if category != DEVICE or self.capacity_bytes is None:
            return
        current = self._bytes[DEVICE]
        if current + nbytes > self.capacity_bytes:
            raise SimulatedOutOfMemoryError(
                f"simulated device out of memory: tried to allocate {nbytes} bytes with "
                f"{current} bytes in use and a capacity of {self.capacity_bytes} bytes "
                f"({self.capacity_bytes - current} free)"
            )

    def _track(self, st: torch.UntypedStorage, category: str, count_allocation: bool) -> None:
        nbytes = int(st.nbytes())
        key = st._cdata
        with self._lock:
            stale = self._entries.get(key)
            if stale is not None:
                if stale.finalizer.alive and stale.finalizer.peek()[0] is st:
                    return  # already tracked
                # The address was reused before the old storage's finalizer ran (another
                # thread freed it): retire the old entry now.
                if self._entries.pop(key, None) is stale:
                    self._entry_freed(stale)
                    self._bytes[stale.category] -= stale.nbytes
                stale.finalizer.detach()
            self._check_capacity(category, nbytes)
            token = next(self._tokens)
            finalizer = weakref.finalize(st, self._on_free, key, token)
            finalizer.atexit = False
            entry = self._entries[key] = _Entry(nbytes, category, token, finalizer)
            self._add(category, nbytes)
            if count_allocation:
                self._num_allocations += 1
            self._entry_added(entry)

    def _maybe_resized(self, st: torch.UntypedStorage) -> None:
        """Follow a tracked storage that an op resized in place (``resize_``, ``out=``)."""
        with self._lock:
            entry = self._live_entry(st)
            if entry is None:
                return
            nbytes = int(st.nbytes())
            if nbytes != entry.nbytes:
                old_nbytes = entry.nbytes
                delta = nbytes - old_nbytes
                if delta > 0:
                    self._check_capacity(entry.category, delta)
                entry.nbytes = nbytes
                self._add(entry.category, delta)
                self._entry_resized(entry, old_nbytes)

    def _on_free(self, key: int, token: int) -> None:
        """Finalizer of a tracked storage (any thread): subtract its bytes."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.token != token:
                return
            self._entry_freed(entry)
            del self._entries[key]
            self._bytes[entry.category] -= entry.nbytes

    # Subclasses that keep their own books on tracked storages (the planner's recorder, the
    # telemetry's attribution) follow them through these three hooks, called under the lock, so
    # the matching rules above (storage identity, a reused address, a resize) exist once.
    def _entry_added(self, entry: _Entry) -> None:
        """A storage is tracked from now on (its bytes already counted)."""

    def _entry_freed(self, entry: _Entry) -> None:
        """A tracked storage is about to be forgotten (its bytes still counted)."""

    def _entry_resized(self, entry: _Entry, old_nbytes: int) -> None:
        """A tracked storage changed size in place; ``entry.nbytes`` is the new size."""
