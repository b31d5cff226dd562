"""Megatron modules running METP: the same parameters as Megatron's SelfAttention and MLP
(linear_qkv/linear_proj, linear_fc1/linear_fc2: ColumnParallelLinear / RowParallelLinear with
identical names, shapes, initialisation and sharded state dicts, so checkpoints interchange with
TP+SP), whose forward runs METP's ring functions instead of all-gather / reduce-scatter.

Inputs are the sequence-parallel shard [s/p, b, h] in METP's zigzag order (the model's tokens
are permuted by :meth:`memo_ext.metp.MemoryEfficientTP.attach`): rank r holds sequence chunks r
and 2p-1-r, and rotary embeddings are taken at those global positions. Packed documents'
offsets (megatron's PackedSeqParams) stay those of the whole sequence in its own order: the
ring maps them onto its zigzag tiles.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP

from memo_ext.attention import Ring, ZigzagLayout, documents_of
from memo_ext.metp.attention import HeadShape, two_level_attention
from memo_ext.metp.mlp import Activation, ring_mlp


def _tp_ring() -> Ring:
    return Ring(parallel_state.get_tensor_model_parallel_group())


def _with_row_bias(output: torch.Tensor, linear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What a RowParallelLinear returns: (output, bias) with skip_bias_add, else (output+bias,
    None)."""
    if linear.bias is None or linear.skip_bias_add:
        return output, linear.bias
    return output + linear.bias, None


def megatron_activation(config) -> Activation:
    """The MLP activation of a megatron TransformerConfig (gated: act(first half) * second)."""
    if not config.gated_linear_unit:
        return config.activation_func

    def gated(x: torch.Tensor) -> torch.Tensor:
        gate, linear = torch.chunk(x, 2, dim=-1)
        return config.activation_func(gate) * linear

    return gated


class MetpMLP(MLP):
    """Megatron's MLP whose forward is :func:`memo_ext.metp.mlp.ring_mlp`."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise NotImplementedError("METP's MLP has no per-token scaling (MoE experts)")
        output = ring_mlp(hidden_states, self.linear_fc1.weight, self.linear_fc1.bias,
                          self.linear_fc2.weight, megatron_activation(self.config), _tp_ring())
        return _with_row_bias(output, self.linear_fc2)


class MetpSelfAttention(SelfAttention):
    """Megatron's causal SelfAttention whose forward is
    :func:`memo_ext.metp.attention.two_level_attention` (the spec's core attention is built but
    never called: it has no parameters)."""

    def forward(self, hidden_states, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        unsupported = {"key_value_states": key_value_states, "inference_context":
                       inference_context or inference_params, "rotary_pos_cos": rotary_pos_cos,
                       "rotary_pos_cos_sin": rotary_pos_cos_sin, "attention_bias": attention_bias}
        given = [name for name, value in unsupported.items() if value is not None]
        if given:
            raise NotImplementedError(f"METP attention supports causal self-attention training "
                                      f"only; got {', '.join(given)}")
        ring = _tp_ring()
        layout = ZigzagLayout(hidden_states.shape[0] * ring.size, ring.size)
        rotary = None
        if rotary_pos_emb is not None:
            freqs = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
            local_freqs = freqs[layout.positions(ring.rank).to(freqs.device)]
            # YaRN's attention temperature, on q and k as megatron's SelfAttention applies it.
            mscale = _yarn_get_concentration_factor_from_config(self.config)

            def rotary(t: torch.Tensor) -> torch.Tensor:
                return apply_rotary_pos_emb(t, local_freqs, config=self.config, mscale=mscale)

        shape = HeadShape(self.num_attention_heads_per_partition,
                          self.num_query_groups_per_partition, self.hidden_size_per_attention_head)
        output = two_level_attention(hidden_states, self.linear_qkv.weight, self.linear_qkv.bias,
                                     self.linear_proj.weight, shape, ring, layout, rotary,
                                     documents_of(packed_seq_params, hidden_states))
        return _with_row_bias(output, self.linear_proj)
