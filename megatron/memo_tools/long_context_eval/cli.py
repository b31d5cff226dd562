"""``tools/eval_long_context.py``: the trainer's flags (the model, the layout, the data and the
tokenizer, as the run that trained the checkpoint had them) plus this tool's group. Run it as
one process or under torchrun at any TP, CP and PP; see docs/eval_long_context.md."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron.training.arguments import ArgumentValidationError, parse_args, run_main
from megatron.memo_tools.long_context_eval.buckets import (
    BUCKET_KINDS,
    bucket_edges,
    default_bucket_size,
)

# The training flags parse_args requires; they play no part here (flags given after win).
PLACEHOLDER_FLAGS = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4"]
DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"


def _list_of(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                             f"{kind.__name__}s") from None
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return values

    return parse


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="long-context evaluation")
    group.add_argument("--use-checkpoint-args", action="store_true",
                       help="Take the model flags from the checkpoint under --load (its record "
                       "of the architecture and position flags); flags given here still win, "
                       "so positions may differ (the architecture must not).")
    group.add_argument("--output-dir", required=True,
                       help="Directory of eval_long_context.json, .md and .png (created; the "
                       "files are replaced atomically).")
    group.add_argument("--eval-samples", type=int, default=16,
                       help="Sequences of --seq-length tokens for the perplexity by position "
                       "(0: skip it). Default 16.")
    group.add_argument("--eval-split", choices=("train", "validation", "test"),
                       default="validation",
                       help="Which --split of --data-path they come from. Default validation.")
    group.add_argument("--position-buckets", choices=BUCKET_KINDS, default="linear",
                       help="linear: buckets of --position-bucket-size positions; log2: the "
                       "first of that size, each next as wide as all before it.")
    group.add_argument("--position-bucket-size", type=int, default=None, metavar="TOKENS",
                       help="Default: --seq-length / 8 (linear), --seq-length / 64 (log2).")
    group.add_argument("--passkey-lengths", type=_list_of(int), default=[],
                       metavar="L1,L2,...",
                       help="Passkey prompt lengths in tokens, generated tokens included "
                       "(none: skip the passkey test).")
    group.add_argument("--passkey-depths", type=_list_of(float),
                       default=DEFAULT_DEPTHS, metavar="D1,D2,...",
                       help=f"Where the key sits in the filler, 0 (start) to 1 (end). Default "
                       f"{DEFAULT_DEPTHS}.")
    group.add_argument("--passkey-samples", type=int, default=5,
                       help="Keys per length and depth. Default 5.")
    group.add_argument("--passkey-digits", type=int, default=5, help="Digits of a key. Default 5.")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentValidationError(message)


def validate_eval_args(args: argparse.Namespace) -> None:
    """This tool's flags against each other and the trainer's (one line naming the flag)."""
    _require(args.load is not None, "--load DIR is required: the checkpoint to evaluate")
    _require(args.eval_samples >= 0, f"--eval-samples must be >= 0, got {args.eval_samples}")
    _require(args.eval_samples > 0 or args.passkey_lengths,
             "--eval-samples 0 and no --passkey-lengths: nothing to evaluate")
    if args.position_bucket_size is None:
        args.position_bucket_size = default_bucket_size(args.seq_length, args.position_buckets)
    _require(args.position_bucket_size >= 1,
             f"--position-bucket-size must be positive, got {args.position_bucket_size}")
    if not args.passkey_lengths:
        return
    _require(args.tokenizer_type != "NullTokenizer", "--passkey-lengths needs a text "
             "tokenizer (--tokenizer-type BPETokenizer or BytesTokenizer), not NullTokenizer")
    _require(args.passkey_samples >= 1,
             f"--passkey-samples must be positive, got {args.passkey_samples}")
    _require(1 <= args.passkey_digits <= 18,
             f"--passkey-digits must be 1 to 18, got {args.passkey_digits}")
    for depth in args.passkey_depths:
        _require(0 <= depth <= 1, f"--passkey-depths {depth} is outside [0, 1]")
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    multiple = math.lcm(2 * cp if cp > 1 else 1, tp if args.sequence_parallel else 1)
    for length in args.passkey_lengths:
        _require(length % multiple == 0, f"--passkey-lengths {length} is not a multiple of "
                 f"{multiple}, as --context-parallel-size {cp} and --sequence-parallel at "
                 f"--tensor-model-parallel-size {tp} need; pick multiples of {multiple}")
        _require(args.position_embedding_type != "learned_absolute"
                 or length <= args.max_position_embeddings,
                 f"--passkey-lengths {length} is past --max-position-embeddings "
                 f"{args.max_position_embeddings} of the learned position table")


def eval_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """Validated arguments; with --use-checkpoint-args the checkpoint's model flags go first."""
    prefix = argparse.ArgumentParser(add_help=False, allow_abbrev=False,
                                     fromfile_prefix_chars="@")
    prefix.add_argument("--load")
    prefix.add_argument("--use-checkpoint-args", action="store_true")
    known, _ = prefix.parse_known_args(argv)
    recorded = []
    if known.use_checkpoint_args:
        _require(known.load is not None, "--use-checkpoint-args needs --load DIR")
        from megatron.training import checkpointing

        try:
            directory, common = checkpointing.latest_checkpoint(known.load)
        except ValueError as error:
            raise ArgumentValidationError(str(error)) from None
        _require(directory is not None, f"--load {known.load}: no "
                 f"{checkpointing.TRACKER_FILENAME}; point it at a checkpoint of the trainer")
        record = common["train_state"].get("model_args")
        _require(bool(record), f"--use-checkpoint-args: {directory} records no model flags; "
                 "give them on the command line")
        recorded = checkpointing.recorded_model_flags(record)
    args = parse_args(PLACEHOLDER_FLAGS + recorded + list(argv),
                      extra_args_providers=[add_eval_args])
    validate_eval_args(args)
    args.command = shlex.join(["tools/eval_long_context.py", *argv])
    return args


def evaluate(args: argparse.Namespace) -> Optional[dict]:
    """Both measurements; the report's record on the world's last rank (None elsewhere)."""
    import torch.distributed as dist

    from megatron.training import gpt
    from megatron.training.checkpointing import read_latest_iteration
    from megatron.training.initialize import initialize_megatron
    from megatron.memo_tools.long_context_eval import evaluate as measure
    from megatron.memo_tools.long_context_eval.model import EvalModel
    from megatron.memo_tools.long_context_eval.report import passkey_record, perplexity_record
    from megatron.training.tokenizer import build_tokenizer, padded_vocab_size

    start = time.perf_counter()
    initialize_megatron(args)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                                    args.vocab_file, args.merge_file)
    except ValueError as error:
        raise ArgumentValidationError(str(error)) from None
    args.padded_vocab_size = padded_vocab_size(
        tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    model = EvalModel(args, gpt.model_provider, tokenizer.vocab_size)
    writer = dist.get_rank() == dist.get_world_size() - 1
    record = {
        "checkpoint": str(Path(args.load).absolute()),
        "iteration": read_latest_iteration(args.load),
        "command": args.command,
        "layout": (f"TP={args.tensor_model_parallel_size} CP={args.context_parallel_size} "
                   f"PP={args.pipeline_model_parallel_size} DP={args.data_parallel_size} "
                   f"SP={args.sequence_parallel}"),
    }
    if args.eval_samples:
        began = time.perf_counter()
        edges = bucket_edges(args.seq_length, args.position_buckets, args.position_bucket_size)
        losses = measure.perplexity(args, model, tokenizer, edges)
        record["perplexity"] = perplexity_record(losses, {
            "seq_length": args.seq_length, "samples": args.eval_samples,
            "split": args.eval_split, "bucket_kind": args.position_buckets,
            "bucket_size": args.position_bucket_size,
            "seconds": time.perf_counter() - began})
    if args.passkey_lengths:
        began = time.perf_counter()
        outcomes, generated_tokens = measure.passkey(args, model, tokenizer)
        record["passkey"] = passkey_record(outcomes, generated_tokens, {
            "digits": args.passkey_digits, "samples": args.passkey_samples, "seed": args.seed,
            "seconds": time.perf_counter() - began})
    record["seconds"] = time.perf_counter() - start
    return record if writer else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    def body(arguments: list[str]) -> None:
        from megatron.memo_tools.long_context_eval.report import summary_lines, write_report

        args = eval_arguments(arguments)
        record = evaluate(args)
        if record is not None:
            for line in summary_lines(record):
                print(line, flush=True)
            paths = write_report(Path(args.output_dir), record)
            print(f"> wrote {', '.join(map(str, paths))}", flush=True)

    run_main(body, sys.argv[1:] if argv is None else argv)
    return 0
