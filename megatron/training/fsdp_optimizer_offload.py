"""Optimizer CPU offload of Megatron-FSDP's shards (``--use-megatron-fsdp
--optimizer-cpu-offload``): ZeRO-3 with Adam's states and the fp32 master weights stepped on
the host (the device keeps Megatron-FSDP's own fp32 main-weight shard, which the host step is
copied back into: megatron-core 0.16.1 has no switch to drop it).

megatron-core 0.16.1 builds its HybridDeviceOptimizer (``--optimizer-cpu-offload``) over
whatever parameters the distributed optimizer hands it. Under Megatron-FSDP those are DTensors
(each rank's shard of a parameter, wrapped with the whole parameter's shape), and three of its
steps assume plain tensors, so the first step fails on any device (Megatron-LM issue 1986;
upstream's fix, Megatron-LM pull request 4623, takes the same route as here: the local shard):

- the split (``_get_sub_optimizer_param_groups``) weighs parameters by ``numel()``, a DTensor's
  *global* element count, and makes each host copy with ``param.detach().clone().cpu()``, a
  DTensor again;
- the host gradient (``_set_sub_optimizer_grads``) is ``torch.empty(param.shape)``, the
  global shape, into which the DTensor gradient is copied ("mixed torch.Tensor and DTensor");
- the copy back after the host step (``_register_param_copy_back_gpu_hook``) copies a plain
  host tensor into the DTensor.

:class:`ShardedHybridDeviceOptimizer` is megatron-core's class with its split done on each
DTensor's local shard: the same rule (parameters in order until ``offload_fraction`` of the
rank's elements), a host copy of the local shard, and, as the device counterpart its gradient
copy and copy back use, the shard itself (:class:`LocalShard`). Everything else -- the
sub-optimizers, streams, state syncing -- is megatron-core's. The optimizer states of the host
part are then plain host tensors of the local shard's shape;
:meth:`~ShardedHybridDeviceOptimizer.state_as_dtensors` gives the fsdp_dtensor checkpoint each
one as a DTensor laid out like its parameter (what Adam's states of the device part already
are), without a device copy.

Megatron-FSDP's gradients reach the optimizer in two attributes at once here. Its buffer
attaches each reduced gradient shard as ``.grad`` (param_and_grad_buffer.py:2674-2678; its
``decoupled_grad`` branch hangs on an attribute 0.16.1 never sets), and the gradient norm reads
``.grad`` of a Megatron-FSDP parameter (optimizer.py:149), while the precision-aware optimizer,
which offload needs, clips and offloads ``decoupled_grad`` (optimizer.py:219,
hybrid_optimizer.py:102). :func:`hand_gradients_as_decoupled` makes ``decoupled_grad`` the
same tensor as ``.grad`` after each attachment, so the norm, the clipping and both
sub-optimizers see one gradient, as without offload.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from unittest import mock

import torch
from torch.distributed.tensor import DTensor

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron.core.utils import to_local_if_dtensor as _local


class LocalShard:
    """What HybridDeviceOptimizer reads of a host copy's device parameter, for a DTensor: its
    local shard's gradient (``decoupled_grad`` or ``grad``) and data, the part the host copy
    mirrors."""

    def __init__(self, param: DTensor):
        self.param = param

    @property
    def decoupled_grad(self):
        grad = getattr(self.param, "decoupled_grad", None)
        if grad is None:
            raise AttributeError("decoupled_grad")
        return _local(grad)

    @property
    def grad(self):
        grad = self.param.grad
        return None if grad is None else _local(grad)

    @property
    def data(self):
        return _local(self.param).data


class ShardedHybridDeviceOptimizer(HybridDeviceOptimizer):
    """megatron-core's HybridDeviceOptimizer, split on DTensors' local shards (module
    docstring); on plain tensors it is megatron-core's."""

    def _get_sub_optimizer_param_groups(self, offload_fraction: float):
        """hybrid_optimizer.py:251-300's rule on each parameter's local shard."""
        params = [param for group in self.param_groups for param in group["params"]]
        if not any(isinstance(param, DTensor) for param in params):
            return super()._get_sub_optimizer_param_groups(offload_fraction)
        offload_threshold = sum(_local(p).numel() for p in params if p.is_cuda) * offload_fraction
        offloaded = 0
        cpu_groups, gpu_groups = [], []
        gpu_params_map_cpu_copy, cpu_copys_map_gpu_param, param_to_fp32_param = {}, {}, {}
        for group in self.param_groups:
            gpu_group, cpu_group = {**group, "params": []}, {**group, "params": []}
            for param in group["params"]:
                inner, host_copy = param, False
                if offloaded < offload_threshold and param.is_cuda:
                    inner = _local(param).detach().clone().cpu().pin_memory()
                    offloaded += inner.numel()
                    host_copy = True
                if self.param_update_in_fp32 and inner.dtype != torch.float32:
                    inner = inner.detach().clone().float()
                    param_to_fp32_param[param] = inner
                if host_copy:
                    gpu_params_map_cpu_copy[param] = inner
                    cpu_copys_map_gpu_param[inner] = (LocalShard(param)
                                                      if isinstance(param, DTensor) else param)
                (gpu_group if inner.is_cuda else cpu_group)["params"].append(inner)
            for part, groups in ((gpu_group, gpu_groups), (cpu_group, cpu_groups)):
                if part["params"]:
                    groups.append(part)
        return (cpu_groups, gpu_groups, gpu_params_map_cpu_copy, cpu_copys_map_gpu_param,
                param_to_fp32_param)

    def _move_new_state_to_right_device(self):
        """megatron-core's, then the host optimizers' states of a DTensor parameter as plain
        host tensors of its local shard, as their parameters are: a checkpoint loads them as
        DTensors (:meth:`state_as_dtensors`), and torch's AdamW refuses to mix the two."""
        super()._move_new_state_to_right_device()
        for optimizer in self.cpu_optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, DTensor):
                        state[key] = _local(value)

    def _update_fp32_params_by_new_state(self):
        """After a load, refresh the fp32 copies of 16-bit parameters from their loaded
        ``master_param``. megatron-core 0.16.1 looks one up for every parameter and raises
        KeyError for an fp32 one (Megatron-FSDP's main weights are fp32, so every one of them);
        Megatron-LM skips them after 0.16.1. A state without ``master_param`` (an fsdp_dtensor
        checkpoint's: :meth:`state_as_dtensors`) keeps the copy made from the loaded
        parameter."""
        if not self.param_update_in_fp32:
            return
        for param, state in self.state.items():
            fp32_copy = self.param_to_fp32_param.get(param)
            if fp32_copy is not None and "master_param" in state:
                fp32_copy.data.copy_(state["master_param"])

    def state_as_dtensors(self) -> None:
        """The state as an fsdp_dtensor checkpoint saves and loads it: each host tensor of a
        DTensor parameter's local shard as a DTensor laid out like the parameter (a view: a
        load writes into the host tensor; nothing is copied to the device), as the device
        part's states already are, and without ``master_param`` (the parameter itself, which
        the model state holds; the states are then those of a run without offload; its
        parameter groups' options are HybridDeviceOptimizer's). Until the next step rebuilds
        it from the sub-optimizers."""
        def as_dtensor(param, value):
            if isinstance(value, DTensor) or not isinstance(param, DTensor) or value.dim() == 0:
                return value
            return DTensor(value.view(_local(param).shape), param._spec,
                           requires_grad=False)

        self.state = defaultdict(dict, {
            param: {key: as_dtensor(param, value) for key, value in state.items()
                    if key != "master_param"}
            for param, state in self.state.items()})


def hand_gradients_as_decoupled(fsdp_model) -> None:
    """After Megatron-FSDP attaches its gradient shards (``update_main_grads``), each optimizer
    parameter's ``decoupled_grad`` is its ``.grad`` (module docstring)."""
    buffer = fsdp_model.param_and_grad_buffer
    attach = buffer.update_main_grads

    @functools.wraps(attach)
    def attach_as_decoupled_too():
        attach()
        for _, param in buffer.optimizer_named_parameters:
            param.decoupled_grad = param.grad

    buffer.update_main_grads = attach_as_decoupled_too


@contextlib.contextmanager
def building_sharded_offload():
    """megatron-core builds :class:`ShardedHybridDeviceOptimizer` where it builds
    HybridDeviceOptimizer: in its optimizer factory (megatron.core.optimizer, line 336 of its
    __init__) and again inside DistributedOptimizer (distrib_optimizer.py:603, which rebuilds
    it over its shards)."""
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer

    with mock.patch.object(optimizer, "HybridDeviceOptimizer", ShardedHybridDeviceOptimizer), \
            mock.patch.object(distrib_optimizer, "HybridDeviceOptimizer",
                              ShardedHybridDeviceOptimizer):
        yield
