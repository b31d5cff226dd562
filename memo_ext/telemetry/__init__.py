"""Memory telemetry. Entry point: :class:`DeviceMemoryTracker`, a dispatch mode that measures the
"device" (and host-arena) bytes of the CPU stand-in, with an optional simulated capacity."""

from memo_ext.telemetry.tracker import DeviceMemoryTracker, SimulatedOutOfMemoryError

__all__ = ["DeviceMemoryTracker", "SimulatedOutOfMemoryError"]
