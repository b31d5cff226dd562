"""The real GMLake stitching allocator on Linux host memory (docs/stitching.md).

The C++ allocator (``csrc/stitching_allocator.h``) makes the decisions of the ``stitching``
allocator model (:func:`memo_ext.alloc.replay` with ``policy="stitching"``) but hands out real
memory: physical chunks are ``memfd_create`` files, virtual ranges ``mmap(PROT_NONE)``
reservations, and a stitched block is one contiguous range whose pieces are
``mmap(MAP_FIXED|MAP_SHARED)`` views of several non-contiguous physical pieces. The same core
runs on a GPU over the CUDA VMM API (:mod:`memo_ext.alloc.stitching_cuda`).

Entry points: :class:`HostStitchingAllocator` (malloc/free real memory from Python) and
:func:`replay_host` (drive a fresh allocator with a :class:`~memo_ext.alloc.AllocatorTrace`,
writing and verifying a pattern in every block, and checking that nothing leaks). All sizes are
bytes.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np

from memo_ext import _C
from memo_ext.alloc.models import OomInfo
from memo_ext.alloc.traces import AllocatorTrace

__all__ = ["CONSTANTS", "HostReplayResult", "HostStitchingAllocator", "replay_host"]

# kGranularity (2 MiB chunk), kDefaultFragLimit, kDefaultMaxSBlocks, and the data-check scheme
# kCheckWindow / kCheckStride / kWholeCheckLimit, in bytes (explained in csrc/stitching_check.h).
CONSTANTS: dict = dict(_C.STITCHING_CONSTANTS)


class HostStitchingAllocator:
    """GMLake stitching over host memory: blocks are real, readable and writable.

    capacity_bytes: physical memory it may hold at once (None: unlimited); beyond it a request
    first drops the cache (a reorganisation), then fails. frag_limit_bytes: requests below it
    (and always those below 2 MiB) take the embedded caching path; larger ones are rounded up to
    2 MiB chunks and served from the primitive/stitched pools. max_sblocks: StitchFree keeps at
    most this many stitched blocks. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, capacity_bytes: int | None = None, frag_limit_bytes: int | None = None,
                 max_sblocks: int | None = None):
        self._a = _C.HostStitchingAllocator(
            capacity_bytes or 0,
            CONSTANTS["kDefaultFragLimit"] if frag_limit_bytes is None else frag_limit_bytes,
            CONSTANTS["kDefaultMaxSBlocks"] if max_sblocks is None else max_sblocks)

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Address of a block of at least ``nbytes`` bytes for ``stream``; 0 when out of memory."""
        return self._a.malloc(nbytes, stream)

    def free(self, address: int) -> int:
        """Return the block at ``address``; its requested bytes, or -1 when none starts there."""
        return self._a.free(address)

    def empty_cache(self) -> None:
        """Drop unused stitched blocks and release every free physical piece."""
        self._a.empty_cache()

    def kind(self, address: int) -> str:
        """"normal", "primitive" or "stitched" ("" when no block starts at ``address``)."""
        return self._a.kind(address)

    def block_bytes(self, address: int) -> int:
        """Bytes of the block at ``address`` (its full size; -1: none)."""
        return self._a.block_bytes(address)

    def views(self, address: int) -> list[tuple[int, int, int, int, int]]:
        """The block's physical pieces: (offset in the block, address of the piece's own view,
        bytes, physical handle, offset in the handle), in block order."""
        return [tuple(v) for v in self._a.views(address)]

    def buffer(self, address: int, nbytes: int) -> np.ndarray:
        """A uint8 numpy array over ``nbytes`` bytes at ``address`` (no copy): valid only while
        the memory stays mapped."""
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))

    def stats(self) -> dict:
        """Counters: reserved/active/mapped bytes and peaks, stitched blocks alive, alloc,
        split, stitch and exact-hit counts, map calls and the seconds spent in them, and what the
        host backend holds (``backend_*``: physical bytes, open memfds, ranges)."""
        return dict(self._a.stats())

    def check_invariants(self) -> str:
        """"" when every internal invariant holds, else the first broken one."""
        return self._a.check_invariants()

    def close(self) -> dict:
        """Release everything (blocks in use included); returns what the backend still holds
        afterwards (all zero)."""
        return dict(self._a.close())

    @property
    def closed(self) -> bool:
        return self._a.closed

    def __enter__(self) -> HostStitchingAllocator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class HostReplayResult:
    """What the real host allocator did with one trace. Bytes and seconds throughout.

    ``peak_reserved_bytes`` counts physical memory (memfd bytes) only, however many views map
    it; ``peak_mapped_bytes`` counts every view. The integrity counts describe the pattern
    check of csrc/stitching_check.h; ``leaked`` is what the backend still held after teardown.
    """

    trace_name: str
    device: int
    capacity_bytes: int | None
    num_events: int
    peak_allocated_bytes: int  # 512-rounded requests live at once (as the models count)
    peak_reserved_bytes: int
    peak_mapped_bytes: int
    fragmentation: float  # 1 - peak allocated / peak reserved
    physical_creates: int  # memfd allocations (the model's device_mallocs)
    physical_releases: int  # pieces handed back (the model's device_frees)
    reorganisations: int
    oom: OomInfo | None
    unmatched_frees: int
    stats: dict  # the allocator's counters at the end (see HostStitchingAllocator.stats)
    checked_blocks: int  # blocks whose pattern was verified
    stitched_checked: int  # of which stitched (also read through each part's own view)
    checked_bytes: int
    data_errors: int
    first_error: str
    invariant_error: str  # "" when every internal invariant held at the end
    leaked: dict  # physical_bytes, handles, ranges, mapped_bytes left after teardown
    peak_resident_bytes: int  # process RSS sampled during the replay
    seconds: float  # replay loop, checks included
    allocated_timeline: np.ndarray = field(repr=False)
    reserved_timeline: np.ndarray = field(repr=False)
    decision_events: np.ndarray = field(repr=False)  # with log=True: physical creates (2) and
    decision_kinds: np.ndarray = field(repr=False)  # releases (3) per event, as the models log
    decision_sizes: np.ndarray = field(repr=False)

    @property
    def ok(self) -> bool:
        """No data error, every invariant held, nothing leaked."""
        return (self.data_errors == 0 and not self.invariant_error
                and not any(self.leaked.values()))


def replay_host(trace: AllocatorTrace, capacity_bytes: int | None = None, *,
                frag_limit: int | None = None, max_sblocks: int | None = None,
                check: bool = True, timelines: bool = True, log: bool = False
                ) -> HostReplayResult:
    """Replay ``trace`` through a fresh :class:`HostStitchingAllocator` and tear it down.

    Events as :func:`memo_ext.alloc.replay` treats them (ALLOC, FREE, FAILED_ALLOC tried and
    handed back, EMPTY_CACHE, the rest ignored). capacity_bytes: physical memory it may hold
    (None: unlimited). frag_limit (bytes), max_sblocks: as for the ``stitching`` model. check:
    write a pattern of each request into its block and verify it at its free (and at the end),
    through the block's address and each piece's own view. log: keep the physical
    create/release decisions (to compare with the model's). Host memory used: the pattern
    touches about 1/512 of each large block (csrc/stitching_check.h); virtual address space as
    much as the trace reserves.
    """
    cfg = {"capacity": capacity_bytes or 0, "frag_limit": frag_limit,
           "max_sblocks": max_sblocks, "log": int(log)}
    r = _C.replay_stitching_host(trace.actions, trace.ids, trace.sizes, trace.streams, cfg,
                                 check, timelines)
    st = {k: (float(v) if k.endswith("seconds") else int(v)) for k, v in dict(r["stats"]).items()}
    peak_reserved = st["peak_reserved_bytes"]
    oom = None
    if r["num_ooms"]:
        i = int(r["first_oom_index"])
        oom = OomInfo(i, int(trace.sizes[i]), int(trace.streams[i]), int(r["num_ooms"]))
    return HostReplayResult(
        trace_name=trace.name, device=trace.device, capacity_bytes=capacity_bytes,
        num_events=len(trace), peak_allocated_bytes=int(r["peak_allocated"]),
        peak_reserved_bytes=peak_reserved, peak_mapped_bytes=st["peak_mapped_bytes"],
        fragmentation=1.0 - r["peak_allocated"] / peak_reserved if peak_reserved else 0.0,
        physical_creates=st["physical_creates"], physical_releases=st["physical_releases"],
        reorganisations=st["reorganisations"], oom=oom,
        unmatched_frees=int(r["unmatched_frees"]), stats=st,
        checked_blocks=int(r["checked_blocks"]), stitched_checked=int(r["stitched_checked"]),
        checked_bytes=int(r["checked_bytes"]), data_errors=int(r["data_errors"]),
        first_error=str(r["first_error"]), invariant_error=str(r["invariant_error"]),
        leaked={k: int(r[f"leaked_{k}"]) for k in ("physical_bytes", "handles", "ranges",
                                                      "mapped_bytes")},
        peak_resident_bytes=int(r["peak_resident_bytes"]), seconds=float(r["seconds"]),
        allocated_timeline=r["allocated"], reserved_timeline=r["reserved"],
        decision_events=r["decision_event"], decision_kinds=r["decision_kind"],
        decision_sizes=r["decision_size"],
    )
