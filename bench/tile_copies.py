"""The tracer's tile loops recorded by copies (memo_ext/trace/tile_copies.py) and its fast path
for device queries and views (memo_ext/trace/fake_fast_path.py): one trace's time with every
tile run through FakeTensorMode alone, with the copies, and with both, for 7B stages the
recommender traces, and whether the traces are the same (events and work), beside the untiled
stage.

    python bench/tile_copies.py

Each request is the estimator's own (memo_ext.estimate.layout.Layout.trace_request) at the first
fitted length, 131,072 tokens, on the A800 profile: a few-layer stage of a symbolic trace or
the deeper stage of its check. All run in this one process, one after another, after one
untimed trace (imports, first-call costs). Writes bench/results/tile_copies.md and .png; the
times are this machine's CPU, no GPU is involved.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import commit, machine, write_atomic  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
SEQ = 131072
TILES = dict(mlp_tiles=16, projection_tiles=16)
#: name -> (Layout fields, layers of the traced stage)
CASES = {
    "MEMO alpha 0, every offloaded layer in (b), one buffer, TP=4 CP=2; 5 layers (a fit)":
        (dict(tp=4, cp=2, policy="memo", alpha=0.0, checkpoint_layers=4, offload_buffers=1,
              head_chunks=8), 5),
    "MEMO alpha 1, TP=1 CP=8; 7 layers (a check)":
        (dict(tp=1, cp=8, policy="memo", alpha=1.0, offload_buffers=1, head_chunks=8), 7),
    "Megatron full recompute, TP=8; 3 layers (a fit)":
        (dict(tp=8, cp=1, policy="megatron", head_chunks=4), 3),
}


def _timed(request, copying: bool, fast_path: bool):
    from megatron.training import tracing
    from memo_ext.trace import fake_fast_path, tile_copies

    saved = tile_copies.MIN_TILES_TO_COPY, fake_fast_path.view, fake_fast_path.device_query
    if not copying:
        tile_copies.MIN_TILES_TO_COPY = 1 << 30
    if not fast_path:
        fake_fast_path.view = fake_fast_path.device_query = \
            lambda *args: fake_fast_path.NOT_HANDLED
    try:
        started = time.perf_counter()
        trace, _ = tracing.record(request)
        return time.perf_counter() - started, trace
    finally:
        (tile_copies.MIN_TILES_TO_COPY, fake_fast_path.view,
         fake_fast_path.device_query) = saved


def main() -> int:
    from memo_ext.estimate.layout import Layout
    from memo_ext.estimate.models import traced_model
    from memo_ext.hardware import load_hardware

    hardware = load_hardware("a800")
    model = traced_model("7b")
    rows = []
    first = True
    for name, (fields, layers) in CASES.items():
        tiled = Layout(pp=1, dp=1, **fields, **TILES)
        untiled = Layout(pp=1, dp=1, **{**fields, "head_chunks": 1})
        request = tiled.trace_request(model.with_layers(layers), SEQ, hardware)
        if first:  # imports and first-call costs, untimed
            _timed(request, True, True)
            first = False
        plain, _ = _timed(untiled.trace_request(model.with_layers(layers), SEQ, hardware),
                          True, True)
        every, reference = _timed(request, False, False)
        copied, with_copies = _timed(request, True, False)
        fast, with_both = _timed(request, True, True)
        same = all(trace.events == reference.events and trace.header == reference.header
                   for trace in (with_copies, with_both))
        rows.append((name, plain, every, copied, fast, same, len(reference.events)))
        print(f"{name}: untiled {plain:.1f} s, every tile {every:.1f} s, copies {copied:.1f} s, "
              f"copies and fast path {fast:.1f} s, same trace {same}", flush=True)
    lines = [
        "# Tile loops traced by copies, views and device queries without FakeTensorMode's cache",
        "",
        f"Commit {commit()}, {machine()}. `python bench/tile_copies.py`: one trace of 7B "
        f"(`--model 7b`) at {SEQ:,} tokens per request, the estimator's own request on the A800 "
        "profile (16 MLP and projection tiles; head chunks as the recommender sets them), all "
        "in one process after one untimed trace (the untiled one with copies and the fast path, "
        "which change nothing there but the device queries and views). The times are this "
        "CPU's. Same trace: the copies' and both's traces equal the reference's, events and "
        "header (work counts).",
        "",
        "| stage | untiled | tiled, every tile, FakeTensorMode alone (reference) | "
        "middle tiles copied | copied, views and device queries by the fast path | speed-up | "
        "same trace | events |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, plain, every, copied, fast, same, events in rows:
        lines.append(f"| {name} | {plain:.1f} s | {every:.1f} s | {copied:.1f} s | "
                     f"**{fast:.1f} s** | {every / fast:.1f}x | {'yes' if same else '**no**'} "
                     f"| {events:,} |")
    write_atomic(RESULTS / "tile_copies.md", "\n".join(lines) + "\n")
    _plot(rows, RESULTS / "tile_copies.png")
    return 0 if all(row[5] for row in rows) else 1


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(9, 4))
    xs = range(len(rows))
    for offset, index, label in ((-0.3, 1, "untiled"), (-0.1, 2, "tiled, every tile"),
                                 (0.1, 3, "tiled, copies"),
                                 (0.3, 4, "tiled, copies and fast path")):
        axis.bar([x + offset for x in xs], [row[index] for row in rows], 0.2, label=label)
    axis.set_xticks(list(xs), [row[0].split(";")[0].replace(", ", "\n", 2) for row in rows],
                    fontsize=7)
    axis.set_ylabel("seconds per trace (this CPU)")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
