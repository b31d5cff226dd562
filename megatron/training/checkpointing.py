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
when the world size is unchanged. The common state also records the flags that shape the
network (:data:`MODEL_ARGS`): a run whose flags disagree on the architecture is refused with
one line naming the flag, and tools/checkpoint rebuilds the model from them.

A weights-only checkpoint (:func:`save_weights_checkpoint`, what tools/checkpoint writes from a
Hugging Face model) holds the model alone at iteration 0; loading it is --finetune: iteration 0,
a fresh optimizer and fresh RNG states. The Hugging Face config.json it was converted from
travels in the common state (``hf_config``) into every checkpoint trained from it, so that an
export needs nothing but the checkpoint.
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

from megatron.training.arguments import ArgumentValidationError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
PARTIAL_SUFFIX = ".partial"
# Bump when the common-state layout changes; loading an unknown version is refused.
CHECKPOINT_FORMAT_VERSION = 1

# Flags that fix the network's shape and arithmetic: a run loading a checkpoint must agree.
ARCHITECTURE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "norm_epsilon", "swiglu", "add_bias_linear", "add_qkv_bias",
    "untie_embeddings_and_output_weights", "rotary_percent",
)
# Flags of positions, which continued pretraining may change (longer context, RoPE scaling).
POSITION_ARGS = (
    "position_embedding_type", "max_position_embeddings", "rotary_base",
    "rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor",
    "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
    "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int",
)
MODEL_ARGS = ARCHITECTURE_ARGS + POSITION_ARGS + ("padded_vocab_size",)


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


def model_args_record(args: argparse.Namespace) -> dict:
    """The :data:`MODEL_ARGS` of ``args`` (plain values; what a checkpoint records)."""
    return {name: getattr(args, name, None) for name in MODEL_ARGS}


def recorded_model_flags(recorded: dict) -> list[str]:
    """The flag line that rebuilds the network of a checkpoint's ``model_args`` record
    (Megatron-LM's --use-checkpoint-args): a value flag for each recorded value, a switch for
    each recorded True, the rules' own flags only for the RoPE rule in use."""
    def value(name: str) -> list[str]:
        return ["--" + name.replace("_", "-"), str(recorded[name])]

    flags = []
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "kv_channels", "normalization", "norm_epsilon", "rotary_percent",
                 "position_embedding_type", "max_position_embeddings", "rotary_base"):
        flags += value(name)
    if recorded["num_query_groups"] != recorded["num_attention_heads"]:
        flags += ["--group-query-attention", *value("num_query_groups")]
    flags += ["--" + name.replace("_", "-") for name in
              ("swiglu", "add_qkv_bias", "untie_embeddings_and_output_weights") if recorded[name]]
    if not recorded["add_bias_linear"]:
        flags.append("--disable-bias-linear")
    if recorded["rotary_seq_len_interpolation_factor"] is not None:
        flags += value("rotary_seq_len_interpolation_factor")
    if recorded["use_rope_scaling"]:
        flags += ["--use-rope-scaling", *value("rope_scaling_factor")]
    if recorded["position_embedding_type"] == "yarn":
        for name in ("rotary_scaling_factor", "mscale", "mscale_all_dim",
                     "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow"):
            flags += value(name)
        flags.append(("--" if recorded["yarn_correction_range_round_to_int"] else "--no-")
                     + "yarn-correction-range-round-to-int")
    return flags


def _flag_text(name: str, value) -> str:
    if name == "add_bias_linear":
        return "no --disable-bias-linear" if value else "--disable-bias-linear"
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) or value is None:
        return flag if value else f"no {flag}"
    return f"{flag} {value}"


def check_model_args(recorded: Optional[dict], args: argparse.Namespace, where: Path) -> None:
    """Refuse ``args`` whose architecture differs from the ``recorded`` one (one line naming
    the flag); say which position flags this run changes. Checkpoints without a record pass."""
    if not recorded:
        return
    for name in ARCHITECTURE_ARGS:
        if name in recorded and recorded[name] != getattr(args, name, None):
            raise ArgumentValidationError(
                f"--load {where}: the checkpoint was saved with {_flag_text(name, recorded[name])}"
                f", this run has {_flag_text(name, getattr(args, name, None))}; use the "
                "checkpoint's value (tools/checkpoint/hf_args.py prints a converted model's flags)")
    kinds = {recorded.get("position_embedding_type"), args.position_embedding_type}
    if "learned_absolute" in kinds and len(kinds) > 1:
        raise ArgumentValidationError(
            f"--load {where}: the checkpoint has --position-embedding-type "
            f"{recorded['position_embedding_type']}, this run {args.position_embedding_type}; "
            "learned and rotary positions do not convert into each other")
    changed = [f"{_flag_text(name, getattr(args, name, None))} (checkpoint: "
               f"{_flag_text(name, recorded[name])})" for name in POSITION_ARGS
               if name in recorded and recorded[name] != getattr(args, name, None)]
    if changed and dist.get_rank() == 0:
        print(f"> positions differ from the checkpoint's: {'; '.join(changed)}", flush=True)


def _train_state_record(args: argparse.Namespace, iteration: int, consumed_train_samples: int,
                        consumed_valid_samples: int, weights_only: bool) -> dict:
    return {
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "world_size": dist.get_world_size(),
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "weights_only": weights_only,
        "model_args": model_args_record(args),
    }


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


def _write_checkpoint(root: Path, iteration: int, sharded: dict) -> Path:
    """dist_checkpointing.save into ``iter_XXXXXXX.partial``, then rename it and replace the
    tracker file (collective)."""
    final = checkpoint_dir(root, iteration)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    dist.barrier()
    dist_checkpointing.save(sharded, str(partial))
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_tracker(root, iteration)
        print(f"> saved checkpoint at iteration {iteration} to {final}", flush=True)
    dist.barrier()
    return final


def save_checkpoint(args: argparse.Namespace, state, model: list, optimizer, scheduler) -> Path:
    """Save everything needed to resume at ``state.iteration`` under --save (collective)."""
    sharded = _sharded_state_dict(args, model, optimizer, include_optimizer=True,
                                  include_rng=True, is_loading=False)
    sharded["opt_param_scheduler"] = scheduler.state_dict()
    sharded["train_state"] = _train_state_record(
        args, state.iteration, state.consumed_train_samples, state.consumed_valid_samples,
        weights_only=False)
    if getattr(args, "hf_config", None) is not None:
        sharded["hf_config"] = args.hf_config
    return _write_checkpoint(Path(args.save), state.iteration, sharded)


def save_weights_checkpoint(args: argparse.Namespace, module: torch.nn.Module, root: str | Path,
                            hf_config: Optional[dict] = None) -> Path:
    """Save ``module``'s weights alone as iteration 0 under ``root`` (collective); with
    ``hf_config``, the Hugging Face config.json they came from."""
    sharded = {"model": module.sharded_state_dict(),
               "train_state": _train_state_record(args, 0, 0, 0, weights_only=True)}
    if hf_config is not None:
        sharded["hf_config"] = hf_config
    return _write_checkpoint(Path(root), 0, sharded)


def read_latest_iteration(root: str | Path) -> Optional[int]:
    """The iteration named by the tracker file under ``root``, or None if there is none."""
    tracker = Path(root) / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"--load {root}: {tracker} holds {text!r}, not an iteration number")
    return int(text)


def latest_checkpoint(root: str | Path) -> tuple[Optional[Path], dict]:
    """The directory the tracker under ``root`` names and its common state, or (None, {})."""
    iteration = read_latest_iteration(root)
    if iteration is None:
        return None, {}
    directory = checkpoint_dir(root, iteration)
    if not directory.is_dir():
        raise ValueError(f"--load {root}: tracker names iteration {iteration} but "
                         f"{directory} is missing; fix or delete {TRACKER_FILENAME}")
    common = dist_checkpointing.load_common_state_dict(str(directory))
    saved = common["train_state"]
    if saved.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise ValueError(f"--load {directory}: checkpoint format {saved.get('format_version')} "
                         f"is not {CHECKPOINT_FORMAT_VERSION}; it was written by another version")
    return directory, common


def _check_vocabulary(args: argparse.Namespace, common: dict, where: Path) -> None:
    """megatron-core loads the vocabulary rows both sides have (the rest zero); refuse a run
    whose padded vocabulary would drop rows of the Hugging Face model it came from."""
    rows = (common.get("hf_config") or {}).get("vocab_size")
    padded = getattr(args, "padded_vocab_size", None)
    if rows is not None and padded is not None and padded < rows:
        raise ArgumentValidationError(
            f"--load {where}: the model has {rows} vocabulary rows but this run pads its "
            f"vocabulary to {padded}, which would drop rows; pass --vocab-size {rows} (with "
            "NullTokenizer or HuggingFaceTokenizer)")


def load_checkpoint(args: argparse.Namespace, model: list, optimizer, scheduler):
    """Restore the latest checkpoint under --load; returns its TrainState, or None if none.
    A weights-only checkpoint loads as --finetune does (``optimizer`` may then be None)."""
    from megatron.training.training import TrainState

    directory, common = latest_checkpoint(args.load)
    if directory is None:
        if dist.get_rank() == 0:
            print(f"> no checkpoint under --load {args.load}; training from scratch", flush=True)
        return None
    saved = common["train_state"]
    check_model_args(saved.get("model_args"), args, directory)
    _check_vocabulary(args, common, directory)
    fresh = args.finetune or saved.get("weights_only", False)
    load_optimizer = not (args.no_load_optim or fresh)
    load_rng = not (args.no_load_rng or fresh) and saved["world_size"] == dist.get_world_size()
    template = _sharded_state_dict(args, model, optimizer, include_optimizer=load_optimizer,
                                   include_rng=load_rng, is_loading=True)
    loaded = dist_checkpointing.load(template, str(directory))
    model[0].module.load_state_dict(loaded["model"])
    if load_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(common["opt_param_scheduler"])
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    if "hf_config" in common:
        args.hf_config = common["hf_config"]  # saved again with every checkpoint of this run
    if dist.get_rank() == 0:
        print(f"> loaded checkpoint {directory} (iteration {saved['iteration']})", flush=True)
        if saved.get("weights_only", False) and not args.finetune:
            print("> it holds weights only: starting at iteration 0 with a fresh optimizer, "
                  "as --finetune", flush=True)
    if fresh:
        return TrainState()
    return TrainState(
        iteration=saved["iteration"],
        consumed_train_samples=saved["consumed_train_samples"],
        consumed_valid_samples=saved["consumed_valid_samples"],
    )


def load_weights(root: str | Path, module: torch.nn.Module,
                 args: Optional[argparse.Namespace] = None) -> dict:
    """Load the latest checkpoint's model weights under ``root`` into ``module`` (resharded to
    this process's layout by dist_checkpointing); returns the checkpoint's common state. With
    ``args``, the model flags are checked against the checkpoint's first, as a resuming run's."""
    directory, common = latest_checkpoint(root)
    if directory is None:
        raise ValueError(f"--load {root}: no {TRACKER_FILENAME}; point it at a checkpoint "
                         "directory written by the trainer or tools/checkpoint")
    if args is not None:
        check_model_args(common["train_state"].get("model_args"), args, directory)
        _check_vocabulary(args, common, directory)
    loaded = dist_checkpointing.load({"model": module.sharded_state_dict()}, str(directory))
    module.load_state_dict(loaded["model"])
    return common
