"""What one 7B layer needs on the device while its backward runs, in units of U, from traces of
the trainer's own modules: the attention untiled against the whole layer tiled.

    python bench/device_wall.py          # 12 traces of 4 layers at 256K tokens, ~6 min on 2 cores

U = s * h * 2 / 8 bytes: one rank's share of a layer input for 7B (h = 4096, bf16) on 8 GPUs,
1 GiB per Mi tokens. Each trace is ``tools/trace.py --model 7b --num-layers 4 --seq-length
262144`` with MEMO at alpha 0, both offloaded layers in checkpoint mode (so the two kept layers
take it too) and the MLP in 16 tiles, on the layouts of one 8-GPU node; "tiled" adds the
attention's projections in 16 tiles and its query groups in up to 8 chunks (what the
recommender's tiled layouts run), "norms in the tiles" adds --memo-tile-norms to those
(docs/tiled_mlp.md "Norms in the tiles"). The sizes at the peak are linear in s, so U figures hold at
any length. The peak's live tensors are grouped by what holds them; the model states (weights,
gradients, optimizer) and the fixed per-process constants are left out: they do not grow with
the sequence. Where the peak is not in a layer (TP=8 tiled: the embedding's backward at the
end of the step), the table says so. Writes bench/results/device_wall.md.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import commit, machine, write_atomic  # noqa: E402
from memo_ext.trace import read_trace, summarize  # noqa: E402

SEQ, HIDDEN, GPUS = 262144, 4096, 8
UNIT = SEQ * HIDDEN * 2 // GPUS
LAYOUTS = {"TP=4 CP=2": (4, 2), "TP=2 CP=4": (2, 4), "TP=1 CP=8": (1, 8), "TP=8": (8, 1)}
MODEL_STATES = ("parameter", "gradient", "optimizer")
#: The columns of each layout: the attention untiled, tiled, tiled with the norms in the tiles.
VARIANTS = ("untiled", "tiled", "norms in the tiles")
GROUPS = (
    "core attention backward (dQ/dK/dV, a chunk's ring buffers, kernel workspaces)",
    "the layer's recomputed forward (norm output, RoPE'd Q/K, V, output)",
    "the gradients on their way back (attention output, residual)",
    "the embedding's backward (its gradient all-gathered, the vocabulary mask's copy)",
    "the two rounding buffers (one layer input each)",
    "the sequence-parallel all-gather buffer (megatron's, kept)",
    "the rotary table and the rest",
)


def trace_command(tp: int, cp: int, variant: str, output: Path) -> list[str]:
    command = [sys.executable, str(REPO_ROOT / "tools" / "trace.py"), "--model", "7b",
               "--num-layers", "4", "--seq-length", str(SEQ), "--tensor-model-parallel-size",
               str(tp), "--context-parallel-size", str(cp), "--bf16",
               "--use-distributed-optimizer", "--memo-offload", "--memo-alpha", "0",
               "--memo-checkpoint-layers", "2", "--memo-mlp-tiles", "16", "--gpu", "a800", "-o",
               str(output),
               "--trainer-args=--cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked"]
    if variant != "untiled":
        chunks = min(8, 32 // tp)
        command += ["--memo-attention-projection-tiles", "16",
                    "--memo-attention-head-chunks", str(chunks)]
    if variant == "norms in the tiles":
        command.append("--memo-tile-norms")
    return command


def group_of(event: dict) -> str:
    module = event["module"] or ""
    if event["phase"] == "init":
        if module.startswith("global_memory_buffer"):
            return GROUPS[5]
        if module.startswith("decoder.layers."):
            return GROUPS[4]
        return GROUPS[6]
    if event["phase"] == "recompute":
        return GROUPS[1]
    if event["phase"] == "backward":
        if module.startswith("embedding"):
            return GROUPS[3]
        return GROUPS[0] if "core_attention" in module else GROUPS[2]
    return GROUPS[6]


def breakdown(path: Path) -> dict[str, float]:
    """U per group of the device tensors alive at the trace's peak (model states and
    per-process constants left out)."""
    trace = read_trace(path)
    peak = summarize(trace).peak_event
    live: dict[int, dict] = {}
    for event in trace.events[: peak + 1]:
        if event["action"] == "alloc":
            live[event["id"]] = event
        else:
            live.pop(event["id"], None)
    groups = dict.fromkeys(GROUPS, 0.0)
    for event in live.values():
        if event["pool"] != "device" or event["category"] in MODEL_STATES:
            continue
        if (event["module"] or "").startswith("cuBLAS workspace"):
            continue  # a constant: 32 MiB whatever the length
        groups[group_of(event)] += event["bytes"] / UNIT
    return groups


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/device_wall"))
    parser.add_argument("--reuse", action="store_true",
                        help="read the traces already in --work-dir instead of tracing again "
                             "(only while the traced code is unchanged)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench" / "results" /
                        "device_wall.md")
    opts = parser.parse_args(argv)
    opts.work_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    columns, commands = {}, []
    for name, (tp, cp) in LAYOUTS.items():
        for variant in VARIANTS:
            path = opts.work_dir / f"tp{tp}_cp{cp}_{variant.replace(' ', '_')}.jsonl.gz"
            command = trace_command(tp, cp, variant, path)
            commands.append(shlex.join([Path(command[0]).name, *command[1:]]).replace(
                str(REPO_ROOT) + "/", ""))
            if not (opts.reuse and path.exists()):
                subprocess.run(command, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
            columns[f"{name}, {variant}"] = breakdown(path)
    lines = ["# What grows with the sequence at a 7B step's device peak, in U", "",
             "Generated by `python bench/device_wall.py` "
             f"({time.time() - started:.0f} s{', traces reused' if opts.reuse else ''}) on "
             f"{machine()}, commit {commit()}. "
             "U = s·h·2/8 bytes (1 GiB per Mi tokens): linear in s, so these hold at any "
             "length. Model states and per-process constants are left out.", "",
             "| live at the peak (U) | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    for group in GROUPS:
        lines.append(f"| {group} | " + " | ".join(f"{c[group]:.2f}" for c in columns.values())
                     + " |")
    lines.append("| **total** | " + " | ".join(f"**{sum(c.values()):.2f}**"
                                               for c in columns.values()) + " |")
    lines += ["", "Commands (traces of 4 layers; the two offloaded ones and the two kept ones "
              "in checkpoint mode):", "", "```", *commands, "```", ""]
    write_atomic(opts.output, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
