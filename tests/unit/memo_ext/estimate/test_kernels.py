"""memo_ext.estimate.kernels: efficiencies read from kernel tables at a model's shapes."""

from __future__ import annotations

import json
import math

import pytest

from memo_ext.estimate import load_hardware
from memo_ext.estimate.cost import CostModelError, Efficiency
from memo_ext.estimate.kernels import (
    TABLES_FILE,
    at_model_shapes,
    attention_tflops,
    gemm_tflops,
    kernel_rows,
    model_gemms,
)

ATTENTION = [{"direction": "forward", "causal": True, "head_dim": 128, "seq_len": 1024,
              "tflops": 100.0},
             {"direction": "forward", "causal": True, "head_dim": 128, "seq_len": 4096,
              "tflops": 160.0},
             {"direction": "forward", "causal": False, "head_dim": 128, "seq_len": 4096,
              "tflops": 190.0},
             {"direction": "forward", "causal": True, "head_dim": 64, "seq_len": 4096,
              "tflops": 120.0},
             {"direction": "backward", "causal": True, "head_dim": 128, "seq_len": 4096,
              "tflops": 130.0}]
GEMM = [{"m": 4096, "n": 4096, "k": 4096, "tflops": 200.0},
        {"m": 16384, "n": 4096, "k": 4096, "tflops": 250.0},
        {"m": 16384, "n": 1024, "k": 4096, "tflops": 150.0}]


def test_attention_interpolates_in_log_length_and_holds_flat_beyond_the_table():
    assert attention_tflops(ATTENTION, "forward", True, 128, 2048) == pytest.approx(130.0)
    assert attention_tflops(ATTENTION, "forward", True, 128, 256) == 100.0
    assert attention_tflops(ATTENTION, "forward", True, 128, 1 << 20) == 160.0
    assert attention_tflops(ATTENTION, "forward", False, 128, 1 << 20) == 190.0
    assert attention_tflops(ATTENTION, "forward", True, 80, 4096) == 120.0  # 64 is nearer
    assert attention_tflops(ATTENTION, "backward", True, 128, 4096) == 130.0
    with pytest.raises(CostModelError, match="no backward .or forward_backward. attention"):
        attention_tflops(ATTENTION[:1], "backward", True, 128, 4096)
    summed = [{**ATTENTION[1], "direction": "forward_backward", "tflops": 150.0}]
    assert attention_tflops(summed, "backward", True, 128, 4096) == 150.0


def test_gemm_takes_the_nearest_shape_with_the_token_count_clamped():
    assert gemm_tflops(GEMM, 1 << 20, 4096, 4096) == 250.0  # beyond the largest m
    assert gemm_tflops(GEMM, 4096, 4096, 4096) == 200.0
    assert gemm_tflops(GEMM, 1 << 20, 1536, 4096) == 150.0


def test_model_efficiency_is_the_flop_weighted_harmonic_mean_of_its_gemms():
    hardware = {"name": "toy", "bf16_tflops": 300.0,
                "kernels": {"gemm": GEMM, "attention": ATTENTION}}
    model = {"num_layers": 4, "hidden_size": 4096, "ffn_hidden_size": 16384,
             "num_attention_heads": 32, "vocab_size": 50257, "seq_length": 65536}
    layout = {"tp": 4, "cp": 2, "pp": 1}
    base = Efficiency(memory=0.7, collective=0.75, pcie=0.4, reorganisation_s=2.0)
    efficiency = at_model_shapes(base, hardware, model, layout)
    gemms = model_gemms(model, layout)
    assert gemms[0] == (32768, 3 * 4096 // 4, 4096, 4)
    flops = sum(2 * m * n * k * c for m, n, k, c in gemms)
    seconds = sum(2 * m * n * k * c / gemm_tflops(GEMM, m, n, k) for m, n, k, c in gemms)
    assert efficiency.gemm == pytest.approx(flops / seconds / 300.0)
    assert efficiency.attention_forward == pytest.approx(160.0 / 300.0)
    assert efficiency.attention_backward == pytest.approx(130.0 / 300.0)
    assert efficiency.memory == 0.7


def test_a_profile_without_kernel_rows_is_refused_in_one_line():
    with pytest.raises(CostModelError, match='add "kernel_table"'):
        kernel_rows({"name": "mine", "bf16_tflops": 100})
    assert math.isnan(Efficiency.from_profile(load_hardware("a800")).gemm)


def test_every_gpu_profile_reads_published_rows_that_cite_their_source():
    tables = json.loads(TABLES_FILE.read_text())
    for kind in ("gemm", "attention"):
        assert tables[kind]
        assert all(row["source"] in tables["sources"] for row in tables[kind])
    profiles = json.loads((TABLES_FILE.parent / "hardware.json").read_text())
    for name in profiles:
        if name in ("_comment", "efficiency"):
            continue
        rows = kernel_rows(load_hardware(name))
        assert rows["gemm"] and rows["attention"], name
        for direction in ("forward", "backward"):
            assert attention_tflops(rows["attention"], direction, True, 128, 1 << 20) > 0
