"""The SPPO solver (memo_ext/sppo/solver.py) and its CLI (tools/sppo_plan.py); CPU only, fast."""

from __future__ import annotations

import pytest

from memo_ext.estimate.cost import persistent_bytes
from memo_ext.estimate.flops import parameter_count
from memo_ext.estimate.memory import external_bytes
from memo_ext.estimate.models import model_shape
from memo_ext.estimate.rank_constants import (
    OPTIMIZER_BYTES_PER_PARAM,
    WEIGHT_AND_GRAD_BYTES_PER_PARAM,
)
from memo_ext.hardware import load_hardware
from memo_ext.trace import MiB, read_trace
from memo_ext.sppo.solver import GiB, Problem, evaluate, not_fit_message, solve

TINY = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
        "vocab_size": 1000}
A100 = load_hardware("a100-80gb")


def _cli():
    from megatron.memo_tools.cli import sppo_plan

    return sppo_plan


def test_memory_terms_match_a_hand_computation():
    seq, tp, pp = 4096, 2, 2
    one = evaluate(Problem(TINY, gpus=4, hardware=A100, seq=seq), tp, pp, 1)
    # Parameters: 4 layers x (attention 4*64*64 + MLP 2*64*256) + embedding 1000*64.
    params = 4 * (4 * 64 * 64 + 2 * 64 * 256) + 1000 * 64
    per_stage = 4 // pp
    # bf16 weights, fp32 gradients (6); fp32 main weights and Adam moments (12), not sharded
    assert one.memory.model_states == pytest.approx((6 + 12) * params / (pp * tp))
    kv = per_stage * 2 * seq * 64 * 2 / tp
    assert one.memory.kv_cache == pytest.approx(kv)
    assert one.memory.dkv_accumulators == pytest.approx(kv)  # all of K/V precedes the end
    assert one.memory.activations == pytest.approx(per_stage * 36 * seq * 64 / tp)
    assert one.memory.staging == 0 and one.alphas == [0.0]
    assert one.memory.logits == pytest.approx(seq * 1000 * 4 / tp)
    assert one.memory.workspaces == 2 * (8 * MiB + 128 * 1024)  # sm80: main and autograd
    assert one.memory.reserved == (512 + 2 * 128) * MiB  # context, NCCL of TP and PP

    two = evaluate(Problem(TINY, gpus=4, hardware=A100, seq=seq), tp, pp, 2)
    a = [per_stage * 36 * s * 64 / tp for s in two.lengths]
    alpha = two.alphas[0]
    assert 0 < alpha <= 1 and two.alphas[1] == 0
    # Unrolled peak: the larger of A_0 and A_1 + (1 - alpha_0) A_0, with the dK/dV of the
    # keys up to the end of that subsequence.
    kv_token = per_stage * 2 * 64 * 2 / tp
    expected = max(a[0] + kv_token * two.lengths[0], a[1] + (1 - alpha) * a[0] + kv_token * seq)
    assert two.memory.activations + two.memory.dkv_accumulators == pytest.approx(expected)
    assert two.memory.staging == pytest.approx(alpha * a[0])


def test_more_gpus_never_slower_and_longer_sequences_never_smaller():
    model = model_shape("7b")
    best = [solve(Problem(model, gpus=g, hardware=A100, seq=65536))[0][0].step_s
            for g in (8, 16, 32)]
    assert best[0] >= best[1] >= best[2]
    totals = [evaluate(Problem(model, gpus=8, hardware=A100, seq=s), 8, 1, 8).memory.total
              for s in (32768, 65536, 131072)]
    assert totals == sorted(totals) and totals[0] < totals[-1]


def test_every_returned_candidate_fits_device_memory():
    fitting, everything = solve(Problem(model_shape("7b"), gpus=8, hardware=A100, seq=262144))
    assert fitting and len(fitting) < len(everything)  # some layouts were refused
    assert all(c.memory.total <= c.capacity_bytes for c in fitting)
    assert [c.step_s for c in fitting] == sorted(c.step_s for c in fitting)


def test_not_fit_message_names_what_is_missing():
    problem = Problem(model_shape("65b"), gpus=8, hardware=A100, seq=4 << 20)
    fitting, smallest = solve(problem)
    assert not fitting
    message = not_fit_message(smallest[0], problem)
    assert message.startswith("does not fit: the smallest layout (TP8 PP1 DP1 N")
    assert f"needs {smallest[0].memory.total / GiB:.1f} GiB per GPU" in message
    assert "79.3 GiB available" in message and "host memory: " in message


def test_cli_plan_table_and_errors(capsys):
    cli = _cli()
    assert cli.main(["--model", "7b", "--gpus", "8", "--gpu", "a100-80gb", "--seq-length",
                     "64K", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "predicted (analytic model, not measured)" in out and "MFU" in out
    assert "best 3 of the fitting candidates" in out
    assert cli.main(["--model", "65b", "--gpus", "8", "--gpu", "a100-80gb",
                     "--seq-length", "4M"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert cli.main(["--model", "7b", "--gpus", "8", "--gpu", "a100-80gb",
                     "--seq-length", "4X"]) == 2
    assert "--seq-length 4X" in capsys.readouterr().err
    assert cli.main(["--model", "7b", "--gpus", "8", "--gpu", "tpu",
                     "--seq-length", "4M"]) == 2
    assert "--gpu tpu" in capsys.readouterr().err
    assert cli.parse_tokens("896K") == 917504 and cli.parse_tokens("4M") == 4 << 20


def test_msp_trades_bubble_for_weight_traffic_and_memory():
    model = model_shape("7b")
    plain = evaluate(Problem(model, gpus=32, hardware=A100, seq=1 << 20), 4, 8, 16)
    msp = evaluate(Problem(model, gpus=32, hardware=A100, seq=1 << 20, msp=True), 4, 8, 16)
    assert msp.time_terms["bubble"] < plain.time_terms["bubble"] / 2
    per_param = WEIGHT_AND_GRAD_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM
    stage_bf16 = plain.memory.model_states / per_param * 2  # a stage's bf16 weights over TP
    assert msp.memory.msp_weights == pytest.approx(stage_bf16)
    # 7 warm-up forward slots with helpers (p=8): each broadcasts, and its backward broadcasts
    # again and reduces the gradients, over InfiniBand (t*p = 32 GPUs > 8 per node).
    ib = A100["ib_gbps"] * 1e9 * 0.75
    assert msp.time_terms["MSP weight traffic"] == pytest.approx(
        2 * 7 * 3 * stage_bf16 / ib, rel=0.01)
    assert msp.step_s < plain.step_s
    single = evaluate(Problem(model, gpus=8, hardware=A100, seq=1 << 16, msp=True), 8, 1, 4)
    assert "MSP weight traffic" not in single.time_terms and single.memory.msp_weights == 0


def test_cli_plans_with_msp(capsys):
    assert _cli().main(["--model", "7b", "--gpus", "32", "--gpu", "a100-80gb", "--seq-length",
                        "896K", "--msp"]) == 0
    out = capsys.readouterr().out
    assert "SPPO plan with MSP, predicted" in out and "MSP weight traffic" in out


def test_sppo_rows_hold_what_a_trace_of_the_same_layout_records(tmp_path):
    """tools/estimate.py --recommend ranks SPPO's rows beside traced ones: the model states per
    parameter, the cuBLAS workspaces and the memory outside the allocator must be what a trace
    of the same layout (TP 2, DP 2, distributed optimizer) records, and what the traced
    candidates' filter (memo_ext.estimate.layout) assumes."""
    from megatron.memo_tools.cli import trace

    output = tmp_path / "trace.jsonl.gz"
    assert trace.main(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "256", "--vocab-size", "600",
                       "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size",
                       "2", "--gpus", "4", "--bf16", "--use-distributed-optimizer", "--gpu",
                       "a100-80gb", "--quiet", "-o", str(output)]) == 0
    traced = read_trace(output)
    persistent = persistent_bytes(traced)
    params = persistent["parameter"] / 2  # the rank's bf16 weights
    assert (persistent["parameter"] + persistent["gradient"]) / params == \
        WEIGHT_AND_GRAD_BYTES_PER_PARAM
    assert persistent["optimizer"] * 2 / params == pytest.approx(OPTIMIZER_BYTES_PER_PARAM,
                                                                  rel=1e-3)  # over DP 2

    model = traced.header["model"]
    sppo = evaluate(Problem(model, gpus=4, hardware=A100, seq=256, distributed_optimizer=True),
                    2, 1, 1).memory
    assert sppo.model_states / (parameter_count(model) / 2) == pytest.approx(
        sum(persistent.values()) / params, rel=1e-3)
    assert sppo.reserved == external_bytes(traced)
    assert sppo.workspaces == sum(
        e["bytes"] for e in traced.events
        if e["action"] == "alloc" and (e["module"] or "").startswith("cuBLAS workspace"))
