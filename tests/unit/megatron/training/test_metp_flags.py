"""--memo-metp's flag combinations: refused with one line naming the flag and the fix; accepted
combinations imply --sequence-parallel."""

from __future__ import annotations

import pytest

from megatron.training.arguments import ArgumentValidationError, parse_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10",
        "--mock-data", "--vocab-size", "512", "--attention-dropout", "0", "--memo-metp"]
TP2 = ["--tensor-model-parallel-size", "2"]

REFUSED = [
    ("without_tp", 1, [], "--tensor-model-parallel-size"),
    ("with_sppo", 2, TP2 + ["--memo-sppo"], "--memo-sppo"),
    ("with_memo_offload", 2, TP2 + ["--memo-offload"], "--memo-offload"),
    ("with_context_parallel", 4, TP2 + ["--context-parallel-size", "2"],
     "--context-parallel-size"),
    ("with_attention_dropout", 2, TP2 + ["--attention-dropout", "0.1"], "--attention-dropout"),
    ("with_recompute", 2, TP2 + ["--recompute-granularity", "full", "--recompute-method",
                                 "uniform", "--recompute-num-layers", "1"],
     "--recompute-granularity"),
    ("seq_not_divisible", 2, TP2 + ["--seq-length", "66", "--max-position-embeddings", "66"],
     "--seq-length"),
]


@pytest.mark.parametrize("case,world_size,extra,flag", REFUSED, ids=[c[0] for c in REFUSED])
def test_metp_refusals_name_the_flag(case, world_size, extra, flag):
    with pytest.raises(ArgumentValidationError) as error:
        parse_args(BASE + extra, world_size=world_size, cuda_available=False)
    message = str(error.value)
    assert flag in message and "--memo-metp" in message and "\n" not in message, message


def test_metp_implies_sequence_parallel():
    args = parse_args(BASE + TP2, world_size=2, cuda_available=False)
    assert args.memo_metp and args.sequence_parallel
