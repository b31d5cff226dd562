"""METP memory benchmark: measured peak activation bytes per rank of one transformer layer under
TP+SP (Megatron's layers, sequence parallel) and METP, at TP p = 2 and 4, over sequence lengths,
beside docs/metp.md's attention peak ratio r = (3+2p)/(p(4+p)).

    python bench/metp_memory.py                    # full run, a few minutes on 2 cores
    python bench/metp_memory.py --quick -o /tmp/m  # smoke test

Measured on CPU with p gloo processes (torchrun; one worker per p). Each worker builds one
Megatron TransformerLayer from the local spec with sequence parallelism (TP+SP) and one from
METP's spec (memo_ext.metp), and runs forward + backward of [s/p, 1, h] fp32 inputs through (a)
the self-attention block and (b) the whole layer under
:class:`memo_ext.storage_tracker.DeviceMemoryTracker`. Parameters, their gradients, the input
and the output gradient are registered first, so

    activation bytes = peak tracked bytes - those static bytes,

i.e. everything the block allocates: TP+SP's all-gathered sequence (Megatron's global memory
buffer is replaced by a fresh one per run so it is counted), QKV, scores' flash outputs,
reduce-scatter inputs; METP's weight double buffers, K/V ring buffers, per-head-group Q/K/V and
accumulators. The forward peak is read before backward starts; the table's ratios are METP /
TP+SP of the forward peak of the attention block, which is what docs/metp.md's r describes
(TP: bsh + 3bsh/p + bsh/p; METP: 2bsh/p + 3bsh/p^2), and of the fwd+bwd peak of the whole layer.
Values are the maximum over ranks. Dropout is 0 and there is no rotary embedding (neither
changes the bytes by more than a Q/K copy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import MiB  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    hidden: int = 256
    heads: int = 8
    tp_sizes: tuple = (2, 4)
    seqs: tuple = (256, 1024, 4096, 16384, 65536)


QUICK = Sizes(hidden=64, heads=4, seqs=(64, 512))


def spec_ratio(p: int) -> float:
    """docs/metp.md's attention peak ratio METP / TP+SP."""
    return (3 + 2 * p) / (p * (4 + p))


def spec_peaks_in_bsh_over_p(p: int) -> dict:
    """docs/metp.md's attention forward peaks in units of bsh/p: TP+SP bsh + 3bsh/p + bsh/p,
    METP 2bsh/p + 3bsh/p^2."""
    return {"tp_sp": p + 4, "metp": 2 + 3 / p}


# ------------------------------------------------------------------------------------ worker

def _measure(block, x, grad, call) -> dict:
    """Forward peak, bytes left after forward, and fwd+bwd peak of ``call(block, x)`` (bytes
    above parameters, gradients, input and output gradient)."""
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    from memo_ext.storage_tracker import DeviceMemoryTracker

    parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    params = list(block.parameters())
    for param in params:
        param.grad = torch.zeros_like(param)
    tracker = DeviceMemoryTracker()
    tracker.register_existing([x, grad] + params + [p.grad for p in params])
    static = tracker.stats()["current_device_bytes"]
    with tracker:
        out = call(block, x)
        forward_peak = tracker.stats()["peak_device_bytes"] - static
        after_forward = tracker.stats()["current_device_bytes"] - static
        out.backward(grad)
        del out
    x.grad = None
    return {"forward_peak": forward_peak, "after_forward": after_forward,
            "peak": tracker.stats()["peak_device_bytes"] - static}


def worker(sizes: Sizes, out_path: Path) -> None:
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from megatron.core.transformer.spec_utils import build_module

    from megatron.training.arguments import core_transformer_config_from_args, parse_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.layer_specs import local_layer_spec
    from memo_ext.config import METPConfig
    from memo_ext.metp import MemoryEfficientTP

    p = int(os.environ["WORLD_SIZE"])
    longest = max(sizes.seqs)
    argv = ["--num-layers", "1", "--hidden-size", str(sizes.hidden), "--num-attention-heads",
            str(sizes.heads), "--seq-length", str(longest), "--max-position-embeddings",
            str(longest), "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-3",
            "--train-iters", "1", "--mock-data", "--vocab-size", "512", "--attention-dropout",
            "0", "--hidden-dropout", "0", "--position-embedding-type", "none",
            "--tensor-model-parallel-size", str(p), "--sequence-parallel"]
    args = parse_args(argv, world_size=p, cuda_available=False)
    initialize_megatron(args)
    rank = dist.get_rank()
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = core_transformer_config_from_args(args)
    specs = {"tp_sp": local_layer_spec(args),
             "metp": MemoryEfficientTP(METPConfig(metp=True), seq_length=longest,
                                       tensor_parallel_size=p).layer_spec(local_layer_spec(args))}
    layers = {name: build_module(spec, config=config, layer_number=1)
              for name, spec in specs.items()}
    calls = {"attention": (lambda layer: layer.self_attention,
                           lambda block, x: block(x, attention_mask=None)[0]),
             "layer": (lambda layer: layer, lambda block, x: block(x, attention_mask=None)[0])}
    rows = []
    for seq in sizes.seqs:
        generator = torch.Generator().manual_seed(seq + rank)
        x = torch.randn(seq // p, 1, sizes.hidden, generator=generator).requires_grad_()
        grad = torch.randn(seq // p, 1, sizes.hidden, generator=generator)
        for block_name, (select, call) in calls.items():
            for mechanism, layer in layers.items():
                start = time.perf_counter()
                measured = _measure(select(layer), x, grad, call)
                seconds = time.perf_counter() - start
                values = torch.tensor([measured["forward_peak"], measured["after_forward"],
                                       measured["peak"]], dtype=torch.float64)
                dist.all_reduce(values, op=dist.ReduceOp.MAX)
                rows.append({"tp": p, "seq": seq, "block": block_name, "mechanism": mechanism,
                             "forward_peak": int(values[0]), "after_forward": int(values[1]),
                             "peak": int(values[2]), "seconds": seconds,
                             "bsh_over_p": seq * sizes.hidden * 4 // p})
    if rank == 0:
        out_path.write_text(json.dumps(rows))


# -------------------------------------------------------------------------------------- main

def run_workers(sizes: Sizes, quick: bool, workdir: Path) -> list[dict]:
    rows = []
    for p in sizes.tp_sizes:
        out_path = workdir / f"metp_memory_tp{p}.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={p}", str(Path(__file__).resolve()), "--worker",
                   "--worker-out", str(out_path)] + (["--quick"] if quick else [])
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")])))
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=3000)
        if result.returncode != 0:
            raise RuntimeError(f"TP={p} workers failed:\n{result.stdout[-2000:]}\n"
                               f"{result.stderr[-4000:]}")
        rows += json.loads(out_path.read_text())
    return rows


def comparisons(rows: list[dict]) -> list[dict]:
    """METP / TP+SP per (p, seq): attention forward peak, bytes left after attention forward,
    whole-layer fwd+bwd peak; beside docs/metp.md's ratios."""
    index = {(r["tp"], r["seq"], r["block"], r["mechanism"]): r for r in rows}
    result = []
    for (p, seq, block, mechanism), metp in sorted(index.items()):
        if block != "attention" or mechanism != "metp":
            continue
        tp = index[(p, seq, "attention", "tp_sp")]
        layer_metp, layer_tp = index[(p, seq, "layer", "metp")], index[(p, seq, "layer", "tp_sp")]
        result.append({
            "tp": p, "seq": seq,
            "attention_forward_peak_ratio": metp["forward_peak"] / tp["forward_peak"],
            "spec_ratio": spec_ratio(p),
            "attention_after_forward_ratio": metp["after_forward"] / tp["after_forward"],
            "spec_after_forward_ratio": 2 / 5,
            "layer_peak_ratio": layer_metp["peak"] / layer_tp["peak"],
            "attention_metp_mib": metp["forward_peak"] / MiB,
            "attention_tp_sp_mib": tp["forward_peak"] / MiB,
            "layer_metp_mib": layer_metp["peak"] / MiB,
            "layer_tp_sp_mib": layer_tp["peak"] / MiB,
            "attention_tp_sp_in_bsh_over_p": tp["forward_peak"] / tp["bsh_over_p"],
            "attention_metp_in_bsh_over_p": metp["forward_peak"] / metp["bsh_over_p"],
        })
    return result


def write_report(out: Path, sizes: Sizes, rows: list[dict], table: list[dict], seconds: float,
                 argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [
        "# METP vs TP+SP: peak activation bytes per rank of one layer",
        "",
        f"`python bench/metp_memory.py {' '.join(argv)}`, {seconds:.0f} s on this 2-core CPU "
        f"machine. Measured (DeviceMemoryTracker storage bytes, fp32, max over ranks) with p "
        f"gloo processes; hidden {sizes.hidden}, {sizes.heads} heads, batch 1, one layer. "
        "The spec columns are docs/metp.md's formulas, not measurements.",
        "",
        "| p | seq | attn fwd peak TP+SP MiB | attn fwd peak METP MiB | METP / TP+SP | "
        "spec (3+2p)/(p(4+p)) | left after attn fwd METP / TP+SP | spec 2/5 | "
        "layer fwd+bwd peak TP+SP MiB | METP MiB | METP / TP+SP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in table:
        lines.append(
            f"| {c['tp']} | {c['seq']} | {c['attention_tp_sp_mib']:.2f} | "
            f"{c['attention_metp_mib']:.2f} | {c['attention_forward_peak_ratio']:.3f} | "
            f"{c['spec_ratio']:.3f} | {c['attention_after_forward_ratio']:.3f} | 0.400 | "
            f"{c['layer_tp_sp_mib']:.2f} | {c['layer_metp_mib']:.2f} | "
            f"{c['layer_peak_ratio']:.3f} |")
    lines += [""]
    for p in sizes.tp_sizes:
        ours = [c for c in table if c["tp"] == p]
        longest = ours[-1]
        deviation = longest["attention_forward_peak_ratio"] / longest["spec_ratio"] - 1
        layer_deviation = longest["layer_peak_ratio"] / longest["spec_ratio"] - 1
        crossover = [c["seq"] for c in ours if c["layer_peak_ratio"] > 1]
        lines.append(
            f"- p={p}, {longest['seq']} tokens, against the spec's {longest['spec_ratio']:.3f}: "
            f"the whole layer's peak (forward + backward) {longest['layer_peak_ratio']:.3f} "
            f"({layer_deviation:+.1%}); the attention block's forward peak "
            f"{longest['attention_forward_peak_ratio']:.3f} ({deviation:+.1%}). "
            + (f"The layer under METP needs more than under TP+SP at "
               f"{', '.join(map(str, crossover))} tokens (its weight double buffers outweigh "
               "the sequence there)."
               if crossover else "METP needs less than TP+SP at every measured length."))
    lines += [
        "",
        "Which measured ratio the spec's r describes: docs/metp.md derives r from the attention "
        "block's intermediates, and the issue asks for the peak activation bytes per rank of "
        "one layer. Both are in the table. The whole layer's peak is the quantity a user's "
        "memory budget sees; the attention-forward ratio is the closest to r's derivation, and "
        "both mechanisms' measured attention peaks exceed their spec terms by different factors "
        "(next table), which moves it below r at p=4.",
    ]
    lines += [
        "",
        "Each mechanism against its own term in docs/metp.md (attention forward peak in units of "
        "bsh/p; spec: TP+SP p+4, METP 2+3/p):",
        "",
        "| p | seq | TP+SP measured | TP+SP spec | METP measured | METP spec |",
        "|---|---|---|---|---|---|",
    ]
    for c in table:
        spec = spec_peaks_in_bsh_over_p(c["tp"])
        lines.append(f"| {c['tp']} | {c['seq']} | {c['attention_tp_sp_in_bsh_over_p']:.2f} | "
                     f"{spec['tp_sp']:.2f} | {c['attention_metp_in_bsh_over_p']:.2f} | "
                     f"{spec['metp']:.2f} |")
    lines += [
        "",
        "Both measured peaks exceed their spec terms, by different amounts, which is why the "
        "ratio lands near the spec at p=2 but below it at p=4. Counted by construction of the "
        "code: TP+SP's peak is at linear_proj, holding the all-gathered input (bsh, Megatron's "
        "global buffer), Q/K/V (3bsh/p) and the attention output (bsh/p) saved for backward, "
        "the projection's full [s, b, h] partial sum before its reduce-scatter (bsh) and the "
        "reduce-scattered shard (bsh/p): 2bsh + 5bsh/p, i.e. 2p+5 in the table's units (9 at "
        "p=2, 13 at p=4: what is measured). The spec's TP term omits the last two. METP's peak "
        "is in the last head group: the output accumulator (bsh/p), the attention outputs of "
        "all head groups saved for backward (bsh/p: the spec's 'left after forward'), Q of the "
        "group (bsh/p^2), K/V in the ring's send and receive buffers (4bsh/p^2: the receive "
        "half is the double buffer the spec leaves out), plus tile temporaries (about bsh/p^2) "
        "and, independent of s, the weight double buffers (2 x 4h^2/p parameters) that make "
        "METP the larger one at short sequences. With these terms the expected ratio is "
        "(2/p + 5/p^2) / (2 + 5/p) = 1/p plus temporaries. The whole-layer columns add the "
        "MLP (METP's [s/p, b, f/p] per ring step vs TP+SP's gathered [s, b, h] and "
        "[s, b, f/p]) and backward (METP recomputes Q/K/V and the MLP intermediate per step "
        "and carries gradient accumulators around the ring).",
    ]
    lines += ["", "All rows (bytes):", "", "| p | seq | block | mechanism | fwd peak | "
              "left after fwd | fwd+bwd peak |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tp']} | {r['seq']} | {r['block']} | {r['mechanism']} | "
              f"{r['forward_peak']} | {r['after_forward']} | {r['peak']} |" for r in rows]
    lines.append("")
    (out / "metp_memory.md").write_text("\n".join(lines))
    (out / "metp_memory.json").write_text(json.dumps(
        {"sizes": asdict(sizes), "rows": rows, "comparison": table}, indent=1))

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, p in zip(axes, sizes.tp_sizes):
        ours = [c for c in table if c["tp"] == p]
        seqs = [c["seq"] for c in ours]
        axis.plot(seqs, [c["attention_forward_peak_ratio"] for c in ours], "o-",
                  label="attention fwd peak, measured")
        axis.plot(seqs, [c["layer_peak_ratio"] for c in ours], "s-",
                  label="whole layer fwd+bwd peak, measured")
        axis.axhline(spec_ratio(p), color="k", linestyle="--", label="spec (3+2p)/(p(4+p))")
        axis.axhline(1 / p, color="k", linestyle=":",
                     label="1/p: spec terms + those the code holds (report)")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set(xscale="log", xlabel="sequence length (tokens)", ylabel="METP / TP+SP bytes",
                 title=f"p = {p}")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "metp_memory.png", dpi=120)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("-o", "--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    sizes = QUICK if options.quick else Sizes()
    if options.worker:
        worker(sizes, options.worker_out)
        return 0
    options.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = run_workers(sizes, options.quick, options.out)
    for p in sizes.tp_sizes:
        (options.out / f"metp_memory_tp{p}.json").unlink()
    table = comparisons(rows)
    write_report(options.out, sizes, rows, table, time.perf_counter() - start, argv)
    print((options.out / "metp_memory.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
