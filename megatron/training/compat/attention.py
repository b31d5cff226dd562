"""Core attention on torch's scaled_dot_product_attention, with context parallelism.

Replaces megatron.core.transformer.dot_product_attention.DotProductAttention in the local
(non-Transformer-Engine) layer spec. Two reasons:
- DotProductAttention refuses context_parallel_size > 1 ("only supported by
  TEDotProductAttention"), and TE does not exist on CPU.
- It materialises the [b, heads, s, s] score tensor through a global buffer; SDPA's causal
  kernel does not, which keeps CPU tests fast and long sequences feasible.

Context parallelism: megatron.core.utils.get_batch_on_this_cp_rank gives CP rank r the
sequence chunks r and 2*CP-1-r (of 2*CP equal chunks). K and V are all-gathered over the CP
group (megatron.core's sequence-parallel gather: all-gather forward, reduce-scatter backward)
and a causal mask over global token positions is applied. The mask is [s_local, s_global]
booleans: fine for CPU tests, not for million-token runs (use TE's ring attention there).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


def load_balanced_positions(local_length: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global token positions held by ``cp_rank`` under Megatron's load-balanced CP split.

    The rank holds chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``, each ``local_length/2``
    tokens long. Returns an int64 tensor of ``local_length`` positions.
    """
    chunk = local_length // 2
    first = torch.arange(chunk) + cp_rank * chunk
    second = torch.arange(chunk) + (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, second])


class SDPACoreAttention(MegatronModule):
    """Self-attention core (causal or unmasked): [s, b, heads, d] q/k/v -> [s, b, heads*d]."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(
                f"SDPACoreAttention supports causal and no_mask, got {attn_mask_type.name}"
            )
        if attn_mask_type != AttnMaskType.causal and config.context_parallel_size > 1:
            raise ValueError("context parallelism needs the causal mask")
        self.is_causal = attn_mask_type == AttnMaskType.causal
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_size = config.context_parallel_size

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed sequences nor bias")
        local_length = query.size(0)
        mask = None
        is_causal = self.is_causal
        if self.cp_size > 1:
            cp_group = parallel_state.get_context_parallel_group()
            key = tensor_parallel.gather_from_sequence_parallel_region(key, group=cp_group)
            value = tensor_parallel.gather_from_sequence_parallel_region(value, group=cp_group)
            query_positions = load_balanced_positions(
                local_length, parallel_state.get_context_parallel_rank(), self.cp_size
            )
            key_positions = torch.cat(
                [load_balanced_positions(local_length, r, self.cp_size) for r in range(self.cp_size)]
            )
            mask = (query_positions[:, None] >= key_positions[None, :]).to(query.device)
            is_causal = False

        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork():
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=self.heads_per_partition != self.query_groups_per_partition,
            )
        # [b, n, s, d] -> [s, b, n*d]
        return context.permute(2, 0, 1, 3).reshape(local_length, q.size(0), -1)
