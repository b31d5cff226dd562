"""Tokenize a JSON-lines corpus into megatron-core indexed datasets (.bin/.idx).

Each line of --input is one JSON object; for every name in --json-keys its string value is one
document. Per key the script writes ``{output-prefix}_{key}_document.bin`` and ``.idx``, which
``--data-path {output-prefix}_{key}_document`` then reads through megatron-core's GPTDataset.

Documents that tokenize to nothing are skipped and counted (GPTDataset cannot sample from a
dataset whose documents are all empty). Outputs are built under temporary names and renamed into
place only after every line was read, so a failure never leaves partial files. Input errors
(missing file, a line that is not JSON, a missing key) print one line to stderr and exit with
code 2.

Example:
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type BPETokenizer --tokenizer-model tokenizer.json --append-eod --workers 2
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model Meta-Llama-3.1-8B --append-eod
"""

import argparse
import json
import multiprocessing
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with warnings.catch_warnings():
    # Importing megatron.core warns four times that Transformer Engine and Apex are missing;
    # this tool uses neither, and the noise would bury its one-line errors.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    from megatron.training.tokenizer import TOKENIZER_TYPES, build_tokenizer

# Lines handed to a worker at a time: large enough to amortize inter-process pickling.
_WORKER_CHUNK_LINES = 64


class InputError(Exception):
    """A problem with the command line or the input file, reported as one line, exit code 2."""


@dataclass
class KeyStats:
    """What was written for one JSON key."""

    output_prefix: str
    """Prefix of the .bin/.idx pair, the value to pass as --data-path."""
    documents: int
    """Documents written."""
    tokens: int
    """Tokens written, EOD tokens included."""
    empty_documents: int
    """Documents skipped because they tokenized to nothing."""


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (Megatron-LM flag names)."""
    parser = argparse.ArgumentParser(
        prog="preprocess_data.py",
        description="Tokenize a JSON-lines corpus into megatron-core .bin/.idx datasets.",
    )
    parser.add_argument("--input", required=True, help="JSON-lines file, one object per line.")
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="Keys whose string values are documents; one dataset per key (default: text).",
    )
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="Outputs are {prefix}_{key}_document.bin/.idx; missing directories are created.",
    )
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument(
        "--tokenizer-model",
        default=None,
        help="BPETokenizer: its JSON file. HuggingFaceTokenizer: a Hugging Face tokenizer folder "
        "or its tokenizer.json.",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="Vocabulary size (NullTokenizer only)."
    )
    parser.add_argument("--vocab-file", default=None,
                        help="GPT2BPETokenizer: GPT-2's vocab.json.")
    parser.add_argument("--merge-file", default=None,
                        help="GPT2BPETokenizer: GPT-2's merges.txt.")
    parser.add_argument(
        "--append-eod", action="store_true", help="Append the EOD token to every document."
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="Tokenizing processes (default: 1, in-process)."
    )
    return parser


class _DocumentEncoder:
    """Turns numbered input lines into token ids per key; one instance per process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.input_path = args.input
        self.json_keys = args.json_keys
        self.append_eod = args.append_eod
        self.tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                                         args.vocab_file, args.merge_file)

    def encode(self, numbered_line: tuple[int, bytes]) -> dict[str, list[int]] | None:
        """Return {key: ids} for one line (ids empty for an empty document), None for a blank line.

        Raises InputError naming the line for invalid JSON, a missing key or a non-string value.
        """
        line_number, line = numbered_line
        if not line.strip():
            return None
        where = f"line {line_number} of --input '{self.input_path}'"
        try:
            record = json.loads(line)
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
            raise InputError(f"{where} is not valid JSON: {error}") from None
        if not isinstance(record, dict):
            raise InputError(f"{where} is not a JSON object")
        ids_per_key = {}
        for key in self.json_keys:
            if key not in record:
                raise InputError(f"{where} has no key '{key}' (check --json-keys)")
            text = record[key]
            if not isinstance(text, str):
                kind = type(text).__name__
                raise InputError(f"{where}: value of '{key}' is {kind}, not a string")
            # Empty text is an empty document, even for a tokenizer that starts every text
            # with a bos token (HuggingFaceTokenizer of Llama).
            ids = self.tokenizer.tokenize(text) if text else []
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            ids_per_key[key] = ids
        return ids_per_key


# The encoder of a worker process, set by _init_worker.
_worker_encoder: _DocumentEncoder | None = None


def _init_worker(args: argparse.Namespace) -> None:
    """Pool initializer: build this worker's tokenizer once."""
    global _worker_encoder
    _worker_encoder = _DocumentEncoder(args)


def _encode_in_worker(numbered_line: tuple[int, bytes]) -> dict[str, list[int]] | None:
    """Pool task: encode one line with this worker's encoder."""
    return _worker_encoder.encode(numbered_line)


def _encoded_documents(
    args: argparse.Namespace, encoder: _DocumentEncoder, lines: Iterable[bytes]
) -> Iterator[dict[str, list[int]] | None]:
    """Yield encoder results for ``lines`` in input order, using --workers processes."""
    numbered_lines = enumerate(lines, start=1)
    if args.workers == 1:
        yield from map(encoder.encode, numbered_lines)
        return
    with multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,)) as pool:
        yield from pool.imap(_encode_in_worker, numbered_lines, chunksize=_WORKER_CHUNK_LINES)


def _remove_if_present(paths: Iterable[str]) -> None:
    """Delete each path that exists."""
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def preprocess(args: argparse.Namespace) -> dict[str, KeyStats]:
    """Tokenize ``args.input`` and write one indexed dataset per JSON key.

    Raises InputError for input problems; no output file is written or left behind then (the
    output directory may have been created).
    """
    if not os.path.isfile(args.input):
        raise InputError(f"--input '{args.input}' does not exist")
    if args.workers < 1:
        raise InputError(f"--workers must be at least 1, got {args.workers}")
    try:
        encoder = _DocumentEncoder(args)
    except ValueError as error:
        raise InputError(str(error)) from None
    token_dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)

    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(output_dir, exist_ok=True)
    final_prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    # Temporary names sit next to the targets so that os.replace is an atomic rename.
    temp_prefixes = {key: f"{prefix}.{os.getpid()}.tmp" for key, prefix in final_prefixes.items()}
    temp_paths = [
        path
        for prefix in temp_prefixes.values()
        for path in (get_bin_path(prefix), get_idx_path(prefix))
    ]
    stats = {
        key: KeyStats(output_prefix=final_prefixes[key], documents=0, tokens=0, empty_documents=0)
        for key in args.json_keys
    }
    builders = {}
    try:
        for key, prefix in temp_prefixes.items():
            builders[key] = IndexedDatasetBuilder(get_bin_path(prefix), dtype=token_dtype)
        with open(args.input, "rb") as input_file:
            for ids_per_key in _encoded_documents(args, encoder, input_file):
                if ids_per_key is None:
                    continue
                for key, ids in ids_per_key.items():
                    if not ids:
                        stats[key].empty_documents += 1
                        continue
                    builders[key].add_document(ids, [len(ids)])
                    stats[key].documents += 1
                    stats[key].tokens += len(ids)
        for key, key_stats in stats.items():
            if key_stats.documents == 0:
                raise InputError(
                    f"--input '{args.input}' has no non-empty '{key}' documents; nothing written"
                )
        for key, prefix in temp_prefixes.items():
            builders[key].finalize(get_idx_path(prefix))
        for key in args.json_keys:
            os.replace(get_bin_path(temp_prefixes[key]), get_bin_path(final_prefixes[key]))
            os.replace(get_idx_path(temp_prefixes[key]), get_idx_path(final_prefixes[key]))
    except BaseException:
        # IndexedDatasetBuilder has no close(); its file is open until finalize().
        for builder in builders.values():
            builder.data_file.close()
        _remove_if_present(temp_paths)
        raise
    return stats


def main(argv: list[str] | None = None) -> dict[str, KeyStats]:
    """Run the command line; return the per-key statistics.

    Input errors print ``preprocess_data.py: error: <message>`` to stderr and raise SystemExit(2),
    as argparse does for bad flags.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        stats = preprocess(args)
    except InputError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    for key, key_stats in stats.items():
        print(
            f"{key}: wrote {key_stats.documents} documents, {key_stats.tokens} tokens to "
            f"{key_stats.output_prefix}.bin/.idx; "
            f"skipped {key_stats.empty_documents} empty documents"
        )
    return stats


if __name__ == "__main__":
    main()
