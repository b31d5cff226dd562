"""Head + loss memory against sequence length: megatron's unfused output layer and
vocabulary-parallel cross-entropy vs memo_ext.loss's chunked one (docs/loss.md).

    python bench/loss_memory.py                      # 7B shape, TP4 CP2 bf16, 128K..1152K
    python bench/loss_memory.py --quick -o /tmp/l    # two lengths

Measured with the allocation recorder on fake tensors (tools/trace.py: the trainer's model, a
fake TP x CP world, CUDA allocation sizes, no device needed) for rank 0 of 7B's hidden size and
vocabulary at TP4 CP2 SP bf16, one transformer layer (the head sees only the last layer's output,
whose shape does not depend on the layer count). "Head + loss" is every allocation made while
the output layer or GPTModel's own code around it runs (megatron's unfused loss runs in
GPTModel._postprocess, outside any submodule), forward and backward: the peak of their live bytes,
and the largest single allocation among them. Writes loss_memory.md, .json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import GiB, seq_label  # noqa: E402
from bench.common import trace_rank  # noqa: E402

#: Modules whose allocations are the head and the loss (module names as traces record them).
HEAD_MODULES = ("output_layer", "model")
CHUNKED_FLAGS = "--cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked"
SEQS = (131072, 262144, 524288, 1048576, 1179648)
QUICK_SEQS = (131072, 1048576)


def head_allocations(trace) -> tuple[int, int]:
    """(peak live bytes, largest single allocation) of the head and the loss, forward and
    backward (and recompute)."""
    live = peak = largest = 0
    alive: dict[int, int] = {}
    for event in trace.events:
        if event["phase"] not in ("forward", "backward", "recompute"):
            continue
        if event["action"] == "alloc" and (event["module"] or "").split(".")[0] in HEAD_MODULES:
            alive[event["id"]] = event["bytes"]
            live += event["bytes"]
            peak, largest = max(peak, live), max(largest, event["bytes"])
        elif event["action"] == "free" and event["id"] in alive:
            live -= alive.pop(event["id"])
    return peak, largest


def trace_argv(tp: int, cp: int, chunked: bool) -> list[str]:
    argv = ["--model", "7b", "--num-layers", "1", "--tensor-model-parallel-size", str(tp),
            "--context-parallel-size", str(cp), "--bf16", "--use-distributed-optimizer"]
    return argv + ([f"--trainer-args={CHUNKED_FLAGS}"] if chunked else [])


def measure(seqs, tp: int, cp: int, log) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for seq in seqs:
            row = {"seq": seq}
            for name, chunked in (("unfused", False), ("chunked", True)):
                start = time.perf_counter()
                trace = trace_rank(trace_argv(tp, cp, chunked), seq, Path(workdir))
                row[f"{name}_peak"], row[f"{name}_largest"] = head_allocations(trace)
                log(f"  {seq_label(seq)} {name}: head+loss peak "
                    f"{row[f'{name}_peak'] / GiB:.2f} GiB ({time.perf_counter() - start:.1f} s)")
            rows.append(row)
    return rows


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout
    dirty = " + uncommitted changes" if git("status", "--porcelain").strip() else ""
    return git("rev-parse", "--short", "HEAD").strip() + dirty


def write_results(rows, out: Path, command: str, seconds: float, tp: int, cp: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_memory.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# Head + loss memory: unfused vs chunked",
        "",
        f"Command: `{command}` ({seconds:.0f} s). Machine: CPU only, {os.cpu_count()} cores; "
        f"commit {git_commit()}. Predicted CUDA allocation sizes from the allocation recorder on "
        f"fake tensors (tools/trace.py), rank 0 of 7B's hidden size and vocabulary (4096, "
        f"50257 padded), TP{tp} CP{cp} SP bf16, micro-batch 1. Peak: live bytes of every "
        "allocation made in the output layer and the loss, forward and backward; largest: the "
        "largest single one. Chunked: --cross-entropy-loss-fusion --cross-entropy-fusion-impl "
        "chunked with the default chunk (256 MiB of logits).",
        "",
        "| s | unfused peak GiB | chunked peak GiB | unfused / chunked | unfused largest GiB "
        "| chunked largest GiB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {seq_label(row['seq'])} | {row['unfused_peak'] / GiB:.2f} | "
            f"{row['chunked_peak'] / GiB:.2f} | {row['unfused_peak'] / row['chunked_peak']:.1f} | "
            f"{row['unfused_largest'] / GiB:.2f} | {row['chunked_largest'] / GiB:.2f} |")
    lines += ["", "The chunked peak's largest item is the [s/(CP·TP), b, h] input gradient the "
              "output layer returns (any implementation returns it); the rest is one chunk's "
              "logits and the weight gradient, independent of s.", ""]
    (out / "loss_memory.md").write_text("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 4))
    seqs = [row["seq"] // 1024 for row in rows]
    for name in ("unfused", "chunked"):
        axis.plot(seqs, [row[f"{name}_peak"] / GiB for row in rows], marker="o", label=name)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("sequence length (K tokens)")
    axis.set_ylabel("head + loss peak per rank (GiB)")
    axis.set_title(f"7B output layer + cross-entropy, TP{tp} CP{cp} bf16")
    axis.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_memory.png", dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK_SEQS}")
    parser.add_argument("--tensor-model-parallel-size", dest="tp", type=int, default=4)
    parser.add_argument("--context-parallel-size", dest="cp", type=int, default=2)
    parser.add_argument("-o", "--output", default=str(REPO / "bench" / "results"))
    opts = parser.parse_args(argv)
    start = time.perf_counter()
    rows = measure(QUICK_SEQS if opts.quick else SEQS, opts.tp, opts.cp,
                   lambda line: print(line, flush=True))
    command = "python bench/loss_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(rows, Path(opts.output), command.strip(), time.perf_counter() - start,
                  opts.tp, opts.cp)
    print((Path(opts.output) / "loss_memory.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
