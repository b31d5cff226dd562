"""METP: memory-efficient tensor parallelism (docs/metp.md).

Public entry point: :class:`MemoryEfficientTP`. The trainer builds one from a
:class:`memo_ext.config.METPConfig`, builds the model from :meth:`MemoryEfficientTP.layer_spec`
(Megatron's local layer with METP's SelfAttention and MLP: same parameters, ring P2P instead of
all-gather / reduce-scatter) and calls :meth:`MemoryEfficientTP.attach` on each model chunk,
which permutes every sequence into METP's zigzag order on the way in and back on the way out.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from memo_ext.config import METPConfig
from memo_ext.attention import Ring, ZigzagLayout
from memo_ext.metp.attention import HeadShape, two_level_attention
from memo_ext.metp.layers import MetpMLP, MetpSelfAttention
from memo_ext.metp.mlp import ring_mlp

__all__ = ["MemoryEfficientTP", "MetpMLP", "MetpSelfAttention", "ZigzagLayout", "HeadShape",
           "Ring", "ring_mlp", "two_level_attention"]


class MemoryEfficientTP:
    """METP's runtime for one rank (see the module docstring)."""

    def __init__(self, config: METPConfig, *, seq_length: int, tensor_parallel_size: int):
        self.config = config
        self.layout = ZigzagLayout(seq_length, tensor_parallel_size)
        self._order = self.layout.permutation()
        self._inverse = torch.argsort(self._order)

    def describe(self) -> str:
        p = self.layout.size
        return (f"METP: ring P2P tensor parallelism over {p} ranks | zigzag sequence shards of "
                f"2 x {self.layout.chunk} tokens | attention peak vs TP+SP (docs/metp.md) "
                f"(3+2p)/(p(4+p)) = {(3 + 2 * p) / (p * (4 + p)):.3f}")

    def layer_spec(self, spec: ModuleSpec) -> ModuleSpec:
        """``spec`` (a local TransformerLayer ModuleSpec) with METP's attention and MLP."""
        spec = copy.copy(spec)
        spec.submodules = copy.copy(spec.submodules)
        attention = copy.copy(spec.submodules.self_attention)
        attention.module = MetpSelfAttention
        mlp = copy.copy(spec.submodules.mlp)
        mlp.module = MetpMLP
        spec.submodules.self_attention, spec.submodules.mlp = attention, mlp
        return spec

    def attach(self, model_chunk: torch.nn.Module) -> None:
        """Permute tokens, positions and labels into zigzag order before the GPT model and its
        per-token outputs (losses or logits, [b, s, ...]) back after it."""
        for module in model_chunk.modules():
            if isinstance(module, GPTModel):
                module.register_forward_pre_hook(self._to_zigzag, with_kwargs=True)
                module.register_forward_hook(self._from_zigzag)

    def _permute(self, tensor, order):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
            return tensor
        return tensor.index_select(1, order.to(tensor.device))

    def _to_zigzag(self, module, args, kwargs):
        args = tuple(self._permute(a, self._order) if i < 2 else a for i, a in enumerate(args))
        for name in ("input_ids", "position_ids", "labels"):
            if name in kwargs:
                kwargs[name] = self._permute(kwargs[name], self._order)
        return args, kwargs

    def _from_zigzag(self, module, args, output):
        # The last stage returns per-token [b, s] losses or [b, s, V] logits; earlier stages
        # return hidden states that stay in zigzag order for the next stage.
        return self._permute(output, self._inverse) if module.post_process else output
