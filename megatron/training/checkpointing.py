"""Checkpoints through megatron.core.dist_checkpointing, written atomically.

Layout under --save::

    iter_0000010/                    one dist_checkpointing directory per saved iteration
    latest_checkpointed_iteration.txt

Every rank writes into ``iter_XXXXXXX.partial``; only after all ranks finished does rank 0
rename it to ``iter_XXXXXXX`` and then replace the tracker file (write + fsync + os.replace).
A crash mid-save leaves the previous checkpoint and tracker untouched, so --load never sees a
half-written checkpoint.

What is saved: model and optimizer (sharded, so TP/PP layouts can be resharded on load; the
distributed optimizer's state in megatron-core's ``dp_reshardable`` format, Megatron-LM's
default, which reshards across data-parallel sizes only), the
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

from megatron.training import fsdp_checkpointing
from megatron.training.arguments import ArgumentValidationError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
PARTIAL_SUFFIX = ".partial"
# Bump when the common-state layout changes; loading an unknown version is refused.
CHECKPOINT_FORMAT_VERSION = 1

# Flags that fix the network's shape and arithmetic: a run loading a checkpoint must agree.
ARCHITECTURE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "norm_epsilon", "swiglu", "add_bias_linear", "add_qkv_bias",
    "untie_embeddings_and_output_weights", "rotary_percent", "apply_layernorm_1p",
)
# Flags of positions, which continued pretraining may change (longer context, RoPE scaling).
POSITION_ARGS = (
    "position_embedding_type", "max_position_embeddings", "rotary_base",
    "rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor",
    "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
    "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int",
)
MODEL_ARGS = ARCHITECTURE_ARGS + POSITION_ARGS + ("padded_vocab_size",)
# How DistributedOptimizer.sharded_state_dict lays out its state, as Megatron-LM's default: each
# rank writes its own shard of every bucket (no gather); the checkpoint can be loaded at another
# data-parallel size but not at another TP/PP layout. megatron-core's own default,
# 'fully_sharded_model_space', fails to save in 0.16.1 (ShardedTensor.flattened_range).
DISTRIB_OPTIM_SHARDING_TYPE = "dp_reshardable"


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
              ("swiglu", "add_qkv_bias", "untie_embeddings_and_output_weights",
               "apply_layernorm_1p") if recorded.get(name)]
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


def _model_parallel(args: argparse.Namespace) -> list[int]:
    """[TP, PP]: what shapes the gradient buckets a distributed optimizer's state follows."""
    return [args.tensor_model_parallel_size, args.pipeline_model_parallel_size]


def _train_state_record(args: argparse.Namespace, iteration: int, consumed_train_samples: int,
                        consumed_valid_samples: int, weights_only: bool) -> dict:
    return {
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "world_size": dist.get_world_size(),
        "model_parallel": _model_parallel(args),
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "weights_only": weights_only,
        "model_args": model_args_record(args),
    }


def content_metadata(args: argparse.Namespace) -> Optional[dict]:
    """What megatron.core's ``sharded_state_dict`` methods are told about the format (saved in
    the checkpoint as dist_checkpointing's content metadata); None for the plain optimizer."""
    if args.use_distributed_optimizer:
        return {"distrib_optim_sharding_type": DISTRIB_OPTIM_SHARDING_TYPE}
    return None


def _sharded_state_dict(args: argparse.Namespace, model: list, optimizer, include_optimizer: bool,
                        include_rng: bool, is_loading: bool,
                        metadata: Optional[dict] = None) -> dict:
    state = {"model": model[0].module.sharded_state_dict()}
    if include_optimizer:
        extra = {} if metadata is None else {"metadata": metadata}
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=is_loading,
                                                          **extra)
    if include_rng:
        state["rng_state"] = _rng_sharded_object()
    return state


def _rng_sharded_object() -> ShardedObject:
    """This rank's RNG states as a torch_dist checkpoint holds them (one object per rank)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    return ShardedObject("rng_state", _rng_state(), (world_size,), (rank,), replica_id=0)


def _write_tracker(root: Path, iteration: int) -> None:
    temporary = root / (TRACKER_FILENAME + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(str(iteration))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, root / TRACKER_FILENAME)


def _write_checkpoint(root: Path, iteration: int, sharded: dict,
                      metadata: Optional[dict] = None, writer=None) -> Path:
    """dist_checkpointing.save (with ``metadata`` as its content metadata), or ``writer``
    (called with the directory), into ``iter_XXXXXXX.partial``, then rename it and replace the
    tracker file (collective)."""
    final = checkpoint_dir(root, iteration)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    dist.barrier()
    if writer is None:
        dist_checkpointing.save(sharded, str(partial), content_metadata=metadata)
    else:
        writer(partial)
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
    if args.ckpt_format == "fsdp_dtensor":
        return _save_fsdp_dtensor(args, state, model, optimizer, scheduler)
    metadata = content_metadata(args)
    sharded = _sharded_state_dict(args, model, optimizer, include_optimizer=True,
                                  include_rng=True, is_loading=False, metadata=metadata)
    sharded["opt_param_scheduler"] = scheduler.state_dict()
    sharded["train_state"] = _train_state_record(
        args, state.iteration, state.consumed_train_samples, state.consumed_valid_samples,
        weights_only=False)
    if getattr(args, "hf_config", None) is not None:
        sharded["hf_config"] = args.hf_config
    return _write_checkpoint(Path(args.save), state.iteration, sharded, metadata)


def _save_fsdp_dtensor(args: argparse.Namespace, state, model: list, optimizer,
                       scheduler) -> Path:
    """--ckpt-format fsdp_dtensor (megatron.training.fsdp_checkpointing): the same common state
    as a torch_dist checkpoint, the model and optimizer as Megatron-FSDP's DTensors."""
    common = {"opt_param_scheduler": scheduler.state_dict(),
              "train_state": _train_state_record(
                  args, state.iteration, state.consumed_train_samples,
                  state.consumed_valid_samples, weights_only=False)}
    if getattr(args, "hf_config", None) is not None:
        common["hf_config"] = args.hf_config
    return _write_checkpoint(
        Path(args.save), state.iteration, {}, writer=lambda partial: fsdp_checkpointing.write(
            args, partial, model, optimizer, _rng_state(), common))


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
    if fsdp_checkpointing.is_fsdp_dtensor_checkpoint(directory):
        common = fsdp_checkpointing.read_common(directory)
    else:
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


def _check_optimizer_state_loads(args: argparse.Namespace, metadata: Optional[dict],
                                 saved: dict, where: Path) -> None:
    """The optimizer state of a checkpoint loads only into the kind of optimizer that saved it
    (the distributed optimizer's is laid out by gradient buckets, the plain one's by
    parameter), and the distributed optimizer's only at the TP and PP sizes that saved it
    (its buckets reshard across data-parallel sizes alone)."""
    saved_distributed = "distrib_optim_sharding_type" in (metadata or {})
    if saved_distributed != bool(args.use_distributed_optimizer):
        kind = "with" if saved_distributed else "without"
        raise ArgumentValidationError(
            f"--load {where}: its optimizer state was saved {kind} --use-distributed-optimizer; "
            f"train {kind} it too, or pass --no-load-optim to start a fresh optimizer")
    layout = saved.get("model_parallel")
    if saved_distributed and layout is not None and layout != _model_parallel(args):
        raise ArgumentValidationError(
            f"--load {where}: its distributed optimizer state was saved at "
            f"--tensor-model-parallel-size {layout[0]} --pipeline-model-parallel-size "
            f"{layout[1]} and reshards across data-parallel sizes only; train at those sizes, "
            "or pass --no-load-optim to start a fresh optimizer")


def _allocate_distributed_optimizer_state(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet its Adam states, so that its load
    template can be built.

    With torch's Adam (no Transformer Engine or apex, on CPU and GPU alike) megatron-core
    0.16.1's DistributedOptimizer.state_dict() -- which sharded_state_dict(is_loading=True)
    calls -- asserts that its states hold exactly one step, and a fresh optimizer has none.
    megatron-core's own remedy, used before its FSDP loads, is
    ``_init_optimizer_states_with_dummy_values``: one step on zero gradients. That step may
    move this rank's shard of the weights (decoupled weight decay); the load then overwrites
    weights, main parameters, moments and step alike. With Transformer Engine's or apex's
    FusedAdam, whose state_dict() accepts empty states, nothing is done."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer) -> None:
    """Set each parameter's Adam ``step`` to the checkpoint's, in a tensor of its own.

    With torch's Adam, megatron-core 0.16.1's DistributedOptimizer.load_state_dict goes wrong
    twice: it gives every parameter's state one shared ``step`` tensor (torch's Adam increments
    each parameter's step in place, so a shared one would advance once per parameter per
    iteration), and its dp_reshardable loader then copies into that tensor the step of the load
    template (the states before the load: one dummy step), not the checkpoint's. The
    checkpoint's step is in each parameter group (DistributedOptimizer.state_dict records it
    there for torch's Adam), which load_state_dict restored."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(inner, DistributedOptimizer):
            continue
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                state = inner.optimizer.state.get(param, {})
                step = state.get("step")
                if isinstance(step, torch.Tensor) and "step" in group:
                    state["step"] = torch.tensor(float(group["step"]), dtype=step.dtype,
                                                 device=step.device)


def load_checkpoint(args: argparse.Namespace, model: list, optimizer, scheduler):
    """Restore the latest checkpoint under --load; returns its TrainState, or None if none.
    A weights-only checkpoint loads as --finetune does (``optimizer`` may then be None)."""
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
    saved_format = _check_checkpoint_format(args, directory, load_optimizer)
    if saved_format != args.ckpt_format:  # torch_dist weights into Megatron-FSDP
        fsdp_checkpointing.load_torch_dist_weights(directory, model)
        rng = _load_torch_dist_rng(directory) if load_rng else None
        return _loaded(args, common, directory, scheduler, load_optimizer, rng, fresh)
    if args.ckpt_format == "fsdp_dtensor":
        rng = fsdp_checkpointing.load(args, directory, model, optimizer, load_optimizer,
                                      load_rng, _rng_state())
        return _loaded(args, common, directory, scheduler, load_optimizer, rng, fresh)
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if load_optimizer:
        _check_optimizer_state_loads(args, metadata, saved, directory)
        _allocate_distributed_optimizer_state(optimizer)
    template = _sharded_state_dict(args, model, optimizer, include_optimizer=load_optimizer,
                                   include_rng=load_rng, is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load(template, str(directory))
    model[0].module.load_state_dict(loaded["model"])
    if load_optimizer:
        # No autograd: with fp32 parameters the distributed optimizer's main parameters are views
        # of the model's (leaves that require grad), which its dp_reshardable loader copies into
        # in place without torch.no_grad (megatron-core 0.16.1; its other loaders have it).
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    return _loaded(args, common, directory, scheduler, load_optimizer,
                   loaded["rng_state"] if load_rng else None, fresh)


def _loaded(args: argparse.Namespace, common: dict, directory: Path, scheduler,
            load_optimizer: bool, rng_state: Optional[dict], fresh: bool):
    """What load_checkpoint restores after the model and optimizer, in either format: the LR
    schedule, the RNG states, the Hugging Face config; its TrainState."""
    from megatron.training.training import TrainState

    saved = common["train_state"]
    if load_optimizer:
        scheduler.load_state_dict(common["opt_param_scheduler"])
    if rng_state is not None:
        _set_rng_state(rng_state)
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


def _check_checkpoint_format(args: argparse.Namespace, directory: Path,
                             load_optimizer: bool) -> str:
    """The --ckpt-format that wrote ``directory``. A checkpoint loads in the format that wrote
    it (Megatron-FSDP's DTensors with fsdp_dtensor, dist_checkpointing's shards with
    torch_dist), except a torch_dist checkpoint's weights into a Megatron-FSDP run
    (fsdp_checkpointing.load_torch_dist_weights): its optimizer state is laid out by the other
    optimizer's buckets, so that run starts a fresh optimizer."""
    saved = "fsdp_dtensor" if fsdp_checkpointing.is_fsdp_dtensor_checkpoint(directory) \
        else "torch_dist"
    if saved == args.ckpt_format:
        return saved
    if saved == "fsdp_dtensor":
        raise ArgumentValidationError(
            f"--load {directory}: it was saved with --ckpt-format fsdp_dtensor (Megatron-FSDP), "
            f"this run has --ckpt-format {args.ckpt_format}; load it with --use-megatron-fsdp "
            "--ckpt-format fsdp_dtensor")
    if load_optimizer:
        raise ArgumentValidationError(
            f"--load {directory}: a torch_dist checkpoint's optimizer state does not load into "
            "Megatron-FSDP (--ckpt-format fsdp_dtensor); pass --no-load-optim to load its "
            "weights, RNG states and data position with a fresh optimizer, or --finetune")
    return saved


def _load_torch_dist_rng(directory: Path) -> dict:
    """This rank's RNG states from a torch_dist checkpoint saved at this world size."""
    return dist_checkpointing.load({"rng_state": _rng_sharded_object()},
                                   str(directory))["rng_state"]


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
