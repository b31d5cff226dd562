"""Persistent rank state: the parameters, gradient buffers and optimizer states a rank holds,
collected from (or fabricated for) a model so the trace records them as "init" allocations."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from memo_ext.trace.format import OPTIMIZER
from memo_ext.trace.tagging import _clean_module_name, tagged_allocations

#: Ends the name of a host allocation that is page-locked on CUDA (the host model rounds it as
#: PyTorch's pinned allocator does: memo_ext.estimate.host_memory).
PINNED_MARK = " [pinned]"

def persistent_tensors(model: torch.nn.Module) -> tuple[list, list]:
    """(parameter-like, gradient) (name, tensor) pairs a rank holds for ``model``: megatron DDP's
    contiguous parameter buffers (distributed optimizer) and fp32 gradient buffers
    (``main_grad``), the parameters themselves (their storage is the buffer's when it exists,
    and is then counted once), and module buffers."""
    if hasattr(model, "param_and_grad_buffer"):
        return _fsdp_persistent_tensors(model)
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


#: megatron-core Megatron-FSDP's buffers of a parameter group, parameter-like then gradient.
FSDP_PARAM_BUFFERS = ("model_weight_buffer", "transpose_weight_buffer", "main_weight_buffer",
                      "hsdp_wbuf")
FSDP_GRAD_BUFFERS = ("main_grad_buffer", "hsdp_gbuf")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (Megatron-FSDP's parameters are DTensors), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _fsdp_persistent_tensors(model: torch.nn.Module) -> tuple[list, list]:
    """persistent_tensors of a model wrapped in megatron-core's Megatron-FSDP
    (--use-megatron-fsdp): each parameter group's buffers as its ParamAndGradBuffer allocated
    them (the weight shard or whole weights, fp32 main weights, main gradients, per
    --data-parallel-sharding-strategy), the parameters' local shards (views into them) and
    module buffers. A ZeRO-3 group's all-gather bucket is freed after construction (its storage
    resized to 0): transient, not persistent."""
    params, grads = [], []
    for index, group in enumerate(model.param_and_grad_buffer.parameter_groups):
        for kinds, found in ((FSDP_PARAM_BUFFERS, params), (FSDP_GRAD_BUFFERS, grads)):
            for kind in kinds:
                buffer = getattr(group, kind, None)
                if buffer is not None and getattr(buffer, "data", None) is not None:
                    found.append((f"fsdp.{kind}.{index}", buffer.data))
    params += [(_clean_module_name(n), _local(p)) for n, p in model.named_parameters()]
    params += [(_clean_module_name(n), b) for n, b in model.named_buffers()]
    return params, grads


def _fsdp_optimizer_shards(model: torch.nn.Module) -> list[tuple[str, int, torch.dtype]]:
    """What megatron's DistributedOptimizer steps under Megatron-FSDP: its
    ``optimizer_named_parameters``, DTensors over this rank's shard of the main (else model)
    weight buffer; a shard may be empty on this rank."""
    return [(_clean_module_name(name), _local(param).numel(), _local(param).dtype)
            for name, param in model.param_and_grad_buffer.optimizer_named_parameters
            if param.requires_grad and _local(param).numel() > 0]


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
    fsdp = hasattr(model, "param_and_grad_buffer")
    buffers = [] if fsdp else list(getattr(model, "buffers", []) or [])
    if fsdp:
        # the master weights are Megatron-FSDP's main weight buffer (registered as a parameter)
        shards = _fsdp_optimizer_shards(model)
    elif use_distributed_optimizer and buffers:
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


@dataclass(frozen=True)
class OptimizerShard:
    """One parameter shard the optimizer updates, in its order: the parameter's name, its
    elements on this rank, the model parameter's dtype, and whether megatron-core's
    HybridDeviceOptimizer keeps its copy, gradient and Adam states on the host."""

    name: str
    numel: int
    dtype: torch.dtype
    host: bool


@dataclass(frozen=True)
class OptimizerOffload:
    """--optimizer-cpu-offload's split for one rank (the shards in the optimizer's order, as
    the tracer engine learns it from megatron-core: megatron.training.optimizer_offload) and
    --no-pin-cpu-grads."""

    shards: tuple[OptimizerShard, ...]
    pin_cpu_grads: bool = True

    @property
    def host_numel(self) -> int:
        return sum(shard.numel for shard in self.shards if shard.host)


#: A torch optimizer's step counter: a 0-d fp32 tensor per parameter, on the parameter's device
#: (torch.optim.AdamW, fused: _init_group).
STEP_BYTES = 4


def allocate_offloaded_optimizer_states(
        offload: OptimizerOffload, device: torch.device,
        host_scope: Callable[[], contextlib.AbstractContextManager]
) -> list[tuple[str, torch.Tensor]]:
    """Allocate what megatron-core 0.16.1's HybridDeviceOptimizer (param_update_in_fp32, Adam)
    holds for ``offload``'s shards, device and host, in its order
    (megatron.core.optimizer.cpu_offloading.hybrid_optimizer):

    - at construction (``_get_sub_optimizer_param_groups``): a device shard of a 16-bit
      parameter gets an fp32 copy on the device (``.float()``); a host shard gets a host copy,
      ``clone().cpu().pin_memory()`` -- itself the host parameter when fp32 (page-locked) --
      and for a 16-bit parameter an fp32 copy of that (``.float()``, pageable: the pinned
      16-bit copy is dropped);
    - at the first step: each host shard's fp32 gradient copy (``torch.empty(pin_memory=
      pin_cpu_grads)``, ``_set_sub_optimizer_grads``), then the states of the device Adam
      (exp_avg and exp_avg_sq, fp32; a step counter, 4 B, is not modelled, as without
      offload) and of the host AdamW (its step, exp_avg and exp_avg_sq: fp32, on the host
      copy's device, pageable), in ``step``'s order.

    Host allocations are made inside ``host_scope()`` (the recorder's pool "host"), named
    with :data:`PINNED_MARK` where page-locked. Returns (name, tensor) pairs the caller keeps
    alive.

    Written out rather than run: the split is the real optimizer's (``offload``), but its
    gradient copies and Adam states appear only in its first ``step``, which would need
    gradients and a fused AdamW on fake tensors, with each state told apart as host or device
    for the recorder. tests/unit/megatron/training/test_optimizer_offload_trace.py compares
    these bytes with the real optimizer's, built and stepped by the trainer on CPU."""
    states: list[tuple[str, torch.Tensor]] = []
    host_shards = [shard for shard in offload.shards if shard.host]
    device_shards = [shard for shard in offload.shards if not shard.host]

    def allocate(state_name: str, nbytes: int, on_host: bool, pinned: bool = False) -> None:
        name = f"optimizer:{state_name}{PINNED_MARK if pinned else ''}"
        scope = host_scope() if on_host else contextlib.nullcontext()
        with scope, tagged_allocations(OPTIMIZER, name):
            states.append((name, torch.empty(nbytes, dtype=torch.uint8, device=device)))

    for shard in offload.shards:  # construction, in the optimizer's order
        if shard.host:
            allocate(f"{shard.name}.host_param", 4 * shard.numel, True,
                     pinned=shard.dtype == torch.float32)
        elif shard.dtype != torch.float32:
            allocate(f"{shard.name}.master_fp32", 4 * shard.numel, False)
    for shard in host_shards:  # the first step: gradients to the host, then the host step
        allocate(f"{shard.name}.host_grad", 4 * shard.numel, True, pinned=offload.pin_cpu_grads)
    for shard in device_shards:  # step(): the device optimizer first, then the host ones
        for kind in ("exp_avg", "exp_avg_sq"):
            allocate(f"{shard.name}.{kind}", 4 * shard.numel, False)
    for shard in host_shards:
        allocate(f"{shard.name}.host_step", STEP_BYTES, True)
        for kind in ("exp_avg", "exp_avg_sq"):
            allocate(f"{shard.name}.host_{kind}", 4 * shard.numel, True)
    return states


def offloaded_elements(events) -> tuple[tuple[int, ...], int]:
    """(elements of each shard on the host, in the optimizer's order; elements of the device
    part) of the optimizer states :func:`allocate_offloaded_optimizer_states` recorded in
    ``events`` (a trace's): read from the host gradient copies and the device exp_avg."""
    host, device = [], 0
    for event in events:
        if event["action"] != "alloc" or event.get("category") != OPTIMIZER:
            continue
        name = (event.get("module") or "").removesuffix(PINNED_MARK)
        if name.endswith(".host_grad"):
            host.append(int(event["bytes"]) // 4)
        elif name.endswith(".exp_avg") and ".host_" not in name:
            device += int(event["bytes"]) // 4
    return tuple(host), device
