"""What the attention tiles' CUDA kernels request besides the ops' outputs, request by request
(memo_ext.attention.kernels dispatches the tiles; the trace's CUDA rules, memo_ext.planner.
cuda_rules, record these for the kernel the traced GPU runs, kernels.declared_tile_kernel).
Kept apart from the dispatch so each file holds one concern; kernels re-exports the names.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np
import torch

#
# What a CUDA run of a tile allocates besides the op's outputs, request by request, from the
# upstream sources (read for flash-attn v2.7.4.post1, v2.8.0 and v2.8.3 and torch's bundled
# copy of FlashAttention-2): flash_api.cpp's mha_fwd / mha_bwd / set_params_splitkv, torch's
# attention.cu / attention_backward.cu wrappers, flash-attn's flash_attn_interface.py, and
# memo_ext.attention.kernels' own dispatch (_cuda_flash_forward / _cuda_flash_backward, the
# cuDNN functions; cudnn-frontend for cuDNN's block). The trace's CUDA
# rules record them; the ops' fake rules declare only the outputs.


#: The split-KV accumulators' names in a trace: like a reduction's scratch they come and go in
#: steps with the length (memo_ext.planner.cuda_rules.STEPWISE_SCRATCH).
SPLIT_KV_LSE_ACCUM = "flash forward: split-KV softmax_lse_accum"
SPLIT_KV_OUT_ACCUM = "flash forward: split-KV out_accum"
#: cuDNN's backward workspace block in a trace (:func:`cudnn_backward_workspace_shape`).
CUDNN_BACKWARD_WORKSPACE = "cuDNN backward: dQ accumulator and softmax sum"


class KernelRequest(NamedTuple):
    """One allocation a kernel call makes and frees before it returns."""

    shape: tuple
    dtype: torch.dtype
    what: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def padded_head_dim(head_dim: int, flash_attn: Optional[tuple[int, int]] = None) -> int:
    """The head dim of the kernels' fp32 accumulators (mha_fwd's out_accum, mha_bwd's
    dq_accum): rounded to 32 up to 128 and to 64 above in flash-attn >= 2.8 and in torch's
    bundled copy; flash-attn 2.7 rounded to 32 up to 192 and took 256 above."""
    if flash_attn is not None and flash_attn < (2, 8):
        return _round_up(head_dim, 32) if head_dim <= 192 else 256
    return _round_up(head_dim, 32 if head_dim <= 128 else 64)


def flash_backward_workspace_shapes(batch: int, heads: int, seq_q: int, head_dim: int,
                                    flash_attn: Optional[tuple[int, int]] = None
                                    ) -> tuple[tuple, tuple]:
    """Shapes (fp32) of ``mha_bwd``'s two workspaces: ``softmax_d`` [b, heads, round128(s_q)]
    and ``dq_accum`` [b, round128(s_q), heads, :func:`padded_head_dim`] (the non-deterministic
    backward, the one used)."""
    seq_rounded = _round_up(seq_q, 128)
    return ((batch, heads, seq_rounded),
            (batch, seq_rounded, heads, padded_head_dim(head_dim, flash_attn)))


def split_kv_splits(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                    sm_count: int) -> int:
    """How many key splits mha_fwd runs a forward in (set_params_splitkv with num_splits 0,
    which both torch's build and flash-attn pass in training whenever dropout is 0): its
    num_splits_heuristic, in the kernel's float arithmetic. More than 1 for tiles too small to
    fill the GPU (short tiles cut at document bounds, small batches x heads), never for long
    ones: a split is worth it only while batch x heads x ceil(s_q/64) < 0.8 x 2 x SMs."""
    block_n = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
    n_blocks = -(-seq_k // block_n)
    work = batch * heads * -(-seq_q // 64)
    slots = sm_count * 2  # "we're using 128 threads per block"
    if work >= np.float32(0.8) * np.float32(slots):
        return 1
    max_splits = min(128, slots, n_blocks)

    def eligible(splits: int) -> bool:
        return splits == 1 or -(-n_blocks // splits) != -(-n_blocks // (splits - 1))

    efficiency = {}
    for splits in range(1, max_splits + 1):
        if eligible(splits):
            waves = np.float32(work * splits) / np.float32(slots)
            efficiency[splits] = waves / np.ceil(waves)
    best = max(efficiency.values(), default=np.float32(0))
    for splits, value in efficiency.items():
        if float(value) >= 0.85 * float(best):
            return splits
    return 1


def forward_workspaces(q: torch.Tensor, k: torch.Tensor, sm_count: int,
                       flash_attn: Optional[tuple[int, int]] = None,
                       kernel: str = "cuda_flash") -> list[KernelRequest]:
    """What a tile_forward on the CUDA ``kernel`` allocates besides out and lse, in request
    order (q [b, heads, s_q, d], k [b, groups, s_k, d]; ``flash_attn``: the flash-attn version,
    None for torch's build). "explicit": nothing here (its fp32 scores are ops of their own).
    "cuda_cudnn": nothing declared -- GQA is native, no split-KV; its two 0-d int64 dropout
    seed/offset tensors are not declared (the sources read do not settle their device: the
    meta rule puts them on "meta"), nor the cuDNN engine's workspace (to measure on a GPU).
    "cuda_flash":

    - torch's build with GQA: K and V expanded to every query head (:func:`_expand_groups`);
    - split-KV (both): softmax_lse_accum [splits, b, heads, s_q] and out_accum [splits, b,
      heads, s_q, padded d], fp32, when :func:`split_kv_splits` > 1;
    - the RNG state mha_fwd allocates even without dropout: torch's build 2 uint64 and an
      unused uint64 scalar, flash-attn 2 int64 (its 0-element ``p`` is no request).
    """
    if kernel != "cuda_flash":
        return []
    batch, heads, seq_q, head_dim = q.shape
    groups, seq_k = k.shape[1], k.shape[2]
    requests = []
    if flash_attn is None and groups != heads:
        expanded = (batch, heads, seq_k, head_dim)
        requests += [KernelRequest(expanded, k.dtype, "flash forward: K expanded to the heads"),
                     KernelRequest(expanded, k.dtype, "flash forward: V expanded to the heads")]
    split_heads, split_rows = heads, seq_q
    if flash_attn is not None and seq_q == 1 and heads > groups:
        split_heads, split_rows = groups, heads // groups  # mha_fwd's seqlenq_ngroups_swapped
    splits = split_kv_splits(batch, split_heads, split_rows, seq_k, head_dim, sm_count)
    if splits > 1:
        requests += [
            KernelRequest((splits, batch, split_heads, split_rows), torch.float32,
                          SPLIT_KV_LSE_ACCUM),
            KernelRequest((splits, batch, split_heads, split_rows,
                           padded_head_dim(head_dim, flash_attn)), torch.float32,
                          SPLIT_KV_OUT_ACCUM)]
    if flash_attn is None:
        requests += [KernelRequest((2,), torch.uint64, "flash forward: rng_state"),
                     KernelRequest((), torch.uint64, "flash forward: unused RNG offset")]
    else:
        requests.append(KernelRequest((2,), torch.int64, "flash forward: rng_state"))
    return requests


def backward_workspaces(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor,
                        flash_attn: Optional[tuple[int, int]] = None,
                        kernel: str = "cuda_flash") -> list[KernelRequest]:
    """What a tile_backward on the CUDA ``kernel`` allocates besides dq, dk and dv, in request
    order. Both fused kernels first make the log-sum-exp contiguous when it is a slice
    (:func:`_cuda_flash_backward`, :func:`_cudnn_backward_operands`). "explicit": nothing here.

    "cuda_cudnn" (GQA native: no per-head dK/dV, they are virtual inside its graph): the 0-d
    int64 ``no_rng`` :func:`_cuda_cudnn_backward` passes for the seed and offset, then the one
    workspace block (:func:`cudnn_backward_workspace_shape`). Not declared: the copies
    :func:`_cudnn_backward_operands` makes of out/grad_out in another layout than q's (the
    trainer's paths need none, tests/unit/memo_ext/attention/test_cudnn_attention.py checks the ring, documents
    and head chunks; whether one is made depends on the layouts the forward kernel returned,
    which differ between a live CPU trace and a fake one, and the two traces must be the same).

    "cuda_flash":

    - torch's build: with GQA, K and V expanded to every query head; grad_out and out made
      contiguous in [b, s, heads, d] unless they are (_flash_attention_backward; with batch 1
      the trainer's are); the kernel's dK and dV for every query head, summed over each group
      into the op's dk/dv after the call (only with GQA: otherwise they are the op's own);
    - mha_bwd's softmax_d and dq_accum (:func:`flash_backward_workspace_shapes`);
    - flash-attn with GQA: dk_expanded / dv_expanded [b, s_k, heads, d] in q's dtype, which the
      kernel fills and sums into the groups' dk/dv.
    """
    if kernel not in ("cuda_flash", "cuda_cudnn"):
        return []
    batch, heads, seq_q, head_dim = q.shape
    groups, seq_k = k.shape[1], k.shape[2]
    expanded = (batch, heads, seq_k, head_dim)
    name = "flash" if kernel == "cuda_flash" else "cuDNN"
    requests = []
    if not lse.is_contiguous():
        requests.append(KernelRequest(tuple(lse.shape), lse.dtype,
                                      f"{name} backward: log-sum-exp made contiguous"))
    if kernel == "cuda_cudnn":
        return requests + [
            KernelRequest((), torch.int64, "cuDNN backward: no_rng (seed and offset)"),
            KernelRequest(cudnn_backward_workspace_shape(*q.shape), torch.float32,
                          CUDNN_BACKWARD_WORKSPACE)]
    if flash_attn is None:
        if groups != heads:
            requests += [
                KernelRequest(expanded, k.dtype, "flash backward: K expanded to the heads"),
                KernelRequest(expanded, k.dtype, "flash backward: V expanded to the heads")]
        for name, tensor in (("grad_out", grad_out), ("out", out)):
            if not tensor.transpose(1, 2).is_contiguous():
                requests.append(KernelRequest(tuple(tensor.transpose(1, 2).shape),
                                              tensor.dtype,
                                              f"flash backward: {name} made contiguous"))
        if groups != heads:
            requests += [
                KernelRequest(expanded, k.dtype, "flash backward: dK of every query head"),
                KernelRequest(expanded, k.dtype, "flash backward: dV of every query head")]
    softmax_d, dq_accum = flash_backward_workspace_shapes(batch, heads, seq_q, head_dim,
                                                          flash_attn)
    requests += [KernelRequest(softmax_d, torch.float32, "flash backward: softmax_d"),
                 KernelRequest(dq_accum, torch.float32, "flash backward: dq_accum")]
    if flash_attn is not None and groups != heads:
        requests += [
            KernelRequest(expanded, q.dtype, "flash backward: dk_expanded (GQA)"),
            KernelRequest(expanded, q.dtype, "flash backward: dv_expanded (GQA)")]
    return requests


def cudnn_backward_workspace_shape(batch: int, heads: int, seq_q: int,
                                   head_dim: int) -> tuple[int, int, int, int]:
    """Shape (fp32) of the one block cudnn-frontend's fused attention backward asks the caching
    allocator for besides dQ/dK/dV (CompositeSDPABackwardNode::get_fe_workspace_size_node, dense
    inputs, no bias gradient, not deterministic): its dQ accumulator [b, heads, s_q, d] and
    softmax sum [b, heads, s_q], i.e. [b, heads, s_q, d + 1]. The cuDNN engine's own workspace
    comes on top of it in the same block and is not modelled (to measure on a GPU)."""
    return batch, heads, seq_q, head_dim + 1
