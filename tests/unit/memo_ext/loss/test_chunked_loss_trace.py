"""The chunked loss in allocation traces (tools/trace.py, fake tensors): at 7B's hidden size and
vocabulary, 1M tokens, TP4 CP2 bf16, the head and loss (bench.loss_memory.head_allocations:
allocations made in ``output_layer`` or GPTModel's own code) hold no [s/CP, V/TP] logits and at most
2 GiB; the trace keeps its structure across lengths (what the estimator's two-length fit needs);
the estimator's MEMO policy traces with it.

One layer instead of 32: the head and the loss see only the last layer's output, whose shape
does not depend on the layer count, and the trace takes seconds instead of a minute.
"""

from __future__ import annotations

import pytest

from megatron.training import tracing

from bench.loss_memory import head_allocations
from memo_ext.estimate.layout import Layout
from memo_ext.estimate.models import traced_model
from memo_ext.estimate.memory import LinearTrace
from memo_ext.hardware import load_hardware


@pytest.fixture(scope="module")
def tool():
    from megatron.memo_tools.cli import trace

    return trace


def record(tool, argv):
    """(trace, trainer args) of tools/trace.py ``argv``, in this process."""
    with tracing.traced_rank(tool.request_from_argv(argv)) as rank:
        return rank.record(), rank.args


CHUNKED = ["--trainer-args=--cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked"]
GiB = 1 << 30


def logits_bytes(args):
    """One [s/CP, b, V/TP] bf16 logits tensor of this rank: the smallest of the unfused copies."""
    return (args.seq_length // args.context_parallel_size * args.micro_batch_size
            * args.padded_vocab_size // args.tensor_model_parallel_size * 2)


def test_7b_one_million_tokens_head_and_loss_under_2_gib(tool):
    trace, args = record(tool, ["--model", "7b", "--num-layers", "1", "--seq-length", "1048576",
                                "--tensor-model-parallel-size", "4", "--context-parallel-size",
                                "2", "--bf16", "--use-distributed-optimizer", *CHUNKED])
    peak, largest = head_allocations(trace)
    # A [s/CP, V/TP] tensor of any dtype of 1 byte or more is at least half the bf16 logits.
    assert largest < logits_bytes(args) // 2, largest
    assert peak <= 2 * GiB, f"head and loss peak {peak / GiB:.2f} GiB"


@pytest.mark.slow
def test_tracer_sees_unfused_logits_and_a_length_independent_chunked_structure(tool):
    """The check above can fail (megatron's unfused loss allocates the [s/CP, V/TP] logits),
    and the chunked trace at 8 and 16 chunks has the same allocation sequence with the same
    chunk buffers, so the estimator's LinearTrace fits it. ~30 s: three traces."""
    small = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
             "--vocab-size", "4096", "--untie-embeddings-and-output-weights",
             "--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--bf16",
             "--use-distributed-optimizer"]
    unfused, args = record(tool, small + ["--seq-length", "4096"])
    assert head_allocations(unfused)[1] >= logits_bytes(args)
    chunked = small + ["--trainer-args=--cross-entropy-loss-fusion --cross-entropy-fusion-impl "
                       "chunked --cross-entropy-chunk-size 256"]
    first, _ = record(tool, chunked + ["--seq-length", "4096"])
    second, _ = record(tool, chunked + ["--seq-length", "8192"])
    LinearTrace.from_traces(first, second)  # raises if the structure differs
    (peak1, largest1), (peak2, largest2) = head_allocations(first), head_allocations(second)
    assert largest1 == largest2 < logits_bytes(args) // 2  # a chunk's buffers, not the sequence's
    # What grows: the [s/TP, b, h] input gradient (bf16) and ~24 bytes per token of targets,
    # log-sum-exps, losses and their gradients (2048 more tokens on this rank).
    assert peak2 - peak1 <= 2048 * (64 * 2 // 2 + 32)


def test_estimator_memo_policy_traces_the_chunked_loss(tool):
    a800 = load_hardware("a800")
    memo = Layout(4, 2, 1, 1, "memo", alpha=0.0).trace_request(traced_model("7b"), 131072, a800)
    trainer = tracing.trainer_argv(memo)
    assert trainer[-3:] == ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl",
                            "chunked"]
    megatron = Layout(4, 2, 1, 1, "megatron").trace_request(traced_model("7b"), 131072, a800)
    assert "--cross-entropy-loss-fusion" not in tracing.trainer_argv(megatron)
