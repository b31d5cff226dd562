"""--ckpt-format fsdp_dtensor: Megatron-FSDP's checkpoints, as Megatron-LM writes them.

With --use-megatron-fsdp the model's parameters and the distributed optimizer's states are
DTensors sharded over the data-parallel (x context-parallel) ranks, and megatron-core 0.16.1
checkpoints them only as such (DistributedOptimizer.sharded_state_dict refuses any other
``distrib_optim_sharding_type``; MegatronFSDP has no ``sharded_state_dict``). Megatron-LM
(core_v0.16.1 megatron/training/checkpointing.py) saves them with
torch.distributed.checkpoint (DCP): the model's ``state_dict_for_save_checkpoint()``, the
optimizer's ``sharded_state_dict`` in the ``fsdp_dtensor`` sharding type, both passed through
megatron-core's fsdp_dtensor helpers (SwiGLU's fused fc1 split in two, uneven shards described);
it loads them in place into the same structure built from the model being resumed.

Here the same, inside megatron.training.checkpointing's atomic layout (``iter_XXXXXXX``
written as ``.partial``, then renamed, then the tracker): the DCP files, plus
:data:`COMMON_FILE` (rank 0's torch.save of what dist_checkpointing's common state holds
elsewhere: train state, LR scheduler, Hugging Face config). Each rank's RNG states travel in
the DCP files under a key of their own (the rank's), restored only at the same world size.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

#: The common state of an fsdp_dtensor checkpoint (the trainer's counters, scheduler, ...).
COMMON_FILE = "fsdp_dtensor_common.pt"
#: What DistributedOptimizer.sharded_state_dict is told (Megatron-LM's metadata for the format).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fsdp_dtensor"}


def is_fsdp_dtensor_checkpoint(directory: Path) -> bool:
    return (Path(directory) / COMMON_FILE).is_file()


def read_common(directory: Path) -> dict:
    return torch.load(Path(directory) / COMMON_FILE, weights_only=False)


def _raw(args: argparse.Namespace, model: list, optimizer, include_optimizer: bool,
         is_loading: bool) -> dict:
    """Model (and optimizer) state as megatron-core returns it: DTensors that are the
    parameters' and states' own shards (a load writes into them)."""
    state = {"model": model[0].state_dict_for_save_checkpoint()}
    if include_optimizer:
        if is_loading:  # so that the states exist to fill (the load overwrites them)
            optimizer._init_optimizer_states_with_dummy_values()
        if hasattr(optimizer.optimizer, "state_as_dtensors"):  # --optimizer-cpu-offload
            optimizer.optimizer.state_as_dtensors()
        _give_empty_shards_states(optimizer)
        # sharded_state_dict's own dummy step (distrib_optimizer.py:1356) is the one above:
        # with --optimizer-cpu-offload a step rebuilds the state from the sub-optimizers,
        # which would undo the two preparations
        with mock.patch.object(optimizer, "_init_optimizer_states_with_dummy_values",
                               lambda: None):
            state["optimizer"] = optimizer.sharded_state_dict(
                state, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))
    return state


def _give_empty_shards_states(optimizer) -> None:
    """Give each parameter whose shard on this rank is empty the (empty) Adam states the
    other ranks' shards of it have, so that every rank's optimizer state has the same keys.

    megatron-core 0.16.1 hands torch's Adam no gradient for a parameter with no elements on
    this rank (megatron_fsdp/param_and_grad_buffer.py:2669-2670, update_main_grads), so Adam
    never creates its states here, while the ranks holding the parameter's elements do. The
    fsdp_dtensor preprocessing then runs one all_gather_object per DTensor of the state
    (megatron_fsdp/uneven_dtensor.py:53): ranks with different keys call different numbers
    of collectives and hang (measured at DP=2 with the tiny model: the position embedding lies
    wholly in rank 1's shard). The states given are empty DTensors of the parameter's global
    shape and the step the other parameters have; Adam leaves them alone (no gradient).
    The states are then put in parameter order, the same on every rank (the collectives pair
    DTensors by order)."""
    inner = optimizer.optimizer
    steps = [state["step"] for state in inner.state.values() if "step" in state]
    if not steps:
        return
    params = [param for group in inner.param_groups for param in group["params"]]
    for param in params:
        if param.to_local().numel() == 0 and not inner.state.get(param):
            inner.state[param] = {"step": steps[0].clone(), "exp_avg": torch.zeros_like(param),
                                  "exp_avg_sq": torch.zeros_like(param)}
    ordered = {param: inner.state[param] for param in params if param in inner.state}
    inner.state.clear()
    inner.state.update(ordered)


class _ParametersByEitherName:
    """FullyShardedDataParallel as handle_swiglu_in_state_dict asks it for parameters.

    megatron-core 0.16.1's handle_swiglu_in_state_dict looks a model key up as
    ``model.get_parameter(f"module.{key}")`` (fsdp_dtensor_checkpoint.py:285) and an optimizer
    key, which names the same parameter with one more ``module.`` (the optimizer names
    parameters from the wrapper's ``named_parameters``), as ``key[len("module."):]``
    (fsdp_dtensor_checkpoint.py:311-313): the second name is relative to the wrapper's
    ``module`` (MegatronFSDP), the first to the wrapper, and no one module resolves both
    (AttributeError "MegatronFSDP has no attribute `decoder`" at the first SwiGLU save). Here a
    name resolves from the wrapper, or else from its ``module``: the same parameter."""

    def __init__(self, wrapper):
        self._wrapper = wrapper
        self.config = wrapper.config

    def get_parameter(self, name: str):
        try:
            return self._wrapper.get_parameter(name)
        except AttributeError:
            return self._wrapper.module.get_parameter(name)


def _for_dcp(args: argparse.Namespace, model: list, raw: dict,
             rng_state: Optional[dict]) -> dict:
    """``raw`` as DCP saves it: megatron-core's fsdp_dtensor preprocessing (Megatron-LM's
    preprocess_fsdp_dtensor_state_dict: SwiGLU's fc1 split into its two halves, views of the
    same shards; uneven shards described), and this rank's RNG states under its rank."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_swiglu_in_state_dict

    state = dict(raw)
    if args.swiglu:
        state["model"], optimizer_state = handle_swiglu_in_state_dict(
            _ParametersByEitherName(model[0]), state["model"], state.get("optimizer"))
        if "optimizer" in raw:
            state["optimizer"] = optimizer_state
    if rng_state is not None:
        state["rng_state"] = {f"rank{dist.get_rank()}": rng_state}
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def write(args: argparse.Namespace, partial: Path, model: list, optimizer, rng_state: dict,
          common: dict) -> None:
    """Save into the (existing, empty) ``partial`` directory (collective)."""
    raw = _raw(args, model, optimizer, include_optimizer=True, is_loading=False)
    state = _for_dcp(args, model, raw, rng_state)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial)))
    if dist.get_rank() == 0:
        torch.save(common, partial / COMMON_FILE)


def load(args: argparse.Namespace, directory: Path, model: list, optimizer,
         load_optimizer: bool, load_rng: bool, rng_template: dict) -> Optional[dict]:
    """Load model (and optimizer) in place; returns this rank's RNG states (None when not
    loaded). The optimizer's template steps once on zero gradients (megatron-core's
    ``_init_optimizer_states_with_dummy_values``, which allocates the states); the load then
    overwrites weights and states alike."""
    raw = _raw(args, model, optimizer, include_optimizer=load_optimizer, is_loading=True)
    state = _for_dcp(args, model, raw, rng_template if load_rng else None)
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)))
    model[0].load_state_dict(_unprefixed(raw["model"]))
    if load_optimizer:
        optimizer.load_state_dict(raw["optimizer"])
    return state["rng_state"][f"rank{dist.get_rank()}"] if load_rng else None


def _unprefixed(model_state: dict) -> dict:
    """FullyShardedDataParallel.load_state_dict adds MegatronFSDP's ``module.`` prefix to the
    keys its ``state_dict_for_save_checkpoint`` returned with it."""
    return {key.removeprefix("module."): value for key, value in model_state.items()}


def _tensor_parallel_dim(param) -> Optional[int]:
    """The dimension megatron-core splits ``param`` along over tensor-parallel ranks, or None."""
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


@contextlib.contextmanager
def _unsharded_placeholders(module: torch.nn.Module):
    """``module`` with each Megatron-FSDP parameter replaced, in the block, by a meta tensor of
    the shape the parameter has on this tensor-parallel rank unsharded. megatron-core's
    ``sharded_state_dict`` describes a parameter by its local tensor, and Megatron-FSDP's are
    DTensors whose local tensor is this rank's shard (an empty one divides by zero in
    SwiGLU's factory) and whose shape spans the tensor-parallel ranks too."""
    from megatron.core import parallel_state
    from torch.distributed.tensor import DTensor

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    swapped = []
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if isinstance(param, DTensor):
                shape = list(param.shape)
                dim = _tensor_parallel_dim(param)
                if dim is not None:
                    shape[dim] //= tp_size
                placeholder = torch.nn.Parameter(torch.empty(shape, dtype=param.dtype,
                                                             device="meta"),
                                                 requires_grad=param.requires_grad)
                owner._parameters[name] = placeholder
                swapped.append((owner, name, param))
    try:
        yield module
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


def load_torch_dist_weights(directory: Path, model: list) -> None:
    """Load the weights of a torch_dist checkpoint (dist_checkpointing's: the trainer's without
    --use-megatron-fsdp, tools/checkpoint's conversions) into Megatron-FSDP's sharded
    parameters, at any data-parallel and tensor-parallel size.

    Megatron-LM converts such a checkpoint offline first (its checkpoint_inspector's
    ``convert-torch-dist-to-fsdp-dtensor``); here it loads directly, with megatron-core doing
    the reading: the wrapped GPTModel's own ``sharded_state_dict`` names every weight as a
    torch_dist checkpoint holds it (checkpoint keys, the layer axis, this rank's
    tensor-parallel slice, SwiGLU's fc1 halves), each backed here by a host tensor of this
    rank's unsharded (tensor-parallel-local) shape, which dist_checkpointing fills. Each rank
    then keeps the part its Megatron-FSDP shard holds: the chunk that the same DTensors,
    described as megatron-core describes them to DCP (uneven shards), occupy in the parameter.
    One parameter's tensor at a time would need a loader of our own; this reads them all at
    once, this tensor-parallel rank's unsharded model in host memory for the duration."""
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core import dist_checkpointing, parallel_state

    gpt = model[0].module.module
    tp_dims = {name: _tensor_parallel_dim(param) for name, param in gpt.named_parameters()}
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with _unsharded_placeholders(gpt):
        template, _ = extract_sharded_tensors_and_factories(gpt.sharded_state_dict())
    for entry in template.values():  # ShardedTensors and SwiGLU's factories, on placeholders
        entry.data = torch.empty(entry.data.shape, dtype=entry.data.dtype)
    loaded = dist_checkpointing.load(template, str(directory))
    raw = {"model": model[0].state_dict_for_save_checkpoint()}
    preprocess_state_dict_for_uneven_dtensor(raw)
    for name, shard in raw["model"].items():
        if not isinstance(shard, torch.Tensor):
            continue
        name = name.removeprefix("module.")
        full = loaded[name]
        # the chunk's place in the parameter across tensor-parallel ranks, then in this rank's
        (chunk,) = shard.__create_chunk_list__()
        offsets = list(chunk.offsets)
        if tp_dims[name] is not None:
            offsets[tp_dims[name]] -= tp_rank * full.shape[tp_dims[name]]
        index = tuple(slice(start, start + size) for start, size in zip(offsets, chunk.sizes))
        part = full[index]
        assert part.shape == tuple(chunk.sizes), (name, part.shape, chunk.sizes)
        with torch.no_grad():
            shard.to_local().copy_(part)
    model[0].load_state_dict(_unprefixed(raw["model"]))
