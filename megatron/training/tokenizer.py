"""Offline tokenizers that megatron-core's GPTDataset accepts.

Five tokenizers cover the workflows of this fork without downloading anything:

* ``BytesTokenizer``: UTF-8 bytes 0..255 plus one end-of-document id (256).
* ``BPETokenizer``: a byte-level BPE model stored as a local HF ``tokenizers`` JSON file, which
  must contain the special token ``<|endoftext|>`` (used as end of document).
  ``train_bpe_tokenizer`` writes such a file.
* ``HuggingFaceTokenizer``: a Hugging Face tokenizer folder (Llama, Mistral, Qwen2 ...) read
  from local disk: its ``tokenizer.json`` through the ``tokenizers`` library, its eos token as
  end of document (no transformers, no remote code, no network).
* ``GPT2BPETokenizer``: Megatron-LM's GPT-2 tokenizer from a ``vocab.json`` and ``merges.txt``
  (``--vocab-file``, ``--merge-file``), byte-level BPE read with the ``tokenizers`` library;
  ``<|endoftext|>`` is the end of document.
* ``NullTokenizer``: for ``--mock-data`` and pre-tokenized text; its "text" is whitespace-separated
  integer ids.

Each tokenizer exposes ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]``,
``detokenize(ids) -> str`` and ``unique_identifiers`` (an OrderedDict that GPTDataset folds into the
hash naming its cached index files, so two different tokenizers never share a cache entry).

``build_tokenizer`` maps the command-line flags (--tokenizer-type, --tokenizer-model,
--vocab-size, --vocab-file, --merge-file) to a tokenizer, and ``model_vocab_size`` gives the vocabulary the model is built
with; their errors are one-line ``ValueError`` messages naming the flag.
"""

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

from megatron.training.arguments import TOKENIZER_TYPES
# Megatron's vocabulary padding rule lives beside the model shapes, which the estimator shares.
from memo_ext.estimate.models import padded_vocab_size  # noqa: F401 (re-exported)

EOD_TOKEN = "<|endoftext|>"
"""Text of the end-of-document token (the name GPT-2 uses)."""


class _OfflineTokenizer(MegatronLegacyTokenizer):
    """Common base: fills ``unique_identifiers`` the way megatron-core's tokenizers do.

    MegatronLegacyTokenizer.__init__ is deliberately not called: it only sets the same two
    attributes and logs a deprecation warning meant for Megatron-LM's own legacy tokenizers, which
    would be noise on every run here.
    """

    def __init__(self, tokenizer_paths: list[str], **options: Any) -> None:
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
        for name, value in options.items():
            self.unique_identifiers[name] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        """Return ``ids`` as a list of Python ints, or raise ValueError for one out of range."""
        id_list = [int(token_id) for token_id in ids]
        for token_id in id_list:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"token id {token_id} is outside the {type(self).__name__} vocabulary "
                    f"[0, {self.vocab_size})"
                )
        return id_list


class BytesTokenizer(_OfflineTokenizer):
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, id 256 is end of document.

    ``vocab`` keys are the bytes decoded as Latin-1 (one distinct character per byte) plus
    ``<|endoftext|>``. ``detokenize`` decodes invalid UTF-8 with U+FFFD replacement characters and
    renders the EOD id as ``<|endoftext|>``.
    """

    def __init__(self) -> None:
        super().__init__([])
        self._vocab = {bytes([byte]).decode("latin-1"): byte for byte in range(256)}
        self._vocab[EOD_TOKEN] = 256
        self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}

    @property
    def vocab(self) -> dict[str, int]:
        """Map from token text to id."""
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Map from id to token text."""
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        """Number of ids: 256 bytes plus EOD."""
        return 257

    @property
    def eod(self) -> int:
        """End-of-document id (256)."""
        return 256

    def tokenize(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Decode ids back to text; EOD ids become ``<|endoftext|>``."""
        pieces = []
        pending_bytes = bytearray()
        for token_id in self._check_ids(ids):
            if token_id == self.eod:
                pieces.append(pending_bytes.decode("utf-8", errors="replace"))
                pieces.append(EOD_TOKEN)
                pending_bytes.clear()
            else:
                pending_bytes.append(token_id)
        pieces.append(pending_bytes.decode("utf-8", errors="replace"))
        return "".join(pieces)


class _TokenizersFile(_OfflineTokenizer):
    """A HF ``tokenizers`` JSON file read from local disk (BPETokenizer, HuggingFaceTokenizer).

    ``vocab_size`` includes added special tokens. The file's SHA-256 is part of
    ``unique_identifiers`` so that a changed tokenizer at the same path does not reuse stale
    dataset caches.
    """

    def __init__(self, model_path: Path, flag_value: str, **options: Any) -> None:
        from tokenizers import Tokenizer

        if not model_path.is_file():
            raise ValueError(f"--tokenizer-model '{flag_value}' does not exist")
        try:
            self._tokenizer = Tokenizer.from_file(str(model_path))
        except Exception as error:  # tokenizers raises a plain Exception for unreadable files
            reason = " ".join(str(error).split())
            raise ValueError(
                f"--tokenizer-model '{flag_value}' is not a tokenizers JSON file ({reason})"
            ) from error
        file_digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
        super().__init__([str(model_path)], sha256=file_digest, **options)

    def _special_id(self, token: str, flag_value: str, fix: str) -> int:
        """The id of special token ``token``; a ValueError naming the flag and ``fix`` if the
        file lacks it."""
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"--tokenizer-model '{flag_value}' has no token '{token}'; {fix}")
        return token_id

    @property
    def vocab(self) -> dict[str, int]:
        """Map from token text to id, special tokens included."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Map from id to token text, special tokens included."""
        return {token_id: token for token, token_id in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        """End-of-document id."""
        return self._eod

    def detokenize(self, ids: Iterable[int]) -> str:
        """Decode ids back to text, special tokens (EOD) rendered as their text."""
        return self._tokenizer.decode(self._check_ids(ids), skip_special_tokens=False)


class BPETokenizer(_TokenizersFile):
    """A ``tokenizers`` JSON file (e.g. from ``train_bpe_tokenizer``) whose special token
    ``<|endoftext|>`` is the end of document; text is encoded without any special token."""

    def __init__(self, tokenizer_model: str) -> None:
        super().__init__(Path(tokenizer_model), tokenizer_model)
        self._eod = self._special_id(
            EOD_TOKEN, tokenizer_model,
            "train it with megatron.training.tokenizer.train_bpe_tokenizer or add that token")

    def tokenize(self, text: str) -> list[int]:
        """Encode ``text``; a literal ``<|endoftext|>`` in it becomes the EOD id."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids


# Files of a Hugging Face tokenizer folder that name its special tokens; transformers reads the
# eos token from the first, older folders carry it in the second only.
HF_SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _eos_token(folder: Path, flag_value: str) -> str:
    """The eos token's text, from the first of HF_SPECIAL_TOKEN_FILES in ``folder`` that names
    one (a string, or an AddedToken object with ``content``)."""
    for name in HF_SPECIAL_TOKEN_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
        except (ValueError, AttributeError) as error:  # not JSON, or not an object
            raise ValueError(f"--tokenizer-model '{flag_value}': {path} is not a JSON object "
                             f"({type(error).__name__}); re-download it") from None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    raise ValueError(
        f"--tokenizer-model '{flag_value}': no eos_token in {' or '.join(HF_SPECIAL_TOKEN_FILES)} "
        f"of {folder}; the end-of-document id is the eos token, so give the folder those files")


class HuggingFaceTokenizer(_TokenizersFile):
    """A Hugging Face tokenizer folder, or its ``tokenizer.json`` with the folder's
    tokenizer_config.json / special_tokens_map.json beside it (Megatron-LM's
    ``--tokenizer-type HuggingFaceTokenizer``, without transformers: only those JSON files are
    read, so no remote code runs and nothing is downloaded).

    ``eod`` is the eos token (Llama 3's ``<|end_of_text|>``, Qwen2's ``<|endoftext|>``).
    ``tokenize`` applies the tokenizer's own post-processor, as transformers and Megatron-LM do:
    a Llama document starts with its bos token; ``--append-eod`` then ends it with eos.
    """

    def __init__(self, tokenizer_model: str) -> None:
        path = Path(tokenizer_model)
        if path.is_dir():
            path = path / "tokenizer.json"
            if not path.is_file():
                raise ValueError(
                    f"--tokenizer-model '{tokenizer_model}' has no tokenizer.json; give a "
                    "Hugging Face tokenizer folder that has one (a sentencepiece "
                    "tokenizer.model alone is not read)")
        eos = _eos_token(path.parent, tokenizer_model)
        super().__init__(path, tokenizer_model, eos_token=eos)
        self._eod = self._special_id(eos, tokenizer_model, "it is the folder's eos_token: "
                                     "give a tokenizer.json and config files that match")

    def tokenize(self, text: str) -> list[int]:
        """Encode ``text`` with the tokenizer's special tokens (a Llama bos first)."""
        return self._tokenizer.encode(text).ids


class GPT2BPETokenizer(_TokenizersFile):
    """Megatron-LM's ``GPT2BPETokenizer``: GPT-2's byte-level BPE from a ``vocab.json`` and a
    ``merges.txt`` (the files GPT-2 and Megatron-LM's examples ship), its ``<|endoftext|>`` the
    end of document. Read with the tokenizers library's BPE and ByteLevel pre-tokenizer (GPT-2's
    split pattern, no prefix space), so ids match GPT-2's encoder; both files' SHA-256 name the
    dataset cache."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if path is None or not Path(path).is_file():
                raise ValueError(f"{flag} '{path}' does not exist (GPT2BPETokenizer needs "
                                 "--vocab-file and --merge-file)")
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:  # tokenizers raises a plain Exception for unreadable files
            reason = " ".join(str(error).split())
            raise ValueError(f"--vocab-file '{vocab_file}' / --merge-file '{merge_file}' are not "
                             f"a GPT-2 vocab.json and merges.txt ({reason})") from error
        self._tokenizer = Tokenizer(model)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        digests = [hashlib.sha256(Path(path).read_bytes()).hexdigest()
                   for path in (vocab_file, merge_file)]
        _OfflineTokenizer.__init__(self, [vocab_file, merge_file], sha256=digests)
        eod = self._tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(f"--vocab-file '{vocab_file}' has no token '{EOD_TOKEN}' (GPT-2's "
                             "end of document); give a GPT-2 vocab.json")
        self._eod = eod

    def tokenize(self, text: str) -> list[int]:
        """Encode ``text`` (GPT-2's encoder: no special tokens added)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids


class NullTokenizer(_OfflineTokenizer):
    """Identity tokenizer for --mock-data and pre-tokenized text.

    Text is whitespace-separated integer ids in [0, vocab_size). The EOD id is
    ``vocab_size - 1``, the last id of the given vocabulary (upstream Megatron-LM instead appends an
    extra id after the given size; here --vocab-size is the exact size of the embedding table).
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(
                f"--vocab-size must be at least 2 with --tokenizer-type NullTokenizer "
                f"(one id is EOD), got {vocab_size}"
            )
        super().__init__([], vocab_size=vocab_size)
        self._vocab_size = vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        """Map from the decimal text of each id to the id."""
        return {str(token_id): token_id for token_id in range(self._vocab_size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Map from each id to its decimal text."""
        return {token_id: str(token_id) for token_id in range(self._vocab_size)}

    @property
    def vocab_size(self) -> int:
        """The --vocab-size given, EOD included."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """End-of-document id: ``vocab_size - 1``."""
        return self._vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        """Parse whitespace-separated integer ids; raise ValueError for other words or bad ids."""
        try:
            ids = [int(word) for word in text.split()]
        except ValueError as error:
            raise ValueError(f"NullTokenizer text must be integer ids: {error}") from error
        return self._check_ids(ids)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Join ids with single spaces."""
        return " ".join(str(token_id) for token_id in self._check_ids(ids))


def build_tokenizer(
    tokenizer_type: str, tokenizer_model: str | None = None, vocab_size: int | None = None,
    vocab_file: str | None = None, merge_file: str | None = None,
) -> BytesTokenizer | BPETokenizer | HuggingFaceTokenizer | GPT2BPETokenizer | NullTokenizer:
    """Build the tokenizer named by --tokenizer-type.

    ``tokenizer_model`` (a tokenizer JSON path, or a Hugging Face tokenizer folder) is required
    by and only used for BPETokenizer and HuggingFaceTokenizer; ``vocab_size`` is required by
    and only used for NullTokenizer; ``vocab_file`` and ``merge_file`` by GPT2BPETokenizer.
    Raises ValueError with a one-line message naming the offending flag.
    """
    if tokenizer_type == "BytesTokenizer":
        return BytesTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("BPETokenizer", "HuggingFaceTokenizer"):
        if tokenizer_model is None:
            raise ValueError(
                f"--tokenizer-model is required with --tokenizer-type {tokenizer_type}")
        return (BPETokenizer if tokenizer_type == "BPETokenizer" else HuggingFaceTokenizer)(
            tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--vocab-size is required with --tokenizer-type NullTokenizer")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"--tokenizer-type '{tokenizer_type}' is not supported; "
        f"use one of {', '.join(TOKENIZER_TYPES)}"
    )


def model_vocab_size(tokenizer, tokenizer_type: str, vocab_size: int | None) -> int:
    """Rows of the model's vocabulary before padding: the tokenizer's ids; with
    HuggingFaceTokenizer, --vocab-size when given (a Hugging Face model may have more rows than
    its tokenizer has ids: Qwen2.5's config.json vocab_size 152064 for 151665 ids, and a
    converted checkpoint's model_flags.txt names that count). Fewer rows than ids is a
    ValueError naming the flag."""
    if tokenizer_type != "HuggingFaceTokenizer" or vocab_size is None:
        return tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"--vocab-size {vocab_size} is below the {tokenizer.vocab_size} ids of "
            f"--tokenizer-model; give the model's vocabulary (config.json's vocab_size) or drop "
            "--vocab-size")
    return vocab_size


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, output_path: str) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` and write it to ``output_path`` (JSON).

    ``vocab_size`` counts every id: the 256 byte symbols, ``<|endoftext|>`` and the learned merges,
    so it must be at least 257; a small corpus may yield fewer merges than asked for. The file is
    written to a temporary name and renamed, so ``output_path`` is either the old file or the
    complete new one. Returns the tokenizer loaded from the written file.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum_size = len(byte_alphabet) + 1
    if vocab_size < minimum_size:
        raise ValueError(
            f"--vocab-size must be at least {minimum_size} for a byte-level BPE tokenizer "
            f"(256 bytes + {EOD_TOKEN}), got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False keeps detokenize(tokenize(text)) == text exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        # Seeding all 256 byte symbols means any text can be encoded, even bytes unseen in training.
        initial_alphabet=byte_alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)

    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    # Same directory as the target so os.replace is an atomic rename; the pid keeps concurrent
    # writers apart.
    temp_path = f"{output_path}.{os.getpid()}.tmp"
    try:
        tokenizer.save(temp_path)
        os.replace(temp_path, output_path)
    except BaseException:
        if os.path.exists(temp_path):
            os.unlink(temp_path)
        raise
    return BPETokenizer(output_path)
