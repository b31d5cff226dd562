"""Gradient clipping that accepts CPU gradients.

Replaces megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32 as imported by
megatron.core.optimizer.optimizer: the original asserts ``grad.type() ==
'torch.cuda.FloatTensor'``. The norm itself (get_grad_norm_fp32) already runs on CPU once
devices are redirected (compat.devices), so only the scaling step is replaced.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.utils import to_local_if_dtensor

# Same epsilon as megatron.core so clipping coefficients match bit for bit.
_NORM_EPSILON = 1.0e-6


def clip_grad_by_total_norm_cpu(
    parameters: Union[Iterable[torch.Tensor], torch.Tensor],
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale fp32 gradients in place by ``max_norm / total_norm`` when that is below 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        grad = getattr(param, attribute, None)
        if grad is not None:
            if grad.dtype != torch.float32:
                raise TypeError(f"clip_grad_by_total_norm expects fp32 grads, got {grad.dtype}")
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + _NORM_EPSILON)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def use_cpu_grad_clipping() -> None:
    """Install :func:`clip_grad_by_total_norm_cpu` where megatron.core's optimizer looks it up."""
    megatron_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu
