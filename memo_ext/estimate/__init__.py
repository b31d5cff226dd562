"""Memory estimator: predicted per-rank device memory, fit/OOM and the longest sequence that
fits, from allocation traces replayed through the allocator models (memo_ext.alloc).

Entry points: :func:`linear_trace` (two traces of a rank, any sequence length from them),
:func:`estimate_at` (one length through one allocator model), :func:`max_sequence_length`,
:func:`load_hardware` (GPU profiles in hardware.json). ``tools/estimate.py`` is the command.
The time side (cost model, MFU) is not built yet.
"""

from memo_ext.estimate.memory import (
    EstimateError,
    LinearTrace,
    MemoryEstimate,
    estimate_at,
    external_bytes,
    linear_trace,
    load_hardware,
    longest_fitting,
    max_sequence_length,
    trace_rank,
)

__all__ = ["EstimateError", "LinearTrace", "MemoryEstimate", "estimate_at", "external_bytes",
           "linear_trace", "load_hardware", "longest_fitting", "max_sequence_length",
           "trace_rank"]
