"""MEMO's planned arena against PyTorch's caching allocator, on the same traces.

    python bench/planning.py                  # 7B, TP=4 CP=2, full recompute, 80 GiB: ~5 min
    python bench/planning.py --quick -o DIR   # tiny model, MiB-sized device: the smoke test

For each sequence length, rank 0's trace (tools/trace.py: fake tensors, fake process group) is
planned by memo_ext.planner (bi-level, plus the single-level placement; the smaller arena is
kept), then the persistent state and ``--iterations`` training iterations are replayed through
memo_ext.alloc's caching model and its planned-arena model (planned requests at their offsets,
everything else, i.e. parameters, gradient buffers and optimizer state, on the caching path).
Reported side by side: peak reserved, fragmentation, reorganisations in the last iteration,
OOM, the plan's gap to its lower bound and the planning time; then the longest sequence that
fits the device for each allocator (bisection over multiples of the search step).

Everything is predicted from the allocator models: no GPU is involved.

    python bench/planning.py --cuda-requests [--baseline-json OLD.json]   # ~3 min, 2 cores

does something else: the planned arena's runtime under the requests a CUDA run makes. The model
``make gpu-check`` trains (also with full recompute, and with GQA at CP=2, where a layer phase
runs several attention tiles) is traced and planned, and each trace's requests plus the ones the
CUDA attention kernels make untraced are sent through the real allocator hook on CPU
(bench/arena_requests.py); reported: the share of the plan's layer requests served at their
planned offsets (planning_cuda_requests.md / .json). ``--baseline-json``: the JSON the same mode
wrote for another checkout (the code before a change), shown beside.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import (  # noqa: E402
    GiB,
    MiB,
    PolicyRun,
    TraceCache,
    external_bytes,
    gib,
    longest_fitting,
    replay_iterations,
    seq_label,
    trace_rank,
)
from memo_ext.planner.plan import plan_trace  # noqa: E402

REPORT_MD = "planning.md"
REPORT_JSON = "planning.json"
PLOT = "planning.png"
RECOMPUTE_ARGV = ("--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1")
ALLOCATORS = ("caching", "arena")


@dataclass(frozen=True)
class Setup:
    trace_argv: tuple[str, ...]
    seqs: tuple[int, ...]
    capacity_bytes: int
    search_step: int
    search_max: int
    iterations: int = 3


FULL = Setup(trace_argv=("--model", "7b", "--tensor-model-parallel-size", "4",
                         "--context-parallel-size", "2", "--bf16", "--use-distributed-optimizer",
                         *RECOMPUTE_ARGV),
             seqs=(262144, 1048576), capacity_bytes=80 * GiB, search_step=65536,
             search_max=2097152)
QUICK = Setup(trace_argv=("--num-layers", "4", "--hidden-size", "256", "--num-attention-heads",
                          "4", "--ffn-hidden-size", "1024", "--vocab-size", "2048",
                          "--untie-embeddings-and-output-weights",
                          "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                          "--cuda-context-mib", "4", "--nccl-mib-per-communicator", "2",
                          *RECOMPUTE_ARGV),
              seqs=(2048, 8192), capacity_bytes=160 * MiB, search_step=2048, search_max=16384)


@dataclass
class PlanStats:
    seq: int
    arena_bytes: int
    lower_bound: int
    gap: float
    chosen: str
    bi_level_arena_bytes: int
    level1_worst_gap: float
    level1_unproven_worst_gap: float  # over level-1 blocks the MIP did not prove optimal
    level2_gap: float
    seconds: float


class Planned:
    """Plans by sequence length, made once each."""

    def __init__(self, traces: TraceCache, log):
        self.traces, self.log = traces, log
        self.plans: dict[int, object] = {}
        self.stats: dict[int, PlanStats] = {}

    def __getitem__(self, seq: int):
        if seq not in self.plans:
            start = time.perf_counter()
            plan = plan_trace(self.traces[seq])
            seconds = time.perf_counter() - start
            self.plans[seq] = plan
            self.stats[seq] = PlanStats(
                seq, plan.arena_bytes, plan.iteration_lower_bound, plan.iteration_gap,
                plan.chosen, plan.bi_level_arena_bytes,
                max(level["gap"] for level in plan.level1),
                max((level["gap"] for level in plan.level1 if level["status"] != "Optimal"),
                    default=0.0),
                plan.level2.gap, seconds)
            self.log(f"  planned seq {seq}: arena {gib(plan.arena_bytes)} GiB ({plan.chosen}), "
                     f"gap {plan.iteration_gap:.2%}, {seconds:.1f} s")
        return self.plans[seq]


def run(planned: Planned, allocator: str, seq: int, setup: Setup) -> PolicyRun:
    trace = planned.traces[seq]
    plan = planned[seq] if allocator == "arena" else None
    result, _, _ = replay_iterations(trace, allocator, setup.capacity_bytes, setup.iterations,
                                     plan=plan)
    return result


def report(setup: Setup, runs: list[PolicyRun], stats: dict, longest: dict, probes: dict,
           argv: list[str], seconds: float, external: int) -> list[str]:
    command = " ".join(["python bench/planning.py", *(shlex.quote(a) for a in argv)])
    lines = [
        "# Planned arena vs caching allocator", "",
        "Predicted, not measured on a GPU: rank 0's trace (tools/trace.py, fake tensors) planned "
        "by memo_ext.planner and replayed through memo_ext.alloc's caching and planned-arena "
        f"models. Machine: {os.cpu_count()} CPU cores ({platform.machine()}).", "",
        f"Command: `{command}` (total {seconds:.0f} s)", "",
        f"Trace: `tools/trace.py {' '.join(setup.trace_argv)}`. Device: "
        f"{setup.capacity_bytes / GiB:g} GiB less {external / GiB:.2f} GiB outside the allocator "
        f"(CUDA context, NCCL); the persistent state once, then {setup.iterations} iterations. "
        "The arena holds the planned requests (every activation, workspace and activation "
        "gradient of the iteration); parameters, gradient buffers and optimizer state stay on "
        "the caching path in both columns.", "",
        "## Plans", "",
        "| seq | arena GiB | lower bound GiB | gap | kept | bi-level arena GiB | worst level-1 gap"
        " | level-2 gap | planning s |", "|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for seq in sorted(stats):
        s = stats[seq]
        lines.append(f"| {seq_label(seq)} | {gib(s.arena_bytes)} | {gib(s.lower_bound)} | "
                     f"{s.gap:.2%} | {s.chosen} | {gib(s.bi_level_arena_bytes)} | "
                     f"{s.level1_worst_gap:.2%} | {s.level2_gap:.2%} | {s.seconds:.1f} |")
    lines += ["", "## Side by side", "",
              "| seq | allocator | peak allocated GiB | peak reserved GiB | fragmentation | "
              "reorganisations / iteration | arena fallbacks | OOM |",
              "|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        lines.append(f"| {seq_label(r.seq)} | {r.policy} | {gib(r.peak_allocated_bytes)} | "
                     f"{gib(r.peak_reserved_bytes)} | {r.fragmentation:.1%} | "
                     f"{r.reorganisations_last_iteration} | "
                     f"{r.arena_fallbacks if r.policy == 'arena' else '-'} | "
                     f"{'yes' if r.oom else 'no'} |")
    lines += ["", "## Longest sequence that fits", "",
              f"Bisection over multiples of {seq_label(setup.search_step)} up to "
              f"{seq_label(setup.search_max)}.", "",
              "| allocator | longest sequence | probes (y fits / n OOM) |", "|---|---:|---|"]
    for allocator in ALLOCATORS:
        shown = ", ".join(f"{seq_label(p.seq)}:{'y' if p.fits else 'n'}" for p in probes[allocator])
        lines.append(f"| {allocator} | {seq_label(longest[allocator])} | {shown} |")
    lines += ["", "Notes:", "",
              "- Fragmentation of the arena column counts the caching path too (parameters, "
              "optimizer state: one segment each, nearly no waste), so the arena's own waste is "
              "its plan's gap.",
              "- The planned arena is sized once and never grows or shrinks, so it cannot "
              "reorganise; a request the plan did not foresee (none here) would take the caching "
              "path and be counted as a fallback."]
    return lines


def plot(out_dir: Path, runs: list[PolicyRun]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r.seq for r in runs})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.38
    for i, allocator in enumerate(ALLOCATORS):
        values = [next(r for r in runs if r.seq == s and r.policy == allocator)
                  for s in seqs]
        xs = [x + (i - 0.5) * width for x in range(len(seqs))]
        ax.bar(xs, [v.peak_reserved_bytes / GiB for v in values], width,
               label=f"{allocator}: peak reserved")
    allocated = [next(r for r in runs if r.seq == s).peak_allocated_bytes / GiB for s in seqs]
    ax.plot(range(len(seqs)), allocated, "k_", markersize=40, label="peak allocated")
    ax.axhline(runs[0].allocator_capacity_bytes / GiB, color="red", linestyle=":",
               label="allocator capacity")
    ax.set_xticks(range(len(seqs)), [seq_label(s) for s in seqs])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("GiB (rank 0)")
    ax.set_title("Planned arena vs caching allocator (predicted by the allocator models)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / PLOT, dpi=110)
    plt.close(fig)


# ------------------------------------------------------- the arena under CUDA's requests
CUDA_REQUESTS_MD = "planning_cuda_requests.md"
CUDA_REQUESTS_JSON = "planning_cuda_requests.json"
#: megatron/memo_tools/gpu_check/plan.py's ModelSettings as tools/trace.py flags (micro-batch 1;
#: the trace holds one micro-batch, the replay repeats it).
GPU_CHECK_MODEL = ("--num-layers", "4", "--hidden-size", "512", "--ffn-hidden-size", "2048",
                   "--num-attention-heads", "8", "--vocab-size", "4096",
                   "--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
                   "--micro-batch-size", "1")
CUDA_REQUEST_SETUPS = {
    "gpu-check model": GPU_CHECK_MODEL,
    "+ full recompute": (*GPU_CHECK_MODEL, *RECOMPUTE_ARGV),
    "+ GQA (2 groups), CP=2": (*GPU_CHECK_MODEL, "--num-query-groups", "2",
                               "--context-parallel-size", "2"),
}
CUDA_REQUESTS_SEQ = 4096
CUDA_REQUESTS_ITERATIONS = 4  # the check's 4 micro-batches per iteration
#: The arena's counters per iteration of the one H100 run (bench/results/gpu_check_h100.md).
H100_PER_ITERATION = {"size_mismatches": 96, "overlaps": 96, "beyond_plan": 368,
                      "unplanned": 320}
REFUSALS = ("size_mismatches", "overlaps", "beyond_plan", "unplanned")


def cuda_request_runs(workdir: Path, log) -> list[dict]:
    """Each setup traced, planned and replayed through the hook with each kernel path."""
    from bench.arena_requests import (
        KERNELS,
        build_fake_runtime,
        cuda_requests,
        load_fake_runtime,
        replay_through_hooks,
    )

    load_fake_runtime(build_fake_runtime(workdir))
    runs = []
    for number, (name, trace_argv) in enumerate(CUDA_REQUEST_SETUPS.items()):
        directory = workdir / f"setup{number}"
        directory.mkdir()
        trace = trace_rank(list(trace_argv), CUDA_REQUESTS_SEQ, directory)
        plan = plan_trace(trace)
        for kernels in KERNELS:
            requests = cuda_requests(trace, kernels, CUDA_REQUESTS_ITERATIONS)
            r = replay_through_hooks(plan, requests, kernels)
            runs.append({"setup": name, "trace_argv": list(trace_argv), "kernels": kernels,
                         "planned": r.planned, "at_plan": r.at_plan, "share": r.share,
                         "untraced_zero": r.untraced_zero, "untraced_small": r.untraced_small,
                         "zero_byte_non_null": r.zero_byte_non_null,
                         **{k: r.stats[k] for k in ("served", "resyncs", *REFUSALS)}})
            log(f"  {name}, {kernels}: {r.at_plan}/{r.planned} at their planned offsets "
                f"({r.share:.2%})")
    return runs


def cuda_request_report(runs: list[dict], baseline: Optional[dict], argv: list[str],
                        seconds: float) -> list[str]:
    command = " ".join(["python bench/planning.py", *(shlex.quote(a) for a in argv)])
    n = CUDA_REQUESTS_ITERATIONS
    lines = [
        "# The planned arena under the requests a CUDA run makes", "",
        "Measured on CPU, through the real allocator hook (memo_ext._C's memo_arena_malloc / "
        "memo_arena_free, called as PyTorch's CUDAPluggableAllocator calls them, against "
        "csrc/standalone/fake_cuda_runtime.c): rank 0's trace of each setup (tools/trace.py, "
        f"{CUDA_REQUESTS_SEQ} tokens) planned by memo_ext.planner, then its requests for "
        f"{n} micro-batches with, inserted where the kernels make them, the ones the CUDA "
        "attention kernels make that no trace records (bench/arena_requests.py, UNTRACED): per "
        "tile_forward the empty debug mask p, per tile_backward torch's empty no_rng (the "
        "16-byte rng_state, torch's 8-byte _unused and the backward workspaces are in the "
        "trace, recorded by its CUDA rules). Each request's layer phase is opened first, as ArenaPhaseTagger does before "
        "each op. No GPU: what a kernel allocates besides these is not modelled (item 8 of issue "
        f"42, the fake rules' drift). Machine: {os.cpu_count()} CPU cores ({platform.machine()}).",
        "", f"Command: `{command}` (total {seconds:.0f} s)", "",
        "Share: the plan's layer requests (traced requests the plan places in the arena) that "
        "the hook served at their planned address. Refusals: the arena's counters over all "
        f"{n} micro-batches (requests sent to the stream-ordered pool).", "",
    ]
    columns = [("this checkout", {(r["setup"], r["kernels"]): r for r in runs})]
    if baseline:
        lines += [f"The \"before\" rows: this mode run on the code before ({baseline.get('label')}"
                  "; bench/arena_requests.py, this file and the fake runtime copied into it), "
                  "its JSON given with --baseline-json.", ""]
        columns.insert(0, (f"before ({baseline.get('label', 'baseline')})",
                           {(r["setup"], r["kernels"]): r for r in baseline["runs"]}))
    lines += ["| setup | kernels | code | at planned offsets | share | resyncs | size mismatches"
              " | overlaps | beyond plan | unplanned | zero-byte requests given an address |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        for label, by_key in columns:
            row = by_key.get((r["setup"], r["kernels"]))
            if row is None:
                continue
            lines.append(
                f"| {r['setup']} | {r['kernels']} | {label} | {row['at_plan']} / "
                f"{row['planned']} | {row['share']:.2%} | {row['resyncs']} | "
                + " | ".join(str(row[k]) for k in REFUSALS)
                + f" | {row['zero_byte_non_null']} / {row['untraced_zero']} |")
    lowest = min(r["share"] for r in runs)
    lines += ["", f"Lowest share in this checkout: {lowest:.2%} (the acceptance bar is 99%).", "",
              "Reading the refusals: *unplanned* counts the requests the plan itself leaves to "
              "the normal allocator (tensors that outlive their layer phase, entry -1), so with "
              "the plan kept they are exactly the plan's -1 entries; *size mismatches* in this "
              "checkout are few-byte requests the plan did not place (the kernels' RNG state is "
              "traced since the CUDA rules record it), refused without using up a position; "
              "zero-byte requests get a null pointer and "
              "never reach the arena. Before, each untraced request took the next entry "
              "(zero bytes were rounded to 512), so every later request of its phase met the "
              "entry planned for the one before it: overlaps with blocks still live, requests "
              "beyond the table's end, and resyncs.", "",
              "For comparison, the one H100 run (bench/results/gpu_check_h100.md: the gpu-check "
              "model, torch's flash kernels, a plan recorded on the GPU) counted per iteration "
              "(4 micro-batches) "
              + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in H100_PER_ITERATION.items())
              + ": the same kinds of refusal as the replay of the code before the fix, of "
              "similar counts (its plan came from a recording on the GPU, not from the tracer). "
              "Its 320 unplanned are the figure the replay counts with the plan kept.",
              "", "Setups (tools/trace.py flags):", ""]
    lines += [f"- {name}: `{' '.join(argv_)}`" for name, argv_ in CUDA_REQUEST_SETUPS.items()]
    return lines


def cuda_requests_main(cli, argv: list[str]) -> dict:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memo_cuda_requests_") as workdir:
        runs = cuda_request_runs(Path(workdir), log=lambda line: print(line, flush=True))
    seconds = time.perf_counter() - started
    baseline = json.loads(cli.baseline_json.read_text()) if cli.baseline_json else None
    payload = {"label": cli.label, "argv": argv, "seconds": seconds,
               "iterations": CUDA_REQUESTS_ITERATIONS, "seq": CUDA_REQUESTS_SEQ, "runs": runs}
    (cli.output_dir / CUDA_REQUESTS_JSON).write_text(json.dumps(payload, indent=1))
    lines = cuda_request_report(runs, baseline, argv, seconds)
    (cli.output_dir / CUDA_REQUESTS_MD).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return payload


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model (the smoke test)")
    parser.add_argument("-o", "--output-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--seqs", type=int, nargs="+", default=None)
    parser.add_argument("--skip-search", action="store_true",
                        help="skip the longest-sequence search")
    parser.add_argument("--cuda-requests", action="store_true",
                        help="the arena's runtime under a CUDA run's requests (module docstring)")
    parser.add_argument("--baseline-json", type=Path, default=None,
                        help="--cuda-requests: another checkout's JSON, shown beside")
    parser.add_argument("--label", default=None,
                        help="--cuda-requests: what this checkout is, for a later --baseline-json")
    cli = parser.parse_args(argv)
    cli.output_dir.mkdir(parents=True, exist_ok=True)
    if cli.cuda_requests:
        return cuda_requests_main(cli, argv)
    setup = QUICK if cli.quick else FULL
    if cli.seqs:
        setup = replace(setup, seqs=tuple(sorted(cli.seqs)))
    started = time.perf_counter()

    def log(line: str) -> None:
        print(line, flush=True)

    with tempfile.TemporaryDirectory(prefix="memo_planning_") as workdir:
        traces = TraceCache(list(setup.trace_argv), Path(workdir), log)
        planned = Planned(traces, log)
        runs = []
        for seq in setup.seqs:
            for allocator in ALLOCATORS:
                r = run(planned, allocator, seq, setup)
                runs.append(r)
                log(f"  seq {seq} {allocator:8s}: reserved {gib(r.peak_reserved_bytes)} GiB, "
                    f"fragmentation {r.fragmentation:.1%}, reorganisations "
                    f"{r.reorganisations_last_iteration}, OOM {r.oom}")
        longest, probes = {}, {a: [] for a in ALLOCATORS}
        for allocator in ALLOCATORS:
            if cli.skip_search:
                longest[allocator] = 0
                continue

            def fits(seq: int) -> bool:
                r = run(planned, allocator, seq, setup)
                probes[allocator].append(r)
                return r.fits

            longest[allocator] = longest_fitting(fits, setup.search_step, setup.search_max)
            log(f"  {allocator}: longest sequence {longest[allocator]}")
        external = external_bytes(traces[setup.seqs[0]])
        stats = dict(planned.stats)
    seconds = time.perf_counter() - started
    lines = report(setup, runs, stats, longest, probes, argv, seconds, external)
    (cli.output_dir / REPORT_MD).write_text("\n".join(lines) + "\n")
    payload = {"setup": asdict(setup), "argv": argv, "seconds": seconds,
               "runs": [asdict(r) for r in runs],
               "plans": {str(k): asdict(v) for k, v in stats.items()},
               "longest_seq": longest,
               "probes": {a: [asdict(r) for r in rs] for a, rs in probes.items()}}
    (cli.output_dir / REPORT_JSON).write_text(json.dumps(payload, indent=1))
    plot(cli.output_dir, runs)
    print("\n".join(lines))
    return payload


if __name__ == "__main__":
    main()
