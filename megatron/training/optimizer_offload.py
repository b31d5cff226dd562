"""Megatron-LM's optimizer CPU offload as the tracer and the log see it: which optimizer shards
--optimizer-cpu-offload keeps on the host, learnt from megatron-core itself, for the tracer
(megatron.training.tracing), and the host tensors a built HybridDeviceOptimizer holds, for the
trainer's log line after its first iteration (bench/host_memory.py compares the two).

The split is not re-derived: the trainer's own optimizer is built -- megatron-core 0.16.1's
parameter groups, DistributedOptimizer and, inside it, HybridDeviceOptimizer, from the
trainer's OptimizerConfig (megatron.training.training.optimizer_config) -- on the traced rank's
model in the tracer's fake world (fake tensors: nothing is allocated), and its
``gpu_params_map_cpu_copy`` read: the parameters whose copies it put on the host. That is
HybridDeviceOptimizer._get_sub_optimizer_param_groups's rule (the first parameters of its
groups, in order, until ``offload_fraction`` of their elements) applied to the groups and
shards DistributedOptimizer hands it (its parameter groups, each this rank's fp32 shards then
its 16-bit ones), so a change in either upstream is followed.

Two things of the real build are stood in for: megatron-core's
``ProcessGroupCollection.setup_process_groups_for_optimizer`` needs gloo groups the fake world
cannot create, so the optimizer is built one level down
(``_get_megatron_optimizer_based_on_param_groups``, with the fake world's data-parallel group);
and ``_get_param_groups`` aligns its group keys over the world with ``all_gather_object``,
which in the fake world (every rank alike) answers this rank's keys for every rank.
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from memo_ext.trace import OptimizerOffload, OptimizerShard
from memo_ext.trace.tagging import _clean_module_name


def _every_rank_answers_mine(object_list, obj, group=None):
    object_list[:] = [obj] * len(object_list)


def build_offloaded_optimizer(args: argparse.Namespace, ddp: torch.nn.Module):
    """The trainer's optimizer for ``ddp`` (megatron-core's DistributedOptimizer with its
    HybridDeviceOptimizer), built in the tracer's fake world (module docstring)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import (
        _get_megatron_optimizer_based_on_param_groups,
        _get_param_groups_and_buffers,
    )

    from megatron.training.fsdp_optimizer_offload import building_sharded_offload
    from megatron.training.training import optimizer_config

    config = optimizer_config(args)
    with mock.patch("torch.distributed.all_gather_object", _every_rank_answers_mine):
        param_groups, buffers = _get_param_groups_and_buffers(
            [ddp], model_chunk_offset=0, config=config, config_overrides=None,
            filter_fn=lambda group: not group["is_expert_parallel"], buffer_name="buffers")
    with building_sharded_offload():
        return _get_megatron_optimizer_based_on_param_groups(
            config, [ddp], param_groups, per_model_buffers=buffers,
            model_parallel_group=parallel_state.get_model_parallel_group(),
            data_parallel_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            data_parallel_group_idx=parallel_state.get_model_parallel_group().rank())


def offload_split(optimizer) -> OptimizerOffload:
    """The shards of a built DistributedOptimizer with HybridDeviceOptimizer inside, in the
    latter's order, each with its parameter's name and whether it is offloaded."""
    hybrid = optimizer.optimizer
    if optimizer.ddp_config.use_megatron_fsdp:
        return _fsdp_offload_split(optimizer)
    model_param_of = {}
    for model_groups, shard_groups in ((optimizer.model_float16_groups,
                                        optimizer.shard_float16_groups),
                                       (optimizer.model_fp32_groups,
                                        optimizer.shard_fp32_groups)):
        for model_group, shard_group in zip(model_groups, shard_groups):
            for model_param, shard in zip(model_group, shard_group):
                model_param_of[shard] = model_param
    names = {}
    for model_chunk in optimizer.model_chunks:
        names.update({param: _clean_module_name(name)
                      for name, param in model_chunk.named_parameters()})
    shards = []
    for group in hybrid.param_groups:
        for shard in group["params"]:
            model_param = model_param_of[shard]
            shards.append(OptimizerShard(names.get(model_param, "?"), shard.numel(),
                                         model_param.dtype,
                                         shard in hybrid.gpu_params_map_cpu_copy))
    return OptimizerOffload(tuple(shards), pin_cpu_grads=hybrid.pin_cpu_grads)


def _fsdp_offload_split(optimizer) -> OptimizerOffload:
    """:func:`offload_split` under Megatron-FSDP: HybridDeviceOptimizer steps the DTensors of
    its ``optimizer_named_parameters`` (this rank's shards of the fp32 main weights), split on
    their local shards (megatron.training.fsdp_optimizer_offload); a shard's dtype is its own
    (no 16-bit parameter reaches the optimizer). A shard with no elements on this rank gets
    no gradient (megatron_fsdp/param_and_grad_buffer.py:2669-2670), so no state, and holds
    nothing: it is left out, as without offload (memo_ext.trace.model_state)."""
    from megatron.core.utils import to_local_if_dtensor as _local

    hybrid = optimizer.optimizer
    names = {param: _clean_module_name(name) for model_chunk in optimizer.model_chunks
             for name, param in model_chunk.param_and_grad_buffer.optimizer_named_parameters}
    shards = tuple(OptimizerShard(names.get(param, "?"), _local(param).numel(), param.dtype,
                                  param in hybrid.gpu_params_map_cpu_copy)
                   for group in hybrid.param_groups for param in group["params"]
                   if _local(param).numel() > 0)
    return OptimizerOffload(shards, pin_cpu_grads=hybrid.pin_cpu_grads)


def traced_offload_split(args: argparse.Namespace, ddp: torch.nn.Module) -> OptimizerOffload:
    """:func:`offload_split` of the trainer's optimizer for ``ddp`` (built, read, dropped).
    Building it leaves each model parameter a ``main_param`` (None with the precision-aware
    optimizer) and ``main_param_sharded``, which nothing the tracer runs reads."""
    return offload_split(build_offloaded_optimizer(args, ddp))


def hybrid_optimizer_of(optimizer):
    """The HybridDeviceOptimizer inside the trainer's optimizer (a DistributedOptimizer, or a
    ChainedOptimizer of them: the first that has one), or None."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(getattr(inner, "optimizer", None), HybridDeviceOptimizer):
            return inner.optimizer
    return None


def host_tensors(hybrid) -> list[torch.Tensor]:
    """What a HybridDeviceOptimizer holds on the host, one tensor per storage: its host
    sub-optimizers' parameters (the host copies) and their states (step, exp_avg, exp_avg_sq),
    and the host gradient copies (``cpu_copy_map_grad``)."""
    found = [param for optimizer in hybrid.cpu_optimizers
             for group in optimizer.param_groups for param in group["params"]]
    found += [value for optimizer in hybrid.cpu_optimizers
              for state in optimizer.state.values() for value in state.values()
              if isinstance(value, torch.Tensor)]
    found += list(hybrid.cpu_copy_map_grad.values())
    seen, unique = set(), []
    for tensor in found:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in seen:
            seen.add(pointer)
            unique.append(tensor)
    return unique


def host_tensors_line(optimizer, rank: int, iteration: int) -> str:
    """The log line of this rank's host tensors of --optimizer-cpu-offload (bench/host_memory.py
    reads it): how many storages, their bytes (``untyped_storage().nbytes()``)."""
    tensors = host_tensors(hybrid_optimizer_of(optimizer))
    nbytes = sum(tensor.untyped_storage().nbytes() for tensor in tensors)
    return (f"> optimizer CPU offload host tensors [rank {rank}, after iteration {iteration}]: "
            f"{len(tensors)} storages, {nbytes} B")
