"""``--apply-layernorm-1p`` in the local layers: zero-centred gamma.

megatron-core's ``layernorm_zero_centered_gamma`` (Transformer Engine's ``zero_centered_gamma``)
stores a norm's scale as ``weight`` with the norm applying ``1 + weight``, the weight starting
at 0: weight decay and the initial value are both centred on the identity scale. The torch
norms of the local spec lack it (megatron.training.compat.norm refuses the flag), so
:class:`ZeroCenteredTorchNorm` builds LayerNorm/RMSNorm modules that apply ``1 + weight``,
tagged for sequence parallelism like the compat norm. Same parameters, same shapes: a
checkpoint records the flag (megatron.training.checkpointing.ARCHITECTURE_ARGS), since the
stored weights mean ``gamma - 1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


class _ZeroCentered:
    """The weight starts at 0 (the scale 1 + weight at 1)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)


class ZeroCenteredLayerNorm(_ZeroCentered, torch.nn.LayerNorm):
    """LayerNorm applying ``1 + weight``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(_ZeroCentered, torch.nn.RMSNorm):
    """RMSNorm applying ``1 + weight``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(input, self.normalized_shape, self.weight + 1, self.eps)


_NORMS = {"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}


class ZeroCenteredTorchNorm:
    """Factory with WrappedTorchNorm's signature: the zero-centred norm of
    ``config.normalization``, its parameters tagged ``sequence_parallel`` (finalize_model_grads
    then sums their gradients over the tensor-parallel group)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm"):
        if config.normalization not in _NORMS:
            raise ValueError(f"--normalization {config.normalization} is not supported without "
                             f"Transformer Engine; use one of {', '.join(_NORMS)}")
        norm = _NORMS[config.normalization](hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
