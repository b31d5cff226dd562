"""Attention kernels of one tile, with their log-sum-exp, as two torch custom ops.

Every attention in Megatron-MEMO (the trainer's core attention with and without context
parallelism, SPPO's cached blocks, METP's head groups) is a sum of tiles: blocks of queries
against blocks of keys, unmasked or causal (top-left aligned, square), merged by log-sum-exp in
forward and differentiated tile by tile against the row's final output and log-sum-exp in
backward (the flash-attention backward identity: with the row's own log-sum-exp a tile's
probabilities are exactly its share of the full softmax).

``memo_attention::tile_forward`` -> (out, lse) and ``memo_attention::tile_backward`` ->
(dq, dk, dv, *workspaces) take [b, heads, s, d] tensors (views of Megatron's [s, b, heads, d]
layout are fine) with K/V in ``groups`` query groups (GQA is never expanded outside the kernel).
They are custom ops for one reason: their fake (meta) rules below are the allocation sizes of
the CUDA kernels, declared here next to the dispatch, so a trace of the trainer's own modules
under FakeTensorMode records what a GPU run allocates (out, the fp32 log-sum-exp [b, heads, s_q]
and, in backward, dq/dk/dv plus flash-attention 2's workspaces) and never an s x s tensor. Live
CPU runs allocate the same outputs.

Kernels, by device and dtype (:func:`kernel_for`):

* CPU: torch's flash-attention kernel for CPU (``_scaled_dot_product_flash_attention_for_cpu``
  and its backward), GQA native;
* CUDA, fp16/bf16, head dim a multiple of 8 up to 256: the ``flash-attn`` package (>= 2.7)
  when it is installed (GQA native), torch's own FlashAttention-2 build otherwise
  (``_scaled_dot_product_flash_attention``, K/V groups expanded inside the op). Their
  arithmetic never runs here (no GPU; tests/gpu/ compares them with the explicit kernel); how
  they read their operands does, through tests/cuda_double.py's FlashKernelDouble;
* anything else, and any tile with dropout: an explicit softmax in fp32 that materialises the
  tile's scores. Dropout regenerates its mask in backward from a per-tile seed.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

#: FlashAttention-2 takes head dims that are multiples of 8, at most 256.
CUDA_FLASH_HEAD_DIM_MULTIPLE = 8
CUDA_FLASH_MAX_HEAD_DIM = 256

_STATE = threading.local()


def kernel_for(query: torch.Tensor, dropout_p: float = 0.0) -> str:
    """Which kernel runs a tile of ``query``: "cpu_flash", "cuda_flash" or "explicit".
    :func:`forced_kernel` overrides it (tests run the explicit path on CPU)."""
    forced = getattr(_STATE, "kernel", None)
    if forced is not None:
        return forced
    if dropout_p > 0:
        return "explicit"
    if query.device.type == "cpu":
        return "cpu_flash"
    head_dim = query.shape[-1]
    if (query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16)
            and head_dim % CUDA_FLASH_HEAD_DIM_MULTIPLE == 0
            and head_dim <= CUDA_FLASH_MAX_HEAD_DIM):
        return "cuda_flash"
    return "explicit"


@contextlib.contextmanager
def _thread_setting(name: str, value) -> Iterator[None]:
    saved = getattr(_STATE, name, None)
    setattr(_STATE, name, value)
    try:
        yield
    finally:
        setattr(_STATE, name, saved)


def forced_kernel(kernel: Optional[str]):
    """Run every tile of this thread with ``kernel`` (None: by device and dtype)."""
    return _thread_setting("kernel", kernel)


def declared_workspaces(enabled: bool = True):
    """Make tile_backward also allocate (and return) the workspaces the CUDA kernel allocates,
    so a trace records them; off in training, where nothing reads them."""
    return _thread_setting("workspaces", enabled)


# ------------------------------------------------------------- the CUDA kernels' allocations

def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def flash_backward_workspace_shapes(batch: int, heads: int, seq_q: int,
                                    head_dim: int) -> tuple[tuple, tuple]:
    """Shapes (fp32) of flash-attention 2's ``mha_bwd`` workspaces: ``softmax_d`` [b, heads,
    round128(s_q)] and ``dq_accum`` [b, round128(s_q), heads, d rounded to 32 (d <= 192) or to
    256] (flash_api.cpp, non-deterministic backward)."""
    seq_rounded = _round_up(seq_q, 128)
    dim_rounded = _round_up(head_dim, 32) if head_dim <= 192 else 256
    return (batch, heads, seq_rounded), (batch, seq_rounded, heads, dim_rounded)


def _workspaces(q: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    """What flash-attention 2's backward allocates besides dq/dk/dv: softmax_d and dq_accum
    (fp32), and with GQA dK/dV for every query head ([b, heads, s_k, d], k's dtype) before
    they are summed over each group. Empty tensors when workspaces are not declared."""
    batch, heads, seq_q, head_dim = q.shape
    if not getattr(_STATE, "workspaces", False):
        return [q.new_empty((0,), dtype=torch.float32) for _ in range(4)]
    softmax_d, dq_accum = flash_backward_workspace_shapes(batch, heads, seq_q, head_dim)
    expanded = ((batch, heads, k.shape[2], head_dim) if k.shape[1] != heads else (0,))
    return [q.new_empty(softmax_d, dtype=torch.float32),
            q.new_empty(dq_accum, dtype=torch.float32),
            k.new_empty(expanded), k.new_empty(expanded)]


# ----------------------------------------------------------------------------- the ops

@torch.library.custom_op("memo_attention::tile_forward", mutates_args=())
def tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                 dropout_p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile: q [b, heads, s_q, d], k/v [b, groups, s_k, d] -> out [b, heads, s_q, d] (q's
    dtype) and lse [b, heads, s_q] (fp32)."""
    kernel = kernel_for(q, dropout_p)
    if kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    if kernel == "cuda_flash":
        return _cuda_flash_forward(q, k, v, scale, causal)
    return _explicit_forward(q, k, v, scale, causal, dropout_p, seed)


@tile_forward.register_fake
def _(q, k, v, scale, causal, dropout_p, seed):
    batch, heads, seq_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads, seq_q), dtype=torch.float32)


@torch.library.custom_op("memo_attention::tile_backward", mutates_args=())
def tile_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                  dropout_p: float, seed: int) -> list[torch.Tensor]:
    """Gradients [dq, dk, dv] of one tile given the row's final ``out`` and ``lse`` over all
    tiles, followed by the kernel's four workspaces (see :func:`_workspaces`; the caller drops
    them at once, as the kernel frees them)."""
    kernel = kernel_for(q, dropout_p)
    if kernel == "cpu_flash":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    elif kernel == "cuda_flash":
        grads = _cuda_flash_backward(grad_out, q, k, v, out, lse, scale, causal)
    else:
        grads = _explicit_backward(grad_out, q, k, v, out, lse, scale, causal, dropout_p, seed)
    return [*grads, *_workspaces(q, k)]


@tile_backward.register_fake
def _(grad_out, q, k, v, out, lse, scale, causal, dropout_p, seed):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *_workspaces(q, k)]


#: tile_backward outputs that are kernel workspaces, by op name (the trace tags them so).
WORKSPACE_OUTPUTS = {"memo_attention.tile_backward.default": (3, 4, 5, 6)}
TILE_FORWARD_OP = "memo_attention.tile_forward.default"
TILE_BACKWARD_OP = "memo_attention.tile_backward.default"


def merge_into(output: torch.Tensor, lse: torch.Tensor, tile_output: torch.Tensor,
               tile_lse: torch.Tensor) -> None:
    """Log-sum-exp merge of one more tile into the running fp32 ``output`` and ``lse`` of the
    same rows, in place (online softmax)."""
    merged = torch.logaddexp(lse, tile_lse)
    output.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(
        tile_output.float() * torch.exp(tile_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


# ------------------------------------------------------------------------------ kernels

def _expand_groups(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    groups = tensor.shape[1]
    return tensor if groups == heads else tensor.repeat_interleave(heads // groups, dim=1)


def _sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    batch, heads, seq, dim = grad.shape
    if groups == heads:
        return grad
    return grad.view(batch, groups, heads // groups, seq, dim).sum(dim=2)


def _flash_attn():
    """flash-attn's interface module when flash-attn >= 2.7 is installed (its
    ``_wrapped_flash_attn_forward``/``_backward`` take [b, s, heads, d] and GQA natively and
    return the log-sum-exp), else None: torch's own FlashAttention-2 build is used instead."""
    try:
        from flash_attn import __version__
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    major, minor = (int(part) for part in __version__.split(".")[:2])
    return flash_attn_interface if (major, minor) >= (2, 7) else None


def _cuda_flash_forward(q, k, v, scale, causal):
    flash = _flash_attn()
    if flash is not None:
        out, lse, _, _ = flash._wrapped_flash_attn_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0,
            softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, return_softmax=False)
        return out.transpose(1, 2), lse
    heads = q.shape[1]
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, _expand_groups(k, heads), _expand_groups(v, heads), 0.0, causal, False, scale=scale)
    return out, lse.float()


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy when its last dimension is strided (which mha_fwd and
    mha_bwd refuse)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _cuda_flash_backward(grad_out, q, k, v, out, lse, scale, causal):
    # What the CUDA backward reads by raw pointer must be laid out as it assumes. mha_bwd
    # (flash_api.cpp in flash-attn's sources, and torch's copy of it in
    # aten/src/ATen/native/transformers/cuda/flash_attn) hands the kernel
    # softmax_lse.data_ptr() with no strides at all: flash_bwd_kernel.h indexes it as a
    # contiguous [b, heads, s_q] ((bidb * h + bidh) * seqlen_q + row). Our callers pass row
    # slices of the whole rows' lse (ring and SPPO tiles, tiles cut at document bounds) and
    # head slices (head chunks): with more than one head, or batch > 1, those are strided and
    # a GPU would read other rows' values, silently giving wrong dQ/dK/dV. Neither wrapper
    # fixes it: torch's _flash_attention_backward (attention_backward.cu) makes only grad_out
    # and out contiguous, flash-attn's _flash_attn_backward only copies dout/q/k/v/out whose
    # last dimension is strided. So the lse is made contiguous here (a copy of b*heads*s_q
    # floats only when it is a slice; Transformer Engine's context parallelism does the same).
    # q/k/v/out/grad_out are read with their batch, row and head strides; mha_bwd only needs
    # their last dimension unit-strided (it refuses them otherwise), which the layouts here
    # always are; _unit_last_stride keeps that true whatever a caller passes.
    lse = lse.contiguous()
    q, k, v, out, grad_out = (_unit_last_stride(t) for t in (q, k, v, out, grad_out))
    flash = _flash_attn()
    if flash is not None:
        grads = [torch.empty_like(t.transpose(1, 2)) for t in (q, k, v)]
        flash._wrapped_flash_attn_backward(
            grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            out.transpose(1, 2), lse, *grads, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None)
        return tuple(g.transpose(1, 2) for g in grads)
    heads, groups = q.shape[1], k.shape[1]
    # Dense tiles: the cumulative lengths are undefined (None), as the forward returns them; an
    # empty tensor would select the variable-length kernel, which refuses a batch of -1 (seen on
    # an H100). No dropout, so the RNG state is never read.
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, _expand_groups(k, heads), _expand_groups(v, heads), out, lse, None, None,
        q.shape[-2], k.shape[-2], 0.0, causal, no_rng, no_rng, scale=scale)
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


def _explicit_probabilities(q, k, scale, causal, lse=None):
    """fp32 scores' probabilities [b, heads, s_q, s_k] and the rows' lse (given or computed)."""
    k = _expand_groups(k.float(), q.shape[1])
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if causal:
        length = scores.shape[-1]
        scores = scores + torch.full((length, length), float("-inf"),
                                     device=scores.device).triu(1)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)), lse


def _dropout_keep(shape, dropout_p: float, seed: int, device) -> torch.Tensor:
    """The tile's dropout scale: kept entries 1/(1-p), dropped 0, from the tile's own seed so
    backward regenerates the same mask."""
    generator = torch.Generator(device=device).manual_seed(seed)
    keep = torch.rand(shape, generator=generator, device=device) >= dropout_p
    return keep.float() / (1.0 - dropout_p)


def _explicit_forward(q, k, v, scale, causal, dropout_p, seed):
    probabilities, lse = _explicit_probabilities(q, k, scale, causal)
    if dropout_p > 0:
        probabilities = probabilities * _dropout_keep(probabilities.shape, dropout_p, seed,
                                                      q.device)
    out = torch.matmul(probabilities, _expand_groups(v.float(), q.shape[1]))
    return out.to(q.dtype), lse


def _explicit_backward(grad_out, q, k, v, out, lse, scale, causal, dropout_p, seed):
    heads, groups = q.shape[1], k.shape[1]
    probabilities, _ = _explicit_probabilities(q, k, scale, causal, lse)
    grad = grad_out.float()
    keys, values = _expand_groups(k.float(), heads), _expand_groups(v.float(), heads)
    grad_probabilities = torch.matmul(grad, values.transpose(-1, -2))
    dropped = probabilities
    if dropout_p > 0:
        keep = _dropout_keep(probabilities.shape, dropout_p, seed, q.device)
        dropped = probabilities * keep
        grad_probabilities = grad_probabilities * keep
    grad_value = torch.matmul(dropped.transpose(-1, -2), grad)
    # sum_j P_ij dP_ij = dO_i . O_i also with dropout (O is the dropped output).
    row_dot = (grad * out.float()).sum(-1, keepdim=True)
    grad_scores = probabilities * (grad_probabilities - row_dot) * scale
    return (torch.matmul(grad_scores, keys).to(q.dtype),
            _sum_groups(torch.matmul(grad_scores.transpose(-1, -2), q.float()), groups).to(k.dtype),
            _sum_groups(grad_value, groups).to(v.dtype))
