"""Predict a training job's device memory, step time and MFU before launching it, on any machine.

    python tools/estimate.py --model 7b --gpu a800 --tensor-model-parallel-size 4 \\
        --context-parallel-size 2 --seq-length 524288
    python tools/estimate.py --model 7b --gpu a800 --tensor-model-parallel-size 4 \\
        --context-parallel-size 2 --max-seq-length
    python tools/estimate.py --model 7b --gpus 8 --gpu a800 --policy memo --memo-alpha 0 \\
        --tensor-model-parallel-size 4 --context-parallel-size 2 --max-seq-length
    python tools/estimate.py --model 7b --gpus 8 --gpu a800 --recommend --max-seq-length

One rank per traced pipeline stage (the first, with 1F1B's micro-batches in flight, and the
last, with the output layer and loss) is traced on fake tensors, cut to a few layers (3 for
Megatron's policies, 5 for MEMO; block recompute whole), at 128K and 256K tokens, plus the stage's persistent state; the symbolic trace built from them gives the
stage at any length and depth and is checked against a real trace before it is used
(memo_ext/estimate/symbolic.py; traces cached under ~/.cache/megatron-memo/traces). The trace at
a length is replayed (persistent state once, then three iterations) through the allocator model
on the GPU's memory; the work it counted (GEMM and attention FLOPs, bytes moved, collectives,
PCIe copies) goes through the cost model (memo_ext/estimate/cost.py) for the step time and MFU,
its kernels priced by rows measured on the GPU where bench/gpu_evidence.py's were imported,
published rows otherwise; a ``kernel rows:`` line says which (docs/estimate.md).

Prints the predicted peak (reserved by the allocator plus the memory outside it: CUDA context,
NCCL), the live bytes by category at the peak, FITS or OOM (device or host), the step time with
its breakdown and the MFU. ``--max-seq-length`` solves the longest sequence that fits in steps
of 128K (16K below 128K) from closed-form peak bounds and a replay or two and ends with ``max sequence length: <tokens> tokens, predicted MFU
<pct>%``. ``--recommend`` searches (TP, CP, PP, DP, micro-batch, policy, alpha) for ``--gpus``
GPUs and prints the best layouts as a table.

Policies: ``megatron`` is Megatron-LM with full recompute (uniform, 1 layer), ``megatron-none``
without recompute, ``memo`` MEMO's offload at ``--memo-alpha``. Everything printed is predicted
(allocator models and a cost model; no GPU is involved).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

from megatron.memo_tools.cli.quiet import (
    add_verbose_argument,
    explain_hidden,
    hide_highs_banner,
    hide_library_warnings,
)

hide_library_warnings()  # before the first import of megatron.core (cli/quiet.py)

from megatron.training.arguments import (  # noqa: E402
    add_grad_reduce_in_bf16_arg,
    add_optimizer_offload_args,
)
from megatron.training.megatron_fsdp import add_megatron_fsdp_args  # noqa: E402
from megatron.memo_tools.cli.trace import (  # noqa: E402
    TRACED_OFFLOAD_FLAGS,
    TRACED_OFFLOAD_VARIANTS,
    add_layout_arguments,
    add_tiling_arguments,
    data_parallel_size,
    traced_offload_config,
)
from memo_ext.config import (  # noqa: E402
    AttentionConfig,
    MemoConfigError,
    OffloadConfig,
    add_config_flags,
    config_from_args,
)
from memo_ext.estimate.cpu_profile import CPU_PROFILE  # noqa: E402
from memo_ext.estimate.kernels import kernel_rows_line, priced_rows  # noqa: E402
from memo_ext.estimate.layout import BLOCK_RECOMPUTE_FRACTIONS, CHECKPOINT_FRACTIONS  # noqa: E402
from memo_ext.estimate.models import (  # noqa: E402
    MODELS,
    SHAPE_FLAGS,
    ModelError,
    model_shape,
    traced_model,
)
from memo_ext.sppo.layout_model import (  # noqa: E402
    SPPOLayoutModel,
    SPPOPrediction,
    sppo_layout_models,
)
from memo_ext.trace.request import TracedModel  # noqa: E402

GiB = 1 << 30
SEARCH_STEP, FINE_STEP = 131072, 16384
POLICIES = ("megatron", "megatron-none", "megatron-block", "memo", "sppo")
#: Block recompute multiplies the traced Megatron layouts by its layer counts: opt-in.
DEFAULT_POLICIES = "megatron,megatron-none,memo,sppo"
#: The MEMO paper's calibration runs: 16 sequences per iteration (docs/memo.md "The paper's reported figures").
DEFAULT_GLOBAL_BATCH = 16


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--model", required=True,
                        help="7b, 13b, 30b, 65b (examples/configs), a JSON file with "
                             + ", ".join(SHAPE_FLAGS) + " (and swiglu, disable_bias_linear, "
                             "tie_embeddings: true/false; normalization: LayerNorm/RMSNorm), or "
                             "@FILE: pretrain_gpt.py flags one a line, as pretrain_gpt.py @FILE "
                             "reads them (a converted checkpoint's model_flags.txt)")
    parser.add_argument("--gpu", required=True,
                        help="a profile of memo_ext/hardware.json, or cpu: this "
                             "machine running the CPU trainer (fp32, one process per rank), "
                             "micro-benchmarked at startup for the one layout and --seq-length "
                             "asked (memo_ext/estimate/cpu_profile.py; traced whole)")
    parser.add_argument("--hardware-file", type=Path, default=None,
                        help="extra GPU profiles (JSON, the keys of hardware.json)")
    layout = parser.add_argument_group("layout")
    # The trainer's parallel-size flags and --gpus, as tools/trace.py takes them.
    add_layout_arguments(layout, default_size=None,
                         tp_note="; with --gpus and none of the three parallel sizes, the "
                                 "layout is searched for --policy")
    layout.add_argument("--micro-batch-size", type=int, default=1)
    layout.add_argument("--global-batch-size", type=int, default=DEFAULT_GLOBAL_BATCH,
                        help="sequences per iteration (default 16, as the MEMO paper's calibration runs; docs/memo.md)")
    parser.add_argument("--policy", choices=POLICIES, default="megatron",
                        help="megatron (full recompute), megatron-none (no recompute), "
                             "megatron-block (full recompute of --recompute-num-layers layers "
                             "per stage, megatron's --recompute-method block), memo "
                             "(MEMO's offload at --memo-alpha) or sppo (SPPO's subsequence "
                             "pipeline, predicted by memo_ext/sppo/solver.py's analytic model: "
                             "N, and MSP when PP > 1, are searched)")
    # The trainer's --memo-* flags as a traced layout takes them (with --policy memo).
    add_config_flags(parser, OffloadConfig, fields=TRACED_OFFLOAD_FLAGS[1:],
                     variants=TRACED_OFFLOAD_VARIANTS)
    add_tiling_arguments(parser)
    parser.add_argument("--recompute-num-layers", type=int, default=None,
                        help="with --policy megatron-block: layers recomputed per stage")
    optimizer = parser.add_argument_group(
        "optimizer (one layout; the estimator models the distributed optimizer)")
    optimizer.add_argument("--use-distributed-optimizer", action="store_true",
                           help="The trainer's flag. The estimator models the distributed "
                                "optimizer with or without it; --optimizer-cpu-offload needs it, "
                                "as the trainer does.")
    add_optimizer_offload_args(optimizer, ("--optimizer-cpu-offload",
                                           "--optimizer-offload-fraction"))
    add_megatron_fsdp_args(optimizer)  # traced: megatron-core's own Megatron-FSDP buffers
    add_grad_reduce_in_bf16_arg(optimizer)  # one layout: a numerics choice, not searched
    parser.add_argument("--host-memory-gb", type=float, default=None,
                        help="host memory per node for MEMO's offload (default: the profile's)")
    parser.add_argument("--allocator", choices=("caching", "expandable", "arena"), default=None,
                        help="allocator model: caching (PyTorch's default), expandable "
                             "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or arena "
                             "(MEMO's planned arena, planned from each trace). Default: arena "
                             "with --policy memo, caching otherwise")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--seq-length", type=int, help="tokens per sequence")
    target.add_argument("--max-seq-length", action="store_true",
                        help="search the longest sequence that fits")
    parser.add_argument("--search-max", type=int, default=8 * 1048576,
                        help="longest sequence the search tries (default 8M)")
    search = parser.add_argument_group("recommender (--recommend)")
    search.add_argument("--recommend", action="store_true",
                        help="search layouts and policies for --gpus GPUs; print the best")
    search.add_argument("--policies", default=DEFAULT_POLICIES,
                        help=f"policies searched (comma-separated; default {DEFAULT_POLICIES}; "
                             f"also megatron-block)")
    search.add_argument("--block-recompute-fractions",
                        default=",".join(f"{f:g}" for f in BLOCK_RECOMPUTE_FRACTIONS),
                        help="megatron-block: the layers per stage tried, as fractions of a "
                             "stage's layers (comma-separated)")
    search.add_argument("--alphas", default="0,1",
                        help="MEMO alphas searched (comma-separated, default 0,1)")
    search.add_argument("--checkpoint-fractions",
                        default=",".join(f"{f:g}" for f in CHECKPOINT_FRACTIONS),
                        help="MEMO: checkpoint-offloaded layers per stage tried, as fractions "
                             "of a stage's offloaded layers (comma-separated, in [0, 1])")
    search.add_argument("--offload-fp8", choices=("off", "on", "both"), default="off",
                        help="MEMO: search lossy fp8 offload (--memo-offload-fp8) too "
                             "('both'), only, or not (default off: it changes the gradients)")
    search.add_argument("--offload-buffers", default="1,2",
                        help="MEMO: offload buffer counts searched (comma-separated, each 1 or "
                             "2; default 1,2; --memo-offload-buffers)")
    search.add_argument("--mlp-tiles", default="0,16",
                        help="MLP tile counts searched (comma-separated; 0: untiled; default "
                             "0,16): each layer's MLP run in K sequence tiles of the rank's CP "
                             "shard (the trainer's --memo-mlp-tile-size; docs/tiled_mlp.md), "
                             "the attention's projections in K tiles too and its heads in up "
                             "to 8 chunks (whole query groups; parts of groups at CP=1; "
                             "--memo-attention-*). The untiled variant is "
                             "traced only when its tiled one reaches the table")
    search.add_argument("--optimizer-offload-fractions", default="0",
                        help="optimizer CPU offload fractions searched (comma-separated, each "
                             "in [0, 1]; default 0: the optimizer on the device). A fraction F "
                             "> 0 is the trainer's --use-distributed-optimizer "
                             "--optimizer-cpu-offload --optimizer-offload-fraction F; it moves "
                             "persistent state only, so its layouts share the activation "
                             "traces of the same layout without it")
    search.add_argument("--pp-sizes", default="1",
                        help="pipeline sizes searched for the traced policies (comma-separated; "
                             "default 1); SPPO's solver searches every pipeline size")
    search.add_argument("--micro-batch-sizes", default="1",
                        help="micro-batch sizes searched (comma-separated)")
    search.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    parser.add_argument("--json", action="store_true",
                        help="print the answer as one JSON object on stdout (progress goes to "
                             "stderr)")
    parser.add_argument("--exhaustive", action="store_true",
                        help="trace the whole stage at every length probed and bisect (the "
                             "reference the symbolic traces and the solver are checked "
                             "against; slow)")
    parser.add_argument("--jobs", type=int, default=2, help="traces run in parallel")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="trace cache (default $MEMO_ESTIMATE_CACHE or "
                             "~/.cache/megatron-memo/traces)")
    parser.add_argument("--no-cache", action="store_true", help="trace afresh, keep nothing")
    add_verbose_argument(parser)
    return parser


def _sizes(opts: argparse.Namespace) -> tuple:
    """(TP, CP, PP) as given (None: not given)."""
    return (opts.tensor_model_parallel_size, opts.context_parallel_size,
            opts.pipeline_model_parallel_size)


class UsageError(ValueError):
    """Bad command-line input (one line)."""


def _fail(message: str) -> int:
    print(f"estimate.py: error: {message}", file=sys.stderr)
    return 2


def _numbers(text: str, flag: str, kind=float) -> list:
    try:
        return [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text}: give comma-separated numbers") from None


def traced_model_and_shape(name: str) -> tuple[TracedModel, dict]:
    """The network the tracer builds for --model, and its shape (for the recommender's
    pruning)."""
    if name in MODELS:
        return traced_model(name), model_shape(name)
    try:
        shape = model_shape(name)
    except ModelError as exc:
        raise UsageError(str(exc)) from None
    return traced_model(None, shape), shape


def _memory_lines(memory, device_bytes: int, label: str, verdict: str) -> list[str]:
    return [f"{label}peak {memory.peak_reserved_bytes / GiB:.2f} GiB reserved + "
            f"{memory.external_bytes / GiB:.2f} GiB outside the allocator = "
            f"{memory.peak_device_bytes / GiB:.2f} of {device_bytes / GiB:.2f} GiB per rank: "
            f"{verdict}",
            "  live at the peak: " + ", ".join(
                f"{name} {nbytes / GiB:.2f} GiB"
                for name, nbytes in sorted(memory.peak_by_category.items(),
                                           key=lambda kv: -kv[1]) if nbytes),
            f"  fragmentation {memory.fragmentation:.1%}, reorganisations in 3 iterations "
            f"{memory.reorganisations}"]


def describe(prediction, device_bytes: int) -> list[str]:
    """The prediction's lines: memory (per traced pipeline stage when PP > 1), host memory,
    the slowest stage's time and the MFU; an SPPO prediction's are the solver's report."""
    if isinstance(prediction, SPPOPrediction):
        return prediction.lines()
    if len(prediction.stages) == 1:
        lines = _memory_lines(prediction.memory, device_bytes, f"seq {prediction.seq}: ",
                              prediction.verdict())
    else:
        lines = [f"seq {prediction.seq}: {prediction.verdict()}"]
        for stage in prediction.stages:
            in_flight = stage.stage.microbatches_in_flight
            lines += _memory_lines(
                stage.memory, device_bytes,
                f" stage {stage.stage.index} (rank {stage.stage.rank}, {in_flight} "
                f"micro-batch{'es' if in_flight > 1 else ''} in flight): ",
                "FITS" if stage.memory.fits else "OOM")
    step = prediction.step
    host = prediction.host_memory
    optimizer = host.terms.get("optimizer_offload", 0)
    if host.arena_bytes:  # per rank: the node's host bytes but the offloaded optimizer's
        lines.append(f"  host memory for offloaded activations: "
                     f"{(host.total_bytes - optimizer) / prediction.ranks_per_node / GiB:.2f} "
                     f"GiB per rank, {prediction.host_bytes_per_node / 1e9:.0f} of "
                     f"{prediction.host_capacity_bytes / 1e9:.0f} GB per node")
    if optimizer:
        lines.append(f"  host memory for the offloaded optimizer: {optimizer / 1e9:.1f} GB per "
                     f"node; the node in all: {host.describe()}")
    slowest = "" if len(prediction.stages) == 1 else " (the slowest traced stage)"
    lines.append(f"  time{slowest}: {step.breakdown()}")
    global_batch = step.microbatches * prediction.layout.dp * prediction.layout.micro_batch
    lines.append(f"  predicted MFU {step.mfu:.1%} ({prediction.layout.gpus} GPUs, "
                 f"{global_batch} sequences per iteration)")
    lines.append(f"  flags: pretrain_gpt.py {' '.join(trainer_flags(prediction, global_batch))}")
    return lines


def table(predictions, top: int) -> list[str]:
    lines = ["| # | layout | seq | peak GiB/rank | host GB/node | step s | MFU | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for index, p in enumerate(predictions[:top], 1):
        lines.append(f"| {index} | {p.describe()} | {p.seq} | "
                     f"{p.peak_device_bytes / GiB:.1f} | "
                     f"{p.host_bytes_per_node / 1e9:.0f} | {p.step_s:.1f} | "
                     f"{p.mfu:.1%} | {p.verdict()} |")
    return lines


def trainer_flags(prediction, global_batch: int) -> list[str]:
    """The ready-to-run pretrain_gpt.py flags of a row (traced layout or SPPO plan)."""
    if isinstance(prediction, SPPOPrediction):
        return prediction.trainer_flags(global_batch)
    return prediction.layout.trainer_flags(prediction.seq, global_batch)


def flag_lines(predictions, top: int, global_batch: int) -> list[str]:
    """One ``#N: pretrain_gpt.py FLAGS`` line per row of :func:`table`."""
    return [f"#{index}: pretrain_gpt.py {' '.join(trainer_flags(p, global_batch))}"
            for index, p in enumerate(predictions[:top], 1)]


def answer_json(opts, predictions, seconds: float, hardware: dict) -> dict:
    """--json's object: the question, each row (best first), which kernel rows priced them
    and the time taken."""
    rows = [{"layout": p.describe(), "seq": p.seq, "fits": p.fits, "verdict": p.verdict(),
             "peak_device_gib": round(p.peak_device_bytes / GiB, 3),
             "host_gb_per_node": round(p.host_bytes_per_node / 1e9, 3),
             "step_s": p.step_s, "mfu": p.mfu,
             "trainer_flags": trainer_flags(p, opts.global_batch_size)} for p in predictions]
    return {"model": opts.model, "gpu": opts.gpu, "gpus": opts.gpus,
            "question": "max_seq_length" if opts.max_seq_length else "seq_length",
            "seq_length": opts.seq_length, "rows": rows,
            "max_seq_length": rows[0]["seq"] if rows and opts.max_seq_length else None,
            "kernel_rows": priced_rows(hardware).source, "predicted": True,
            "seconds": round(seconds, 1)}


@contextlib.contextmanager
def _answer_stream(json_answer: bool):
    """The stream the answer goes to. With --json, stdout carries the JSON object alone: while
    the estimate runs, file descriptor 1 points at stderr, so that nothing else writing to it
    (HiGHS prints a banner from C when the arena planner's MIP first runs) can corrupt it."""
    if not json_answer:
        yield sys.stdout
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with os.fdopen(os.dup(saved), "w", encoding="utf-8") as answer:
            yield answer
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    explain_hidden(opts.verbose)
    hide_highs_banner()
    with _answer_stream(opts.json) as answer:
        return _estimate(opts, answer)


def _estimate(opts: argparse.Namespace, answer) -> int:
    from memo_ext.estimate import EstimateError
    from memo_ext.estimate.cost import CostModelError
    from memo_ext.estimate.layout import (
        CHECK_SEQ,
        FIT_SEQS,
        Layout,
        Progress,
        TraceCache,
        build_layout_model,
        build_models,
        candidate_layouts,
        default_cache_dir,
    )
    from memo_ext.estimate.search import LongestRanking, SearchChecks, rank_at, search_longest
    from memo_ext.hardware import HardwareProfileError, load_hardware

    started = time.perf_counter()
    # With --json, stdout carries the answer alone; progress goes to stderr.
    out = sys.stderr if opts.json else sys.stdout

    # Lines come from several threads at once (the first batch's builders log while SPPO's
    # rows are solved): print writes a line and its newline separately.
    said = threading.Lock()

    def say(line: str = "") -> None:
        with said:
            print(line, file=out, flush=True)

    try:
        network, shape = traced_model_and_shape(opts.model)
        cpu = opts.gpu.lower() == CPU_PROFILE
        if cpu:
            check_cpu_question(opts, shape)
        # --gpu cpu is measured once the layout is known (below).
        hardware = None if cpu else load_hardware(opts.gpu, opts.hardware_file)
        device = None if cpu else int(hardware["device_memory_bytes"])
        cache = TraceCache(None if opts.no_cache else (opts.cache_dir or default_cache_dir()),
                           workers=opts.jobs)
        if opts.recompute_num_layers is not None and opts.policy != "megatron-block":
            raise UsageError("--recompute-num-layers applies to --policy megatron-block only "
                             "(megatron full recompute is 1 layer per block, uniform)")
        fixed_layout = any(v is not None for v in _sizes(opts))
        searching = bool(opts.recommend or (opts.gpus and not fixed_layout))
        optimizer_offload = optimizer_offload_fraction(opts, searching)
        fsdp_strategy = megatron_fsdp_strategy(opts, fixed_layout)
        check_grad_reduce_in_bf16(opts, fixed_layout)
        if searching:
            if not opts.gpus:
                raise UsageError("--recommend needs --gpus N")
            if opts.memo_tile_norms and not any(_numbers(opts.mlp_tiles, "--mlp-tiles", int)):
                raise UsageError("--memo-tile-norms runs the norms inside the tiles; the search's "
                                 f"--mlp-tiles {opts.mlp_tiles} has no tiled layout")
            if opts.recommend:
                policies = [p.strip() for p in opts.policies.split(",") if p.strip()]
            else:  # the best layout for --policy
                policies = [opts.policy]
                if opts.memo_alpha is not None:
                    opts.alphas = opts.memo_alpha
            unknown = [p for p in policies if p not in POLICIES]
            if unknown:
                raise UsageError(f"--policies: unknown {', '.join(unknown)}; use "
                                 f"{', '.join(POLICIES)}")
            alphas = _numbers(opts.alphas, "--alphas")
            if any(not 0 <= a <= 1 for a in alphas):
                raise UsageError(f"--alphas {opts.alphas}: each in [0, 1]")
            traced = [p for p in policies if p != "sppo"]
            fractions = _numbers(opts.block_recompute_fractions, "--block-recompute-fractions")
            if any(not 0 < f < 1 for f in fractions):
                raise UsageError(f"--block-recompute-fractions {opts.block_recompute_fractions}:"
                                 " each strictly between 0 and 1")
            tiles = _numbers(opts.mlp_tiles, "--mlp-tiles", int)
            if any(k < 0 for k in tiles):
                raise UsageError(f"--mlp-tiles {opts.mlp_tiles}: each 0 (untiled) or a tile "
                                 "count >= 1")
            buffers = _numbers(opts.offload_buffers, "--offload-buffers", int)
            if any(b not in (1, 2) for b in buffers):
                raise UsageError(f"--offload-buffers {opts.offload_buffers}: each 1 or 2")
            checkpoints = _numbers(opts.checkpoint_fractions, "--checkpoint-fractions")
            if any(not 0 <= f <= 1 for f in checkpoints):
                raise UsageError(f"--checkpoint-fractions {opts.checkpoint_fractions}: each in "
                                 "[0, 1]")
            optimizer_offloads = searched_optimizer_offloads(opts, optimizer_offload)
            layouts, dropped = candidate_layouts(
                shape, opts.gpus, hardware, policies=traced, alphas=alphas,
                micro_batches=_numbers(opts.micro_batch_sizes, "--micro-batch-sizes", int),
                global_batch=opts.global_batch_size,
                pipeline_sizes=_numbers(opts.pp_sizes, "--pp-sizes", int),
                block_fractions=fractions, checkpoint_fractions=checkpoints,
                offload_fp8={"off": (False,), "on": (True,), "both": (False, True)}[
                    opts.offload_fp8], mlp_tiles=tuple(tiles),
                offload_buffers=tuple(buffers),
                optimizer_offloads=optimizer_offloads,
                tile_norms=opts.memo_tile_norms) if traced else ([], [])
            sppo_models, sppo_dropped = sppo_layout_models(
                shape, opts.gpus, hardware, global_batch=opts.global_batch_size,
                host_memory_gb_per_node=opts.host_memory_gb,
                seq=opts.seq_length) if "sppo" in policies \
                else ([], [])
            say(f"{'recommend' if opts.recommend else 'layout search'}: {opts.model} on "
                  f"{opts.gpus} x {opts.gpu}, policies {', '.join(policies)}, {len(layouts)} "
                  f"layouts to trace ({len(dropped)} ruled out before tracing)"
                  + (f", {len(sppo_models)} SPPO layouts from its analytic model "
                     f"({len(sppo_dropped)} ruled out)" if "sppo" in policies else ""))
            say(f"  {kernel_rows_line(hardware)}")
            progress = Progress(len(layouts), lambda line: say(f"  {line}"))

            def build(wanted: list) -> list:
                models, failed = build_models(
                    network, wanted, hardware, global_batch=opts.global_batch_size,
                    cache=cache, jobs=opts.jobs, host_memory_gb_per_node=opts.host_memory_gb,
                    num_layers=shape["num_layers"], exhaustive=opts.exhaustive,
                    trust=not opts.max_seq_length, progress=progress)
                for layout, reason in failed:
                    say(f"  not predicted: {layout.describe()}: {reason}")
                return models

            with cache:
                if opts.max_seq_length:
                    checks = SearchChecks(cache, opts.jobs)
                    try:
                        ranking = LongestRanking(SEARCH_STEP, opts.search_max, FINE_STEP,
                                                 top=opts.top, log=lambda line: say(f"  {line}"),
                                                 checks=checks)
                        ranked = search_longest(layouts, build, ranking, untraced=sppo_models,
                                                log=progress, batch=2 * opts.jobs)
                    finally:
                        checks.close()
                else:
                    models = build(layouts) + sppo_models
                    ranked = [p for p in rank_at(models, opts.seq_length) if p.fits]
            seconds = time.perf_counter() - started
            for line in table(ranked, opts.top) + flag_lines(ranked, opts.top,
                                                              opts.global_batch_size):
                say(line)
            say(f"estimated in {seconds:.1f} s")
            if opts.json:
                print(json.dumps(answer_json(opts, ranked[:opts.top], seconds, hardware)),
                  file=answer)
            if not ranked:
                say("no layout fits" + ("" if opts.max_seq_length
                                        else f" at {opts.seq_length} tokens"))
                return 1
            best = ranked[0]
            say(f"best: {best.describe()}")
            for text in describe(best, device):
                say(text)
            if opts.max_seq_length:
                say(f"max sequence length: {best.seq} tokens, predicted MFU "
                    f"{best.mfu * 100:.1f}%")
            return 0

        tp, cp, pp = (size or 1 for size in _sizes(opts))
        opts.tensor_model_parallel_size, opts.context_parallel_size = tp, cp
        opts.pipeline_model_parallel_size = pp
        model_parallel = tp * cp * pp
        gpus = opts.gpus or model_parallel
        try:
            dp = data_parallel_size(gpus, model_parallel)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        alpha = traced_offload_config(opts).fixed_alpha if opts.policy == "memo" else None
        if opts.policy == "sppo":
            return _fixed_sppo_layout(opts, shape, hardware, gpus, started)
        recompute_layers = None
        if opts.policy == "megatron-block":
            stage_layers = shape["num_layers"] // pp
            if opts.recompute_num_layers is None or not \
                    1 <= opts.recompute_num_layers <= stage_layers:
                raise UsageError(f"--policy megatron-block needs --recompute-num-layers K, 1 <= K"
                                 f" <= {stage_layers} (the layers of a stage)")
            recompute_layers = opts.recompute_num_layers
        if opts.memo_mlp_tiles < 0:
            raise UsageError(f"--memo-mlp-tiles {opts.memo_mlp_tiles}: give 0 (untiled) or a "
                             "tile count >= 1")
        if opts.memo_attention_projection_tiles < 0:
            raise UsageError(f"--memo-attention-projection-tiles "
                             f"{opts.memo_attention_projection_tiles}: give 0 (untiled) or a "
                             "tile count >= 1")
        attention = config_from_args(AttentionConfig, opts)  # the trainer's rules
        attention.validate()
        attention.validate_with(
            shape["num_attention_heads"] // tp,
            (shape.get("num_query_groups") or shape["num_attention_heads"]) // tp)
        if opts.memo_tile_norms and not (opts.memo_mlp_tiles
                                         or opts.memo_attention_projection_tiles):
            raise UsageError("--memo-tile-norms runs the norms inside the tiles; give "
                             "--memo-mlp-tiles or --memo-attention-projection-tiles, or drop it")
        if (opts.memo_checkpoint_layers or opts.memo_offload_fp8
                or opts.memo_offload_buffers != 2) and opts.policy != "memo":
            raise UsageError("--memo-checkpoint-layers, --memo-offload-fp8 and "
                             "--memo-offload-buffers apply to --policy memo only")
        layout = Layout(tp, cp, pp, dp, opts.policy, alpha,
                        opts.micro_batch_size, recompute_layers,
                        checkpoint_layers=opts.memo_checkpoint_layers,
                        offload_fp8=opts.memo_offload_fp8, mlp_tiles=opts.memo_mlp_tiles,
                        offload_buffers=opts.memo_offload_buffers,
                        projection_tiles=opts.memo_attention_projection_tiles,
                        head_chunks=opts.memo_attention_head_chunks,
                        tile_norms=opts.memo_tile_norms,
                        optimizer_offload=optimizer_offload,
                        megatron_fsdp=fsdp_strategy,
                        fsdp_double_buffer=opts.fsdp_double_buffer,
                        fsdp_unit_size=opts.suggested_communication_unit_size,
                        grad_reduce_in_bf16=opts.grad_reduce_in_bf16)
        if cpu:
            hardware = cpu_hardware(layout, shape, opts.seq_length, say)
            device = int(hardware["device_memory_bytes"])
        with cache:
            model, refused = build_layout_model(
                network, layout, hardware, cache=cache, exhaustive=opts.exhaustive or cpu,
                global_batch=opts.global_batch_size, allocator=opts.allocator,
                host_memory_gb_per_node=opts.host_memory_gb, num_layers=shape["num_layers"])
        how = ("traced whole at every length probed" if opts.exhaustive or cpu else
               f"traces at {FIT_SEQS[0]} and {FIT_SEQS[1]} tokens"
               + ("" if refused or all(m.symbolic is None for m in model.stages) else
                  f" of {model.stages[0].symbolic.layers} layers, checked at {CHECK_SEQ} "
                  "tokens"))
        say(f"estimate: {opts.model} on {opts.gpu} ({device / GiB:.2f} GiB per GPU), "
            f"{gpus} GPUs: {layout.describe()}, {model.allocator} allocator model, "
            f"rank{'s' if len(model.stages) > 1 else ''} "
            f"{', '.join(str(m.stage.rank) for m in model.stages)} traced (predicted; {how})")
        say(f"  {kernel_rows_line(hardware)}")
        if refused:
            say(f"  {refused}")
        if opts.seq_length is not None:
            prediction = model.predict(opts.seq_length)
            for text in describe(prediction, device):
                say(text)
            if opts.json:
                print(json.dumps(answer_json(opts, [prediction], time.perf_counter() - started,
                                             hardware)), file=answer)
            return 0
        longest = model.longest(SEARCH_STEP, opts.search_max, FINE_STEP)
        mfu = "n/a (nothing fits)"
        predictions = []
        if longest:
            prediction = model.predict(longest)
            predictions.append(prediction)
            for text in describe(prediction, device):
                say(text)
            mfu = f"{prediction.step.mfu * 100:.1f}%"
            if getattr(model, "replays", None):  # the solver's (not an exhaustive search)
                above = "" if any(seq > longest for seq, _ in model.replays) else \
                    "; every longer length OOM by its allocated-peak bound"
                say("  solved: replayed " + ", ".join(
                    f"{seq} ({'fits' if fits else 'OOM'})" for seq, fits in model.replays)
                    + above)
        seconds = time.perf_counter() - started
        say(f"estimated in {seconds:.1f} s")
        say(f"max sequence length: {longest} tokens, predicted MFU {mfu}")
        if opts.json:
            print(json.dumps(answer_json(opts, predictions, seconds, hardware)), file=answer)
        return 0
    except (UsageError, MemoConfigError, EstimateError, HardwareProfileError,
            CostModelError) as exc:
        return _fail(str(exc))


def optimizer_offload_fraction(opts: argparse.Namespace, searching: bool):
    """--optimizer-offload-fraction with --optimizer-cpu-offload, else None; the trainer's rules
    (megatron.training.arguments) and this tool's: not SPPO's analytic model, and
    --optimizer-offload-fractions for a search only (``searching``), in its stead."""
    fraction = opts.optimizer_offload_fraction
    if not searching and opts.optimizer_offload_fractions != OFFLOAD_FRACTIONS_DEFAULT:
        raise UsageError("--optimizer-offload-fractions is searched by --recommend; for one "
                         "layout give --optimizer-cpu-offload --optimizer-offload-fraction F")
    if not opts.optimizer_cpu_offload:
        if fraction != 1.0:
            raise UsageError("--optimizer-offload-fraction has no effect without "
                             "--optimizer-cpu-offload; add it or drop the flag")
        return None
    if not 0.0 <= fraction <= 1.0:
        raise UsageError(f"--optimizer-offload-fraction must be in [0, 1], got {fraction}")
    if not opts.use_distributed_optimizer:
        raise UsageError("--optimizer-cpu-offload needs --use-distributed-optimizer (as the "
                         "trainer); add it")
    if opts.optimizer_offload_fractions != OFFLOAD_FRACTIONS_DEFAULT:
        raise UsageError("--optimizer-offload-fractions searches fractions; give it or "
                         "--optimizer-cpu-offload --optimizer-offload-fraction F, not both")
    if opts.policy == "sppo" and not opts.recommend:
        raise UsageError("--optimizer-cpu-offload --policy sppo: SPPO's analytic model has no "
                         "optimizer offload; use another --policy")
    return fraction


#: --optimizer-offload-fractions' default: today's search, the optimizer on the device.
OFFLOAD_FRACTIONS_DEFAULT = "0"


def searched_optimizer_offloads(opts: argparse.Namespace, given) -> tuple:
    """The optimizer offload fractions a search tries, as Layout.optimizer_offload (None: the
    optimizer on the device): --optimizer-offload-fractions, or the one fraction of
    --optimizer-cpu-offload --optimizer-offload-fraction F (``given``)."""
    if given is not None:
        return (given,)
    fractions = _numbers(opts.optimizer_offload_fractions, "--optimizer-offload-fractions")
    if not fractions or any(not 0 <= f <= 1 for f in fractions):
        raise UsageError(f"--optimizer-offload-fractions {opts.optimizer_offload_fractions}: "
                         "give each in [0, 1] (0: the optimizer on the device)")
    return tuple(dict.fromkeys(f or None for f in fractions))


def check_grad_reduce_in_bf16(opts: argparse.Namespace, fixed_layout: bool) -> None:
    """--grad-reduce-in-bf16 is estimated for one traced layout: the user's numerics choice,
    which the recommender does not make for them, and SPPO's analytic model has fp32
    gradients."""
    if not opts.grad_reduce_in_bf16:
        return
    if opts.recommend or not fixed_layout:
        raise UsageError("--grad-reduce-in-bf16 is estimated for one layout: give its parallel "
                         "sizes (--tensor-model-parallel-size, ...), not a search")
    if opts.policy == "sppo":
        raise UsageError("--grad-reduce-in-bf16 --policy sppo: SPPO's analytic model keeps fp32 "
                         "gradients; use another --policy")


def megatron_fsdp_strategy(opts: argparse.Namespace, fixed_layout: bool):
    """--data-parallel-sharding-strategy with --use-megatron-fsdp, else None; the trainer's rules
    (megatron.training.megatron_fsdp.validate_megatron_fsdp, those a layout can break) and this
    tool's: one layout, traced (not SPPO's analytic model)."""
    if not opts.use_megatron_fsdp:
        for flag, given in (("--data-parallel-sharding-strategy",
                             opts.data_parallel_sharding_strategy != "no_shard"),
                            ("--fsdp-double-buffer", opts.fsdp_double_buffer),
                            ("--suggested-communication-unit-size",
                             opts.suggested_communication_unit_size is not None)):
            if given:
                raise UsageError(f"{flag} applies to --use-megatron-fsdp; add it or drop the "
                                 "flag")
        return None
    if opts.data_parallel_sharding_strategy == "no_shard":
        raise UsageError("--use-megatron-fsdp needs --data-parallel-sharding-strategy optim, "
                         "optim_grads or optim_grads_params (the trainer refuses no_shard); "
                         "add it")
    if not opts.use_distributed_optimizer:
        raise UsageError("--use-megatron-fsdp needs --use-distributed-optimizer (as the "
                         "trainer); add it")
    if opts.recommend or not fixed_layout:
        raise UsageError("--use-megatron-fsdp is estimated for one layout: give its parallel "
                         "sizes (--tensor-model-parallel-size, ...), not --recommend")
    if (opts.pipeline_model_parallel_size or 1) > 1:
        raise UsageError("--use-megatron-fsdp does not run with "
                         "--pipeline-model-parallel-size > 1 (megatron-core 0.16.1); use PP=1")
    if opts.policy == "sppo":
        raise UsageError("--use-megatron-fsdp --policy sppo: SPPO's analytic model has no "
                         "Megatron-FSDP; use another --policy")
    return opts.data_parallel_sharding_strategy


def check_cpu_question(opts: argparse.Namespace, shape: dict) -> None:
    """--gpu cpu answers one fixed layout at one length (its kernels are measured there);
    anything else is refused in one line."""
    if opts.recommend or (opts.gpus and all(v is None for v in _sizes(opts))):
        raise UsageError("--gpu cpu measures this machine for one layout: give "
                         "--tensor-model-parallel-size/--context-parallel-size/"
                         "--pipeline-model-parallel-size instead of a layout search")
    if opts.seq_length is None:
        raise UsageError("--gpu cpu predicts one --seq-length (its kernels are measured at "
                         "that length); give --seq-length instead of --max-seq-length")
    if opts.policy == "sppo":
        raise UsageError("--gpu cpu --policy sppo: SPPO's analytic model has no CPU profile; "
                         "use megatron, megatron-none, megatron-block or memo")
    if opts.hardware_file is not None:
        raise UsageError("--hardware-file does not apply to --gpu cpu (its profile is "
                         "measured); drop it")
    if not shape.get("ffn_hidden_size"):
        raise UsageError(f"--model {opts.model}: --gpu cpu measures the MLP's GEMMs; give "
                         "ffn_hidden_size in the model file")


def cpu_hardware(layout, shape: dict, seq: int, say) -> dict:
    """The cpu profile micro-benchmarked for ``layout`` at ``seq`` tokens (one process per
    rank, the cores shared out), or a UsageError naming what cannot be measured."""
    from memo_ext.estimate.cpu_profile import CpuProfileError, measure_cpu_profile

    say(f"measuring this machine for {layout.gpus} rank(s) (the cpu profile)")
    try:
        return measure_cpu_profile(
            {**shape, "seq_length": seq},
            {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp,
             "micro_batch_size": layout.micro_batch}, ranks=layout.gpus, log=say)
    except CpuProfileError as exc:
        raise UsageError(str(exc)) from None


def _fixed_sppo_layout(opts, shape: dict, hardware: dict, gpus: int, started: float) -> int:
    """--policy sppo with --tensor-model-parallel-size/--pipeline-model-parallel-size: the
    solver's best N (and MSP) for that layout."""
    from memo_ext.sppo.solver import SolverError

    tp, cp, pp = _sizes(opts)
    if cp != 1:
        raise UsageError(f"--policy sppo --context-parallel-size {cp}: SPPO splits the sequence "
                         "over the pipeline, not over context-parallel ranks; give "
                         "--context-parallel-size 1")
    if opts.micro_batch_size != 1:
        raise UsageError("--policy sppo plans micro-batch 1; drop --micro-batch-size")
    model = SPPOLayoutModel(shape, gpus, hardware, tp, pp, opts.global_batch_size,
                            None if opts.host_memory_gb is None else opts.host_memory_gb * 1e9)
    device = int(hardware["device_memory_bytes"])
    print(f"estimate: {opts.model} on {opts.gpu} ({device / GiB:.2f} GiB per GPU), {gpus} "
          f"GPUs: TP={tp} PP={pp} DP={model.dp} SPPO (analytic model, "
          "memo_ext/sppo/solver.py; predicted)")
    print(f"  {kernel_rows_line(hardware)}")
    try:
        if opts.seq_length is not None:
            for text in model.predict(opts.seq_length - opts.seq_length % model.multiple).lines():
                print(text)
            return 0
        longest = model.longest(SEARCH_STEP, opts.search_max, FINE_STEP)
    except SolverError as exc:
        raise UsageError(str(exc)) from None
    mfu = "n/a (nothing fits)"
    if longest:
        prediction = model.predict(longest)
        for text in prediction.lines():
            print(text)
        mfu = f"{prediction.mfu * 100:.1f}%"
    print(f"estimated in {time.perf_counter() - started:.1f} s")
    print(f"max sequence length: {longest} tokens, predicted MFU {mfu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
