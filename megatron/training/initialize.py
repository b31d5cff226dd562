"""Process setup: torch.distributed (nccl on CUDA, gloo on CPU), megatron.core parallel_state,
seeds and determinism. CPU shims (megatron.training.compat) are applied only without CUDA."""

from __future__ import annotations

import argparse
import logging
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from memo_ext.device_memory import current_allocator

from megatron.training.memo import install_memo_plan_allocator, install_memo_stitching_allocator

# Megatron-LM offsets each pipeline stage's seed so that stages draw different weights.
PIPELINE_SEED_STRIDE = 100


def initialize_distributed(args: argparse.Namespace) -> None:
    """Join the process group described by torchrun's RANK/WORLD_SIZE/LOCAL_RANK.

    A plain ``python pretrain_gpt.py`` (no torchrun, no MASTER_ADDR) runs as a world of one on
    an in-memory store: no port to pick, so no race with other processes for it.
    """
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.distributed_backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = dist.HashStore() if world_size == 1 and "MASTER_ADDR" not in os.environ else None
    dist.init_process_group(
        backend=args.distributed_backend,
        rank=rank,
        world_size=world_size,
        store=store,
        timeout=timedelta(minutes=args.distributed_timeout_minutes),
    )
    args.rank = rank


def set_seeds(seed: int) -> None:
    """Seed python, numpy and torch (CPU and the model-parallel CUDA/CPU RNG tracker)."""
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + PIPELINE_SEED_STRIDE * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _log_rank_0(message: str) -> None:
    """print on rank 0 before torch.distributed exists (torchrun's RANK; a plain run is rank 0)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def set_logging_level(args: argparse.Namespace) -> None:
    """--logging-level, else $MEGATRON_LOGGING_LEVEL (Megatron-LM's precedence): the root
    logger's level, with a stderr handler when nothing configured one (so that megatron-core's
    INFO records show at 20). Without either, logging is left as it is."""
    level = getattr(args, "logging_level", None)
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is None:
        return
    logging.basicConfig(level=level)
    logging.getLogger().setLevel(level)


def initialize_megatron(args: argparse.Namespace) -> None:
    """Everything before the model is built. ``args`` must already be validated."""
    set_logging_level(args)
    if not torch.cuda.is_available():
        from megatron.training.compat import apply_cpu_shims

        apply_cpu_shims()
    else:
        from megatron.training.compat import check_megatron_core_version

        check_megatron_core_version()
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NCCL_ALGO", "Ring")
    if args.transformer_impl == "local":
        from memo_ext.attention import kernels

        # Process-wide: autograd runs CUDA backwards on its own thread.
        kernels.set_attention_backend(getattr(args, "attention_backend", "auto"))
    install_memo_plan_allocator(args)
    install_memo_stitching_allocator(args, log=_log_rank_0)
    if current_allocator() is not None:
        # ProcessGroupNCCL's record_stream goes to the C++ allocator API, which a pluggable
        # allocator never hears of; holding the tensors until the work completes does not
        # need the allocator. Read when the process group is created.
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    initialize_distributed(args)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    set_seeds(args.seed)
