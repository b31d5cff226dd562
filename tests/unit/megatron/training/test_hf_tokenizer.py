"""--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (a Hugging Face tokenizer folder,
read with the tokenizers library): its ids are the library's encoding (and transformers'), its
EOD is the eos token; tools/preprocess_data.py writes those ids plus EOD; the trainer builds
its vocabulary from it, trains on the data it wrote, and refuses a bad folder in one line; a
converted checkpoint carries the folder and names it in model_flags.txt."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from megatron.training.arguments import ArgumentValidationError, parse_args
from megatron.training.tokenizer import HuggingFaceTokenizer, build_tokenizer, model_vocab_size
from tests.hf_models import BOS, EOS, TINY, TOKENIZER_TEXTS, save_tiny_model, save_tiny_tokenizer
from tests.unit.tools.test_preprocess_data import _read_documents, _write_jsonl, preprocess_data

DOCUMENTS = ["The quick brown fox.", "", "Long-context training, wörld ✓", "x"]


@pytest.fixture
def folder(tmp_path):
    return save_tiny_tokenizer(tmp_path / "tokenizer")


def _library_ids(folder, text: str) -> list[int]:
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids


def test_ids_are_the_tokenizers_encoding_and_eod_the_eos_token(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(folder))
    for model in (folder, folder / "tokenizer.json"):
        tokenizer = build_tokenizer("HuggingFaceTokenizer", str(model))
        assert isinstance(tokenizer, HuggingFaceTokenizer)
        assert tokenizer.eod == reference.eos_token_id == tokenizer.vocab[EOS]
        assert tokenizer.vocab_size == len(reference) == 300
        for text in (*DOCUMENTS, TOKENIZER_TEXTS[2]):
            ids = tokenizer.tokenize(text)
            assert ids == _library_ids(folder, text) == reference(text).input_ids
            assert ids[0] == tokenizer.vocab[BOS]  # the post-processor's bos, as transformers
            assert tokenizer.detokenize(ids) == BOS + text
        # merges were learned
        assert len(tokenizer.tokenize(TOKENIZER_TEXTS[0])) < len(TOKENIZER_TEXTS[0])


def test_eos_from_special_tokens_map_and_the_cache_key(folder):
    before = HuggingFaceTokenizer(str(folder)).unique_identifiers
    (folder / "tokenizer_config.json").unlink()
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": BOS, "lstrip": False, "special": True}}))
    tokenizer = HuggingFaceTokenizer(str(folder))
    assert tokenizer.eod == tokenizer.vocab[BOS]
    assert tokenizer.unique_identifiers != before  # another EOD, another dataset cache


BAD_FOLDERS = {
    "no_tokenizer_json": (lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer.json"),
    "no_eos": (lambda d: (d / "tokenizer_config.json").write_text("{}"),
               "no eos_token in tokenizer_config.json or special_tokens_map.json"),
    "eos_not_in_vocabulary": (lambda d: (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>"})), "has no token '</s>'"),
    "config_not_json": (lambda d: (d / "tokenizer_config.json").write_text("eos"),
                        "tokenizer_config.json is not a JSON object"),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_bad_folder_is_one_line_naming_the_flag(folder, case):
    damage, message = BAD_FOLDERS[case]
    damage(folder)
    with pytest.raises(ValueError, match=message) as error:
        build_tokenizer("HuggingFaceTokenizer", str(folder))
    assert str(error.value).startswith(f"--tokenizer-model '{folder}'")
    assert "\n" not in str(error.value)


def test_model_vocabulary_is_the_larger_vocab_size_never_a_smaller_one(folder):
    tokenizer = HuggingFaceTokenizer(str(folder))
    assert model_vocab_size(tokenizer, "HuggingFaceTokenizer", None) == 300
    assert model_vocab_size(tokenizer, "HuggingFaceTokenizer", 1000) == 1000
    with pytest.raises(ValueError, match="--vocab-size 200 is below the 300 ids"):
        model_vocab_size(tokenizer, "HuggingFaceTokenizer", 200)


def test_preprocess_writes_the_encoding_plus_eos(folder, tmp_path, capsys):
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": text} for text in DOCUMENTS])
    stats = preprocess_data.main([
        f"--input={source}", f"--output-prefix={tmp_path / 'out'}",
        "--tokenizer-type=HuggingFaceTokenizer", f"--tokenizer-model={folder}", "--append-eod",
        "--workers=2"])
    eos = HuggingFaceTokenizer(str(folder)).eod
    documents, _ = _read_documents(tmp_path / "out_text_document")
    assert documents == [_library_ids(folder, text) + [eos] for text in DOCUMENTS if text]
    assert stats["text"].empty_documents == 1  # "" is no document, though bos would make one


def _trainer_args(folder, *extra: str):
    return parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "32", "--micro-batch-size", "2",
                       "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
                       "--eval-iters", "0", "--tokenizer-type", "HuggingFaceTokenizer",
                       "--tokenizer-model", str(folder), *extra],
                      world_size=1, cuda_available=False)


def test_trainer_refuses_a_missing_folder_in_one_line(tmp_path):
    with pytest.raises(ArgumentValidationError, match="--tokenizer-model .*missing does not "
                       "exist; give a Hugging Face tokenizer folder"):
        _trainer_args(tmp_path / "missing", "--mock-data")
    with pytest.raises(ArgumentValidationError, match="--tokenizer-model DIR is required"):
        parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                    "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "3",
                    "--lr", "1e-3", "--mock-data", "--tokenizer-type", "HuggingFaceTokenizer"],
                   world_size=1, cuda_available=False)


def test_trainer_trains_on_the_preprocessed_data(folder, tmp_path, megatron_world):
    """The trainer's steps (pretrain's tokenizer, vocabulary and data, then train_step) on the
    dataset preprocess_data wrote with the folder; the model's vocabulary is --vocab-size."""
    from megatron.core.distributed import finalize_model_grads

    from megatron.training import gpt
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.data import build_data_iterator, build_datasets
    from megatron.training.tokenizer import padded_vocab_size
    from megatron.training.training import build_model, build_optimizer, train_step

    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TOKENIZER_TEXTS])
    preprocess_data.main([f"--input={source}", f"--output-prefix={tmp_path / 'corpus'}",
                          "--tokenizer-type=HuggingFaceTokenizer", f"--tokenizer-model={folder}",
                          "--append-eod"])
    args = _trainer_args(folder, "--data-path", str(tmp_path / "corpus_text_document"),
                         "--split", "100,0,0", "--vocab-size", str(TINY["vocab_size"]))
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    vocab_size = model_vocab_size(tokenizer, args.tokenizer_type, args.vocab_size)
    args.padded_vocab_size = padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, 1)
    assert args.padded_vocab_size == 1024  # the model's 1000 rows, not the tokenizer's 300 ids
    config = core_transformer_config_from_args(args)
    model = build_model(args, config, gpt.model_provider)
    optimizer, scheduler = build_optimizer(args, model)
    config.finalize_model_grads_func = finalize_model_grads
    dataset = build_datasets(args, tokenizer)[0]
    sample = dataset[0]["tokens"].tolist()
    assert tokenizer.eod in sample and max(sample) < 300
    iterator = build_data_iterator(dataset, 0, args)
    losses = [train_step(gpt.forward_step, iterator, model, optimizer, scheduler,
                         args)[0]["lm loss"] for _ in range(3)]
    assert all(torch.isfinite(torch.as_tensor(loss)) for loss in losses), losses


def test_conversion_carries_the_tokenizer_and_names_it(folder, tmp_path, megatron_world):
    from megatron.memo_tools.hf_checkpoint.convert import import_hf

    hf = save_tiny_model(tmp_path / "hf", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).write_bytes((folder / name).read_bytes())
    flags = import_hf(hf, tmp_path / "checkpoint", log=lambda _: None)
    checkpoint = tmp_path / "checkpoint"
    assert flags[-4:] == ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                          str(checkpoint.absolute())]
    assert (checkpoint / "model_flags.txt").read_text().split() == flags
    assert (checkpoint / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    tokenizer = build_tokenizer("HuggingFaceTokenizer", str(checkpoint))
    assert tokenizer.tokenize(DOCUMENTS[0]) == _library_ids(folder, DOCUMENTS[0])


def test_conversion_without_a_usable_tokenizer_names_none(folder, tmp_path, megatron_world):
    from megatron.memo_tools.hf_checkpoint.convert import import_hf

    hf = save_tiny_model(tmp_path / "hf", "llama", vocab_size=200)  # fewer rows than ids
    (hf / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (hf / "tokenizer_config.json").write_bytes((folder / "tokenizer_config.json").read_bytes())
    said = []
    flags = import_hf(hf, tmp_path / "checkpoint", log=said.append)
    assert "--tokenizer-type" not in flags
    assert said[0] == ("> model_flags.txt names no tokenizer: --vocab-size 200 is below the 300 "
                       "ids of --tokenizer-model; give the model's vocabulary (config.json's "
                       "vocab_size) or drop --vocab-size")
