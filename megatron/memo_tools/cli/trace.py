"""Record the device-memory allocation trace of one training iteration of one rank.

    python tools/trace.py --model 7b --seq-length 1048576 --tp 4 --cp 2 --pp 1 --rank 0 \\
        --bf16 -o trace.jsonl.gz

The model is the trainer's own, built its way (megatron.training.arguments validation,
megatron.training.gpt.model_provider, megatron.training.layer_specs' local spec with
memo_ext.attention's core attention, megatron-core DDP); nothing is substituted. By default it runs offline: a fake process group stands in for the TP x CP x PP x DP world and every tensor
is a FakeTensor on the CPU device, so a 1M-token 7B trace takes seconds and little memory.
``--live`` uses real CPU tensors instead (small models only; same events).

``--serve`` (alone) keeps one process for many traces (memo_ext.estimate.tracer.TracerPool):
it reads one JSON request per line on stdin, ``{"argv": [...], "output": "/abs/t.jsonl.gz"}``,
writes what ``main(argv + ["--quiet", "-o", output])`` would, and answers one line on stdout,
``{"ok": true}`` or ``{"ok": false, "error": "<last line of the error>"}``; EOF ends it.

Writes gzipped JSON lines (header, then one event per line; docs/tracing.md) and prints a
summary: events, peak live bytes, bytes by category at the peak, per-layer forward skeletal
bytes against docs/memo.md "Skeletal activations per layer": 16·b·s·h/(TP·CP).
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import resource
import shlex
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

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
from memo_ext.planner.cuda_rules import DEFAULT_GPU  # noqa: E402
from memo_ext.config import (  # noqa: E402
    AttentionConfig,
    MemoConfigError,
    OffloadConfig,
    TiledMLPConfig,
    ToolVariant,
    add_config_flags,
)
from memo_ext.flags import refused_value  # noqa: E402
from megatron.training.arguments import add_model_shape_args  # noqa: E402
# Host memory given to MEMO's offload while tracing: large enough never to refuse an alpha
# (the trace does not model host capacity; memo_ext.offload.alpha does).
TRACE_HOST_MEMORY_GB = 1e6
TRACE_PCIE_GBPS = 25.0

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
    model.add_argument("--tie-embeddings", action="store_true",
                       help="Share the input embedding and output layer weights (megatron's "
                            "default; the trainer without --untie-embeddings-and-output-weights). "
                            "Default: untied, as examples/configs.")
    model.add_argument("--attention-dropout", type=float, default=0.0)
    model.add_argument("--hidden-dropout", type=float, default=0.0)

    layout = parser.add_argument_group("layout")
    layout.add_argument("--seq-length", type=int, required=True, help="Tokens per sequence.")
    layout.add_argument("--micro-batch-size", type=int, default=1)
    layout.add_argument("--tp", type=int, default=1, help="Tensor-parallel size.")
    layout.add_argument("--cp", type=int, default=1, help="Context-parallel size.")
    layout.add_argument("--pp", type=int, default=1, help="Pipeline-parallel size.")
    layout.add_argument("--dp", type=int, default=1, help="Data-parallel size.")
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
    add_config_flags(training, TiledMLPConfig)
    add_tiling_arguments(training)
    training.add_argument("--no-distributed-optimizer", action="store_true",
                          help="Replicate optimizer state on every DP rank.")
    training.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    training.add_argument("--param-dtype-grad-buffer", action="store_true",
                          help="Gradient buffer in the parameter dtype instead of fp32 "
                               "(Megatron-LM uses fp32 with --bf16).")
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
                            "memo_ext.planner.record_iteration): 'none' traces the first "
                            "iteration; 'auto' is 'iteration' with --memo-offload, else "
                            "'forward'.")
    trace.add_argument("--no-flash-workspace", action="store_true",
                       help="Do not record what the attention tiles' CUDA kernels allocate "
                            "besides their outputs (workspaces, split-KV accumulators, GQA's "
                            "expanded K/V) -- FlashAttention-2's, or cuDNN's where the trainer "
                            "dispatches it on the --gpu (Hopper with --attention-backend auto); "
                            "stated next to the kernels in memo_ext.attention.kernels.")
    trace.add_argument("--gpu", default=DEFAULT_GPU, metavar="PROFILE",
                       help="The GPU (a profile of memo_ext/estimate/hardware.json) whose CUDA "
                            "kernels' workspaces the trace records: cuBLAS workspace size, "
                            "reduction scratch (SM count). Default: %(default)s.")
    trace.add_argument("--hardware-file", default=None, metavar="JSON",
                       help="Extra GPU profiles for --gpu (the keys of hardware.json).")
    trace.add_argument("--no-cuda-semantics", action="store_true",
                       help="Record the CPU program as it allocates here: no CUDA allocation "
                            "rules (memo_ext/planner/cuda_rules.py: kernel workspaces, "
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


def model_shape(opts: argparse.Namespace) -> tuple[int, int, int, int]:
    """(layers, hidden, ffn, heads) from --model, overridden by explicit flags."""
    base = MODELS.get(opts.model, (None, None, None, None))
    layers = opts.num_layers or base[0]
    hidden = opts.hidden_size or base[1]
    heads = opts.num_attention_heads or base[3]
    ffn = opts.ffn_hidden_size or (base[2] if opts.hidden_size in (None, base[1]) else None)
    missing = [flag for flag, value in (("--num-layers", layers), ("--hidden-size", hidden),
                                        ("--num-attention-heads", heads)) if value is None]
    if missing:
        raise SystemExit(f"error: give --model or {', '.join(missing)}")
    return layers, hidden, ffn, heads


def trainer_argv(opts: argparse.Namespace) -> list[str]:
    """The trainer command line (pretrain_gpt.py flags) of the traced configuration."""
    layers, hidden, ffn, heads = model_shape(opts)
    argv = [
        "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--num-attention-heads", str(heads),
        "--seq-length", str(opts.seq_length), "--max-position-embeddings", str(opts.seq_length),
        "--micro-batch-size", str(opts.micro_batch_size),
        "--global-batch-size", str(opts.micro_batch_size * opts.dp * opts.microbatches_in_flight),
        "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", str(opts.vocab_size),
        "--position-embedding-type", opts.position_embedding_type,
        "--normalization", opts.normalization,
        *([] if opts.tie_embeddings else ["--untie-embeddings-and-output-weights"]),
        "--attention-dropout", str(opts.attention_dropout),
        "--hidden-dropout", str(opts.hidden_dropout),
        "--tensor-model-parallel-size", str(opts.tp),
        "--pipeline-model-parallel-size", str(opts.pp),
        "--context-parallel-size", str(opts.cp), "--optimizer", opts.optimizer,
    ]
    if ffn is not None:
        argv += ["--ffn-hidden-size", str(ffn)]
    if opts.num_query_groups:
        argv += ["--group-query-attention", "--num-query-groups", str(opts.num_query_groups)]
    if opts.kv_channels:
        argv += ["--kv-channels", str(opts.kv_channels)]
    argv += [flag for flag, given in (
        ("--swiglu", opts.swiglu), ("--disable-bias-linear", opts.disable_bias_linear),
        ("--sequence-parallel", not opts.no_sequence_parallel),
        ("--use-distributed-optimizer", not opts.no_distributed_optimizer),
        ("--bf16", opts.bf16), ("--fp16", opts.fp16),
        ("--accumulate-allreduce-grads-in-fp32", not opts.param_dtype_grad_buffer)) if given]
    if opts.recompute_granularity:
        argv += ["--recompute-granularity", opts.recompute_granularity]
        if opts.recompute_granularity == "full":
            argv += ["--recompute-method", opts.recompute_method or "uniform"]
            if opts.recompute_num_layers is not None:
                argv += ["--recompute-num-layers", str(opts.recompute_num_layers)]
    if opts.memo_offload:
        alpha = "0" if opts.memo_alpha is None else opts.memo_alpha
        argv += ["--memo-offload", "--memo-alpha", alpha,
                 "--memo-host-memory-gb", str(TRACE_HOST_MEMORY_GB),
                 "--memo-pcie-gbps", str(TRACE_PCIE_GBPS),
                 "--memo-checkpoint-layers", str(opts.memo_checkpoint_layers)]
        if opts.memo_offload_fp8:
            argv.append("--memo-offload-fp8")
        if opts.memo_offload_buffers != 2:
            argv += ["--memo-offload-buffers", str(opts.memo_offload_buffers)]
    if opts.memo_mlp_tile_size:
        argv += ["--memo-mlp-tile-size", str(opts.memo_mlp_tile_size)]
    elif opts.memo_mlp_tiles:
        from memo_ext.config import TiledMLPConfig

        argv += ["--memo-mlp-tile-size", str(TiledMLPConfig.tile_size_for(
            opts.seq_length // opts.cp, opts.memo_mlp_tiles, opts.tp))]
    if opts.memo_attention_projection_tiles:
        from memo_ext.config import TiledMLPConfig

        argv += ["--memo-attention-projection-tile-size", str(TiledMLPConfig.tile_size_for(
            opts.seq_length // opts.cp, opts.memo_attention_projection_tiles, opts.tp))]
    if opts.memo_attention_head_chunks != 1:
        argv += ["--memo-attention-head-chunks", str(opts.memo_attention_head_chunks)]
    return argv + shlex.split(opts.trainer_args)


def add_tiling_arguments(parser) -> None:
    """The layer-tiling flags of a traced layout (memo_ext.estimate.layout.Layout's
    mlp_tiles, projection_tiles, head_chunks), shared with tools/estimate.py: tile counts of
    the sequence after CP, turned into the trainer's tile sizes at each traced length (so that
    traces at two lengths are alike), and the trainer's head chunks."""
    parser.add_argument("--memo-mlp-tiles", type=int, default=0, metavar="K",
                        help="run every layer's MLP in K sequence tiles of the rank's CP shard "
                             "(the trainer's --memo-mlp-tile-size, docs/tiled_mlp.md; default "
                             "0: untiled)")
    parser.add_argument("--memo-attention-projection-tiles", type=int, default=0, metavar="K",
                        help="run the attention's QKV and output projections in K sequence tiles "
                             "(the trainer's --memo-attention-projection-tile-size; default 0: "
                             "untiled)")
    add_config_flags(parser, AttentionConfig, fields=("attention_head_chunks",))


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


def rank_coordinates(rank: int) -> dict:
    """This rank's TP/CP/PP/DP coordinates (megatron's parallel_state, initialised)."""
    from megatron.core import parallel_state as ps

    return {"rank": rank, "tp_rank": ps.get_tensor_model_parallel_rank(),
            "cp_rank": ps.get_context_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank()}


def make_forward_step(args, model, config):
    """(forward_step, backward_done): forward_step(micro_batch) -> loss (last stage) or stage
    output, megatron.training.gpt.forward_step on a synthetic batch allocated as the data
    loader's H2D copies would be (tokens/labels/position ids int64, loss mask fp32, [b, s]);
    backward_done(micro_batch) drops what a non-first pipeline stage received for it, once its
    input gradient is "sent" back, as megatron's schedules do."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    from megatron.training import gpt

    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    shape = (args.micro_batch_size, args.seq_length)
    tp = args.tensor_model_parallel_size
    local_tokens = args.seq_length // args.context_parallel_size
    if args.sequence_parallel:
        local_tokens //= tp
    set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
    received_inputs: dict[int, torch.Tensor] = {}

    def forward_step(microbatch: int) -> torch.Tensor:
        batch = None
        if first or last:
            batch = {"tokens": torch.zeros(shape, dtype=torch.int64),
                     "labels": torch.zeros(shape, dtype=torch.int64),
                     "loss_mask": torch.ones(shape, dtype=torch.float32),
                     "position_ids": torch.zeros(shape, dtype=torch.int64)}
        if not first:
            # megatron's recv_forward: the previous stage's output arrives in a fresh tensor.
            received = torch.empty((local_tokens, args.micro_batch_size, args.hidden_size),
                                   dtype=config.pipeline_dtype, requires_grad=True)
            set_input_tensor(received)
            received_inputs[microbatch] = received
            del received
        output, loss_func = gpt.forward_step(iter([batch] if batch else []), model)
        del batch
        if not first:
            set_input_tensor(None)
        if not last:
            return output
        loss_sum, _num_tokens, _report = loss_func(output)
        return loss_sum

    def backward_done(microbatch: int) -> None:
        received_inputs.pop(microbatch, None)  # with its .grad, sent to the previous stage

    return forward_step, backward_done


@dataclasses.dataclass
class TracedRank:
    """One rank built for tracing: its validated trainer ``args``, megatron-DDP-wrapped
    ``model``, and everything :func:`memo_ext.planner.record_iteration` needs."""

    args: argparse.Namespace
    config: Any
    model: torch.nn.Module
    recorder: Any
    header: dict
    record_kwargs: dict

    def record(self, **overrides):
        """Record the iteration (record_iteration's keywords may be overridden)."""
        from memo_ext.planner.trace import record_iteration

        kwargs = {**self.record_kwargs, **overrides}
        return record_iteration(self.model, recorder=self.recorder, header=self.header, **kwargs)


@contextlib.contextmanager
def traced_rank(opts: argparse.Namespace) -> Iterator[TracedRank]:
    """Build the configured rank (inside a fake process group and, unless ``--live``,
    FakeTensorMode); everything is torn down on exit."""
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_args,
        silence_expected_cpu_warnings,
    )

    silence_expected_cpu_warnings()
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core\..*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\..*")
    if opts.microbatches_in_flight < 1:
        raise SystemExit("error: --microbatches-in-flight must be >= 1")
    world_size = opts.tp * opts.cp * opts.pp * opts.dp
    args = parse_args(trainer_argv(opts), world_size=world_size, cuda_available=True)
    if not 0 <= opts.rank < world_size:
        raise SystemExit(f"error: --rank {opts.rank} is outside the world of {world_size} ranks "
                         f"(TP x CP x PP x DP)")
    if opts.memo_offload:
        try:
            traced_offload_config(opts)
        except MemoConfigError as exc:
            raise SystemExit(f"error: {exc}") from None

    from megatron.training.compat import apply_cpu_shims
    from megatron.training.tokenizer import padded_vocab_size

    apply_cpu_shims()  # the trace runs on the CPU device whatever the machine has
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    from megatron.training import gpt
    from memo_ext.attention import kernels
    from memo_ext.planner.cuda_rules import CudaTarget
    from memo_ext.planner.trace import (
        AllocationRecorder,
        ProcessConstants,
        allocate_optimizer_states,
        communicators_for_layout,
        fake_distributed,
        fake_tensors,
    )

    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)
    config = core_transformer_config_from_args(args)
    # CPU semantics everywhere (also on a CUDA machine): CPU-side init, no torch.compile fusions.
    config.use_cpu_initialization = True
    config.perform_initialization = bool(opts.live)
    config.bias_activation_fusion = config.bias_dropout_fusion = False
    config.masked_softmax_fusion = False

    constants = ProcessConstants(**{
        key: int(value * MiB) for key, value in (
            ("cuda_context_bytes", opts.cuda_context_mib),
            ("nccl_bytes_per_communicator", opts.nccl_mib_per_communicator))
        if value is not None})
    try:
        target = CudaTarget.for_gpu(opts.gpu, opts.hardware_file, cublas_workspace_bytes=(
            None if opts.cublas_workspace_mib is None else int(opts.cublas_workspace_mib * MiB)))
    except ValueError as exc:  # EstimateError: an unknown profile or one without the fields
        raise SystemExit(f"error: {exc}") from None
    recorder = AllocationRecorder(cuda_semantics=not opts.no_cuda_semantics, target=target)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_distributed(world_size, opts.rank, opts.tp, opts.pp, opts.cp))
        coordinates = rank_coordinates(opts.rank)
        fake_mode = None if opts.live else stack.enter_context(fake_tensors())
        memo = None
        if opts.memo_offload:
            memo = build_memo(args, recorder, stack, opts.microbatches_in_flight)
        # The trainer's model, built by its own spec (--transformer-impl local).
        model = gpt.model_provider(
            config, args, pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(), memo=memo)
        attention_kernel = traced_attention_kernel(opts, args, target)
        stack.enter_context(kernels.declared_workspaces(
            not opts.no_flash_workspace, kernel=attention_kernel,
            capability=target.compute_capability))
        # FakeTensorMode's op cache costs more than it saves on DDP's thousands of one-off
        # views into the contiguous buffers (measured: 9.5 s -> 5.5 s for 7B).
        with uncached(fake_mode):
            ddp = DistributedDataParallel(
                config=config,
                ddp_config=DistributedDataParallelConfig(
                    grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                    overlap_grad_reduce=False,
                    use_distributed_optimizer=args.use_distributed_optimizer),
                module=model)
        ddp.train()
        forward_step, backward_done = make_forward_step(args, ddp, config)
        record_kwargs = {
            "forward_step": forward_step,
            "microbatch_backward_done": backward_done,
            "microbatches": opts.microbatches_in_flight,
            "warmup": warmup_mode(opts),
            "optimizer_states": lambda: allocate_optimizer_states(
                ddp, args.use_distributed_optimizer, adam=args.optimizer == "adam"),
            # DDP's finish_grad_sync reduce-scatters / all-reduces the gradient buffer in place
            # (no allocation); FakeTensorMode has no rule for its coalesced collectives.
            "after_backward": None,
            "constants": constants.entries(
                communicators_for_layout(opts.tp, opts.cp, opts.pp, opts.dp)),
            "deallocate_pipeline_outputs": config.deallocate_pipeline_outputs,
        }
        yield TracedRank(args=args, config=config, model=ddp, recorder=recorder,
                         header=trace_header(opts, args, coordinates, constants,
                                             attention_kernel),
                         record_kwargs=record_kwargs)


def traced_attention_kernel(opts: argparse.Namespace, args: argparse.Namespace, target) -> str:
    """The CUDA tile kernel whose backward workspaces the trace declares: the one the trainer
    dispatches on the target GPU for its --attention-backend (memo_ext.attention.kernels.
    cuda_backend: cuDNN's fused attention on Hopper with 'auto', assuming the CUDA build of
    this torch release, which bundles cuDNN 9). FlashAttention-2's under --no-cuda-semantics,
    as before the choice existed."""
    from memo_ext.attention import kernels

    if opts.no_cuda_semantics:
        return "cuda_flash"
    try:
        return kernels.cuda_backend(target.compute_capability,
                                    kernels.cudnn_attention_op_exists(), args.attention_backend,
                                    deterministic=bool(args.deterministic_mode))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def record(opts: argparse.Namespace):
    """Build the configured rank and record its iteration (or its persistent state alone,
    ``--persistent-only``). Returns (trace, trainer args)."""
    with traced_rank(opts) as rank:
        return rank.record(persistent_only=opts.persistent_only), rank.args


def uncached(fake_mode):
    """``fake_mode`` (a FakeTensorMode or None) with its dispatch cache off in a block."""
    if fake_mode is None:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import disable_fake_tensor_cache

    return disable_fake_tensor_cache(fake_mode)


def build_memo(args, recorder, stack: contextlib.ExitStack, microbatches_in_flight: int):
    """MEMO's runtime as megatron.training.memo builds it, with the fixed alpha, a CPU copy
    engine, and host slots reported to the recorder (pool "host")."""
    from memo_ext.config import OffloadConfig, config_from_args
    from memo_ext.device import CopyEngine
    from memo_ext.offload import ActivationShape, MemoOffload, position_wise_share_of

    class SynchronousCopyEngine(CopyEngine):
        """Copies inline on the calling thread. CopyEngine's CPU workers would run ``copy_`` on
        FakeTensors concurrently with the main thread, and FakeTensorMode is not thread-safe;
        copies allocate nothing, so the trace is the same."""

        def _copy_now(self, dst, src, after):
            if after is not None:
                after.synchronize()
            dst.copy_(src)
            return self.record_compute()

        def offload(self, dst_host, src_device, after=None):
            return self._copy_now(dst_host, src_device, after)

        def prefetch(self, dst_device, src_host, after=None):
            return self._copy_now(dst_device, src_host, after)

    config = config_from_args(OffloadConfig, args)
    engine = stack.enter_context(SynchronousCopyEngine("cpu", copy_delay_s=0.0))
    return MemoOffload(
        config, engine, layers_per_stage=args.num_layers // args.pipeline_model_parallel_size,
        microbatches_in_flight=microbatches_in_flight, shape=ActivationShape.of_trainer(args),
        host_memory_bytes=config.host_memory_bytes, position_wise_share=position_wise_share_of(args),
        bandwidth_bytes_per_s=config.pcie_bytes_per_s,
        host_allocation_scope=recorder.host_allocations,
        log=lambda message: None)


def warmup_mode(opts: argparse.Namespace) -> str:
    """The warm-up record_iteration runs: MEMO's rounding buffers and host slots need a whole
    iteration to reach their steady state; everything else is created in forward."""
    if opts.warmup != "auto":
        return opts.warmup
    return "iteration" if opts.memo_offload else "forward"


def trace_header(opts, args, coordinates: dict, constants,
                 attention_kernel: str = "cuda_flash") -> dict:
    """Plain-data description of what was traced (the trace file's first line)."""
    from megatron.core import package_info

    from memo_ext.estimate.flops import gpt_shape

    return {
        "mode": "live" if opts.live else "fake",
        "layout": {"tp": opts.tp, "cp": opts.cp, "pp": opts.pp, "dp": opts.dp,
                   "world_size": opts.tp * opts.cp * opts.pp * opts.dp, **coordinates,
                   "sequence_parallel": bool(args.sequence_parallel),
                   "micro_batch_size": args.micro_batch_size,
                   "microbatches_in_flight": opts.microbatches_in_flight},
        # The shape fields as the trainer's MFU reads them (one function for both).
        "model": {"name": opts.model, **gpt_shape(args, args.vocab_size),
                  "padded_vocab_size": args.padded_vocab_size,
                  "seq_length": args.seq_length, "params_dtype": str(args.params_dtype),
                  "normalization": args.normalization,
                  "position_embedding_type": args.position_embedding_type,
                  "add_bias_linear": bool(args.add_bias_linear)},
        "options": {"recompute_granularity": args.recompute_granularity,
                    "recompute_method": args.recompute_method,
                    "recompute_num_layers": args.recompute_num_layers,
                    "memo_offload": bool(opts.memo_offload),
                    "memo_alpha": args.memo_alpha if opts.memo_offload else None,
                    "memo_checkpoint_layers": (opts.memo_checkpoint_layers if opts.memo_offload
                                               else None),
                    "memo_offload_fp8": bool(opts.memo_offload and opts.memo_offload_fp8),
                    "memo_offload_buffers": (opts.memo_offload_buffers if opts.memo_offload
                                             else None),
                    "use_distributed_optimizer": bool(args.use_distributed_optimizer),
                    "optimizer": args.optimizer,
                    "grad_buffer_fp32": bool(args.accumulate_allreduce_grads_in_fp32),
                    "warmup": warmup_mode(opts),
                    "flash_workspace": not opts.no_flash_workspace,
                    # The CUDA tile kernel whose backward workspaces are declared.
                    "attention_kernel": attention_kernel,
                    "cuda_semantics": not opts.no_cuda_semantics,
                    "attention": "memo_ext.attention (ring CP, flash tiles)"},
        "constants": dataclasses.asdict(constants),
        "cuda_target": None if opts.no_cuda_semantics else {
            "gpu": opts.gpu, "cublas_workspace_mib": opts.cublas_workspace_mib},
        "versions": {"torch": torch.__version__, "megatron_core": package_info.__version__},
        "trainer_argv": trainer_argv(opts),
    }


def _gib(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (3 decimals)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3f} {unit}"
    return f"{int(nbytes)} B"


def format_summary(trace, summary, args, wall_s: float, peak_rss_bytes: int,
                   output: str | None) -> str:
    """The human-readable summary printed by main()."""
    from memo_ext.planner.trace import skeletal_formula_bytes

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


class _TailWriter:
    """A text stream that passes writes through to ``stream`` and keeps the last few KiB, so a
    failed request can answer with the last line it wrote (as a subprocess's stderr would)."""

    KEEP = 4096

    def __init__(self, stream) -> None:
        self.stream = stream
        self.tail = ""

    def write(self, text: str) -> int:
        self.tail = (self.tail + text)[-self.KEEP:]
        return self.stream.write(text)

    def last_line(self) -> str:
        lines = [line for line in self.tail.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    def __getattr__(self, name):  # flush, fileno, isatty, encoding, ...
        return getattr(self.stream, name)


def serve() -> int:
    """``--serve``: trace request after request in this process (module docstring). Importing
    torch and megatron costs ~3.5 s, more than tracing a small model; a server pays it once."""
    # The protocol keeps the real stdout; fd 1 then points at stderr, so nothing else the
    # tracing prints (print, warnings, C libraries) can corrupt the protocol.
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    # The interpreter's and the libraries' objects live as long as the server: moved out of the
    # collector's view, the collections record_iteration makes cost 2 ms instead of 160 ms.
    import megatron.training.arguments  # noqa: F401  (the heavy imports, before freezing)
    from megatron.training import gpt  # noqa: F401
    gc.collect()
    gc.freeze()
    for line in sys.stdin:
        if not line.strip():
            continue
        stderr = sys.stderr = _TailWriter(sys.__stderr__)
        try:
            request = json.loads(line)
            main([*request["argv"], "--quiet", "-o", request["output"]])
            reply = {"ok": True}
        except SystemExit as exc:  # the tracer's refusals and argparse's errors
            if isinstance(exc.code, str):  # what the interpreter would print on exit
                print(exc.code, file=sys.stderr)
            reply = {"ok": False, "error": stderr.last_line() or f"exit status {exc.code}"}
        except Exception:  # as an uncaught exception would end a tracer subprocess
            traceback.print_exc()
            reply = {"ok": False, "error": stderr.last_line()}
        finally:
            sys.stderr = sys.__stderr__
            sys.stderr.flush()
        # What the request imported stays: frozen too, so the next request's collections
        # skip it (cyclic garbage of a request was collected by record_iteration already).
        gc.collect()
        gc.freeze()
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
    return 0


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
    if argv[:1] == ["--serve"]:  # before the parser, which requires --seq-length
        if len(argv) > 1:
            raise SystemExit("error: --serve takes no other flags (they come per request)")
        return serve()
    opts = build_parser().parse_args(argv)
    explain_hidden(opts.verbose)
    from memo_ext.planner.trace import summarize, write_snapshot, write_trace

    trace, args = record(opts)
    if opts.persistent_only:
        if opts.output:
            write_trace(trace, opts.output)
        return 0
    if opts.output:
        write_trace(trace, opts.output)
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
