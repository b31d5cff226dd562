"""Memory estimator: predicted per-rank device memory, fit/OOM and the longest sequence that
fits, from allocation traces replayed through the allocator models (memo_ext.alloc).

Entry points: :class:`LinearTrace` (two traces of a rank, any sequence length from them),
:func:`estimate_at` (one length through one allocator model), :func:`max_sequence_length`,
:func:`load_hardware` (GPU profiles in hardware.json). The time side is
:mod:`memo_ext.estimate.cost`, whole layouts (every traced pipeline stage, memory and time) and
the recommender's search :mod:`memo_ext.estimate.layout`, SPPO's rows
:mod:`memo_ext.estimate.sppo_layouts`, MFU's model FLOPs (the trainer's log uses them too)
:mod:`memo_ext.estimate.flops`. ``tools/estimate.py`` is the command.
"""

from memo_ext.estimate.memory import (
    EstimateError,
    LinearTrace,
    MemoryEstimate,
    estimate_at,
    external_bytes,
    load_hardware,
    longest_fitting,
    max_sequence_length,
)

__all__ = ["EstimateError", "LinearTrace", "MemoryEstimate", "estimate_at", "external_bytes",
           "load_hardware", "longest_fitting", "max_sequence_length"]
