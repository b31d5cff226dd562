"""memo_ext.estimate.symbolic_shape: the few-layer stage that stands for a MEMO stage mixing
(a) and (b) layers. Its pattern, with one period repeated, must be the stage's own pattern as
the trainer spreads it (memo_ext.offload.modes.checkpoint_layer_indices), and so must the
check's stage one period deeper. The traces themselves are compared in test_symbolic.py."""

from __future__ import annotations

import pytest

from memo_ext.estimate.symbolic_shape import NEIGHBOURS, mixed_symbolic_shape
from memo_ext.offload.modes import checkpoint_layer_indices


def _pattern(offloaded: int, count: int, kept: int) -> str:
    chosen = checkpoint_layer_indices(offloaded, count)
    return "".join("b" if i in chosen else "a" for i in range(offloaded)) + "k" * kept


def _expanded(shape, kept: int, layers: int) -> str:
    few = _pattern(shape.layers - kept, shape.checkpoint_layers, kept)
    head, tail = few[:shape.copied + shape.period], few[shape.copied + shape.period:]
    run = few[shape.copied:shape.copied + shape.period]
    copies, rest = divmod(layers - shape.layers, shape.period)
    assert rest == 0
    return head + run * copies + tail


@pytest.mark.parametrize("offloaded, count, kept, period", [
    (31, 16, 1, 2),  # 7B, one buffer, half in (b): b a b a ... b
    (31, 8, 1, 4),   # a quarter: a b a a, seven times, then a b a
    (30, 15, 2, 2),  # two buffers
    (79, 40, 1, 2),  # 65B
    (79, 20, 1, 4),
])
def test_the_headline_mixes_repeat_one_period(offloaded, count, kept, period):
    shape = mixed_symbolic_shape(offloaded, count, kept)
    assert shape is not None and shape.period == period
    assert _expanded(shape, kept, offloaded + kept) == _pattern(offloaded, count, kept)


def test_every_shape_found_is_the_stage_and_the_check_is_one_period_deeper():
    found = 0
    for offloaded in (7, 11, 15, 23, 31, 39):  # 8-80 layer stages' offloaded layers
        for kept in (0, 1, 2):
            for count in range(1, offloaded):
                shape = mixed_symbolic_shape(offloaded, count, kept)
                if shape is None:
                    continue
                found += 1
                assert _expanded(shape, kept, offloaded + kept) == \
                    _pattern(offloaded, count, kept), (offloaded, count, kept, shape)
                check = _pattern(shape.check_layers - kept, shape.check_checkpoint_layers, kept)
                assert _expanded(shape, kept, shape.check_layers) == check
                assert shape.check_layers - shape.layers >= 2
                # the copied run has NEIGHBOURS layers on each side in the few-layer stage
                assert shape.copied >= NEIGHBOURS
                assert shape.layers - shape.copied - shape.period >= NEIGHBOURS
                if shape.period > NEIGHBOURS:  # a whole period of offloaded layers after it
                    assert shape.layers - shape.copied - 2 * shape.period >= kept
    assert found >= 40  # many mixes repeat a short period (not a vacuous loop)


def test_a_pattern_no_few_layer_stage_repeats_is_none():
    # two buffers, 8 of 30: a b a a a b a a a b a a a b a a b ...: no one period repeats
    assert mixed_symbolic_shape(30, 8, 2) is None
    # 10 of 11 in (b): one (a) layer in the middle, nothing repeats around it
    assert _pattern(11, 10, 1) == "bbbbbabbbbbk"
    assert mixed_symbolic_shape(11, 10, 1) is None
