"""Read PyTorch CUDA memory snapshots safely and summarize them per device.

A snapshot is the pickle written by ``torch.cuda.memory._dump_snapshot()``: plain dicts and lists
with ``segments`` (the allocator's state when it was dumped), ``device_traces`` (one event list
per device) and, in newer PyTorch versions, ``allocator_settings``. Snapshots come from strangers,
so :func:`load_snapshot` admits only builtin containers and scalars: any pickled global (a class,
a function such as ``os.system``) is refused before it can be called.

The trace is a ring buffer that starts mid-run. :func:`summarize_snapshot` rebuilds the starting
state as "what ``segments`` holds at the end minus what the trace added", then replays the trace
with the C++ kernel ``memo_ext._C.replay_live_bytes``. All byte counts are bytes.
"""
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memo_ext import _C

__all__ = ["DeviceSummary", "OomEvent", "SnapshotError", "load_snapshot", "summarize_snapshot"]

# PyTorch trace action -> replay action code. "free_completed" is the moment a block returns to
# the cache ("free_requested" only starts waiting for its streams); every action not listed here
# ("free_requested", "oom", "snapshot", ...) moves no bytes and becomes OTHER.
ACTION_CODES = {
    "alloc": _C.ALLOC,
    "free_completed": _C.FREE,
    "segment_alloc": _C.SEGMENT_ALLOC,
    "segment_free": _C.SEGMENT_FREE,
    "segment_map": _C.SEGMENT_MAP,
    "segment_unmap": _C.SEGMENT_UNMAP,
}

# Block states in ``segments`` that still count as allocated in the trace's view: a block whose
# free was requested but has not completed ("active_pending_free") has no free_completed event yet.
ALLOCATED_BLOCK_STATES = ("active_allocated", "active_pending_free")


class SnapshotError(ValueError):
    """A snapshot was refused (a pickled global, not a pickle) or its contents are malformed."""


class _SnapshotUnpickler(pickle.Unpickler):
    """Unpickler that builds only builtin containers and scalars.

    Those need no globals at all (the five reference snapshots contain no GLOBAL, REDUCE or
    BUILD opcode), so every global lookup is refused: without a callable, nothing can run.
    """

    def __init__(self, file, name: str):
        super().__init__(file)
        self._name = name

    def find_class(self, module, name):
        raise SnapshotError(
            f"{self._name}: refused pickled global {module}.{name}: a memory snapshot may hold "
            "only builtin containers and scalars"
        )

    def persistent_load(self, pid):
        raise SnapshotError(f"{self._name}: refused persistent id {pid!r} in a memory snapshot")


def load_snapshot(path) -> dict:
    """Load a memory snapshot pickle without running any code from it.

    Raises FileNotFoundError (or another OSError) when the file cannot be opened, and
    SnapshotError, naming the file, when it holds a pickled global, is not a readable pickle, or
    is not a snapshot dict with a ``segments`` list.
    """
    path = Path(path)
    with path.open("rb") as f:
        try:
            snapshot = _SnapshotUnpickler(f, str(path)).load()
        except SnapshotError:
            raise
        except Exception as exc:  # untrusted bytes: a corrupt pickle can fail in many ways
            raise SnapshotError(
                f"{path}: not a readable pickle ({type(exc).__name__}: {exc})"
            ) from exc
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list):
        raise SnapshotError(f"{path}: not a memory snapshot (no 'segments' list at the top level)")
    if not isinstance(snapshot.get("device_traces", []), list):
        raise SnapshotError(f"{path}: 'device_traces' is not a list")
    return snapshot


@dataclass(frozen=True)
class OomEvent:
    """An out-of-memory event of the trace."""

    event_index: int  # position in the device's trace
    requested_bytes: int
    device_free_bytes: int | None  # free device memory reported by CUDA; None when not recorded


@dataclass
class DeviceSummary:
    """What one device's trace did. Bytes are in the trace's unit (see ``trace_size_field``)."""

    device: int
    num_events: int
    # Which block field of ``segments`` the trace's sizes match: "requested_size" (the caller's
    # bytes, what PyTorch records; true for all five reference snapshots) or "size" (rounded).
    trace_size_field: str
    initial_allocated_bytes: int  # live before the first event (the trace starts mid-run)
    initial_reserved_bytes: int
    peak_allocated_bytes: int  # over the trace, initial state included
    peak_allocated_event: int  # first event reaching the peak; -1 if it is the initial state
    peak_reserved_bytes: int
    final_allocated_bytes: int
    final_reserved_bytes: int
    fragmentation: float  # 1 - peak allocated / peak reserved; 0.0 when nothing is reserved
    num_allocs: int
    num_frees: int  # free_completed events
    num_unmatched_frees: int  # frees of blocks allocated before the trace started
    num_segment_alloc: int
    num_segment_free: int
    num_segment_map: int  # expandable segments: pages mapped into / unmapped from a segment
    num_segment_unmap: int
    ooms: list[OomEvent]
    allocated_timeline: np.ndarray = field(repr=False)  # int64 bytes after each event
    reserved_timeline: np.ndarray = field(repr=False)


def _trace_size_field(trace: list, segments: list) -> str:
    """Which block field the trace's byte counts are: "requested_size" or "size".

    A block that is live at the end and was allocated by the trace's last alloc at its address
    tells, when its requested and rounded sizes differ. Without such a witness the default is
    "requested_size", or "size" where blocks carry no requested size.
    """
    blocks = [b for s in segments for b in s["blocks"] if b["state"] in ALLOCATED_BLOCK_STATES]
    if any("requested_size" not in b for b in blocks):
        return "size"
    last_alloc = {e["addr"]: e["size"] for e in trace if e["action"] == "alloc"}
    for b in blocks:
        traced = last_alloc.get(b["address"])
        if traced is not None and b["requested_size"] != b["size"]:
            return "size" if traced == b["size"] else "requested_size"
    return "requested_size"


def _summarize_device(device: int, trace: list, segments: list) -> DeviceSummary:
    n = len(trace)
    actions = np.fromiter((ACTION_CODES.get(e["action"], _C.OTHER) for e in trace), np.int64, n)
    addrs = np.fromiter((e.get("addr", 0) for e in trace), np.int64, n)
    sizes = np.fromiter((e.get("size", 0) for e in trace), np.int64, n)

    size_field = _trace_size_field(trace, segments)
    final_allocated = sum(
        b[size_field] for s in segments for b in s["blocks"] if b["state"] in ALLOCATED_BLOCK_STATES
    )
    final_reserved = sum(s["total_size"] for s in segments)

    def total(*codes) -> int:
        return int(sizes[np.isin(actions, codes)].sum())

    initial_allocated = final_allocated - (total(_C.ALLOC) - total(_C.FREE))
    initial_reserved = final_reserved - (
        total(_C.SEGMENT_ALLOC, _C.SEGMENT_MAP) - total(_C.SEGMENT_FREE, _C.SEGMENT_UNMAP)
    )
    if initial_allocated < 0 or initial_reserved < 0:
        raise SnapshotError(
            f"device {device}: the trace adds more than the final segments hold "
            f"(initial allocated {initial_allocated} B, initial reserved {initial_reserved} B)"
        )

    r = _C.replay_live_bytes(actions, addrs, sizes, initial_allocated, initial_reserved)
    ooms = [
        OomEvent(i, e["size"], e.get("device_free"))
        for i, e in enumerate(trace)
        if e["action"] == "oom"
    ]
    peak_reserved = r["peak_reserved"]
    return DeviceSummary(
        device=device,
        num_events=n,
        trace_size_field=size_field,
        initial_allocated_bytes=initial_allocated,
        initial_reserved_bytes=initial_reserved,
        peak_allocated_bytes=r["peak_allocated"],
        peak_allocated_event=r["peak_allocated_index"],
        peak_reserved_bytes=peak_reserved,
        final_allocated_bytes=r["final_allocated"],
        final_reserved_bytes=r["final_reserved"],
        fragmentation=1.0 - r["peak_allocated"] / peak_reserved if peak_reserved else 0.0,
        num_allocs=r["num_allocs"],
        num_frees=r["num_frees"],
        num_unmatched_frees=r["num_unmatched_frees"],
        num_segment_alloc=r["num_segment_allocs"],
        num_segment_free=r["num_segment_frees"],
        num_segment_map=r["num_segment_maps"],
        num_segment_unmap=r["num_segment_unmaps"],
        ooms=ooms,
        allocated_timeline=r["allocated"],
        reserved_timeline=r["reserved"],
    )


def summarize_snapshot(snapshot: dict, device: int | None = None) -> list[DeviceSummary]:
    """Summarize a loaded snapshot per device (bytes throughout).

    ``device=None`` covers every device with trace events or segments, in index order; an index
    selects one device, which must exist in ``device_traces`` or ``segments`` (ValueError
    otherwise). Raises SnapshotError when a field is missing or of the wrong type, or when the
    trace contradicts the final segments.
    """
    try:
        traces = snapshot.get("device_traces", [])
        segments = snapshot["segments"]
        num_devices = max(len(traces), 1 + max((s["device"] for s in segments), default=-1))
        by_device: dict[int, list] = {d: [] for d in range(num_devices)}
        for s in segments:
            by_device[s["device"]].append(s)

        def trace_of(d: int) -> list:
            return traces[d] if d < len(traces) else []

        if device is None:
            devices = [d for d in range(num_devices) if trace_of(d) or by_device[d]]
        elif 0 <= device < num_devices:
            devices = [device]
        else:
            raise ValueError(f"no device {device} in this snapshot ({num_devices} devices)")
        return [_summarize_device(d, trace_of(d), by_device[d]) for d in devices]
    except (KeyError, TypeError, OverflowError) as exc:  # a field missing or of the wrong type
        raise SnapshotError(f"malformed snapshot: {type(exc).__name__}: {exc}") from exc
