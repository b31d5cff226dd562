"""Command lines of tools/checkpoint: ``convert.py`` (Megatron-LM's --loader/--saver
spelling: hf -> core imports a Hugging Face model, core -> hf exports one; Megatron-LM's own
converter flags as megatron.memo_tools.hf_checkpoint.upstream_flags says) and ``hf_args.py``
(the trainer's flag line for a Hugging Face config.json)."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from typing import Optional, Sequence

from megatron.memo_tools.hf_checkpoint.errors import ConversionError
from megatron.memo_tools.hf_checkpoint.hf_config import DEFAULT_VOCAB_DIVISOR
from megatron.memo_tools.hf_checkpoint.upstream_flags import (
    add_upstream_args,
    check_command_line,
    config_check,
    plugin,
)

# --dtype -> the torch dtype's name (torch is imported only once the command line is valid)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}


def _size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text, re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB or 500MB")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "").upper()])


def _add_vocab_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=DEFAULT_VOCAB_DIVISOR,
                        help="Pad the vocabulary to a multiple of this (the trainer's flag; "
                        f"default {DEFAULT_VOCAB_DIVISOR}).")
    parser.add_argument("--ignore-sliding-window", action="store_true",
                        help="Convert a model with sliding-window attention (Mistral v0.1) to "
                        "the trainer's full causal attention (identical up to the window).")


class _OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line naming the flag (no usage block): the converter's rule."""

    def error(self, message):
        raise ConversionError(re.sub(r"^argument (\S+?)(/\S+)?: ", r"\1: ", message))


def convert_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        description="Convert between a Hugging Face model directory (Llama, Mistral, Qwen2) and "
        "the trainer's checkpoint (docs/hf_checkpoint.md); Megatron-LM's converter spellings "
        "are accepted or refused as docs/megatron_convert_flags.md says.", allow_abbrev=False)
    parser.add_argument("--loader", required=True,
                        help="Format read: hf (a model directory of safetensors) or core (a "
                        "checkpoint of pretrain_gpt.py, at any TP/PP); Megatron-LM's "
                        "llama_mistral and mcore too.")
    parser.add_argument("--saver", required=True,
                        help="Format written: the other one (Megatron-LM's mcore too).")
    parser.add_argument("--load-dir", required=True, help="Directory read.")
    parser.add_argument("--save-dir", required=True,
                        help="Directory written (new or empty; appears only when complete).")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="Store the weights in this dtype (default: as read; fp32 with "
                        "--loader llama_mistral, as Megatron-LM).")
    parser.add_argument("--hf-dir", default=None,
                        help="core -> hf: the Hugging Face model the checkpoint started from; "
                        "its config.json is the base (default: the one the checkpoint carries) "
                        "and its tokenizer files are copied.")
    parser.add_argument("--max-shard-size", type=_size, default="5GB",
                        help="core -> hf: largest safetensors file (default 5GB, as "
                        "transformers).")
    _add_vocab_args(parser)
    add_upstream_args(parser)
    return parser


def parse_convert_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The command line, with Megatron-LM's loader and saver names mapped to ours and what this
    converter cannot do refused in one line (ConversionError)."""
    args, unknown = convert_parser().parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=", 1)[0]
        raise ConversionError(f"{flag}: not a flag of tools/checkpoint/convert.py (its own and "
                              "Megatron-LM's converter flags: docs/megatron_convert_flags.md)")
    upstream_loader = args.loader
    args.loader, args.saver = plugin("--loader", args.loader), plugin("--saver", args.saver)
    if args.loader == args.saver:
        raise ConversionError(f"--loader {upstream_loader} --saver {args.saver} converts "
                              "nothing; use --loader hf --saver core or --loader core --saver hf")
    check_command_line(args)
    half = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    # Megatron-LM's llama_mistral loader builds its model in fp32 unless --bf16/--fp16
    default = "fp32" if upstream_loader == "llama_mistral" else None
    args.dtype = args.dtype or half or default
    return args


def _run(main_body) -> int:
    from megatron.training.library_warnings import hide_library_warnings

    hide_library_warnings()  # megatron.core's import-time notices of a CPU machine
    try:
        main_body()
    except ValueError as error:
        # the trainer's argument errors, when the body got as far as importing the trainer
        # (torch and megatron.core: seconds, which a bad config.json does not wait for)
        arguments = sys.modules.get("megatron.training.arguments")
        trainer_error = arguments is not None and isinstance(error,
                                                             arguments.ArgumentValidationError)
        if not (isinstance(error, ConversionError) or trainer_error):
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


def convert_main(argv: Optional[Sequence[str]] = None) -> int:
    try:  # before the training stack is imported: a refused command line fails at once
        args = parse_convert_args(argv)
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2

    def body():
        import torch

        from megatron.memo_tools.hf_checkpoint.convert import FLAGS_FILE, export_hf, import_hf

        dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
        check = config_check(args)
        if args.loader == "hf":
            flags = import_hf(args.load_dir, args.save_dir, args.make_vocab_size_divisible_by,
                              dtype, args.ignore_sliding_window,
                              tokenizer_dir=args.tokenizer_model, check=check)
            print(f"> model flags (also in {args.save_dir}/{FLAGS_FILE}; pretrain_gpt.py "
                  f"@{args.save_dir}/{FLAGS_FILE} reads them):")
            print(shlex.join(flags), flush=True)
        else:
            export_hf(args.load_dir, args.save_dir, args.hf_dir, dtype, args.max_shard_size,
                      check=check)

    return _run(body)


def hf_args_main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Print pretrain_gpt.py's model flags for a Hugging Face config.json.",
        allow_abbrev=False)
    parser.add_argument("model", help="A Hugging Face model directory or its config.json.")
    _add_vocab_args(parser)
    args = parser.parse_args(argv)

    def body():
        from pathlib import Path

        from megatron.memo_tools.hf_checkpoint.hf_config import read_config, trainer_flags

        path = Path(args.model)
        source = str(path / "config.json" if path.is_dir() else path)
        print(shlex.join(trainer_flags(read_config(path), source,
                                       args.make_vocab_size_divisible_by,
                                       args.ignore_sliding_window)), flush=True)

    return _run(body)
