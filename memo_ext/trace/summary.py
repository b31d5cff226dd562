"""Summaries of a trace: peaks, per-category and per-layer figures (:func:`summarize`), and the
closed-form skeletal-activation bytes they are checked against.

Why :func:`summarize` sweeps live bytes in Python rather than through the C++ replay
(``memo_ext._C.replay_live_bytes``, memo_ext.alloc.snapshot's engine for allocator snapshots):

- the replay keeps one live counter and returns totals and a timeline; a summary needs several
  at once (device + external, device alone, host, each category) and two live *sets* (what is
  alive when backward starts, and at the end), which pair each free with its alloc by ``id``.
  Through the replay that is eight masked sweeps plus this Python pass for the sets anyway:
  two engines pairing the same events, and no faster (measured on cached traces of 0.1K-38K
  events: 0-0.6 s either way, the int64 columns costing what the loop saves);
- the rule on a free differs: the replay subtracts the size its alloc had (the event's own
  only when unmatched), this sweep the free event's own ``bytes``. Every trace the project
  writes has equal sizes on both (the recorder copies the alloc's; memo_ext.estimate's
  LinearTrace and SymbolicTrace size both by lines fitted to equal sizes), so the figures agree
  (checked: same peaks, peak index and final bytes), but a hand-edited trace would not.

Same ordering (list order) and peak definition (strictly above the previous peak, from 0; the
first event reaching it; -1 when none) as the replay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from memo_ext.trace.format import (
    BACKWARD,
    CATEGORIES,
    FORWARD,
    INIT,
    POOL_DEVICE,
    POOL_HOST,
    RECOMPUTE,
    Trace,
)

@dataclass
class TraceSummary:
    """What a trace says, in bytes. "Peak" counts device memory: pools "device" and "external"."""

    num_events: int
    num_allocs: int
    num_frees: int
    peak_bytes: int  # device + external
    peak_event: int  # index of the first event reaching peak_bytes
    peak_allocator_bytes: int  # pool "device" only: what a caching-allocator model must hold
    peak_by_category: dict[str, int]  # device+external bytes per category at peak_event
    category_peaks: dict[str, int]  # each category's own maximum (device+external)
    persistent_by_category: dict[str, int]  # init-phase allocations, device+external
    host_peak_bytes: int
    final_live_bytes: int
    iteration_leftover_bytes: int  # allocated in forward/recompute/backward, alive at the end
    layer_forward_skeletal_bytes: dict[int, int]  # micro-batch 0, alive when backward starts
    layer_forward_peak_bytes: dict[int, int]  # micro-batch 0: max live above the layer's start

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize(trace: Trace) -> TraceSummary:
    """Replay ``trace`` once and report peaks, categories and per-layer forward figures."""
    events = trace.events
    live: dict[int, dict] = {}
    device = {c: 0 for c in CATEGORIES}
    total = allocator = host = 0
    peak = peak_allocator = host_peak = 0
    peak_event = -1
    peak_by_category = dict(device)
    category_peaks = dict(device)
    persistent = {c: 0 for c in CATEGORIES}
    backward_start = next((i for i, e in enumerate(events)
                           if e["phase"] in (BACKWARD, RECOMPUTE)), len(events))
    skeletal_live: Optional[dict] = None
    layer_start: dict[int, int] = {}
    layer_peak: dict[int, int] = {}
    num_allocs = num_frees = 0
    for index, event in enumerate(events):
        if index == backward_start:
            skeletal_live = dict(live)
        sign = 1
        if event["action"] == "alloc":
            num_allocs += 1
            live[event["id"]] = event
        else:
            num_frees += 1
            sign = -1
            live.pop(event["id"], None)
        nbytes = sign * event["bytes"]
        if event["pool"] == POOL_HOST:
            host += nbytes
            host_peak = max(host_peak, host)
            continue
        if event["action"] == "alloc" and event["phase"] == INIT:
            persistent[event["category"]] += event["bytes"]
        device[event["category"]] += nbytes
        total += nbytes
        if event["pool"] == POOL_DEVICE:
            allocator += nbytes
            peak_allocator = max(peak_allocator, allocator)
        category_peaks[event["category"]] = max(category_peaks[event["category"]],
                                                device[event["category"]])
        if total > peak:
            peak, peak_event, peak_by_category = total, index, dict(device)
        layer = event["layer"]
        if (event["phase"] == FORWARD and layer is not None and event["microbatch"] in (0, None)
                and index < backward_start):
            if layer not in layer_start:
                layer_start[layer] = total - nbytes
            layer_peak[layer] = max(layer_peak.get(layer, 0), total - layer_start[layer])
    if skeletal_live is None:
        skeletal_live = dict(live)
    leftover = sum(e["bytes"] for e in live.values()
                   if e["phase"] in (FORWARD, RECOMPUTE, BACKWARD) and e["pool"] != POOL_HOST)
    skeletal: dict[int, int] = {}
    for event in skeletal_live.values():
        if (event["phase"] == FORWARD and event["layer"] is not None
                and event["microbatch"] in (0, None) and event["pool"] != POOL_HOST):
            skeletal[event["layer"]] = skeletal.get(event["layer"], 0) + event["bytes"]
    return TraceSummary(
        num_events=len(events), num_allocs=num_allocs, num_frees=num_frees, peak_bytes=peak,
        peak_event=peak_event, peak_allocator_bytes=peak_allocator,
        peak_by_category=peak_by_category, category_peaks=category_peaks,
        persistent_by_category=persistent, host_peak_bytes=host_peak, final_live_bytes=total,
        iteration_leftover_bytes=leftover,
        layer_forward_skeletal_bytes=dict(sorted(skeletal.items())),
        layer_forward_peak_bytes=dict(sorted(layer_peak.items())))


def skeletal_formula_bytes(micro_batch_size: int, seq_length: int, hidden_size: int,
                           tensor_parallel_size: int, context_parallel_size: int,
                           element_bytes: int = 2) -> int:
    """The skeletal activations (docs/memo.md "Skeletal activations") of one pre-LN GPT layer per
    rank with flash attention and sequence parallelism: 16·b·s·h / (TP·CP) elements of
    ``element_bytes`` each."""
    return (16 * micro_batch_size * seq_length * hidden_size * element_bytes
            // (tensor_parallel_size * context_parallel_size))
