"""Packed documents in training (--reset-attention-mask) against an explicit-mask reference.

The reference (tests/explicit_mask_gpt.py) trains the same model on the same data with
megatron.core's DotProductAttention under megatron.core's own [s, s] --reset-attention-mask
mask, in one process: nothing of memo_ext.attention's document offsets. The trainer's losses
equal it to 1e-5 relative in every iteration with TP=2 + SP, CP=2 (the zigzag ring), CP=2 with
MEMO (alpha 0.25, one layer in mode (b)) and METP at TP=2. At PP=3, where the middle stage
reads the offsets itself, the trainer with and without SPPO equals the reference run at PP=3
(PP changes each stage's init seed). The data are short documents, about four per sample,
and without the offsets the losses differ: each comparison can fail.
"""

from __future__ import annotations

import numpy
import pytest
import torch

from tests.conftest import PRETRAIN_GPT, REPO_ROOT, TINY_GPT_ARGS, training_losses

# Two to three processes per run, nine runs (about 40 s each on a busy 2-core machine): -m slow.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EXPLICIT_MASK = REPO_ROOT / "tests" / "explicit_mask_gpt.py"
ITERATIONS = 6
BYTES_EOD = 256  # BytesTokenizer's end of document
# 256: the padded vocabulary (and so the initial weights) is the same at TP=1 and TP=2.
MODEL = [flag for flag in TINY_GPT_ARGS if flag != "--mock-data"] + [
    "--seq-length", "128", "--micro-batch-size", "1", "--train-iters", str(ITERATIONS),
    "--deterministic-mode", "--position-embedding-type", "rope", "--group-query-attention",
    "--num-query-groups", "2", "--make-vocab-size-divisible-by", "256",
    "--tokenizer-type", "BytesTokenizer", "--split", "100,0,0"]
LAYOUTS = {
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cp2": ["--context-parallel-size", "2"],
    "cp2_memo": ["--context-parallel-size", "2", "--memo-offload", "--memo-alpha", "0.25",
                 "--memo-checkpoint-layers", "1"],
    "metp_tp2": ["--tensor-model-parallel-size", "2", "--memo-metp"],
}
PIPELINE = ["--num-layers", "6", "--pipeline-model-parallel-size", "3"]
SPPO = ["--memo-sppo", "--memo-sppo-subsequences", "4"]


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> list[str]:
    """The data flags: 400 documents of 1 to 60 random bytes and their EOD."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path_factory.mktemp("short_documents") / "documents"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    generator = torch.Generator().manual_seed(0)
    for _ in range(400):
        length = int(torch.randint(1, 61, (1,), generator=generator))
        document = torch.cat([torch.randint(0, 256, (length,), generator=generator),
                              torch.tensor([BYTES_EOD])])
        builder.add_document(document, [document.numel()])
    builder.finalize(f"{prefix}.idx")
    return ["--data-path", str(prefix)]


def _losses(data, tmp_path_factory, nproc: int = 1, flags=(),
            script=PRETRAIN_GPT) -> dict[int, float]:
    """iteration -> loss of ``script`` (the trainer, or the reference) with packed documents."""
    return training_losses(nproc, MODEL + data + ["--reset-attention-mask", *flags],
                           tmp_path_factory, script=script)


def _assert_equal(losses: dict[int, float], reference: dict[int, float]) -> None:
    assert sorted(losses) == sorted(reference) == list(range(1, ITERATIONS + 1))
    for iteration, loss in reference.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-5), (iteration, losses, reference)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_equal_the_explicit_mask_reference(layout, data, tmp_path_factory):
    _assert_equal(_losses(data, tmp_path_factory, 2, LAYOUTS[layout]),
                  _losses(data, tmp_path_factory, script=EXPLICIT_MASK))


@pytest.mark.parametrize("sppo", [[], SPPO], ids=["1f1b", "sppo"])
def test_every_pipeline_stage_keeps_the_documents(sppo, data, tmp_path_factory):
    _assert_equal(_losses(data, tmp_path_factory, 3, PIPELINE + sppo),
                  _losses(data, tmp_path_factory, 3, PIPELINE, script=EXPLICIT_MASK))


def test_without_the_offsets_the_losses_differ(data, tmp_path_factory):
    """The trainer without --reset-attention-mask: every iteration's loss is more than ten
    times the tolerance away from the reference's."""
    unpacked = training_losses(1, MODEL + data, tmp_path_factory)
    reference = _losses(data, tmp_path_factory, script=EXPLICIT_MASK)
    assert sorted(unpacked) == sorted(reference)
    for iteration, loss in reference.items():
        assert unpacked[iteration] != pytest.approx(loss, rel=1e-4), iteration
