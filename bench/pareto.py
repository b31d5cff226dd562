#!/usr/bin/env python3
"""Longest sequence against predicted MFU, per hardware: the recommender's rows, their Pareto
front, and the published points of the long-context systems on the same hardware.

Each setup is one ``tools/estimate.py --recommend --max-seq-length --json`` command, run as
a user runs it (its trace cache is the estimator's own). The recommender ranks every layout
it searched by its longest fitting sequence, then MFU, and keeps the ``--top`` rows; the
Pareto front is the rows no other row beats on both length and MFU. Every figure of ours is
**predicted** by the estimator (no GPU ran these layouts); the anchors' are published.

    python bench/pareto.py                 # all setups, ~1 h from an empty trace cache
    python bench/pareto.py --setups h100   # one setup; the others are read back from
                                           # bench/results/pareto_runs/ when there

Writes bench/results/pareto.md, pareto.png and pareto_runs/<setup>.json (the estimator's
answer and its log).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import commit, machine, write_atomic  # noqa: E402

RESULTS = REPO / "bench" / "results"
RUNS = RESULTS / "pareto_runs"
LLAMA3_8B = "examples/models/llama3_8b.json"


@dataclass(frozen=True)
class Setup:
    title: str
    argv: tuple[str, ...]  # tools/estimate.py's arguments, less --json


SETUPS = {
    "a800": Setup("GPT-7B on 8x A800 80 GB, 2 TB host memory (MEMO's hardware)",
                  ("--model", "7b", "--gpu", "a800", "--gpus", "8", "--host-memory-gb", "2048",
                   "--recommend", "--max-seq-length")),
    "h100": Setup("Llama-3-8B shape on 8x H100 80 GB, 2 TB host memory (UPipe's and ALST's "
                  "hardware)",
                  ("--model", LLAMA3_8B, "--gpu", "h100", "--gpus", "8", "--host-memory-gb",
                   "2048", "--recommend", "--max-seq-length")),
    "a100-40gb": Setup("Llama-3-8B shape on 4x A100 40 GB, 1 TB host memory (FPDT's hardware)",
                       ("--model", LLAMA3_8B, "--gpu", "a100-40gb", "--gpus", "4",
                        "--host-memory-gb", "1024", "--recommend", "--max-seq-length")),
}

#: Published single-node points (what each paper states in text; None where it gives no number).
ANCHORS = [
    {"system": "UPipe", "setup": "h100", "model": "Llama3-8B", "tokens": 5_000_000,
     "mfu": None, "source": "Ghadia et al. 2026, arXiv 2602.21196, abstract: 5M tokens, "
                            "Llama3-8B, one 8x H100 node"},
    {"system": "ALST", "setup": "h100", "model": "Llama-8B", "tokens": 3_700_000, "mfu": None,
     "source": "Bekman et al. 2025, arXiv 2506.13996, abstract: 3.7M tokens on one 8x H100 "
               "node"},
    {"system": "FPDT", "setup": "a100-40gb", "model": "8B", "tokens": 2_000_000, "mfu": 0.55,
     "mfu_text": "over 55%",
     "source": "Yao et al. 2024, arXiv 2408.16978, abstract: 2M tokens on 4 GPUs at over 55% "
               "MFU (A100 40 GB)"},
    {"system": "MEMO", "setup": "a800", "model": "GPT-7B", "tokens": 1_048_576, "mfu": 0.5230,
     "mfu_text": "52.30%",
     "source": "Zhao et al. 2025, arXiv 2407.12117, 7B on 8x A800: 1024K at 52.30% MFU"},
]


def run_setup(name: str, setup: Setup) -> dict:
    """Run one setup's estimator command; return its answer with the command and timing."""
    argv = [sys.executable, "tools/estimate.py", *setup.argv, "--json"]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise SystemExit(f"bench/pareto.py: {' '.join(argv[1:])} failed "
                         f"({done.returncode}):\n{done.stderr[-3000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    record = {"setup": name, "title": setup.title,
              "command": "python tools/estimate.py " + " ".join(setup.argv),
              "seconds": round(time.perf_counter() - started, 1),
              "ran": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "commit": commit(), "machine": machine(), "answer": answer,
              "log": [line for line in done.stderr.splitlines() if "warn" not in line.lower()]}
    RUNS.mkdir(parents=True, exist_ok=True)
    write_atomic(RUNS / f"{name}.json", json.dumps(record, indent=1) + "\n")
    return record


def pareto_front(rows: list[dict]) -> list[dict]:
    """Rows no other row beats on both length and MFU (ties on both kept once), longest first."""
    front, best_mfu = [], -1.0
    for row in sorted(rows, key=lambda r: (-r["seq"], -r["mfu"])):
        if row["mfu"] > best_mfu:
            front.append(row)
            best_mfu = row["mfu"]
    return front


def ours_against(anchor: dict, record: dict) -> str:
    rows = record["answer"]["rows"]
    if not rows:
        return "nothing fits"
    best = max(rows, key=lambda r: (r["seq"], r["mfu"]))
    ratio = best["seq"] / anchor["tokens"]
    verdict = "ahead" if ratio >= 1 else "behind"
    mfu = ""
    if anchor["mfu"] is not None:
        mfu = (f"; MFU {best['mfu']:.1%} vs {anchor['mfu_text']}: "
               f"{'ahead' if best['mfu'] >= anchor['mfu'] else 'behind'}")
    return f"{best['seq']:,} tokens, {ratio:.2f}x the published length: {verdict}{mfu}"


def markdown(records: dict[str, dict]) -> str:
    lines = ["# Longest sequence against predicted MFU, per hardware", "",
             "Generated by `python bench/pareto.py`. Every figure of ours is **predicted** by "
             "the estimator on CPU (docs/estimate.md); no GPU ran these layouts. The anchors' "
             "figures are the published ones, as their sources state them.", ""]
    for name, record in records.items():
        rows = record["answer"]["rows"]
        front = {id(r) for r in pareto_front(rows)}
        lines += [f"## {record['title']}", "",
                  f"`{record['command']}` ({record['seconds']:.0f} s, {record['ran']}, commit "
                  f"{record['commit']}, {record['machine']})", "",
                  "| # | layout | longest tokens | predicted MFU | peak GiB/GPU | host GB/node "
                  "| Pareto |", "|---|---|---|---|---|---|---|"]
        for index, row in enumerate(rows, 1):
            lines.append(f"| {index} | {row['layout']} | {row['seq']:,} | {row['mfu']:.1%} | "
                         f"{row['peak_device_gib']:.1f} | {row['host_gb_per_node']:.0f} | "
                         f"{'yes' if id(row) in front else ''} |")
        if rows:
            lines += ["", f"Best row's flags: `pretrain_gpt.py "
                          f"{' '.join(rows[0]['trainer_flags'])}`"]
        lines.append("")
    lines += ["## The published anchors on their own hardware", "",
              "| system | model | hardware | published | ours on that hardware (predicted) | "
              "source |", "|---|---|---|---|---|---|"]
    for anchor in ANCHORS:
        record = records.get(anchor["setup"])
        ours = ours_against(anchor, record) if record else "not run"
        published = f"{anchor['tokens']:,} tokens" + (
            f", {anchor['mfu_text']} MFU" if anchor["mfu"] is not None else ", MFU not stated")
        lines.append(f"| {anchor['system']} | {anchor['model']} | "
                     f"{SETUPS[anchor['setup']].title.split(',')[0].split(' on ')[1]} | "
                     f"{published} | {ours} | {anchor['source']} |")
    return "\n".join(lines) + "\n"


def plot(records: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(records), figsize=(5 * len(records), 4), squeeze=False)
    for axis, (name, record) in zip(axes[0], records.items()):
        rows = record["answer"]["rows"]
        front = pareto_front(rows)
        axis.scatter([r["seq"] / 2**20 for r in rows], [100 * r["mfu"] for r in rows],
                     s=14, color="grey", label="recommender's rows (predicted)")
        axis.plot([r["seq"] / 2**20 for r in front], [100 * r["mfu"] for r in front], "o-",
                  color="tab:blue", label="Pareto front (predicted)")
        for anchor in (a for a in ANCHORS if a["setup"] == name):
            y = 100 * anchor["mfu"] if anchor["mfu"] is not None else 45
            axis.scatter([anchor["tokens"] / 2**20], [y], marker="*", s=120, color="tab:red")
            axis.annotate(anchor["system"] + ("" if anchor["mfu"] else " (MFU n/a)"),
                          (anchor["tokens"] / 2**20, y), textcoords="offset points",
                          xytext=(4, 4), fontsize=8)
        axis.set_title(record["title"].split(" (")[0], fontsize=9)
        axis.set_xlabel("longest sequence (Mi tokens)")
        axis.set_ylabel("MFU (%)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", default=",".join(SETUPS),
                        help=f"setups to run (comma-separated of {', '.join(SETUPS)}); the "
                             "others are read from bench/results/pareto_runs/")
    opts = parser.parse_args()
    wanted = [name.strip() for name in opts.setups.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in SETUPS]
    if unknown:
        parser.error(f"--setups: unknown {', '.join(unknown)} (choose from {', '.join(SETUPS)})")
    records = {}
    for name in SETUPS:
        if name in wanted:
            print(f"bench/pareto.py: running {name} ...", flush=True)
            records[name] = run_setup(name, SETUPS[name])
        elif (RUNS / f"{name}.json").exists():
            records[name] = json.loads((RUNS / f"{name}.json").read_text())
    write_atomic(RESULTS / "pareto.md", markdown(records))
    plot(records, RESULTS / "pareto.png")
    print((RESULTS / "pareto.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
