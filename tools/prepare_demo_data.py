"""Build the default dataset for `make demo` from text that ships with CPython (no downloads).

The corpus is the Python Language Reference as bundled in ``pydoc_data.topics.topics`` (79
topics, about 465 KB of English prose and code). Each topic is cut into documents of roughly
2-4 KB at paragraph boundaries, preferring section headings as cut points. The script then

1. writes ``corpus.jsonl`` (one {"topic", "text"} object per document),
2. trains a byte-level BPE tokenizer on it (``tokenizer.json``; BPETokenizer only),
3. runs tools/preprocess_data.py in-process (``demo_text_document.bin/.idx``, EOD appended),
4. writes ``manifest.json`` last: relative paths, file sizes, token counts, corpus SHA-256.

A later run whose manifest matches the current corpus, options and files does nothing but print
the flags to use, so it is cheap to call before every demo. The last line printed is the
flags for pretraining, e.g.

    --data-path data_cache/demo/demo_text_document --tokenizer-type BPETokenizer \\
        --tokenizer-model data_cache/demo/tokenizer.json

The corpus depends on the CPython version (its docs differ slightly), hence the hash.
"""

import argparse
import hashlib
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from pydoc_data.topics import topics as PYDOC_TOPICS

_TOOLS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(_TOOLS_DIR.parent))  # megatron.training
sys.path.insert(0, str(_TOOLS_DIR))  # preprocess_data, also when this file is imported

MANIFEST_VERSION = 1
"""Bump when the layout or the document splitting changes, so old outputs are rebuilt."""

MAX_DOCUMENT_CHARS = 4096
"""A document is closed before a paragraph that would take it past this size."""

MIN_DOCUMENT_CHARS_BEFORE_HEADING = 2048
"""A section heading starts a new document once the current one has at least this many chars."""

CORPUS_FILE = "corpus.jsonl"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
OUTPUT_PREFIX = "demo"
DATA_PATH = f"{OUTPUT_PREFIX}_text_document"
"""The --data-path prefix, relative to the output directory (preprocess_data's naming)."""

# Blank lines separate paragraphs; only whitespace on the blank line itself is consumed so that
# the indentation of code blocks survives.
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


@dataclass
class DemoData:
    """Where the demo dataset is and what it holds."""

    data_path: str
    """Value for --data-path (the .bin/.idx prefix)."""
    tokenizer_type: str
    tokenizer_model: str | None
    """Value for --tokenizer-model; None for BytesTokenizer."""
    vocab_size: int
    """Tokenizer vocabulary size, EOD included, before padding."""
    documents: int
    tokens: int
    """Tokens in the indexed dataset, EOD tokens included."""
    rebuilt: bool
    """False when existing outputs were reused."""

    def pretrain_flags(self) -> str:
        """The data and tokenizer flags for pretraining, as one shell-quoted command line."""
        flags = ["--data-path", self.data_path, "--tokenizer-type", self.tokenizer_type]
        if self.tokenizer_model is not None:
            flags += ["--tokenizer-model", self.tokenizer_model]
        return shlex.join(flags)


def _is_heading(paragraph: str) -> bool:
    """True for a reST-style title: one line of text underlined by a run of '*', '=' or '-'."""
    lines = paragraph.split("\n")
    return (
        len(lines) == 2
        and len(lines[1]) >= 3
        and lines[1][0] in "*=-"
        and len(set(lines[1])) == 1
    )


def split_topic(text: str) -> list[str]:
    """Split one topic's text into documents of about 2-4 KB at paragraph boundaries.

    A paragraph longer than MAX_DOCUMENT_CHARS becomes a document of its own; whitespace-only
    paragraphs are dropped, so no document is empty.
    """
    paragraphs = [part.strip("\n") for part in _PARAGRAPH_BREAK.split(text) if part.strip()]
    documents = []
    current: list[str] = []
    current_chars = 0
    for paragraph in paragraphs:
        paragraph_chars = len(paragraph) + 2  # the blank line that joins it
        too_long = current_chars + paragraph_chars > MAX_DOCUMENT_CHARS
        new_section = _is_heading(paragraph) and current_chars >= MIN_DOCUMENT_CHARS_BEFORE_HEADING
        if current and (too_long or new_section):
            documents.append("\n\n".join(current))
            current, current_chars = [], 0
        current.append(paragraph)
        current_chars += paragraph_chars
    if current:
        documents.append("\n\n".join(current))
    return documents


def build_corpus() -> list[dict[str, str]]:
    """Return the demo documents as {"topic", "text"} records, topics in sorted order."""
    return [
        {"topic": topic, "text": document}
        for topic in sorted(PYDOC_TOPICS)
        for document in split_topic(PYDOC_TOPICS[topic])
    ]


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and a rename."""
    temp_path = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        temp_path.write_bytes(data)
        os.replace(temp_path, path)
    except BaseException:
        temp_path.unlink(missing_ok=True)
        raise


def _load_complete_manifest(output_dir: Path, expected: dict) -> dict | None:
    """Return the manifest if it matches ``expected`` and every file it lists has its size."""
    try:
        manifest = json.loads((output_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if "file_sizes" not in manifest:
        return None
    if any(manifest.get(key) != value for key, value in expected.items()):
        return None
    for name, size in manifest["file_sizes"].items():
        file_path = output_dir / name
        if not file_path.is_file() or file_path.stat().st_size != size:
            return None
    return manifest


def _demo_data(output_dir: Path, manifest: dict, rebuilt: bool) -> DemoData:
    """Describe the outputs listed in ``manifest``, with paths under ``output_dir``."""
    tokenizer_model = manifest["tokenizer_model"]
    return DemoData(
        data_path=str(output_dir / manifest["data_path"]),
        tokenizer_type=manifest["tokenizer_type"],
        tokenizer_model=None if tokenizer_model is None else str(output_dir / tokenizer_model),
        vocab_size=manifest["vocab_size"],
        documents=manifest["documents"],
        tokens=manifest["tokens"],
        rebuilt=rebuilt,
    )


def _build_outputs(
    directory: Path,
    corpus: list[dict[str, str]],
    corpus_bytes: bytes,
    expected: dict,
    vocab_size: int,
) -> dict:
    """Write corpus, tokenizer, indexed dataset and (last) the manifest; return the manifest."""
    # Imported here, not at the top: importing megatron.core takes ~6 s, which the up-to-date
    # path does not need.
    import preprocess_data

    from megatron.training.tokenizer import BytesTokenizer, train_bpe_tokenizer

    tokenizer_type = expected["tokenizer_type"]
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomically(directory / CORPUS_FILE, corpus_bytes)
    preprocess_argv = [
        f"--input={directory / CORPUS_FILE}",
        "--json-keys=text",
        f"--output-prefix={directory / OUTPUT_PREFIX}",
        f"--tokenizer-type={tokenizer_type}",
        "--append-eod",
    ]
    tokenizer_model = None
    if tokenizer_type == "BPETokenizer":
        tokenizer = train_bpe_tokenizer(
            (record["text"] for record in corpus), vocab_size, str(directory / TOKENIZER_FILE)
        )
        tokenizer_model = TOKENIZER_FILE
        preprocess_argv.append(f"--tokenizer-model={directory / TOKENIZER_FILE}")
    else:
        tokenizer = BytesTokenizer()
    text_stats = preprocess_data.main(preprocess_argv)["text"]

    written_files = [CORPUS_FILE, f"{DATA_PATH}.bin", f"{DATA_PATH}.idx"]
    if tokenizer_model is not None:
        written_files.append(tokenizer_model)
    manifest = {
        **expected,
        "corpus": CORPUS_FILE,
        "tokenizer_model": tokenizer_model,
        "data_path": DATA_PATH,
        "vocab_size": tokenizer.vocab_size,
        "corpus_documents": len(corpus),
        "documents": text_stats.documents,
        "tokens": text_stats.tokens,
        "file_sizes": {name: (directory / name).stat().st_size for name in written_files},
    }
    # Written last: its presence with matching sizes is what marks the outputs as complete.
    _write_atomically(
        directory / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode("utf-8")
    )
    return manifest


def prepare_demo_data(output_dir: str, tokenizer_type: str, vocab_size: int) -> DemoData:
    """Build (or reuse) the demo dataset in ``output_dir``.

    ``vocab_size`` is the BPE vocabulary size to train (ignored for BytesTokenizer, which always
    has 257 ids). Outputs are reused when manifest.json matches the corpus hash, the options and
    the sizes of the files it lists.
    """
    if tokenizer_type not in ("BPETokenizer", "BytesTokenizer"):
        raise ValueError(
            f"--tokenizer-type '{tokenizer_type}' is not supported here; "
            "use BPETokenizer or BytesTokenizer"
        )
    directory = Path(output_dir)
    corpus = build_corpus()
    corpus_bytes = "".join(
        json.dumps(record, ensure_ascii=False) + "\n" for record in corpus
    ).encode("utf-8")
    expected = {
        "manifest_version": MANIFEST_VERSION,
        "corpus_sha256": hashlib.sha256(corpus_bytes).hexdigest(),
        "tokenizer_type": tokenizer_type,
        "requested_vocab_size": vocab_size if tokenizer_type == "BPETokenizer" else None,
    }
    manifest = _load_complete_manifest(directory, expected)
    if manifest is not None:
        return _demo_data(directory, manifest, rebuilt=False)

    manifest = _build_outputs(directory, corpus, corpus_bytes, expected, vocab_size)
    return _demo_data(directory, manifest, rebuilt=True)


def main(argv: list[str] | None = None) -> DemoData:
    """Run the command line; print a summary and, on the last line, the pretraining flags."""
    parser = argparse.ArgumentParser(
        prog="prepare_demo_data.py",
        description="Build the demo dataset from CPython's bundled Language Reference.",
    )
    parser.add_argument("--output-dir", default="data_cache/demo")
    parser.add_argument(
        "--tokenizer-type", default="BPETokenizer", choices=("BPETokenizer", "BytesTokenizer")
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help="BPE vocabulary size to train, EOD included (default: 4096; BPETokenizer only).",
    )
    args = parser.parse_args(argv)
    try:
        demo = prepare_demo_data(args.output_dir, args.tokenizer_type, args.vocab_size)
    except ValueError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    state = "built" if demo.rebuilt else "already up to date"
    print(
        f"demo data {state} in {args.output_dir}: {demo.documents} documents, "
        f"{demo.tokens} tokens, vocab size {demo.vocab_size}"
    )
    print(demo.pretrain_flags())
    return demo


if __name__ == "__main__":
    main()
