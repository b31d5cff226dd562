"""megatron-core's optimizer CPU offload (HybridDeviceOptimizer) on CPU torch.

With --optimizer-cpu-offload, megatron-core 0.16.1 builds
megatron.core.optimizer.cpu_offloading.HybridDeviceOptimizer inside the distributed optimizer: it
splits the parameters it is given into a device part (updated by a device optimizer) and, by
``offload_fraction`` of their elements, a host part (a host copy of each parameter, updated by
torch's AdamW on the host), copies the gradients device-to-host before the step and the updated
parameters host-to-device after it. On CPU the "device" is host memory too (compat.devices
redirects megatron-core's CUDA placement), but the same split, copies and sub-optimizers run;
the shims below answer the CUDA questions that code asks, as the GPU build would. Each is
applied by compat.apply_cpu_shims, so on CUDA none of them applies.

- :func:`split_as_on_the_gpu_build` -- HybridDeviceOptimizer._get_sub_optimizer_param_groups
  decides the split by ``param.is_cuda`` and makes the host copies with ``.cpu().pin_memory()``.
- :func:`answer_te_version_without_te` -- OptimizerConfig.__post_init__ (every
  --use-precision-aware-optimizer, which offload needs) compares Transformer Engine's version.
- :func:`offload_fp32_parameters` -- two places where 0.16.1's offload path assumes 16-bit
  parameters; on CPU parameters are fp32 (no mixed precision without CUDA).

The streams and events HybridDeviceOptimizer synchronises its copies with are compat.devices'
(``torch.cuda.Stream``, ``Stream.record_event``, ``Event.wait``/``synchronize``).
"""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


class HostAndDevice(TorchFunctionMode):
    """Within the block, tensors are told apart as on the GPU build: every tensor lives on the
    device (``is_cuda`` True) except the host tensors -- what ``.cpu()`` returned and anything
    computed from a host tensor.

    Upstream, on the GPU build: ``is_cuda`` says whether a tensor's memory is the GPU's;
    ``Tensor.cpu()`` of a CUDA tensor returns a new host tensor (a device-to-host copy) and of a
    host tensor the tensor itself; ``Tensor.pin_memory()`` of a host tensor returns a copy in
    page-locked host memory (the device's DMA engine copies from it asynchronously) and of a
    CUDA tensor raises. On CPU torch every tensor answers ``is_cuda`` False, ``.cpu()`` returns
    the tensor itself and ``pin_memory()`` raises ("Cannot access accelerator device when none
    is available"), so HybridDeviceOptimizer would see no device parameter to split.

    Here: ``is_cuda`` is False for host tensors only; ``.cpu()`` of a device tensor returns a
    copy (a distinct tensor, as the device-to-host copy is) marked host; ``pin_memory()`` of a
    host tensor returns a copy marked host (no page locking: there is no device to copy to
    it), and of a device tensor raises torch's error for a CUDA tensor. Nothing else changes.
    """

    def __init__(self):
        super().__init__()
        self._host: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive: ids stay unique)

    def is_host(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._host

    def _mark_host(self, result):
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor):
                self._host[id(value)] = value
        return result

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.is_cuda.__get__:
            return not self.is_host(args[0])
        if func is torch.Tensor.cpu:
            tensor = args[0]
            return tensor if self.is_host(tensor) else self._mark_host(tensor.detach().clone())
        if func is torch.Tensor.pin_memory:
            tensor = args[0]
            if not self.is_host(tensor):
                raise RuntimeError(f"cannot pin '{tensor.type().replace('torch.', 'torch.cuda.')}'"
                                   " only dense CPU tensors can be pinned")
            return self._mark_host(tensor.clone())
        result = func(*args, **kwargs)
        inputs = [value for value in tree_flatten((args, kwargs))[0]
                  if isinstance(value, torch.Tensor)]
        if any(self.is_host(value) for value in inputs):
            self._mark_host(result)
        return result


def split_as_on_the_gpu_build() -> None:
    """Run HybridDeviceOptimizer's split (``_get_sub_optimizer_param_groups``, called when it is
    built and again after every load_state_dict) within :class:`HostAndDevice` (once).

    Upstream: the parameters it is given are CUDA tensors; the first ``offload_fraction`` of
    their elements (in order) get a host copy, ``param.detach().clone().cpu().pin_memory()``,
    which the host optimizer updates, the rest stay with the device optimizer. On CPU without
    the shim no parameter answers ``is_cuda``: nothing is offloaded, every parameter lands in
    the host groups without a copy, and the first step fails (KeyError in
    ``cpu_copys_map_gpu_param``). Within the block, the split sees the parameters on the
    device and its copies on the host, and produces the groups and maps the GPU build does."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    from megatron.training.compat.distrib_optimizer import run_within
    from megatron.training.fsdp_optimizer_offload import ShardedHybridDeviceOptimizer

    for cls in (HybridDeviceOptimizer, ShardedHybridDeviceOptimizer):
        run_within(cls, "_get_sub_optimizer_param_groups", HostAndDevice)


def answer_te_version_without_te() -> None:
    """``is_te_min_version`` as OptimizerConfig sees it: False where Transformer Engine is not
    installed.

    Upstream: OptimizerConfig.__post_init__, for --use-precision-aware-optimizer, turns
    ``store_param_remainders`` off when ``is_te_min_version("2.1.0")`` is False (the option is
    TE's FusedAdam's). megatron.core.utils.is_te_min_version compares ``get_te_version()`` --
    None without Transformer Engine -- with a version, so without TE it raises TypeError.
    Transformer Engine needs CUDA, so on CPU it is never installed: the shim answers False (no
    TE is not at least any version), which leaves ``store_param_remainders`` off; with TE it
    defers to megatron-core."""
    from megatron.core import utils
    from megatron.core.optimizer import optimizer_config

    original = utils.is_te_min_version

    @functools.wraps(original)
    def is_te_min_version_or_absent(version, check_equality=True):
        if utils.get_te_version() is None:
            return False
        return original(version, check_equality)

    optimizer_config.is_te_min_version = is_te_min_version_or_absent


def _leaf_shard(shard: torch.Tensor) -> torch.Tensor:
    """``shard`` detached: a leaf sharing its memory, with its tensor-parallel attributes."""
    from megatron.core import tensor_parallel

    leaf = shard.detach().requires_grad_(shard.requires_grad)
    tensor_parallel.copy_tensor_model_parallel_attributes(leaf, shard)
    if hasattr(shard, "shared"):
        leaf.shared = shard.shared
    return leaf


def offload_fp32_parameters() -> None:
    """Let megatron-core 0.16.1's offload path take fp32 parameters (once).

    Upstream, --optimizer-cpu-offload is a path for 16-bit parameters: Megatron-LM pairs it
    with --bf16. On CPU there is no mixed precision, and with fp32 parameters 0.16.1 fails in
    two places, each fixed here without changing what happens to 16-bit parameters:

    1. DistributedOptimizer._build_model_and_main_param_groups hands the optimizer fp32 shards
       as views of the model's parameters (``model_param.view(-1)[start:end]``, with autograd
       history), which torch.optim refuses when HybridDeviceOptimizer is built ("can't optimize
       a non-leaf Tensor"; the plain path assigns param_groups directly and never checks). The
       shards are replaced by detached views of the same memory, with the same tensor-parallel
       attributes, in the optimizer's groups and in ``shard_fp32_groups`` alike (so the
       gradients DistributedOptimizer attaches reach the same tensors).
    2. HybridDeviceOptimizer._set_sub_optimizer_grads gives the device optimizer ``.grad`` only
       for the fp32 copies it made of 16-bit parameters; the precision-aware path puts
       gradients in ``.decoupled_grad``, so a native fp32 parameter kept on the device would
       never be updated. After it, each such parameter's ``.grad`` is its ``.decoupled_grad``
       (the host part is copied from ``.decoupled_grad`` by megatron-core already).
    (A third, HybridDeviceOptimizer._update_fp32_params_by_new_state raising KeyError for fp32
    parameters after a load, fails on the GPU too: the trainer builds
    megatron.training.fsdp_optimizer_offload.ShardedHybridDeviceOptimizer, which fixes it.)"""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    build = DistributedOptimizer._build_model_and_main_param_groups.__func__
    if getattr(build, "_cpu_shim", False):
        return

    @functools.wraps(build)
    def build_with_leaf_fp32_shards(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = build(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        if config.optimizer_cpu_offload and config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            shard_fp32_groups = groups[3]
            for shards, group_range in zip(shard_fp32_groups, opt_group_ranges):
                leaves = {id(shard): _leaf_shard(shard) for shard in shards}
                shards[:] = [leaves[id(shard)] for shard in shards]
                group = group_range["orig_group"]
                group["params"] = [leaves.get(id(param), param) for param in group["params"]]
        return groups

    build_with_leaf_fp32_shards._cpu_shim = True
    DistributedOptimizer._build_model_and_main_param_groups = classmethod(
        build_with_leaf_fp32_shards)

    set_grads = HybridDeviceOptimizer._set_sub_optimizer_grads

    @functools.wraps(set_grads)
    def set_grads_of_fp32_parameters_too(self):
        set_grads(self)
        if self.gpu_optimizer is None:
            return
        for group in self.gpu_optimizer.param_groups:
            for param in group["params"]:
                if self.param_to_inner_param.get(param) is param:  # not a copy: fp32 itself
                    param.grad = getattr(param, "decoupled_grad", param.grad)

    HybridDeviceOptimizer._set_sub_optimizer_grads = set_grads_of_fp32_parameters_too


def apply() -> None:
    """The shims of this module (compat.apply_cpu_shims)."""
    split_as_on_the_gpu_build()
    answer_te_version_without_te()
    offload_fp32_parameters()
