"""Memory telemetry.

Entry points:

- :class:`MemoryTelemetry`: the trainer's per-step, per-rank memory telemetry (lines with
  max/mean/skew over ranks every log interval, fail-fast near capacity, OOM reports and
  snapshots); configured by memo_ext.config.TelemetryConfig (docs/telemetry.md).
- :class:`AttributedTracker`: memo_ext.storage_tracker's dispatch mode that measures the
  "device" (and host-arena) bytes of the CPU stand-in, with an optional simulated capacity,
  plus categories and phase/layer/micro-batch context.
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

__all__ = ["CATEGORIES", "MEMORY_EXIT_STATUS", "AttributedTracker", "GatheredMemory",
           "MemoryBudgetExceeded", "MemoryContext", "MemoryTelemetry", "RankSample",
           "format_line"]
