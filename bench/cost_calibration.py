"""The cost model's evidence: kernel tables in, end-to-end runs out, each beside a constant.

    python bench/cost_calibration.py                     # 7B MEMO-paper rows + published runs
    python bench/cost_calibration.py --models 7b,13b     # and the 13B MEMO-paper rows

1. **Kernels (what the model is built from).** The GEMM and attention efficiencies are read from
   published kernel throughput (memo_ext/estimate/kernel_tables.json, each row citing its
   source) at the model's shapes (memo_ext.estimate.kernels). Every row is predicted from the
   others (leave one out) by the lookup and by the mean of the others: the lookup must beat
   the constant.
2. **End-to-end (held out from the model).** No end-to-end figure fits anything: the MEMO
   paper's MFU (7B on 8 A800s, 13B on 16) and runs published by other systems
   (bench/published_runs.json: Megatron-LM, NeMo, ...) are all predicted. Beside each, the
   simplest baseline: one constant MFU, fitted on the MEMO paper's 7B MEMO column (those rows
   are in sample for the constant, held out for the model). The paper's Megatron-LM cells are
   reported as what they are, predicted upper bounds (docs/estimate.md says why): a row holds
   when the prediction is at or above the measurement.

Layouts: for the MEMO paper, the recommender's candidates (PP 1; Megatron with full or no
recompute; MEMO at alpha 0 and 1; 13B at TP 2, 4 and 8); a system's MFU at a length is its best
fitting layout's. For a published run, its own layout and recompute. Traces are cached
($MEMO_ESTIMATE_CACHE or ~/.cache/megatron-memo/traces). Everything this script prints is
predicted; the papers' figures are measured. Writes bench/results/cost_calibration.md and .png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import mfu_axis, seq_label  # noqa: E402
from memo_ext.estimate.cost import Efficiency  # noqa: E402
from memo_ext.estimate.flops import model_flops_per_sequence  # noqa: E402
from memo_ext.estimate.kernels import (  # noqa: E402
    TABLES_FILE,
    at_model_shapes,
    attention_tflops,
    gemm_tflops,
)
from memo_ext.estimate.layout import (  # noqa: E402
    Layout,
    LayoutModel,
    TraceCache,
    build_models,
    candidate_layouts,
    default_cache_dir,
)
from memo_ext.estimate.models import traced_model  # noqa: E402
from memo_ext.hardware import load_hardware  # noqa: E402
from memo_ext.trace.request import TracedModel  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
PUBLISHED_RUNS = REPO_ROOT / "bench" / "published_runs.json"
K = 1024
#: the MEMO paper's MFU table (docs/memo.md "The paper's reported figures"): (model, GPUs) -> seq -> (Megatron-LM MFU %,
#: MEMO MFU %), None where the system ran out of memory. Measured by the MEMO paper on A800s.
PAPER = {
    ("7b", 8): {32 * K: (52.75, 52.75), 64 * K: (41.55, 52.34), 128 * K: (24.13, 50.96),
                256 * K: (29.07, 53.62), 512 * K: (34.43, 51.84), 640 * K: (30.90, 52.59),
                768 * K: (None, 51.89), 1024 * K: (None, 52.30)},
    ("13b", 16): {32 * K: (49.79, 49.79), 64 * K: (38.51, 52.65), 128 * K: (23.02, 50.93),
                  256 * K: (25.30, 51.22), 512 * K: (29.10, 52.40), 640 * K: (19.41, 52.13),
                  768 * K: (None, 51.71), 1024 * K: (None, 52.06)},
}
PAPER_LONGEST = {("7b", 8): (640 * K, 1024 * K), ("13b", 16): (640 * K, 1408 * K)}
SYSTEMS = {"Megatron-LM": ("megatron", "megatron-none"), "MEMO": ("memo",)}
SEARCH_STEP, SEARCH_MAX = 128 * K, 4096 * K
#: docs/memo.md's calibration runs: 16 sequences per iteration, 2 TB of host memory per node.
GLOBAL_BATCH, HOST_GB = 16, 2048
GPUS = {"7b": 8, "13b": 16}
SHAPES = {"7b": {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 16384,
                 "num_attention_heads": 32, "vocab_size": 50257},
          "13b": {"num_layers": 40, "hidden_size": 5120, "ffn_hidden_size": 20480,
                  "num_attention_heads": 40, "vocab_size": 50257}}
#: A published run's recompute -> the estimator's policy.
RECOMPUTE_POLICIES = {"none": "megatron-none", "full": "megatron"}


# ----------------------------------------------------------------------------- 1. kernels

def leave_one_out(rows: list[dict], kind: str) -> list[tuple[dict, float, float]]:
    """(row, lookup's relative error, constant's relative error) for each row predicted from
    the other rows of its table (same GPU; for attention the same direction)."""
    result = []
    for index, row in enumerate(rows):
        others = [o for j, o in enumerate(rows) if j != index and o["gpu"] == row["gpu"]
                  and (kind == "gemm" or o["direction"] == row["direction"])]
        if not others:
            continue
        if kind == "gemm":
            lookup = gemm_tflops(others, row["m"], row["n"], row["k"])
        else:
            lookup = attention_tflops(others, row["direction"], row["causal"], row["head_dim"],
                                      row["seq_len"])
        constant = statistics.fmean(o["tflops"] for o in others)
        result.append((row, lookup / row["tflops"] - 1, constant / row["tflops"] - 1))
    return result


def kernel_lines() -> list[str]:
    tables = json.loads(TABLES_FILE.read_text())
    lines = ["## 1. Kernel tables (the model's inputs)", "",
             f"Rows of `{TABLES_FILE.relative_to(REPO_ROOT)}`, each predicted from the others "
             "of its GPU (and direction) by the lookup the cost model uses "
             "(memo_ext.estimate.kernels) and by their mean. Mean absolute relative error:", "",
             "| kernel | GPU | rows | lookup | constant (mean of the others) |",
             "|---|---|---|---|---|"]
    for kind in ("attention", "gemm"):
        rows = tables[kind]
        for gpu in sorted({r["gpu"] for r in rows}):
            errors = leave_one_out([r for r in rows if r["gpu"] == gpu], kind)
            if not errors:
                continue
            lookup = statistics.fmean(abs(e) for _, e, _ in errors)
            constant = statistics.fmean(abs(c) for _, _, c in errors)
            lines.append(f"| {kind} | {gpu} | {len(errors)} | {100 * lookup:.1f}% | "
                         f"{100 * constant:.1f}% |")
    lines += ["", "Sources:", ""]
    lines += [f"- `{key}`: {source['citation']} ({source['where']})"
              for key, source in tables["sources"].items()]
    return lines


def efficiency_lines(hardware: dict) -> list[str]:
    base = Efficiency.from_profile(hardware)
    lines = ["", f"Efficiencies the lookup gives at the MEMO paper's shapes ({hardware['name']}, "
             "one rank's tokens = sequence / CP; the GEMM has one published row per GPU, the "
             "attention saturates from 16K tokens on):", "",
             "| model | TP | CP | seq | GEMM | attention forward | attention backward |",
             "|---|---|---|---|---|---|---|"]
    for name in ("7b", "13b"):
        for tp, cp, seq in ((1, 1, 2 * K), (1, 1, 8 * K), (2, 4, 1024 * K)):
            model = {**SHAPES[name], "seq_length": seq}
            e = at_model_shapes(base, hardware, model, {"tp": tp, "cp": cp, "pp": 1})
            lines.append(f"| {name} | {tp} | {cp} | {seq_label(seq)} | {e.gemm:.3f} | "
                         f"{e.attention_forward:.3f} | {e.attention_backward:.3f} |")
    return lines


# ----------------------------------------------------------------------------- 2. end to end

def best(models, seq: int):
    """The highest predicted MFU (%) among the layouts that fit at ``seq``, and its
    prediction; (None, None) when none fits."""
    found = None
    for model in models:
        prediction = model.predict(seq - seq % model.multiple)
        if prediction.fits and (found is None or prediction.step.mfu > found.step.mfu):
            found = prediction
    return (None, None) if found is None else (100 * found.step.mfu, found)


def longest(models) -> int:
    return max((m.longest(SEARCH_STEP, SEARCH_MAX) for m in models), default=0)


def paper_layouts(name: str, hardware: dict) -> list[Layout]:
    """The layouts searched for the MEMO paper's ``name`` rows (module docstring)."""
    layouts, _ = candidate_layouts(SHAPES[name], GPUS[name], hardware,
                                   policies=["megatron", "megatron-none", "memo"],
                                   alphas=[0.0, 1.0], micro_batches=[1],
                                   global_batch=GLOBAL_BATCH, pipeline_sizes=[1])
    if name == "13b":  # TP 1 cannot hold 13B
        layouts = [layout for layout in layouts if layout.tp in (2, 4, 8)]
    return layouts


def memo_paper_models(names: list[str], hardware: dict, cache, jobs: int) -> dict:
    systems = {}
    for name in names:
        gpus = GPUS[name]
        layouts = paper_layouts(name, hardware)
        print(f"{name}: {len(layouts)} layouts", flush=True)
        models, failed = build_models(traced_model(name), layouts, hardware,
                                      global_batch=GLOBAL_BATCH, cache=cache, jobs=jobs,
                                      host_memory_gb_per_node=HOST_GB,
                                      log=lambda line: print(f"  {line}", flush=True))
        for layout, reason in failed:
            print(f"  not predicted: {layout.describe()}: {reason}")
        for system, policies in SYSTEMS.items():
            systems[(name, gpus, system)] = [m for m in models if m.layout.policy in policies]
    return systems


def memo_paper_rows(systems: dict) -> list[dict]:
    rows = []
    for (name, gpus), cells in PAPER.items():
        for index, system in enumerate(SYSTEMS):
            models = systems.get((name, gpus, system))
            if models is None:
                continue
            for seq, figures in cells.items():
                mfu, prediction = best(models, seq)
                role = ("constant's fit" if (name, system) == ("7b", "MEMO")
                        else "upper bound" if system == "Megatron-LM" else "held out")
                rows.append({"source": "MEMO paper", "what": f"{name} {system}", "seq": seq,
                             "gpus": gpus, "measured": figures[index], "predicted": mfu,
                             "role": role, "prediction": prediction})
    return rows


def _traced_model(shape: dict) -> TracedModel:
    """The network a published run's shape describes: its sizes, grouped-query attention and
    SwiGLU; the tracer's defaults for the rest."""
    return traced_model(None, {key: shape[key] for key in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")},
        num_query_groups=shape.get("num_query_groups") or None,
        swiglu=bool(shape.get("swiglu")))


def _megatron_2021_flops(run: dict) -> float:
    """Narayanan et al. 2021, eq. (3): 96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration, the
    recomputed forward included."""
    shape, seq, batch = run["model"], run["seq_length"], run["global_batch"]
    layers, hidden, vocab = shape["num_layers"], shape["hidden_size"], shape["vocab_size"]
    return 96 * batch * seq * layers * hidden ** 2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


#: FLOPs per iteration as a source counts them (``reported.definition_id``): what turns its
#: reported TFLOP/s per GPU back into its measured iteration time. A run counted otherwise is
#: skipped.
SOURCE_FLOPS = {"megatron-2021": _megatron_2021_flops}
TFLOPS_METRICS = ("hardware_tflops_per_gpu", "model_tflops_per_gpu")


def published_rows(hardware_of, cache) -> list[dict]:
    """Each published run predicted at its own layout; measured MFU in our definition (the
    source's throughput turned back into its iteration time by its own FLOPs count)."""
    runs = json.loads(PUBLISHED_RUNS.read_text())["runs"]
    rows = []
    for run in runs:
        policy = RECOMPUTE_POLICIES.get(run["recompute"])
        reported = run["reported"]
        source_flops = SOURCE_FLOPS.get(reported.get("definition_id"))
        if policy is None or run["dtype"] not in ("bf16", "fp16") or source_flops is None \
                or reported["metric"] not in TFLOPS_METRICS:
            print(f"  skipped {run['source']} {run['where']}: recompute {run['recompute']}, "
                  f"{run['dtype']}, FLOPs counted as {reported.get('definition_id')} "
                  "(not modelled)")
            continue
        hardware = hardware_of(run["gpu"])
        peak = float(hardware["bf16_tflops"]) * 1e12
        layout = Layout(run["tp"], run["cp"], run["pp"], run["dp"], policy,
                        micro_batch=run.get("micro_batch") or 1)
        seq = run["seq_length"]
        fit = (seq, 2 * seq) if seq < 131072 else (131072, 262144)
        model = LayoutModel.build(_traced_model(run["model"]), layout, hardware,
                                  global_batch=run["global_batch"], cache=cache, fit_seqs=fit,
                                  num_layers=run["model"]["num_layers"])
        prediction = model.predict(seq)
        gpus = run["gpus"]
        step = source_flops(run) / (reported["value"] * 1e12 * gpus)
        ours = run["global_batch"] * model_flops_per_sequence(run["model"], seq)
        rows.append({"source": run["source"], "what": f"{run['system']} "
                     f"{run['model']['name']}", "seq": seq, "gpus": gpus,
                     "measured": 100 * ours / (step * gpus * peak),
                     "predicted": 100 * prediction.step.mfu, "role": "held out",
                     "prediction": prediction})
        print(f"  {rows[-1]['what']} {seq_label(seq)}: measured {rows[-1]['measured']:.1f}%, "
              f"predicted {rows[-1]['predicted']:.1f}%", flush=True)
    return rows


def end_to_end_lines(rows: list[dict], constant: float) -> list[str]:
    lines = ["", "## 2. End-to-end MFU (model fitted on none of these rows)", "",
             f"Constant baseline: **{constant:.2f}%**, the mean of the MEMO paper's 7B MEMO "
             "column (its fit rows). MFU in the MEMO paper's definition (6·s·P + 6·n·h·s² per "
             "sequence, recomputation not credited); published throughput converted through "
             "the source's own FLOPs count to its iteration time first.", "",
             "| source | run | GPUs | seq | role | measured | predicted | error | constant's "
             "error | reorganisations (s/iteration) | predicted layout |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        measured, predicted = row["measured"], row["predicted"]
        error = None if measured is None or predicted is None else predicted - measured
        prediction = row["prediction"]
        lines.append(
            f"| {row['source']} | {row['what']} | {row['gpus']} | {seq_label(row['seq'])} | "
            f"{row['role']} | {'OOM' if measured is None else f'{measured:.2f}%'} | "
            f"{'OOM' if predicted is None else f'{predicted:.2f}%'} | "
            f"{'-' if error is None else f'{error:+.2f}'} | "
            f"{'-' if measured is None else f'{constant - measured:+.2f}'} | "
            f"{'-' if prediction is None else f'{prediction.step.reorganisation_s:.1f}'} | "
            f"{'-' if prediction is None else prediction.layout.describe()} |")
    lines += ["", "Mean absolute error (MFU points) by group, ours against the constant:", "",
              "| group | rows | ours | constant | upper bound holds |", "|---|---|---|---|---|"]
    groups: dict = {}
    for row in rows:
        if row["measured"] is not None and row["predicted"] is not None:
            groups.setdefault((row["source"], row["role"]), []).append(row)
    for (source, role), members in groups.items():
        ours = statistics.fmean(abs(r["predicted"] - r["measured"]) for r in members)
        base = statistics.fmean(abs(constant - r["measured"]) for r in members)
        holds = "-" if role != "upper bound" else \
            f"{sum(r['predicted'] >= r['measured'] for r in members)} of {len(members)}"
        lines.append(f"| {source} ({role}) | {len(members)} | {ours:.2f} | {base:.2f} | "
                     f"{holds} |")
    return lines


def longest_lines(systems: dict) -> list[str]:
    lines = ["", "| model | system | paper longest | predicted longest |", "|---|---|---|---|"]
    for (name, gpus), lengths in PAPER_LONGEST.items():
        for system, paper_longest in zip(SYSTEMS, lengths):
            models = systems.get((name, gpus, system))
            if models is None:
                continue
            lines.append(f"| {name} | {system} | {seq_label(paper_longest)} | "
                         f"{seq_label(longest(models))} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="7b", help="7b and/or 13b (comma-separated)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--no-published", action="store_true",
                        help="leave out bench/published_runs.json's rows")
    parser.add_argument("--output", type=Path, default=RESULTS / "cost_calibration.md")
    opts = parser.parse_args()
    started = time.perf_counter()
    a800 = load_hardware("a800")
    cache = TraceCache(default_cache_dir())
    with cache:
        systems = memo_paper_models(opts.models.split(","), a800, cache, opts.jobs)
        rows = memo_paper_rows(systems)
        if not opts.no_published:
            rows += published_rows(load_hardware, cache)
    constant = statistics.fmean(r["measured"] for r in rows if r["role"] == "constant's fit")
    lines = ["# Cost model evidence: kernel tables in, end-to-end runs out", "",
             f"`python bench/cost_calibration.py --models {opts.models}"
             f"{' --no-published' if opts.no_published else ''}`, "
             f"{time.perf_counter() - started:.0f} s on this 2-core CPU machine (traces from "
             "the cache where present). Predicted: allocator models and the cost model "
             "(memo_ext/estimate); the sources' figures are measured on GPUs.", "",
             *kernel_lines(), *efficiency_lines(a800), *end_to_end_lines(rows, constant),
             *longest_lines(systems)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    opts.output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(rows, opts.output.with_suffix(".png"))
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paper = [r for r in rows if r["source"] == "MEMO paper"]
    names = sorted({r["what"].split()[0] for r in paper})
    others = [r for r in rows if r["source"] != "MEMO paper"
              and r["measured"] is not None and r["predicted"] is not None]
    panels = len(names) + (1 if others else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    for axis, name in zip(axes[0], names):
        for system, colour in zip(SYSTEMS, ("tab:red", "tab:blue")):
            series = [r for r in paper if r["what"] == f"{name} {system}"]
            xs = [r["seq"] // K for r in series]
            axis.plot(xs, [r["measured"] or math.nan for r in series], "o-", color=colour,
                      label=f"{system} (paper, measured)")
            axis.plot(xs, [r["predicted"] or math.nan for r in series], "x--", color=colour,
                      label=f"{system} (predicted)")
        mfu_axis(axis, f"{name}, A800-80GB")
    if others:
        axis = axes[0][-1]
        for source in sorted({r["source"] for r in others}):
            members = [r for r in others if r["source"] == source]
            axis.scatter([r["measured"] for r in members], [r["predicted"] for r in members],
                         label=source)
        axis.plot([0, 100], [0, 100], "k:", linewidth=1)
        axis.set_xlim(0, 80)
        axis.set_ylim(0, 80)
        axis.set_xlabel("measured MFU % (published)")
        axis.set_ylabel("predicted MFU %")
        axis.set_title("published runs, held out")
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
