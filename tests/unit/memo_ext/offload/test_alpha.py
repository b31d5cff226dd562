"""MEMO's alpha LP: closed form vs HiGHS, page-locked slots' page rounding, shortfall, 1F1B k."""

from __future__ import annotations

import dataclasses
import random

import pytest

from memo_ext.host_pages import HOST_PAGE_BYTES, page_locked_bytes
from memo_ext.offload.alpha import (
    AlphaInputs,
    default_host_memory_bytes,
    format_alpha_log,
    host_memory_shortfall,
    microbatches_in_flight,
    offloaded_layers,
    solve_alpha,
    solve_alpha_lp,
)

MB = 10**6
GB = 10**9


def _inputs(**overrides) -> AlphaInputs:
    """7B-like layer on TP=8 at 128K tokens: S_in = S_attn = b*s*h*2/8 bytes, S_oth = 12x that."""
    unit = 128 * 1024 * 4096 * 2 // 8
    values = dict(input_bytes=unit, attention_output_bytes=unit, other_bytes=12 * unit,
                  bandwidth_bytes_per_s=12 * GB, layer_forward_s=0.5, host_memory_bytes=200 * GB,
                  offloaded_layers=30, microbatches_in_flight=1, page_locked=False)
    values.update(overrides)
    return AlphaInputs(**values)


def test_page_locked_bytes_are_whole_pages():
    assert HOST_PAGE_BYTES == 4096
    assert [page_locked_bytes(n) for n in (0, 1, 4095, 4096, 4097, 3 * 4096 + 5)] == \
        [0, 4096, 4096, 4096, 8192, 4 * 4096]
    # a 4M-token slot of 8 GiB + 64 MiB costs its own bytes, not a 16 GiB block
    assert page_locked_bytes(8 * 2**30 + 64 * 2**20) == 8 * 2**30 + 64 * 2**20
    with pytest.raises(ValueError):
        page_locked_bytes(-1)


def test_closed_form_matches_highs_on_random_inputs():
    rng = random.Random(1234)
    checked = {"bandwidth": 0, "host_memory": 0, "device_memory": 0, "none": 0}
    for _ in range(120):
        inputs = AlphaInputs(
            input_bytes=rng.randint(10 * MB, 2 * GB),
            attention_output_bytes=rng.randint(10 * MB, 2 * GB),
            other_bytes=rng.randint(50 * MB, 20 * GB),
            bandwidth_bytes_per_s=rng.uniform(2, 30) * GB,
            layer_forward_s=rng.uniform(0.01, 2.0),
            host_memory_bytes=rng.randint(1 * GB, 2000 * GB),
            offloaded_layers=rng.randint(0, 80),
            microbatches_in_flight=rng.randint(1, 8),
            page_locked=False,
            interior_extra_bytes=rng.choice((0, rng.randint(10 * MB, 2 * GB))),
            device_headroom_bytes=rng.choice((None, rng.randint(0, 40 * GB))),
        )
        decision = solve_alpha(inputs)
        assert solve_alpha_lp(inputs) == pytest.approx(decision.alpha, abs=1e-6)
        assert 0.0 <= decision.alpha <= 1.0
        if decision.fits_host_memory:
            assert inputs.fits_host(decision.alpha)
        checked[decision.limited_by] += 1
    assert all(count > 0 for count in checked.values()), checked


def test_bandwidth_bound_case():
    inputs = _inputs(layer_forward_s=0.05, host_memory_bytes=10**13)
    decision = solve_alpha(inputs)
    expected = (12 * GB * 0.05 - inputs.whole_bytes) / inputs.other_bytes
    assert decision.limited_by == "bandwidth"
    assert decision.alpha == pytest.approx(expected, rel=1e-12)
    assert 0 < decision.alpha < 1
    assert decision.host_memory_bound > decision.bandwidth_bound
    assert decision.host_bytes_needed == 30 * inputs.slot_bytes(decision.alpha)


def test_memory_bound_case():
    inputs = _inputs(layer_forward_s=10.0, host_memory_bytes=40 * GB)
    decision = solve_alpha(inputs)
    expected = (40 * GB // 30 - inputs.whole_bytes) / inputs.other_bytes
    assert decision.limited_by == "host_memory"
    assert decision.alpha == pytest.approx(expected, rel=1e-9)
    assert 0 < decision.alpha < 1
    assert decision.host_bytes_needed <= 40 * GB
    assert decision.host_bytes_missing_at_alpha0 == 0


def test_alpha_is_clipped_to_unit_interval():
    high = solve_alpha(_inputs(layer_forward_s=100.0, host_memory_bytes=10**14))
    assert high.alpha == 1.0 and high.limited_by == "none"
    assert high.bandwidth_bound > 1 and high.host_memory_bound > 1
    low = solve_alpha(_inputs(layer_forward_s=1e-4))
    assert low.alpha == 0.0 and low.limited_by == "bandwidth" and low.bandwidth_bound < 0
    assert solve_alpha_lp(_inputs(layer_forward_s=1e-4)) == 0.0


def test_no_offloaded_layers_means_no_host_constraint():
    decision = solve_alpha(_inputs(offloaded_layers=0, host_memory_bytes=0, layer_forward_s=100.0))
    assert decision.alpha == 1.0 and decision.host_bytes_needed == 0
    assert decision.host_bytes_missing_at_alpha0 == 0
    assert offloaded_layers(2) == 0 and offloaded_layers(1) == 0 and offloaded_layers(32) == 30


def test_zero_other_bytes():
    fits = solve_alpha(_inputs(other_bytes=0, layer_forward_s=100.0))
    assert fits.alpha == 1.0
    short = solve_alpha(_inputs(other_bytes=0, host_memory_bytes=1 * GB))
    assert short.alpha == 0.0 and short.limited_by == "host_memory"
    assert short.host_bytes_missing_at_alpha0 > 0


def test_page_rounding_is_respected_exactly():
    rng = random.Random(7)
    for _ in range(300):
        inputs = AlphaInputs(
            input_bytes=rng.randint(0, 5 * MB), attention_output_bytes=rng.randint(0, 5 * MB),
            other_bytes=rng.randint(1, 60 * MB), bandwidth_bytes_per_s=1e12, layer_forward_s=1.0,
            host_memory_bytes=rng.randint(1, 4 * GB), offloaded_layers=rng.randint(1, 40),
            microbatches_in_flight=rng.randint(1, 4), page_locked=True)
        decision = solve_alpha(inputs)
        if not decision.fits_host_memory:
            assert decision.alpha == 0.0
            continue
        slot = inputs.slot_bytes(decision.alpha)
        assert inputs.host_slots * page_locked_bytes(slot) <= inputs.host_memory_bytes
        assert decision.host_bytes_needed == inputs.host_slots * page_locked_bytes(slot)
        if decision.alpha < 1.0:
            # Maximal: a slot reaching into one more page would not fit.
            assert inputs.host_slots * page_locked_bytes(page_locked_bytes(slot) + 1) \
                > inputs.host_memory_bytes


def test_page_rounding_costs_less_than_a_page_per_slot():
    # Per-slot budget 1.5 GB + 100 B: the plain count fills it to the byte, page rounding to
    # the last whole page below it (a power-of-two count would have stopped at 2**30).
    budget = 1500 * MB + 100
    plain = _inputs(host_memory_bytes=30 * budget, layer_forward_s=100.0)
    rounded = dataclasses.replace(plain, page_locked=True)
    a_plain, a_rounded = solve_alpha(plain).alpha, solve_alpha(rounded).alpha
    assert a_rounded < a_plain
    assert plain.slot_bytes(a_plain) == budget
    assert budget - HOST_PAGE_BYTES < rounded.slot_bytes(a_rounded) <= budget - budget % 4096
    assert solve_alpha(rounded).limited_by == "host_memory"


def test_shortfall_at_alpha0():
    inputs = _inputs(host_memory_bytes=1 * GB)
    need0 = 30 * inputs.whole_bytes
    assert host_memory_shortfall(inputs) == need0 - 1 * GB
    decision = solve_alpha(inputs)
    assert decision.alpha == 0.0 and not decision.fits_host_memory
    assert decision.limited_by == "host_memory"
    assert decision.host_bytes_missing_at_alpha0 == need0 - 1 * GB
    assert "fall back to recomputation" in format_alpha_log(inputs, decision)
    rounded = dataclasses.replace(inputs, page_locked=True)
    assert host_memory_shortfall(rounded) == 30 * page_locked_bytes(inputs.whole_bytes) - 1 * GB
    assert host_memory_shortfall(_inputs()) == 0


def test_microbatches_in_flight():
    assert microbatches_in_flight(0, 1, 8) == 1
    assert [microbatches_in_flight(p, 4, 8) for p in range(4)] == [4, 3, 2, 1]
    assert [microbatches_in_flight(p, 4, 2) for p in range(4)] == [2, 2, 2, 1]
    for bad in ((4, 4, 8), (-1, 4, 8), (0, 0, 8), (0, 4, 0)):
        with pytest.raises(ValueError):
            microbatches_in_flight(*bad)


def test_microbatches_multiply_host_need():
    one = solve_alpha(_inputs(host_memory_bytes=40 * GB, layer_forward_s=10.0))
    four = solve_alpha(_inputs(host_memory_bytes=40 * GB, layer_forward_s=10.0,
                               microbatches_in_flight=4))
    assert four.alpha < one.alpha


def test_invalid_inputs():
    with pytest.raises(ValueError, match="offloaded_layers"):
        _inputs(offloaded_layers=-1)
    with pytest.raises(ValueError, match="bandwidth"):
        _inputs(bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="microbatches_in_flight"):
        _inputs(microbatches_in_flight=0)


def test_format_alpha_log_is_one_line_with_all_inputs():
    inputs = _inputs(layer_forward_s=0.05)
    line = format_alpha_log(inputs, solve_alpha(inputs))
    assert "\n" not in line
    for fragment in ("alpha=", "limited by bandwidth", "S_in 0.134 GB", "S_oth 1.611 GB",
                     "B 12.00 GB/s", "T_layer 50.00 ms", "host 200.000 GB", "30 layers",
                     "1 micro-batches", "slots at their bytes"):
        assert fragment in line, (fragment, line)


def test_default_host_memory_bytes():
    one = default_host_memory_bytes(1)
    assert one > 0
    assert default_host_memory_bytes(8) <= one // 8 + one // 100  # available memory drifts
    with pytest.raises(ValueError):
        default_host_memory_bytes(0)


def test_device_budget_caps_alpha_and_matches_the_lp():
    """The budget covers both rounding buffers and one layer's working set at alpha 0
    (2W + S), and each unit of alpha grows both buffers: 2W + S + 2aS <= M_dev."""
    from memo_ext.offload.alpha import AlphaInputs, solve_alpha, solve_alpha_lp

    inputs = AlphaInputs(input_bytes=100, attention_output_bytes=200, other_bytes=1000,
                         bandwidth_bytes_per_s=1e12, layer_forward_s=1.0, host_memory_bytes=10**9,
                         offloaded_layers=4, microbatches_in_flight=1, page_locked=False,
                         device_memory_bytes=2 * 300 + 1000 + 500)
    decision = solve_alpha(inputs)
    assert decision.alpha == pytest.approx(0.25)
    assert decision.limited_by == "device_memory"
    assert solve_alpha_lp(inputs) == pytest.approx(0.25, abs=1e-6)


def test_measured_device_headroom_caps_alpha_and_matches_the_lp():
    """Raising alpha grows both rounding buffers by alpha*S; the device peak grows by up to
    2*alpha*S over the alpha-0 peak, so alpha <= D_free / (2S)."""
    from memo_ext.offload.alpha import AlphaInputs, format_alpha_log, solve_alpha, solve_alpha_lp

    base = dict(input_bytes=100, attention_output_bytes=200, other_bytes=1000,
                bandwidth_bytes_per_s=1e12, layer_forward_s=1.0, host_memory_bytes=10**9,
                offloaded_layers=4, microbatches_in_flight=1, page_locked=False)
    inputs = AlphaInputs(**base, device_headroom_bytes=800)
    decision = solve_alpha(inputs)
    assert decision.alpha == pytest.approx(0.4)
    assert decision.limited_by == "device_memory"
    assert solve_alpha_lp(inputs) == pytest.approx(0.4, abs=1e-6)
    assert "0.000 GB free at the alpha=0 peak" in format_alpha_log(inputs, decision)
    # No headroom at all (or a peak already past the capacity): recompute everything.
    assert solve_alpha(AlphaInputs(**base, device_headroom_bytes=-5)).alpha == 0.0
    # Plenty of headroom: the paper's LP decides (here nothing binds).
    assert solve_alpha(AlphaInputs(**base, device_headroom_bytes=10**6)).alpha == 1.0
    # An explicit --memo-device-memory-gb budget replaces the measured headroom.
    explicit = AlphaInputs(**base, device_headroom_bytes=800,
                           device_memory_bytes=2 * 300 + 1000 + 500)
    assert solve_alpha(explicit).alpha == pytest.approx(0.25)
    assert "--memo-device-memory-gb" in format_alpha_log(explicit, solve_alpha(explicit))


def test_device_row_counts_the_interior_extra_in_each_buffer():
    """Under sequence parallelism a slot at 0 < alpha < 1 also stores the attention output
    again (X); each rounding buffer holds a whole slot, so the peak grows by 2*(X + alpha*S)."""
    base = dict(input_bytes=100, attention_output_bytes=200, other_bytes=1000,
                bandwidth_bytes_per_s=1e12, layer_forward_s=1.0, host_memory_bytes=10**9,
                offloaded_layers=4, microbatches_in_flight=1, page_locked=False,
                interior_extra_bytes=50)
    measured = AlphaInputs(**base, device_headroom_bytes=900)
    assert solve_alpha(measured).alpha == pytest.approx(0.4)
    assert solve_alpha_lp(measured) == pytest.approx(0.4, abs=1e-6)
    budget = AlphaInputs(**base, device_memory_bytes=2 * 300 + 1000 + 2 * 50 + 500)
    assert solve_alpha(budget).alpha == pytest.approx(0.25)
    assert solve_alpha_lp(budget) == pytest.approx(0.25, abs=1e-6)
