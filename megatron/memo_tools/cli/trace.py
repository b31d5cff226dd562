"""Record the device-memory allocation trace of one training iteration of one rank.

    python tools/trace.py --model 7b --seq-length 1048576 --tensor-model-parallel-size 4 \\
        --context-parallel-size 2 --gpus 8 --rank 0 --bf16 --use-distributed-optimizer \\
        -o trace.jsonl.gz

The flags the trainer has are spelled and mean as pretrain_gpt.py's (the parallel sizes,
--use-distributed-optimizer, --untie-embeddings-and-output-weights); --gpus is the job's GPU
count, as tools/estimate.py's.

The command line becomes a typed request (memo_ext.trace.request.TraceRequest) that
the tracer engine, megatron.training.tracing, builds and records: the trainer's own model, built
its way, on fake tensors and a fake process group (``--live``: real CPU tensors, small models
only; same events). The estimator sends the engine the same requests, without a command line.

Writes gzipped JSON lines (header, then one event per line; docs/tracing.md) and prints a
summary: events, peak live bytes, bytes by category at the peak, per-layer forward skeletal
bytes against docs/memo.md "Skeletal activations per layer": 16·b·s·h/(TP·CP).
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import argparse
import os
import resource
import shlex
import sys

import torch

GiB = 1 << 30
MiB = 1 << 20

from megatron.memo_tools.cli.quiet import (  # noqa: E402
    add_verbose_argument,
    explain_hidden,
    hide_library_warnings,
)

hide_library_warnings()  # before memo_ext's first import of megatron.core (cli/quiet.py)

# Presets (layers, hidden, ffn hidden, heads) and the default vocabulary: one definition, shared
# with tools/estimate.py and tools/sppo_plan.py.
from memo_ext.estimate.models import DEFAULT_VOCAB_SIZE, MODELS  # noqa: E402
from memo_ext.estimate.models import traced_model as traced_model_of  # noqa: E402
from memo_ext.trace.request import TracedModel, TraceRequest  # noqa: E402
from memo_ext.trace.cuda_rules import DEFAULT_GPU  # noqa: E402
from memo_ext.config import (  # noqa: E402
    AttentionConfig,
    MemoConfigError,
    OffloadConfig,
    TiledMLPConfig,
    ToolVariant,
    add_config_flags,
)
from memo_ext.flags import refused_value  # noqa: E402
from megatron.training.arguments import (  # noqa: E402
    add_grad_reduce_in_bf16_arg,
    add_model_shape_args,
    add_optimizer_offload_args,
)
#: The trainer's OffloadConfig flags a traced layout takes (tools/trace.py, tools/estimate.py).
TRACED_OFFLOAD_FLAGS = ("offload", "alpha", "checkpoint_layers", "offload_fp8", "offload_buffers")
#: How a traced layout takes them: fixed values only. 'auto' needs what a trace does not have
#: (measured layer times for alpha, host memory for the checkpoint count).
TRACED_OFFLOAD_VARIANTS = {
    "alpha": ToolVariant(
        note="Traced layouts (tools/trace.py; tools/estimate.py --policy memo, whose layout "
             "search tries --alphas instead): a number only, "
             "default 0 ('auto' solves the LP from measured layer times, which a trace cannot "
             "measure).",
        default=None, argparse={"metavar": "ALPHA"},
        refuse={"auto": "solves the LP from measured layer times, which a trace cannot "
                        "measure; give --memo-alpha A (0 <= A <= 1)"}),
    "checkpoint_layers": ToolVariant(
        note="Traced layouts: a count only, default 0 ('auto' reads host memory, which a trace "
             "does not model).",
        default=0, type=int, argparse={"metavar": "N"}),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Allocation trace of one training iteration of one rank "
                    "(gzipped JSON lines; see docs/tracing.md).", allow_abbrev=False)
    model = parser.add_argument_group("model (--model or explicit shape flags)")
    model.add_argument("--model", choices=sorted(MODELS), default=None,
                       help="Shape of examples/configs/gpt_<model>.sh.")
    # The trainer's definitions (megatron.training.arguments.MODEL_SHAPE_FLAGS); the flags
    # below them differ from the trainer's (defaults of a traced model, GQA implied).
    add_model_shape_args(model)
    model.add_argument("--num-query-groups", type=int, default=None,
                       help="Grouped-query attention with this many K/V groups.")
    model.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    model.add_argument("--position-embedding-type", default="rope",
                       choices=("rope", "learned_absolute"))
    model.add_argument("--disable-bias-linear", action="store_true")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="The trainer's flag: separate input embedding and output layer "
                            "weights (tied without it, as the trainer). --model's presets untie "
                            "them, as examples/configs.")
    model.add_argument("--attention-dropout", type=float, default=0.0)
    model.add_argument("--hidden-dropout", type=float, default=0.0)

    layout = parser.add_argument_group("layout")
    layout.add_argument("--seq-length", type=int, required=True, help="Tokens per sequence.")
    layout.add_argument("--micro-batch-size", type=int, default=1)
    add_layout_arguments(layout, default_size=1)
    layout.add_argument("--rank", type=int, default=0,
                        help="Global rank whose trace is recorded (megatron's rank order).")
    layout.add_argument("--no-sequence-parallel", action="store_true",
                        help="Turn off sequence parallelism (on by default when TP > 1).")
    layout.add_argument("--microbatches-in-flight", type=int, default=1,
                        help="Forwards recorded before the backwards (1F1B keeps PP - stage "
                             "micro-batches in flight on a stage).")

    training = parser.add_argument_group("training")
    training.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                          help="bf16 parameters and activations (--no-bf16, later on the line, "
                               "undoes it: the cpu profile's fp32 trainer).")
    training.add_argument("--fp16", action="store_true")
    training.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    training.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                          help="Default uniform with --recompute-granularity full.")
    training.add_argument("--recompute-num-layers", type=int, default=None)
    # The trainer's --memo-* flags, generated from memo_ext.config (one definition each).
    add_config_flags(training, OffloadConfig, fields=TRACED_OFFLOAD_FLAGS,
                     variants=TRACED_OFFLOAD_VARIANTS)
    add_config_flags(training, TiledMLPConfig, fields=("mlp_tile_size",))
    add_tiling_arguments(training)
    training.add_argument("--use-distributed-optimizer", action="store_true",
                          help="The trainer's flag: shard optimizer state over data-parallel "
                               "ranks (without it, replicated on every DP rank, as the trainer).")
    training.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    add_optimizer_offload_args(training, ("--optimizer-cpu-offload",
                                          "--optimizer-offload-fraction",
                                          "--overlap-cpu-optimizer-d2h-h2d", "--no-pin-cpu-grads",
                                          "--no-pin-cpu-params"))
    add_grad_reduce_in_bf16_arg(training)
    training.add_argument("--trainer-args", default="", metavar="'FLAGS'",
                          help="More pretrain_gpt.py flags for the traced model, appended to "
                               "the trainer command line (shell-split; write it with '=' when "
                               "it is one flag), e.g. --trainer-args='--cross-entropy-loss-fusion "
                               "--cross-entropy-fusion-impl chunked' (docs/loss.md).")

    trace = parser.add_argument_group("trace")
    trace.add_argument("-o", "--output", default=None, help="Trace file (.jsonl.gz).")
    trace.add_argument("--snapshot", default=None, metavar="PATH",
                       help="Also write the trace as a PyTorch memory snapshot pickle, to open in "
                            "https://pytorch.org/memory_viz (Active Memory Timeline).")
    trace.add_argument("--live", action="store_true",
                       help="Real CPU tensors instead of FakeTensors (small models only).")
    trace.add_argument("--warmup", choices=("auto", "forward", "iteration", "none"),
                       default="auto",
                       help="How the steady state is reached before recording (see "
                            "memo_ext.trace.record_iteration): 'none' traces the first "
                            "iteration; 'auto' is 'iteration' with --memo-offload, else "
                            "'forward'.")
    trace.add_argument("--no-flash-workspace", action="store_true",
                       help="Do not record what the attention tiles' CUDA kernels allocate "
                            "besides their outputs (workspaces, split-KV accumulators, GQA's "
                            "expanded K/V) -- FlashAttention-2's, or cuDNN's where the trainer "
                            "dispatches it on the --gpu (Hopper with --attention-backend auto); "
                            "stated next to the kernels in memo_ext.attention.kernels.")
    trace.add_argument("--gpu", default=DEFAULT_GPU, metavar="PROFILE",
                       help="The GPU (a profile of memo_ext/hardware.json) whose CUDA "
                            "kernels' workspaces the trace records: cuBLAS workspace size, "
                            "reduction scratch (SM count). Default: %(default)s.")
    trace.add_argument("--hardware-file", default=None, metavar="JSON",
                       help="Extra GPU profiles for --gpu (the keys of hardware.json).")
    trace.add_argument("--no-cuda-semantics", action="store_true",
                       help="Record the CPU program as it allocates here: no CUDA allocation "
                            "rules (memo_ext/trace/cuda_rules.py: kernel workspaces, "
                            "autograd's in-place branches, fp32 layer-norm statistics).")
    trace.add_argument("--cuda-context-mib", type=float, default=None,
                       help="Override the CUDA context constant (MiB).")
    trace.add_argument("--cublas-workspace-mib", type=float, default=None,
                       help="cuBLAS workspace per GEMM thread (MiB), as CUBLAS_WORKSPACE_CONFIG "
                            "sets it; default: PyTorch's for the --gpu architecture.")
    trace.add_argument("--nccl-mib-per-communicator", type=float, default=None,
                       help="Override the NCCL buffer constant (MiB per communicator).")
    trace.add_argument("--persistent-only", action="store_true",
                       help="Record only the persistent state (constants, weights, gradient "
                            "buffers, optimizer state) and the optimizer phase's work, without "
                            "running the model: what a symbolic trace of a deeper stage takes "
                            "from that stage (memo_ext/estimate/symbolic.py).")
    trace.add_argument("--quiet", action="store_true", help="No summary on stdout.")
    add_verbose_argument(trace)
    return parser


#: --gpus, the same words in tools/trace.py and tools/estimate.py.
GPUS_HELP = ("GPUs of the job, its world size (default TP x CP x PP, DP 1); "
             "DP = GPUs / (TP x CP x PP)")
#: The parallel sizes' flags, the trainer's (pretrain_gpt.py), by the TraceRequest field each sets.
PARALLEL_SIZE_FLAGS = {"tp": "--tensor-model-parallel-size", "cp": "--context-parallel-size",
                       "pp": "--pipeline-model-parallel-size"}


def add_layout_arguments(group, default_size: int | None, tp_note: str = "") -> None:
    """--gpus and the trainer's parallel-size flags (dest as the trainer's), shared with
    tools/estimate.py; ``default_size`` is each size's default, ``tp_note`` more words on TP."""
    group.add_argument("--gpus", type=int, default=None, metavar="N", help=GPUS_HELP)
    for name, words in (("tp", "Tensor-parallel size"), ("cp", "Context-parallel size"),
                        ("pp", "Pipeline-parallel size")):
        note = tp_note if name == "tp" else ""
        group.add_argument(PARALLEL_SIZE_FLAGS[name], type=int, default=default_size,
                           metavar=name.upper(), help=f"{words} (the trainer's flag){note}.")


def data_parallel_size(gpus: int | None, model_parallel: int) -> int:
    """DP of --gpus ``gpus`` (None: ``model_parallel``, DP 1) over TP x CP x PP =
    ``model_parallel``; ValueError (one line naming --gpus and the fix) when it does not divide."""
    if model_parallel < 1:
        raise ValueError(f"TP x CP x PP = {model_parallel}: give each parallel size >= 1")
    gpus = model_parallel if gpus is None else gpus
    if gpus < 1 or gpus % model_parallel:
        raise ValueError(f"--gpus {gpus} is not a multiple of TP x CP x PP = {model_parallel}; "
                         f"give a multiple of {model_parallel} (DP = GPUs / (TP x CP x PP))")
    return gpus // model_parallel


def model_parallel_size(opts: argparse.Namespace) -> int:
    return (opts.tensor_model_parallel_size * opts.context_parallel_size
            * opts.pipeline_model_parallel_size)


def traced_model(opts: argparse.Namespace) -> TracedModel:
    """The network of --model, overridden by explicit shape flags."""
    given = {"num_layers": opts.num_layers, "hidden_size": opts.hidden_size,
             "ffn_hidden_size": opts.ffn_hidden_size,
             "num_attention_heads": opts.num_attention_heads}
    if opts.model is None:
        missing = [flag for flag, key in (("--num-layers", "num_layers"),
                                          ("--hidden-size", "hidden_size"),
                                          ("--num-attention-heads", "num_attention_heads"))
                   if given[key] is None]
        if missing:
            raise SystemExit(f"error: give --model or {', '.join(missing)}")
    return traced_model_of(opts.model, shape=given, vocab_size=opts.vocab_size,
                           num_query_groups=opts.num_query_groups, kv_channels=opts.kv_channels,
                           position_embedding_type=opts.position_embedding_type,
                           normalization=opts.normalization, swiglu=opts.swiglu,
                           disable_bias_linear=opts.disable_bias_linear,
                           # The trainer's rule (tied unless untied); a preset unties.
                           tie_embeddings=(opts.model is None
                                           and not opts.untie_embeddings_and_output_weights),
                           attention_dropout=opts.attention_dropout,
                           hidden_dropout=opts.hidden_dropout)


def request_from_opts(opts: argparse.Namespace) -> TraceRequest:
    """The typed request of a parsed command line (SystemExit with one line for a value a trace
    cannot take)."""
    if opts.memo_offload:
        try:
            traced_offload_config(opts)
        except MemoConfigError as exc:
            raise SystemExit(f"error: {exc}") from None
    try:
        dp = data_parallel_size(opts.gpus, model_parallel_size(opts))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return TraceRequest(
        model=traced_model(opts), seq_length=opts.seq_length,
        micro_batch_size=opts.micro_batch_size, tp=opts.tensor_model_parallel_size,
        cp=opts.context_parallel_size, pp=opts.pipeline_model_parallel_size, dp=dp,
        rank=opts.rank, sequence_parallel=not opts.no_sequence_parallel,
        microbatches_in_flight=opts.microbatches_in_flight, bf16=opts.bf16, fp16=opts.fp16,
        recompute_granularity=opts.recompute_granularity,
        recompute_method=opts.recompute_method, recompute_num_layers=opts.recompute_num_layers,
        memo_alpha=(float(opts.memo_alpha or 0) if opts.memo_offload else None),
        memo_checkpoint_layers=opts.memo_checkpoint_layers,
        memo_offload_fp8=opts.memo_offload_fp8, memo_offload_buffers=opts.memo_offload_buffers,
        mlp_tiles=opts.memo_mlp_tiles, mlp_tile_size=opts.memo_mlp_tile_size,
        projection_tiles=opts.memo_attention_projection_tiles,
        head_chunks=opts.memo_attention_head_chunks, tile_norms=opts.memo_tile_norms,
        distributed_optimizer=opts.use_distributed_optimizer, optimizer=opts.optimizer,
        optimizer_cpu_offload=opts.optimizer_cpu_offload,
        optimizer_offload_fraction=opts.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=opts.overlap_cpu_optimizer_d2h_h2d,
        pin_cpu_grads=opts.pin_cpu_grads, pin_cpu_params=opts.pin_cpu_params,
        grad_buffer_fp32=not opts.grad_reduce_in_bf16,
        extra_trainer_argv=tuple(shlex.split(opts.trainer_args)), gpu=opts.gpu,
        hardware_file=opts.hardware_file, cuda_semantics=not opts.no_cuda_semantics,
        flash_workspace=not opts.no_flash_workspace, cuda_context_mib=opts.cuda_context_mib,
        cublas_workspace_mib=opts.cublas_workspace_mib,
        nccl_mib_per_communicator=opts.nccl_mib_per_communicator, live=opts.live,
        warmup=opts.warmup, persistent_only=opts.persistent_only)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """A tools/trace.py command line, parsed; a --gpus that TP x CP x PP does not divide is
    the parser's error (usage and one line)."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    try:
        data_parallel_size(opts.gpus, model_parallel_size(opts))
    except ValueError as exc:
        parser.error(str(exc))
    return opts


def request_from_argv(argv: list[str]) -> TraceRequest:
    """The typed request of a tools/trace.py command line."""
    return request_from_opts(parse_args(argv))


def add_tiling_arguments(parser) -> None:
    """The layer-tiling flags of a traced layout (memo_ext.estimate.layout.Layout's
    mlp_tiles, projection_tiles, head_chunks, tile_norms), shared with tools/estimate.py: tile
    counts of the sequence after CP, turned into the trainer's tile sizes at each traced length
    (so that traces at two lengths are alike), the trainer's head chunks and its norms in the
    tiles."""
    parser.add_argument("--memo-mlp-tiles", type=int, default=0, metavar="K",
                        help="run every layer's MLP in K sequence tiles of the rank's CP shard "
                             "(the trainer's --memo-mlp-tile-size, docs/tiled_mlp.md; default "
                             "0: untiled)")
    parser.add_argument("--memo-attention-projection-tiles", type=int, default=0, metavar="K",
                        help="run the attention's QKV and output projections in K sequence tiles "
                             "(the trainer's --memo-attention-projection-tile-size; default 0: "
                             "untiled)")
    add_config_flags(parser, AttentionConfig, fields=("attention_head_chunks",))
    add_config_flags(parser, TiledMLPConfig, fields=("tile_norms",))


def traced_offload_config(opts: argparse.Namespace) -> OffloadConfig:
    """The tool's MEMO offload flags as the trainer's OffloadConfig (offload on), checked by
    the trainer's rules (``validate()``) after the values a trace cannot take
    (TRACED_OFFLOAD_VARIANTS). Raises MemoConfigError (one line)."""
    refused = refused_value(opts, TRACED_OFFLOAD_VARIANTS)
    if refused:
        raise MemoConfigError(refused)
    config = OffloadConfig(offload=True, alpha="0" if opts.memo_alpha is None else opts.memo_alpha,
                           checkpoint_layers=str(opts.memo_checkpoint_layers),
                           offload_fp8=opts.memo_offload_fp8,
                           offload_buffers=opts.memo_offload_buffers)
    try:
        config.validate()
    except MemoConfigError as exc:  # the trainer's fix, less the 'auto' a tool refuses
        raise MemoConfigError(str(exc).replace("use auto or ", "use ")) from None
    return config


def _gib(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (3 decimals)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3f} {unit}"
    return f"{int(nbytes)} B"


def format_summary(trace, summary, args, wall_s: float, peak_rss_bytes: int,
                   output: str | None) -> str:
    """The human-readable summary printed by main()."""
    from memo_ext.trace import skeletal_formula_bytes

    layout = trace.header.get("layout", {})
    model = trace.header.get("model", {})
    lines = [
        (f"trace: {model.get('name') or 'custom'} model, seq {args.seq_length}, "
         f"TP={layout.get('tp')} CP={layout.get('cp')} PP={layout.get('pp')} "
         f"DP={layout.get('dp')}, rank {layout.get('rank')} (tp {layout.get('tp_rank')}, "
         f"cp {layout.get('cp_rank')}, pp {layout.get('pp_rank')}, dp {layout.get('dp_rank')}), "
         f"{model.get('params_dtype')}, {trace.header.get('mode')} tensors"),
        (f"events: {summary.num_events} ({summary.num_allocs} allocs, {summary.num_frees} frees)"
         + (f" -> {output}" if output else "")),
    ]
    peak = trace.events[summary.peak_event] if summary.peak_event >= 0 else {}
    lines.append(
        f"peak live: {_gib(summary.peak_bytes)} device ({_gib(summary.peak_allocator_bytes)} "
        f"through the caching allocator) at event {summary.peak_event} "
        f"[{peak.get('phase')}, layer {peak.get('layer')}, {peak.get('module')}, {peak.get('op')}]")
    lines.append("at peak by category: " + ", ".join(
        f"{k} {_gib(v)}" for k, v in summary.peak_by_category.items() if v))
    lines.append("category peaks: " + ", ".join(
        f"{k} {_gib(v)}" for k, v in summary.category_peaks.items() if v))
    lines.append("persistent (init): " + ", ".join(
        f"{k} {_gib(v)}" for k, v in summary.persistent_by_category.items() if v))
    if summary.iteration_leftover_bytes:
        lines.append(f"warning: {_gib(summary.iteration_leftover_bytes)} allocated during the "
                     f"iteration are still alive at its end (a leak, or state kept for the next "
                     f"iteration)")
    if summary.host_peak_bytes:
        lines.append(f"host (MEMO offload slots): peak {_gib(summary.host_peak_bytes)}")
    element = torch.tensor([], dtype=args.params_dtype).element_size()
    formula = skeletal_formula_bytes(args.micro_batch_size, args.seq_length, args.hidden_size,
                                     args.tensor_model_parallel_size,
                                     args.context_parallel_size, element)
    lines.append(f"per-layer forward skeletal bytes (micro-batch 0, alive when backward starts; "
                 f"formula 16*b*s*h/(TP*CP) = {_gib(formula)}):")
    runs: list[list] = []
    for layer, nbytes in summary.layer_forward_skeletal_bytes.items():
        peak_above = summary.layer_forward_peak_bytes.get(layer, 0)
        if runs and runs[-1][2] == nbytes and runs[-1][3] == peak_above:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, nbytes, peak_above])
    for first, last, nbytes, peak_above in runs:
        name = f"layer {first}" if first == last else f"layers {first}-{last}"
        ratio = nbytes / formula if formula else float("nan")
        lines.append(f"  {name}: {_gib(nbytes)} ({ratio:.4f} x formula; "
                     f"forward peak above layer start {_gib(peak_above)})")
    lines.append(f"wall {wall_s:.1f} s, peak RSS {peak_rss_bytes / MiB:.0f} MiB")
    return "\n".join(lines)


def hide_gpus_by_restarting() -> None:
    """On a GPU node, start this command again with no GPU visible. A trace runs on the CPU
    device whatever the machine has, and the CPU shims refuse a process that sees CUDA; setting
    CUDA_VISIBLE_DEVICES at the start of ``main`` did not take effect on an H100 (the shims
    still saw the GPU), so the command replaces itself. Called for command lines only (``argv``
    None): an in-process caller keeps its process."""
    import torch

    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not torch.cuda.is_available():
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]],
              {**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        hide_gpus_by_restarting()
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    explain_hidden(opts.verbose)
    from memo_ext.trace import summarize, write_snapshot, write_trace

    from megatron.training.tracing import TraceError, record

    try:
        trace, args = record(request_from_opts(opts))
    except TraceError as exc:
        raise SystemExit(f"error: {exc}") from None
    if opts.output:
        write_trace(trace, opts.output)
    if opts.persistent_only:
        return 0
    if opts.snapshot:
        write_snapshot(trace, opts.snapshot)
    summary = summarize(trace)
    wall = time.perf_counter() - _START
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if not opts.quiet:
        print(format_summary(trace, summary, args, wall, rss, opts.output), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
