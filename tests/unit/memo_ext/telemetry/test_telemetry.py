"""memo_ext.telemetry's trainer side, in one process: categories and context of the attributed
tracker, the gathered line (max/mean/skew/worst rank), fail-fast, and the OOM report with its
trace and snapshot. The multi-rank runs are tests/distributed/test_memory_telemetry.py."""

from __future__ import annotations

import argparse
import gc
import json
import re

import pytest
import torch

from memo_ext.config import MemoConfigError, TelemetryConfig
from memo_ext.telemetry import (
    AttributedTracker,
    GatheredMemory,
    MemoryBudgetExceeded,
    MemoryTelemetry,
    RankSample,
    SimulatedOutOfMemoryError,
    format_line,
)

MiB = 1 << 20
F32 = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _config(**overrides) -> TelemetryConfig:
    values = {"telemetry": True, "oom_report_dir": "unused"}
    values.update(overrides)
    return TelemetryConfig(**values)


def test_categories_follow_phases_and_the_peak_breakdown_adds_up():
    model = _model()
    tracker = AttributedTracker()
    params = list(model.parameters())
    tracker.register(params, "params")
    tracker.attach(model)
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    x = torch.randn(128, 64)
    tracker.begin_step()
    with tracker:
        tracker.start_forward()
        loss = model(x).square().sum()
        forward = tracker.category_bytes()
        loss.backward()
        with tracker.phase_scope("optimizer"):
            optimizer.step()
        with tracker.labelled("offload"):
            buffer = torch.empty(1000, dtype=torch.uint8)
    param_bytes = sum(p.numel() * F32 for p in params)
    assert forward["params"] == param_bytes
    # Saved: input of GELU, its output and the second Linear's output (128 x 256/64 floats).
    assert forward["activations"] >= 128 * 256 * F32 * 2
    now = tracker.category_bytes()
    assert now["optimizer"] == param_bytes  # SGD momentum buffers, created in the optimizer phase
    assert now["backward"] == param_bytes  # the .grad tensors, created by the autograd engine
    assert now["offload"] == 1000
    stats = tracker.stats()
    assert sum(tracker.peak_category_bytes().values()) == stats["peak_device_bytes"]
    assert sum(now.values()) == stats["current_device_bytes"]
    del loss, buffer
    gc.collect()
    assert tracker.category_bytes()["offload"] == 0


def test_oom_records_phase_and_microbatch_and_propagates_through_backward():
    model = _model()
    params = list(model.parameters())
    x = torch.randn(128, 64)
    static = sum(p.numel() * F32 for p in params)
    tracker = AttributedTracker(capacity_bytes=static + 128 * 256 * F32 * 3)
    tracker.register(params, "params")
    tracker.attach(model)
    tracker.begin_step()
    with pytest.raises(SimulatedOutOfMemoryError):
        with tracker:
            for _ in range(2):  # two micro-batches; gradients accumulate into .grad
                tracker.start_forward()
                model(x).square().sum().backward()
    record = tracker.last_oom
    assert record is not None and record.request_bytes > 0
    assert record.context.phase in ("forward", "backward")
    assert record.context.microbatch in (0, 1)
    assert record.in_use_bytes + record.request_bytes > tracker.capacity_bytes
    assert record.op and record.op.startswith("aten.")


def test_line_reports_max_mean_skew_and_worst_rank():
    samples = [RankSample(peak=100 * MiB, by_category={"activations": 60 * MiB}),
               RankSample(peak=140 * MiB, by_category={"activations": 90 * MiB,
                                                      "params": 50 * MiB}),
               RankSample(peak=120 * MiB)]
    gathered = GatheredMemory(20, samples)
    assert gathered.worst_rank == 1 and gathered.skew == pytest.approx(140 / 120)
    line = format_line(gathered, capacity_bytes=200 * MiB, estimated_peak_bytes=130 * MiB,
                       cuda=False)
    assert line.startswith("memory [step 20] peak max 140.0 MiB (rank 1) mean 120.0 MiB "
                           "skew 1.17 | ranks 100.0 140.0 120.0 | at rank 1's peak: "
                           "activations 90.0, params 50.0 MiB")
    assert "estimate 130.0 MiB (1.077 x)" in line and "capacity 200.0 MiB (70.0% used)" in line
    round_trip = RankSample.from_list(samples[1].as_list())
    assert round_trip.peak == 140 * MiB and round_trip.by_category["params"] == 50 * MiB


def _steps(telemetry: MemoryTelemetry, model, steps: int, batch: int = 128):
    for iteration in range(1, steps + 1):
        with telemetry.step(iteration):
            telemetry.tracker.start_forward()
            model(torch.randn(batch, 64)).square().sum().backward()
        yield iteration, telemetry.after_step(iteration)


def test_fail_fast_after_warmup_writes_the_report(tmp_path):
    model = _model()
    logged = []
    probe = MemoryTelemetry(_config(), log_interval=1, log=logged.append)
    probe.attach([model], list(model.parameters()), [])
    peak = max(g.max_peak for _, g in _steps(probe, model, 2))
    # A capacity 2% above the peak: within the 5% margin, but no OOM.
    config = _config(device_capacity_gb=peak * 1.02 / 1e9, telemetry_warmup_steps=2,
                     oom_report_dir=str(tmp_path))
    model = _model()
    telemetry = MemoryTelemetry(config, log_interval=10, log=logged.append)
    telemetry.attach([model], list(model.parameters()), [])
    done = []
    with pytest.raises(MemoryBudgetExceeded, match="fail-fast at step 2") as stop:
        for iteration, _ in _steps(telemetry, model, 10):
            done.append(iteration)
    assert done == [1] and not stop.value.peers_waiting
    report = json.loads((tmp_path / "failfast_iter2.json").read_text())
    assert report["kind"] == "fail-fast" and report["rank"] == 0
    assert report["peak_bytes"] >= 0.95 * report["capacity_bytes"]
    assert report["peak_by_category_bytes"]["params"] > 0
    assert any(line.startswith("> memory fail-fast at step 2") for line in logged)


def test_oom_in_a_step_writes_report_trace_and_snapshot(tmp_path, capsys):
    from memo_ext.alloc.snapshot import load_snapshot
    from memo_ext.planner.trace import read_trace, summarize

    model = _model()
    static = sum(p.numel() * F32 for p in model.parameters())
    config = _config(device_capacity_gb=(static + 128 * 256 * F32 * 3) / 1e9,
                     estimated_peak_gb=1e-3, oom_report_dir=str(tmp_path))
    telemetry = MemoryTelemetry(config, log_interval=1, log=lambda line: None)
    telemetry.attach([model], list(model.parameters()), [])
    with pytest.raises(MemoryBudgetExceeded, match="out of device memory on rank 0 at "
                                                   "iteration 1") as stop:
        list(_steps(telemetry, model, 3))
    assert stop.value.peers_waiting
    report = json.loads((tmp_path / "oom_rank0_iter1.json").read_text())
    assert report["kind"] == "oom" and report["rank"] == 0 and report["iteration"] == 1
    assert report["phase"] in ("forward", "backward") and report["microbatch"] == 0
    assert report["in_use_by_category_bytes"]["params"] == static
    assert report["estimated_peak_bytes"] == 10**6
    printed = capsys.readouterr().out
    assert re.search(r"> OOM on rank 0 at iteration 1, (forward|backward)", printed)
    assert "in use by category: " in printed and "estimate: 0.95 MiB predicted peak" in printed
    trace = read_trace(report["trace"])
    summary = summarize(trace)
    # The dump ends just before the failed request: what it holds is what was in use.
    assert summary.final_live_bytes == report["in_use_bytes"]
    assert summary.persistent_by_category["parameter"] == static
    snapshot = load_snapshot(report["snapshot"])
    assert snapshot["device_traces"][0]


@pytest.mark.parametrize("flags, flag", [
    (["--memo-device-capacity-gb", "1"], "--memo-device-capacity-gb"),
    (["--memo-telemetry", "--memo-device-capacity-gb", "0"], "--memo-device-capacity-gb"),
    (["--memo-telemetry", "--memo-telemetry-fail-fast-margin", "1"],
     "--memo-telemetry-fail-fast-margin"),
    (["--memo-telemetry", "--memo-telemetry-warmup-steps", "-1"],
     "--memo-telemetry-warmup-steps"),
    (["--memo-oom-report-dir", "x"], "--memo-oom-report-dir"),
])
def test_bad_telemetry_flags_name_the_flag(flags, flag):
    from memo_ext.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, TelemetryConfig, "telemetry")
    config = config_from_args(TelemetryConfig, parser.parse_args(flags))
    with pytest.raises(MemoConfigError, match=re.escape(flag)):
        config.validate()


def test_trainer_rejects_telemetry_flags_before_building_anything():
    from megatron.training.arguments import ArgumentValidationError, parse_args

    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters",
            "10", "--mock-data", "--vocab-size", "512"]
    with pytest.raises(ArgumentValidationError, match="--memo-device-capacity-gb 0.5 has no "
                                                      "effect without --memo-telemetry"):
        parse_args(base + ["--memo-device-capacity-gb", "0.5"], world_size=1,
                   cuda_available=False)
    args = parse_args(base + ["--memo-telemetry", "--memo-device-capacity-gb", "0.5"],
                      world_size=1, cuda_available=False)
    assert args.memo_telemetry and args.memo_device_capacity_gb == 0.5


@pytest.mark.gpu
def test_cuda_samples_come_from_the_caching_allocator(tmp_path):
    """Thin CUDA path (never run here): peak from torch.cuda.max_memory_allocated."""
    model = _model().cuda()
    telemetry = MemoryTelemetry(_config(oom_report_dir=str(tmp_path)), log_interval=1,
                                log=lambda line: None)
    telemetry.attach([model], list(model.parameters()), [])
    with telemetry.step(1):
        telemetry.tracker.start_forward()
        model(torch.randn(128, 64, device="cuda")).sum().backward()
    gathered = telemetry.after_step(1)
    assert gathered.max_peak == torch.cuda.max_memory_allocated()


def test_telemetry_modules_do_not_import_megatron_training():
    """memo_ext never imports the trainer (static check)."""
    import ast

    from tests.conftest import REPO_ROOT

    for path in sorted((REPO_ROOT / "memo_ext" / "telemetry").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.startswith("megatron.training") for n in names), (path, names)
