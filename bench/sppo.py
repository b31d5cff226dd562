"""SPPO benchmark: device activation bytes of one pipeline stage vs. the number of subsequences N,
and the pipeline bubble with and without multiplexed sequence partitioning (MSP).

    python bench/sppo.py                    # full run, ~8 min on 2 cores
    python bench/sppo.py --quick -o /tmp/s  # smoke test, < 90 s

Section 1 (measured, one process, CPU): one stage of ``layers`` transformer layers (a gloo world
of one; a stage of a deeper pipeline saves exactly what this one saves for its layers) runs one
sequence as N subsequences through SPPO's schedule under
:class:`memo_ext.storage_tracker.DeviceMemoryTracker`; parameters and gradients are registered
first, so

    activation bytes = peak device bytes - static bytes (parameters + gradients).

Offloaded bytes go to host memory (allocated inside ``tracker.host_allocations()``) and do not
count. Beside it, docs/sppo.md's formula for the unrolled peak:

    max_i [A_i + sum_{j<i} (1 - alpha_j) A_j] + KV cache

with A_i = a * s_i, ``a`` the saved-activation bytes per token of the stage (counted once, at N=1,
with saved_tensors_hooks: unique storages, K/V excluded), and the KV cache
2 * S * kv_width * 4 bytes per layer (fp32). The measured peak also holds what the formula
leaves out: the working set of the running subsequence's backward (attention score blocks,
gradients) and the logits/loss of the last subsequence; the gap column shows it.

Section 2 (measured, 2 processes): PP=2 training jobs (torchrun of pretrain_gpt.py, 4096 tokens,
FLOPs partition, --hidden-dropout 0 as MSP needs), for every N plain SPPO and with
``--memo-sppo-msp``, two jobs each in the order plain, MSP, MSP, plain (one each with --quick).
Per mode: the median iteration time over the jobs' iterations 3.. (1-2 carry one-time costs),
each job's median, and stage 0's bubble ratio from the schedule's own clock (idle / busy of
iteration 3, printed by the trainer; with MSP the helper steps, their collective waits and the
recomputation count as busy, so it is not comparable with plain's). Beside them the simulated
bubble with equal work per subsequence (backward = 2 x forward):
``memo_ext.sppo.pipeline_bubble_ratio(2, f, b)`` (= (p-1)/N) and the same with
``tasks=plan_multiplexing(2, f)``; the simulation counts MSP's recomputation but no weight, K/V
or activation traffic, so (1 + MSP bubble) / (1 + plain bubble) is the iteration-time ratio MSP
would reach at zero communication cost. The report gives the measured ratio MSP / plain (and
its range over the pairings of MSP and plain jobs, the run-to-run noise), MSP's time beyond the
prediction, and an estimate of the bytes MSP's collectives send (:func:`msp_task_bytes`) at the
gloo broadcast bandwidth this run measures between two processes (``--gloo-probe``). CPU
processes share 2 cores (with whatever else runs: the load average is recorded), so the
measurement is noisy; on GPUs the weights and K/V move over NVLink, which the report can only
predict.

Section 3 (predicted, no run): the bubble ratio of a 7B model at 1M tokens, PP=4, with
subsequence compute times proportional to their causal FLOPs, for the FLOPs-balanced and the
equal-length partition, and for the FLOPs partition with MSP
(memo_ext.sppo.pipeline_bubble_ratio with plan_multiplexing's tasks): why the partition is by
FLOPs, and what MSP leaves of the bubble before communication.

sppo.png: section 1's bytes, the bubble ratios (sections 2 and 3: measured and predicted, plain
and MSP) and section 2's iteration-time ratio MSP / plain, measured and predicted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import MiB  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    hidden: int = 256
    heads: int = 8
    layers: int = 4
    seq: int = 2048
    vocab: int = 512
    subsequences: tuple = (1, 2, 4, 8, 16)
    bubble_subsequences: tuple = (1, 2, 4, 8)
    bubble_seq: int = 4096
    bubble_layers: int = 4
    bubble_iterations: int = 6
    #: Jobs per N and mode, run in the order plain, MSP, MSP, plain (so load drift cancels).
    bubble_repeats: int = 2


QUICK = Sizes(hidden=64, heads=4, layers=2, seq=256, subsequences=(1, 2, 4),
              bubble_subsequences=(1, 4), bubble_seq=128, bubble_iterations=4,
              bubble_repeats=1)


@dataclass
class MemoryRow:
    subsequences: int
    offload: str
    lengths: list
    activation_bytes: int
    formula_bytes: int
    kv_bytes: int
    offloaded_bytes: int
    seconds: float


class Stage:
    """The megatron world of one process and one fresh model per run."""

    def __init__(self, sizes: Sizes):
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
        from megatron.training.arguments import parse_args
        from megatron.training.initialize import initialize_megatron

        self.sizes = sizes
        self.argv = [
            "--num-layers", str(sizes.layers), "--hidden-size", str(sizes.hidden),
            "--num-attention-heads", str(sizes.heads), "--seq-length", str(sizes.seq),
            "--max-position-embeddings", str(sizes.seq), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--mock-data",
            "--vocab-size", str(sizes.vocab), "--attention-dropout", "0", "--hidden-dropout",
            "0", "--position-embedding-type", "rope",
        ]
        self.args = parse_args(self.argv, world_size=1, cuda_available=False)
        self.args.padded_vocab_size = sizes.vocab
        initialize_megatron(self.args)

    def batch(self) -> dict:
        s = self.sizes
        generator = torch.Generator().manual_seed(1)
        return {"tokens": torch.randint(0, s.vocab, (1, s.seq), generator=generator),
                "labels": torch.randint(0, s.vocab, (1, s.seq), generator=generator),
                "loss_mask": torch.ones(1, s.seq),
                "position_ids": torch.arange(s.seq)[None]}

    def run(self, subsequences: int, offload: str,
            count_saved: bool = False) -> tuple[MemoryRow, int]:
        """One sequence as ``subsequences`` through a fresh model; the row and, with
        ``count_saved``, the bytes of the unique offloadable storages autograd saved."""
        from megatron.core import tensor_parallel

        from megatron.training import gpt
        from megatron.training.arguments import core_transformer_config_from_args
        from memo_ext.config import SPPOConfig
        from memo_ext.device import CopyEngine
        from memo_ext.layer_flops import LayerFlops
        from memo_ext.sppo import SubsequencePipeline
        from memo_ext.storage_tracker import DeviceMemoryTracker

        s = self.sizes
        tracker = DeviceMemoryTracker()
        engine = CopyEngine("cpu") if offload != "none" else None
        sppo = SubsequencePipeline(
            SPPOConfig(sppo=True, sppo_subsequences=str(subsequences), sppo_offload=offload),
            seq_length=s.seq, pipeline_size=1, micro_batch_size=1, hidden_size=s.hidden,
            layer_flops=LayerFlops.of_gpt_layer(s.hidden, 4 * s.hidden, s.heads, s.heads,
                                                s.hidden // s.heads, False),
            engine=engine, bandwidth_bytes_per_s=1e9,
            host_allocation_scope=tracker.host_allocations)
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        config = core_transformer_config_from_args(self.args)
        model = gpt.model_provider(config, self.args, sppo=sppo)
        sppo.attach(model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        tracker.register_existing([t for p in model.parameters() for t in (p, p.grad)])
        static = tracker.stats()["current_device_bytes"]
        kv_bytes = 2 * s.seq * s.hidden * 4 * s.layers
        saved: dict[int, int] = {}

        def count(tensor):
            if not sppo.kept_on_device(tensor):
                saved[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
            return tensor

        start = time.perf_counter()
        with tracker, (torch.autograd.graph.saved_tensors_hooks(count, lambda t: t)
                       if count_saved else contextlib.nullcontext()):
            sppo.forward_backward(forward_step_func=gpt.forward_step,
                                  data_iterator=iter([self.batch()]), model=[model],
                                  num_microbatches=1, forward_only=False, config=config)
        seconds = time.perf_counter() - start
        records = sppo.offloader.after_iteration() if sppo.offloader else []
        if engine is not None:
            engine.close()
        boundaries = sppo.boundaries
        row = MemoryRow(subsequences, offload, [b - a for a, b in zip(boundaries, boundaries[1:])],
                        tracker.stats()["peak_device_bytes"] - static, 0, kv_bytes,
                        sum(r.offloaded_bytes for r in records), seconds)
        return row, sum(saved.values())

    def saved_bytes_per_token(self) -> float:
        """Saved-activation bytes per token of the stage at N=1: unique storages autograd
        saves, not K/V, not parameters (what SPPO's offloader may move)."""
        _, saved = self.run(1, "none", count_saved=True)
        return saved / self.sizes.seq


def formula_bytes(lengths: list[int], alphas: list[float], per_token: float, kv: int) -> int:
    """docs/sppo.md's unrolled peak: max_i [A_i + sum_{j<i}(1-alpha_j) A_j] + KV."""
    activations = [per_token * n for n in lengths]
    peak = max(activations[i] + sum((1 - alphas[j]) * activations[j] for j in range(i))
               for i in range(len(lengths)))
    return int(peak + kv)


def stage_parameters(sizes: Sizes) -> int:
    """Parameters of one PP=2 stage's transformer layers (what MSP broadcasts per task):
    QKV, projection, MLP (4h), their biases and two layer norms per layer."""
    h = sizes.hidden
    per_layer = 3 * h * h + 3 * h + h * h + h + 4 * h * h + 4 * h + 4 * h * h + h + 4 * h
    return per_layer * sizes.bubble_layers // 2


def msp_task_bytes(sizes: Sizes, lengths: list[int], index: int) -> dict:
    """Bytes a PP=2 multiplexed task of subsequence ``index`` sends, both members together
    (memo_ext.sppo.multiplex, 2 members, fp32), by kind: weights (broadcast in forward and
    backward, gradient reduce), hidden states (scatter/gather of the padded pieces: 2 in
    forward, 3 in backward), K/V per layer (all-gather in forward and recomputation, gradient
    all-reduce, earlier subsequences' cached K/V broadcast twice and their gradients reduced,
    the later subsequences' share of the own K/V broadcast). An estimate of the traffic the
    schedule simulation leaves out."""
    from memo_ext.layer_flops import LayerFlops
    from memo_ext.sppo.msp_plan import split_range

    h, four = sizes.hidden, 4
    flops = LayerFlops.of_gpt_layer(h, 4 * h, sizes.heads, sizes.heads, h // sizes.heads, False)
    begin = sum(lengths[:index])
    cuts = split_range(begin, begin + lengths[index], 2, flops)
    longest = max(b - a for a, b in zip(cuts, cuts[1:]))
    kv_piece = 2 * longest * h * four          # K and V of one padded piece
    earlier = 2 * begin * h * four             # cached K and V of the earlier subsequences
    own = 2 * lengths[index] * h * four
    per_layer = (2 * 2 * kv_piece               # all-gather, forward and recomputation
                 + 2 * 2 * kv_piece             # all-reduce of both pieces' gradients
                 + 3 * earlier + own)
    return {"weights": 3 * 4 * stage_parameters(sizes),
            "hidden": 5 * longest * h * four,
            "kv": per_layer * sizes.bubble_layers // 2}


def gloo_probe() -> None:
    """Run under torchrun with 2 processes: rank 0 prints gloo's broadcast bandwidth over
    loopback (6 and 24 MiB fp32, as MSP's weight broadcasts and K/V exchanges)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rates = []
    for mib in (6, 24):
        tensor = torch.ones(mib * MiB // 4)
        for _ in range(2):
            dist.broadcast(tensor, 0)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(10):
            dist.broadcast(tensor, 0)
        dist.barrier()
        rates.append(10 * mib * MiB / (time.perf_counter() - start))
    if dist.get_rank() == 0:
        print(f"gloo broadcast bytes/s: {min(rates):.4g}", flush=True)
    dist.destroy_process_group()


def gloo_bandwidth() -> float:
    """Bytes/s of a gloo broadcast between two local processes (the slower of two sizes)."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", str(Path(__file__).resolve()),
                             "--gloo-probe"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    match = re.search(r"gloo broadcast bytes/s: ([0-9.e+]+)", result.stdout)
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"gloo probe failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return float(match.group(1))


def pipeline_job(sizes: Sizes, count: int, msp: bool) -> dict:
    """One PP=2 training job (2 processes): iteration times and stage 0's logged bubble."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(REPO / "pretrain_gpt.py"),
               "--num-layers", str(sizes.bubble_layers), "--hidden-size", str(sizes.hidden),
               "--num-attention-heads", str(sizes.heads), "--seq-length", str(sizes.bubble_seq),
               "--max-position-embeddings", str(sizes.bubble_seq), "--micro-batch-size", "1",
               "--global-batch-size", "1", "--lr", "1e-3", "--train-iters",
               str(sizes.bubble_iterations), "--mock-data", "--vocab-size", str(sizes.vocab),
               "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1",
               "--eval-iters", "0", "--pipeline-model-parallel-size", "2", "--memo-sppo",
               "--memo-sppo-subsequences", str(count), "--memo-sppo-partition", "flops",
               *(["--memo-sppo-msp"] if msp else [])]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    times = [float(t) for t in re.findall(r"iter time \(s\): ([0-9.]+)", result.stdout)]
    match = re.search(r"bubble ratio \(iteration 3.*?\): ([0-9.]+)", result.stdout)
    if result.returncode != 0 or match is None or len(times) != sizes.bubble_iterations:
        raise RuntimeError(f"PP=2 N={count} msp={msp} run failed:\n{result.stdout[-2000:]}\n"
                           f"{result.stderr[-3000:]}")
    logged = re.search(r"with MSP, equal work: ([0-9.]+)", result.stdout)
    tasks = re.search(r"MSP: \d+ multiplexed tasks per stage pass: (.*)", result.stdout)
    lengths = re.search(r"SPPO: \d+ subsequences \(flops partition\) of ([0-9, ]+) tokens",
                        result.stdout)
    return {"iteration_seconds": times, "seconds": statistics.median(times[2:]),
            "measured": float(match.group(1)),
            "trainer_predicted": float(logged.group(1)) if logged else None,
            "tasks": tasks.group(1).strip() if tasks else None,
            "lengths": [int(n) for n in lengths.group(1).split(",")] if lengths else None,
            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
            "wall_seconds": round(wall, 1)}


def job_order(sizes: Sizes) -> list[bool]:
    """Whether each job of one N runs MSP: plain, MSP, MSP, plain, ... (load drift cancels)."""
    return ([False, True, True, False] * sizes.bubble_repeats)[:2 * sizes.bubble_repeats]


def combine_jobs(runs: list[dict]) -> dict:
    """One mode's jobs of one N: the median over all their iterations 3.., the mean of their
    logged bubbles and loads, every job kept under ``runs``."""
    first = runs[0]
    return {"seconds": statistics.median(t for r in runs for t in r["iteration_seconds"][2:]),
            "run_seconds": [r["seconds"] for r in runs],
            "measured": statistics.fmean(r["measured"] for r in runs),
            "trainer_predicted": first["trainer_predicted"], "tasks": first["tasks"],
            "lengths": first["lengths"],
            "load_before": round(statistics.fmean(r["load_before"] for r in runs), 2),
            "runs": runs}


def measured_bubbles(sizes: Sizes) -> list[dict]:
    """PP=2 runs (2 processes) of every N, plain and with MSP, beside the simulated bubbles."""
    from memo_ext.sppo import pipeline_bubble_ratio, plan_multiplexing

    rows = []
    for count in sizes.bubble_subsequences:
        forward, backward = [1.0] * count, [2.0] * count
        jobs = [(msp, pipeline_job(sizes, count, msp)) for msp in job_order(sizes)]
        plain, msp = (combine_jobs([job for flag, job in jobs if flag == wanted])
                      for wanted in (False, True))
        predicted = pipeline_bubble_ratio(2, forward, backward)
        tasks = plan_multiplexing(2, forward)
        predicted_msp = pipeline_bubble_ratio(2, forward, backward, tasks)
        traffic = [msp_task_bytes(sizes, msp["lengths"], index) for _, index in
                   (map(int, t.lstrip("s").split("+")[0].split("/"))
                    for t in msp["tasks"].split(", "))]
        rows.append({"subsequences": count, "msp_tasks": len(tasks), "plain": plain, "msp": msp,
                     "msp_traffic_bytes": {kind: sum(t[kind] for t in traffic)
                                           for kind in ("weights", "hidden", "kv")},
                     "measured": plain["measured"], "measured_msp": msp["measured"],
                     "formula": 1 / count, "predicted": predicted,
                     "predicted_msp": predicted_msp,
                     "time_ratio": msp["seconds"] / plain["seconds"],
                     "predicted_time_ratio": (1 + predicted_msp) / (1 + predicted)})
        pairs = [m / q for m in msp["run_seconds"] for q in plain["run_seconds"]]
        rows[-1]["time_ratio_range"] = [min(pairs), max(pairs)]
        rows[-1]["unmodelled_seconds"] = (msp["seconds"] - rows[-1]["predicted_time_ratio"]
                                          * plain["seconds"])
        b = rows[-1]
        print(f"PP=2 N={count}: plain {plain['seconds']:.2f} s/iter, bubble "
              f"{plain['measured']:.3f} (predicted {predicted:.3f}); MSP {msp['seconds']:.2f} "
              f"s/iter, bubble {msp['measured']:.3f} (predicted {predicted_msp:.3f}); time "
              f"ratio {b['time_ratio']:.2f} (predicted {b['predicted_time_ratio']:.2f}); load "
              f"{plain['load_before']:.1f}/{msp['load_before']:.1f}", flush=True)
    return rows


def predicted_partition_bubbles() -> list[dict]:
    """7B, 1M tokens, PP=4: bubble with compute proportional to each subsequence's FLOPs,
    without and (FLOPs partition) with MSP's tasks."""
    from memo_ext.layer_flops import LayerFlops
    from memo_ext.sppo import partition, pipeline_bubble_ratio, plan_multiplexing

    flops = LayerFlops.of_gpt_layer(4096, 11008, 32, 32, 128, swiglu=True)
    rows = []
    for count in (4, 8, 16, 32):
        row = {"subsequences": count, "formula": 3 / count}
        for how in ("flops", "length"):
            bounds = partition(1 << 20, count, how, flops, multiple_of=8)
            work = [flops.of_range(a, b) for a, b in zip(bounds, bounds[1:])]
            row[how] = pipeline_bubble_ratio(4, work, [2 * w for w in work])
            if how == "flops":
                tasks = plan_multiplexing(4, work)
                row["msp"] = pipeline_bubble_ratio(4, work, [2 * w for w in work], tasks)
                row["msp_tasks"] = len(tasks)
        rows.append(row)
    return rows


def write_report(out: Path, sizes: Sizes, memory: list[MemoryRow], per_token: float,
                 bubbles: list[dict], partitions: list[dict], seconds: float, argv,
                 bandwidth: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [
        "# SPPO: stage activation memory vs. subsequences, and the pipeline bubble",
        "",
        f"`python bench/sppo.py {' '.join(argv)}`, {seconds:.0f} s on this 2-core CPU machine. "
        "Sections 1 and 2 are measured on CPU (bytes: DeviceMemoryTracker storage bytes; "
        "times: CPU wall clock); section 3 is predicted from FLOPs, not measured.",
        "",
        f"## 1. One stage of {sizes.layers} layers, hidden {sizes.hidden}, {sizes.heads} heads, "
        f"{sizes.seq} tokens, fp32 (measured)",
        "",
        f"Formula: max_i [A_i + sum_(j<i) (1-alpha_j) A_j] + KV, with A_i = "
        f"{per_token:.0f} bytes/token x s_i (saved activations per token of this stage, counted "
        "at N=1) and KV = 2 S h 4 bytes x layers. offload 1 means alpha_i = 1 for every "
        "subsequence but the last (which is never offloaded).",
        "",
        "| N | offload | subsequence tokens | measured activation MiB | formula MiB | "
        "measured / formula | KV cache MiB | offloaded MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in memory:
        lengths = r.lengths if len(r.lengths) <= 4 else [*r.lengths[:2], "...", r.lengths[-1]]
        lines.append(f"| {r.subsequences} | {r.offload} | {', '.join(map(str, lengths))} | "
                     f"{r.activation_bytes / MiB:.1f} | {r.formula_bytes / MiB:.1f} | "
                     f"{r.activation_bytes / r.formula_bytes:.2f} | {r.kv_bytes / MiB:.1f} | "
                     f"{r.offloaded_bytes / MiB:.1f} |")
    base = {r.offload: r for r in memory if r.subsequences == 1}
    best = min((r for r in memory if r.offload != "none"), key=lambda r: r.activation_bytes,
               default=None)
    if best is not None and "none" in base:
        lines += ["", f"Largest reduction: N={best.subsequences} with offloading holds "
                      f"{best.activation_bytes / base['none'].activation_bytes:.2f}x the "
                      "activation bytes of the unsplit sequence (N=1, no offload)."]
    lines += [
        "",
        "Without offloading, every subsequence's activations stay until its backward (backward "
        "runs in reverse order), so N alone saves only the working set that scales with the "
        "subsequence (MLP intermediates, logits; the attention runs as flash tiles, which keep "
        "no score blocks); with offloading the peak falls towards A_(N-1) + KV.",
        "",
        "The gap to the formula with offloading is what it leaves out: the dK/dV accumulators "
        "of earlier subsequences (up to the KV size), the prefetched A_(i-1) during backward i, "
        "and the working set and logits of the running subsequence.",
        "",
        f"## 2. PP=2, {sizes.bubble_layers} layers, hidden {sizes.hidden}, {sizes.bubble_seq} "
        "tokens, FLOPs partition: plain SPPO vs. MSP (measured on CPU)",
        "",
        f"Each row is {2 * sizes.bubble_repeats} torchrun jobs of {sizes.bubble_iterations} "
        f"iterations (2 processes, gloo), {sizes.bubble_repeats} plain and "
        f"{sizes.bubble_repeats} MSP, run in the order "
        + ", ".join("MSP" if msp else "plain" for msp in job_order(sizes))
        + ": s/iter is the "
        "median iteration time of iterations 3.. of a mode's jobs together (in brackets each "
        "job's median), the bubble is stage 0's idle/busy of iteration 3 from the trainer's log "
        "line (mean over the mode's jobs). Predicted: the schedule "
        "simulation with equal work per subsequence, backward = 2 x forward "
        "(pipeline_bubble_ratio, with plan_multiplexing's tasks for MSP; MSP's recomputation "
        "counted, no communication); predicted time ratio = (1 + MSP bubble) / (1 + plain "
        "bubble). MSP cost beyond the model = MSP s/iter - predicted ratio x plain s/iter. "
        "MSP traffic: bytes the iteration's multiplexed tasks send (weights, hidden states, "
        "K/V; an estimate from the code's collectives, bench/sppo.py msp_task_bytes) and its "
        f"time at {bandwidth / 1e9:.1f} GB/s (a gloo broadcast between two processes over "
        "loopback, measured by this run). load = 1-minute load average before the plain / MSP "
        "jobs (mean; it includes the bench's own previous job, about 2).",
        "",
        "| N | MSP tasks | plain s/iter | MSP s/iter | MSP / plain (over job pairs) | "
        "predicted MSP / plain | "
        "MSP cost beyond the model, s/iter | MSP traffic MiB/iter (weights + hidden + K/V) | "
        f"at {bandwidth / 1e9:.1f} GB/s, s | measured bubble plain | measured bubble MSP | predicted bubble plain "
        "| predicted bubble MSP | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in bubbles:
        traffic = b["msp_traffic_bytes"]
        total = sum(traffic.values())
        lines.append(
            f"| {b['subsequences']} | {b['msp']['tasks']} | {b['plain']['seconds']:.2f} "
            f"({', '.join(f'{t:.2f}' for t in b['plain']['run_seconds'])}) | "
            f"{b['msp']['seconds']:.2f} ({', '.join(f'{t:.2f}' for t in b['msp']['run_seconds'])})"
            f" | {b['time_ratio']:.2f} ({b['time_ratio_range'][0]:.2f}-"
            f"{b['time_ratio_range'][1]:.2f}) | "
            f"{b['predicted_time_ratio']:.2f} | {b['unmodelled_seconds']:+.2f} | "
            f"{total / MiB:.0f} ({traffic['weights'] / MiB:.0f} + {traffic['hidden'] / MiB:.0f} "
            f"+ {traffic['kv'] / MiB:.0f}) | {total / bandwidth:.3f} | {b['measured']:.3f} | "
            f"{b['measured_msp']:.3f} | {b['predicted']:.3f} | {b['predicted_msp']:.3f} | "
            f"{b['plain']['load_before']:.1f} / {b['msp']['load_before']:.1f} |")
    weight_bytes = 4 * stage_parameters(sizes)
    # Faster or slower only where every pairing of an MSP job with a plain job agrees.
    verdict = "; ".join(
        f"{what} for N in {counts}" for what, counts in (
            ("MSP was faster", [b["subsequences"] for b in bubbles
                                if b["time_ratio_range"][1] < 1]),
            ("MSP was slower", [b["subsequences"] for b in bubbles
                                if b["time_ratio_range"][0] > 1]),
            ("MSP and plain SPPO were within the run-to-run noise",
             [b["subsequences"] for b in bubbles
              if b["time_ratio_range"][0] <= 1 <= b["time_ratio_range"][1]])) if counts)
    extra = [b["unmodelled_seconds"] for b in bubbles]
    transfer = [sum(b["msp_traffic_bytes"].values()) / bandwidth for b in bubbles]
    lines += [
        "",
        f"{verdict} on this machine. The simulation says MSP should bring the iteration time to "
        f"{min(b['predicted_time_ratio'] for b in bubbles):.2f}-"
        f"{max(b['predicted_time_ratio'] for b in bubbles):.2f}x plain SPPO's (its "
        "recomputation included); measured, MSP took "
        f"{min(extra):+.2f} to {max(extra):+.2f} s per iteration beyond that prediction, with "
        f"{bubbles[0]['msp_tasks']} multiplexed tasks per iteration at PP=2 (the first forward "
        "of stage 0 with stage 1's help and the last forward of stage 1 with stage 0's; each "
        "one's backward recomputes). The simulation counts no communication; MSP's traffic "
        f"alone is an estimated {min(transfer):.3f}-{max(transfer):.3f} s per iteration at "
        f"{bandwidth / 1e9:.1f} GB/s: per task the owner broadcasts its stage's layer weights "
        f"twice ({weight_bytes / MiB:.1f} MiB each) and reduces their gradients, the group "
        "all-gathers every layer's K/V of the pieces in forward and recomputation, all-reduces "
        "their gradients and moves the earlier subsequences' cached K/V, and the owner scatters "
        "and gathers the hidden states. Beyond the bytes: every collective makes both processes "
        "wait for the slower one, gloo's copies compete with the compute for the two cores, "
        "and MSP only gains where the idle stage's core is really idle; with other jobs on the "
        "machine (load column) plain SPPO's waiting process leaves its core to them, and MSP's "
        "two busy processes share the cores with them.",
        "",
        "The measured MSP bubble is not comparable with the plain one: a stage's clock counts "
        "its helper steps as busy, including their waits in collectives and the recomputation, "
        "so it drops towards 0 whether or not the iteration gets faster; the iteration time is "
        "the measure. Plain SPPO's measured bubble sits above (p-1)/N by the p2p latency and "
        "scheduling noise of two processes on two cores.",
        "",
        "On GPUs the fixed cost is much smaller: the weights and K/V move over NVLink "
        f"(hundreds of GB/s instead of {bandwidth / 1e9:.1f} GB/s), so MSP's iteration time should approach the "
        "predicted ratio. That is predicted, not measured here.",
        "",
        "## 3. 7B at 1M tokens, PP=4: FLOPs vs. length partition, and MSP (predicted)",
        "",
        "Compute per subsequence proportional to its causal FLOPs (backward = 2 x forward); "
        "bubble of the fill-drain schedule simulated with these times (pipeline_bubble_ratio). "
        "MSP column: the FLOPs partition with plan_multiplexing(4, FLOPs per subsequence)'s "
        "tasks, their recomputation counted, weight and K/V traffic not.",
        "",
        "| N | FLOPs partition | FLOPs partition + MSP | MSP tasks | length partition | "
        "(p-1)/N |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {p['subsequences']} | {p['flops']:.3f} | {p['msp']:.3f} | {p['msp_tasks']} | "
              f"{p['length']:.3f} | {p['formula']:.3f} |" for p in partitions]
    lines += [""]
    (out / "sppo.md").write_text("\n".join(lines))
    (out / "sppo.json").write_text(json.dumps(
        {"sizes": asdict(sizes), "bytes_per_token": per_token,
         "memory": [asdict(r) for r in memory], "gloo_bytes_per_s": bandwidth,
         "bubbles": bubbles,
         "partitions": partitions}, indent=1))

    from matplotlib.ticker import NullFormatter, ScalarFormatter

    figure, (left, right, ratio) = plt.subplots(1, 3, figsize=(17, 6.5))
    for offload, colour in (("none", "tab:blue"), ("1", "tab:orange")):
        rows = [r for r in memory if r.offload == offload]
        left.plot([r.subsequences for r in rows], [r.activation_bytes / MiB for r in rows],
                  "o-", color=colour, label=f"measured, offload {offload}")
        left.plot([r.subsequences for r in rows], [r.formula_bytes / MiB for r in rows], "--",
                  color=colour, label=f"formula, offload {offload}")
    left.set(xscale="log", xlabel="subsequences N", ylabel="stage activation MiB",
             title="peak activation bytes of one stage")
    counts = [b["subsequences"] for b in bubbles]
    partition_counts = [p["subsequences"] for p in partitions]
    lines_of_bubbles = [
        (counts, bubbles, "measured", "o-", "tab:blue", "PP=2 plain, measured (CPU)"),
        (counts, bubbles, "predicted", "--", "tab:blue", "PP=2 plain, predicted = (p-1)/N"),
        (counts, bubbles, "measured_msp", "o-", "tab:red",
         "PP=2 MSP, measured (CPU; helper steps count busy)"),
        (counts, bubbles, "predicted_msp", "--", "tab:red", "PP=2 MSP, predicted"),
        (partition_counts, partitions, "length", "s:", "tab:gray",
         "7B 1M PP=4 length partition (predicted)"),
        (partition_counts, partitions, "flops", "^:", "tab:green",
         "7B 1M PP=4 FLOPs partition (predicted)"),
        (partition_counts, partitions, "msp", "v:", "tab:purple",
         "7B 1M PP=4 FLOPs partition + MSP (predicted)"),
    ]
    for xs, rows, key, style, colour, label in lines_of_bubbles:
        right.plot(xs, [row[key] for row in rows], style, color=colour, label=label)
    right.set(xscale="log", xlabel="subsequences N", ylabel="idle / busy",
              title="pipeline bubble ratio")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    spread = [[b["time_ratio"] - b["time_ratio_range"][0] for b in bubbles],
              [b["time_ratio_range"][1] - b["time_ratio"] for b in bubbles]]
    ratio.errorbar(counts, [b["time_ratio"] for b in bubbles], yerr=spread, fmt="o-",
                   color="tab:red", capsize=3,
                   label="measured (CPU, gloo; bars: range over job pairs)")
    ratio.plot(counts, [b["predicted_time_ratio"] for b in bubbles], "--", color="tab:red",
               label="predicted, no communication")
    ratio.axhline(1.0, color="black", linewidth=0.8)
    ratio.set(xscale="log", xlabel="subsequences N", ylabel="MSP s/iter / plain s/iter",
              title=f"PP=2 iteration time, MSP / plain ({sizes.bubble_seq} tokens)")
    ratio.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    for axis, ticks in ((left, [r.subsequences for r in memory]),
                        (right, counts + [p["subsequences"] for p in partitions]),
                        (ratio, counts)):
        axis.set_xticks(sorted(set(ticks)))
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_formatter(NullFormatter())
    figure.tight_layout()
    figure.savefig(out / "sppo.png", dpi=120)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("-o", "--output-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--gloo-probe", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.gloo_probe:
        gloo_probe()
        return
    sizes = QUICK if options.quick else Sizes()
    options.output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    stage = Stage(sizes)
    per_token = stage.saved_bytes_per_token()
    memory = []
    for count in sizes.subsequences:
        for offload in ("none", "1"):
            row, _ = stage.run(count, offload)
            alphas = [1.0 if offload == "1" and i < count - 1 else 0.0 for i in range(count)]
            row.formula_bytes = formula_bytes(row.lengths, alphas, per_token, row.kv_bytes)
            print(f"N={count} offload {offload}: {row.activation_bytes / MiB:.1f} MiB measured, "
                  f"{row.formula_bytes / MiB:.1f} MiB formula, {row.seconds:.1f} s", flush=True)
            memory.append(row)
    bandwidth = gloo_bandwidth()
    print(f"gloo broadcast over loopback: {bandwidth / 1e9:.2f} GB/s", flush=True)
    bubbles = measured_bubbles(sizes)
    write_report(options.output_dir, sizes, memory, per_token, bubbles,
                 predicted_partition_bubbles(), time.perf_counter() - start,
                 argv if argv is not None else sys.argv[1:], bandwidth)
    print(f"wrote {options.output_dir / 'sppo.md'}")


if __name__ == "__main__":
    main()
