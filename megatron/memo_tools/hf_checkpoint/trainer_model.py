"""The trainer's own model on this process: a world of one (gloo, TP = PP = 1, no port), the
arguments parsed from a flag line by the trainer's parser, the GPTModel built by
megatron.training.gpt.model_provider with weights left uninitialised (they are all overwritten)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from megatron.training.arguments import parse_args
from megatron.memo_tools.hf_checkpoint.errors import ConversionError

# The training flags parse_args requires; they do not shape the model (flags given after them
# win).
PLACEHOLDER_FLAGS = ["--seq-length", "128", "--micro-batch-size", "1", "--train-iters", "1",
                     "--lr", "1e-4", "--mock-data"]


def trainer_args(model_flags: list[str]) -> argparse.Namespace:
    """Validated trainer arguments for one process from ``model_flags`` (the flag line)."""
    return parse_args(PLACEHOLDER_FLAGS + list(model_flags), world_size=1, cuda_available=False)


@contextlib.contextmanager
def world_of_one(args: argparse.Namespace) -> Iterator[None]:
    """megatron.core's parallel state for one process (set up here unless it already is, and
    then torn down again)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() != 1
                or parallel_state.get_pipeline_model_parallel_world_size() != 1):
            raise ConversionError("conversion runs as one process (TP = PP = 1); run the tool "
                                  "on its own, not under torchrun")
        yield
        return
    from megatron.training.initialize import initialize_megatron

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise ConversionError(f"conversion runs as one process, not in a world of "
                              f"{dist.get_world_size()}; run the tool on its own, not under "
                              "torchrun")
    created = not dist.is_initialized()
    if created:  # a HashStore: no port, whatever MASTER_ADDR the environment holds
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        initialize_megatron(args)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def build_model(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    """The trainer's GPTModel for ``args`` (all of it: first and last stage), parameters of
    ``dtype``, not initialised."""
    from megatron.training import gpt
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    config.params_dtype = dtype
    config.perform_initialization = False
    return gpt.model_provider(config, args, pre_process=True, post_process=True)
