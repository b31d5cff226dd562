"""Allocator tooling: read real PyTorch CUDA memory snapshots and summarize them per device.

Entry point: ``summarize_snapshot(load_snapshot(path))`` (see memo_ext.alloc.snapshot).
"""
from memo_ext.alloc.snapshot import (
    DeviceSummary,
    OomEvent,
    SnapshotError,
    load_snapshot,
    summarize_snapshot,
)

__all__ = ["DeviceSummary", "OomEvent", "SnapshotError", "load_snapshot", "summarize_snapshot"]
