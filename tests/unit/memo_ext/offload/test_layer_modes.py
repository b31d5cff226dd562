"""The checkpoint-offload solver (memo_ext.offload.modes): its answer always fits host memory,
no (count, alpha) on a fine grid that fits recomputes less, and the layers it picks are spread."""

from __future__ import annotations

import random

import pytest

from memo_ext.offload.alpha import AlphaInputs
from memo_ext.offload.modes import (
    checkpoint_layer_indices,
    fewest_checkpoint_layers,
    host_bytes_needed,
    position_wise_share,
    solve_layer_modes,
)

GB = 10**9
UNIT = 1 << 20


def _inputs(rng: random.Random) -> AlphaInputs:
    s_in = rng.randint(1, 8) * UNIT
    return AlphaInputs(input_bytes=s_in, attention_output_bytes=2 * s_in + rng.randint(0, UNIT),
                       other_bytes=rng.randint(2, 16) * s_in,
                       bandwidth_bytes_per_s=rng.uniform(1, 30) * GB,
                       layer_forward_s=rng.uniform(1e-4, 5e-2),
                       host_memory_bytes=rng.randint(1, 400) * UNIT,
                       offloaded_layers=rng.randint(1, 12),
                       microbatches_in_flight=rng.randint(1, 3),
                       page_locked=rng.random() < 0.5)


def _cost(inputs, count, alpha, share):
    return count + (inputs.offloaded_layers - count) * (1 - alpha) * share


def test_answer_fits_and_no_grid_point_recomputes_less():
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        inputs = _inputs(rng)
        share = rng.uniform(0.05, 1.0)
        modes = solve_layer_modes(inputs, inputs.input_bytes, share)
        if fewest_checkpoint_layers(inputs, inputs.input_bytes) is None:
            assert modes.host_bytes_needed > inputs.host_memory_bytes
            continue
        checked += 1
        assert modes.host_bytes_needed <= inputs.host_memory_bytes
        assert modes.host_bytes_needed == host_bytes_needed(
            inputs, modes.checkpoint_layers, inputs.input_bytes, modes.alpha.alpha)
        # the alpha layers' copies hide under their forward (the LP's bandwidth row)
        copy = inputs.whole_bytes + modes.alpha.alpha * inputs.other_bytes
        assert modes.alpha.alpha == 0 or \
            copy <= inputs.bandwidth_bytes_per_s * inputs.layer_forward_s * (1 + 1e-9)
        for count in range(inputs.offloaded_layers + 1):
            for step in range(101):
                alpha = step / 100
                copy = inputs.whole_bytes + alpha * inputs.other_bytes
                if alpha and copy > inputs.bandwidth_bytes_per_s * inputs.layer_forward_s:
                    continue
                if host_bytes_needed(inputs, count, inputs.input_bytes, alpha) \
                        > inputs.host_memory_bytes:
                    continue
                assert modes.recomputed_layer_forwards <= _cost(inputs, count, alpha, share) \
                    + 1e-9
    assert checked > 100


def test_attention_bound_layers_take_checkpoints_only_where_host_needs_them():
    """f = 0 (core attention is all of a layer, as at millions of tokens): a checkpoint layer
    costs a whole forward and an alpha layer nothing, so the fewest that fit are taken."""
    rng = random.Random(3)
    for _ in range(100):
        inputs = _inputs(rng)
        fewest = fewest_checkpoint_layers(inputs, inputs.input_bytes)
        if fewest is not None:
            assert solve_layer_modes(inputs, inputs.input_bytes, 0.0).checkpoint_layers == fewest


def test_fixed_count_and_alpha_are_kept():
    inputs = _inputs(random.Random(1))
    modes = solve_layer_modes(inputs, inputs.input_bytes, 0.5, fixed_count=1, fixed_alpha=0.0)
    assert modes.checkpoint_layers == 1 and modes.alpha.alpha == 0.0


@pytest.mark.parametrize("layers,count,expected", [
    (4, 0, set()), (4, 1, {2}), (4, 2, {1, 3}), (4, 4, {0, 1, 2, 3}), (30, 3, {5, 15, 25})])
def test_checkpoint_layers_are_spread(layers, count, expected):
    assert checkpoint_layer_indices(layers, count) == expected


def test_position_wise_share_falls_with_length():
    """A 7B layer (linear 2*12*h^2 per token, attention 4*h per key): half the forward is
    core attention at 12h = 48K tokens, over 95% of it at 1M."""
    hidden = 4096
    linear, attention = 2.0 * 12 * hidden * hidden, 4.0 * hidden
    assert position_wise_share(linear, attention, 12 * hidden) == pytest.approx(0.5)
    assert position_wise_share(linear, attention, 1 << 20) < 0.05
