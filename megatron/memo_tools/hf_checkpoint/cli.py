"""Command lines of tools/checkpoint: ``convert.py`` (Megatron-LM's --loader/--saver
spelling: hf -> core imports a Hugging Face model, core -> hf exports one) and ``hf_args.py``
(the trainer's flag line for a Hugging Face config.json)."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from typing import Optional, Sequence

import torch

from megatron.memo_tools.hf_checkpoint.errors import ConversionError
from megatron.memo_tools.hf_checkpoint.hf_config import DEFAULT_VOCAB_DIVISOR

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
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


def convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert between a Hugging Face model directory (Llama, Mistral, Qwen2) and "
        "the trainer's checkpoint (docs/hf_checkpoint.md).", allow_abbrev=False)
    parser.add_argument("--loader", required=True, choices=("hf", "core"),
                        help="Format read: hf (a model directory of safetensors) or core (a "
                        "checkpoint of pretrain_gpt.py, at any TP/PP).")
    parser.add_argument("--saver", required=True, choices=("hf", "core"),
                        help="Format written: the other one.")
    parser.add_argument("--load-dir", required=True, help="Directory read.")
    parser.add_argument("--save-dir", required=True,
                        help="Directory written (new or empty; appears only when complete).")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="Store the weights in this dtype (default: as read).")
    parser.add_argument("--hf-dir", default=None,
                        help="core -> hf: the Hugging Face model the checkpoint started from; "
                        "its config.json is the base (default: the one the checkpoint carries) "
                        "and its tokenizer files are copied.")
    parser.add_argument("--max-shard-size", type=_size, default="5GB",
                        help="core -> hf: largest safetensors file (default 5GB, as "
                        "transformers).")
    _add_vocab_args(parser)
    return parser


def _run(main_body) -> int:
    from megatron.training.arguments import ArgumentValidationError, silence_expected_cpu_warnings

    silence_expected_cpu_warnings()
    try:
        main_body()
    except (ConversionError, ArgumentValidationError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


def convert_main(argv: Optional[Sequence[str]] = None) -> int:
    args = convert_parser().parse_args(argv)
    if args.loader == args.saver:
        print(f"error: --loader {args.loader} --saver {args.saver} converts nothing; use "
              "--loader hf --saver core or --loader core --saver hf", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if args.dtype else None

    def body():
        from megatron.memo_tools.hf_checkpoint.convert import FLAGS_FILE, export_hf, import_hf

        if args.loader == "hf":
            flags = import_hf(args.load_dir, args.save_dir, args.make_vocab_size_divisible_by,
                              dtype, args.ignore_sliding_window)
            print(f"> model flags (also in {args.save_dir}/{FLAGS_FILE}; pretrain_gpt.py "
                  f"@{args.save_dir}/{FLAGS_FILE} reads them):")
            print(shlex.join(flags), flush=True)
        else:
            export_hf(args.load_dir, args.save_dir, args.hf_dir, dtype, args.max_shard_size)

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
