"""make gpu-check (megatron/training/gpu_check): the no-GPU line, the plan for 1-8 GPUs, the
figures read from a real (CPU) training's log, the report, and end to end under the CUDA test
double with the trainings run on CPU (slow). The GPU path itself is not verified here."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from megatron.training.gpu_check import check, measure, plan, predict, report
from megatron.training.gpu_check.measure import (
    Completed,
    Measurement,
    RunFailure,
    failure_reason,
    first_error_line,
    launch,
    read_records,
)
from megatron.training.gpu_check.plan import CUDA_ONLY_FLAGS, ModelSettings
from tests.conftest import REPO_ROOT, subprocess_env

#: A model the CPU trains in seconds; 512 tokens leave SPPO's solver two subsequences of 256.
TINY = ModelSettings(num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                     vocab_size=512, seq_length=512, microbatches_per_replica=2, train_iters=4,
                     steady_from=2)


def planned(gpus: int, model: ModelSettings = ModelSettings()) -> dict:
    return {run.mechanism.name: run for run in plan.plan(gpus, model)}


def test_without_a_gpu_one_line_and_status_2():
    env = {**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpu_check.py")],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == check.NO_GPU_STATUS == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [check.NO_GPU_LINE]


@pytest.mark.parametrize("gpus, data_parallel", [(1, 1), (2, 2), (4, 4), (8, 8), (16, 8)])
def test_plan_for_the_gpus_present(gpus, data_parallel):
    runs = planned(gpus)
    assert list(runs) == ["plain", "memo-offload-alpha-auto", "memo-offload-one-buffer",
                          "planned-arena", "sppo", "metp", "telemetry", "stitching-allocator"]
    for name in ("plain", "memo-offload-alpha-auto", "memo-offload-one-buffer",
                 "planned-arena", "telemetry", "stitching-allocator"):
        run = runs[name]
        assert (run.tp, run.pp, run.dp, run.skip_reason) == (1, 1, data_parallel, None)
        assert run.global_batch == 4 * data_parallel
    for name, tp, pp in (("sppo", 1, 2), ("metp", 2, 1)):
        run = runs[name]
        assert (run.tp, run.pp) == (tp, pp)
        if gpus == 1:
            assert run.skip_reason == "skipped: needs 2 GPUs (TP=%d PP=%d), 1 present" % (tp, pp)
        else:
            assert run.skip_reason is None and run.nproc == data_parallel


def test_planned_flags_are_valid_trainer_flags(tmp_path):
    """Each run's command line passes the trainer's validation for its world size (on CUDA as
    planned, on CPU without the CUDA-only flags), except what needs a GPU."""
    from megatron.training.arguments import ArgumentValidationError, parse_args

    for run in planned(8).values():
        argv = run.argv(tmp_path / "metrics.jsonl")
        assert all(flag in argv for flag in CUDA_ONLY_FLAGS)
        parse_args(argv, world_size=run.nproc, cuda_available=True)
        cpu_argv = run.argv(tmp_path / "metrics.jsonl", cuda=False)
        assert not set(CUDA_ONLY_FLAGS) & set(cpu_argv)
        if run.mechanism.name == "stitching-allocator":
            with pytest.raises(ArgumentValidationError, match="--memo-stitching-allocator"):
                parse_args(cpu_argv, world_size=run.nproc, cuda_available=False)
        else:
            parse_args(cpu_argv, world_size=run.nproc, cuda_available=False)


def test_run_flags_match_what_the_estimator_traces(tmp_path):
    """Measured and predicted describe one configuration: the flags the tracer gives the
    trainer for the layout appear in the run's command line with the same values."""
    from megatron.training.cli import trace as trace_tool

    for run in planned(4).values():
        if run.mechanism.estimator in (None, ("sppo", "solver")):
            continue
        shape = predict.model_shape(run)
        opts = trace_tool.build_parser().parse_args(
            ["--num-layers", str(shape["num_layers"]), "--hidden-size", str(shape["hidden_size"]),
             "--ffn-hidden-size", str(shape["ffn_hidden_size"]),
             "--num-attention-heads", str(shape["num_attention_heads"]),
             "--vocab-size", str(shape["vocab_size"]), "--seq-length",
             str(run.model.seq_length), "--tp", str(run.tp), "--pp", str(run.pp), "--dp",
             str(run.dp), "--bf16"])
        traced = trace_tool.trainer_argv(opts)
        ours = run.argv(tmp_path / "m.jsonl")
        for flag in ("--bf16", "--use-distributed-optimizer", "--sequence-parallel",
                     "--accumulate-allreduce-grads-in-fp32",
                     "--untie-embeddings-and-output-weights"):
            assert (flag in traced) == (flag in ours), flag
        for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                     "--seq-length", "--vocab-size", "--position-embedding-type",
                     "--attention-dropout", "--hidden-dropout", "--micro-batch-size"):
            value = traced[traced.index(flag) + 1]
            mine = ours[ours.index(flag) + 1]
            assert mine == value or float(mine) == float(value), flag


def test_figures_from_a_real_training_log(tmp_path):
    """A 4-iteration CPU run of MEMO alpha auto: the steady peak and median time come from its
    metrics, the alpha from its log line; a missing iteration, a bad loss or a missing memory
    field is a failure with its reason."""
    run = planned(1, TINY)["memo-offload-alpha-auto"]
    metrics, log = tmp_path / "metrics.jsonl", tmp_path / "train.log"
    completed = launch(1, run.argv(metrics, cuda=False), log, timeout_s=120)
    text = log.read_text()
    assert failure_reason(completed, text) is None, text[-2000:]
    records = read_records(metrics)
    steady = [r for r in records if r["iteration"] >= TINY.steady_from]
    figures = measure.measure(records, text, memory_key="mem_peak_rss_mib",
                              train_iters=TINY.train_iters, steady_from=TINY.steady_from)
    assert figures.peak_mib == max(r["mem_peak_rss_mib"] for r in steady)
    times = sorted(r["iteration_time_s"] for r in steady)
    assert len(times) == 3 and figures.iteration_s == times[1]  # iterations 2-4: the median
    assert 0.0 <= figures.memo_alpha <= 1.0
    assert f"alpha used by all ranks: {figures.memo_alpha:.4f}" in text
    kwargs = dict(memory_key="mem_peak_rss_mib", train_iters=TINY.train_iters, steady_from=2)
    with pytest.raises(RunFailure, match=r"3 of 4 iterations logged \(first missing: 3\)"):
        measure.measure([r for r in records if r["iteration"] != 3], text, **kwargs)
    with pytest.raises(RunFailure, match="lm loss nan at iteration 2"):
        measure.measure([{**r, "lm_loss": math.nan} if r["iteration"] == 2 else r
                         for r in records], text, **kwargs)
    with pytest.raises(RunFailure, match="no mem_peak_allocated_mib"):
        measure.measure(records, text, **{**kwargs, "memory_key": "mem_peak_allocated_mib"})


def test_failure_reasons():
    output = "\n".join([
        "> building GPT model ...",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "pretrain_gpt.py", line 9, in <module>',
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ])
    assert first_error_line(output) == ("torch.OutOfMemoryError: CUDA out of memory. Tried to "
                                        "allocate 2.00 GiB")
    assert first_error_line("error: --memo-plan auto: bad\nValueError: later") == \
        "error: --memo-plan auto: bad"
    assert failure_reason(Completed(1, 3.0, 75), output).startswith(
        "exit status 1: torch.OutOfMemoryError: CUDA out of memory")
    assert failure_reason(Completed(None, 75.0, 75), output) == \
        "timed out after 75 s (the run's share of the 10 minutes)"
    assert failure_reason(Completed(1, 3.0, 75), "nothing") == \
        "exit status 1: no error line in the log"


def test_budget():
    assert check.run_limit(deadline=1000.0, now=0.0, limit_s=75) == 75
    assert check.run_limit(deadline=1000.0, now=960.0, limit_s=75) == 40
    assert check.run_limit(deadline=1000.0, now=990.0, limit_s=75) is None


def test_hardware_profiles():
    assert predict.hardware_profile_name("NVIDIA H100 80GB HBM3", 85 * 10**9) == "h100"
    assert predict.hardware_profile_name("NVIDIA H200", 150 * 10**9) == "h200"
    assert predict.hardware_profile_name("NVIDIA A100-SXM4-40GB", 42 * 10**9) == "a100-40gb"
    assert predict.hardware_profile_name("NVIDIA A100-SXM4-80GB", 85 * 10**9) == "a100-80gb"
    assert predict.hardware_profile_name("NVIDIA GeForce RTX 4090", 24 * 10**9) is None


def test_report_rows_and_exit_status(tmp_path):
    header = report.Header("NVIDIA H100 80GB HBM3", 2, "2.13.0", "12.8", "abc1234",
                           "2025-01-01 00:00 UTC", TINY.describe(), "h100",
                           "mem_peak_allocated_mib")
    rows = [report.Row("gpu tests", report.PASS, notes=["pytest -m gpu tests/gpu: 5 passed"]),
            report.Row("plain", report.PASS, "TP=1 PP=1 DP=2 (2 GPUs)",
                       Measurement(300.0, 0.05),
                       predict.Predicted(250.0, 0.04, "caching allocator model")),
            report.Row("metp", report.SKIP, "TP=2 PP=1 DP=1 (2 GPUs)",
                       notes=["skipped: needs 2 GPUs (TP=2 PP=1), 1 present"])]
    text = report.render(header, rows)
    assert ("Measured on 2 x NVIDIA H100 80GB HBM3 (torch 2.13.0, CUDA 12.8), commit abc1234"
            in text)
    assert "not measurements" in text and "`mem_peak_allocated_mib` per rank" in text
    assert ("| plain | PASS | TP=1 PP=1 DP=2 (2 GPUs) | 300.0 | 250.0 | 1.20 | 0.0500 | 0.0400 "
            "| caching allocator model |") in text
    assert "| metp | SKIP | TP=2 PP=1 DP=1 (2 GPUs) | - | - | - | - | - | skipped" in text
    assert report.exit_status(rows) == 0
    assert report.exit_status(rows + [report.Row("sppo", report.FAIL)]) == 1
    out = tmp_path / "sub" / "report.md"
    report.write_atomic(out, text)
    assert out.read_text() == text
    assert [p.name for p in out.parent.iterdir()] == ["report.md"]  # no temporary left


class CpuRunner:
    """The test double's runner: the planned command minus its CUDA-only flags, on CPU ranks
    (so the peak is the CPU trainer's RSS figure)."""

    memory_key = "mem_peak_rss_mib"

    def __call__(self, run, metrics_path, log_path, timeout_s):
        return launch(run.nproc, run.argv(metrics_path, cuda=False), log_path, timeout_s)


@pytest.mark.slow
def test_end_to_end_under_the_cuda_double(tmp_path, monkeypatch, capsys):
    """Two doubled H100s: the GPU tests (all skipped in the subprocess, which sees no CUDA),
    then every mechanism trained on CPU and predicted by the estimator; the stitching allocator
    needs a real GPU and fails with the trainer's one-line error."""
    from tests.cuda_double import CudaDouble

    CudaDouble(device_count=2).install(monkeypatch)
    monkeypatch.setenv("MEMO_ESTIMATE_CACHE", str(tmp_path / "traces"))
    out = tmp_path / "report.md"
    status = check.main(["--out", str(out), "--run-dir", str(tmp_path / "runs")],
                        runner=CpuRunner(), model=TINY)
    text = out.read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
            for line in text.splitlines() if line.startswith("| ") and " | " in line}
    assert status == 1, text
    assert rows["gpu tests"][1] == "PASS"
    # The double has no CUDA kernels to compose: the row reports the refusal, not a crash.
    assert rows["tile compositions"][1] == "FAIL"
    for name in ("plain", "memo-offload-alpha-auto", "memo-offload-one-buffer",
                 "planned-arena", "sppo", "metp", "telemetry"):
        cells = rows[name]
        assert cells[1] == "PASS", text
        assert float(cells[3]) > 0 and float(cells[6]) > 0  # measured peak and time
        if name == "metp":
            assert cells[4] == "-" and "no prediction for this mechanism" in cells[8]
        else:
            assert float(cells[4]) > 0 and float(cells[7]) > 0, text  # predicted
    assert "alpha" in rows["memo-offload-alpha-auto"][8]
    # Traced at the run's length: MEMO predicts below plain (the line through the estimator's
    # 128K/256K traces carried the chunked loss's full 256 MiB logits down to 512 tokens).
    assert float(rows["memo-offload-alpha-auto"][4]) < float(rows["plain"][4]), text
    assert rows["sppo"][2] == "TP=1 PP=2 DP=1 (2 GPUs)"
    stitching = rows["stitching-allocator"]
    assert stitching[1] == "FAIL" and "exit status 1: error: --memo-stitching-allocator" in \
        stitching[8]
    assert "Measured on 2 x NVIDIA H100 80GB HBM3 (CPU test double)" in text
    assert "GPU profile `h100`" in text and "`mem_peak_rss_mib` per rank" in text
    assert capsys.readouterr().out.splitlines()[-1] == f"gpu-check: FAIL: report {out}"
