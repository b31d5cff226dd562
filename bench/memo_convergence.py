"""MEMO convergence runs: does ``--memo-offload`` train like the baseline, and how far does the
lossy ``--memo-offload-fp8`` move the loss curve?

    python bench/memo_convergence.py                       # 200 iterations, ~10-20 min on 2 cores
    python bench/memo_convergence.py --quick -o /tmp/mc    # smoke test: tiny model, 10 iterations
    python bench/memo_convergence.py --suite fp8           # offload modes: checkpoint layers, fp8
    python bench/memo_convergence.py --suite fp8 --quick -o /tmp/mc   # its smoke test (~1 min)

MEMO swaps part of each layer's saved activations to host memory and recomputes the rest before
the layer's backward. Neither changes the math, so with ``--deterministic-mode`` and no dropout
every exact MEMO run should reproduce the baseline's loss curve up to float32 round-off.

On the embedded demo dataset (tools/prepare_demo_data.py), the same small GPT is trained on CPU
(2 processes under torchrun, TP=2 + sequence parallelism, gloo) once without MEMO (baseline) and
once per variant of the chosen suite, one run after another:

- ``--suite alpha`` (the default): one ``--memo-offload --memo-alpha A`` run for each A in
  ``--alphas``. The model has 6 layers, so MEMO offloads 4 of them (it keeps the last 2 of a
  stage on device).
- ``--suite fp8``: the offload modes. ``exact-ckpt`` (``--memo-offload --memo-alpha 0
  --memo-checkpoint-layers 2``: 2 of the 4 offloaded layers checkpoint-offloaded, mode (b)) and
  ``exact-ckpt-a0.25`` (the same at alpha 0.25) must coincide with the baseline like the alpha
  suite; ``fp8-ckpt`` and ``fp8-ckpt-a0.25`` add ``--memo-offload-fp8`` (lossy) and are compared
  with the exact run of the same flags: the mean |loss - exact| over the last
  ``FP8_WINDOW`` iterations, relative to the exact run's mean loss there, must be
  <= ``FP8_TOLERANCE`` (1%; the reasoning is in the report and in :data:`FP8_TOLERANCE`).
  ``--runs`` picks a subset of the variants (the baseline always runs); a fp8 variant whose exact
  counterpart is not run is compared with the baseline, which every exact run equals.
  ``--quick`` uses a 4-layer model here (2 offloaded layers, 1 checkpoint-offloaded).

Outputs, in ``--output-dir`` (default bench/results):

- ``memo_convergence.png`` (alpha suite) / ``memo_offload_fp8.png`` (fp8 suite): top, the loss
  curves (each has its own marker and line style); bottom, the per-iteration difference to the
  reference on a log scale (alpha suite: |loss - baseline|, exact zeros drawn at a floor, the
  1e-5 relative threshold dashed; fp8 suite: |loss - reference| / reference, with the fp8 runs'
  running mean over the tolerance window in bold and both thresholds dashed).
- ``memo_convergence.md`` / ``memo_offload_fp8.md``: per run, final loss, max |loss - reference|,
  max relative difference, first iteration that differs at all and first that exceeds the
  threshold (fp8 suite also: mean gap, trailing-window gap against the tolerance, grad-norm
  gap), mean iteration time, tokens/s and peak RSS (all measured on this CPU), the exact
  commands, and a one-line verdict (alpha suite: COINCIDE/DIVERGE; fp8 suite: PASS/FAIL).
- ``memo_convergence_runs/<run>/{metrics.jsonl,train.log}`` (fp8 suite:
  ``memo_convergence_runs/fp8/<run>/``): the raw logs of each run.

Exit status: 0 when the report is written (whatever the verdict; ``--strict`` makes a DIVERGE or
FAIL exit 1), 1 when a training run fails (its log tail is printed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

REPORT_MD = "memo_convergence.md"
REPORT_PNG = "memo_convergence.png"
RUNS_DIR = "memo_convergence_runs"

FP8_REPORT_MD = "memo_offload_fp8.md"
FP8_REPORT_PNG = "memo_offload_fp8.png"
FP8_RUNS_SUBDIR = "fp8"
"""The fp8 suite's run logs go to RUNS_DIR/FP8_RUNS_SUBDIR/<run> (RUNS_DIR is git-ignored)."""

SUITES = ("alpha", "fp8")

RELATIVE_TOLERANCE = 1e-5
"""The curves coincide when max |loss - baseline| / |baseline| over all iterations is <= this."""

HOST_SLOTS_PREFIX = "> MEMO host slots"
HOST_SLOTS_PATTERN = re.compile(r"^> MEMO host slots \[rank 0,.*\]: \d+ slots, (\d+) B allocated")

DIFF_FLOOR = 1e-9
"""Where an exact zero difference is drawn on the log-scale difference panel."""

FP8_TOLERANCE = 0.01
"""fp8 runs pass when mean |loss - exact| over the last FP8_WINDOW iterations, divided by the exact
run's mean loss over those iterations, is <= this.

Why 1%: e4m3 keeps 3 mantissa bits, so round-to-nearest moves a value by at most 2^-4 = 6.25% of
itself (values far below their block's maximum fall into e4m3's subnormals, whose absolute error
is at most 2^-10 x 448^-1 of that maximum: negligible). The rounded copies are only read by
backward (the forward, and so the logged loss of the same iteration, ran on the exact values);
the curve moves only through the parameter updates. If every value were off by +2^-4 in the same
direction, the updates would be ~6% off and the loss drop over the run (~10.4 -> ~5.0 nats here)
~6% off: ~0.35 nats, ~7% of the final loss. Round-to-nearest errors are unbiased and independent
across values, so the expected gradient is unchanged to first order and what is left is of order
(2^-4)^2 = 2^-8 ~ 0.4% of the loss, plus the trajectory noise that any perturbation of the
updates starts (averaged over the window). 1% leaves that ~2.5x room and still fails a biased or
broken compression (scales off, stale data), which the ~7% worst case bounds from above."""

FP8_WINDOW = 20
"""Trailing iterations over which the fp8 gap is averaged for the verdict."""

FP8_VARIANTS = ("exact-ckpt", "exact-ckpt-a0.25", "fp8-ckpt", "fp8-ckpt-a0.25")
"""The fp8 suite's runs besides the baseline, in run order."""

FULL_CHECKPOINT_LAYERS = 2
"""--memo-checkpoint-layers of the fp8 suite: 2 of the full model's 4 offloaded layers."""
QUICK_CHECKPOINT_LAYERS = 1
"""The same for --quick: 1 of the 4-layer quick model's 2 offloaded layers."""

DEFAULT_ALPHAS = ("0", "0.25", "0.5", "1")
NPROC = 2

# 6 layers: MEMO keeps the last 2 layers of the stage on device, so 4 layers are offloaded.
# 2 micro-batches of 4 sequences per iteration, so every step also exercises several
# micro-batches' activations being swapped out and back.
FULL_MODEL_ARGS = [
    "--num-layers", "6", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "4", "--global-batch-size", "8",
]
# --quick: 3 layers (the minimum MEMO accepts: 1 offloaded layer), a smaller everything else.
QUICK_MODEL_ARGS = [
    "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4",
]
# --suite fp8 --quick: 4 layers, so MEMO offloads 2 and one of each mode (a) and (b) runs.
QUICK_FP8_MODEL_ARGS = ["--num-layers", "4", *QUICK_MODEL_ARGS[2:]]
QUICK_ITERATIONS = 10

COMMON_ARGS = [
    "--position-embedding-type", "rope",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--tensor-model-parallel-size", str(NPROC), "--sequence-parallel",
    "--deterministic-mode", "--seed", "1234",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--weight-decay", "0.1", "--clip-grad", "1.0",
    # The corpus has ~180 documents: no test split, and no evaluation (it would only add time).
    "--split", "95,5,0", "--eval-interval", "1000000", "--eval-iters", "0",
    "--log-interval", "1",
]

# What examples/cpu_quickstart.sh sets: one intra-op thread per rank (2 ranks share 2 cores),
# and no deprecation notices from torch's collectives.
RUN_ENV = {
    "OMP_NUM_THREADS": "1",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTHONWARNINGS": "ignore::FutureWarning:torch.distributed.c10d_logger",
}


@dataclass
class RunSpec:
    name: str
    """Directory name and table label: 'baseline', 'alpha=A' or one of FP8_VARIANTS."""
    alpha: str | None
    """--memo-alpha, or None for the baseline (no --memo-offload)."""
    flags: list[str] = field(default_factory=list)
    """Further --memo-* flags (fp8 suite: --memo-checkpoint-layers N, --memo-offload-fp8)."""
    reference: str = "baseline"
    """The run this one is compared with."""
    lossy: bool = False
    """--memo-offload-fp8: judged against FP8_TOLERANCE instead of RELATIVE_TOLERANCE."""
    command: list[str] = field(default_factory=list)
    metrics: Path = Path()
    log: Path = Path()


@dataclass
class RunResult:
    spec: RunSpec
    losses: dict[int, float]
    iteration_times: dict[int, float]
    grad_norms: dict[int, float]
    peak_rss_mib: float | None
    wall_s: float
    memo_lines: list[str]
    """MEMO's start-up lines ("> MEMO ..."), host-slot lines left out."""
    host_slot_bytes: int | None = None
    """Host-slot bytes allocated on rank 0 after iteration 1, where the trainer logs them
    ("> MEMO host slots [rank 0, ...]: N slots, B B allocated")."""


@dataclass
class Comparison:
    """One MEMO run against the baseline, over the iterations both logged."""

    max_abs: float
    max_rel: float
    max_rel_iteration: int | None
    first_nonzero: tuple[int, float, float] | None
    """(iteration, |diff|, relative diff) of the first iteration whose loss differs at all."""
    first_over: tuple[int, float, float] | None
    """The same for the first iteration past RELATIVE_TOLERANCE."""
    missing: list[int]
    """Baseline iterations this run did not log."""

    @property
    def coincides(self) -> bool:
        return self.max_rel <= RELATIVE_TOLERANCE and not self.missing


@dataclass
class LossyComparison:
    """One fp8 run against its exact reference (fp8 suite)."""

    reference: str
    max_abs: float
    max_rel: float
    max_rel_iteration: int | None
    mean_abs: float
    """Mean |loss - reference| over all common iterations."""
    mean_rel: float
    """Mean of |loss - reference| / |reference| over all common iterations."""
    window: int
    """Trailing iterations averaged for the verdict (FP8_WINDOW, or fewer in a short run)."""
    window_abs: float
    """Mean |loss - reference| over the window."""
    window_rel: float
    """window_abs / mean |reference loss| over the window: the number judged."""
    final_gap: float
    """Signed final loss - reference final loss."""
    first_grad_norm_rel: float
    """|grad norm - reference| / reference at the first iteration (the same weights and batch:
    fp8's direct effect on the gradient; nan if not logged)."""
    max_grad_norm_rel: float
    """Max |grad norm - reference| / reference over the common iterations (nan if not logged);
    later iterations add the drift of the weights."""
    nonfinite: list[int]
    """Iterations whose loss is nan or inf."""
    missing: list[int]

    @property
    def passes(self) -> bool:
        return (self.window_rel <= FP8_TOLERANCE and not self.nonfinite and not self.missing)


def parse_alpha(text: str) -> str:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"alpha {text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"alpha {text} is outside [0, 1]")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memo_convergence.py",
        description="Train the same small GPT on CPU without and with --memo-offload (one run "
                    "per --memo-alpha, or with --suite fp8 exact checkpoint-offload and "
                    "--memo-offload-fp8 runs) and compare the loss curves.",
    )
    parser.add_argument("--iterations", type=int, default=None,
                        help="Training iterations per run (default: 200; 10 with --quick).")
    parser.add_argument("-o", "--output-dir", type=Path, default=REPO_ROOT / "bench" / "results",
                        help="Where the PNG, the Markdown report and the run logs go "
                             "(default: bench/results).")
    parser.add_argument("--suite", choices=SUITES, default="alpha",
                        help="alpha (default): one --memo-offload run per --alphas value, "
                             f"reported in {REPORT_MD}; fp8: exact checkpoint-offload runs and "
                             f"--memo-offload-fp8 runs ({', '.join(FP8_VARIANTS)}), reported in "
                             f"{FP8_REPORT_MD} with the fp8 tolerance.")
    parser.add_argument("--alphas", nargs="+", type=parse_alpha, default=None,
                        metavar="ALPHA", help="--suite alpha: --memo-alpha values, one MEMO run "
                                              f"each (default: {' '.join(DEFAULT_ALPHAS)}).")
    parser.add_argument("--runs", nargs="+", choices=FP8_VARIANTS, default=None, metavar="RUN",
                        help="--suite fp8: the variants to run besides the baseline (default: "
                             f"all of {' '.join(FP8_VARIANTS)}).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: a 64-wide model, sequence 64, 10 iterations (3 layers; "
                             "4 with --suite fp8).")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="Seconds allowed per training run (default: 1800).")
    parser.add_argument("--strict", action="store_true",
                        help="Exit 1 when the verdict is DIVERGE (alpha suite) or FAIL (fp8 "
                             "suite).")
    return parser


def display_path(path: Path | str) -> str:
    """``path`` relative to the repository root when it lies inside it (commands run there)."""
    path = Path(path)
    for candidate in (path.absolute(), path.resolve()):
        try:
            return str(candidate.relative_to(REPO_ROOT))
        except ValueError:
            pass
    return str(path)


def prepare_data() -> list[str]:
    """Build (or reuse) the demo dataset; return its pretraining flags (the script's last line)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "prepare_demo_data.py")],
        check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines or not lines[-1].startswith("--data-path"):
        raise RuntimeError(
            f"tools/prepare_demo_data.py failed (exit {result.returncode}):\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        )
    print(lines[0] if len(lines) > 1 else lines[-1], flush=True)
    return shlex.split(lines[-1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_command(spec: RunSpec, model_args: list[str], data_args: list[str], iterations: int,
                  port: int) -> list[str]:
    python = display_path(sys.executable) if Path(sys.executable).is_absolute() else sys.executable
    command = [
        python, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC),
        "--master-addr", "127.0.0.1", "--master-port", str(port),
        "pretrain_gpt.py", *model_args, *COMMON_ARGS,
        "--lr-warmup-iters", str(max(1, min(10, iterations // 10))),
        "--train-iters", str(iterations), *data_args,
        "--log-metrics-jsonl", display_path(spec.metrics),
    ]
    if spec.alpha is not None:
        command += ["--memo-offload", "--memo-alpha", spec.alpha, *spec.flags]
    return command


def fp8_suite_specs(names: list[str], checkpoint_layers: int) -> list[RunSpec]:
    """The fp8 suite's runs: the baseline, then ``names`` (of FP8_VARIANTS) in FP8_VARIANTS
    order. A fp8 run whose exact counterpart is not among ``names`` is compared with the
    baseline (which the exact runs must equal)."""
    table = {  # name: (alpha, fp8)
        "exact-ckpt": ("0", False),
        "exact-ckpt-a0.25": ("0.25", False),
        "fp8-ckpt": ("0", True),
        "fp8-ckpt-a0.25": ("0.25", True),
    }
    specs = [RunSpec("baseline", None)]
    for name in FP8_VARIANTS:
        if name not in names:
            continue
        alpha, lossy = table[name]
        flags = ["--memo-checkpoint-layers", str(checkpoint_layers)]
        reference = "baseline"
        if lossy:
            flags.append("--memo-offload-fp8")
            exact = name.replace("fp8-", "exact-", 1)
            reference = exact if exact in names else "baseline"
        specs.append(RunSpec(name, alpha, flags, reference, lossy))
    return specs


def read_metrics(path: Path) -> tuple[dict[int, float], dict[int, float], float | None]:
    """(iteration -> lm loss, iteration -> iteration time, peak RSS/allocated MiB)."""
    losses, times, _grad_norms, peak = read_metrics_with_grad_norms(path)
    return losses, times, peak


def read_metrics_with_grad_norms(
    path: Path,
) -> tuple[dict[int, float], dict[int, float], dict[int, float], float | None]:
    """read_metrics plus iteration -> grad norm (iterations that logged one)."""
    losses, times, grad_norms, peak = {}, {}, {}, None
    if not path.is_file():
        return losses, times, grad_norms, peak
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or "lm_loss" not in record:
            continue
        iteration = record["iteration"]
        losses[iteration] = float(record["lm_loss"])
        times[iteration] = float(record["iteration_time_s"])
        if record.get("grad_norm") is not None:
            grad_norms[iteration] = float(record["grad_norm"])
        memory = next((record[key] for key in ("mem_peak_rss_mib", "mem_peak_rss_since_start_mib",
                                               "mem_peak_allocated_mib", "mem_rss_mib")
                       if key in record), None)
        if memory is not None:
            peak = memory if peak is None else max(peak, memory)
    return losses, times, grad_norms, peak


def run_training(spec: RunSpec, timeout: float) -> RunResult:
    spec.metrics.parent.mkdir(parents=True, exist_ok=True)
    spec.metrics.unlink(missing_ok=True)  # the trainer appends
    env = dict(os.environ)
    env.update(RUN_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    print(f"== {spec.name}: {shlex.join(spec.command)}", flush=True)
    start = time.perf_counter()
    with open(spec.log, "w", encoding="utf-8") as log:
        try:
            result = subprocess.run(spec.command, check=False, cwd=REPO_ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=timeout)
            returncode = result.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    wall = time.perf_counter() - start
    log_text = spec.log.read_text(encoding="utf-8", errors="replace")
    if returncode != 0:
        status = f"timed out after {timeout:.0f} s" if returncode is None else f"exit {returncode}"
        raise RuntimeError(f"run {spec.name} failed ({status}); log {spec.log}:\n"
                           f"{log_text[-6000:]}")
    losses, times, grad_norms, peak = read_metrics_with_grad_norms(spec.metrics)
    if not losses:
        raise RuntimeError(f"run {spec.name} logged no lm_loss to {spec.metrics}")
    memo_lines = [line.strip() for line in log_text.splitlines()
                  if line.startswith("> MEMO") and not line.startswith(HOST_SLOTS_PREFIX)]
    host_slot_bytes = next(
        (int(match.group(1)) for match in map(HOST_SLOTS_PATTERN.search, log_text.splitlines())
         if match), None)
    final = losses[max(losses)]
    print(f"   {len(losses)} iterations in {wall:.0f} s, final loss {final:.6f}", flush=True)
    return RunResult(spec, losses, times, grad_norms, peak, wall, memo_lines, host_slot_bytes)


def compare(baseline: dict[int, float], run: dict[int, float]) -> Comparison:
    max_abs = max_rel = 0.0
    max_rel_iteration = None
    first_nonzero = first_over = None
    missing = []
    for iteration in sorted(baseline):
        if iteration not in run:
            missing.append(iteration)
            continue
        reference, value = baseline[iteration], run[iteration]
        diff = abs(value - reference)
        if math.isnan(diff):
            diff = math.inf
        rel = diff / abs(reference) if reference != 0 else (0.0 if diff == 0 else math.inf)
        max_abs = max(max_abs, diff)
        if max_rel_iteration is None or rel > max_rel:
            max_rel, max_rel_iteration = rel, iteration
        if diff != 0 and first_nonzero is None:
            first_nonzero = (iteration, diff, rel)
        if rel > RELATIVE_TOLERANCE and first_over is None:
            first_over = (iteration, diff, rel)
    return Comparison(max_abs, max_rel, max_rel_iteration, first_nonzero, first_over, missing)


def compare_lossy(reference_name: str, reference: dict[int, float], run: dict[int, float],
                  reference_grad_norms: dict[int, float] | None = None,
                  run_grad_norms: dict[int, float] | None = None,
                  window: int = FP8_WINDOW) -> LossyComparison:
    """A lossy run's loss curve against its reference's, over the iterations both logged."""
    missing = [i for i in sorted(reference) if i not in run]
    common = [i for i in sorted(reference) if i in run]
    nonfinite = [i for i in sorted(run) if not math.isfinite(run[i])]
    diffs, rels = {}, {}
    for i in common:
        diff = abs(run[i] - reference[i])
        if math.isnan(diff):
            diff = math.inf
        diffs[i] = diff
        rels[i] = diff / abs(reference[i]) if reference[i] != 0 else (
            0.0 if diff == 0 else math.inf)
    max_rel_iteration = max(common, key=lambda i: rels[i]) if common else None
    tail = common[-window:] if window > 0 else []
    window_abs = sum(diffs[i] for i in tail) / len(tail) if tail else math.inf
    window_ref = sum(abs(reference[i]) for i in tail) / len(tail) if tail else 0.0
    window_rel = window_abs / window_ref if window_ref > 0 else (
        0.0 if window_abs == 0 else math.inf)
    grad_rels = []
    for i in common:
        if reference_grad_norms and run_grad_norms and i in reference_grad_norms \
                and i in run_grad_norms and reference_grad_norms[i] != 0:
            grad_rels.append(abs(run_grad_norms[i] - reference_grad_norms[i])
                             / abs(reference_grad_norms[i]))
    return LossyComparison(
        reference=reference_name,
        max_abs=max(diffs.values(), default=math.inf),
        max_rel=max(rels.values(), default=math.inf),
        max_rel_iteration=max_rel_iteration,
        mean_abs=sum(diffs.values()) / len(diffs) if diffs else math.inf,
        mean_rel=sum(rels.values()) / len(rels) if rels else math.inf,
        window=len(tail),
        window_abs=window_abs,
        window_rel=window_rel,
        final_gap=(run[max(run)] - reference[max(reference)]) if run and reference else math.nan,
        first_grad_norm_rel=grad_rels[0] if grad_rels else math.nan,
        max_grad_norm_rel=max(grad_rels) if grad_rels else math.nan,
        nonfinite=nonfinite,
        missing=missing,
    )


def mean_iteration_time(times: dict[int, float]) -> tuple[float, int]:
    """Mean over the logged iterations, leaving out iteration 1 (warm-up) when there are more."""
    iterations = sorted(times)
    if len(iterations) > 1:
        iterations = iterations[1:]
    return sum(times[i] for i in iterations) / len(iterations), len(iterations)


PLOT_STYLES = [
    {"linestyle": "-", "marker": None, "linewidth": 2.6, "color": "black", "alpha": 0.45},
    {"linestyle": "--", "marker": "o", "color": "tab:blue"},
    {"linestyle": ":", "marker": "s", "color": "tab:orange"},
    {"linestyle": "-.", "marker": "^", "color": "tab:green"},
    {"linestyle": (0, (5, 1, 1, 1)), "marker": "x", "color": "tab:red"},
    {"linestyle": (0, (1, 1)), "marker": "D", "color": "tab:purple"},
    {"linestyle": (0, (3, 1, 1, 1, 1, 1)), "marker": "v", "color": "tab:brown"},
]
"""One style per run, in run order; the first (the baseline) a wide translucent line."""


def _loss_axes(results: list[RunResult], height: float):
    """A figure with every run's loss curve on its top axis; returns (pyplot, figure, top,
    bottom, marks), ``marks[i]`` the (line style, marker keywords) run ``i`` uses below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, height), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    marks = []
    for index, result in enumerate(results):
        style = dict(PLOT_STYLES[index % len(PLOT_STYLES)])
        iterations = sorted(result.losses)
        markevery = max(1, len(iterations) // 12)
        # Offset each run's markers so coinciding curves still show every marker.
        offset = (index * markevery) // max(1, len(results))
        mark = {"marker": style.pop("marker"), "markevery": (offset, markevery),
                "markersize": 6, "markerfacecolor": "none"}
        top.plot(iterations, [result.losses[i] for i in iterations], label=result.spec.name,
                 **mark, **style)
        marks.append((style, mark))
    return plt, figure, top, bottom, marks


def _save_loss_figure(plt, figure, top, bottom, output: Path, *, title: str, ylabel: str,
                      ylim_top: float, legend: dict) -> None:
    """The difference axis on a log scale down to DIFF_FLOOR (exact zeros drawn there, its
    tick read "0"), titles and legends, written to ``output``."""
    import matplotlib.ticker

    bottom.axhline(DIFF_FLOOR, color="grey", linestyle=":", linewidth=1)
    bottom.set_yscale("log")
    log_format = matplotlib.ticker.LogFormatterSciNotation()
    bottom.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda value, pos: "0" if math.isclose(value, DIFF_FLOOR, rel_tol=1e-6)
        else log_format(value, pos)))
    top.set_title(title)
    top.set_ylabel("LM loss (nats/token)")
    bottom.set_ylabel(ylabel)
    bottom.set_xlabel("iteration")
    bottom.set_ylim(DIFF_FLOOR / 3, ylim_top)
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    bottom.grid(True, alpha=0.3, which="both")
    bottom.legend(loc="upper center", **legend)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120)
    plt.close(figure)


def plot(results: list[RunResult], output: Path, title: str) -> None:
    """Loss curves (top) and each run's absolute difference to the baseline (bottom, log)."""
    plt, figure, top, bottom, marks = _loss_axes(results, 8)
    baseline = results[0]
    for result, (style, mark) in zip(results[1:], marks[1:]):
        common = [i for i in sorted(result.losses) if i in baseline.losses]
        diffs = [abs(result.losses[i] - baseline.losses[i]) for i in common]
        shown = [max(d, DIFF_FLOOR) if not math.isnan(d) else DIFF_FLOOR for d in diffs]
        bottom.plot(common, shown, label=result.spec.name, **mark, **style)
    base_iterations = sorted(baseline.losses)
    bottom.plot(base_iterations,
                [RELATIVE_TOLERANCE * abs(baseline.losses[i]) for i in base_iterations],
                color="grey", linestyle="--", linewidth=1,
                label=f"{RELATIVE_TOLERANCE:g} x |baseline| (tolerance)")
    # Room above the tolerance line for the legend, clear of the differences.
    _save_loss_figure(plt, figure, top, bottom, output, title=title,
                      ylabel=f"|loss - baseline|  (exact 0 drawn at {DIFF_FLOOR:g})",
                      ylim_top=1e-1, legend={"fontsize": 8, "ncol": 3})


def _sci(value: float) -> str:
    return "0" if value == 0 else f"{value:.3e}"


def verdict_line(comparisons: dict[str, Comparison]) -> str:
    if not comparisons:
        return "Verdict: no MEMO runs to compare."
    worst = max(comparisons.values(), key=lambda c: c.max_rel).max_rel
    if all(c.coincides for c in comparisons.values()):
        return (f"Verdict: COINCIDE: every MEMO curve matches the baseline (max relative "
                f"difference {_sci(worst)} <= {RELATIVE_TOLERANCE:g}).")
    parts = []
    for name, c in comparisons.items():
        if c.first_over is not None:
            iteration, diff, rel = c.first_over
            parts.append(f"{name} from iteration {iteration} (|diff| {_sci(diff)}, "
                         f"relative {_sci(rel)})")
        elif c.missing:
            parts.append(f"{name} is missing {len(c.missing)} iterations")
    return (f"Verdict: DIVERGE: max relative difference {_sci(worst)} > "
            f"{RELATIVE_TOLERANCE:g}; " + "; ".join(parts) + ".")


def write_report(path: Path, results: list[RunResult], comparisons: dict[str, Comparison],
                 args: argparse.Namespace, iterations: int, model_args: list[str],
                 total_wall: float) -> str:
    tokens_per_iteration = (int(model_args[model_args.index("--global-batch-size") + 1])
                            * int(model_args[model_args.index("--seq-length") + 1]))
    verdict = verdict_line(comparisons)
    lines = [
        "# MEMO convergence: --memo-offload against the baseline",
        "",
        (f"Generated by `python bench/memo_convergence.py{' --quick' if args.quick else ''}"
         f" --iterations {iterations} --alphas {' '.join(args.alphas)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, CPU only ({os.cpu_count()} cores), "
        f"{NPROC} processes, TP={NPROC} + sequence parallelism, gloo, fp32, "
        f"`--deterministic-mode`, dropout 0. Model: `{' '.join(model_args)}` (rope), "
        f"{tokens_per_iteration} tokens per iteration, {iterations} iterations, "
        "embedded demo dataset (tools/prepare_demo_data.py). Total wall time "
        f"{total_wall:.0f} s."),
        "",
        verdict,
        "",
        (f"Differences are against the baseline at the same iteration, over all {iterations} "
         "iterations; relative = |loss - baseline| / |baseline|. Times are measured on this "
        "machine (mean `iteration_time_s` of the trainer's log, iteration 1 left out as "
        "warm-up; tokens/s = tokens per iteration / that mean). Peak RSS is the largest "
        "per-rank peak RSS the trainer logged (`mem_peak_rss_mib`). CPU timings are noisy on "
        "a shared 2-core machine and say nothing about GPU speed."),
        "",
        ("| run | final loss | max abs diff | max rel diff | first differing iteration | "
         "first iteration > 1e-5 rel | mean iter time (s) | tokens/s | peak RSS (MiB) | "
         "wall (s) |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        name = result.spec.name
        final = result.losses[max(result.losses)]
        mean_time, _ = mean_iteration_time(result.iteration_times)
        rss = "n/a" if result.peak_rss_mib is None else f"{result.peak_rss_mib:.0f}"
        if name in comparisons:
            c = comparisons[name]
            max_abs, max_rel = _sci(c.max_abs), _sci(c.max_rel)
            first_nonzero = ("none (bitwise equal)" if c.first_nonzero is None else
                             f"{c.first_nonzero[0]} ({_sci(c.first_nonzero[1])})")
            first_over = ("none" if c.first_over is None else
                          f"{c.first_over[0]} ({_sci(c.first_over[2])})")
        else:
            max_abs = max_rel = first_nonzero = first_over = "(reference)"
        lines.append(
            f"| {name} | {final:.6f} | {max_abs} | {max_rel} | {first_nonzero} | {first_over} | "
            f"{mean_time:.3f} | {tokens_per_iteration / mean_time:.0f} | {rss} | "
            f"{result.wall_s:.0f} |"
        )
    missing = {name: c.missing for name, c in comparisons.items() if c.missing}
    if missing:
        lines += ["", "Iterations missing from a MEMO run's log: "
                  + "; ".join(f"{n}: {m[:10]}" for n, m in missing.items())]
    memo_notes = [(r.spec.name, line) for r in results for line in r.memo_lines]
    if memo_notes:
        lines += ["", "MEMO's own start-up report (last rank):", ""]
        lines += [f"- {name}: `{line}`" for name, line in memo_notes]
    lines += [
        "",
        f"![loss curves and differences]({REPORT_PNG})",
        "",
    ]
    _write_with_commands(path, lines, results,
                         "Run from the repository root, one after another, with "
                         f"{_run_env_text()}. The data flags are the last line of "
                         "`python tools/prepare_demo_data.py`.")
    return verdict


def _run_env_text() -> str:
    return (" ".join(f"`{k}={v}`" for k, v in RUN_ENV.items())
            + " and `PYTHONPATH=<repository root>`")


def _write_with_commands(path: Path, lines: list[str], results: list[RunResult],
                         intro: str) -> None:
    """Write a report: ``lines``, then its Commands section (``intro`` and each run's command
    line)."""
    lines = [*lines, "## Commands", "", intro, "", "```",
             *(shlex.join(r.spec.command) for r in results), "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the up to ``window - 1`` before it."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def plot_fp8(results: list[RunResult], output: Path, title: str) -> None:
    """Loss curves (top) and each run's relative gap to its reference (bottom, log scale)."""
    plt, figure, top, bottom, marks = _loss_axes(results, 8.5)
    by_name = {r.spec.name: r for r in results}
    for result, (style, mark) in zip(results[1:], marks[1:]):
        reference = by_name[result.spec.reference].losses
        common = [i for i in sorted(result.losses) if i in reference]
        rels = []
        for i in common:
            diff = abs(result.losses[i] - reference[i])
            rel = diff / abs(reference[i]) if reference[i] else diff
            rels.append(DIFF_FLOOR if math.isnan(rel) else max(rel, DIFF_FLOOR))
        label = f"{result.spec.name} vs {result.spec.reference}"
        if result.spec.lossy:
            bottom.plot(common, rels, **dict(style, linewidth=0.8, alpha=0.45))
            bottom.plot(common, running_mean(rels, FP8_WINDOW),
                        label=f"{label} ({FP8_WINDOW}-iteration mean)", **mark,
                        **dict(style, linewidth=2.2))
        else:
            bottom.plot(common, rels, label=label, **mark, **style)
    bottom.axhline(FP8_TOLERANCE, color="tab:red", linestyle="--", linewidth=1,
                   label=f"fp8 tolerance {FP8_TOLERANCE:g} (mean of last {FP8_WINDOW})")
    bottom.axhline(RELATIVE_TOLERANCE, color="grey", linestyle="--", linewidth=1,
                   label=f"exact tolerance {RELATIVE_TOLERANCE:g}")
    _save_loss_figure(plt, figure, top, bottom, output, title=title,
                      ylabel=f"|loss - reference| / reference\n(exact 0 drawn at {DIFF_FLOOR:g})",
                      ylim_top=10.0, legend={"fontsize": 7, "ncol": 2})


def fp8_verdict_line(exact: dict[str, Comparison], lossy: dict[str, LossyComparison]) -> str:
    """PASS when every exact run coincides with the baseline (<= RELATIVE_TOLERANCE at every
    iteration) and every fp8 run's trailing-window gap is <= FP8_TOLERANCE."""
    if not exact and not lossy:
        return "Verdict: no MEMO runs to compare."
    failures = []
    for name, c in exact.items():
        if not c.coincides:
            where = (f"from iteration {c.first_over[0]} (relative {_sci(c.first_over[2])})"
                     if c.first_over is not None else f"missing {len(c.missing)} iterations")
            failures.append(f"{name} differs from the baseline {where}, over "
                            f"{RELATIVE_TOLERANCE:g}")
    for name, c in lossy.items():
        if c.nonfinite:
            failures.append(f"{name} has non-finite loss from iteration {c.nonfinite[0]}")
        elif c.missing:
            failures.append(f"{name} is missing {len(c.missing)} iterations")
        elif not c.passes:
            failures.append(f"{name}'s last-{c.window} mean relative gap to {c.reference} "
                            f"is {_sci(c.window_rel)} > {FP8_TOLERANCE:g}")
    parts = []
    if exact:
        worst = max(c.max_rel for c in exact.values())
        parts.append(f"exact runs' max relative difference to the baseline {_sci(worst)} "
                     f"(tolerance {RELATIVE_TOLERANCE:g})")
    if lossy:
        worst_name = max(lossy, key=lambda n: lossy[n].window_rel)
        parts.append(f"fp8 runs' largest last-{lossy[worst_name].window} mean relative gap "
                     f"to exact offload {_sci(lossy[worst_name].window_rel)} ({worst_name}; "
                     f"tolerance {FP8_TOLERANCE:g})")
    if failures:
        return "Verdict: FAIL: " + "; ".join(failures) + "."
    return "Verdict: PASS: " + "; ".join(parts) + "."


def fp8_command_line(args: argparse.Namespace, iterations: int) -> str:
    """The bench command that produced the fp8 report (as typed at the repository root)."""
    command = ["python", "bench/memo_convergence.py", "--suite", "fp8"]
    if args.quick:
        command.append("--quick")
    command += ["--iterations", str(iterations)]
    if args.runs is not None:
        command += ["--runs", *args.runs]
    if args.output_dir.resolve() != (REPO_ROOT / "bench" / "results").resolve():
        command += ["--output-dir", display_path(args.output_dir)]
    return shlex.join(command)


def write_fp8_report(path: Path, results: list[RunResult], exact: dict[str, Comparison],
                     lossy: dict[str, LossyComparison], args: argparse.Namespace,
                     iterations: int, model_args: list[str], checkpoint_layers: int,
                     total_wall: float) -> str:
    tokens_per_iteration = (int(model_args[model_args.index("--global-batch-size") + 1])
                            * int(model_args[model_args.index("--seq-length") + 1]))
    layers = int(model_args[model_args.index("--num-layers") + 1])
    verdict = fp8_verdict_line(exact, lossy)
    lines = [
        "# MEMO offload modes: checkpoint layers and fp8 offload against exact offload",
        "",
        (f"Generated by `{fp8_command_line(args, iterations)}` on "
         f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, CPU only ({os.cpu_count()} cores), "
         f"{NPROC} processes, TP={NPROC} + sequence parallelism, gloo, fp32, "
         f"`--deterministic-mode`, dropout 0. Model: `{' '.join(model_args)}` (rope), "
         f"{tokens_per_iteration} tokens per iteration, {iterations} iterations, "
         "embedded demo dataset (tools/prepare_demo_data.py). Total wall time "
         f"{total_wall:.0f} s."),
        "",
        verdict,
        "",
        (f"MEMO offloads {layers - 2} of the {layers} layers (it keeps the last 2 of the stage on "
         f"device); `--memo-checkpoint-layers {checkpoint_layers}` makes {checkpoint_layers} of "
         "them checkpoint-offloaded (mode (b): only the layer input goes to host, the whole "
         "layer is recomputed before its backward), the others stay token-wise MEMO layers "
         "(mode (a)) at the run's alpha. `--memo-offload-fp8` stores the tensors MEMO offloads "
         "whole (every offloaded layer's input, and the attention output of the mode-(a) "
         "layers) as fp8 e4m3 with one fp32 scale per 128 values (1.03 bytes per value "
         "instead of fp32's 4 here, bf16's 2 on GPU); the alpha-split tensors' kept tokens "
         "stay exact."),
        "",
        "## Exact runs against the baseline",
        "",
        (f"The exact (non-fp8) offload runs must reproduce the baseline: max |loss - baseline| "
         f"/ |baseline| over all iterations <= {RELATIVE_TOLERANCE:g}. Times are measured on "
         "this machine (mean `iteration_time_s` of the trainer's log, iteration 1 left out as "
         "warm-up; tokens/s = tokens per iteration / that mean); peak RSS is the largest "
         "per-rank `mem_peak_rss_mib` logged. CPU timings are noisy on a shared 2-core machine "
         "and say nothing about GPU speed."),
        "",
        ("| run | flags | final loss | max abs diff | max rel diff | first differing iteration "
         "| first iteration > 1e-5 rel | host slots (B, rank 0) | mean iter time (s) | tokens/s "
         "| peak RSS (MiB) | wall (s) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def timing(result: RunResult) -> str:
        mean_time, _ = mean_iteration_time(result.iteration_times)
        rss = "n/a" if result.peak_rss_mib is None else f"{result.peak_rss_mib:.0f}"
        return (f"{mean_time:.3f} | {tokens_per_iteration / mean_time:.0f} | {rss} | "
                f"{result.wall_s:.0f}")

    def host_bytes(result: RunResult, reference: RunResult | None = None) -> str:
        if result.host_slot_bytes is None:
            return "n/a" if result.spec.alpha is not None else "-"
        text = f"{result.host_slot_bytes}"
        if reference is not None and reference.host_slot_bytes:
            text += f" ({result.host_slot_bytes / reference.host_slot_bytes:.2f} x)"
        return text

    def flags(result: RunResult) -> str:
        if result.spec.alpha is None:
            return "(no MEMO)"
        return "`" + " ".join(["--memo-alpha", result.spec.alpha, *result.spec.flags]) + "`"

    for result in results:
        if result.spec.lossy:
            continue
        name = result.spec.name
        final = result.losses[max(result.losses)]
        if name in exact:
            c = exact[name]
            cells = (f"{_sci(c.max_abs)} | {_sci(c.max_rel)} | "
                     + ("none (bitwise equal)" if c.first_nonzero is None else
                        f"{c.first_nonzero[0]} ({_sci(c.first_nonzero[1])})")
                     + " | " + ("none" if c.first_over is None else
                                f"{c.first_over[0]} ({_sci(c.first_over[2])})"))
        else:
            cells = "(reference) | (reference) | (reference) | (reference)"
        lines.append(f"| {name} | {flags(result)} | {final:.6f} | {cells} | "
                     f"{host_bytes(result)} | {timing(result)} |")

    window = min(FP8_WINDOW, iterations)
    lines += [
        "",
        "## fp8 runs against exact offload",
        "",
        (f"Tolerance: the mean |loss - exact| over the last {window} iterations, divided by the "
         f"exact run's mean loss over those iterations, must be <= {FP8_TOLERANCE:g} "
         f"({FP8_TOLERANCE:.0%}). Why: "
         "e4m3 keeps 3 mantissa bits, so rounding moves a value by at most 2^-4 = 6.25% of "
         "itself; the rounded copies are only read by backward (the forward and its logged "
         "loss use the exact values), so the curve moves only through the updates. A "
         "systematic 2^-4 error in every update would shift the loss drop of the run by ~6% "
         "(several percent of the final loss here); round-to-nearest errors are unbiased and "
         "independent, so what remains is second order, ~(2^-4)^2 = 0.4%, plus the trajectory "
         "noise any perturbation starts (averaged by the window). 1% leaves room for that and "
         "still catches a biased or broken compression."),
        "",
        ("| run | reference | final loss | reference final loss | final gap | max abs gap | "
         "max rel gap (iteration) | mean abs gap (all iterations) | mean rel gap (all) | "
         f"last-{window} mean rel gap | within {FP8_TOLERANCE:g}? | grad-norm rel gap, "
         "iteration 1 / max | host slots (B, rank 0; x reference) | mean iter time (s) | "
         "tokens/s | peak RSS (MiB) | wall (s) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_name = {r.spec.name: r for r in results}
    for result in results:
        if not result.spec.lossy:
            continue
        c = lossy[result.spec.name]
        reference = by_name[c.reference]
        grad_gaps = ("n/a" if math.isnan(c.max_grad_norm_rel) else
                     f"{_sci(c.first_grad_norm_rel)} / {_sci(c.max_grad_norm_rel)}")
        lines.append(
            f"| {result.spec.name} | {c.reference} | {result.losses[max(result.losses)]:.6f} | "
            f"{reference.losses[max(reference.losses)]:.6f} | {c.final_gap:+.3e} | "
            f"{_sci(c.max_abs)} | {_sci(c.max_rel)} ({c.max_rel_iteration}) | "
            f"{_sci(c.mean_abs)} | {_sci(c.mean_rel)} | {_sci(c.window_rel)} | "
            f"{'yes' if c.passes else 'NO'} | "
            f"{grad_gaps} | {host_bytes(result, reference)} | "
            f"{timing(result)} |")
    lines += [
        "",
        ("Gaps are against the reference run at the same iteration; relative = |gap| / "
         "|reference|. The loss of iteration 1 is the same in every run (the forward never "
         "reads the fp8 copies); the grad-norm gap at iteration 1 (same weights, same batch) is "
         "fp8's direct effect on the gradient, the later ones add the drift of the weights. "
         "Timing columns as in the exact table: on CPU fp8 only adds the quantisation work; "
         "the transfer it saves on a GPU's PCIe link does not show here. Host slots: the bytes "
         "of host memory MEMO's slots hold on rank 0 after iteration 1, as the trainer logs "
         "them (`> MEMO host slots`; n/a where it does not); fp8 shrinks only the whole-"
         "offloaded tensors, so the ratio to the reference is above 1.03/4."),
    ]
    memo_notes = [(r.spec.name, line) for r in results for line in r.memo_lines]
    if memo_notes:
        lines += ["", "MEMO's own start-up report (last rank):", ""]
        lines += [f"- {name}: `{line}`" for name, line in memo_notes]
    lines += [
        "",
        f"![loss curves and gaps]({FP8_REPORT_PNG})",
        "",
    ]
    _write_with_commands(path, lines, results,
                         f"The bench: `{fp8_command_line(args, iterations)}`. It runs, from the "
                         f"repository root, one after another, with {_run_env_text()} (the data "
                         "flags are the last line of `python tools/prepare_demo_data.py`):")
    return verdict


def run_all(specs: list[RunSpec], runs_dir: Path, model_args: list[str], iterations: int,
            timeout: float) -> list[RunResult]:
    data_args = prepare_data()
    results = []
    for spec in specs:
        run_dir = runs_dir / spec.name.replace("=", "_")
        spec.metrics, spec.log = run_dir / "metrics.jsonl", run_dir / "train.log"
        spec.command = build_command(spec, model_args, data_args, iterations, free_port())
        results.append(run_training(spec, timeout))
    return results


def main_fp8(args: argparse.Namespace, iterations: int) -> int:
    model_args = QUICK_FP8_MODEL_ARGS if args.quick else FULL_MODEL_ARGS
    checkpoint_layers = QUICK_CHECKPOINT_LAYERS if args.quick else FULL_CHECKPOINT_LAYERS
    output_dir: Path = args.output_dir.resolve()
    names = list(args.runs) if args.runs is not None else list(FP8_VARIANTS)
    specs = fp8_suite_specs(names, checkpoint_layers)
    start = time.perf_counter()
    try:
        results = run_all(specs, output_dir / RUNS_DIR / FP8_RUNS_SUBDIR, model_args,
                          iterations, args.timeout)
    except RuntimeError as error:
        print(f"memo_convergence.py: error: {error}", file=sys.stderr)
        return 1
    total_wall = time.perf_counter() - start

    by_name = {r.spec.name: r for r in results}
    baseline = results[0]
    exact = {r.spec.name: compare(baseline.losses, r.losses)
             for r in results[1:] if not r.spec.lossy}
    lossy = {}
    for r in results:
        if r.spec.lossy:
            reference = by_name[r.spec.reference]
            lossy[r.spec.name] = compare_lossy(r.spec.reference, reference.losses, r.losses,
                                               reference.grad_norms, r.grad_norms)
    title = (f"MEMO offload modes on CPU: {model_args[1]} layers x {model_args[3]}, seq "
             f"{model_args[7]}, TP={NPROC}+SP,\n--memo-checkpoint-layers {checkpoint_layers}: "
             "exact offload vs --memo-offload-fp8")
    plot_fp8(results, output_dir / FP8_REPORT_PNG, title)
    verdict = write_fp8_report(output_dir / FP8_REPORT_MD, results, exact, lossy, args,
                               iterations, model_args, checkpoint_layers, total_wall)
    print((output_dir / FP8_REPORT_MD).read_text(encoding="utf-8").split("## Commands")[0]
          .rstrip())
    print(f"\nwrote {output_dir / FP8_REPORT_MD} and {output_dir / FP8_REPORT_PNG}")
    if args.strict and not verdict.startswith("Verdict: PASS"):
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    iterations = args.iterations if args.iterations is not None else (
        QUICK_ITERATIONS if args.quick else 200)
    if iterations < 1:
        parser.error(f"--iterations must be positive, got {iterations}")
    if args.suite == "fp8":
        if args.alphas is not None:
            parser.error("--alphas belongs to --suite alpha; the fp8 suite's runs are chosen "
                         "with --runs")
        return main_fp8(args, iterations)
    if args.runs is not None:
        parser.error("--runs belongs to --suite fp8; the alpha suite's runs are chosen with "
                     "--alphas")
    if args.alphas is None:
        args.alphas = list(DEFAULT_ALPHAS)
    model_args = QUICK_MODEL_ARGS if args.quick else FULL_MODEL_ARGS
    output_dir: Path = args.output_dir.resolve()
    runs_dir = output_dir / RUNS_DIR

    start = time.perf_counter()
    try:
        specs = [RunSpec("baseline", None)] + [RunSpec(f"alpha={a}", a) for a in args.alphas]
        results = run_all(specs, runs_dir, model_args, iterations, args.timeout)
    except RuntimeError as error:
        print(f"memo_convergence.py: error: {error}", file=sys.stderr)
        return 1
    total_wall = time.perf_counter() - start

    baseline = results[0]
    comparisons = {r.spec.name: compare(baseline.losses, r.losses) for r in results[1:]}
    title = (f"MEMO convergence on CPU: {model_args[1]} layers x {model_args[3]}, seq "
             f"{model_args[7]}, TP={NPROC}+SP, deterministic")
    plot(results, output_dir / REPORT_PNG, title)
    verdict = write_report(output_dir / REPORT_MD, results, comparisons, args, iterations,
                           model_args, total_wall)
    print((output_dir / REPORT_MD).read_text(encoding="utf-8").split("## Commands")[0].rstrip())
    print(f"\nwrote {output_dir / REPORT_MD} and {output_dir / REPORT_PNG}")
    if args.strict and verdict.startswith("Verdict: DIVERGE"):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
