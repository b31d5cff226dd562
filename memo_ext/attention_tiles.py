"""Attention tiles with their log-sum-exp: the kernel under METP's sequence ring and SPPO's
cached K/V blocks.

Both mechanisms split each softmax row over several key blocks ("tiles") that are never in
memory together: METP's K/V travel a ring, SPPO's earlier subsequences sit in a per-layer cache.
Forward runs each tile on its own and merges the tile outputs by log-sum-exp
(:func:`merge_tile`); backward runs each tile's gradient against the *row's* final output and
log-sum-exp, which makes the tile's probabilities exactly its share of the full softmax, so the
per-tile gradients are the full attention's (the flash-attention backward identity).

Kernels, by device and dtype:

* CPU: torch's flash-attention kernel for CPU (``_scaled_dot_product_flash_attention_for_cpu``
  and its backward), which returns the log-sum-exp;
* CUDA, fp16/bf16, head dim a multiple of 8 up to 256: torch's FlashAttention-2 kernel
  (``_scaled_dot_product_flash_attention`` and its backward). Never run here (no GPU);
  tests/gpu/test_attention_tiles_cuda.py compares it with the explicit path;
* anything else: an explicit softmax in fp32 (materialises the tile's scores).

Written by hand because torch's public ``scaled_dot_product_attention`` returns no log-sum-exp
and takes no external one in backward; the aten ops above do both. Tiles are [b, heads, L, d];
``causal`` means the tile's queries and keys start at the same token (a diagonal tile), where
the top-left and bottom-right aligned masks agree.
"""

from __future__ import annotations

import torch

#: FlashAttention-2 (torch's CUDA flash kernel) takes head dims that are multiples of 8, <= 256.
CUDA_FLASH_HEAD_DIM_MULTIPLE = 8
CUDA_FLASH_MAX_HEAD_DIM = 256


def kernel_for(query: torch.Tensor) -> str:
    """Which kernel :func:`tile_forward` uses for ``query``: "cpu_flash", "cuda_flash" or
    "explicit"."""
    if query.device.type == "cpu":
        return "cpu_flash"
    head_dim = query.shape[-1]
    if (query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16)
            and head_dim % CUDA_FLASH_HEAD_DIM_MULTIPLE == 0
            and head_dim <= CUDA_FLASH_MAX_HEAD_DIM):
        return "cuda_flash"
    return "explicit"


def tile_forward(query, key, value, causal: bool, scale: float, kernel: str | None = None):
    """Attention of one tile ([b, heads, L, d] each; GQA already expanded): (output in the
    query's dtype, log-sum-exp [b, heads, Lq] fp32). ``kernel`` overrides :func:`kernel_for`
    (tests run the explicit path on CPU)."""
    kernel = kernel or kernel_for(query)
    if kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, scale=scale)
        return out, lse.float()
    if kernel == "cuda_flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, causal, False, scale=scale)
        return out, lse.float()
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores + _causal_bias(scores)
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probabilities, value.float()).to(query.dtype), lse


def tile_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float,
                  kernel: str | None = None):
    """Gradients (dq, dk, dv) of one tile, given the row's final output ``out`` and log-sum-exp
    ``lse`` (fp32) over all tiles."""
    kernel = kernel or kernel_for(query)
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, causal, scale=scale)
    if kernel == "cuda_flash":
        # Dense (not varlen) tiles: no cumulative lengths; no dropout, so the RNG state the
        # backward takes is never read.
        no_lengths = torch.empty(0, dtype=torch.int32, device=query.device)
        no_rng = torch.empty(0, dtype=torch.int64, device=query.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, lse, no_lengths, no_lengths, query.shape[-2],
            key.shape[-2], 0.0, causal, no_rng, no_rng, scale=scale)
    q, k, v = query.float(), key.float(), value.float()
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores + _causal_bias(scores)
    probabilities = torch.exp(scores - lse.unsqueeze(-1))
    grad = grad_out.float()
    grad_value = torch.matmul(probabilities.transpose(-1, -2), grad)
    row_dot = (grad * out.float()).sum(-1, keepdim=True)
    grad_scores = probabilities * (torch.matmul(grad, v.transpose(-1, -2)) - row_dot) * scale
    return (torch.matmul(grad_scores, k).to(query.dtype),
            torch.matmul(grad_scores.transpose(-1, -2), q).to(key.dtype),
            grad_value.to(value.dtype))


def merge_tile(output: torch.Tensor | None, lse: torch.Tensor | None,
               tile_output: torch.Tensor, tile_lse: torch.Tensor):
    """Running log-sum-exp merge: (output, lse) of the tiles so far and of one more tile ->
    the merged (output fp32, lse fp32). Pass None, None for the first tile."""
    if output is None:
        return tile_output.float(), tile_lse
    merged = torch.logaddexp(lse, tile_lse)
    output = (output * torch.exp(lse - merged).unsqueeze(-1)
              + tile_output.float() * torch.exp(tile_lse - merged).unsqueeze(-1))
    return output, merged


def _causal_bias(scores: torch.Tensor) -> torch.Tensor:
    length = scores.shape[-1]
    return torch.full((length, length), float("-inf"), device=scores.device).triu(1)
