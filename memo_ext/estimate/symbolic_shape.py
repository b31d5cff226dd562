"""The few-layer stage a symbolic trace is made from, for a MEMO stage mixing (a) and (b) layers.

The trainer spreads a stage's ``count`` checkpoint-mode (b) layers evenly over its ``offloaded``
layers (memo_ext.offload.modes.checkpoint_layer_indices: the middle of each of ``count`` equal
runs), so the modes repeat: 16 of 31 is ``b a b a ... b``, 8 of 31 ``a b a a`` seven times
and ``a b a``. A stage of a few layers with the same pattern, whose one period is copied to the
stage's depth (memo_ext.estimate.symbolic.expand_events with ``period``), stands for the whole
stage, and is checked against a stage one period deeper, as a one-layer copy is.

The few-layer stage is the trainer's own rule at a smaller count: ``--num-layers`` and
``--memo-checkpoint-layers`` chosen so that the same even spread gives the same pattern, no
per-layer flag. Patterns that no stage of at most MAX_FEW_LAYERS layers repeats are traced
whole.

Hand-written: the pattern search is specific to the trainer's spreading rule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from memo_ext.offload.modes import checkpoint_layer_indices

#: The deepest few-layer stage tried (tracing costs grow with its layers).
MAX_FEW_LAYERS = 12
#: The longest run of layers copied. Two and four are checked
#: (tests/unit/memo_ext/estimate/test_symbolic.py); a run of four (8 of 31 layers in (b):
#: a b a a) is followed by a whole period in the few-layer stage (mixed_symbolic_shape).
MAX_PERIOD = 4
#: Layers each side of the copied run, in the few-layer stage (MEMO's warm-up leaves per-layer
#: buffers a shorter neighbourhood does not repeat: memo_ext.estimate.layout.SYMBOLIC_LAYERS).
NEIGHBOURS = 2


@dataclass(frozen=True)
class SymbolicShape:
    """A stage traced with ``layers`` layers per stage, ``period`` layers from ``copied`` copied
    to the stage's depth, and checked against ``check_layers`` layers. ``checkpoint_layers``
    and ``check_checkpoint_layers``: the (b) layers of those two stages (None: the layout's
    own flag)."""

    layers: int
    copied: int
    period: int = 1
    checkpoint_layers: Optional[int] = None
    check_layers: int = 0
    check_checkpoint_layers: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.check_layers:  # a copied layer is checked with two layers more
            object.__setattr__(self, "check_layers", self.layers + 2)


def _modes(offloaded: int, count: int, kept: int) -> list[bool]:
    """Whether each layer of a stage is in (b): the offloaded layers' spread, then the kept
    layers (in (a): the trainer keeps them on the device)."""
    chosen = checkpoint_layer_indices(offloaded, count)
    return [layer in chosen for layer in range(offloaded)] + [False] * kept


@functools.lru_cache(maxsize=None)
def mixed_symbolic_shape(offloaded: int, count: int, kept: int) -> Optional[SymbolicShape]:
    """The smallest few-layer stage, with ``kept`` layers kept as the stage keeps them, whose
    (b) pattern with one period repeated is the pattern of ``count`` (b) layers among
    ``offloaded``; and the check's stage, one period deeper (at least two layers), whose
    pattern is the same repetition. None when there is none (the stage is traced whole)."""
    target = _modes(offloaded, count, kept)
    for layers in range(2 * NEIGHBOURS + 1 + kept, MAX_FEW_LAYERS + 1):
        few = layers - kept
        for period in range(1, min(MAX_PERIOD, layers - 2 * NEIGHBOURS) + 1):
            added = offloaded - few
            if added <= 0 or added % period:
                continue
            # one period more, twice for a one-layer run (a check with two layers more)
            check_periods = -(-2 // period)
            for few_count in range(1, few):
                pattern = _modes(few, few_count, kept)
                # After the run, NEIGHBOURS layers; a run longer than that is followed by
                # one whole period of offloaded layers too: a run's last layer frees what the
                # next layer allocated, which in the stage is the next copy's first layer, so
                # the layer after the run must be traced as one (four layers of 8 of 31 in
                # (b), a b a a, followed by the kept layer alone freed a block twice).
                after = max(NEIGHBOURS, period + kept) if period > NEIGHBOURS else NEIGHBOURS
                for copied in range(NEIGHBOURS, layers - after - period + 1):
                    run = pattern[copied:copied + period]
                    head, tail = pattern[:copied + period], pattern[copied + period:]
                    if head + run * (added // period) + tail != target:
                        continue
                    check_count = few_count + check_periods * sum(run)
                    check_few = few + check_periods * period
                    if _modes(check_few, check_count, kept) != head + run * check_periods + tail:
                        continue
                    return SymbolicShape(layers, copied, period, few_count,
                                         layers + check_periods * period, check_count)
    return None
