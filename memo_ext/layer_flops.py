"""Forward FLOPs of one GPT transformer layer per token, split into the part every token does
(the linear layers) and the part that grows with the keys a token attends to (causal
attention). SPPO cuts subsequences of equal work with it (memo_ext.sppo.partition) and MEMO's
offload modes weigh recomputation with it (memo_ext.offload.position_wise_share_of).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one transformer layer per token: ``linear`` for every token (QKV,
    attention projection, MLP), ``attention_per_key`` for each key a query attends to
    (Q·K^T and P·V: 4 FLOPs per head dimension)."""

    linear: float
    attention_per_key: float

    @classmethod
    def of_gpt_layer(cls, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                     num_query_groups: int, kv_channels: int, swiglu: bool) -> "LayerFlops":
        """The per-token FLOPs of a Megatron GPT layer (multiply-adds count 2)."""
        query_width = num_attention_heads * kv_channels
        kv_width = num_query_groups * kv_channels
        qkv = hidden_size * (query_width + 2 * kv_width)
        projection = query_width * hidden_size
        mlp = hidden_size * ffn_hidden_size * (3 if swiglu else 2)
        return cls(linear=2.0 * (qkv + projection + mlp), attention_per_key=4.0 * query_width)

    def up_to(self, token: float) -> float:
        """Causal forward FLOPs of tokens ``[0, token)``: W(x) = linear*x + attention*x^2/2."""
        return self.linear * token + self.attention_per_key / 2.0 * token * token

    def token_at(self, work: float) -> float:
        """The inverse of :meth:`up_to`: the (fractional) token where ``work`` FLOPs end."""
        half = self.attention_per_key / 2.0
        if half == 0:
            return work / self.linear
        return (-self.linear + math.sqrt(self.linear ** 2 + 4 * half * work)) / (2 * half)

    def of_range(self, start: int, end: int) -> float:
        """Causal forward FLOPs of tokens ``[start, end)`` (each attends to all earlier keys)."""
        tokens = end - start
        return self.linear * tokens + self.attention_per_key * tokens * (start + end) / 2.0


__all__ = ["LayerFlops"]
