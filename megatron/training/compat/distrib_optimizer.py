"""The distributed optimizer's parameter type checks, answered for CPU parameters.

megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__ sorts the model's
parameters by ``param.type()`` (directly, and in its static ``_build_model_and_main_param_groups``):
``'torch.cuda.HalfTensor'``/``'torch.cuda.BFloat16Tensor'`` get an fp32 main copy of their shard,
``'torch.cuda.FloatTensor'`` is optimised in place through a view of its shard, and anything else
raises ``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...``. A CPU
parameter answers ``'torch.FloatTensor'``, so the constructor refuses every CPU model, although
nothing after the sort depends on the device (the gradient buffer, its shards and the
collectives are device-agnostic once compat.devices redirects megatron.core's CUDA placement).

:func:`sort_cpu_parameters_as_cuda` wraps the constructor so that, while it runs, a CPU floating
tensor's ``type()`` (without arguments) answers the CUDA spelling of its dtype, the name the same
parameter would have on the GPU build: the constructor then takes the branch it takes on CUDA.
``Tensor.type`` is restored when the constructor returns or raises; ``type(dtype)`` conversions
and every other tensor are untouched.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

# The CPU ``type()`` names and their CUDA spellings, for the dtypes DistributedOptimizer accepts.
CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextmanager
def cuda_type_names():
    """Within the block, ``tensor.type()`` of a CPU fp32/fp16/bf16 tensor answers the CUDA name."""
    original = torch.Tensor.type

    def type_named_as_on_cuda(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_named_as_on_cuda
    try:
        yield
    finally:
        torch.Tensor.type = original


def run_within(owner: type, name: str, context) -> None:
    """Make the method ``owner.name`` run within a fresh ``context()`` each call (once: a
    method already wrapped is left alone)."""
    method = getattr(owner, name)
    if getattr(method, "_cpu_shim", False):
        return

    @functools.wraps(method)
    def method_within_context(self, *args, **kwargs):
        with context():
            return method(self, *args, **kwargs)

    method_within_context._cpu_shim = True
    setattr(owner, name, method_within_context)


def sort_cpu_parameters_as_cuda() -> None:
    """Run DistributedOptimizer's constructor within :func:`cuda_type_names` (once)."""
    run_within(DistributedOptimizer, "__init__", cuda_type_names)
