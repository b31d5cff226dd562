"""Hugging Face model directory -> the trainer's checkpoint (:func:`import_hf`), and back
(:func:`export_hf`).

Both build the trainer's own GPTModel (megatron.training.gpt.model_provider) in a world of one and go
through the trainer's checkpoint functions (megatron.training.checkpointing), so the
checkpoint is exactly what pretrain_gpt.py saves and loads: megatron-core dist_checkpointing,
resharded on load to any TP/PP (CP does not shard weights). The vocabulary is padded for TP = 1;
megatron-core loads the rows a run shares with the checkpoint and zero-fills the rest, so
another TP size's padding loads too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from megatron.training import checkpointing
from megatron.memo_tools.hf_checkpoint.atomic import atomic_directory, check_output_directory
from megatron.memo_tools.hf_checkpoint.errors import ConversionError
from megatron.memo_tools.hf_checkpoint.hf_config import (
    DEFAULT_VOCAB_DIVISOR,
    architecture,
    read_config,
    trainer_flags,
)
from megatron.memo_tools.hf_checkpoint.rope import write_rope
from megatron.memo_tools.hf_checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    SafetensorsReader,
    copy_files,
    write_json,
    write_safetensors,
)
from megatron.memo_tools.hf_checkpoint.trainer_model import build_model, trainer_args, world_of_one
from megatron.memo_tools.hf_checkpoint.weight_map import (
    EMBEDDING,
    check_hf_tensors,
    to_hf,
    to_megatron,
)

# Files of a Hugging Face model directory that are not weights, copied into the checkpoint by
# an import (the trainer's HuggingFaceTokenizer reads them there) and by an export. An import's
# tokenizer files may come from another folder (--tokenizer-model).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja")
MODEL_FILES = ("generation_config.json",)
# A check of the command line against the model's config.json (the dict, and the name of its
# source for the message): raises ConversionError.
ConfigCheck = Callable[[dict, str], None]
# The flag line, one flag or value a line, beside the checkpoint: pretrain_gpt.py @FILE reads it.
FLAGS_FILE = "model_flags.txt"


def _tokenizer_flags(hf_dir: Path, save_dir: Path, vocab_size: int,
                     log: Callable[[str], None]) -> list[str]:
    """The flags that make the trainer read the tokenizer files copied into ``save_dir``
    (absolute: the launch may run elsewhere), or none when ``hf_dir`` has no tokenizer the
    trainer can use (said in one line: the checkpoint still trains on pre-tokenized data)."""
    if not (hf_dir / "tokenizer.json").is_file():
        return []
    from megatron.training.tokenizer import HuggingFaceTokenizer, model_vocab_size

    try:
        model_vocab_size(HuggingFaceTokenizer(str(hf_dir)), "HuggingFaceTokenizer", vocab_size)
    except ValueError as error:
        log(f"> {FLAGS_FILE} names no tokenizer: {error}")
        return []
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            str(save_dir.absolute())]


def _checkpoint_dtype(reader: SafetensorsReader, names: list[str]) -> torch.dtype:
    """The weights' dtype; float32 when they mix several."""
    dtypes = {reader.dtype_of(name) for name in names}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def import_hf(hf_dir: str | Path, save_dir: str | Path,
              make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
              dtype: Optional[torch.dtype] = None, ignore_sliding_window: bool = False,
              log: Callable[[str], None] = print,
              tokenizer_dir: Optional[str | Path] = None,
              check: Optional[ConfigCheck] = None) -> list[str]:
    """Write the model of ``hf_dir`` as a weights-only trainer checkpoint under ``save_dir``
    (stored in ``dtype``, default the weights' own), with the tokenizer files of
    ``tokenizer_dir`` (default ``hf_dir``; a tokenizer.json names its folder) beside it;
    returns the trainer's model flags (and its tokenizer flags when the folder has one)."""
    hf_dir, save_dir = Path(hf_dir), Path(save_dir)
    if tokenizer_dir is None:
        tokenizer_dir = hf_dir
    else:  # asked for: a folder the trainer cannot read from is refused, not left out
        tokenizer_dir = Path(tokenizer_dir)
        tokenizer_dir = tokenizer_dir.parent if tokenizer_dir.is_file() else tokenizer_dir
        if not (tokenizer_dir / "tokenizer.json").is_file():
            raise ConversionError(f"--tokenizer-model {tokenizer_dir}: no tokenizer.json there "
                                  "(the trainer reads that file only); give a Hugging Face "
                                  "tokenizer folder or drop the flag")
    config = read_config(hf_dir)
    source = str(hf_dir / "config.json")
    if check is not None:
        check(config, source)
    flags = trainer_flags(config, source, make_vocab_size_divisible_by, ignore_sliding_window)
    arch = architecture(config, source, ignore_sliding_window)
    check_output_directory(save_dir, "--save-dir")
    reader = SafetensorsReader(hf_dir)
    check_hf_tensors(reader, arch, str(hf_dir))
    dtype = dtype or _checkpoint_dtype(reader, reader.keys())
    args = trainer_args(flags)
    from megatron.training.tokenizer import padded_vocab_size

    args.padded_vocab_size = padded_vocab_size(arch.vocab_size, make_vocab_size_divisible_by, 1)
    with world_of_one(args):
        model = build_model(args, dtype)
        parameters = dict(model.named_parameters())
        for name, tensor in to_megatron(reader.get, arch, args.padded_vocab_size):
            parameter = parameters.pop(name)
            if parameter.shape != tensor.shape:  # the flags and the mapping disagree: a bug
                raise AssertionError(f"{name}: model {list(parameter.shape)}, mapped "
                                     f"{list(tensor.shape)}")
            with torch.no_grad():
                parameter.copy_(tensor)
        if parameters:
            raise AssertionError(f"parameters the mapping does not fill: {sorted(parameters)}")
        flags += _tokenizer_flags(tokenizer_dir, save_dir, arch.vocab_size, log)
        with atomic_directory(save_dir, "--save-dir") as partial:
            checkpointing.save_weights_checkpoint(args, model, partial, hf_config=config)
            copy_files(hf_dir, partial, MODEL_FILES)
            copy_files(tokenizer_dir, partial, TOKENIZER_FILES)
            (partial / FLAGS_FILE).write_text("\n".join(flags) + "\n")
    log(f"> converted {hf_dir} ({arch.model_type}, {str(dtype).removeprefix('torch.')}) to "
        f"{save_dir}")
    return flags


def _export_args(base: dict, source: str, recorded: Optional[dict]):
    """Trainer arguments of the checkpoint: the base config.json's network (which must be the
    checkpoint's) with the checkpoint's position flags; and whether those changed."""
    args = trainer_args(trainer_flags(base, source, ignore_sliding_window=True))
    if not recorded:
        return args, False
    for name in checkpointing.ARCHITECTURE_ARGS:
        if name in recorded and recorded[name] != getattr(args, name):
            raise ConversionError(
                f"{source} describes --{name.replace('_', '-')} {getattr(args, name)}, the "
                f"checkpoint has {recorded[name]}; pass --hf-dir of the model it came from")
    changed = False
    for name in checkpointing.POSITION_ARGS:
        if name in recorded and recorded[name] != getattr(args, name):
            setattr(args, name, recorded[name])
            changed = True
    return args, changed


def _exported_config(base: dict, args, positions_changed: bool, dtype: torch.dtype) -> dict:
    config = dict(base)
    if positions_changed:
        write_rope(config, args)
        config["max_position_embeddings"] = args.max_position_embeddings
    name = str(dtype).removeprefix("torch.")
    keys = [key for key in ("torch_dtype", "dtype") if key in config] or ["torch_dtype"]
    for key in keys:
        config[key] = name
    return config


def export_hf(load_dir: str | Path, save_dir: str | Path, hf_dir: Optional[str | Path] = None,
              dtype: Optional[torch.dtype] = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              log: Callable[[str], None] = print, check: Optional[ConfigCheck] = None) -> Path:
    """Write the latest checkpoint under ``load_dir`` (any TP/PP it was saved at) as a
    Hugging Face model directory ``save_dir``: safetensors in ``dtype`` (default the
    checkpoint's) and config.json (that of ``hf_dir``, else the one the checkpoint carries,
    with the checkpoint's RoPE and max_position_embeddings)."""
    from megatron.core import dist_checkpointing

    load_dir, save_dir = Path(load_dir), Path(save_dir)
    check_output_directory(save_dir, "--save-dir")
    directory, common = checkpointing.latest_checkpoint(load_dir)
    if directory is None:
        raise ConversionError(f"--load-dir {load_dir} has no {checkpointing.TRACKER_FILENAME}; "
                              "point it at a checkpoint written by the trainer or this tool")
    if hf_dir is not None:
        base, source = read_config(Path(hf_dir)), str(Path(hf_dir) / "config.json")
    elif common.get("hf_config") is not None:
        base, source = common["hf_config"], f"the config.json {directory} carries"
    else:
        raise ConversionError(f"--load-dir {load_dir} carries no Hugging Face config.json (it "
                              "was not converted from one); pass --hf-dir with the model it "
                              "started from")
    if check is not None:
        check(base, source)
    arch = architecture(base, source, ignore_sliding_window=True)
    args, positions_changed = _export_args(base, source,
                                           common["train_state"].get("model_args"))
    embedding = dist_checkpointing.load_tensors_metadata(str(directory))[EMBEDDING[1]]
    rows, stored = embedding.global_shape[0], embedding.dtype
    if rows < arch.vocab_size:
        raise ConversionError(f"--load-dir {directory}: {rows} vocabulary rows, fewer than "
                              f"vocab_size {arch.vocab_size} of {source}")
    args.padded_vocab_size = rows
    dtype = dtype or stored
    with world_of_one(args):
        model = build_model(args, stored)
        checkpointing.load_weights(load_dir, model)
        parameters = {name: p.detach() for name, p in model.named_parameters()}
        tensors = {name: t.to(dtype) for name, t in to_hf(parameters.__getitem__, arch)}
    del model, parameters
    with atomic_directory(save_dir, "--save-dir") as partial:
        files = write_safetensors(tensors, partial, max_shard_bytes)
        write_json(_exported_config(base, args, positions_changed, dtype), partial / "config.json")
        if hf_dir is not None:
            files += copy_files(Path(hf_dir), partial, TOKENIZER_FILES + MODEL_FILES)
    log(f"> exported {directory} to {save_dir}: config.json, {', '.join(files)}"
        + ("" if positions_changed else " (positions as in the source config.json)"))
    return save_dir
