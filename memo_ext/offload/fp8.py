"""fp8 (e4m3) storage with per-block scales for tensors MEMO offloads whole (--memo-offload-fp8).

A tensor is flattened and cut into blocks of :data:`BLOCK` values; each block is divided by its
absolute maximum over 448 (e4m3's largest finite value) and rounded to ``torch.float8_e4m3fn``;
the scales are kept in fp32. Stored bytes: one per value plus four per block
(:func:`stored_bytes`), 0.52 of bf16's and 0.26 of fp32's. Rounding to e4m3 keeps 3 mantissa
bits: the relative error of a value is at most 2^-4 of its block's scale step, so the restored
tensor differs from the original by up to ~6% of each value (and values far below their block's
maximum lose more). That is why the option is off by default and documented as lossy.

Hand-written rather than taken from a library: Transformer Engine's and torchao's fp8 casts are
per-tensor or per-row scaled for GEMM operands and need CUDA; this is a storage format only,
run on any device (the CPU test double included), and a dozen lines of torch.
"""

from __future__ import annotations

import math

import torch

#: Values per scale.
BLOCK = 128
#: e4m3's largest finite magnitude.
E4M3_MAX = 448.0
SCALE_DTYPE = torch.float32


def compressible(tensor: torch.Tensor) -> bool:
    """Floating-point tensors of 2 or more bytes per value gain from fp8 storage."""
    return tensor.is_floating_point() and tensor.element_size() >= 2


def _blocks(numel: int) -> int:
    return math.ceil(numel / BLOCK)


def stored_bytes(numel: int) -> int:
    """Bytes :func:`compress` writes for a tensor of ``numel`` values (payload, then scales)."""
    return numel + _blocks(numel) * torch.tensor([], dtype=SCALE_DTYPE).element_size()


def compress(tensor: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``tensor`` into the uint8 tensor ``out`` (``stored_bytes(tensor.numel())`` long)."""
    flat = tensor.detach().reshape(-1)
    numel, blocks = flat.numel(), _blocks(flat.numel())
    padded = torch.nn.functional.pad(flat.float(), (0, blocks * BLOCK - numel)).view(blocks, BLOCK)
    scales = padded.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero blocks
    quantized = (padded / scales).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)[:numel]
    out[:numel].copy_(quantized)
    out[numel:].view(SCALE_DTYPE).copy_(scales.reshape(-1))


def decompress(stored: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """The tensor :func:`compress` wrote into ``stored``, as a new contiguous ``dtype`` tensor."""
    numel = math.prod(shape)
    blocks = _blocks(numel)
    values = stored[:numel].view(torch.float8_e4m3fn).float()
    values = torch.nn.functional.pad(values, (0, blocks * BLOCK - numel)).view(blocks, BLOCK)
    scales = stored[numel:numel + blocks * 4].view(SCALE_DTYPE).view(blocks, 1)
    return (values * scales).reshape(-1)[:numel].to(dtype).view(shape)


__all__ = ["BLOCK", "compress", "compressible", "decompress", "stored_bytes"]
