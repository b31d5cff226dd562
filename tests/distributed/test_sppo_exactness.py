"""Must-show 1 of the SPPO issue: with --deterministic-mode on CPU, 20 iterations of
pretrain_gpt.py --memo-sppo give the losses of plain training on the full sequence (megatron's
1F1B with the same layout) to 1e-5 relative: PP=2 with N=4, PP=4 with N=8, and multiplexed
sequence partitioning (--memo-sppo-msp) with PP=2, N=4; slow: PP=2 with N=2 and N=8, TP=2+SP
with SwiGLU/GQA under PP=2, sequence-aware offloading, and MSP with PP=4, with TP=2+SP and with
offloading."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_GPT_ARGS, read_losses, run_trainer, training_losses

pytestmark = pytest.mark.distributed

COMMON = TINY_GPT_ARGS + ["--deterministic-mode", "--position-embedding-type", "rope",
                          "--num-layers", "8"]
LAYOUTS = {
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp4": (4, ["--pipeline-model-parallel-size", "4"]),
    "tp2_sp_pp2_swiglu_gqa": (4, ["--pipeline-model-parallel-size", "2",
                                  "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--swiglu", "--group-query-attention", "--num-query-groups",
                                  "2"]),
    # Subsequences of 64-128 KiB activations, so that offloading has something to move.
    "pp2_wide": (2, ["--pipeline-model-parallel-size", "2", "--hidden-size", "128",
                     "--seq-length", "256"]),
}


def baseline(layout: str, tmp_path_factory) -> dict[int, float]:
    # Run once per session: pp2's is also test_memo_exactness's pp2_4microbatches baseline.
    nproc, flags = LAYOUTS[layout]
    return training_losses(nproc, COMMON + flags, tmp_path_factory)


def check_sppo_matches(layout: str, sppo_flags: list[str], tmp_path, tmp_path_factory) -> str:
    nproc, flags = LAYOUTS[layout]
    metrics = tmp_path / "metrics.jsonl"
    result = run_trainer(nproc, COMMON + flags + ["--memo-sppo", *sppo_flags,
                                                   "--log-metrics-jsonl", str(metrics)])
    sppo_losses, reference = read_losses(metrics), baseline(layout, tmp_path_factory)
    assert sorted(sppo_losses) == sorted(reference) == list(range(1, 21))
    for iteration, loss in reference.items():
        assert sppo_losses[iteration] == pytest.approx(loss, rel=1e-5), iteration
    return result.stdout


# Only N=4 at PP=2 is in the default suite (the schedule and the uneven FLOPs partition); the
# other counts, PP=4 (about two minutes) and MSP with -m slow. MSP's default coverage is
# tests/unit/memo_ext/sppo/test_sppo_msp.py.
@pytest.mark.parametrize("layout, subsequences", [
    pytest.param("pp2", 2, marks=pytest.mark.slow), ("pp2", 4),
    pytest.param("pp2", 8, marks=pytest.mark.slow),
    pytest.param("pp4", 8, marks=pytest.mark.slow)])
def test_sppo_losses_equal_full_sequence_training(layout, subsequences, tmp_path,
                                                  tmp_path_factory):
    stdout = check_sppo_matches(layout, ["--memo-sppo-subsequences", str(subsequences)],
                                tmp_path, tmp_path_factory)
    assert f"> SPPO: {subsequences} subsequences (flops partition)" in stdout


@pytest.mark.slow
def test_sppo_with_tensor_and_sequence_parallel(tmp_path, tmp_path_factory):
    check_sppo_matches("tp2_sp_pp2_swiglu_gqa", ["--memo-sppo-subsequences", "4"], tmp_path,
                       tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["auto", "0.5"])
def test_sppo_offloading_keeps_losses(offload, tmp_path, tmp_path_factory):
    stdout = check_sppo_matches("pp2_wide", ["--memo-sppo-subsequences", "4",
                                             "--memo-sppo-offload", offload,
                                             "--memo-sppo-pcie-gbps", "10"],
                                tmp_path, tmp_path_factory)
    assert "> SPPO offload after iteration 2: offloaded" in stdout
    assert "offloaded 0.00 of" not in stdout.split("after iteration 2")[1].splitlines()[0]


@pytest.mark.parametrize("layout, subsequences", [
    pytest.param("pp2", 4, marks=pytest.mark.slow),
    pytest.param("pp4", 8, marks=pytest.mark.slow)])
def test_msp_losses_equal_full_sequence_training(layout, subsequences, tmp_path,
                                                 tmp_path_factory):
    stdout = check_sppo_matches(layout, ["--memo-sppo-subsequences", str(subsequences),
                                         "--memo-sppo-msp"], tmp_path, tmp_path_factory)
    assert "multiplexed tasks per stage pass: s0/0+" in stdout


@pytest.mark.slow
def test_msp_with_tensor_and_sequence_parallel(tmp_path, tmp_path_factory):
    check_sppo_matches("tp2_sp_pp2_swiglu_gqa", ["--memo-sppo-subsequences", "4",
                                                 "--memo-sppo-msp"], tmp_path, tmp_path_factory)


@pytest.mark.slow
def test_msp_with_offloading_keeps_losses(tmp_path, tmp_path_factory):
    stdout = check_sppo_matches("pp2_wide", ["--memo-sppo-subsequences", "4", "--memo-sppo-msp",
                                             "--memo-sppo-offload", "0.5",
                                             "--memo-sppo-pcie-gbps", "10"],
                                tmp_path, tmp_path_factory)
    assert "offloaded 0.00 of" not in stdout.split("after iteration 2")[1].splitlines()[0]
