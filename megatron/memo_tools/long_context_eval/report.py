"""The evaluation's report: ``eval_long_context.json`` (everything, each passkey case with the
model's continuation), ``eval_long_context.md`` (the tables) and ``eval_long_context.png``
(perplexity by position; passkey accuracy by length), each written atomically."""

from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

from megatron.memo_tools.gpu_check.report import write_atomic
from megatron.memo_tools.long_context_eval.buckets import PositionLosses, position_text
from megatron.memo_tools.long_context_eval.evaluate import PasskeyOutcome

STEM = "eval_long_context"


def perplexity_record(losses: PositionLosses, settings: dict) -> dict:
    return {**settings, "buckets": [row.as_record() for row in losses.rows()],
            "overall": losses.overall().as_record()}


def _accuracy(outcomes: list[PasskeyOutcome]) -> dict:
    correct = sum(outcome.correct for outcome in outcomes)
    return {"correct": correct, "total": len(outcomes), "accuracy": correct / len(outcomes)}


def passkey_record(outcomes: list[PasskeyOutcome], generated_tokens: int, settings: dict) -> dict:
    by_length, by_cell = defaultdict(list), defaultdict(list)
    for outcome in outcomes:
        by_length[outcome.case.length].append(outcome)
        by_cell[outcome.case.length, outcome.case.depth].append(outcome)
    return {
        **settings,
        "generated_tokens": generated_tokens,
        "by_length": [{"length": length, **_accuracy(group)}
                      for length, group in by_length.items()],
        "by_length_and_depth": [{"length": length, "depth": depth, **_accuracy(group)}
                                for (length, depth), group in by_cell.items()],
        "cases": [outcome.as_record() for outcome in outcomes],
    }


def markdown(record: dict) -> str:
    lines = [f"# Long-context evaluation of {record['checkpoint']}", "",
             f"Iteration {record['iteration']}, {record['layout']}, {record['seconds']:.0f} s.", "",
             "```", record["command"], "```", ""]
    ppl = record.get("perplexity")
    if ppl:
        lines += [f"## Perplexity by position ({ppl['samples']} samples of {ppl['seq_length']} "
                  f"tokens, {ppl['split']} split, {ppl['bucket_kind']} buckets)", "",
                  "| positions | tokens | mean loss | perplexity |", "|---|---|---|---|"]
        for row in ppl["buckets"] + [{**ppl["overall"], "label": "all"}]:
            lines.append(f"| {row['label']} | {row['tokens']} | {row['mean_loss']:.4f} | "
                         f"{row['perplexity']:.3f} |")
        lines.append("")
    passkey = record.get("passkey")
    if passkey:
        depths = list(dict.fromkeys(cell["depth"] for cell in passkey["by_length_and_depth"]))
        cells = {(cell["length"], cell["depth"]): cell for cell in passkey["by_length_and_depth"]}
        lines += [f"## Passkey retrieval ({passkey['samples']} keys of {passkey['digits']} digits "
                  f"per cell, greedy, {passkey['generated_tokens']} tokens generated)", "",
                  "| length | " + " | ".join(f"depth {depth:g}" for depth in depths) + " | all |",
                  "|---|" + "---|" * (len(depths) + 1)]
        for row in passkey["by_length"]:
            shares = [f"{cells[row['length'], depth]['correct']}/"
                      f"{cells[row['length'], depth]['total']}" for depth in depths]
            lines.append(f"| {row['length']} | " + " | ".join(shares)
                         + f" | {100 * row['accuracy']:.0f}% |")
        lines.append("")
    return "\n".join(lines)


def plot(record: dict) -> bytes:
    """The PNG: one panel per measurement the record holds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [name for name in ("perplexity", "passkey") if record.get(name)]
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for axis, name in zip(axes[0], panels):
        part = record[name]
        if name == "perplexity":
            rows = part["buckets"]
            edges = [rows[0]["start"]] + [row["end"] for row in rows]
            axis.stairs([row["perplexity"] for row in rows], edges, baseline=None)
            if part["bucket_kind"] == "log2":  # linear up to the first edge: every bucket as wide
                axis.set_xscale("symlog", base=2, linthresh=edges[1])
            axis.set_xticks(edges, [position_text(edge) for edge in edges], fontsize=8)
            axis.set_xlabel("position in the sequence (tokens)")
            axis.set_ylabel("perplexity")
            axis.set_title(f"perplexity by position, {part['seq_length']} tokens")
        else:
            lengths = [row["length"] for row in part["by_length"]]
            axis.plot(lengths, [100 * row["accuracy"] for row in part["by_length"]], "o-",
                      color="black", linewidth=2, label="all depths")
            for depth in dict.fromkeys(cell["depth"] for cell in part["by_length_and_depth"]):
                cells = [cell for cell in part["by_length_and_depth"] if cell["depth"] == depth]
                axis.plot([cell["length"] for cell in cells],
                          [100 * cell["accuracy"] for cell in cells], ".--", alpha=0.6,
                          label=f"depth {depth:g}")
            axis.set_xscale("log", base=2)
            axis.set_xticks(lengths, [position_text(length) for length in lengths])
            axis.minorticks_off()
            axis.set_ylim(-5, 105)
            axis.set_xlabel("prompt length (tokens)")
            axis.set_ylabel("passkey accuracy (%)")
            axis.set_title("passkey retrieval")
            axis.legend(fontsize=8)
        axis.grid(True, alpha=0.3)
    figure.suptitle(f"{record['checkpoint']} (iteration {record['iteration']})", fontsize=9)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    plt.close(figure)
    return buffer.getvalue()


def write_report(directory: Path, record: dict) -> list[Path]:
    """The three files under ``directory``; returns their paths."""
    paths = [directory / f"{STEM}.{suffix}" for suffix in ("json", "md", "png")]
    write_atomic(paths[0], json.dumps(record, indent=2) + "\n")
    write_atomic(paths[1], markdown(record))
    write_atomic(paths[2], plot(record))
    return paths


def summary_lines(record: dict) -> list[str]:
    """What the tool prints."""
    lines = []
    ppl: Optional[dict] = record.get("perplexity")
    if ppl:
        lines.append("> perplexity by position: " + " | ".join(
            f"{row['label']} {row['perplexity']:.3f}" for row in ppl["buckets"])
            + f" | all {ppl['overall']['perplexity']:.3f}")
    passkey: Optional[dict] = record.get("passkey")
    if passkey:
        lines.append("> passkey accuracy by length: " + " | ".join(
            f"{row['length']}: {row['correct']}/{row['total']}" for row in passkey["by_length"]))
    return lines
