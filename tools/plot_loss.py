"""Plot training (and validation) loss curves from --log-metrics-jsonl files.

    python tools/plot_loss.py runs/demo/metrics.jsonl -o runs/demo/loss.png
    python tools/plot_loss.py a.jsonl b.jsonl -o compare.png --labels baseline memo

Each input file becomes one curve: the ``lm_loss`` of its training records against
``iteration``, plus its ``validation_lm_loss`` records as markers of the same colour. Lines
that are not JSON objects are skipped. A missing file, or one without any loss record, is an
error: one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

# tools/ is not a package: make the repository root importable like the other tools do.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TRAIN_KEY = "lm_loss"
VALIDATION_KEY = "validation_lm_loss"


class MetricsError(Exception):
    """A metrics file that cannot be plotted; the message names the file."""


@dataclass
class LossCurves:
    """The loss points of one metrics file, in file order."""

    train: list[tuple[int, float]] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)


def read_loss_curves(path: Path) -> LossCurves:
    """Training and validation (iteration, loss) points of one JSON-lines metrics file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise MetricsError(f"{path}: no such file") from None
    except OSError as error:
        raise MetricsError(f"{path}: cannot read ({error.strerror or error})") from None
    curves = LossCurves()
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
            continue
        for key, points in ((TRAIN_KEY, curves.train), (VALIDATION_KEY, curves.validation)):
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                points.append((record["iteration"], float(value)))
    if not curves.train and not curves.validation:
        raise MetricsError(
            f"{path}: no '{TRAIN_KEY}' or '{VALIDATION_KEY}' records (empty or not a "
            "--log-metrics-jsonl file)"
        )
    return curves


def plot_loss_curves(curves: list[tuple[str, LossCurves]], output: Path, title: str) -> None:
    """Draw one line (training) and one marker series (validation) per labelled curve set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for label, curve in curves:
        color = None
        if curve.train:
            iterations, losses = zip(*curve.train)
            (line,) = axes.plot(iterations, losses, label=f"{label} (train)")
            color = line.get_color()
        if curve.validation:
            iterations, losses = zip(*curve.validation)
            axes.plot(iterations, losses, linestyle="none", marker="o", color=color,
                      label=f"{label} (validation)")
    axes.set_title(title)
    axes.set_xlabel("iteration")
    axes.set_ylabel("LM loss (cross-entropy, nats/token)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120)
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plot_loss.py",
        description="Plot lm_loss (and validation loss) against iteration from metrics JSONL files.",
    )
    parser.add_argument("metrics", nargs="+", type=Path, help="--log-metrics-jsonl files")
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="One legend label per file (default: the file names)")
    parser.add_argument("--title", default="GPT pretraining loss")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns 0, exits 2 on a bad file or arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.metrics):
        parser.error(f"--labels has {len(args.labels)} labels for {len(args.metrics)} files")
    labels = args.labels or [str(path) for path in args.metrics]
    try:
        curves = [(label, read_loss_curves(path)) for label, path in zip(labels, args.metrics)]
    except MetricsError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    plot_loss_curves(curves, args.output, args.title)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
