"""The pieces of tools/eval_long_context.py (megatron.memo_tools.long_context_eval): bucket
arithmetic, passkey prompts and answers, where a position lives under CP and SP, the flags a
checkpoint records, the command line's refusals, and both readouts of the trainer's model
against the same model run directly (one process). The whole tool against a model trained on
passkeys, and at other layouts: tests/distributed/test_eval_long_context.py (slow)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.training.arguments import ArgumentValidationError, parse_args
from megatron.memo_tools.long_context_eval.buckets import (
    PositionLosses,
    bucket_edges,
    default_bucket_size,
)
from megatron.memo_tools.long_context_eval.passkey import (
    HEADER,
    NEEDLE,
    QUESTION,
    PasskeyPrompts,
    parse_answer,
    passkey_cases,
)
from megatron.training.tokenizer import BytesTokenizer
from tests.conftest import TINY_GPT_ARGS

TRAINING_PLACEHOLDERS = ["--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "1",
                         "--lr", "1e-4", "--mock-data", "--vocab-size", "512"]


@pytest.mark.parametrize("seq_length, kind, size, edges", [
    (4096, "linear", 1024, [0, 1024, 2048, 3072, 4096]),
    (1000, "linear", 300, [0, 300, 600, 900, 1000]),
    (256, "log2", 4, [0, 4, 8, 16, 32, 64, 128, 256]),
    (100, "log2", 10, [0, 10, 20, 40, 80, 100]),
    (8, "log2", 8, [0, 8]),
])
def test_bucket_edges(seq_length, kind, size, edges):
    assert bucket_edges(seq_length, kind, size) == edges


def test_default_buckets_are_eight_linear_or_seven_log2():
    assert len(bucket_edges(4096, "linear", default_bucket_size(4096, "linear"))) == 9
    assert bucket_edges(4096, "log2", default_bucket_size(4096, "log2"))[:3] == [0, 64, 128]
    assert len(bucket_edges(4096, "log2", default_bucket_size(4096, "log2"))) == 8


def test_position_losses_are_masked_means_per_bucket():
    generator = torch.Generator().manual_seed(0)
    losses = torch.rand(3, 10, generator=generator) * 5
    mask = (torch.rand(3, 10, generator=generator) > 0.3).float()
    collected = PositionLosses([0, 3, 10])
    collected.add(losses[:2], mask[:2])
    collected.add(losses[2:], mask[2:])
    rows = collected.rows()
    for row, (start, end) in zip(rows, [(0, 3), (3, 10)]):
        picked = losses[:, start:end][mask[:, start:end] > 0]
        assert row.tokens == picked.numel()
        assert row.mean_loss == pytest.approx(picked.double().mean().item(), rel=1e-12)
        assert row.perplexity == pytest.approx(math.exp(row.mean_loss))
    assert collected.overall().mean_loss == pytest.approx(
        losses[mask > 0].double().mean().item(), rel=1e-12)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_prompt_has_its_length_and_the_needle_at_its_depth(depth):
    tokenizer = BytesTokenizer()
    prompts = PasskeyPrompts(tokenizer)
    prompt = prompts.prompt(1000, depth, "40712")
    assert len(prompt) == 1000
    needle = prompts.needle("40712")
    filler = 1000 - prompts.shortest("40712")
    at = len(prompts.header) + round(depth * filler)
    assert prompt[at:at + len(needle)] == needle
    text = tokenizer.detokenize(prompt)
    assert text.startswith(HEADER) and text.endswith(QUESTION)
    assert NEEDLE.format(key="40712") in text and text.count("40712") == 2
    assert tokenizer.detokenize(prompts.answer("40712")) == " 40712"
    with pytest.raises(ValueError, match="at least"):
        prompts.prompt(prompts.shortest("40712") - 1, depth, "40712")


def test_passkey_cases_are_reproducible_and_answers_parse():
    cases = passkey_cases([128, 256], [0.0, 1.0], 3, 5, seed=9)
    assert len(cases) == 12 and cases == passkey_cases([128, 256], [0.0, 1.0], 3, 5, seed=9)
    assert all(len(case.key) == 5 and case.key[0] != "0" for case in cases)
    assert cases != passkey_cases([128, 256], [0.0, 1.0], 3, 5, seed=10)
    assert parse_answer(" 12345. Remember") == "12345"
    assert parse_answer(" 123456") == "123456"
    assert parse_answer("\n\n the") is None


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_locate_and_unzigzag_invert_megatrons_context_parallel_split(monkeypatch, cp):
    from megatron.core import parallel_state, utils

    from megatron.memo_tools.long_context_eval.model import locate, unzigzag

    seq_length = 48
    sequence = torch.arange(seq_length).view(1, seq_length)
    parts = []
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
    for rank in range(cp):
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda r=rank: r)
        parts.append(utils.get_batch_on_this_cp_rank({"tokens": sequence.clone()})["tokens"])
    if cp > 1:
        assert torch.equal(unzigzag(parts), sequence)
    for sp in (1, 2, 3):
        for position in range(seq_length):
            cp_rank, tp_rank, row = locate(position, seq_length, cp, sp)
            assert parts[cp_rank][0].view(sp, -1)[tp_rank, row] == position


@pytest.mark.parametrize("flags", [
    [],
    ["--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
     "--norm-epsilon", "1e-6", "--group-query-attention", "--num-query-groups", "2",
     "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--add-qkv-bias",
     "--use-rope-scaling", "--rope-scaling-factor", "16", "--rotary-base", "500000",
     "--max-position-embeddings", "4096", "--kv-channels", "32", "--ffn-hidden-size", "96"],
    ["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "4",
     "--rotary-percent", "0.5"],
    ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.707",
     "--no-yarn-correction-range-round-to-int", "--yarn-original-max-position-embeddings", "32"],
], ids=["defaults", "llama_like", "linear", "yarn"])
def test_recorded_model_flags_rebuild_the_record(flags):
    from megatron.training.checkpointing import model_args_record, recorded_model_flags

    record = model_args_record(parse_args(TINY_GPT_ARGS + flags, world_size=1,
                                          cuda_available=False))
    rebuilt = parse_args(TRAINING_PLACEHOLDERS + recorded_model_flags(record), world_size=1,
                         cuda_available=False)
    assert model_args_record(rebuilt) == record


@pytest.mark.parametrize("argv, message", [
    (["--mock-data", "--vocab-size", "512", "--passkey-lengths", "128"], "--load DIR is required"),
    (["--load", "x", "--mock-data", "--vocab-size", "512", "--passkey-lengths", "128"],
     "needs a text tokenizer"),
    (["--load", "x", "--mock-data", "--tokenizer-type", "BytesTokenizer", "--passkey-lengths",
      "102", "--context-parallel-size", "2"], "not a multiple of 4"),
    (["--load", "x", "--mock-data", "--tokenizer-type", "BytesTokenizer", "--passkey-depths",
      "0.5,2", "--passkey-lengths", "128"], "--passkey-depths 2.0 is outside"),
    (["--load", "x", "--mock-data", "--vocab-size", "512", "--eval-samples", "0"],
     "nothing to evaluate"),
])
def test_command_line_refusals_name_the_flag(monkeypatch, argv, message):
    from megatron.memo_tools.long_context_eval.cli import eval_arguments

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgumentValidationError, match=message):
        eval_arguments(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                        "--seq-length", "128", "--output-dir", "out", *argv])


def test_readouts_equal_the_model_run_directly(megatron_world, tmp_path):
    """Per-token losses and greedy tokens of the checkpoint through EvalModel equal the saved
    model's own forward; the padding rows of the vocabulary are never chosen; the checkpoint's
    record gives back its model flags."""
    from megatron.training import checkpointing
    from megatron.training import gpt
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.memo_tools.long_context_eval.cli import eval_arguments
    from megatron.memo_tools.long_context_eval.model import EvalModel

    model_flags = ["--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
                   "--untie-embeddings-and-output-weights"]  # tied, seen tokens would win
    args = parse_args(TINY_GPT_ARGS + model_flags + ["--load", str(tmp_path)], world_size=1,
                      cuda_available=False)
    args.padded_vocab_size = args.vocab_size
    reference = gpt.model_provider(core_transformer_config_from_args(args), args)
    checkpointing.save_weights_checkpoint(args, reference, tmp_path)
    reference.eval()
    vocabulary = 100  # of the 512 rows: the other 412 must never be predicted
    model = EvalModel(args, gpt.model_provider, vocabulary)

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocabulary, (2, 64), generator=generator)
    labels = torch.randint(0, vocabulary, (2, 64), generator=generator)
    positions = torch.arange(64).expand(2, 64)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(2, 64),
             "position_ids": positions}
    with torch.no_grad():
        direct_losses = reference(tokens, positions, attention_mask=None, labels=labels)
        logits = reference(tokens, positions, attention_mask=None)
    [losses] = model.token_losses([batch])
    torch.testing.assert_close(losses, direct_losses, rtol=1e-6, atol=1e-6)
    read = [0, 17, 63]
    assert (logits[:, read].argmax(dim=-1) >= vocabulary).any()  # unmasked, padding would win
    for position in read:
        [ids] = model.next_tokens([batch], position)
        chosen = logits[:, position].gather(1, ids.view(-1, 1)).view(-1)
        assert (ids < vocabulary).all()
        torch.testing.assert_close(chosen, logits[:, position, :vocabulary].max(dim=1).values)

    recorded = eval_arguments(["--load", str(tmp_path), "--use-checkpoint-args", "--seq-length",
                               "64", "--mock-data", "--vocab-size", "512", "--output-dir", "out"])
    assert checkpointing.model_args_record(recorded) == {
        **checkpointing.model_args_record(args), "padded_vocab_size": None}
