"""tools/eval_long_context.py measures what it says (slow, one shared bench run of about 15
minutes on 2 cores): bench/passkey.py's tiny GPT, trained here on passkey prompts, finds every
held-out key at the trained length, and the same model after one step finds none. At TP = 2
with SP, CP = 2, PP = 2 and DP = 2 (torchrun, 2 ranks) the tool gives the one-process report of that
model: the same continuation for every passkey case, bucket losses within 1e-5 relative or
1e-6 absolute (fp32 rounding of near-zero losses, FP32_LOSS_ABS)."""

from __future__ import annotations

import sys

import pytest

from bench import passkey

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(3600)]

LAYOUTS = {
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cp2": ["--context-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": [],  # two replicas, each evaluating half of the samples
}
# A token's loss is logsumexp(logits) minus the target's logit: two fp32 values of the logits'
# size, so under TP (the vocabulary's logsumexp summed in two parts) it moves by ~1e-7 however
# small the loss. The trained model's first buckets have mean losses of ~4e-4, where 1e-5
# relative is 4e-9, below that rounding (measured: TP=2 differs by at most 1.8e-7, CP=2 by
# 7e-8; a wrong token or shard moves a loss by orders of magnitude more).
FP32_LOSS_ABS = 1e-6

# fewer cases than the bench's evaluation: two keys per length and depth, the trained length and
# twice it
FEWER_CASES = ("--passkey-lengths", f"{passkey.SEQ_LENGTH},{2 * passkey.SEQ_LENGTH}",
               "--passkey-samples", "2", "--eval-samples", "8")
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("passkey")
    return workdir, passkey.run(workdir)


def test_trained_model_finds_held_out_keys_and_the_initial_one_none(bench_run):
    _, results = bench_run
    trained = {row["length"]: row for row in results["trained"]["passkey"]["by_length"]}
    print({length: f"{row['correct']}/{row['total']}" for length, row in trained.items()})
    assert trained[passkey.SEQ_LENGTH]["accuracy"] == 1.0
    assert all(row["correct"] == 0 for row in results["initial"]["passkey"]["by_length"])


@pytest.fixture(scope="module")
def one_process_report(bench_run, tmp_path_factory):
    workdir, _ = bench_run
    return passkey.evaluate(workdir / "trained", workdir / "passkey_text_document",
                            tmp_path_factory.mktemp("tp1"), extra=FEWER_CASES)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_give_the_one_process_report(bench_run, one_process_report, layout, tmp_path):
    workdir, _ = bench_run
    report = passkey.evaluate(workdir / "trained", workdir / "passkey_text_document", tmp_path,
                              launcher=TORCHRUN, extra=(*FEWER_CASES, *LAYOUTS[layout]))
    assert report["layout"] != one_process_report["layout"]
    continuations = [case["continuation"] for case in report["passkey"]["cases"]]
    assert continuations == [case["continuation"]
                             for case in one_process_report["passkey"]["cases"]]
    assert sum(case["correct"] for case in report["passkey"]["cases"]) > 0
    for ours, theirs in zip(report["perplexity"]["buckets"],
                            one_process_report["perplexity"]["buckets"]):
        assert ours["tokens"] == theirs["tokens"]
        assert ours["mean_loss"] == pytest.approx(theirs["mean_loss"], rel=1e-5,
                                                  abs=FP32_LOSS_ABS)
