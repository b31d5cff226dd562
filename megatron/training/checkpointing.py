"""Checkpoints through megatron.core.dist_checkpointing, written atomically.

Layout under --save::

    iter_0000010/                    one dist_checkpointing directory per saved iteration
    latest_checkpointed_iteration.txt

Every rank writes into ``iter_XXXXXXX.partial``; only after all ranks finished does rank 0
rename it to ``iter_XXXXXXX`` and then replace the tracker file (write + fsync + os.replace).
A crash mid-save leaves the previous checkpoint and tracker untouched, so --load never sees a
half-written checkpoint.

What is saved: model and optimizer (sharded, so TP/PP layouts can be resharded on load), the
LR scheduler and the counters of :class:`TrainState` (common state), and each rank's RNG
states (CPU generator plus the model-parallel tracker, and the CUDA generator on GPUs) so a
resumed run draws the same dropout masks as an uninterrupted one. RNG states are restored only
when the world size is unchanged.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
PARTIAL_SUFFIX = ".partial"
# Bump when the common-state layout changes; loading an unknown version is refused.
CHECKPOINT_FORMAT_VERSION = 1


def checkpoint_dir(root: str | Path, iteration: int) -> Path:
    """Directory of the checkpoint of ``iteration`` under ``root``."""
    return Path(root) / f"iter_{iteration:07d}"


def _rng_state() -> dict:
    state = {
        "cpu": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state_dict(args: argparse.Namespace, model: list, optimizer, include_optimizer: bool,
                        include_rng: bool, is_loading: bool) -> dict:
    state = {"model": model[0].module.sharded_state_dict()}
    if include_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=is_loading)
    if include_rng:
        world_size, rank = dist.get_world_size(), dist.get_rank()
        state["rng_state"] = ShardedObject(
            "rng_state", _rng_state(), (world_size,), (rank,), replica_id=0
        )
    return state


def _write_tracker(root: Path, iteration: int) -> None:
    temporary = root / (TRACKER_FILENAME + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(str(iteration))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, root / TRACKER_FILENAME)


def save_checkpoint(args: argparse.Namespace, state, model: list, optimizer, scheduler) -> Path:
    """Save everything needed to resume at ``state.iteration`` under --save (collective)."""
    root = Path(args.save)
    final = checkpoint_dir(root, state.iteration)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    dist.barrier()
    sharded = _sharded_state_dict(args, model, optimizer, include_optimizer=True,
                                  include_rng=True, is_loading=False)
    sharded["opt_param_scheduler"] = scheduler.state_dict()
    sharded["train_state"] = {
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "world_size": dist.get_world_size(),
        "format_version": CHECKPOINT_FORMAT_VERSION,
    }
    dist_checkpointing.save(sharded, str(partial))
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_tracker(root, state.iteration)
        print(f"> saved checkpoint at iteration {state.iteration} to {final}", flush=True)
    dist.barrier()
    return final


def read_latest_iteration(root: str | Path) -> Optional[int]:
    """The iteration named by the tracker file under ``root``, or None if there is none."""
    tracker = Path(root) / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"--load {root}: {tracker} holds {text!r}, not an iteration number")
    return int(text)


def load_checkpoint(args: argparse.Namespace, model: list, optimizer, scheduler):
    """Restore the latest checkpoint under --load; returns its TrainState, or None if none."""
    from megatron.training.training import TrainState

    iteration = read_latest_iteration(args.load)
    if iteration is None:
        if dist.get_rank() == 0:
            print(f"> no checkpoint under --load {args.load}; training from scratch", flush=True)
        return None
    directory = checkpoint_dir(args.load, iteration)
    if not directory.is_dir():
        raise ValueError(f"--load {args.load}: tracker names iteration {iteration} but "
                         f"{directory} is missing; fix or delete {TRACKER_FILENAME}")
    common = dist_checkpointing.load_common_state_dict(str(directory))
    saved = common["train_state"]
    if saved.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise ValueError(f"--load {directory}: checkpoint format {saved.get('format_version')} "
                         f"is not {CHECKPOINT_FORMAT_VERSION}; it was written by another version")
    load_optimizer = not (args.no_load_optim or args.finetune)
    load_rng = not (args.no_load_rng or args.finetune) and saved["world_size"] == dist.get_world_size()
    template = _sharded_state_dict(args, model, optimizer, include_optimizer=load_optimizer,
                                   include_rng=load_rng, is_loading=True)
    loaded = dist_checkpointing.load(template, str(directory))
    model[0].module.load_state_dict(loaded["model"])
    if load_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(common["opt_param_scheduler"])
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    if dist.get_rank() == 0:
        print(f"> loaded checkpoint {directory} (iteration {iteration})", flush=True)
    if args.finetune:
        return TrainState()
    return TrainState(
        iteration=saved["iteration"],
        consumed_train_samples=saved["consumed_train_samples"],
        consumed_valid_samples=saved["consumed_valid_samples"],
    )
