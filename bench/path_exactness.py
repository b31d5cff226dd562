"""Exactness of the million-token path against another checkout: the losses of 20 training
iterations of a tiny GPT, per parallel layout, in this tree with the ring attention, the chunked
loss and the sequence-tiled MLP, and in a reference tree running its own default path (for
example the commit before the change: ``git worktree add /tmp/ref <commit>``).

    python bench/path_exactness.py --reference /tmp/ref [--layouts tp2_sp,cp2] [-o DIR]

Every run is pretrain_gpt.py under torchrun on CPU/gloo with --deterministic-mode and dropout 0;
both trees use this interpreter (the reference tree goes first on PYTHONPATH). Writes
``path_exactness.md`` (a table of the largest relative loss difference over the 20 iterations,
the command, machine and commits) to the output directory (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--train-iters", "20", "--mock-data", "--vocab-size", "512",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--deterministic-mode",
    "--position-embedding-type", "rope",
]
#: This tree's million-token path besides its attention (which no flag selects: it is the only
#: one): chunks and tiles smaller than the sequence, so each runs several times.
CHUNKED_LOSS = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "chunked",
                "--cross-entropy-chunk-size", "24"]
TILED_MLP = ["--memo-mlp-tile-size", "20"]


def long_context_path(layout: list[str]) -> list[str]:
    """The flags this tree adds to ``layout``: METP brings its own ring MLP (no tiling)."""
    return CHUNKED_LOSS + ([] if "--memo-metp" in layout else TILED_MLP)
#: name -> (processes, layout flags)
LAYOUTS = {
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "cp4": (4, ["--context-parallel-size", "4"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "8"]),
    "tp2_sp_memo": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--memo-offload", "--memo-alpha", "0.25"]),
    "cp2_memo": (2, ["--context-parallel-size", "2", "--memo-offload", "--memo-alpha", "0.25"]),
    "pp2_memo": (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "8",
                     "--memo-offload", "--memo-alpha", "0.25"]),
    "sppo": (2, ["--pipeline-model-parallel-size", "2", "--memo-sppo",
                 "--memo-sppo-subsequences", "4"]),
    "metp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--memo-metp"]),
}


def losses(tree: Path, nproc: int, argv: list[str]) -> dict[int, float]:
    with tempfile.TemporaryDirectory() as scratch:
        metrics = Path(scratch) / "metrics.jsonl"
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
        env["PYTHONPATH"] = str(tree)
        env.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", str(tree / "pretrain_gpt.py"), *argv,
                   "--log-metrics-jsonl", str(metrics)]
        result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                                timeout=900)
        if result.returncode != 0:
            raise SystemExit(f"error: {tree}: {' '.join(argv)} failed:\n{result.stderr[-3000:]}")
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, metrics.read_text()
                                                            .splitlines()) if "lm_loss" in r}


def commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "?"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True,
                        help="Another checkout of this repository (its own default path).")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"Comma-separated subset of {', '.join(LAYOUTS)}.")
    parser.add_argument("-o", "--output-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    opts = parser.parse_args(argv)
    if not (opts.reference / "pretrain_gpt.py").exists():
        raise SystemExit(f"error: --reference {opts.reference} has no pretrain_gpt.py; give a "
                         "checkout of this repository")
    names = opts.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"error: --layouts {','.join(unknown)} unknown; pick from "
                         f"{', '.join(LAYOUTS)}")
    rows = []
    for name in names:
        nproc, layout = LAYOUTS[name]
        reference = losses(opts.reference, nproc, TINY_GPT + layout)
        ours = losses(REPO_ROOT, nproc, TINY_GPT + layout + long_context_path(layout))
        if sorted(reference) != sorted(ours):
            raise SystemExit(f"error: {name}: iterations differ: {sorted(reference)} vs "
                             f"{sorted(ours)}")
        worst = max(abs(ours[i] - reference[i]) / abs(reference[i]) for i in reference)
        rows.append((name, nproc, reference[1], reference[20], ours[20], worst))
        print(f"{name}: largest relative difference {worst:.2e}", flush=True)
    opts.output_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Million-token path against a reference checkout", "",
        f"Command: `python bench/path_exactness.py --reference <checkout of "
        f"{commit(opts.reference)}> --layouts {opts.layouts}`; this tree at {commit(REPO_ROOT)} "
        f"(uncommitted changes included); {platform.node()} ({os.cpu_count()} CPUs), "
        "CPU/gloo, fp32, --deterministic-mode, dropout 0.", "",
        f"This tree adds `{' '.join(CHUNKED_LOSS + TILED_MLP)}` (METP: the loss flags only, it has "
        "its own ring MLP); its attention is memo_ext.attention in every run. Tiny GPT: 4 layers (8 with PP=2), hidden 64, 4 heads, 64 tokens, "
        "global batch 8, 20 iterations.", "",
        "| layout | processes | loss 1 (reference) | loss 20 (reference) | loss 20 (this tree) | "
        "largest relative difference |",
        "|---|---:|---:|---:|---:|---:|",
        *(f"| {n} | {p} | {first:.6f} | {last:.6f} | {mine:.6f} | {worst:.1e} |"
          for n, p, first, last, mine, worst in rows), ""]
    (opts.output_dir / "path_exactness.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
