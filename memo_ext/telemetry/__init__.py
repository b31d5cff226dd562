"""Memory telemetry.

Entry points:

- :class:`MemoryTelemetry`: the trainer's per-step, per-rank memory telemetry (lines with
  max/mean/skew over ranks every log interval, fail-fast near capacity, OOM reports and
  snapshots); configured by memo_ext.config.TelemetryConfig (docs/telemetry.md).
- :class:`DeviceMemoryTracker`: a dispatch mode that measures the "device" (and host-arena)
  bytes of the CPU stand-in, with an optional simulated capacity;
  :class:`AttributedTracker` adds categories and phase/layer/micro-batch context.
"""

from memo_ext.telemetry.attribution import CATEGORIES, AttributedTracker, MemoryContext
from memo_ext.telemetry.monitor import (
    MEMORY_EXIT_STATUS,
    GatheredMemory,
    MemoryBudgetExceeded,
    MemoryTelemetry,
    RankSample,
    format_line,
)
from memo_ext.telemetry.tracker import DeviceMemoryTracker, SimulatedOutOfMemoryError

__all__ = ["CATEGORIES", "MEMORY_EXIT_STATUS", "AttributedTracker", "DeviceMemoryTracker",
           "GatheredMemory", "MemoryBudgetExceeded", "MemoryContext", "MemoryTelemetry",
           "RankSample", "SimulatedOutOfMemoryError", "format_line"]
