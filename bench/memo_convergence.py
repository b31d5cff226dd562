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

RELATIVE_TOLERANCE = 1e-5
"""The curves coincide when max |loss - baseline| / |baseline| over all iterations is <= this."""

DIFF_FLOOR = 1e-9
"""Where an exact zero difference is drawn on the log-scale difference panel."""

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
    """Directory name and table label: 'baseline' or 'alpha=A'."""
    alpha: str | None
    """--memo-alpha, or None for the baseline (no --memo-offload)."""
    command: list[str] = field(default_factory=list)
    metrics: Path = Path()
    log: Path = Path()


@dataclass
class RunResult:
    spec: RunSpec
    losses: dict[int, float]
    iteration_times: dict[int, float]
    peak_rss_mib: float | None
    wall_s: float
    memo_lines: list[str]


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
                    "per --memo-alpha) and compare the loss curves.",
    )
    parser.add_argument("--iterations", type=int, default=None,
                        help="Training iterations per run (default: 200; 10 with --quick).")
    parser.add_argument("-o", "--output-dir", type=Path, default=REPO_ROOT / "bench" / "results",
                        help="Where the PNG, the Markdown report and the run logs go "
                             "(default: bench/results).")
    parser.add_argument("--alphas", nargs="+", type=parse_alpha, default=list(DEFAULT_ALPHAS),
                        metavar="ALPHA", help="--memo-alpha values, one MEMO run each "
                                              f"(default: {' '.join(DEFAULT_ALPHAS)}).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: a 3-layer 64-wide model, sequence 64, 10 iterations.")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="Seconds allowed per training run (default: 1800).")
    parser.add_argument("--strict", action="store_true",
                        help="Exit 1 when a MEMO curve does not coincide with the baseline.")
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
        command += ["--memo-offload", "--memo-alpha", spec.alpha]
    return command


def read_metrics(path: Path) -> tuple[dict[int, float], dict[int, float], float | None]:
    """(iteration -> lm loss, iteration -> iteration time, peak RSS/allocated MiB)."""
    losses, times, peak = {}, {}, None
    if not path.is_file():
        return losses, times, peak
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
        memory = next((record[key] for key in ("mem_peak_rss_mib", "mem_peak_rss_since_start_mib",
                                               "mem_peak_allocated_mib", "mem_rss_mib")
                       if key in record), None)
        if memory is not None:
            peak = memory if peak is None else max(peak, memory)
    return losses, times, peak


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
    losses, times, peak = read_metrics(spec.metrics)
    if not losses:
        raise RuntimeError(f"run {spec.name} logged no lm_loss to {spec.metrics}")
    memo_lines = [line.strip() for line in log_text.splitlines() if line.startswith("> MEMO")]
    final = losses[max(losses)]
    print(f"   {len(losses)} iterations in {wall:.0f} s, final loss {final:.6f}", flush=True)
    return RunResult(spec, losses, times, peak, wall, memo_lines)


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


def mean_iteration_time(times: dict[int, float]) -> tuple[float, int]:
    """Mean over the logged iterations, leaving out iteration 1 (warm-up) when there are more."""
    iterations = sorted(times)
    if len(iterations) > 1:
        iterations = iterations[1:]
    return sum(times[i] for i in iterations) / len(iterations), len(iterations)


def plot(results: list[RunResult], output: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    styles = [
        {"linestyle": "-", "marker": None, "linewidth": 2.6, "color": "black", "alpha": 0.45},
        {"linestyle": "--", "marker": "o", "color": "tab:blue"},
        {"linestyle": ":", "marker": "s", "color": "tab:orange"},
        {"linestyle": "-.", "marker": "^", "color": "tab:green"},
        {"linestyle": (0, (5, 1, 1, 1)), "marker": "x", "color": "tab:red"},
        {"linestyle": (0, (1, 1)), "marker": "D", "color": "tab:purple"},
        {"linestyle": (0, (3, 1, 1, 1, 1, 1)), "marker": "v", "color": "tab:brown"},
    ]
    baseline = results[0]
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    for index, result in enumerate(results):
        style = dict(styles[index % len(styles)])
        iterations = sorted(result.losses)
        marker = style.pop("marker")
        markevery = max(1, len(iterations) // 12)
        # Offset each run's markers so coinciding curves still show every marker.
        offset = (index * markevery) // max(1, len(results))
        top.plot(iterations, [result.losses[i] for i in iterations], label=result.spec.name,
                 marker=marker, markevery=(offset, markevery), markersize=6,
                 markerfacecolor="none", **style)
        if index == 0:
            continue
        common = [i for i in iterations if i in baseline.losses]
        diffs = [abs(result.losses[i] - baseline.losses[i]) for i in common]
        shown = [max(d, DIFF_FLOOR) if not math.isnan(d) else DIFF_FLOOR for d in diffs]
        bottom.plot(common, shown, label=result.spec.name, marker=marker,
                    markevery=(offset, markevery), markersize=6, markerfacecolor="none", **style)
    base_iterations = sorted(baseline.losses)
    bottom.plot(base_iterations,
                [RELATIVE_TOLERANCE * abs(baseline.losses[i]) for i in base_iterations],
                color="grey", linestyle="--", linewidth=1,
                label=f"{RELATIVE_TOLERANCE:g} x |baseline| (tolerance)")
    bottom.axhline(DIFF_FLOOR, color="grey", linestyle=":", linewidth=1)
    bottom.set_yscale("log")
    # Exact zeros sit on the floor; its tick reads "0" instead of the floor value.
    log_format = matplotlib.ticker.LogFormatterSciNotation()
    bottom.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda value, pos: "0" if math.isclose(value, DIFF_FLOOR, rel_tol=1e-6)
        else log_format(value, pos)))
    top.set_title(title)
    top.set_ylabel("LM loss (nats/token)")
    bottom.set_ylabel(f"|loss - baseline|  (exact 0 drawn at {DIFF_FLOOR:g})")
    bottom.set_xlabel("iteration")
    # Room above the tolerance line for the legend, clear of the differences.
    bottom.set_ylim(DIFF_FLOOR / 3, 1e-1)
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    bottom.grid(True, alpha=0.3, which="both")
    bottom.legend(fontsize=8, loc="upper center", ncol=3)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120)
    plt.close(figure)


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
        "## Commands",
        "",
        "Run from the repository root, one after another, with "
        + " ".join(f"`{k}={v}`" for k, v in RUN_ENV.items())
        + " and `PYTHONPATH=<repository root>`. The data flags are the last line of "
          "`python tools/prepare_demo_data.py`.",
        "",
        "```",
    ]
    lines += [shlex.join(r.spec.command) for r in results]
    lines += ["```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    iterations = args.iterations if args.iterations is not None else (
        QUICK_ITERATIONS if args.quick else 200)
    if iterations < 1:
        parser.error(f"--iterations must be positive, got {iterations}")
    model_args = QUICK_MODEL_ARGS if args.quick else FULL_MODEL_ARGS
    output_dir: Path = args.output_dir.resolve()
    runs_dir = output_dir / RUNS_DIR

    start = time.perf_counter()
    try:
        data_args = prepare_data()
        specs = [RunSpec("baseline", None)] + [RunSpec(f"alpha={a}", a) for a in args.alphas]
        results = []
        for spec in specs:
            run_dir = runs_dir / spec.name.replace("=", "_")
            spec.metrics, spec.log = run_dir / "metrics.jsonl", run_dir / "train.log"
            spec.command = build_command(spec, model_args, data_args, iterations, free_port())
            results.append(run_training(spec, args.timeout))
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
