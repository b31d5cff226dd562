"""A torch LayerNorm/RMSNorm that works with sequence parallelism.

Replaces megatron.core.transformer.torch_norm.WrappedTorchNorm in the local (non-Transformer-
Engine) layer spec. WrappedTorchNorm asserts ``not config.sequence_parallel``; the only thing a
norm needs under sequence parallelism is that its weight/bias gradients, computed from this
rank's token slice, are summed over the tensor-parallel group. megatron.core's
finalize_model_grads already does that for every parameter tagged ``sequence_parallel=True``,
so the norm only has to carry the tag.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelTorchNorm:
    """Factory with WrappedTorchNorm's signature returning a torch norm tagged for SP."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        if config.layernorm_zero_centered_gamma:
            raise ValueError(
                "--apply-layernorm-1p needs Transformer Engine norms; drop the flag on CPU"
            )
        norm_name = config.normalization
        if norm_name not in _NORMS:
            raise ValueError(
                f"--normalization {norm_name} is not supported without Transformer Engine; "
                f"use one of {', '.join(_NORMS)}"
            )
        norm = _NORMS[norm_name](normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
