"""The two measurements: perplexity by position bucket on the trainer's dataset, and passkey
retrieval by greedy decoding. Both split their samples over data-parallel replicas and sum the
results back on every rank of the last pipeline stage (perplexity) or on every rank (passkey).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.utils.data import default_collate

from megatron.training.data import SPLIT_NAMES, build_datasets
from megatron.memo_tools.long_context_eval.buckets import PositionLosses
from megatron.memo_tools.long_context_eval.model import EvalModel, device
from megatron.memo_tools.long_context_eval.passkey import (
    PasskeyCase,
    PasskeyPrompts,
    parse_answer,
    passkey_cases,
)


def _data_parallel_share(count: int) -> range:
    """The indices of ``count`` items this data-parallel replica evaluates."""
    return range(parallel_state.get_data_parallel_rank(), count,
                 parallel_state.get_data_parallel_world_size())


def micro_batches(samples: list[dict], size: int) -> list[dict]:
    """``samples`` collated ``size`` at a time; the last micro-batch is filled up with copies of
    the last sample whose loss mask is 0 (pipeline transfers need one micro-batch shape)."""
    filler = {**samples[-1], "loss_mask": torch.zeros_like(samples[-1]["loss_mask"])}
    padded = samples + [filler] * (-len(samples) % size)
    return [default_collate(padded[start:start + size]) for start in range(0, len(padded), size)]


def perplexity(args: argparse.Namespace, model: EvalModel, tokenizer,
               edges: list[int]) -> PositionLosses:
    """Loss per position bucket over the first --eval-samples samples of --eval-split (the
    trainer's GPTDataset at --seq-length); complete on the last pipeline stage."""
    split = SPLIT_NAMES.index(args.eval_split)
    counts = [0, 0, 0]
    counts[split] = args.eval_samples
    dataset = build_datasets(args, tokenizer, counts)[split]
    losses = PositionLosses(edges)
    samples = [dataset[index] for index in _data_parallel_share(args.eval_samples)]
    if samples:
        batches = micro_batches(samples, args.micro_batch_size)
        for batch, token_losses in zip(batches, model.token_losses(batches)):
            losses.add(token_losses, batch["loss_mask"])
    if model.last_stage:
        totals = losses.totals.to(device())
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        losses.totals = totals.cpu()
    return losses


@dataclass
class PasskeyOutcome:
    """One case and what the model continued it with."""

    case: PasskeyCase
    continuation: str
    answer: str | None

    @property
    def correct(self) -> bool:
        return self.answer == self.case.key

    def as_record(self) -> dict:
        return {"length": self.case.length, "depth": self.case.depth, "key": self.case.key,
                "continuation": self.continuation, "answer": self.answer,
                "correct": self.correct}


def generation_budget(prompts: PasskeyPrompts, cases: list[PasskeyCase]) -> int:
    """Tokens generated per case: the longest key's answer and one more, so that a longer
    number than the key shows."""
    return max(len(prompts.answer(case.key)) for case in cases) + 1


def _prompt_sample(tokens: torch.Tensor) -> dict:
    return {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(tokens.shape),
            "position_ids": torch.arange(tokens.shape[0])}


def _generate(model: EvalModel, tokens: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Greedy tokens written into ``tokens`` [n, L] from ``start`` to the end, one full
    forward per token (causal: what follows the position read never changes it)."""
    for position in range(start, tokens.shape[1]):
        batches = micro_batches([_prompt_sample(row) for row in tokens], size)
        tokens[:, position] = model.next_tokens(batches, position - 1).view(-1)[:len(tokens)].cpu()
    return tokens[:, start:]


def passkey(args: argparse.Namespace, model: EvalModel,
            tokenizer) -> tuple[list[PasskeyOutcome], int]:
    """Every case of --passkey-lengths x --passkey-depths x --passkey-samples (keys from
    --seed) and the number of tokens generated for each; complete on every rank."""
    prompts = PasskeyPrompts(tokenizer)
    cases = passkey_cases(args.passkey_lengths, args.passkey_depths, args.passkey_samples,
                          args.passkey_digits, args.seed)
    budget = generation_budget(prompts, cases)
    generated = torch.zeros(len(cases), budget, dtype=torch.long)
    mine = list(_data_parallel_share(len(cases)))
    for length in args.passkey_lengths:
        indices = [index for index in mine if cases[index].length == length]
        if not indices:
            continue
        tokens = torch.full((len(indices), length), tokenizer.eod, dtype=torch.long)
        for row, index in enumerate(indices):
            case = cases[index]
            tokens[row, :length - budget] = torch.tensor(
                prompts.prompt(length - budget, case.depth, case.key))
        generated[indices] = _generate(model, tokens, length - budget, args.micro_batch_size)
    generated = generated.to(device())
    dist.all_reduce(generated, group=parallel_state.get_data_parallel_group())
    outcomes = []
    for case, ids in zip(cases, generated.tolist()):
        text = tokenizer.detokenize(ids)
        outcomes.append(PasskeyOutcome(case, text, parse_answer(text)))
    return outcomes, budget
