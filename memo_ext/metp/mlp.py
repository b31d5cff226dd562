"""METP's MLP: O = f(A·B)·C over the TP ring (docs/metp.md "O = f(AB)C").

Rank i holds A_i, its sequence shard of the input ([s/p, b, h], the sequence-parallel layout),
B's column shard (ColumnParallelLinear fc1: weight [k/p, h], bias [k/p]) and C's row shard
(RowParallelLinear fc2: weight [h, f/p]); k = f, or 2f for gated units whose two halves are
interleaved per shard exactly as Megatron lays them out, so f applies to each shard on its own.
O_i = sum_r f(A_i·B_r + b_r)·C_r: at ring step j rank i uses the shard of rank (i+j) % p while the
next one travels. No rank holds a full-sequence activation; the per-step intermediate is
[s/p, b, f/p].

Backward recomputes f(A_i·B_r) per step (nothing but A_i is saved) and sends the gradient
accumulators (dB_r, db_r, dC_r) around the ring behind their shard: at step j rank i adds its
contribution for shard (i+j) to the accumulator that rank i+1 passed on after its step j-1, and
passes it to rank i-1; one extra hop after the last step brings every accumulator home, so each
rank ends with the full gradient of its own shard. Each accumulator hop overlaps the next step's
compute.

Written by hand: no library implements this (the paper has no public code); Megatron's own
layers gather the full sequence instead. Nothing here imports megatron (memo_ext.metp.layers
wraps it into Megatron's MLP).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from memo_ext.attention.ring import GRADIENTS_TAG, WEIGHTS_TAG, FlatPack, Ring, Transfer

Activation = Callable[[torch.Tensor], torch.Tensor]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
    return torch.nn.functional.linear(x, weight, bias)


class RingMLPFunction(torch.autograd.Function):
    """Autograd of ``sum_r activation(hidden·W1_r^T + b1_r)·W2_r^T`` over ``ring``."""

    @staticmethod
    def forward(ctx, hidden, fc1_weight, fc1_bias, fc2_weight, activation: Activation,
                ring: Ring):
        shard = FlatPack([fc1_weight, fc1_bias, fc2_weight])
        buffers = [shard.pack([fc1_weight, fc1_bias, fc2_weight]), shard.empty()]
        output = None
        for step in range(ring.size):
            current = buffers[step % 2]
            transfer = (ring.exchange(current, buffers[(step + 1) % 2], WEIGHTS_TAG)
                        if step < ring.size - 1 else None)
            weight1, bias1, weight2 = shard.unpack(current)
            partial = _linear(activation(_linear(hidden, weight1, bias1)), weight2)
            output = partial if output is None else output.add_(partial)
            if transfer is not None:
                transfer.wait()
        ctx.save_for_backward(hidden, fc1_weight, fc1_bias, fc2_weight)
        ctx.activation, ctx.ring = activation, ring
        return output

    @staticmethod
    def backward(ctx, grad_output):
        hidden, fc1_weight, fc1_bias, fc2_weight = ctx.saved_tensors
        activation, ring = ctx.activation, ctx.ring
        grad_output = grad_output.contiguous()
        shard = FlatPack([fc1_weight, fc1_bias, fc2_weight])
        buffers = [shard.pack([fc1_weight, fc1_bias, fc2_weight]), shard.empty()]
        grad_hidden = torch.zeros_like(hidden)
        # The accumulator of this step's shard, sent by rank i+1 after its previous step.
        incoming: Optional[torch.Tensor] = None
        accumulator_transfer: Optional[Transfer] = None
        for step in range(ring.size):
            current = buffers[step % 2]
            weight_transfer = (ring.exchange(current, buffers[(step + 1) % 2], WEIGHTS_TAG)
                               if step < ring.size - 1 else None)
            weight1, bias1, weight2 = shard.unpack(current)
            contribution = shard.empty()
            grad_weight1, grad_bias1, grad_weight2 = shard.unpack(contribution)
            with torch.enable_grad():
                leaf_hidden = hidden.detach().requires_grad_()
                leaf_weight1 = weight1.detach().requires_grad_()
                leaf_bias1 = None if bias1 is None else bias1.detach().requires_grad_()
                intermediate = activation(_linear(leaf_hidden, leaf_weight1, leaf_bias1))
                grad_intermediate = torch.matmul(grad_output, weight2)
                inputs = [leaf_hidden, leaf_weight1] + ([] if bias1 is None else [leaf_bias1])
                grads = torch.autograd.grad(intermediate, inputs, grad_intermediate)
            grad_hidden.add_(grads[0])
            grad_weight1.copy_(grads[1])
            if grad_bias1 is not None:
                grad_bias1.copy_(grads[2])
            torch.matmul(grad_output.flatten(0, -2).t(), intermediate.detach().flatten(0, -2),
                         out=grad_weight2)
            del intermediate, grad_intermediate, grads
            if accumulator_transfer is not None:
                accumulator_transfer.wait()
                contribution.add_(incoming)
            incoming = shard.empty()
            accumulator_transfer = ring.exchange(contribution, incoming, GRADIENTS_TAG)
            if weight_transfer is not None:
                weight_transfer.wait()
        accumulator_transfer.wait()  # the extra hop: our own shard's gradient comes home
        grad_weight1, grad_bias1, grad_weight2 = shard.unpack(incoming)
        return grad_hidden, grad_weight1, grad_bias1, grad_weight2, None, None


def ring_mlp(hidden: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: Optional[torch.Tensor],
             fc2_weight: torch.Tensor, activation: Activation, ring: Ring) -> torch.Tensor:
    """METP MLP of this rank's sequence shard ``hidden`` ([s/p, b, h] or any [..., h]): returns
    ``sum_r activation(hidden·W1_r^T + b1_r)·W2_r^T`` ([..., h]) without fc2's bias; the weight
    arguments are this rank's Column/RowParallelLinear shards."""
    return RingMLPFunction.apply(hidden, fc1_weight, fc1_bias, fc2_weight, activation, ring)
