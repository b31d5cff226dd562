"""This machine as a second oracle for the estimator's time model: the predicted iteration time
of the real CPU trainer beside the measured one, configuration by configuration.

    python bench/cpu_oracle.py                   # 9 configurations, ~28 min on 2 cores
    python bench/cpu_oracle.py --only tp2,cp2    # some of them (--list names them; the
                                                 # others' rows are kept from the last run)

For each configuration, one after another:

1. the ``cpu`` hardware profile is micro-benchmarked (memo_ext.estimate.cpu_profile) with the
   ranks and threads the trainer will use: GEMMs and the trainer's attention kernels at the
   layout's shapes, element-wise bandwidth, MEMO's host copies, gloo's collectives;
2. the estimator traces the layout (the tracer with the cpu profile's request fields: fp32, no
   CUDA rules, megatron's plain optimizer; traced whole at the trainer's length) and predicts one
   iteration (memo_ext.estimate.layout.LayoutModel.predict, the same path as
   ``tools/estimate.py --gpu cpu``);
3. the trainer runs that trace's own command line (its header's ``trainer_argv``, with the
   trace-only MEMO flags dropped and the iterations, batch and logging set here) under torchrun,
   one process per rank, each with cores/ranks intra-op threads; the measured iteration time is
   the median of ``iteration_time_s`` over the iterations after the first WARMUP_ITERATIONS.

Nothing is fitted to the trainer's times: the profile is micro-benchmarks only. The load average
is recorded before and after each row (other jobs share the 2 cores; a row whose load was above
--max-load when it started waits, up to --wait-minutes). Writes bench/results/cpu_oracle.md and
.png (and cpu_oracle.json: every profile and prediction).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from memo_ext.estimate.cpu_profile import (  # noqa: E402
    cores,
    free_port,
    measure_cpu_profile,
    threads_per_rank,
)
from memo_ext.estimate.kernels import at_model_shapes  # noqa: E402
from memo_ext.estimate.layout import (  # noqa: E402
    Layout,
    LayoutModel,
    TraceCache,
    build_layout_model,
    default_cache_dir,
)
from memo_ext.estimate.models import traced_model  # noqa: E402
from memo_ext.flags import render_flags  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
#: One model for every row: GEMMs dominate (hidden 1024, MLP 4096) and an iteration of 2
#: sequences of 4096 tokens takes ~15 s on 2 cores. The tracer's defaults make it a GPT with
#: RoPE, LayerNorm, GeLU, biases, untied embeddings and no dropout; the trainer gets the same
#: from the trace's own command line.
SEQ = 4096
MODEL = {"num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 4096,
         "num_attention_heads": 8, "vocab_size": 4096, "seq_length": SEQ}
#: The network traced: MODEL's shape (the tracer's defaults for the rest).
TRACED_MODEL = traced_model(None, MODEL)
GLOBAL_BATCH = 2
ITERATIONS = 6
WARMUP_ITERATIONS = 2  # page faults of first allocations, MKL and gloo start-up
#: Runs of each micro-benchmark (the profile takes their median). 20: with 5, opt1's profile
#: predicted its forward and backward between 0.73 and 1.05 s a micro-batch from run to run
#: on the same quiet machine; with 20, 0.81-0.84 (2026-11-28). About 20 s a one-rank profile.
PROFILE_REPEATS = 20
#: Flags of the tracer that the trainer must not get: MEMO's host capacity and bandwidth
#: stand-ins (the trainer measures both), each with its value.
TRACE_ONLY_FLAGS = ("--memo-host-memory-gb", "--memo-pcie-gbps")
#: megatron-core's timer printout, the training loop's 'optimizer' timer (min, max over ranks,
#: ms per iteration): megatron.training.timing
OPTIMIZER_TIMER = re.compile(r"^\s+optimizer \.+: \(([\d.]+), [\d.]+\)", re.M)
RUN_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONWARNINGS": "ignore::FutureWarning:torch.distributed.c10d_logger"}


@dataclass(frozen=True)
class Config:
    """One row. ``request_fields``: TraceRequest fields (memo_ext.trace.request) that
    the layout does not say, set on each of its trace requests (e.g. sequence parallelism off
    at TP=2)."""

    name: str
    layout: Layout
    description: str
    request_fields: dict = field(default_factory=dict)
    seq: int = SEQ  # tokens per sequence (the trainer's --seq-length)
    #: The trainer's timers (--timing-log-level 1): its 'optimizer' timer, measured beside the
    #: predicted optimizer term (the part of the step a row is about)
    time_optimizer: bool = False


CONFIGS = [
    Config("none", Layout(1, 1, 1, 1, "megatron-none"), "no recompute"),
    Config("full", Layout(1, 1, 1, 1, "megatron"), "full recompute (uniform, 1 layer)"),
    Config("memo0", Layout(1, 1, 1, 1, "memo", 0.0), "MEMO alpha 0"),
    Config("memo1", Layout(1, 1, 1, 1, "memo", 1.0), "MEMO alpha 1"),
    Config("tp2", Layout(2, 1, 1, 1, "megatron-none"), "TP=2",
           {"sequence_parallel": False}),
    Config("tp2sp", Layout(2, 1, 1, 1, "megatron-none"), "TP=2 + sequence parallel"),
    Config("cp2", Layout(1, 2, 1, 1, "megatron-none"), "CP=2"),
    Config("pp2", Layout(1, 1, 2, 1, "megatron-none"), "PP=2 (1F1B, 2 micro-batches)"),
    # 512 tokens: the optimizer step, which does not grow with the length, is a tenth of the
    # iteration (at 4096 tokens it would be under 1%, and the row would test nothing of it)
    Config("opt1", Layout(1, 1, 1, 1, "megatron-none", optimizer_offload=1.0),
           "no recompute, --optimizer-cpu-offload --optimizer-offload-fraction 1, 512 tokens",
           seq=512, time_optimizer=True),
]


@dataclass
class Row:
    config: str
    description: str
    ranks: int
    threads: int
    measured_s: float
    iteration_times: list
    predicted_s: float
    breakdown: str
    step: dict
    efficiency: dict
    profile: dict
    trainer_argv: list
    load_before: float
    load_after: float
    wall_s: float
    log: str = field(default="", repr=False)
    #: the trainer's 'optimizer' timer, median over the timed iterations (time_optimizer rows)
    measured_optimizer_s: Optional[float] = None

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def wait_for_quiet(max_load: float, minutes: float, say) -> None:
    """Return once the 1-minute load average is at most ``max_load`` (or after ``minutes``)."""
    deadline = time.monotonic() + 60 * minutes
    load = os.getloadavg()[0]
    while load > max_load and time.monotonic() < deadline:
        say(f"  load {load:.2f} > {max_load}: waiting")
        time.sleep(30)
        load = os.getloadavg()[0]


def profile_layout(config: Config) -> dict:
    """The configuration's layout as cpu_profile.measure_cpu_profile takes it."""
    layout = config.layout
    return {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp,
            "micro_batch_size": layout.micro_batch,
            "sequence_parallel": layout.tp > 1 and config.request_fields.get(
                "sequence_parallel", True)}


def layout_model(config: Config, hardware: dict, cache: TraceCache) -> LayoutModel:
    """The configuration's layout traced whole at every length asked (the path of
    ``tools/estimate.py --gpu cpu``), each stage's trace request with the configuration's
    ``request_fields``."""
    model, _ = build_layout_model(TRACED_MODEL, config.layout, hardware, cache=cache,
                                  exhaustive=True, global_batch=GLOBAL_BATCH,
                                  num_layers=MODEL["num_layers"])
    for stage in model.stages:  # exhaustive: no trace yet, each stage's request (StageModel)
        traced_cache, request = stage.traced
        stage.traced = (traced_cache, request.replace(**config.request_fields))
    return model


def trainer_command(trace_argv: list[str], ranks: int, metrics: Path) -> list[str]:
    """torchrun and pretrain_gpt.py with the trace's trainer command line (module docstring)."""
    argv, skip = [], False
    for flag in trace_argv:
        if skip:
            skip = False
        elif flag in TRACE_ONLY_FLAGS:
            skip = True
        else:
            argv.append(flag)
    port = free_port()
    return [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(REPO_ROOT / "pretrain_gpt.py"), *argv,
            "--train-iters", str(ITERATIONS), "--global-batch-size", str(GLOBAL_BATCH),
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
            "--seed", "1234", "--log-metrics-jsonl", str(metrics)]


def train(command: list[str], threads: int, run_dir: Path) -> tuple[list[float], str]:
    """Per-iteration times the trainer logged, and its log's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # the trainer appends
    env = {**os.environ, **RUN_ENV, "OMP_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    log = run_dir / "train.log"
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_text().strip().splitlines()[-5:]
        raise SystemExit(f"cpu_oracle.py: the trainer failed (status {done.returncode}); "
                         f"see {log}:\n" + "\n".join(tail))
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["iteration_time_s"] for r in records if "iteration_time_s" in r], str(log)


def microbatch_s(step) -> float:
    """One micro-batch of a stage, as StepTime.breakdown() sums it."""
    return step.forward_s + step.recompute_s + step.backward_s + step.offload_exposed_s \
        + step.pipeline_s


def run_config(config: Config, cache: TraceCache, run_root: Path, say) -> Row:
    started = time.perf_counter()
    layout = config.layout
    ranks = layout.gpus
    threads = threads_per_rank(ranks)
    load_before = os.getloadavg()[0]
    hardware = measure_cpu_profile({**MODEL, "seq_length": config.seq}, profile_layout(config),
                                   ranks=ranks, threads=threads, repeats=PROFILE_REPEATS,
                                   log=lambda line: say(f"  {line}"))
    model = layout_model(config, hardware, cache)
    prediction = model.predict(config.seq)
    step = prediction.step
    breakdown = step.breakdown()
    if len(prediction.stages) > 1:  # what 1F1B's fill and drain run on (docs/cpu_oracle.md)
        breakdown += "; micro-batch per stage " + ", ".join(
            f"{microbatch_s(p.step):.3f}" for p in prediction.stages)
    say(f"  predicted: {breakdown}")
    header = model.stages[0].at(config.seq).header
    efficiency = at_model_shapes(model.efficiency, hardware, header["model"], header["layout"])
    command = trainer_command(header["trainer_argv"], ranks,
                              run_root / config.name / "metrics.jsonl")
    if config.time_optimizer:
        command += ["--timing-log-level", "1"]
    times, log = train(command, threads, run_root / config.name)
    timed = times[WARMUP_ITERATIONS:]
    optimizer_s = None
    if config.time_optimizer:
        optimizer_ms = [float(value) for value in OPTIMIZER_TIMER.findall(Path(log).read_text())]
        optimizer_s = statistics.median(optimizer_ms[WARMUP_ITERATIONS:]) / 1e3
        say(f"  optimizer step: measured {optimizer_s:.3f} s (trainer's timer), predicted "
            f"{step.optimizer_s:.3f} s ({step.optimizer_s / optimizer_s - 1:+.1%})")
    if not timed:
        raise SystemExit(f"cpu_oracle.py: {config.name}: the trainer logged {len(times)} "
                         f"iterations, none after the {WARMUP_ITERATIONS} of warm-up; see {log}")
    measured = statistics.median(timed)
    say(f"  measured {measured:.2f} s (iterations {', '.join(f'{t:.2f}' for t in times)}), "
        f"predicted {step.step_s:.2f} s ({step.step_s / measured - 1:+.1%})")
    return Row(config.name, config.description, ranks, threads, measured, times, step.step_s,
               breakdown, asdict(step), asdict(efficiency), hardware, command, load_before,
               os.getloadavg()[0], time.perf_counter() - started, log, optimizer_s)


# ----------------------------------------------------------------------------- the report

def profile_line(row: Row) -> str:
    p = row.profile
    collectives = "; ".join(f"{op.replace('_', '-')} {v['gbps']:.1f} GB/s + "
                            f"{v['latency_s'] * 1e6:.0f} us" for op, v in
                            p["collective_ops"].items()) or "none (one rank)"
    return (f"| {row.config} | {p['bf16_tflops'] * 1e3:.0f} | GEMM "
            f"{row.efficiency['gemm']:.2f}, attention {row.efficiency['attention_forward']:.2f}"
            f" / {row.efficiency['attention_backward']:.2f} | "
            f"{p['hbm_gbps']:.1f} | {p['pcie_gbps']:.1f} | {p['host_copy_overlap']:.2f} | "
            f"{collectives} |")


def write_report(rows: list[Row], command: str, wall_s: float, load: tuple,
                 carried: tuple = ()) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain"],
                           capture_output=True, text=True).stdout.strip()
    worst = max(rows, key=lambda r: abs(r.error))
    shape = " ".join(render_flags({k: v for k, v in MODEL.items() if k != "seq_length"}))
    lines = [
        "# The CPU trainer as an oracle for the time model",
        "",
        f"Generated by `{command}` at commit {commit}{' (uncommitted changes)' if dirty else ''}"
        f" on {os.uname().nodename}, {cores()} cores, torch "
        f"{__import__('torch').__version__}, in {wall_s / 60:.1f} min; load average (1 min) "
        f"{load[0]:.2f} before, {load[1]:.2f} after.",
        "",
        f"Model: {shape}, {SEQ} tokens (unless the row says otherwise), global batch "
        f"{GLOBAL_BATCH}, micro-batch 1, fp32 (the CPU trainer's dtype), {ITERATIONS} iterations, the median of "
        f"iterations {WARMUP_ITERATIONS + 1}-{ITERATIONS} measured. Measured: the trainer's "
        "`iteration_time_s` on this machine. Predicted: the estimator (tools/estimate.py's "
        "path) with the `cpu` profile micro-benchmarked just before the row's run; nothing is "
        "fitted to the trainer."
        + (f" Rows {', '.join(carried)}: carried over from the previous cpu_oracle.json (not "
           "re-run; their profiles, commands and loads are that run's)." if carried else ""),
        "",
        f"Largest error: {worst.config} {worst.error:+.1%}; "
        f"{sum(abs(r.error) <= 0.2 for r in rows)} of {len(rows)} rows within 20%.",
        "",
        "| config | ranks x threads | measured s | predicted s | error | predicted breakdown "
        "| load before / after |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row.config}: {row.description} | {row.ranks} x {row.threads} | "
                     f"{row.measured_s:.2f} | {row.predicted_s:.2f} | {row.error:+.1%} | "
                     f"{row.breakdown} | {row.load_before:.2f} / {row.load_after:.2f} |")
    timed = [row for row in rows if row.measured_optimizer_s]
    if timed:
        lines += ["", "The optimizer step alone (the trainer's `--timing-log-level 1` "
                  "'optimizer' timer, median of the timed iterations; predicted: the breakdown's "
                  "optimizer term):", "", "| config | measured s | predicted s | error |",
                  "|---|---|---|---|"]
        lines += [f"| {row.config} | {row.measured_optimizer_s:.3f} | "
                  f"{row.step['optimizer_s']:.3f} | "
                  f"{row.step['optimizer_s'] / row.measured_optimizer_s - 1:+.1%} |"
                  for row in timed]
    lines += ["", "Profiles (per rank; peak: a 2048^3 fp32 GEMM, GFLOP/s; efficiencies: "
              "fractions of it at the layout's shapes, attention forward / backward; "
              "bandwidths GB/s):", "",
              "| config | peak | kernel efficiencies | element-wise | host copy | copy "
              "overlap | gloo collectives |", "|---|---|---|---|---|---|---|"]
    lines += [profile_line(row) for row in rows]
    lines += ["", "![measured and predicted](cpu_oracle.png)", "", "## Trainer commands", ""]
    for row in rows:
        lines += [f"{row.config} (OMP_NUM_THREADS={row.threads}):", "",
                  "```", shlex.join(row.trainer_argv), "```", ""]
    path = RESULTS / "cpu_oracle.md"
    path.write_text("\n".join(lines))
    (RESULTS / "cpu_oracle.json").write_text(json.dumps(
        [{k: v for k, v in asdict(row).items() if k != "log"} for row in rows], indent=1))

    figure, axis = plt.subplots(figsize=(9, 4.5))
    positions = range(len(rows))
    axis.bar([p - 0.2 for p in positions], [r.measured_s for r in rows], 0.4,
             label="measured (CPU trainer)")
    axis.bar([p + 0.2 for p in positions], [r.predicted_s for r in rows], 0.4,
             label="predicted (estimator, cpu profile)")
    for p, row in zip(positions, rows):
        axis.annotate(f"{row.error:+.0%}", (p + 0.2, row.predicted_s), ha="center",
                      va="bottom", fontsize=8)
    axis.set_xticks(list(positions), [r.config for r in rows])
    axis.set_ylabel("iteration time (s)")
    axis.set_title(f"GPT {MODEL['num_layers']}x{MODEL['hidden_size']}, {SEQ} tokens, "
                   f"global batch {GLOBAL_BATCH}, fp32 on {cores()} CPU cores")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(RESULTS / "cpu_oracle.png", dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None,
                        help="comma-separated configuration names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the configurations")
    parser.add_argument("--max-load", type=float, default=1.0,
                        help="wait before a row while the 1-minute load is above this")
    parser.add_argument("--wait-minutes", type=float, default=10.0,
                        help="longest wait for the load to fall, per row")
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/cpu_oracle_runs"),
                        help="the trainer's logs and metrics, one folder per row")
    opts = parser.parse_args(argv)
    if opts.list:
        for config in CONFIGS:
            print(f"{config.name}: {config.layout.describe()} ({config.description})")
        return 0
    names = [c.name for c in CONFIGS]
    wanted = names if opts.only is None else [n.strip() for n in opts.only.split(",")]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(f"cpu_oracle.py: error: --only {opts.only}: unknown {', '.join(unknown)}; use "
              f"{', '.join(names)}", file=sys.stderr)
        return 2
    command = "python bench/cpu_oracle.py" + ("" if argv is None and len(sys.argv) == 1
                                              else " " + shlex.join(sys.argv[1:]))
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    rows = []
    with TraceCache(default_cache_dir()) as cache:
        for config in (c for c in CONFIGS if c.name in wanted):
            print(f"{config.name}: {config.layout.describe()} ({config.description})",
                  flush=True)
            wait_for_quiet(opts.max_load, opts.wait_minutes, print)
            rows.append(run_config(config, cache, opts.run_dir, print))
    # With --only, the other rows are the previous report's (named in it).
    previous = RESULTS / "cpu_oracle.json"
    done = {row.config for row in rows}
    kept = [Row(**record) for record in (json.loads(previous.read_text())
                                         if opts.only and previous.exists() else [])
            if record["config"] not in done and record["config"] in names]
    rows = sorted(rows + kept, key=lambda row: names.index(row.config))
    path = write_report(rows, command, time.perf_counter() - started,
                        (load_before, os.getloadavg()[0]), tuple(row.config for row in kept))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
