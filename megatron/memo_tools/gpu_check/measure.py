"""Launching one training of the check and reading what it measured.

The figures come from the trainer's --log-metrics-jsonl records (the same numbers as its
per-iteration log line, megatron/training/training.py TrainingLogger): ``iteration_time_s`` and,
on CUDA, ``mem_peak_allocated_mib`` (the caching allocator's peak since the previous line, max
over ranks). With --log-interval 1 each record is one iteration. The console output (log file)
gives MEMO's solved alpha and, for a failed run, the first error line.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron.memo_tools.gpu_check.plan import PlannedRun

REPO_ROOT = Path(__file__).resolve().parents[3]
#: A source checkout (tests/gpu and pretrain_gpt.py beside the packages), not an installed wheel.
IN_CHECKOUT = (REPO_ROOT / "pretrain_gpt.py").is_file() and (REPO_ROOT / "tests" / "gpu").is_dir()
#: Seconds a timed-out run gets between SIGTERM and SIGKILL (torchrun forwards the former).
KILL_GRACE_S = 10
#: Rendezvous variables of an enclosing launch, which would point torchrun at a port not its own.
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE")
# "> MEMO alpha: ...; alpha used by all ranks: 0.2500" (memo_ext/offload/__init__.py).
_ALPHA_LINE = re.compile(r"alpha used by all ranks: ([0-9.]+)")
# The trainer's one-line errors ("error: ...", arguments.run_main) and exception lines; torchrun's
# own ChildFailedError summary names no cause.
_ERROR_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?(error: .+|[A-Za-z_][\w.]*(?:Error|Exception)\b.*)$")


class RunFailure(Exception):
    """A run whose log cannot give the check's figures; the message is the one-line reason."""


@dataclass
class Completed:
    """A finished launch: ``returncode`` None when it was killed at its time limit (seconds)."""

    returncode: Optional[int]
    wall_s: float
    timeout_s: float


@dataclass
class Measurement:
    """Steady-state figures of one run: peak memory in MiB (max over ranks and the steady
    iterations), median iteration time in seconds, MEMO's solved alpha when it logged one."""

    peak_mib: float
    iteration_s: float
    memo_alpha: Optional[float] = None


def visible_devices() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices 0-7 when it
    is unset): a launch on visible GPUs (1, 2) gets the second and third of these."""
    names = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
             if d.strip()]
    return names if "CUDA_VISIBLE_DEVICES" in os.environ else [str(i) for i in range(8)]


def launch_env(devices: Optional[tuple[int, ...]] = None) -> dict:
    """This environment without rendezvous variables, with the checkout importable (an
    installed package already is); ``devices``: the visible GPUs (indices) the launch gets,
    by CUDA_VISIBLE_DEVICES (None: all of this process's)."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    if devices is not None:
        names = visible_devices()
        env["CUDA_VISIBLE_DEVICES"] = ",".join(names[i] for i in devices)
    if IN_CHECKOUT:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                          env.get("PYTHONPATH")]))
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron's advice for TP/SP overlap
    return env


def run_logged(command: list[str], log_path: Path, timeout_s: float,
               devices: Optional[tuple[int, ...]] = None) -> Completed:
    """Run ``command`` (in the checkout, if this is one) on ``devices`` (:func:`launch_env`)
    with its output in ``log_path``; killed (its whole process group) after ``timeout_s``
    seconds."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT if IN_CHECKOUT else None,
                                   env=launch_env(devices), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(process)
            returncode = None
    return Completed(returncode, time.perf_counter() - start, timeout_s)


def launch(nproc: int, argv: list[str], log_path: Path, timeout_s: float,
           devices: Optional[tuple[int, ...]] = None) -> Completed:
    """``torchrun --standalone --nproc-per-node nproc -m pretrain_gpt argv`` (see
    :func:`run_logged`); the module is the checkout's or the installed one. ``--standalone``
    gives each launch its own free rendezvous port, so launches on disjoint GPUs run at once."""
    return run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={nproc}", "-m", "pretrain_gpt", *argv],
                      log_path, timeout_s, devices)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the launch's own process group (torchrun and its ranks), SIGKILL if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


class TorchrunRunner:
    """Runs a planned training on the GPUs; ``memory_key`` is the metric its peak comes from."""

    memory_key = "mem_peak_allocated_mib"

    def __call__(self, run: PlannedRun, metrics_path: Path, log_path: Path,
                 timeout_s: float, devices: Optional[tuple[int, ...]] = None) -> Completed:
        return launch(run.nproc, run.argv(metrics_path, cuda=True), log_path, timeout_s,
                      devices)


def read_records(metrics_path: Path) -> list[dict]:
    """The JSON-lines records of a run ([] when the file was never written)."""
    if not metrics_path.is_file():
        return []
    return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]


def first_error_line(log_text: str) -> Optional[str]:
    """The first error line of a failed run's output (stripped), None when there is none."""
    for line in log_text.splitlines():
        match = _ERROR_LINE.match(line.strip())
        if match and "ChildFailedError" not in line:
            return match.group(1)
    return None


def solved_alpha(log_text: str) -> Optional[float]:
    """The alpha MEMO's LP chose (its log line), None when the run logged none."""
    match = _ALPHA_LINE.search(log_text)
    return float(match.group(1)) if match else None


def failure_reason(completed: Completed, log_text: str) -> Optional[str]:
    """Why a launch failed (one line), None when it exited 0."""
    if completed.returncode == 0:
        return None
    if completed.returncode is None:
        return f"timed out after {completed.timeout_s:.0f} s (the run's share of the 10 minutes)"
    error = first_error_line(log_text) or "no error line in the log"
    return f"exit status {completed.returncode}: {error}"


def measure(records: list[dict], log_text: str, *, memory_key: str, train_iters: int,
            steady_from: int) -> Measurement:
    """Steady-state figures of iterations ``steady_from``..``train_iters``.

    Raises RunFailure when an iteration is missing, a loss is not finite, or a record lacks
    ``memory_key`` (e.g. a CUDA run whose allocator reports no statistics).
    """
    training = {r["iteration"]: r for r in records if "iteration_time_s" in r}
    missing = [i for i in range(1, train_iters + 1) if i not in training]
    if missing:
        raise RunFailure(f"{train_iters - len(missing)} of {train_iters} iterations logged "
                         f"(first missing: {missing[0]})")
    for iteration, record in sorted(training.items()):
        loss = record.get("lm_loss")
        if loss is None or not math.isfinite(loss):
            raise RunFailure(f"lm loss {loss} at iteration {iteration}")
    steady = [training[i] for i in range(steady_from, train_iters + 1)]
    if any(memory_key not in r for r in steady):
        raise RunFailure(f"the metrics carry no {memory_key}")
    return Measurement(peak_mib=max(r[memory_key] for r in steady),
                       iteration_s=statistics.median(r["iteration_time_s"] for r in steady),
                       memo_alpha=solved_alpha(log_text))


#: Largest relative difference of a CP=2 run's lm loss from its CP=1 reference's, per
#: iteration. Both train in bf16 from the same weights on the same sequences; CP splits each
#: sequence's attention into ring tiles merged by log-sum-exp, whose bf16 outputs round
#: differently (unit round-off 2^-8 = 3.9e-3 per element). The loss is a mean over 16384
#: tokens, so that rounding largely averages out: 1e-2 is several bf16 ulps of the loss, and
#: a wrong ring (a missing or misplaced tile, a wrong causal mask) moves it by more. Not yet
#: calibrated on a GPU.
CP_LOSS_TOLERANCE = 1e-2
#: The same for the grad norm: a norm over every gradient, after 10 Adam steps whose
#: per-element updates amplify round-off differences in near-zero gradients, so looser than
#: the loss. A missing CP gradient reduction changes it by about a factor 2 (1 - 1/sqrt(2) =
#: 0.29 at the least), far above 5e-2.
CP_GRAD_NORM_TOLERANCE = 5e-2


@dataclass
class Agreement:
    """Largest relative differences over the iterations, and the iteration of each."""

    loss: float
    loss_iteration: int
    grad_norm: float
    grad_norm_iteration: int

    @property
    def passed(self) -> bool:
        return self.loss <= CP_LOSS_TOLERANCE and self.grad_norm <= CP_GRAD_NORM_TOLERANCE

    def describe(self) -> str:
        return (f"against CP=1 on one GPU, same sequences: largest relative difference of lm "
                f"loss {self.loss:.1e} (iteration {self.loss_iteration}, tolerance "
                f"{CP_LOSS_TOLERANCE:g}), of grad norm {self.grad_norm:.1e} (iteration "
                f"{self.grad_norm_iteration}, tolerance {CP_GRAD_NORM_TOLERANCE:g})")


def agreement(records: list[dict], reference: list[dict], train_iters: int) -> Agreement:
    """How far a run's per-iteration ``lm_loss`` and ``grad_norm`` are from its reference's
    over iterations 1..``train_iters`` (relative to the reference). Raises RunFailure when an
    iteration or a figure is missing from either."""
    def by_iteration(rows, what):
        out = {r["iteration"]: r for r in rows if "iteration_time_s" in r}
        for i in range(1, train_iters + 1):
            for key in ("lm_loss", "grad_norm"):
                if i not in out or out[i].get(key) is None:
                    raise RunFailure(f"{what} logged no {key} at iteration {i}")
        return out

    ours, theirs = by_iteration(records, "the run"), by_iteration(reference, "the reference")
    worst = {}
    for key in ("lm_loss", "grad_norm"):
        diffs = [(abs(ours[i][key] - theirs[i][key]) / max(abs(theirs[i][key]), 1e-30), i)
                 for i in range(1, train_iters + 1)]
        worst[key] = max(diffs, key=lambda d: (not math.isfinite(d[0]), d[0]))
    return Agreement(worst["lm_loss"][0], worst["lm_loss"][1], worst["grad_norm"][0],
                     worst["grad_norm"][1])
