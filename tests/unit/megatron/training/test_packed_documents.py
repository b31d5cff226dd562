"""Packed documents (--reset-attention-mask, megatron.training.packed_documents): the offsets
follow megatron's explicit-mask rule, each document of a packed sequence gets the logits it
gets alone (the trainer's GPT, world of one), and the flag's bad combinations are one line."""

from __future__ import annotations

import pytest
import torch

from megatron.training.arguments import (
    ArgumentValidationError,
    core_transformer_config_from_args,
    parse_args,
)
from megatron.training.packed_documents import (
    OFFSETS_KEY,
    DocumentOffsets,
    document_offsets,
    packed_seq_params,
)
from tests.conftest import TINY_GPT_ARGS

EOD = 7
ROPE = ["--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
        "--group-query-attention", "--num-query-groups", "2", "--micro-batch-size", "1"]


def _block_causal(offsets: list[int], length: int) -> torch.Tensor:
    """True where a query may see a key: causal, inside its document."""
    document = torch.zeros(length, dtype=torch.long)
    for index, (start, end) in enumerate(zip(offsets, offsets[1:])):
        document[start:end] = index
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return causal & (document[:, None] == document[None, :])


@pytest.mark.parametrize("eods", [[], [0], [5, 6, 20], [31], [3, 31]])
def test_offsets_give_megatrons_reset_attention_mask(eods):
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = torch.randint(8, 100, (32,))
    tokens[eods] = EOD
    offsets = document_offsets(tokens, EOD)
    assert offsets.dtype == torch.int32 and offsets[0] == 0 and offsets[-1] == 32
    assert bool((offsets[1:] > offsets[:-1]).all())
    masked, _, _ = _get_ltor_masks_and_position_ids(tokens, EOD, False, True, False, True)
    # megatron's mask is True where attention is *blocked*
    assert torch.equal(~masked[0], _block_causal(offsets.tolist(), 32))


def test_the_data_loader_adds_offsets_to_each_sample():
    samples = [{"tokens": torch.tensor([1, EOD, 2, 3]), "labels": torch.zeros(4)}]
    sample = DocumentOffsets(samples, EOD)[0]
    assert torch.equal(sample[OFFSETS_KEY], torch.tensor([0, 2, 4], dtype=torch.int32))
    assert len(DocumentOffsets(samples, EOD)) == 1 and "labels" in sample
    assert packed_seq_params({"tokens": None}) is None


def test_each_packed_document_gets_its_logits_alone(megatron_world):
    """The trainer's GPT (RoPE, GQA) on documents A|B|C packed into one sequence: each
    document's logits equal those of the model run on it alone (RoPE scores depend on
    distances only, so no position reset is needed)."""
    from megatron.training import gpt
    from megatron.training.tokenizer import padded_vocab_size

    args = parse_args(TINY_GPT_ARGS + ROPE, world_size=1, cuda_available=False)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                               1)
    torch.manual_seed(0)
    model = gpt.model_provider(core_transformer_config_from_args(args), args).eval()
    lengths = (20, 13, 31)
    documents = [torch.randint(8, args.vocab_size, (n,)) for n in lengths]
    for document in documents[:-1]:
        document[-1] = EOD
    tokens = torch.cat(documents)[None]
    positions = torch.arange(tokens.shape[1])[None]
    batch = {"tokens": tokens, OFFSETS_KEY: document_offsets(tokens[0], EOD)}
    with torch.no_grad():
        packed = model(tokens, positions, None, packed_seq_params=packed_seq_params(batch))
        unmasked = model(tokens, positions, None)
        start = 0
        for document in documents:
            # alone, at the model's length: causal, so the filler after it changes nothing
            filler = torch.randint(8, args.vocab_size, (tokens.shape[1] - document.numel(),))
            alone = model(torch.cat([document, filler])[None], positions,
                          None)[:, :document.numel()]
            got = packed[:, start:start + document.numel()]
            assert torch.allclose(got, alone, rtol=1e-5, atol=1e-5), \
                (got - alone).abs().max().item()
            start += document.numel()
    # the later documents' logits do change without the offsets: the check can fail
    assert not torch.allclose(unmasked[:, lengths[0]:], packed[:, lengths[0]:], atol=1e-3)


@pytest.mark.parametrize("extra, message", [
    (["--micro-batch-size", "2"], "--micro-batch-size 1"),
    (["--memo-sppo", "--memo-sppo-msp", "--pipeline-model-parallel-size", "2",
      "--micro-batch-size", "1"], "--memo-sppo-msp"),
])
def test_unsupported_combinations_are_one_line(extra, message):
    with pytest.raises(ArgumentValidationError, match="--reset-attention-mask") as error:
        parse_args(TINY_GPT_ARGS + ["--reset-attention-mask", *extra], world_size=2,
                   cuda_available=False)
    assert message in str(error.value) and "\n" not in str(error.value)
