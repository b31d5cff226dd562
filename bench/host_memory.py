"""The estimator's host-memory prediction beside the host bytes MEMO's offload allocates in the
real CPU trainer, per node, in four layouts; and the MEMO paper's out-of-host-memory case.

    python bench/host_memory.py                    # 7 configurations, ~10 min on 2 cores
    python bench/host_memory.py --only pp2,dp2     # some of them (--list names them; the
                                                   # others' rows are kept from the last run)

For each configuration (two ranks, this machine is the node):

1. the ``cpu`` profile is measured for the layout (memo_ext.estimate.cpu_profile, one repeat:
   only its memory side is used here) and the estimator traces the layout whole at the
   trainer's length (memo_ext.estimate.layout.build_layout_model, the path of
   ``tools/estimate.py --gpu cpu``) and predicts it (``LayoutModel.predict``). The prediction's
   host model (memo_ext.estimate.host_memory, ``Prediction.host_memory``) sums each local
   rank's own stage's slots; the column "before" is the formula it replaced, the largest
   stage's slots times the ranks of a node;
2. the trainer runs the trace's own command line (its header's ``trainer_argv``, without the
   tracer's host-capacity and bandwidth stand-ins) under torchrun for two iterations; every
   rank prints, after its first iteration, the slots its HostSlotPool holds
   (megatron/training/memo.py, ``host_slots_line``): bytes allocated, the same slots in whole
   pages (what page-locking them takes on CUDA), and the process's RSS. The measured node
   bytes are the sum over the two ranks.

The comparison is of the offload arena (the model's ``offload_arena`` term): on CPU the
slots are ordinary tensors of their bytes. The whole-pages column compares the model's CUDA
arena (page_locked=True) with the measured slots rounded to pages as CUDA's would be. Writes
bench/results/host_memory.md (and host_memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from memo_ext.estimate.cpu_profile import cpu_name, free_port, measure_cpu_profile  # noqa: E402
from memo_ext.estimate.host_memory import (  # noqa: E402
    CUDA_PROCESS_RESIDENT_BYTES,
    KERNEL_PAGE_MAP_FRACTION,
    SlotShape,
    StageSlots,
    longest_fitting_seq,
    memo_paper_host_limit,
    node_host_memory,
    optimizer_host_bytes,
)
from memo_ext.estimate.layout import Layout, TraceCache, build_layout_model  # noqa: E402
from memo_ext.estimate.models import traced_model  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
SEQ = 1024
MODEL = {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 1024,
         "num_attention_heads": 4, "vocab_size": 512, "seq_length": SEQ}
ITERATIONS = 2
#: The tracer's stand-ins for what the trainer measures (host capacity, bandwidth), and the
#: flags set here instead (each with its value).
TRACE_ONLY_FLAGS = ("--memo-host-memory-gb", "--memo-pcie-gbps", "--train-iters",
                    "--global-batch-size")
LINE = re.compile(r"^> MEMO host slots \[rank (\d+), pipeline stage (\d+), after iteration "
                  r"(\d+), alpha ([\d.]+)\]: (\d+) slots, (\d+) B allocated, (\d+) B in "
                  r"whole pages \| process RSS (\d+) B", re.M)


@dataclass(frozen=True)
class Config:
    name: str
    layout: Layout
    global_batch: int
    description: str
    num_layers: int = 4


CONFIGS = [
    Config("tp2sp", Layout(2, 1, 1, 1, "memo", 0.25), 2, "TP=2 + SP, alpha 0.25"),
    Config("cp2", Layout(1, 2, 1, 1, "memo", 0.0, checkpoint_layers=1), 2,
           "CP=2, alpha 0, 1 checkpoint-offloaded layer"),
    Config("pp2", Layout(1, 1, 2, 1, "memo", 0.5), 4,
           "PP=2, 8 layers, 4 micro-batches (2 in flight on stage 0), alpha 0.5", 8),
    Config("dp2", Layout(1, 1, 1, 2, "memo", 0.25, offload_fp8=True), 2,
           "DP=2 (two replicas), alpha 0.25, --memo-offload-fp8"),
]


#: Megatron-LM's optimizer CPU offload (issue 44): the host tensors HybridDeviceOptimizer
#: holds per rank, against the estimator's ``optimizer_offload`` term.
OFFLOAD_CONFIGS = [
    Config("dp2-opt1", Layout(1, 1, 1, 2, "megatron-none", optimizer_offload=1.0), 2,
           "DP=2, no recompute, --optimizer-offload-fraction 1.0"),
    Config("tp2sp-opt05", Layout(2, 1, 1, 1, "memo", 0.25, optimizer_offload=0.5), 2,
           "TP=2 + SP, MEMO alpha 0.25, --optimizer-offload-fraction 0.5"),
    Config("cp2-opt05", Layout(1, 2, 1, 1, "megatron-none", optimizer_offload=0.5), 2,
           "CP=2, no recompute, --optimizer-offload-fraction 0.5"),
    Config("dp2-fsdp-opt05", Layout(1, 1, 1, 2, "megatron-none", optimizer_offload=0.5,
                                    megatron_fsdp="optim_grads_params"), 2,
           "DP=2, Megatron-FSDP optim_grads_params, no recompute, "
           "--optimizer-offload-fraction 0.5"),
]
OFFLOAD_LINE = re.compile(r"> optimizer CPU offload host tensors \[rank (\d+), after iteration "
                          r"1\]: (\d+) storages, (\d+) B")


def trainer_command(trace_argv: list[str], config: Config) -> list[str]:
    argv, skip = [], False
    for flag in trace_argv:
        if skip:
            skip = False
        elif flag in TRACE_ONLY_FLAGS:
            skip = True
        else:
            argv.append(flag)
    return [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node",
            str(config.layout.gpus), "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), str(REPO_ROOT / "pretrain_gpt.py"), *argv,
            "--train-iters", str(ITERATIONS), "--global-batch-size", str(config.global_batch),
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000"]


def measure(command: list[str], run_dir: Path) -> tuple[list[dict], str]:
    """Each rank's first host-slots line (module docstring), and the log's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore::FutureWarning:torch.distributed.c10d_logger"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    log = run_dir / "train.log"
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=out,
                              stderr=subprocess.STDOUT)
    text = log.read_text()
    if done.returncode:
        raise SystemExit(f"host_memory.py: the trainer failed (status {done.returncode}); see "
                         f"{log}:\n" + "\n".join(text.strip().splitlines()[-5:]))
    ranks: dict[int, dict] = {}
    for match in LINE.finditer(text):
        rank = int(match.group(1))
        ranks.setdefault(rank, {"rank": rank, "stage": int(match.group(2)),
                                "iteration": int(match.group(3)),
                                "alpha": float(match.group(4)), "slots": int(match.group(5)),
                                "allocated": int(match.group(6)),
                                "pages": int(match.group(7)), "rss": int(match.group(8))})
    for match in OFFLOAD_LINE.finditer(text):
        rank = ranks.setdefault(int(match.group(1)), {"rank": int(match.group(1))})
        rank.update(optimizer_storages=int(match.group(2)), optimizer_bytes=int(match.group(3)))
    return [ranks[r] for r in sorted(ranks)], str(log)


def predicted_layout(config: Config, cache: TraceCache, say):
    """The estimator's model of ``config``'s layout, on this machine's measured CPU profile,
    traced whole (``exhaustive``), and its prediction at the trainer's length."""
    layout = config.layout
    model_shape = {**MODEL, "num_layers": config.num_layers}
    hardware = measure_cpu_profile(model_shape, {"tp": layout.tp, "cp": layout.cp,
                                                 "pp": layout.pp,
                                                 "micro_batch_size": layout.micro_batch},
                                   ranks=layout.gpus, repeats=1,
                                   log=lambda line: say(f"  {line}"))
    model, _ = build_layout_model(traced_model(None, model_shape), layout, hardware,
                                  cache=cache, exhaustive=True,
                                  global_batch=config.global_batch,
                                  num_layers=config.num_layers)
    return model, model.predict(SEQ)


def run_config(config: Config, cache: TraceCache, run_root: Path, say) -> dict:
    started = time.perf_counter()
    layout = config.layout
    model, prediction = predicted_layout(config, cache, say)
    host = prediction.host_memory
    stages = [StageSlots(p.stage.index, p.stage.microbatches_in_flight, p.host_slots)
              for p in prediction.stages]
    cuda = node_host_memory(tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=layout.dp,
                            stages=stages, ranks_per_node=prediction.ranks_per_node, seq=SEQ,
                            micro_batch=layout.micro_batch, page_locked=True)
    before = max(p.memory.host_bytes for p in prediction.stages) * prediction.ranks_per_node
    header = model.stages[0].at(SEQ).header
    command = trainer_command(header["trainer_argv"], config)
    say(f"  trainer: {shlex.join(command[8:])}")
    ranks, log = measure(command, run_root / config.name)
    if len(ranks) != layout.gpus:
        raise SystemExit(f"host_memory.py: {len(ranks)} host-slot lines for {layout.gpus} ranks "
                         f"in {log}")
    measured = sum(r["allocated"] for r in ranks)
    measured_pages = sum(r["pages"] for r in ranks)
    predicted = host.terms["offload_arena"]
    return {
        "config": config.name, "description": config.description, "layout": layout.describe(),
        "seq": SEQ, "ranks_per_node": prediction.ranks_per_node,
        "predicted_arena": predicted, "measured_arena": measured,
        "error": predicted / measured - 1,
        "predicted_pages": cuda.terms["offload_arena"], "measured_pages": measured_pages,
        "error_pages": cuda.terms["offload_arena"] / measured_pages - 1,
        "before": before, "error_before": before / measured - 1,
        "predicted_per_rank": host.arena_per_rank, "stage_slots": {
            p.stage.index: list(p.host_slots) for p in prediction.stages},
        "ranks": ranks, "cuda_terms": cuda.terms, "command": command[8:], "log": log,
        "wall_s": time.perf_counter() - started,
    }


def run_offload_config(config: Config, cache: TraceCache, run_root: Path, say) -> dict:
    """An OFFLOAD_CONFIGS row: the layout traced whole at the trainer's length (as
    :func:`run_config`; with --optimizer-cpu-offload the estimator traces each data-parallel
    rank's persistent state too), the trainer run for two iterations, and each rank's host
    tensors of HybridDeviceOptimizer after iteration 1 (megatron.training.optimizer_offload,
    ``host_tensors_line``: its host sub-optimizers' parameters and states and its gradient
    copies, one per storage, ``untyped_storage().nbytes()``) against the prediction's
    ``optimizer_offload`` term and each rank's own traced tensors."""
    started = time.perf_counter()
    layout = config.layout
    model, prediction = predicted_layout(config, cache, say)
    host = prediction.host_memory
    command = trainer_command(model.stages[0].at(SEQ).header["trainer_argv"], config)
    say(f"  trainer: {shlex.join(command[8:])}")
    ranks, log = measure(command, run_root / config.name)
    if sum("optimizer_bytes" in r for r in ranks) != layout.gpus:
        raise SystemExit(f"host_memory.py: not every rank printed its optimizer host tensors "
                         f"in {log}")
    per_rank = [optimizer_host_bytes(model.host_optimizer.tensors(r["rank"]), False)
                for r in ranks]
    cuda = node_host_memory(tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=layout.dp,
                            stages=[StageSlots(0, 1, ())], ranks_per_node=prediction.ranks_per_node,
                            seq=SEQ, page_locked=True,
                            optimizer_tensors=model.host_optimizer.tensors)
    measured = sum(r["optimizer_bytes"] for r in ranks)
    predicted = host.terms["optimizer_offload"]
    row = {"config": config.name, "description": config.description,
           "layout": layout.describe(), "seq": SEQ, "predicted_optimizer": predicted,
           "measured_optimizer": measured, "error": predicted / measured - 1,
           "predicted_per_rank": per_rank, "predicted_cuda": cuda.terms["optimizer_offload"],
           "ranks": ranks, "command": command[8:], "log": log}
    if layout.policy == "memo":
        row.update(measured_arena=sum(r["allocated"] for r in ranks),
                   predicted_arena=host.terms["offload_arena"])
    row["wall_s"] = time.perf_counter() - started
    return row


# -------------------------------------------------------------------------- the paper's case
PAPER_CAPACITY = 2048 * 10**9  # hardware.json's a800 node (the paper: "2 TB")
PAPER_SEQS = (1024 * 1024, 1152 * 1024)


def paper_rows() -> list[dict]:
    """docs/estimate.md's candidates for 7B on 8 A800s (TP x CP = 8, SP), alpha 0: what could
    have stopped the published MEMO, taken to allocate its slots from PyTorch's pinned
    (power-of-two, caching) allocator. Our trainer's slots are page-locked at their own size."""
    # The slot of the host model the issue found 2.3-2.6x too long (the attention output was
    # stored twice until commit db32dcc; the paper's case is about that model).
    ours = SlotShape.gpt(4096, 32, 8, attention_copies=2, statistics=True,
                         name="old model's slot (input + 2 attention-output copies + log-sum-exp)")
    paper = SlotShape.gpt(4096, 32, 8, attention_copies=1, statistics=False,
                          name="paper's table (input + attention output)")
    process = CUDA_PROCESS_RESIDENT_BYTES
    kernel = int(PAPER_CAPACITY * KERNEL_PAGE_MAP_FRACTION)
    candidates = [
        ("old model: alpha 0, exact bytes, n - 2 slots", {"pinned": False}),
        ("+ PyTorch's power-of-two pinned blocks", {}),
        ("+ a slot for all n layers", {"pinned": False, "all_layers": True}),
        ("+ 8 processes (CUDA context, 2.06 GB each) + kernel page map (1/64)",
         {"pinned": False, "process_bytes": process, "os_reserved_bytes": kernel}),
        ("power-of-two + alpha-0 arena held twice (--memo-alpha auto)", {"arena_copies": 2}),
        ("power-of-two + held twice + processes + kernel page map",
         {"arena_copies": 2, "process_bytes": process, "os_reserved_bytes": kernel}),
    ]
    rows = []
    for shape in (ours, paper):
        for name, options in candidates:
            cells = [memo_paper_host_limit(shape, seq, capacity_bytes=PAPER_CAPACITY, **options)
                     for seq in PAPER_SEQS]
            longest = longest_fitting_seq(lambda seq: memo_paper_host_limit(
                shape, seq, capacity_bytes=PAPER_CAPACITY, **options)["fits"])
            rows.append({"slots": shape.name, "candidate": name, "cells": cells,
                         "longest": longest})
    return rows


def offload_lines(rows: list[dict]) -> list[str]:
    """The markdown of the OFFLOAD_CONFIGS rows."""
    lines = ["", "## Optimizer CPU offload", "",
             "Megatron-LM's `--optimizer-cpu-offload` (megatron-core's HybridDeviceOptimizer, with "
             "`--use-distributed-optimizer --use-precision-aware-optimizer`). Measured: the host "
             "tensors each rank's HybridDeviceOptimizer holds after its first iteration (its host "
             "sub-optimizers' parameters and states, its gradient copies; one per storage, "
             "`untyped_storage().nbytes()`: the trainer's `> optimizer CPU offload host tensors` "
             "line), summed over the node's two ranks. Predicted: the `optimizer_offload` term of "
             "`Prediction.host_memory`, each rank's own traced host tensors (on CPU nothing is "
             "page-locked). The CUDA column is the same tensors with the pinned ones (the fp32 "
             "host copies and gradients) in PyTorch's power-of-two pinned blocks: predicted only.",
             "", "| config | layout | measured B/node | predicted B/node | error | rank 0 measured "
             "/ predicted | rank 1 measured / predicted | MEMO slots measured / predicted | "
             "predicted pinned-rounded (CUDA) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{rank['optimizer_bytes']:,} / {predicted:,}"
                 for rank, predicted in zip(r["ranks"], r["predicted_per_rank"])]
        memo = (f"{r['measured_arena']:,} / {r['predicted_arena']:,}"
                if "measured_arena" in r else "-")
        lines.append(f"| {r['config']} | {r['description']} | {r['measured_optimizer']:,} | "
                     f"{r['predicted_optimizer']:,} | {100 * r['error']:+.2f}% | "
                     f"{' | '.join(cells)} | {memo} | {r['predicted_cuda']:,} |")
    lines += ["", "Commands (pretrain_gpt.py's flags; torchrun --nproc-per-node 2):", ""]
    lines += [f"- {r['config']}: `{shlex.join(r['command'])}`" for r in rows]
    return lines


def write(rows: list[dict], paper: list[dict], path: Path, offload_rows: list[dict],
          carried: list[str]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                           text=True).stdout.strip()
    cpu = cpu_name()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lines = [
        "# Host memory: the estimator's prediction against the CPU trainer",
        "",
        f"`{shlex.join(['python', 'bench/host_memory.py', *sys.argv[1:]])}` at commit {commit}"
        f"{' (working tree modified)' if dirty else ''}"
        f", on {os.cpu_count()} cores ({cpu}), {memory / 2**30:.1f} GiB, Python "
        f"{platform.python_version()}. Model: GPT, hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_attention_heads']} heads, MLP {MODEL['ffn_hidden_size']}, vocabulary "
        f"{MODEL['vocab_size']}, fp32, {SEQ} tokens, micro-batch 1; two ranks on this machine "
        "(one node). Predicted: `Prediction.host_memory` (memo_ext/estimate/host_memory.py) of "
        "the layout traced whole at the trainer's length (the `--gpu cpu` path). Measured: the "
        "host slots each rank's HostSlotPool holds after its first iteration (the trainer's "
        "`> MEMO host slots` line), summed over the node's two ranks."
        + (f" Rows {', '.join(carried)}: carried over from the previous host_memory.json "
           "(not re-run; their commands and commit are that run's)." if carried else ""),
        "",
        "| config | layout | measured B/node | predicted B/node | error | before (max x ranks) "
        "| its error | measured in whole pages | predicted page-locked (CUDA) | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['config']} | {r['description']} | {r['measured_arena']:,} | "
                     f"{r['predicted_arena']:,} | {100 * r['error']:+.2f}% | {r['before']:,} | "
                     f"{100 * r['error_before']:+.1f}% | {r['measured_pages']:,} | "
                     f"{r['predicted_pages']:,} | {100 * r['error_pages']:+.2f}% |")
    lines += ["", "Per rank (measured: slots, bytes allocated, process RSS after iteration 1; "
              "predicted: the rank's own stage):", "",
              "| config | rank | stage | slots | measured B | predicted B | RSS MiB |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        for rank, predicted in zip(r["ranks"], r["predicted_per_rank"]):
            lines.append(f"| {r['config']} | {rank['rank']} | {rank['stage']} | "
                         f"{rank['slots']} | {rank['allocated']:,} | {predicted:,} | "
                         f"{rank['rss'] / 2**20:.0f} |")
    lines += ["", "Commands (pretrain_gpt.py's flags; torchrun --nproc-per-node 2):", ""]
    for r in rows:
        lines += [f"- {r['config']}: `{shlex.join(r['command'])}`"]
    lines += offload_lines(offload_rows)
    lines += ["", "## The MEMO paper's out-of-host-memory case", "",
              "7B (32 layers, hidden 4096, 32 heads), 8 ranks of TP x CP = 8 with sequence "
              f"parallelism on one node of {PAPER_CAPACITY / 1e9:.0f} GB, alpha 0, bf16 "
              "(memo_ext.estimate.host_memory.memo_paper_host_limit). The paper ran 1024K and "
              "not 1152K. GB = 1e9 B.", "",
              "| slot bytes | candidate | node GB at 1024K | fits | node GB at 1152K | fits | "
              "longest that fits |", "|---|---|---|---|---|---|---|"]
    for row in paper:
        a, b = row["cells"]
        lines.append(f"| {row['slots']} | {row['candidate']} | {a['total_bytes'] / 1e9:.0f} | "
                     f"{'yes' if a['fits'] else 'no'} | {b['total_bytes'] / 1e9:.0f} | "
                     f"{'yes' if b['fits'] else 'no'} | {row['longest'] // 1024}K |")
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps(
        {"rows": rows, "offload_rows": offload_rows, "paper": paper}, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated configuration names")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--output", default=str(RESULTS / "host_memory.md"))
    parser.add_argument("--run-dir", default="/tmp/host_memory_bench")
    opts = parser.parse_args(argv)
    if opts.list:
        for config in CONFIGS + OFFLOAD_CONFIGS:
            print(f"{config.name}: {config.description}")
        return 0
    wanted = None if opts.only is None else set(opts.only.split(","))
    configs = [c for c in CONFIGS if wanted is None or c.name in wanted]
    offload_configs = [c for c in OFFLOAD_CONFIGS if wanted is None or c.name in wanted]
    # With --only, the other rows are the previous run's (named in the markdown).
    previous = Path(opts.output).with_suffix(".json")
    earlier = json.loads(previous.read_text()) if wanted and previous.exists() else {}

    def say(line: str) -> None:
        print(line, flush=True)

    rows = []
    with TraceCache(Path(opts.run_dir) / "traces") as cache:
        for config in configs:
            say(f"{config.name}: {config.description}")
            row = run_config(config, cache, Path(opts.run_dir), say)
            say(f"  measured {row['measured_arena']:,} B, predicted {row['predicted_arena']:,} B "
                f"({100 * row['error']:+.2f}%), before {100 * row['error_before']:+.1f}%")
            rows.append(row)
        offload_rows = []
        for config in offload_configs:
            say(f"{config.name}: {config.description}")
            row = run_offload_config(config, cache, Path(opts.run_dir), say)
            say(f"  optimizer host tensors: measured {row['measured_optimizer']:,} B, predicted "
                f"{row['predicted_optimizer']:,} B ({100 * row['error']:+.2f}%)")
            offload_rows.append(row)
    checked = rows + offload_rows
    carried = []
    for key, fresh, names in (("rows", rows, CONFIGS), ("offload_rows", offload_rows,
                                                       OFFLOAD_CONFIGS)):
        done = {row["config"] for row in fresh}
        kept = [row for row in earlier.get(key, []) if row["config"] not in done]
        carried += [row["config"] for row in kept]
        order = [config.name for config in names]
        fresh[:] = sorted(fresh + kept, key=lambda row: order.index(row["config"]))
    write(rows, paper_rows(), Path(opts.output), offload_rows, carried)
    say(f"wrote {opts.output}")
    return 0 if all(abs(r["error"]) <= 0.02 for r in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
