"""The trace's format: its vocabulary (categories, phases, pools), the :class:`Trace` container,
and its file I/O (:func:`write_trace`, :func:`read_trace`).

Event format (one dict per event; :func:`write_trace` writes gzipped JSON lines)::

    {"id": 17, "action": "alloc" | "free", "bytes": 1073741824, "stream": 0,
     "layer": 3 | null, "phase": "init" | "forward" | "recompute" | "backward" | "optimizer",
     "category": "parameter" | "gradient" | "optimizer" | "activation" | "workspace",
     "microbatch": 0 | null, "pool": "device" | "host" | "external",
     "module": "decoder.layers.3.mlp.linear_fc1" | null, "op": "aten.mm.default" | null}

``id`` pairs an alloc with its free; ``bytes`` are requested bytes (no allocator rounding);
``layer`` is the global 0-based transformer layer index; ``pool`` "device" goes through the
caching allocator, "external" is device memory outside it (CUDA context, NCCL), "host" is
host memory (MEMO's offload slots, page-locked on CUDA). Allocations alive at the end of the iteration
(parameters, gradient buffer, optimizer state, persistent buffers) have no free event.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass

PARAMETER, GRADIENT, OPTIMIZER, ACTIVATION, WORKSPACE = (
    "parameter", "gradient", "optimizer", "activation", "workspace")
CATEGORIES = (PARAMETER, GRADIENT, OPTIMIZER, ACTIVATION, WORKSPACE)

INIT, FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER_STEP = (
    "init", "forward", "recompute", "backward", "optimizer")
PHASES = (INIT, FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER_STEP)

POOL_DEVICE, POOL_HOST, POOL_EXTERNAL = "device", "host", "external"

#: Every allocation of the traced iteration is issued on the compute stream (MEMO's copy streams
#: only copy into buffers allocated on it), so ``stream`` is always this value today.
COMPUTE_STREAM = 0

TRACE_FORMAT = "memo-alloc-trace"
TRACE_VERSION = 1

EVENT_FIELDS = ("id", "action", "bytes", "stream", "layer", "phase", "category", "microbatch",
                "pool", "module", "op")

MiB = 1 << 20

@dataclass
class Trace:
    """A header (layout, model, options: plain data) and the ordered events (dicts with
    :data:`EVENT_FIELDS`)."""

    header: dict
    events: list[dict]


def write_trace(trace: Trace, path) -> None:
    """Write ``trace`` as gzipped JSON lines: the header object first (with "format" and
    "version"), then one event per line. Deterministic bytes (no gzip name or mtime); written to
    a temporary name and renamed, so a crash never leaves half a trace."""
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **trace.header}
    partial = f"{os.fspath(path)}.partial"
    # One encoder for every line (json.dumps with separators makes one per call), the events
    # written at once: a 32-layer trace has ~100,000 of them.
    encode = json.JSONEncoder(separators=(",", ":")).encode
    lines = [json.dumps(header, sort_keys=True)]
    lines += [encode({k: event[k] for k in EVENT_FIELDS}) for event in trace.events]
    with open(partial, "wb") as raw, \
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(("\n".join(lines) + "\n").encode())
    os.replace(partial, path)


def read_trace(path) -> Trace:
    """Read a trace written by :func:`write_trace`. Raises ValueError naming the file when the
    first line is not a header of this format and version, or an event lacks a field."""
    with gzip.open(path, "rt") as f:
        first = f.readline()
        try:
            header = json.loads(first)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: first line is not JSON ({exc})") from None
        if header.get("format") != TRACE_FORMAT or header.get("version") != TRACE_VERSION:
            raise ValueError(f"{path}: not a {TRACE_FORMAT} v{TRACE_VERSION} file (header "
                             f"format={header.get('format')!r}, version={header.get('version')!r})")
        body = f.read()
    # The event lines parsed as one JSON array (one parser call, not one per line).
    try:
        events = json.loads("[" + body.rstrip("\n").replace("\n", ",") + "]")
    except json.JSONDecodeError:
        events = None
    fields = frozenset(EVENT_FIELDS)
    if events is None or not all(type(e) is dict and fields <= e.keys() for e in events):
        _first_bad_event(path, body)
    return Trace(header=header, events=events)


def _first_bad_event(path, body: str) -> None:
    """Raise the ValueError naming the first event line of ``body`` (after the header) that
    is not JSON or lacks a field."""
    for number, line in enumerate(body.splitlines(), start=2):
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        missing = [k for k in EVENT_FIELDS if not isinstance(event, dict) or k not in event]
        if missing:
            raise ValueError(f"{path}:{number}: event lacks {', '.join(missing)}")
    raise ValueError(f"{path}: its events are not JSON lines")
