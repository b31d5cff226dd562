"""Soak: does any mechanism's host memory grow over a long run? (issue 42, finding 2)

Each mechanism trains a tiny GPT on 2 CPU ranks (torchrun, gloo) for ``--iterations``
iterations. Every rank samples its own resident set size (psutil) once per iteration, at the
same point (when the trainer's logger is called for the iteration, after the step and the
mechanisms' end-of-step work). After ``--warmup`` iterations (MEMO's alpha solve, the planner's
trace and plan, allocator arenas filling) a least-squares line is fitted to each rank's RSS;
the mechanism's slope is the largest over its ranks, in MiB per iteration. The same fit over the
second half of the steady iterations tells growth that stops (a cache or allocator arena still
filling after the warm-up) from growth that goes on (a leak).

Noise floor: the plain run's steady iterations are cut into four windows and a line is fitted to
each; the floor is the largest |slope| of any window on any rank. Each row is judged by the plain
run of its own layout: ``plain`` (TP=2+SP) for the model-parallel rows, ``plain-dp2`` for the
data-parallel ones (distributed optimizer, optimizer offload, --overlap-param-gather, Megatron-FSDP). A shorter window gives a
noisier slope than the whole run, so the floor is generous: a mechanism is ``flat`` when its
whole-run slope is at most the floor; ``settling`` when it is above but its second-half slope is
within the floor; ``grows`` when both are above. (Issue 42's leak measured 0.36
MiB/iteration with MEMO alpha 1 at seq 128, 4.5-6.3 at seq 512.)

    python bench/soak.py                                   # every mechanism, 1,000 iterations
    python bench/soak.py --mechanisms plain,memo-alpha-1 --iterations 200
    python bench/soak.py --group seq512-after --mechanisms memo-alpha-1 --seq-length 512 \\
        --iterations 300                                   # a before/after pair: see --source-tree
    python bench/soak.py --render                          # rewrite soak.md/png from soak.json

Results accumulate in bench/results/soak.json (one entry per group and mechanism, written after
each run, so a bench cut short keeps what it measured) and are rendered to bench/results/soak.md
and soak.png. The default group is the soak table; any other group (e.g. a run of an older
commit with ``--source-tree``) is shown beside it as a before/after table. Each run's log and
per-rank RSS files are kept under ``--run-dir`` (runs/soak).

Under torchrun this file is also the rank's entry point (environment SOAK_RSS_DIR set): it wraps
the trainer's TrainingLogger.log to append ``iteration,seconds,rss_bytes`` to rank<r>.csv and
runs pretrain_gpt.py's main.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MiB = 1 << 20
MAIN_GROUP = "soak"
RSS_DIR_ENV = "SOAK_RSS_DIR"


# ------------------------------------------------------------------------------ the rank side

def rank_main(argv: list[str]) -> None:
    """One torchrun rank: the trainer, with its RSS sampled once per iteration."""
    import psutil

    from megatron.training import training
    from megatron.training.arguments import run_main
    import pretrain_gpt  # the entry script of --source-tree (on PYTHONPATH), any commit's

    rank = int(os.environ.get("RANK", "0"))
    samples = open(Path(os.environ[RSS_DIR_ENV]) / f"rank{rank}.csv", "w", buffering=1)
    process, start = psutil.Process(), time.perf_counter()
    log = training.TrainingLogger.log

    def sampled_log(self, iteration, *args, **kwargs):
        # Called once per iteration (log_interval or not), after the step and end_step.
        samples.write(f"{iteration},{time.perf_counter() - start:.3f},"
                      f"{process.memory_info().rss}\n")
        return log(self, iteration, *args, **kwargs)

    training.TrainingLogger.log = sampled_log
    run_main(pretrain_gpt.main, argv)


# ------------------------------------------------------------------------------ mechanisms

@dataclass(frozen=True)
class Mechanism:
    name: str
    flags: tuple[str, ...]  # "{run}" stands for the run's directory (TensorBoard, W&B files)
    layout: str  # in words, for the table
    documents: bool = False  # packed documents: data with end-of-document tokens
    # Data-parallel ranks: the global batch is this many times --global-batch-size, so that each
    # rank still runs the same micro-batches per iteration as under TP, CP or PP.
    data_parallel: int = 1
    floor: str = "plain"  # the plain row of the same layout, whose noise floor judges this one
    env: tuple[tuple[str, str], ...] = ()


TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
MEMO = (*TP2_SP, "--memo-offload", "--memo-alpha")
DISTRIBUTED_OPTIMIZER = ("--use-distributed-optimizer",)
OFFLOAD = (*DISTRIBUTED_OPTIMIZER, "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
           "--optimizer-offload-fraction")
FSDP = (*DISTRIBUTED_OPTIMIZER, "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
        "optim_grads_params", "--ckpt-format", "fsdp_dtensor")


def data_parallel(name: str, flags: tuple[str, ...]) -> Mechanism:
    """A data-parallel mechanism: 2 DP ranks, judged against plain-dp2's floor."""
    return Mechanism(name, flags, "DP=2", data_parallel=2, floor="plain-dp2")


MECHANISMS = (
    Mechanism("plain", TP2_SP, "TP=2+SP"),
    Mechanism("memo-alpha-0", (*MEMO, "0"), "TP=2+SP"),
    Mechanism("memo-alpha-1", (*MEMO, "1"), "TP=2+SP"),
    Mechanism("memo-alpha-auto", (*MEMO, "auto"), "TP=2+SP"),
    Mechanism("chunked-loss", (*TP2_SP, "--cross-entropy-loss-fusion",
                               "--cross-entropy-fusion-impl", "chunked",
                               "--cross-entropy-chunk-size", "64"), "TP=2+SP"),
    Mechanism("tiled-mlp", (*TP2_SP, "--memo-mlp-tile-size", "32"), "TP=2+SP"),
    Mechanism("tile-norms", (*TP2_SP, "--memo-mlp-tile-size", "32",
                             "--memo-attention-projection-tile-size", "32", "--memo-tile-norms"),
              "TP=2+SP"),
    Mechanism("cp-ring", ("--context-parallel-size", "2"), "CP=2 (zigzag ring)"),
    Mechanism("pp", ("--pipeline-model-parallel-size", "2"), "PP=2"),
    Mechanism("sppo", ("--pipeline-model-parallel-size", "2", "--memo-sppo",
                       "--memo-sppo-subsequences", "2", "--memo-sppo-offload", "auto"),
              "PP=2"),
    Mechanism("metp", ("--tensor-model-parallel-size", "2", "--memo-metp"), "TP=2 (METP)"),
    Mechanism("packed-documents", ("--context-parallel-size", "2", "--reset-attention-mask"),
              "CP=2", documents=True),
    Mechanism("telemetry", (*TP2_SP, "--memo-telemetry"), "TP=2+SP"),
    Mechanism("planned-arena", (*TP2_SP, "--memo-plan", "auto"), "TP=2+SP"),
    Mechanism("plain-dp2", (), "DP=2", data_parallel=2, floor="plain-dp2"),
    data_parallel("distributed-optimizer", DISTRIBUTED_OPTIMIZER),
    data_parallel("optimizer-offload-0.5", (*OFFLOAD, "0.5")),
    data_parallel("optimizer-offload-1.0", (*OFFLOAD, "1.0")),
    data_parallel("overlap-param-gather", (*DISTRIBUTED_OPTIMIZER, "--overlap-grad-reduce",
                                           "--overlap-param-gather")),
    data_parallel("megatron-fsdp", FSDP),
    data_parallel("megatron-fsdp-offload-0.5", (*FSDP, *OFFLOAD[1:], "0.5")),
    Mechanism("timers", (*TP2_SP, "--timing-log-level", "2", "--log-timers-to-tensorboard",
                         "--tensorboard-dir", "{run}/tensorboard"), "TP=2+SP"),
    Mechanism("wandb-offline", (*TP2_SP, "--wandb-project", "soak", "--wandb-save-dir",
                                "{run}/wandb"), "TP=2+SP", env=(("WANDB_MODE", "offline"),)),
    Mechanism("manual-gc", (*TP2_SP, "--manual-gc", "--manual-gc-interval", "10"), "TP=2+SP"),
    Mechanism("per-token-loss", (*TP2_SP, "--calculate-per-token-loss"), "TP=2+SP"),
    Mechanism("empty-unused-memory", (*TP2_SP, "--empty-unused-memory-level", "2"), "TP=2+SP"),
)
BY_NAME = {m.name: m for m in MECHANISMS}
FLOORS = tuple(dict.fromkeys(m.floor for m in MECHANISMS))  # the plain rows: plain, plain-dp2


def model_flags(seq_length: int, iterations: int, micro_batch: int = 1,
                global_batch: int = 2) -> list[str]:
    """The tiny model every mechanism trains: 4 layers (MEMO keeps two on device, PP=2 takes two
    per stage), hidden 64, by default micro-batch 1 and two micro-batches per iteration (the
    fewest that fill PP=2's pipeline), no dropout."""
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
            "--position-embedding-type", "rope", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--micro-batch-size", str(micro_batch),
            "--global-batch-size", str(global_batch),
            "--lr", "1e-3", "--train-iters", str(iterations), "--vocab-size", "512",
            # One log line per 100 iterations: the RSS is sampled every iteration anyway.
            "--log-interval", "100", "--eval-interval", str(iterations + 1), "--eval-iters", "0"]


def documents_data(run_dir: Path, python: str) -> list[str]:
    """Data flags of 2,000 short documents of random bytes (1-60 bytes and an end-of-document
    token each: a few documents per sample), built once under ``run_dir``."""
    prefix = run_dir / "documents" / "documents"
    if not prefix.with_suffix(".idx").exists():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        script = (
            "import sys, numpy, torch\n"
            "from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder\n"
            "prefix = sys.argv[1]\n"
            "builder = IndexedDatasetBuilder(prefix + '.bin', dtype=numpy.uint16)\n"
            "generator = torch.Generator().manual_seed(0)\n"
            "for _ in range(2000):\n"
            "    length = int(torch.randint(1, 61, (1,), generator=generator))\n"
            "    document = torch.cat([torch.randint(0, 256, (length,), generator=generator),\n"
            "                          torch.tensor([256])])\n"
            "    builder.add_document(document, [document.numel()])\n"
            "builder.finalize(prefix + '.idx')\n")
        subprocess.run([python, "-c", script, str(prefix)], check=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    return ["--data-path", str(prefix), "--tokenizer-type", "BytesTokenizer",
            "--make-vocab-size-divisible-by", "256", "--split", "100,0,0"]


# ------------------------------------------------------------------------------ analysis

def fit_slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (iteration, MiB) points, MiB per iteration."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return sxy / sxx if sxx else 0.0


def steady(points: list[tuple[int, float]], warmup: int) -> list[tuple[int, float]]:
    return [(x, y) for x, y in points if x > warmup]


def window_slopes(points: list[tuple[int, float]], windows: int = 4) -> list[float]:
    """Slopes of ``windows`` equal consecutive parts of ``points``."""
    size = len(points) // windows
    return [fit_slope(points[i * size:(i + 1) * size]) for i in range(windows) if size >= 2]


def analyse(ranks: dict[int, list[tuple[int, float]]], warmup: int) -> dict:
    """One run's figures from each rank's (iteration, RSS MiB) samples."""
    per_rank = {}
    for rank, points in sorted(ranks.items()):
        tail = steady(points, warmup)
        if len(tail) < 8:
            continue
        head_mib = sorted(y for _, y in tail[:20])[len(tail[:20]) // 2]
        end_mib = sorted(y for _, y in tail[-20:])[len(tail[-20:]) // 2]
        per_rank[rank] = {
            "slope_mib_per_iteration": fit_slope(tail),
            "second_half_slope_mib_per_iteration": fit_slope(tail[len(tail) // 2:]),
            "window_slopes": window_slopes(tail),
            "steady_start_mib": head_mib, "end_mib": end_mib,
            "growth_mib": end_mib - head_mib,
            "peak_mib": max(y for _, y in points),
        }
    if not per_rank:
        return {"per_rank": {}}
    worst = max(per_rank, key=lambda r: per_rank[r]["slope_mib_per_iteration"])
    return {"per_rank": per_rank, "worst_rank": worst,
            "slope_mib_per_iteration": per_rank[worst]["slope_mib_per_iteration"],
            "second_half_slope_mib_per_iteration": max(
                v["second_half_slope_mib_per_iteration"] for v in per_rank.values()),
            "growth_mib": max(v["growth_mib"] for v in per_rank.values()),
            "end_mib": max(v["end_mib"] for v in per_rank.values())}


def noise_floor(plain: dict) -> Optional[float]:
    """The largest |slope| of any quarter of the plain run's steady iterations, any rank."""
    slopes = [abs(s) for rank in plain.get("per_rank", {}).values()
              for s in rank["window_slopes"]]
    return max(slopes) if slopes else None


def verdict(slope: Optional[float], floor: Optional[float],
            second_half: Optional[float] = None) -> str:
    """flat, settling (above the floor, but not over the second half) or grows."""
    if slope is None:
        return "no data"
    if floor is None:
        return "no noise floor (plain not run)"
    if slope <= floor:
        return "flat"
    return "settling" if second_half is not None and second_half <= floor else "grows"


# ------------------------------------------------------------------------------ running

def read_samples(rss_dir: Path) -> dict[int, list[tuple[int, float]]]:
    ranks = {}
    for path in sorted(rss_dir.glob("rank*.csv")):
        points = []
        for line in path.read_text().splitlines():
            iteration, _seconds, rss = line.split(",")
            points.append((int(iteration), int(rss) / MiB))
        ranks[int(path.stem.removeprefix("rank"))] = points
    return ranks


def seconds_per_iteration(rss_dir: Path, warmup: int) -> Optional[float]:
    path = rss_dir / "rank0.csv"
    if not path.exists():
        return None
    rows = [line.split(",") for line in path.read_text().splitlines()]
    rows = [(int(i), float(s)) for i, s, _ in rows if int(i) > warmup]
    if len(rows) < 2:
        return None
    return (rows[-1][1] - rows[0][1]) / (rows[-1][0] - rows[0][0])


def run_mechanism(mechanism: Mechanism, opts, run_dir: Path, say) -> dict:
    rss_dir = run_dir / "rss"
    rss_dir.mkdir(parents=True, exist_ok=True)
    for stale in rss_dir.glob("rank*.csv"):
        stale.unlink()
    source = Path(opts.source_tree).resolve()
    python = sys.executable
    global_batch = opts.global_batch_size * mechanism.data_parallel
    trainer = model_flags(opts.seq_length, opts.iterations, opts.micro_batch_size, global_batch)
    trainer += [flag.replace("{run}", str(run_dir)) for flag in mechanism.flags]
    trainer += (documents_data(opts.run_dir, python) if mechanism.documents else ["--mock-data"])
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).resolve()), *trainer]
    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"PYTHONPATH": str(source), "OMP_NUM_THREADS": "1", RSS_DIR_ENV: str(rss_dir),
                "PYTHONWARNINGS": "ignore", **dict(mechanism.env)})
    say(f"{mechanism.name}: {opts.iterations} iterations ({mechanism.layout}) -> {run_dir}")
    start = time.monotonic()
    with open(run_dir / "train.log", "w") as log:
        done = subprocess.run(command, cwd=source, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    samples = read_samples(rss_dir)
    iterations = min((len(points) for points in samples.values()), default=0)
    result = {
        "mechanism": mechanism.name, "layout": mechanism.layout, "flags": list(mechanism.flags),
        "floor": mechanism.floor, "iterations": iterations,
        "requested_iterations": opts.iterations, "seq_length": opts.seq_length,
        "micro_batch_size": opts.micro_batch_size, "global_batch_size": global_batch,
        "warmup": opts.warmup, "exit_status": done.returncode,
        "wall_s": round(wall, 1),
        "seconds_per_iteration": seconds_per_iteration(rss_dir, opts.warmup),
        "source_tree": str(source), "commit": opts.source_commit or _commit(source),
        "command": ("" if source == REPO else f"(trainer from {source.name}) ")
                   + "".join(f"{key}={value} " for key, value in mechanism.env)
                   + "PYTHONPATH=. OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 "
                   "bench/soak.py " + shlex.join(trainer).replace(str(opts.run_dir), "runs/soak"),
        "series": {str(rank): [[x, round(y, 2)] for x, y in points]
                   for rank, points in samples.items()},
        **analyse(samples, opts.warmup),
    }
    slope = result.get("slope_mib_per_iteration")
    say(f"  exit {done.returncode}, {iterations} iterations in {wall:.0f} s; slope "
        f"{'-' if slope is None else f'{slope:.4f}'} MiB/iteration")
    return result


def _commit(tree: Path) -> str:
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=tree,
                         capture_output=True, text=True).stdout.strip()
    if not top or Path(top).resolve() != tree.resolve():  # e.g. a git archive under runs/
        return "unknown (not a git checkout; give --source-commit)"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree,
                          capture_output=True, text=True).stdout.strip()
    # The bench's own results change as it runs: they do not make the trainer uncommitted.
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)bench/results"], cwd=tree,
                           capture_output=True, text=True).stdout.strip()
    return head + (" + uncommitted changes" if dirty else "")


# ------------------------------------------------------------------------------ report

def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"groups": {}}


def save(data: dict, path: Path) -> None:
    temporary = path.with_suffix(".tmp")
    # Compact: the per-iteration samples (kept for --render) are most of it.
    temporary.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    temporary.replace(path)


def _fmt(value: Optional[float], digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(data: dict, md_path: Path, png_path: Path) -> None:
    groups = data["groups"]
    main = groups.get(MAIN_GROUP, {})
    # Each layout's floor comes from its own plain run (plain, plain-dp2).
    floors = {name: noise_floor(main[name]) for name in FLOORS if name in main}
    lines = ["# Soak: host memory over long runs (bench/soak.py)", "",
             "Issue 42, finding 2. Each mechanism trains a tiny GPT (4 layers, hidden 64, 4 heads, "
             "vocabulary 512, fp32, no dropout; sequence length and batch below) on "
             "2 CPU ranks over gloo. Each rank's RSS (psutil) is sampled once per iteration; a "
             "line is fitted to the iterations after the warm-up; a mechanism's slope is its "
             "steepest rank's. Noise floor: the largest |slope| of any quarter of the plain "
             "run's steady iterations on any rank (a quarter is noisier than the whole run, so "
             "the floor is generous), from the plain run of the row's layout (`plain`: TP=2+SP, "
             "`plain-dp2`: two data-parallel ranks, each running the same two micro-batches per "
             "iteration, so a global batch twice as large); **flat**: slope <= floor; **settling**: above the floor "
             "over the whole run but within it over the second half of the steady iterations "
             "(growth that stops); **grows**: above it over both.", ""]
    meta = data.get("meta", {})
    if meta:
        lines += [f"Machine: {meta.get('machine', '?')}. Written {meta.get('written', '?')}.", ""]
    if main:
        any_row = next(iter(main.values()))
        commits = sorted({row["commit"] for row in main.values()})
        lines += [f"Sequence length {any_row['seq_length']}, micro-batch "
                  f"{any_row.get('micro_batch_size', 1)}, warm-up {any_row['warmup']} "
                  f"iterations, commit{'s' if len(commits) > 1 else ''} {', '.join(commits)} "
                  "(each row's beside its command below). Noise floors: "
                  + "; ".join(f"{name} ({main[name]['layout']}, global batch "
                              f"{main[name].get('global_batch_size', 2)}) "
                              f"**{_fmt(value)} MiB/iteration**"
                              for name, value in floors.items()) + ".", "",
                  "| mechanism | layout | global batch | iterations | RSS slope (MiB/iteration) "
                  "| second half | noise floor (of) | steady growth (MiB) "
                  "| RSS at end (MiB, max rank) | s/iteration | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for mechanism in MECHANISMS:
            row = main.get(mechanism.name)
            if row is None:
                continue
            floor = floors.get(mechanism.floor)
            slope = row.get("slope_mib_per_iteration")
            second = row.get("second_half_slope_mib_per_iteration")
            status = "" if row["exit_status"] == 0 else f" (exit {row['exit_status']})"
            lines.append(
                f"| {mechanism.name} | {row['layout']} | {row.get('global_batch_size', 2)} | "
                f"{row['iterations']}{status} | {_fmt(slope)} | {_fmt(second)} | "
                f"{_fmt(floor)} ({mechanism.floor}) | "
                f"{_fmt(row.get('growth_mib'), 1)} | {_fmt(row.get('end_mib'), 0)} | "
                f"{_fmt(row.get('seconds_per_iteration'), 3)} | {verdict(slope, floor, second)} |")
        missing = [m.name for m in MECHANISMS if m.name not in main]
        if missing:
            lines += ["", f"Not run yet: {', '.join(missing)}."]
    others = {name: rows for name, rows in groups.items() if name != MAIN_GROUP}
    if others:
        lines += ["", "## Other runs (before/after pairs)", "",
                  "The noise floor of a row is that of the plain run of its layout (plain or "
                  "plain-dp2), sequence length and batch.", "",
                  "| group | mechanism | seq | micro / global batch | commit | iterations "
                  "| RSS slope (MiB/iteration) | second half | noise floor | steady growth (MiB) "
                  "| RSS at end (MiB) | s/iteration | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, rows in sorted(others.items()):
            for row in rows.values():
                row_floor = _group_floor(groups, name, row)
                slope = row.get("slope_mib_per_iteration")
                second = row.get("second_half_slope_mib_per_iteration")
                lines.append(
                    f"| {name} | {row['mechanism']} | {row['seq_length']} | "
                    f"{row.get('micro_batch_size', 1)} / {row.get('global_batch_size', 2)} | "
                    f"{row['commit']} | "
                    f"{row['iterations']} | {_fmt(slope)} | "
                    f"{_fmt(second)} | {_fmt(row_floor)} | "
                    f"{_fmt(row.get('growth_mib'), 1)} | {_fmt(row.get('end_mib'), 0)} | "
                    f"{_fmt(row.get('seconds_per_iteration'), 3)} | "
                    f"{verdict(slope, row_floor, second)} |")
    lines += ["", "Commands (from the repository root; each rank runs bench/soak.py, which wraps "
              "pretrain_gpt.py's logger to sample the RSS):", ""]
    for name, rows in sorted(groups.items()):
        for row in rows.values():
            lines.append(f"- {name} / {row['mechanism']} (commit {row['commit']}): "
                         f"`{row['command']}`")
    lines += ["", f"Plot: [soak.png]({png_path.name}) (RSS of the steepest rank, less its value "
              "at the end of the warm-up)."]
    md_path.write_text("\n".join(lines) + "\n")
    _plot(groups, png_path)


def _group_floor(groups: dict, group: str, row: dict) -> Optional[float]:
    """The noise floor of the plain run of ``row``'s layout and shape: its own group's if there
    is one (a run as long as it), else any group's."""
    plain, shape = row.get("floor", "plain"), _shape(row)
    candidates = [groups[group].get(plain)] + [rows.get(plain) for rows in groups.values()]
    return next((noise_floor(c) for c in candidates if c is not None and _shape(c) == shape),
                None)


def _shape(row: dict) -> tuple:
    return (row["seq_length"], row.get("micro_batch_size", 1), row.get("global_batch_size", 2))


def _plot(groups: dict, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One panel per noise floor (layout) of the soak table, one for the before/after pairs.
    main = groups.get(MAIN_GROUP, {})
    panels = [(f"{MAIN_GROUP}: RSS growth after warm-up (noise floor of {floor})",
               {m.name: main[m.name] for m in MECHANISMS if m.floor == floor and m.name in main})
              for floor in FLOORS]
    panels = [(title, rows) for title, rows in panels if rows] or [(MAIN_GROUP, {})]
    others = {f"{g}/{m} (seq {row['seq_length']})": row for g, rows in sorted(groups.items())
              if g != MAIN_GROUP for m, row in sorted(rows.items())}
    if others:
        panels.append(("before/after pairs", others))
    figure, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for axis, (title, rows) in zip(axes[0], panels):
        axis.set_prop_cycle(color=plt.cm.tab20.colors)  # up to 20 series: no repeated colour
        for name, row in rows.items():
            _series(axis, name, row)
        axis.set_title(title, fontsize=10)
    for axis in axes[0]:
        axis.set_xlabel("iteration")
        axis.set_ylabel("RSS - RSS at end of warm-up (MiB)")
        axis.legend(fontsize=7, ncol=2)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)
    plt.close(figure)


def _series(axis, label: str, row: dict) -> None:
    rank = str(row.get("worst_rank", 0))
    points = row["series"].get(rank) or next(iter(row["series"].values()), [])
    base = [y for x, y in points if x <= row["warmup"]]
    origin = base[-1] if base else (points[0][1] if points else 0.0)
    axis.plot([x for x, _ in points], [y - origin for _, y in points], label=label, lw=0.9)


# ------------------------------------------------------------------------------ command

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mechanisms", default=",".join(BY_NAME),
                        help=f"comma-separated subset of {', '.join(BY_NAME)}")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100,
                        help="iterations left out of the fit (default 100)")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=2,
                        help="sequences per iteration (default 2: two micro-batches)")
    parser.add_argument("--group", default=MAIN_GROUP,
                        help=f"result group (default {MAIN_GROUP}: the soak table)")
    parser.add_argument("--source-tree", default=str(REPO),
                        help="the checkout whose trainer runs (default this one; e.g. an older "
                             "commit unpacked with git archive, for a before/after pair)")
    parser.add_argument("--source-commit", default=None,
                        help="the commit --source-tree holds, for the report (read with git "
                             "when the tree is a checkout)")
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / "soak")
    parser.add_argument("--json", type=Path, default=RESULTS / "soak.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.md")
    parser.add_argument("--plot", type=Path, default=RESULTS / "soak.png")
    parser.add_argument("--render", action="store_true", help="only rewrite the report")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    opts = build_parser().parse_args(argv)
    data = load(opts.json)
    if opts.render:
        # The figures again from the stored samples (the analysis may have changed since).
        for rows in data["groups"].values():
            for row in rows.values():
                series = {int(rank): [tuple(p) for p in points]
                          for rank, points in row["series"].items()}
                row.update(analyse(series, row["warmup"]))
        save(data, opts.json)
    else:
        names = [n.strip() for n in opts.mechanisms.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            print(f"soak.py: error: unknown mechanisms {unknown}; use {list(BY_NAME)}",
                  file=sys.stderr)
            return 2
        sys.path.insert(0, str(REPO))
        from bench.common import machine

        data["meta"] = {"machine": machine(), "written": time.strftime("%Y-%m-%d %H:%M %Z")}

        def say(line: str) -> None:
            print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

        for name in names:
            run_dir = opts.run_dir / opts.group / name
            result = run_mechanism(BY_NAME[name], opts, run_dir, say)
            data["groups"].setdefault(opts.group, {})[name] = result
            save(data, opts.json)
            render(data, opts.out, opts.plot)
    render(data, opts.out, opts.plot)
    print(f"wrote {opts.out} and {opts.plot}")
    return 0


if __name__ == "__main__":
    if os.environ.get(RSS_DIR_ENV):
        # A script's own directory comes first on sys.path: bench/'s modules (sppo.py,
        # planning.py, ...) must not shadow top-level names the trainer or its libraries import.
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
        rank_main(sys.argv[1:])
    else:
        sys.exit(main())
