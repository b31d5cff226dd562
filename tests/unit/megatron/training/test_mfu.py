"""MFU's two inputs have one source each: P and the model FLOPs (memo_ext.estimate.flops) for the
trainer's log and the estimator alike, and the GPU peak from memo_ext/hardware.json."""

from __future__ import annotations

import argparse

import pytest
import torch

from memo_ext.estimate.flops import gpt_shape, model_flops_per_sequence, parameter_count
from memo_ext.trace import read_trace

from megatron.training import metrics
from megatron.training.arguments import parse_args
from megatron.training.tokenizer import build_tokenizer

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128", "--vocab-size", "600"]  # 600: padded to 640 at TP 1, 768 at TP 2
# (extra trainer flags, the tracer's flags for the same model); the tracer defaults to rope, the
# trainer to learned positions; both tie the embeddings unless
# --untie-embeddings-and-output-weights.
CASES = {
    "swiglu_gqa_untied": (
        ["--swiglu", "--group-query-attention", "--num-query-groups", "2", "--normalization",
         "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights"],
        ["--swiglu", "--num-query-groups", "2", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]),
    "default_gpt": ([], ["--position-embedding-type", "learned_absolute"]),
}


def trainer_shape(extra: list[str]) -> dict:
    """The shape the trainer feeds the MFU (megatron.training.training's setup)."""
    args = parse_args(SHAPE + ["--micro-batch-size", "1", "--global-batch-size", "1",
                               "--train-iters", "1", "--lr", "1e-4", "--mock-data", *extra],
                      world_size=1, cuda_available=False)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    return gpt_shape(args, tokenizer.vocab_size)


@pytest.mark.parametrize("case", list(CASES))
def test_the_trainers_count_equals_the_estimators_from_a_trace_header(case, tmp_path):
    from megatron.memo_tools.cli import trace

    trainer_flags, tracer_flags = CASES[case]
    output = tmp_path / "trace.jsonl.gz"
    assert trace.main(SHAPE + tracer_flags + ["--tensor-model-parallel-size", "2",
                                              "--use-distributed-optimizer", "--quiet", "-o",
                                              str(output)]) == 0
    header = read_trace(output).header["model"]
    assert header["padded_vocab_size"] == 768  # TP 2's padding, which P does not see

    shape = trainer_shape(trainer_flags)
    assert parameter_count(shape) == parameter_count(header)
    assert model_flops_per_sequence(shape, 128) == model_flops_per_sequence(header, 128)


# ----------------------------------------------------------------------------- the GPU peak

DEVICE_PEAKS = {  # torch.cuda.get_device_name() -> the dense bf16 peak the profile gives
    "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A800-SXM4-80GB": 312.0, "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H200": 989.0,
}
# Parts no profile stands for: other peaks (PCIe/NVL, GH200) or no profile at all.
UNKNOWN_DEVICES = ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GH200 480GB",
                   "NVIDIA H800", "NVIDIA H20", "NVIDIA L40S", "NVIDIA B200"]


def _on_gpu(monkeypatch, name: str) -> argparse.Namespace:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: name)
    return argparse.Namespace(peak_tflops=None)


@pytest.mark.parametrize("name", list(DEVICE_PEAKS))
def test_the_peak_is_the_matching_hardware_profiles(monkeypatch, name):
    peak, source = metrics.peak_tflops_per_device(_on_gpu(monkeypatch, name))
    assert peak == DEVICE_PEAKS[name]
    assert source.startswith(f"{name}: dense bf16 peak of hardware.json's ")


@pytest.mark.parametrize("name", UNKNOWN_DEVICES)
def test_an_unknown_gpu_asks_for_peak_tflops(monkeypatch, name):
    with pytest.raises(ValueError, match=rf"unknown GPU '{name}' .*: pass --peak-tflops$"):
        metrics.peak_tflops_per_device(_on_gpu(monkeypatch, name))


def test_peak_tflops_wins_over_the_profile(monkeypatch):
    args = _on_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    args.peak_tflops = 700.0
    assert metrics.peak_tflops_per_device(args) == (700.0, "--peak-tflops")
