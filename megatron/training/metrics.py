"""Throughput, MFU and memory figures for the training log.

Model FLOPs follow the MEMO paper's accounting (per sample of s tokens):
    6 * s * P  +  6 * n * h * s^2
P = parameters, n = layers, h = hidden size. The first term is the dense GEMMs (forward 2sP,
backward 4sP), the second causal attention's score and context GEMMs. Recomputation is not
counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import argparse
import time

import psutil
import torch
import torch.distributed as dist

from megatron.training.arguments import GPU_PEAK_TFLOPS

_BYTES_PER_MIB = 1024**2


def count_parameters(args: argparse.Namespace, padded_vocab_size: int) -> int:
    """Total parameters of the GPT model described by ``args`` (all ranks together)."""
    h, ffn, n = args.hidden_size, args.ffn_hidden_size, args.num_layers
    kv_projection = args.kv_channels * args.num_query_groups
    q_projection = args.kv_channels * args.num_attention_heads
    bias = 1 if args.add_bias_linear else 0
    norm_params = h if args.normalization == "RMSNorm" else 2 * h
    attention = h * (q_projection + 2 * kv_projection) + q_projection * h
    attention += bias * (q_projection + 2 * kv_projection + h)
    fc1_out = 2 * ffn if args.swiglu else ffn
    mlp = h * fc1_out + ffn * h + bias * (fc1_out + h)
    layer = attention + mlp + 2 * norm_params
    embeddings = padded_vocab_size * h
    if args.position_embedding_type == "learned_absolute":
        embeddings += args.max_position_embeddings * h
    output_layer = padded_vocab_size * h if args.untie_embeddings_and_output_weights else 0
    return n * layer + embeddings + output_layer + norm_params


def model_flops_per_sample(args: argparse.Namespace, num_parameters: int) -> float:
    """6sP + 6nhs^2 FLOPs for one sample of ``args.seq_length`` tokens."""
    s = args.seq_length
    return 6.0 * s * num_parameters + 6.0 * args.num_layers * args.hidden_size * s * s


def measure_cpu_gemm_tflops(size: int = 1024, repeats: int = 4) -> float:
    """Dense fp32 GEMM throughput of this process's CPU threads, in TFLOP/s (measured)."""
    generator = torch.Generator().manual_seed(0)  # leaves the training RNG streams untouched
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    elapsed = time.perf_counter() - start
    return 2.0 * size**3 * repeats / elapsed / 1e12


def peak_tflops_per_device(args: argparse.Namespace) -> tuple[float, str]:
    """Per-device peak TFLOP/s for MFU and where it came from."""
    if args.peak_tflops is not None:
        return args.peak_tflops, "--peak-tflops"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops, f"{name} dense bf16 peak"
        raise ValueError(f"unknown GPU {name!r}: pass --peak-tflops for MFU")
    return measure_cpu_gemm_tflops(), "measured CPU fp32 GEMM"


def memory_report() -> dict[str, float]:
    """This process's memory in MiB: CUDA allocator stats, or resident set size on CPU."""
    if torch.cuda.is_available():
        return {
            "mem_allocated_mib": torch.cuda.memory_allocated() / _BYTES_PER_MIB,
            "mem_reserved_mib": torch.cuda.memory_reserved() / _BYTES_PER_MIB,
            "mem_peak_allocated_mib": torch.cuda.max_memory_allocated() / _BYTES_PER_MIB,
        }
    return {"mem_rss_mib": psutil.Process().memory_info().rss / _BYTES_PER_MIB}


def max_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Element-wise maximum of a dict of floats over all ranks (same keys everywhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    keys = sorted(values)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return dict(zip(keys, tensor.tolist()))
