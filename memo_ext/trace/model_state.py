"""Persistent rank state: the parameters, gradient buffers and optimizer states a rank holds,
collected from (or fabricated for) a model so the trace records them as "init" allocations."""

from __future__ import annotations

import torch

from memo_ext.trace.format import OPTIMIZER
from memo_ext.trace.tagging import _clean_module_name, tagged_allocations

def persistent_tensors(model: torch.nn.Module) -> tuple[list, list]:
    """(parameter-like, gradient) (name, tensor) pairs a rank holds for ``model``: megatron DDP's
    contiguous parameter buffers (distributed optimizer) and fp32 gradient buffers
    (``main_grad``), the parameters themselves (their storage is the buffer's when it exists,
    and is then counted once), and module buffers."""
    params, grads = [], []
    buffers = list(getattr(model, "buffers", []) or [])
    buffers += list(getattr(model, "expert_parallel_buffers", []) or [])
    for index, buffer in enumerate(buffers):
        if not hasattr(buffer, "grad_data"):
            continue
        if getattr(buffer, "param_data", None) is not None:
            params.append((f"ddp.param_buffer.{index}", buffer.param_data))
        grads.append((f"ddp.grad_buffer.{index}", buffer.grad_data))
    params += [(_clean_module_name(n), p) for n, p in model.named_parameters()]
    params += [(_clean_module_name(n), b) for n, b in model.named_buffers()]
    return params, grads


def allocate_optimizer_states(model: torch.nn.Module, use_distributed_optimizer: bool,
                              adam: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Allocate what megatron's optimizer keeps per rank, in its order: fp32 master copies of
    16-bit parameters (at construction), then per parameter Adam's exp_avg and exp_avg_sq (fp32,
    at the first step; SGD with momentum: one buffer). With the distributed optimizer each rank
    holds only its shard of every gradient-buffer bucket (megatron's own range computation,
    DistributedOptimizer._build_gbuf_range_map, over the DP x CP group). Returns (name, tensor)
    pairs the caller keeps alive."""
    shards: list[tuple[str, int, torch.dtype]] = []  # (name, numel, model param dtype)
    names = {p: _clean_module_name(n) for n, p in model.named_parameters()}
    buffers = list(getattr(model, "buffers", []) or [])
    if use_distributed_optimizer and buffers:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for buffer in buffers:
            range_map = DistributedOptimizer._build_gbuf_range_map(buffer)
            for bucket_ranges in range_map.values():
                for bucket in bucket_ranges:
                    for param, ranges in bucket["param_map"].items():
                        shards.append((names.get(param, "?"), ranges["param"].size, param.dtype))
    else:
        shards = [(names[p], p.numel(), p.dtype) for p in model.parameters() if p.requires_grad]
    device = next(model.parameters()).device
    states: list[tuple[str, torch.Tensor]] = []

    def allocate(state_name: str, numel: int) -> None:
        with tagged_allocations(OPTIMIZER, state_name):
            states.append((state_name, torch.empty(numel, dtype=torch.float32, device=device)))

    for name, numel, dtype in shards:
        if dtype in (torch.float16, torch.bfloat16):
            allocate(f"optimizer:{name}.master_fp32", numel)
    for name, numel, _ in shards:
        for kind in (("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)):
            allocate(f"optimizer:{name}.{kind}", numel)
    return states
