"""Helpers the benchmarks share (import as ``bench.common`` once the repository root is on
sys.path, as every bench script puts it)."""

from __future__ import annotations

from typing import Callable


def longest_fitting(fits: Callable[[int], bool], step: int, maximum: int) -> int:
    """Largest multiple of ``step`` <= ``maximum`` with fits(seq) (0 if none), by bisection
    (assumes fitting is monotone in the sequence length)."""
    lo, hi = 0, maximum // step + 1  # lo fits (0 trivially), hi does not (assumed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step
