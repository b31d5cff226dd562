"""Allocation traces for the allocator models: :class:`AllocatorTrace`, the columns they replay
(action codes, block ids, requested sizes, streams; not memo_ext.trace's event traces, which
carry phases, layers and categories), our trace files (``.npz`` and JSON lines, plain or
gzipped: :func:`load_trace`, :func:`save_trace`; docs/allocator_models.md, "Trace files") and
:func:`repeated_iterations`, the allocator's view of a memo_ext.trace trace. The third input
format, PyTorch memory snapshots, is memo_ext.alloc.recorded's :func:`snapshot_trace`. The
action codes are the C++ ones (memo_ext._C.ALLOC ...). Bytes.
"""
from __future__ import annotations

import gzip
import json
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memo_ext import _C

__all__ = [
    "ACTION_NAMES", "ALLOC", "EMPTY_CACHE", "FAILED_ALLOC", "FREE", "OTHER", "SEGMENT_ALLOC",
    "SEGMENT_FREE", "SEGMENT_MAP", "SEGMENT_UNMAP", "AllocatorTrace", "TraceError", "load_trace",
    "repeated_iterations", "save_trace",
]

ALLOC, FREE, OTHER = _C.ALLOC, _C.FREE, _C.OTHER
SEGMENT_ALLOC, SEGMENT_FREE = _C.SEGMENT_ALLOC, _C.SEGMENT_FREE
SEGMENT_MAP, SEGMENT_UNMAP = _C.SEGMENT_MAP, _C.SEGMENT_UNMAP
EMPTY_CACHE, FAILED_ALLOC = _C.EMPTY_CACHE, _C.FAILED_ALLOC

# Action names in our trace files (and PyTorch's snapshot actions) -> codes. "free" is
# PyTorch's "free_completed": the block returns to the allocator. "oom" is a request that failed.
ACTION_NAMES = {
    "alloc": ALLOC,
    "free": FREE,
    "free_completed": FREE,
    "free_requested": OTHER,
    "segment_alloc": SEGMENT_ALLOC,
    "segment_free": SEGMENT_FREE,
    "segment_map": SEGMENT_MAP,
    "segment_unmap": SEGMENT_UNMAP,
    "empty_cache": EMPTY_CACHE,
    "oom": FAILED_ALLOC,
    "snapshot": OTHER,
    "other": OTHER,
}
_MAX_CODE = FAILED_ALLOC


class TraceError(ValueError):
    """A trace file could not be read: the message names the file (and line) at fault."""



# ------------------------------------------------------------------------------------ traces


@dataclass
class AllocatorTrace:
    """An allocation trace as the allocator models replay it: equally long int64 columns, one
    row per event.

    ``actions`` holds codes (ALLOC=0, FREE=1, SEGMENT_ALLOC..SEGMENT_UNMAP=2..5 recorded allocator
    decisions that the models ignore, OTHER=6, EMPTY_CACHE=7, FAILED_ALLOC=8); ``ids`` names the
    block (an address in a snapshot), ``sizes`` are requested bytes (FREE sizes are not used),
    ``streams`` the stream of the request. The first ``num_prologue`` rows are ALLOCs recreating
    the blocks that were live before a snapshot's recording started.
    """

    actions: np.ndarray
    ids: np.ndarray
    sizes: np.ndarray
    streams: np.ndarray
    name: str = ""
    device: int = 0
    num_prologue: int = 0

    def __post_init__(self):
        cols = [np.ascontiguousarray(c, dtype=np.int64) for c in
                (self.actions, self.ids, self.sizes, self.streams)]
        if any(c.ndim != 1 for c in cols) or len({len(c) for c in cols}) != 1:
            raise TraceError(f"{self.name or 'trace'}: action, addr, size and stream must be "
                             "1-D columns of equal length")
        self.actions, self.ids, self.sizes, self.streams = cols

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def num_allocs(self) -> int:
        return int(np.count_nonzero(self.actions == ALLOC))


def _codes(names, where: str) -> np.ndarray:
    try:
        return np.array([ACTION_NAMES[str(a)] for a in names], dtype=np.int64)
    except KeyError as exc:
        raise TraceError(f"{where}: unknown action {exc.args[0]!r} (expected one of "
                         f"{', '.join(sorted(ACTION_NAMES))})") from None


def load_trace(path) -> AllocatorTrace:
    """Read one of our trace files (see docs/allocator_models.md, "Trace files").

    ``.npz``: int64 arrays ``action`` (codes, or action names as strings), ``addr``, ``size``,
    ``stream`` (optional, default 0), equally long. Anything else is JSON lines, optionally
    gzipped: one object per line, ``{"action": "alloc", "addr": 140, "size": 4096, "stream": 0}``;
    "action" is one of :data:`ACTION_NAMES`, "size" (bytes) is needed for "alloc" and "oom",
    "stream" defaults to 0; blank lines and lines starting with ``#`` are skipped. The files of
    memo_ext.trace's tracer (``tools/trace.py``: a header object with "format", events keyed
    "id" and "bytes", a "pool") read as they are: the header is skipped, "id"/"bytes" stand for
    "addr"/"size", and events of a pool other than "device" (host memory, memory outside the
    allocator) are left out. Raises OSError when the file cannot be opened and
    :class:`TraceError` (one line naming the file) when it is not a valid trace.
    """
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):
        return _load_npz(path)
    return _load_jsonl(path, gzipped=head.startswith(b"\x1f\x8b"))


def _load_npz(path: Path) -> AllocatorTrace:
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = {"action", "addr", "size"} - set(z.files)
            if missing:
                raise TraceError(f"{path}: missing array(s) {', '.join(sorted(missing))} "
                                 "(need action, addr, size, optionally stream)")
            action, addr, size = z["action"], z["addr"], z["size"]
            stream = z["stream"] if "stream" in z.files else np.zeros(len(action), np.int64)
    except TraceError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise TraceError(f"{path}: not a readable .npz trace ({type(exc).__name__}: {exc})") \
            from exc
    if action.dtype.kind in "US":
        action = _codes(action, str(path))
    for name, col in (("action", action), ("addr", addr), ("size", size), ("stream", stream)):
        if col.dtype.kind not in "iu":
            raise TraceError(f"{path}: array {name!r} must hold integers, not {col.dtype}")
    trace = AllocatorTrace(action, addr, size, stream, name=path.name)
    _check_columns(trace, str(path))
    return trace


def _load_jsonl(path: Path, gzipped: bool = False) -> AllocatorTrace:
    actions, addrs, sizes, streams = [], [], [], []
    try:
        text = (gzip.decompress(path.read_bytes()) if gzipped else path.read_bytes()).decode()
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(f"{path}: not a readable gzipped trace ({exc})") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a trace (neither .npz nor UTF-8 JSON lines)") from exc
    seen_event = False
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if isinstance(rec, dict) and "format" in rec and "action" not in rec and not seen_event:
            continue  # a header line (memo_ext.trace's tracer writes one)
        if not isinstance(rec, dict) or "action" not in rec:
            raise TraceError(f"{where}: expected an object with an 'action' key")
        seen_event = True
        if rec.get("pool", "device") != "device":
            continue  # host memory or device memory outside the allocator
        code = _codes([rec["action"]], where)[0]
        try:
            addr = int(rec.get("addr", rec.get("id", 0)))
            size = int(rec.get("size", rec.get("bytes", 0)))
            stream = int(rec.get("stream", 0) or 0)
        except (TypeError, ValueError):
            raise TraceError(f"{where}: addr, size and stream must be integers") from None
        if code in (ALLOC, FAILED_ALLOC) and "size" not in rec and "bytes" not in rec:
            raise TraceError(f"{where}: an {rec['action']!r} event needs a 'size' (bytes)")
        actions.append(code)
        addrs.append(addr)
        sizes.append(size)
        streams.append(stream)
    try:
        cols = [np.array(c, np.int64) for c in (actions, addrs, sizes, streams)]
    except OverflowError:
        raise TraceError(f"{path}: a value does not fit in 64 bits") from None
    trace = AllocatorTrace(*cols, name=path.name)
    _check_columns(trace, str(path))
    return trace


def _check_columns(trace: AllocatorTrace, where: str) -> None:
    bad = np.flatnonzero((trace.actions < 0) | (trace.actions > _MAX_CODE))
    if bad.size:
        raise TraceError(f"{where}: event {bad[0]} has action code {trace.actions[bad[0]]} "
                         f"(expected 0..{_MAX_CODE})")
    bad = np.flatnonzero(trace.sizes < 0)
    if bad.size:
        raise TraceError(f"{where}: event {bad[0]} has a negative size")


def save_trace(trace: AllocatorTrace, path) -> None:
    """Write ``trace`` as .npz (when ``path`` ends in .npz) or JSON lines (anything else)."""
    path = Path(path)
    if path.suffix == ".npz":
        with path.open("wb") as f:  # np.savez_compressed would append .npz to other names
            np.savez_compressed(f, action=trace.actions, addr=trace.ids, size=trace.sizes,
                                stream=trace.streams)
        return
    names = {code: name for name, code in reversed(ACTION_NAMES.items())}
    names[FREE], names[FAILED_ALLOC] = "free", "oom"
    with path.open("w") as f:
        for a, i, s, st in zip(trace.actions.tolist(), trace.ids.tolist(), trace.sizes.tolist(),
                               trace.streams.tolist()):
            f.write(json.dumps({"action": names[a], "addr": i, "size": s, "stream": st}) + "\n")



def repeated_iterations(trace, iterations: int) -> tuple[AllocatorTrace, list[int], list[int]]:
    """The allocator's view of ``iterations`` training iterations of a memo_ext.trace trace
    (anything with ``.events``, dicts with id/action/bytes/phase/pool): the persistent
    (``init``) allocations once, then the iteration's events ``iterations`` times with its
    blocks renamed per iteration. Returns the trace, the row at which each iteration starts,
    and for each row of one iteration its row among the trace's device events."""
    device = [e for e in trace.events if e["pool"] == "device"]
    persistent = [e for e in device if e["phase"] == "init"]
    persistent_ids = {e["id"] for e in persistent}
    step_rows = [row for row, e in enumerate(device) if e["phase"] != "init"]
    step = [device[row] for row in step_rows]
    if any(e["action"] == "free" and e["id"] in persistent_ids for e in step):
        raise ValueError("the iteration frees a persistent allocation: cannot repeat it")
    id_span = 1 + max((e["id"] for e in device), default=0)
    actions = [ALLOC] * len(persistent)
    sizes = [e["bytes"] for e in persistent]
    starts = []
    step_actions = [ALLOC if e["action"] == "alloc" else FREE for e in step]
    step_ids = np.array([e["id"] for e in step], np.int64)
    step_sizes = [e["bytes"] if e["action"] == "alloc" else 0 for e in step]
    id_columns = [np.array([e["id"] for e in persistent], np.int64)]
    for iteration in range(iterations):
        starts.append(len(actions))
        actions += step_actions
        sizes += step_sizes
        id_columns.append(step_ids + (iteration + 1) * id_span)
    return (AllocatorTrace(np.array(actions), np.concatenate(id_columns), np.array(sizes),
                  np.zeros(len(actions)), name=f"{iterations} iterations"), starts, step_rows)
