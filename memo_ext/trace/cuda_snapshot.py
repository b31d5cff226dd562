"""PyTorch memory snapshots: traces recorded live on CUDA (:func:`record_cuda_trace`), and
conversion between a snapshot and a :class:`Trace` both ways (for memory_viz)."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any, Optional

import torch

from memo_ext.trace.format import ACTIVATION, POOL_DEVICE, Trace

def trace_from_snapshot(snapshot: dict, device: int = 0, header: Optional[dict] = None) -> Trace:
    """Events of one device's trace in a PyTorch memory snapshot (a dict as returned by
    memo_ext.alloc.snapshot.load_snapshot): "alloc" and "free_completed" actions, ids paired by
    address, sizes as the snapshot records them (the caching allocator's rounded block sizes).
    No layer/phase tags (null); category "activation" for everything."""
    traces = snapshot.get("device_traces", [])
    trace_events = traces[device] if device < len(traces) else []
    ids = itertools.count()
    live: dict[int, int] = {}
    events = []
    for raw in trace_events:
        action = raw.get("action")
        if action == "alloc":
            event_id = next(ids)
            live[raw["addr"]] = event_id
            events.append({"id": event_id, "action": "alloc", "bytes": int(raw["size"]),
                           "stream": raw.get("stream", 0), "layer": None, "phase": None,
                           "category": ACTIVATION, "microbatch": None, "pool": POOL_DEVICE,
                           "module": None, "op": None})
        elif action == "free_completed" and raw["addr"] in live:
            events.append({"id": live.pop(raw["addr"]), "action": "free",
                           "bytes": int(raw["size"]), "stream": raw.get("stream", 0),
                           "layer": None, "phase": None, "category": ACTIVATION,
                           "microbatch": None, "pool": POOL_DEVICE, "module": None, "op": None})
    return Trace(header=dict(header or {}, mode="cuda"), events=events)


#: Where exported snapshots place their synthetic blocks (any aligned, nonzero base works:
#: memory_viz only uses addresses to pair an alloc with its free).
_SNAPSHOT_BASE_ADDRESS = 0x7F0000000000
_SNAPSHOT_ADDRESS_STRIDE = 512


def trace_to_snapshot(trace: Trace) -> dict:
    """``trace`` as a PyTorch memory snapshot (the dict ``torch.cuda.memory._snapshot()``
    returns), so PyTorch's memory_viz (https://pytorch.org/memory_viz) shows its "Active Memory
    Timeline". Device-pool events only, as a real snapshot has them: host slots are not device
    memory, and external memory (CUDA context, NCCL) never passes through the caching allocator
    (the header, kept as JSON under "memo_trace_header", names it). Every block gets its own
    synthetic address; its tags (phase, layer, micro-batch, category, module,
    op) become the one stack frame memory_viz shows for it. No "segments": the trace has no
    allocator decisions (replay it through memo_ext.alloc for those).
    :func:`trace_from_snapshot` reads it back to the same sizes and order."""
    entries = []
    for event in trace.events:
        if event["pool"] != POOL_DEVICE:
            continue
        tags = [f"{event['phase'] or 'untagged'}"]
        if event["layer"] is not None:
            tags.append(f"layer {event['layer']}")
        if event["microbatch"] is not None:
            tags.append(f"micro-batch {event['microbatch']}")
        tags.append(event["category"])
        if event["op"]:
            tags.append(str(event["op"]))
        entries.append({
            "action": "alloc" if event["action"] == "alloc" else "free_completed",
            "addr": _SNAPSHOT_BASE_ADDRESS + int(event["id"]) * _SNAPSHOT_ADDRESS_STRIDE,
            "size": int(event["bytes"]),
            "stream": int(event["stream"] or 0),
            "frames": [{"filename": event["module"] or "memo_ext.trace",
                        "line": int(event["layer"] or 0), "name": ", ".join(tags)}],
        })
    return {"segments": [], "device_traces": [entries],
            "memo_trace_header": json.dumps(trace.header, sort_keys=True)}


def write_snapshot(trace: Trace, path) -> None:
    """Write :func:`trace_to_snapshot` as a pickle, as ``torch.cuda.memory._dump_snapshot``
    does (plain dicts, lists, strings and ints only, so memo_ext.alloc's restricted reader and
    memory_viz both open it). Written to a temporary name and renamed: never half a file."""
    import pickle

    path = os.fspath(path)
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        pickle.dump(trace_to_snapshot(trace), f, protocol=4)
    os.replace(partial, path)


def record_cuda_trace(function: Callable[[], Any], device: Optional[int] = None,
                      max_entries: int = 1_000_000) -> tuple[Trace, Any]:
    """Run ``function()`` on CUDA under ``torch.cuda.memory._record_memory_history`` and return
    (its allocation trace, the snapshot's memo_ext.alloc DeviceSummary). Needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("record_cuda_trace needs CUDA; use record_iteration (live CPU or "
                           "FakeTensorMode) on this machine")
    from memo_ext.device_memory import current_allocator, snapshots_supported

    if not snapshots_supported():
        raise RuntimeError(f"record_cuda_trace reads PyTorch's allocator snapshots, and "
                           f"{current_allocator().name} replaced that allocator in this process: "
                           "trace in a process without it")
    from memo_ext.alloc.snapshot import load_snapshot, summarize_snapshot

    device = torch.cuda.current_device() if device is None else device
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        function()
        torch.cuda.synchronize(device)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "snapshot.pickle")
            torch.cuda.memory._dump_snapshot(path)
            snapshot = load_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    summary = summarize_snapshot(snapshot, device)[0]
    return trace_from_snapshot(snapshot, device), summary
