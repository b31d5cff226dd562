"""Megatron-FSDP (``--use-megatron-fsdp``): megatron-core 0.16.1's fully sharded data
parallelism, wired as Megatron-LM wires it (core_v0.16.1 megatron/training/training.py
get_model, arguments.py).

With ``--data-parallel-sharding-strategy`` ``optim`` the distributed optimizer's states are
sharded over the data-parallel (x context-parallel) ranks (ZeRO-1), ``optim_grads`` the
gradients too (ZeRO-2), ``optim_grads_params`` the parameters too (ZeRO-3: each transformer
layer's weights all-gathered before its forward and backward, released after). The model chunk
is wrapped in megatron-core's FullyShardedDataParallel instead of its DistributedDataParallel;
the distributed optimizer steps the sharded DTensors; checkpoints are ``--ckpt-format
fsdp_dtensor`` (megatron.training.fsdp_checkpointing). On CPU it runs through gloo with
megatron.training.compat.megatron_fsdp's shims (docs/training.md, "On CPU").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
from unittest import mock

import torch

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def add_megatron_fsdp_args(group) -> None:
    group.add_argument(
        "--use-megatron-fsdp", action="store_true",
        help="Wrap the model in megatron-core's Megatron-FSDP instead of its DDP (needs "
        "--use-distributed-optimizer, --ckpt-format fsdp_dtensor and a sharding strategy).",
    )
    group.add_argument(
        "--data-parallel-sharding-strategy", default="no_shard", choices=STRATEGIES,
        help="With --use-megatron-fsdp: what is sharded over the data-parallel ranks: optim "
        "(optimizer states), optim_grads (and gradients), optim_grads_params (and parameters). "
        "no_shard (Megatron-LM's default) is refused: megatron-core 0.16.1 cannot step it.",
    )
    group.add_argument(
        "--fsdp-double-buffer", action="store_true",
        help="With --use-megatron-fsdp: allocate the all-gather and reduce-scatter buckets "
        "once, as two persistent buffers, instead of per communication.",
    )
    group.add_argument(
        "--suggested-communication-unit-size", type=int, default=None, metavar="ELEMENTS",
        help="With --use-megatron-fsdp: elements reduce-scattered at once (the gradient "
        "buckets queued) and, halved, all-gathered ahead (the weights prefetched). Default "
        "megatron-core's: at least 1e9, which at 7-8B holds several layers' buckets.",
    )


def _require(condition: bool, message: str) -> None:
    from megatron.training.arguments import ArgumentValidationError

    if not condition:
        raise ArgumentValidationError(message)


def validate_megatron_fsdp(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for --use-megatron-fsdp (core_v0.16.1 arguments.py) and what
    megatron-core 0.16.1 can run, each as one line."""
    if not args.use_megatron_fsdp:
        unused = [flag for flag, given in (
            ("--data-parallel-sharding-strategy", args.data_parallel_sharding_strategy
             != "no_shard"),
            ("--fsdp-double-buffer", args.fsdp_double_buffer),
            ("--suggested-communication-unit-size",
             args.suggested_communication_unit_size is not None)) if given]
        _require(not unused, f"{unused[0] if unused else ''} applies to --use-megatron-fsdp; "
                 "add it or drop the flag")
        _require(args.ckpt_format != "fsdp_dtensor",
                 "--ckpt-format fsdp_dtensor is Megatron-FSDP's format (as in Megatron-LM); add "
                 "--use-megatron-fsdp or use --ckpt-format torch_dist")
        return
    _require(args.data_parallel_sharding_strategy != "no_shard",
             "--data-parallel-sharding-strategy no_shard (the default) cannot train with "
             "megatron-core 0.16.1's Megatron-FSDP: it builds no parameter buffer for it "
             "(megatron_fsdp/param_and_grad_buffer.py:1970) but the distributed optimizer's "
             "step all-gathers one (megatron_fsdp.py:1126); pass optim, optim_grads or "
             "optim_grads_params")
    _require(importlib.util.find_spec("einops") is not None,
             "--use-megatron-fsdp needs the einops package (megatron-core 0.16.1's "
             "mcore_fsdp_adapter builds its device mesh with it); pip install 'einops~=0.8'")
    _require(args.suggested_communication_unit_size is None
             or args.suggested_communication_unit_size > 0,
             f"--suggested-communication-unit-size must be positive, got "
             f"{args.suggested_communication_unit_size}")
    _require(args.use_distributed_optimizer,
             "--use-megatron-fsdp needs --use-distributed-optimizer (megatron-core's "
             "Megatron-FSDP is stepped by its DistributedOptimizer; with the plain optimizer "
             "it trains wrongly); add it")
    _require(args.pipeline_model_parallel_size == 1,
             "--use-megatron-fsdp does not run with --pipeline-model-parallel-size > 1 in "
             "megatron-core 0.16.1: its device mesh lays all ranks out as data-parallel x "
             "expert x tensor-parallel, without pipeline stages (mcore_fsdp_adapter.py:365-372: "
             "EinopsError); use PP=1")
    _require(args.ckpt_format == "fsdp_dtensor",
             "--use-megatron-fsdp saves only --ckpt-format fsdp_dtensor (as in Megatron-LM; "
             "megatron-core 0.16.1 has no torch_dist layout for its DTensors); add it")
    _require(args.data_parallel_size * args.context_parallel_size > 1,
             "--use-megatron-fsdp shards over the data-parallel x context-parallel ranks, and "
             "there is one: it would shard nothing, and with megatron-core 0.16.1 the gradients "
             "come out wrong (measured: twice the plain optimizer's for one micro-batch, in "
             "another direction for two); drop --use-megatron-fsdp or use more ranks")


def ddp_config_fields(args: argparse.Namespace) -> dict:
    """The DistributedDataParallelConfig fields --use-megatron-fsdp sets.

    ``gradient_reduce_div_fusion`` (megatron-core's default True) reduces gradients with
    NCCL's PREMUL_SUM, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); off,
    each rank multiplies its gradients by the same factor and then sums
    (megatron_fsdp/param_and_grad_buffer.py gradient_reduce_preprocessing): the products and
    the sum NCCL's premultiplied sum computes, and megatron-core's DDP's own order."""
    return {
        "use_megatron_fsdp": args.use_megatron_fsdp,
        "data_parallel_sharding_strategy": args.data_parallel_sharding_strategy,
        "fsdp_double_buffer": args.fsdp_double_buffer,
        "suggested_communication_unit_size": args.suggested_communication_unit_size,
        "gradient_reduce_div_fusion": torch.cuda.is_available(),
    }


class NoTransformerEngineLinear:
    """What ``TELinear`` is without Transformer Engine: a type no module is an instance of."""


def _without_transformer_engine_no_module_is_te_linear() -> None:
    """At TP > 1, FullyShardedDataParallel._fix_tensor_parallel_attributes asks
    ``isinstance(module, (TELinear,))`` of every parameter's module (mcore_fsdp_adapter.py:184)
    to find Transformer Engine linears that duplicate their weight across TP ranks. Without
    Transformer Engine, megatron-core's ``TELinear`` subclasses a MagicMock stand-in for ``te``
    (extensions/transformer_engine.py:62-77, 470) and is not a type, so the question raises
    TypeError; the answer it asks for is False for every module, which a type with no
    instances gives. On CPU and on a GPU without Transformer Engine alike."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        mcore_fsdp_adapter.TELinear = NoTransformerEngineLinear


def wrap(config, ddp_config, module: torch.nn.Module,
         optimizer_cpu_offload: bool = False) -> torch.nn.Module:
    """``module`` in megatron-core's FullyShardedDataParallel, on the current CUDA device (its
    default) or, without CUDA, on the CPU; with ``optimizer_cpu_offload`` its gradients are
    handed to the optimizer as ``decoupled_grad`` too (megatron.training.fsdp_optimizer_offload;
    the precision-aware path without offload, Transformer Engine's, is left as megatron-core
    wires it: no GPU has run it here)."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from megatron.training.fsdp_optimizer_offload import hand_gradients_as_decoupled

    _without_transformer_engine_no_module_is_te_linear()
    device = None if torch.cuda.is_available() else torch.device("cpu")
    wrapped = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                       device=device)
    if optimizer_cpu_offload:
        hand_gradients_as_decoupled(wrapped)
    return wrapped


@contextlib.contextmanager
def fake_world_seams(resized):
    """What megatron-core's Megatron-FSDP needs to run in the tracer's fake world
    (megatron.training.tracing: FakeTensorMode, a fake process group), so the trace records its
    own buffers; for the trace's lifetime. None of them allocates device memory in the trainer:

    - the device mesh's rank bookkeeping (``_init_dist_index``'s ``torch.arange`` / ``tolist``
      and DeviceMesh's ``mesh`` lookups, ``nonzero``) runs host-side on real tensors: under
      FakeTensorMode their values, which it reads, do not exist;
    - ``validate_uneven_dtensor`` and ``update_uneven_dtensor_chunk_metadata``
      (param_and_grad_buffer.py:4155-4159) are skipped: they all_gather_object the other ranks'
      shard shapes (checkpoint metadata and a bounds check, host objects only), which a fake
      process group cannot answer;
    - ``DTensor.from_local``'s ``run_check`` (a tensor-parallel weight at TP > 1) is skipped:
      it all_gather_objects every rank's dtype and requires_grad to compare them, host
      objects only, and the fake process group cannot answer;
    - the all-gathers and reduce-scatters of a bucket group are issued one by one instead of
      coalesced (``_coalescing_manager``): FakeTensorMode has no rule for c10d's coalesced
      ops; each writes into the buckets megatron-core allocated, as the coalesced ones do;
    - a temporary bucket's ``_alloc_storage`` / ``_free_storage`` (the gathered weights of an
      FSDP unit without --fsdp-double-buffer: its storage resized to the bucket and back to 0)
      is reported to ``resized(tensor)`` (the recorder's follow_resize): a storage resize is
      no op the recorder sees, but the allocator's malloc and free on the GPU."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import _api as dtensor_api

    init_dist_index = FullyShardedDataParallel._init_dist_index
    mesh = DeviceMesh.mesh.fget
    alloc_storage, free_storage = (param_and_grad_buffer._alloc_storage,
                                   param_and_grad_buffer._free_storage)

    def reported_alloc(tensor, size):
        allocated = alloc_storage(tensor, size)
        resized(tensor)
        return allocated

    def reported_free(tensor):
        freed = free_storage(tensor)
        resized(tensor)
        return freed

    def host_side_dist_index(self, *args, **kwargs):
        with unset_fake_temporarily():
            return init_dist_index(self, *args, **kwargs)

    def host_side_mesh(self):
        with unset_fake_temporarily():
            return mesh(self)

    with contextlib.ExitStack() as seams:
        seams.enter_context(mock.patch.object(FullyShardedDataParallel, "_init_dist_index",
                                              host_side_dist_index))
        seams.enter_context(mock.patch.object(DeviceMesh, "mesh", property(host_side_mesh)))
        for name in ("validate_uneven_dtensor", "update_uneven_dtensor_chunk_metadata"):
            seams.enter_context(mock.patch.object(param_and_grad_buffer, name,
                                                  lambda dtensor: None))
        seams.enter_context(mock.patch.object(dtensor_api, "check_tensor_meta",
                                              lambda *args, **kwargs: None))
        seams.enter_context(mock.patch.object(param_and_grad_buffer, "_coalescing_manager",
                                              _uncoalesced))
        seams.enter_context(mock.patch.object(param_and_grad_buffer, "_alloc_storage",
                                              reported_alloc))
        seams.enter_context(mock.patch.object(param_and_grad_buffer, "_free_storage",
                                              reported_free))
        yield


@contextlib.contextmanager
def _uncoalesced(group=None, device=None, async_ops=False):
    """torch's ``_coalescing_manager`` that coalesces nothing: the collectives inside run as
    issued (synchronously in the fake world); its handle's ``wait`` has nothing to wait for."""
    from torch.distributed.distributed_c10d import _CoalescingManager

    yield _CoalescingManager()


def wrap_fake(config, ddp_config, module: torch.nn.Module) -> torch.nn.Module:
    """:func:`wrap` of a fake model inside :func:`fake_world_seams`, without its
    ``module.to(device)`` (megatron_fsdp.py:201): the fake model is already on the CPU device,
    and torch swaps each fake parameter for a new one, which the fake mode's weak references
    refuse (on the GPU the trainer's model is already on its device too)."""
    with mock.patch.object(module, "to", lambda device: module):
        return wrap(config, ddp_config, module)
