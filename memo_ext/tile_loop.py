"""Loops over equal tiles (the tiled MLP's and projections' sequence tiles, the attention's head
chunks, the steps of a context-parallel ring whose later steps attend alike tiles, the chunked
loss's sequence chunks), whose middle iterations the tracer may stand in for.

A loop over ``count`` tiles asks :func:`tile_indices` which iterations to run. In training
that is every one. While the tracer records a model on fake tensors
(megatron/training/tracing.py), a repeater installed with :func:`repeated_by` may run the first
three and the last and record the iterations between as copies of the third
(memo_ext.trace.recorder.AllocationRecorder.repeat_tiles): the middle tiles run the same code on
tensors of the same shapes, so they request the same blocks, and a trace of 16 MLP tiles costs
what four cost. The tiles the loop skips compute nothing, so a repeater is for fake tensors
only: the tiles' outputs are left unwritten.

Hand-written: it is the seam between the mechanisms' loops and the tracer, which they must not
import (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional

#: A repeater: ``count`` -> the indices of the iterations to run, in order.
Repeater = Callable[[int], Iterable[int]]

_repeater: Optional[Repeater] = None


def tile_indices(count: int) -> Iterable[int]:
    """The iterations a loop over ``count`` equal tiles runs, in order: all of them, unless a
    repeater is installed (:func:`repeated_by`)."""
    return range(count) if _repeater is None else _repeater(count)


@contextlib.contextmanager
def repeated_by(repeater: Repeater) -> Iterator[None]:
    """Tile loops started in this block ask ``repeater`` which iterations to run."""
    global _repeater
    previous, _repeater = _repeater, repeater
    try:
        yield
    finally:
        _repeater = previous
