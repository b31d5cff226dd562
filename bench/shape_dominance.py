"""The recommender's shape rule on the estimator's own answers: a data-parallel layout (CP > 1,
DP > 1, no PP) fits no longer a sequence than the same variant with CP k times larger and DP k
times smaller (memo_ext.estimate.search.wider_context), so the recommender traces it only when
that one reaches its table.

    python bench/shape_dominance.py                      # 7B on 8 A800s
    python bench/shape_dominance.py --model 65b --gpus 64

Each pair is built as the recommender builds its layouts (symbolic traces checked against a
real trace, the shared trace cache: $MEMO_ESTIMATE_CACHE) and solved at its longest fitting
length on the recommender's grid (memo_ext.estimate.layout.LayoutModel.longest). The variants
are the recommender's frugal ones, those the rule pairs: Megatron full recompute, and MEMO
alpha 0 with one offload buffer and 0 or every offloaded layer in checkpoint mode, all tiled
(16 MLP and projection tiles). Every figure is predicted. Results:
bench/results/shape_dominance_<model>_<gpus>gpus.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

RESULTS = REPO_ROOT / "bench" / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="7b")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu", default="a800")
    parser.add_argument("--host-memory-gb", type=float, default=2048)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--output", type=Path,
                        help="default: bench/results/shape_dominance_<model>_<gpus>gpus.md")
    opts = parser.parse_args(argv)
    opts.output = opts.output or RESULTS / f"shape_dominance_{opts.model}_{opts.gpus}gpus.md"

    from megatron.memo_tools.cli.estimate import (
        DEFAULT_GLOBAL_BATCH,
        FINE_STEP,
        SEARCH_STEP,
        traced_model_and_shape,
    )
    from memo_ext.estimate.layout import (
        TraceCache,
        build_models,
        candidate_layouts,
        default_cache_dir,
    )
    from memo_ext.estimate.search import frugal_variant, wider_context
    from memo_ext.hardware import load_hardware

    started = time.perf_counter()
    hardware = load_hardware(opts.gpu)
    network, shape = traced_model_and_shape(opts.model)
    search_max = 8 << 20
    layouts, _ = candidate_layouts(
        shape, opts.gpus, hardware, policies=["megatron", "memo"], alphas=[0.0],
        micro_batches=[1], global_batch=DEFAULT_GLOBAL_BATCH, checkpoint_fractions=(0.0, 1.0),
        mlp_tiles=(16,), offload_buffers=(1,))
    steps = (SEARCH_STEP, FINE_STEP)
    pairs = [(layout, wider) for layout in layouts
             if frugal_variant(layout, layouts) is None
             and (wider := wider_context(layout, layouts, steps)) is not None]
    if not pairs:
        raise SystemExit(f"{opts.model} on {opts.gpus} GPUs: no layout with CP > 1 and DP > 1 "
                         "to compare; try more --gpus")
    wanted = list(dict.fromkeys(layout for pair in pairs for layout in pair))
    print(f"{len(pairs)} pairs, {len(wanted)} layouts", flush=True)
    with TraceCache(default_cache_dir(), workers=opts.jobs) as cache:
        models, failed = build_models(
            network, wanted, hardware, global_batch=DEFAULT_GLOBAL_BATCH, cache=cache,
            jobs=opts.jobs, host_memory_gb_per_node=opts.host_memory_gb,
            num_layers=shape["num_layers"], log=lambda line: print(f"  {line}", flush=True))
    if failed:
        raise SystemExit(f"not predicted: {failed}")
    longest = {m.layout: m.longest(SEARCH_STEP, search_max, FINE_STEP) for m in models}
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    lines = [
        "# The recommender's shape rule on the estimator's answers", "",
        f"Commit {commit}, {platform.machine()} CPU with {os.cpu_count()} cores, no GPU; "
        "every figure predicted.", "",
        f"`python bench/shape_dominance.py --model {opts.model} --gpus {opts.gpus} --gpu "
        f"{opts.gpu} --host-memory-gb {opts.host_memory_gb:g}`, "
        f"{time.perf_counter() - started:.0f} s (traces from the cache where present). Each "
        "data-parallel layout's longest fitting length beside the same variant with more "
        "context parallelism (memo_ext.estimate.search.wider_context); the rule holds when "
        "the first is at most the second.", "",
        "| layout (dominated) | longest | wider context (dominating) | longest | holds |",
        "|---|---|---|---|---|"]
    broken = 0
    for layout, wider in pairs:
        holds = longest[layout] <= longest[wider]
        broken += not holds
        lines.append(f"| {layout.describe()} | {longest[layout]} | {wider.describe()} | "
                     f"{longest[wider]} | {'yes' if holds else '**no**'} |")
        print(lines[-1], flush=True)
    lines += ["", f"{len(pairs) - broken} of {len(pairs)} pairs hold."]
    partial = opts.output.with_suffix(".md.partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("\n".join(lines) + "\n")
    os.replace(partial, opts.output)
    print(f"wrote {opts.output}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
