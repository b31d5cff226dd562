"""METP's two-level causal self-attention (docs/metp.md "Attention (two-level)").

Outer loop over head groups: at step j rank j broadcasts its QKV and projection shards (the
ColumnParallelLinear / RowParallelLinear weights Megatron gives TP rank j) and every rank computes
Q, K, V of head group j for its own sequence shard. Inner loop: a ring over the sequence shards
passes K and V while each rank merges per-tile flash attention results by log-sum-exp (online
softmax); the head group's output times its projection shard is added to this rank's output.
The next head group's weights are broadcast while the current one computes, and the next K/V
shard travels while the current tile computes (double buffering).

Causal mask, which the paper omits: the sequence is cut into 2p equal chunks and rank r holds
chunks r and 2p-1-r (zigzag, memo_ext.attention's :class:`ZigzagLayout`, the split context
parallelism uses), so every rank has the same causal work. The ring is memo_ext.attention's
:class:`RingAttention`, the one the trainer's core attention runs over the context-parallel
group; no mask tensor is ever built.

Backward: broadcast the weights again, recompute Q, K, V (and rotary) per head group, rerun the
ring with each tile's flash backward against the saved output and log-sum-exp of the whole
row, K/V carrying their dK/dV accumulators, which reach their owners with one extra hop; the
head group's weight gradients are reduced to rank j. Saved per layer: this rank's input and its
attention output of every head group (2bsh/p in all) plus the log-sum-exps.

Memory: Q and K/V of one head group are two matmuls on row slices of the fused QKV shard (no
fused temporary, no layout copies: tiles read [b, heads, s, d] views of Megatron's [s, b, heads,
d] layout); the K/V matmul's [s, b, 2, groups, d] output is itself the ring's send buffer, in
forward and in backward's recomputation, and the projection accumulates into the output in
place.

GQA: the ring carries K/V in their query groups and the tile kernels take them so.

Packed documents (--reset-attention-mask): the ring cuts its tiles along the documents' bounds,
as it does for the trainer's context parallelism.

Written by hand: the paper has no public code, and no library ring attention works on gloo/CPU
or shares Megatron's weight layout.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from memo_ext.attention import FlatPack, Ring, RingAttention, ZigzagLayout

Rotary = Callable[[torch.Tensor], torch.Tensor]

#: METP has no attention dropout (the flags refuse it): every tile's seed is unused.
_NO_DROPOUT = itertools.repeat(0)


@dataclass(frozen=True)
class HeadShape:
    """One rank's share of the heads: ``heads`` query heads in ``groups`` query groups of
    ``head_dim`` channels (Megatron's per-partition counts)."""
    heads: int
    groups: int
    head_dim: int

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


# ------------------------------------------------------------------------------ head groups

def _project_qkv(hidden, qkv_weight, qkv_bias, shape: HeadShape, rotary: Optional[Rotary]):
    """Q [s, b, heads, d] and K/V [s, b, 2, groups, d] of one head group from Megatron's fused
    QKV shard (rows per query group: its query heads, then K, then V). Two matmuls on row
    slices of the weight instead of one fused output split afterwards: no [s, b, 3 x] temporary
    and no layout copies; the K/V output is contiguous and travels the ring as it is."""
    per_group = (shape.heads_per_group + 2) * shape.head_dim
    query_rows = shape.heads_per_group * shape.head_dim
    weight = qkv_weight.view(shape.groups, per_group, -1)
    bias = None if qkv_bias is None else qkv_bias.view(shape.groups, per_group)

    def rows(tensor, start, width, leading):
        # [groups, width, ...] rows of every query group, as `leading` blocks of width/leading.
        part = tensor[:, start:start + width]
        part = part.reshape(shape.groups, leading, width // leading, *part.shape[2:])
        return part.transpose(0, 1).reshape(-1, *part.shape[3:])

    length, batch = hidden.shape[:2]
    query = torch.nn.functional.linear(
        hidden, weight[:, :query_rows].reshape(shape.heads * shape.head_dim, -1),
        None if bias is None else bias[:, :query_rows].reshape(-1))
    query = query.view(length, batch, shape.heads, shape.head_dim)
    # K rows of all groups, then V rows of all groups: the output is [s, b, 2, groups, d].
    key_value = torch.nn.functional.linear(
        hidden, rows(weight, query_rows, 2 * shape.head_dim, 2),
        None if bias is None else rows(bias, query_rows, 2 * shape.head_dim, 2))
    key_value = key_value.view(length, batch, 2, shape.groups, shape.head_dim)
    if rotary is not None:
        query = rotary(query)
        key_value[:, :, 0] = rotary(key_value[:, :, 0])
    return query, key_value


def _merge_heads(tensor: torch.Tensor) -> torch.Tensor:
    """[s, b, heads, d] -> [s, b, heads * d]."""
    return tensor.flatten(2)


class _WeightBroadcast:
    """Double-buffered broadcast of each rank's (QKV weight, QKV bias, projection weight) in
    turn: group j's weights arrive while group j-1 computes."""

    def __init__(self, shard: FlatPack, own: list, ring: Ring):
        self._shard, self._own, self._ring = shard, own, ring
        self._buffers = [shard.empty(), shard.empty()]
        self._works: list = [None, None]
        self._post(0)

    def _post(self, group: int) -> None:
        buffer = self._buffers[group % 2]
        if group == self._ring.rank:
            for view, tensor in zip(self._shard.unpack(buffer), self._own):
                if view is not None:
                    view.copy_(tensor)
        self._works[group % 2] = dist.broadcast(buffer, self._ring.global_rank(group),
                                                group=self._ring.group, async_op=True)

    def weights(self, group: int) -> list:
        """Group ``group``'s weights (waits for them) after posting group+1's broadcast."""
        if group + 1 < self._ring.size:
            self._post(group + 1)
        self._works[group % 2].wait()
        return self._shard.unpack(self._buffers[group % 2])


class TwoLevelAttentionFunction(torch.autograd.Function):
    """Autograd of METP self-attention (module docstring) for this rank's zigzag shard."""

    @staticmethod
    def forward(ctx, hidden, qkv_weight, qkv_bias, proj_weight, shape: HeadShape,
                rotary: Optional[Rotary], ring: Ring, layout: ZigzagLayout,
                documents: Optional[list[int]]):
        own = [qkv_weight, qkv_bias, proj_weight]
        broadcast = _WeightBroadcast(FlatPack(own), own, ring)
        length, batch, width = hidden.shape
        output = torch.zeros(length * batch, width, dtype=hidden.dtype, device=hidden.device)
        saved = []
        for group in range(ring.size):
            weight_qkv, bias_qkv, weight_proj = broadcast.weights(group)
            query, key_value = _project_qkv(hidden, weight_qkv, bias_qkv, shape, rotary)
            attention, lse = RingAttention(layout, shape.scale, ring, documents).forward(
                query, key_value, _NO_DROPOUT)
            del query, key_value
            saved += [attention, lse]
            output.addmm_(_merge_heads(attention).view(length * batch, -1), weight_proj.t())
        ctx.save_for_backward(hidden, qkv_weight, qkv_bias, proj_weight, *saved)
        ctx.shape, ctx.rotary, ctx.ring, ctx.layout = shape, rotary, ring, layout
        ctx.documents = documents
        return output.view(length, batch, width)

    @staticmethod
    def backward(ctx, grad_output):
        hidden, qkv_weight, qkv_bias, proj_weight, *saved = ctx.saved_tensors
        shape, rotary, ring, layout = ctx.shape, ctx.rotary, ctx.ring, ctx.layout
        grad_output = grad_output.contiguous()
        length, batch, _ = hidden.shape
        own = [qkv_weight, qkv_bias, proj_weight]
        shard = FlatPack(own)
        broadcast = _WeightBroadcast(shard, own, ring)
        grad_hidden = torch.zeros_like(hidden)
        own_grads = None
        previous_reduction = None
        for group in range(ring.size):
            weight_qkv, bias_qkv, weight_proj = broadcast.weights(group)
            attention, lse = saved[2 * group], saved[2 * group + 1]
            grads = shard.empty()
            grad_weight_qkv, grad_bias_qkv, grad_weight_proj = shard.unpack(grads)
            torch.matmul(grad_output.flatten(0, 1).t(), _merge_heads(attention).flatten(0, 1),
                         out=grad_weight_proj)
            grad_attention = torch.matmul(grad_output, weight_proj).view(attention.shape)
            with torch.enable_grad():
                leaves = [hidden.detach().requires_grad_(), weight_qkv.detach().requires_grad_()]
                if bias_qkv is not None:
                    leaves.append(bias_qkv.detach().requires_grad_())
                qkv = _project_qkv(*leaves[:2], leaves[2] if bias_qkv is not None else None,
                                   shape, rotary)
            grad_qkv = RingAttention(layout, shape.scale, ring, ctx.documents).backward(
                grad_attention, *(t.detach() for t in qkv), attention, lse, _NO_DROPOUT)
            input_grads = torch.autograd.grad(qkv, leaves, grad_qkv)
            del qkv, grad_qkv, grad_attention
            grad_hidden.add_(input_grads[0])
            grad_weight_qkv.copy_(input_grads[1])
            if grad_bias_qkv is not None:
                grad_bias_qkv.copy_(input_grads[2])
            del input_grads
            reduction = dist.reduce(grads, ring.global_rank(group), group=ring.group,
                                    async_op=True)
            if group == ring.rank:
                own_grads = grads
            # At most two reductions in flight: other ranks' gradient buffers are dropped
            # as soon as their reduction finished.
            if previous_reduction is not None:
                previous_reduction.wait()
            previous_reduction = reduction
        previous_reduction.wait()
        grad_weight_qkv, grad_bias_qkv, grad_weight_proj = shard.unpack(own_grads)
        return grad_hidden, grad_weight_qkv, grad_bias_qkv, grad_weight_proj, None, None, None, \
            None, None


def two_level_attention(hidden: torch.Tensor, qkv_weight: torch.Tensor,
                        qkv_bias: Optional[torch.Tensor], proj_weight: torch.Tensor,
                        shape: HeadShape, ring: Ring, layout: ZigzagLayout,
                        rotary: Optional[Rotary] = None,
                        documents: Optional[list[int]] = None) -> torch.Tensor:
    """Causal self-attention of this rank's zigzag sequence shard ``hidden`` [s/p, b, h] ->
    [s/p, b, h] (without the projection bias). Weights are this rank's Megatron shards:
    linear_qkv [(heads + 2 groups) d, h] per rank, linear_proj [h, heads d]. ``rotary`` maps
    [s/p, b, n, d] to the same shape with this rank's token positions (or None);
    ``documents``: packed documents' cumulative offsets over the whole sequence (or None)."""
    return TwoLevelAttentionFunction.apply(hidden, qkv_weight, qkv_bias, proj_weight, shape,
                                           rotary, ring, layout, documents)
