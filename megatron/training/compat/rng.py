"""CPU replacements for megatron.core.tensor_parallel.random's CUDA generator access.

``CudaRNGStatesTracker.fork()`` (entered by every ColumnParallelLinear init and attention
dropout, even with dropout 0) saves and restores the CUDA generator through
``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``. On a
CPU build the first raises and the second silently queues a lazy call that never runs, so the
tracker would hand out the same state forever. These replacements use the CPU default
generator, which is where CPU dropout draws from, so forked regions get their own stream
exactly as on CUDA. Because forked regions now draw from the CPU generator, fork()'s warning
"CPU RNG state changed within GPU RNG context" (meant to catch CPU draws inside a CUDA-RNG
region) fires on every dropout; it is filtered out.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.tensor_parallel import random as megatron_random


def _get_cpu_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Replaces megatron.core.tensor_parallel.random._get_cuda_rng_state."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    """Replaces megatron.core.tensor_parallel.random._set_cuda_rng_state."""
    torch.set_rng_state(new_state)


class _DropCpuRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def use_cpu_generator_in_rng_tracker() -> None:
    """Install the CPU generator accessors into megatron.core.tensor_parallel.random."""
    megatron_random._get_cuda_rng_state = _get_cpu_rng_state
    megatron_random._set_cuda_rng_state = _set_cpu_rng_state
    logging.getLogger(megatron_random.__name__).addFilter(_DropCpuRngWarning())
