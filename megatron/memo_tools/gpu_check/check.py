"""The ``make gpu-check`` command (tools/gpu_check.py): probe the GPUs, run ``pytest -m gpu
tests/gpu``, train each mechanism of :mod:`.plan` for 10 iterations, predict each with the
estimator, write the markdown report. Exit status: 0 when no row failed, 1 otherwise, 2 when
no CUDA GPU is visible (one line, nothing else).

Budget: the whole check must end within 10 minutes on 1 to 8 GPUs, so the GPU tests get
:data:`GPU_TESTS_LIMIT_S`, each wave of trainings (up to four at once on disjoint GPU pairs,
:func:`.plan.waves`) :data:`RUN_LIMIT_S` (a small model starts in ~20 s and trains 10
iterations in seconds) and no wave starts after :data:`TOTAL_BUDGET_S`; a run cut short is a
FAIL row, not a hang. The predictions are made after the last wave. :mod:`.schedule` computes
the expected wall time from measured durations.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from megatron.memo_tools.gpu_check.measure import (
    IN_CHECKOUT,
    REPO_ROOT,
    Completed,
    RunFailure,
    TorchrunRunner,
    agreement,
    failure_reason,
    measure,
    read_records,
    run_logged,
)
from megatron.memo_tools.gpu_check.plan import MECHANISMS, ModelSettings, PlannedRun, plan, waves
from megatron.memo_tools.gpu_check.predict import NoPrediction, hardware_profile_name, predict
from megatron.memo_tools.gpu_check.report import (
    FAIL,
    PASS,
    SKIP,
    Header,
    Row,
    exit_status,
    render,
    write_atomic,
)

NO_GPU_LINE = ("gpu-check: no CUDA GPU visible (torch.cuda.is_available() is False); run it on "
               "a node with 1-8 NVIDIA GPUs")
NO_GPU_STATUS = 2
USAGE_STATUS = 2  # argparse's
#: Seconds (wall clock) of the whole check after which no step starts; the rest of the 10
#: minutes is the last step's own limit and the predictions' traces.
TOTAL_BUDGET_S = 480
GPU_TESTS_LIMIT_S = 240
RUN_LIMIT_S = 75
#: A run given less than this is not started (startup alone takes ~20 s).
MIN_RUN_S = 25


@dataclass
class Devices:
    """The visible GPUs: count, name and total memory (bytes) of GPU 0."""

    count: int
    name: str
    total_memory_bytes: int


def probe_devices() -> Optional[Devices]:
    """The visible CUDA GPUs, None when torch sees none."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return None
    return Devices(torch.cuda.device_count(), torch.cuda.get_device_name(0),
                   torch.cuda.get_device_properties(0).total_memory)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu_check.py", description="GPU tests and a 10-iteration training of each "
        "mechanism, measured against the estimator (docs/gpu_check.md).")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_report.md"),
                        help="the markdown report (default gpu_check_report.md)")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/gpu_check"),
                        help="each run's train.log and metrics.jsonl (default runs/gpu_check)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="use at most this many of the visible GPUs (default all, up to 8)")
    parser.add_argument("--mechanisms", default=",".join(m.name for m in MECHANISMS),
                        help="comma-separated subset (default all)")
    parser.add_argument("--skip-gpu-tests", action="store_true",
                        help="do not run pytest -m gpu tests/gpu first")
    return parser


def run_limit(deadline: float, now: float, limit_s: float) -> Optional[float]:
    """Seconds a step may take: ``limit_s`` or what is left before ``deadline`` (monotonic
    seconds), None when that is below :data:`MIN_RUN_S`."""
    left = min(limit_s, deadline - now)
    return left if left >= MIN_RUN_S else None


def gpu_tests_row(log_path: Path, timeout_s: float) -> Row:
    """``pytest -m gpu tests/gpu``: PASS/FAIL with pytest's summary line (SKIP outside a
    checkout: an installed package carries no tests)."""
    if not IN_CHECKOUT:
        return Row("gpu tests", SKIP, notes=["installed package: the gpu tests live in the "
                                             "source checkout (tests/gpu)"])
    completed = run_logged([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"],
                           log_path, timeout_s)
    lines = [line.strip(" =") for line in log_path.read_text().splitlines() if line.strip(" =")]
    summary = lines[-1] if lines else "no output"
    if completed.returncode is None:
        return Row("gpu tests", FAIL, notes=[f"timed out after {timeout_s:.0f} s; {log_path}"])
    verdict = PASS if completed.returncode == 0 else FAIL
    return Row("gpu tests", verdict, notes=[f"pytest -m gpu tests/gpu: {summary}"])


#: Tokens of the tile-composition check (a multiple of 64; 4096 takes seconds on one GPU).
COMPOSITION_SEQ = 4096


def composition_row() -> Row:
    """The one attention's tile compositions (zigzag ring, packed documents, head chunks) with
    this GPU's kernels, gradients against a dense fp32 reference
    (megatron.memo_tools.gpu_check.ring_composition): PASS when every case is within tolerance."""
    from megatron.memo_tools.gpu_check import ring_composition

    failed, notes = [], []
    try:
        results = ring_composition.run_all(COMPOSITION_SEQ)
    except Exception as error:  # a kernel that refuses a tile is a failed row, not a crash
        return Row("tile compositions", FAIL, "1 GPU",
                   notes=[f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"])
    for result in results:
        worst = max(result.errors.values())
        notes.append(f"{result.case.name}: {worst:.1e}")
        if not result.passed:
            failed.append(result.case.name)
    verdict = FAIL if failed else PASS
    summary = (f"largest relative gradient error per case (tolerance "
               f"{ring_composition.BF16_TOLERANCE:g}): " + "; ".join(notes))
    return Row("tile compositions", verdict, "1 GPU, ranks as threads", notes=[summary])


def start_training(run: PlannedRun, runner, run_dir: Path, timeout_s: float,
                   devices: tuple[int, ...]) -> Completed:
    """Launch ``run`` on ``devices`` (indices of the visible GPUs) with its log and metrics in
    ``run_dir`` (emptied first: the trainer appends to metrics.jsonl)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    return runner(run, run_dir / "metrics.jsonl", run_dir / "train.log", timeout_s,
                  devices=devices)


def run_waves(runs: list[PlannedRun], gpus: int, runner, run_dir: Path, deadline: float,
              clock: Callable[[], float] = time.monotonic) -> dict[str, Optional[Completed]]:
    """Every launch of :func:`.plan.waves`, the trainings of a wave at once on their own GPUs,
    each wave given :func:`run_limit` (``deadline`` on ``clock``): mechanism name ->
    Completed, None for a launch not started (the budget was spent)."""
    done: dict[str, Optional[Completed]] = {}
    all_waves = waves(runs, gpus)
    for number, wave in enumerate(all_waves, 1):
        timeout = run_limit(deadline, clock(), RUN_LIMIT_S)
        names = ", ".join(f"{run.mechanism.name} on {run.layout()}" for run, _ in wave)
        if timeout is None:
            print(f"gpu-check: wave {number}/{len(all_waves)} not started (budget spent): "
                  f"{names}", flush=True)
            done.update((run.mechanism.name, None) for run, _ in wave)
            continue
        print(f"gpu-check: wave {number}/{len(all_waves)}: {names}", flush=True)
        with ThreadPoolExecutor(max_workers=len(wave)) as pool:
            futures = {run.mechanism.name: pool.submit(
                start_training, run, runner, run_dir / run.mechanism.name, timeout, devices)
                for run, devices in wave}
        done.update((name, future.result()) for name, future in futures.items())
    return done


def training_row(run: PlannedRun, completed: dict[str, Optional[Completed]], run_dir: Path,
                 memory_key: str, predictor: Callable) -> Row:
    """The row of ``run`` from its launch (and its reference's) in ``completed``
    (:func:`run_waves`): measured, compared with the reference, predicted."""
    row = Row(run.mechanism.name, SKIP, run.layout())
    if run.skip_reason:
        row.notes.append(run.skip_reason)
        return row
    launched = completed.get(run.mechanism.name)
    if launched is None:
        row.verdict = FAIL
        row.notes.append("not run: the check's 10-minute budget was spent")
        return row
    reason = _figures(run, launched, run_dir / run.mechanism.name, memory_key, row)
    if reason is None and run.reference is not None:
        reason = _compare(run, completed.get(run.reference.mechanism.name), run_dir, row)
    row.verdict = FAIL if reason else PASS
    if reason:
        row.notes.append(reason)
    try:
        row.predicted = predictor(run, row.measured and row.measured.memo_alpha)
    except NoPrediction as missing:
        row.notes.append(str(missing))
    return row


def _figures(run: PlannedRun, launched: Completed, run_dir: Path, memory_key: str,
             row: Row) -> Optional[str]:
    """Measure a finished launch into ``row``; the failure reason, None when it is fine."""
    log = run_dir / "train.log"
    log_text = log.read_text(errors="replace")
    reason = failure_reason(launched, log_text)
    if reason is None:
        try:
            row.measured = measure(read_records(run_dir / "metrics.jsonl"), log_text,
                                   memory_key=memory_key, train_iters=run.model.train_iters,
                                   steady_from=run.model.steady_from)
        except RunFailure as failure:
            reason = str(failure)
    return f"{reason} ({log})" if reason else None


def _compare(run: PlannedRun, launched: Optional[Completed], run_dir: Path,
             row: Row) -> Optional[str]:
    """Compare ``run`` with its CP=1 reference, the comparison in ``row``'s notes; the failure
    reason, None when within tolerance."""
    reference = run.reference
    ref_dir = run_dir / reference.mechanism.name
    if launched is None:
        return "CP=1 reference not run: the check's 10-minute budget was spent"
    log = ref_dir / "train.log"
    failure = failure_reason(launched, log.read_text(errors="replace"))
    if failure:
        return f"CP=1 reference: {failure} ({log})"
    try:
        found = agreement(read_records(run_dir / run.mechanism.name / "metrics.jsonl"),
                          read_records(ref_dir / "metrics.jsonl"), run.model.train_iters)
    except RunFailure as missing:
        return f"CP=1 reference: {missing}"
    row.notes.append(found.describe())
    return None if found.passed else "losses or grad norms differ from CP=1 beyond bf16 noise"


def _commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _predictor(devices: Devices) -> tuple[Optional[str], Callable]:
    """(hardware profile name, run -> Predicted) for the GPUs found."""
    from memo_ext.hardware import load_hardware
    from memo_ext.estimate.layout import TraceCache, default_cache_dir

    profile = hardware_profile_name(devices.name, devices.total_memory_bytes)
    if profile is None:
        def none(run, alpha):
            raise NoPrediction(f"no prediction: no estimator profile for {devices.name} in "
                               "memo_ext/hardware.json")
        return None, none
    hardware, cache = load_hardware(profile), TraceCache(default_cache_dir())
    return profile, lambda run, alpha: predict(run, hardware, cache, alpha)


def main(argv: Optional[list[str]] = None, runner=None,
         model: ModelSettings = ModelSettings()) -> int:
    """The command; ``runner`` (default :class:`TorchrunRunner`) launches each training and
    names the metric its peak comes from, ``model`` is the trained model (tests shrink it)."""
    opts = build_parser().parse_args(argv)
    devices = probe_devices()
    if devices is None:
        print(NO_GPU_LINE, file=sys.stderr)
        return NO_GPU_STATUS
    names = [n.strip() for n in opts.mechanisms.split(",") if n.strip()]
    known = {m.name: m for m in MECHANISMS}
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"gpu_check.py: error: --mechanisms: unknown {', '.join(unknown)}; use "
              f"{', '.join(known)}", file=sys.stderr)
        return USAGE_STATUS
    gpus = devices.count if opts.gpus is None else opts.gpus
    if not 1 <= gpus <= devices.count:
        print(f"gpu_check.py: error: --gpus {opts.gpus}: {devices.count} GPUs are visible; give "
              f"1 to {devices.count}", file=sys.stderr)
        return USAGE_STATUS
    import torch

    deadline = time.monotonic() + TOTAL_BUDGET_S
    runner = runner or TorchrunRunner()
    profile, predictor = _predictor(devices)
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    if not opts.skip_gpu_tests:
        print("gpu-check: pytest -m gpu tests/gpu", flush=True)
        rows.append(gpu_tests_row(opts.run_dir / "gpu_tests.log", GPU_TESTS_LIMIT_S))
        print(f"gpu-check: gpu tests: {rows[-1].verdict}: {'; '.join(rows[-1].notes)}", flush=True)
    print("gpu-check: tile compositions against a dense reference", flush=True)
    rows.append(composition_row())
    print(f"gpu-check: tile compositions: {rows[-1].verdict}: {rows[-1].notes[0]}", flush=True)
    runs = plan(gpus, model, tuple(known[n] for n in names))
    completed = run_waves(runs, gpus, runner, opts.run_dir, deadline)
    for index, run in enumerate(runs, 1):
        rows.append(training_row(run, completed, opts.run_dir, runner.memory_key, predictor))
        print(f"gpu-check: [{index}/{len(runs)}] {run.mechanism.name}: {rows[-1].verdict}"
              + (f": {'; '.join(rows[-1].notes)}" if rows[-1].verdict != PASS else ""),
              flush=True)
    header = Header(device_name=devices.name, gpu_count=gpus, torch_version=torch.__version__,
                    cuda_version=torch.version.cuda or "n/a", commit=_commit(),
                    date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    model=model.describe(), hardware_profile=profile,
                    memory_metric=runner.memory_key)
    write_atomic(opts.out, render(header, rows))
    status = exit_status(rows)
    print(f"gpu-check: {'PASS' if status == 0 else 'FAIL'}: report {opts.out}", flush=True)
    return status
