"""Tests for megatron/training/tokenizer.py: round trips, EOD ids, flag-naming errors, padding."""

import json
from collections import OrderedDict

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from megatron.training.tokenizer import (
    EOD_TOKEN,
    BPETokenizer,
    BytesTokenizer,
    NullTokenizer,
    build_tokenizer,
    padded_vocab_size,
    train_bpe_tokenizer,
)

SAMPLE_TEXT = "Hello, wörld!  \n\tdef f(x):\n        return x * 2  # 日本語 ✓\n"
TRAINING_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def forward(self, hidden_states):\n    return self.linear(hidden_states)\n",
    "Tensor parallelism splits the embedding table across ranks.",
] * 20


@pytest.fixture
def bpe_path(tmp_path):
    """A small byte-level BPE tokenizer trained on TRAINING_TEXTS."""
    path = tmp_path / "tokenizer.json"
    train_bpe_tokenizer(TRAINING_TEXTS, vocab_size=320, output_path=str(path))
    return path


def test_bytes_tokenizer_round_trips_utf8_and_renders_eod():
    tokenizer = BytesTokenizer()
    ids = tokenizer.tokenize(SAMPLE_TEXT)
    assert ids == list(SAMPLE_TEXT.encode("utf-8"))
    assert tokenizer.vocab_size == 257 and tokenizer.eod == 256
    assert tokenizer.detokenize(ids) == SAMPLE_TEXT
    with_eod = ids + [tokenizer.eod] + ids
    assert tokenizer.detokenize(with_eod) == SAMPLE_TEXT + EOD_TOKEN + SAMPLE_TEXT
    assert len(tokenizer.vocab) == len(tokenizer.inv_vocab) == 257
    with pytest.raises(ValueError, match="257"):
        tokenizer.detokenize([257])


def test_bpe_tokenizer_round_trips_and_has_eod(bpe_path):
    tokenizer = build_tokenizer("BPETokenizer", str(bpe_path), None)
    assert isinstance(tokenizer, BPETokenizer)
    assert tokenizer.vocab[EOD_TOKEN] == tokenizer.eod
    assert tokenizer.vocab_size == 320
    for text in [SAMPLE_TEXT, *TRAINING_TEXTS[:3], ""]:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    # Merges were learned: common text takes fewer ids than bytes.
    assert len(tokenizer.tokenize(TRAINING_TEXTS[0])) < len(TRAINING_TEXTS[0].encode())
    ids = tokenizer.tokenize("end" + EOD_TOKEN)
    assert ids[-1] == tokenizer.eod
    assert tokenizer.detokenize(ids) == "end" + EOD_TOKEN


def test_train_bpe_tokenizer_writes_atomically_and_rejects_tiny_vocab(tmp_path, bpe_path):
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tokenizer.json"]
    json.loads(bpe_path.read_text())  # complete JSON, no temporary file left behind
    with pytest.raises(ValueError, match="--vocab-size"):
        train_bpe_tokenizer(TRAINING_TEXTS, vocab_size=100, output_path=str(tmp_path / "x.json"))
    assert not (tmp_path / "x.json").exists()


def test_null_tokenizer_parses_ids_and_uses_last_id_as_eod():
    tokenizer = build_tokenizer("NullTokenizer", None, 100)
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.vocab_size == 100 and tokenizer.eod == 99
    assert tokenizer.tokenize(" 1 2\n 99 ") == [1, 2, 99]
    assert tokenizer.detokenize([1, 2, 99]) == "1 2 99"
    with pytest.raises(ValueError, match="100"):
        tokenizer.tokenize("1 100")
    with pytest.raises(ValueError, match="integer"):
        tokenizer.tokenize("one two")
    with pytest.raises(ValueError, match="--vocab-size"):
        NullTokenizer(1)


def test_unique_identifiers_tell_tokenizers_apart(bpe_path):
    tokenizers = [
        BytesTokenizer(),
        BPETokenizer(str(bpe_path)),
        NullTokenizer(100),
        NullTokenizer(200),
    ]
    descriptions = set()
    for tokenizer in tokenizers:
        assert isinstance(tokenizer.unique_identifiers, OrderedDict)
        assert tokenizer.unique_identifiers["class"] == type(tokenizer).__name__
        descriptions.add(json.dumps(tokenizer.unique_identifiers))
    assert len(descriptions) == len(tokenizers)


def test_bpe_identifier_changes_when_the_file_is_retrained(tmp_path, bpe_path):
    before = BPETokenizer(str(bpe_path)).unique_identifiers
    train_bpe_tokenizer(TRAINING_TEXTS, vocab_size=300, output_path=str(bpe_path))
    assert BPETokenizer(str(bpe_path)).unique_identifiers != before


@pytest.mark.parametrize(
    "arguments, flag",
    [
        (("Foo", None, None), "--tokenizer-type"),
        (("BPETokenizer", None, None), "--tokenizer-model"),
        (("BPETokenizer", "missing.json", None), "--tokenizer-model"),
        (("NullTokenizer", None, None), "--vocab-size"),
    ],
)
def test_build_tokenizer_errors_name_the_flag(arguments, flag):
    with pytest.raises(ValueError) as error:
        build_tokenizer(*arguments)
    message = str(error.value)
    assert flag in message and "\n" not in message


def test_unsupported_type_lists_the_choices():
    with pytest.raises(ValueError, match="BytesTokenizer, BPETokenizer, NullTokenizer"):
        build_tokenizer("Foo", None, None)


def test_bpe_file_without_eod_or_not_json_is_rejected(tmp_path):
    no_eod_tokenizer = Tokenizer(models.BPE())
    no_eod_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    no_eod_tokenizer.train_from_iterator(
        TRAINING_TEXTS, trainers.BpeTrainer(vocab_size=300, show_progress=False)
    )
    no_eod_path = tmp_path / "no_eod.json"
    no_eod_tokenizer.save(str(no_eod_path))
    with pytest.raises(ValueError, match=f"--tokenizer-model .*{EOD_TOKEN}"):
        BPETokenizer(str(no_eod_path))

    not_json_path = tmp_path / "vocab.txt"
    not_json_path.write_text("hello\nworld\n")
    with pytest.raises(ValueError, match="--tokenizer-model .*not a tokenizers JSON file") as error:
        BPETokenizer(str(not_json_path))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "vocab_size, divisible_by, tensor_parallel, expected",
    [
        (257, 128, 1, 384),
        (257, 128, 2, 512),
        (256, 128, 2, 256),
        (4096, 128, 8, 4096),
        (50257, 128, 1, 50304),
        (5, 1, 1, 5),
    ],
)
def test_padded_vocab_size(vocab_size, divisible_by, tensor_parallel, expected):
    assert padded_vocab_size(vocab_size, divisible_by, tensor_parallel) == expected


def test_padded_vocab_size_rejects_non_positive_flags():
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        padded_vocab_size(257, 0, 1)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        padded_vocab_size(257, 128, 0)
