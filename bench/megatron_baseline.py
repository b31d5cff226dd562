"""Which Megatron-LM did the MEMO paper measure? Megatron-LM's predicted longest sequence and
MFU with and without context parallelism, beside the paper's figures (docs/memo.md "The paper's reported
figures"), and the per-iteration overhead the paper's MFU implies beyond our cost model.

    python bench/megatron_baseline.py

Layouts (Megatron-LM full recompute, uniform 1 layer; and no recompute where it fits):
- without CP, as Megatron-LM is usually laid out: TP=8 inside a node, and for 13B on two nodes
  PP=2 across them;
- with CP: TP x CP = 8 (7B) and TP x CP = 16 (13B), TP <= 8.

For the no-CP layouts the table gives, at each of the paper's lengths, the predicted MFU (the
better of no recompute and full recompute that fits), the predicted step, the step the paper's
MFU implies (docs/memo.md's MFU definition, 16 sequences, 312 TFLOPS), the difference, and where
the paper gives Megatron-LM's reorganisation counts (7B: 6 per iteration at 128K, 16 at 256K),
the seconds per reorganisation that difference would need. Writes
bench/results/megatron_baseline.md and .png. Every figure of ours is predicted (allocator
models and the cost model on traces); the paper's were measured on A800s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import mfu_axis, seq_label  # noqa: E402
from bench.cost_calibration import GLOBAL_BATCH, PAPER, PAPER_LONGEST  # noqa: E402
from memo_ext.estimate.flops import model_flops_per_sequence  # noqa: E402
from memo_ext.estimate.layout import Layout, TraceCache, build_models, default_cache_dir  # noqa: E402
from memo_ext.estimate.models import model_shape, traced_model  # noqa: E402
from memo_ext.hardware import load_hardware  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
K = 1024
SEARCH_STEP, SEARCH_MAX = 128 * K, 2048 * K
#: (model, GPUs) -> layout family -> (TP, CP, PP, DP) of each layout.
FAMILIES = {
    ("7b", 8): {"without CP": [(8, 1, 1, 1)],
                "with CP": [(2, 4, 1, 1), (4, 2, 1, 1)]},
    ("13b", 16): {"without CP": [(8, 1, 2, 1)],
                  "with CP": [(4, 4, 1, 1), (8, 2, 1, 1)]},
}
#: The MEMO paper: Megatron-LM's cache reorganisations per iteration (7B, 8 GPUs).
PAPER_REORGANISATIONS = {("7b", 8): {128 * K: 6, 256 * K: 16}}


def best_fitting(models, seq: int):
    """The prediction with the highest MFU among ``models`` that fit at ``seq`` (or None)."""
    fitting = [p for p in (m.predict(seq - seq % (2 * m.layout.tp * m.layout.cp))
                           for m in models) if p.fits]
    return max(fitting, key=lambda p: p.step.mfu, default=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS / "megatron_baseline.md")
    opts = parser.parse_args()
    started = time.perf_counter()
    hardware = load_hardware("a800")
    peak = float(hardware["bf16_tflops"]) * 1e12
    cache = TraceCache(default_cache_dir())
    longest_lines = ["| model | GPUs | layout (full recompute) | predicted longest | "
                     "peak at it, GiB | paper longest |", "|---|---|---|---|---|---|"]
    mfu_lines = ["| model | seq | paper MFU | predicted MFU, no CP | layout | predicted step s"
                 " | paper's step s | paper - predicted, s | reorganisations (paper) | "
                 "s per reorganisation needed | predicted MFU, with CP |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
    plot = {}
    for (name, gpus), families in FAMILIES.items():
        shape = model_shape(name)
        models = {}
        for family, layouts in families.items():
            wanted = [Layout(tp, cp, pp, dp, policy) for tp, cp, pp, dp in layouts
                      for policy in ("megatron", "megatron-none")]
            built, failed = build_models(traced_model(name), wanted, hardware,
                                         global_batch=GLOBAL_BATCH, cache=cache, jobs=opts.jobs,
                                         log=lambda line: print(f"  {line}", flush=True))
            for layout, reason in failed:
                print(f"  not predicted: {layout.describe()}: {reason}")
            models[family] = built
            for model in built:
                if model.layout.policy != "megatron":
                    continue
                longest = model.longest(SEARCH_STEP, SEARCH_MAX)
                at = model.predict(longest) if longest else None
                longest_lines.append(
                    f"| {name} | {gpus} | {model.layout.describe()} ({family}) | "
                    f"{seq_label(longest)} | "
                    f"{'-' if at is None else f'{at.memory.peak_device_bytes / (1 << 30):.1f}'}"
                    f" | {seq_label(PAPER_LONGEST[(name, gpus)][0])} |")
        for seq, (paper, _) in PAPER[(name, gpus)].items():
            without = best_fitting(models["without CP"], seq)
            with_cp = best_fitting(models["with CP"], seq)
            plot.setdefault(name, []).append(
                (seq, paper, without and 100 * without.step.mfu,
                 with_cp and 100 * with_cp.step.mfu))
            if paper is None and without is None:
                paper_step = gap = None
            else:
                paper_step = None if paper is None else (
                    GLOBAL_BATCH * model_flops_per_sequence(shape, seq) / (gpus * peak
                                                                           * paper / 100))
                gap = None if paper_step is None or without is None \
                    else paper_step - without.step.step_s
            reorganisations = PAPER_REORGANISATIONS.get((name, gpus), {}).get(seq)
            per_reorganisation = (f"{gap / reorganisations:.0f}"
                                  if gap is not None and reorganisations else "-")
            mfu_lines.append(
                f"| {name} | {seq_label(seq)} | "
                f"{'OOM' if paper is None else f'{paper:.2f}%'} | "
                f"{'OOM' if without is None else f'{100 * without.step.mfu:.1f}%'} | "
                f"{'-' if without is None else without.layout.describe()} | "
                f"{'-' if without is None else f'{without.step.step_s:.0f}'} | "
                f"{'-' if paper_step is None else f'{paper_step:.0f}'} | "
                f"{'-' if gap is None else f'{gap:+.0f}'} | {reorganisations or '-'} | "
                f"{per_reorganisation} | "
                f"{'OOM' if with_cp is None else f'{100 * with_cp.step.mfu:.1f}%'} |")
    lines = ["# Megatron-LM in the MEMO paper: with or without context parallelism?", "",
             f"`python bench/megatron_baseline.py`, {time.perf_counter() - started:.0f} s on "
             "this 2-core CPU machine (traces from the cache where present). Ours: predicted "
             "(allocator models and the cost model, the kernel tables' efficiencies); the paper's: "
             "measured on A800-80GB, 16 sequences per iteration.", "",
             "## Longest sequence", "", *longest_lines, "",
             "## MFU", "", *mfu_lines, ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    opts.output.write_text("\n".join(lines))
    print("\n".join(lines))
    _plot(plot, opts.output.with_suffix(".png"))
    return 0


def _plot(series: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4), squeeze=False)
    for axis, (name, rows) in zip(axes[0], series.items()):
        xs = [seq // K for seq, *_ in rows]
        for index, (label, style) in enumerate((("paper, measured", "o-"),
                                                ("predicted, no CP", "x--"),
                                                ("predicted, with CP", "s:")), start=1):
            axis.plot(xs, [row[index] if row[index] is not None else float("nan")
                           for row in rows], style, label=f"Megatron-LM {label}")
        mfu_axis(axis, f"{name}, A800-80GB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
