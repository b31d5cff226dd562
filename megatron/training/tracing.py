"""The tracer engine: one training iteration of one rank of the trainer's own model, recorded on
fake tensors, for a :class:`memo_ext.trace.request.TraceRequest`.

The model is the trainer's, built its way: the request is rendered into the trainer's flags by
the one renderer (memo_ext.flags.render_flags), parsed and validated by
megatron.training.arguments, built by megatron.training.gpt's model provider with the local
layer spec and megatron-core DDP, and MEMO by megatron.training.memo's one builder; nothing is
substituted. A fake process group stands in for the TP x CP x PP x DP world and every tensor is
a FakeTensor on the CPU device (or a real CPU tensor with ``live``), so a 1M-token 7B trace takes
seconds and little memory.

Callers: ``tools/trace.py`` (one request from its command line) and the estimator's worker pool
(memo_ext.estimate.tracer), whose workers run :func:`serve` (``python -m
megatron.training.tracing --serve``): one JSON request per line on stdin,
``{"request": TraceRequest.to_dict(), "output": "/abs/t.jsonl.gz"}``, one answer per line on
stdout, ``{"ok": true}`` or ``{"ok": false, "error": "<one line>"}``; EOF ends it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from memo_ext.config import MemoConfigError
from memo_ext.flags import render_flags
from memo_ext.trace.request import (
    CHUNKED_LOSS_FLAGS,
    TRACE_HOST_MEMORY_GB,
    TRACE_PCIE_GBPS,
    TraceRequest,
)

MiB = 1 << 20


class TraceError(ValueError):
    """A request the tracer cannot build; one line naming the setting and the fix."""


def _tile_size(request: TraceRequest, tiles: int) -> int:
    from memo_ext.config import TiledMLPConfig

    return TiledMLPConfig.tile_size_for(request.seq_length // request.cp, tiles, request.tp)


def trainer_argv(request: TraceRequest) -> list[str]:
    """The trainer command line (pretrain_gpt.py flags) of the traced configuration."""
    from memo_ext.config import AttentionConfig, OffloadConfig, TiledMLPConfig

    model = request.model
    seq = request.seq_length
    flags = {
        "num_layers": model.num_layers, "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads, "seq_length": seq,
        "max_position_embeddings": seq, "micro_batch_size": request.micro_batch_size,
        "global_batch_size": (request.micro_batch_size * request.dp
                              * request.microbatches_in_flight),
        "train_iters": 1, "lr": 1e-4, "mock_data": True, "vocab_size": model.vocab_size,
        "position_embedding_type": model.position_embedding_type,
        "normalization": model.normalization,
        "untie_embeddings_and_output_weights": not model.tie_embeddings,
        "attention_dropout": model.attention_dropout, "hidden_dropout": model.hidden_dropout,
        "tensor_model_parallel_size": request.tp, "pipeline_model_parallel_size": request.pp,
        "context_parallel_size": request.cp, "optimizer": request.optimizer,
        "ffn_hidden_size": model.ffn_hidden_size,
        "group_query_attention": bool(model.num_query_groups),
        "num_query_groups": model.num_query_groups or None,
        "kv_channels": model.kv_channels or None,
        "swiglu": model.swiglu, "disable_bias_linear": model.disable_bias_linear,
        "sequence_parallel": request.sequence_parallel,
        "use_distributed_optimizer": request.distributed_optimizer,
        "bf16": request.bf16, "fp16": request.fp16,
        "accumulate_allreduce_grads_in_fp32": request.grad_buffer_fp32,
        # --bf16 alone accumulates in fp32, as Megatron-LM; a bf16 grad buffer is asked for.
        "grad_reduce_in_bf16": request.bf16 and not request.grad_buffer_fp32,
    }
    if request.optimizer_cpu_offload:  # Megatron-LM's flags; offload needs the first
        flags.update({"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True,
                      "optimizer_offload_fraction": request.optimizer_offload_fraction,
                      "overlap_cpu_optimizer_d2h_h2d": request.overlap_cpu_optimizer_d2h_h2d,
                      "no_pin_cpu_grads": not request.pin_cpu_grads,
                      "no_pin_cpu_params": not request.pin_cpu_params})
    if request.megatron_fsdp:  # Megatron-LM's flags; Megatron-FSDP needs the last two
        flags.update({"use_megatron_fsdp": True,
                      "data_parallel_sharding_strategy": request.megatron_fsdp,
                      "fsdp_double_buffer": request.fsdp_double_buffer,
                      "suggested_communication_unit_size": request.fsdp_unit_size,
                      "use_distributed_optimizer": True, "ckpt_format": "fsdp_dtensor"})
    if request.recompute_granularity:
        flags["recompute_granularity"] = request.recompute_granularity
        if request.recompute_granularity == "full":
            flags["recompute_method"] = request.recompute_method or "uniform"
            flags["recompute_num_layers"] = request.recompute_num_layers
    configs = []
    if request.memo_offload:
        configs.append(OffloadConfig(
            offload=True, alpha=f"{request.memo_alpha:g}", host_memory_gb=TRACE_HOST_MEMORY_GB,
            pcie_gbps=TRACE_PCIE_GBPS, checkpoint_layers=str(request.memo_checkpoint_layers),
            offload_fp8=request.memo_offload_fp8, offload_buffers=request.memo_offload_buffers))
    mlp_tile_size = request.mlp_tile_size or (
        _tile_size(request, request.mlp_tiles) if request.mlp_tiles else 0)
    projection_tile_size = (_tile_size(request, request.projection_tiles)
                            if request.projection_tiles else 0)
    configs.append(TiledMLPConfig(mlp_tile_size=mlp_tile_size, tile_norms=request.tile_norms))
    configs.append(AttentionConfig(attention_head_chunks=request.head_chunks,
                                   attention_projection_tile_size=projection_tile_size))
    loss = CHUNKED_LOSS_FLAGS if request.chunked_loss else {}
    return render_flags(flags, *configs, loss) + list(request.extra_trainer_argv)


def rank_coordinates(rank: int) -> dict:
    """This rank's TP/CP/PP/DP coordinates (megatron's parallel_state, initialised)."""
    from megatron.core import parallel_state as ps

    return {"rank": rank, "tp_rank": ps.get_tensor_model_parallel_rank(),
            "cp_rank": ps.get_context_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank()}


def make_forward_step(args, model, config):
    """(forward_step, backward_done): forward_step(micro_batch) -> loss (last stage) or stage
    output, the trainer's forward step on a synthetic batch allocated as the data loader's H2D
    copies would be (tokens/labels/position ids int64, loss mask fp32, [b, s]);
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
    ``model``, and everything :func:`memo_ext.trace.record_iteration` needs."""

    args: argparse.Namespace
    config: Any
    model: torch.nn.Module
    recorder: Any
    header: dict
    record_kwargs: dict

    def record(self, **overrides):
        """Record the iteration (record_iteration's keywords may be overridden)."""
        from memo_ext.trace import record_iteration

        kwargs = {**self.record_kwargs, **overrides}
        return record_iteration(self.model, recorder=self.recorder, header=self.header, **kwargs)


def uncached(fake_mode):
    """``fake_mode`` (a FakeTensorMode or None) with its dispatch cache off in a block."""
    if fake_mode is None:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import disable_fake_tensor_cache

    return disable_fake_tensor_cache(fake_mode)


def _tracing_memo(args, recorder, stack: contextlib.ExitStack, microbatches_in_flight: int):
    """MEMO's runtime built by the trainer's builder (megatron.training.memo.memo_offload)
    with the fixed alpha, a synchronous CPU copy engine, and host slots reported to the
    recorder (pool "host")."""
    from memo_ext.config import OffloadConfig, config_from_args
    from memo_ext.device import CopyEngine

    from megatron.training.memo import memo_offload

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
    return memo_offload(args, engine, host_memory_bytes=config.host_memory_bytes,
                        bandwidth_bytes_per_s=config.pcie_bytes_per_s,
                        microbatches_in_flight=microbatches_in_flight, log=lambda message: None,
                        host_allocation_scope=recorder.host_allocations)


def warmup_mode(request: TraceRequest) -> str:
    """The warm-up record_iteration runs: a forward of micro-batch 0, which creates what an
    iteration keeps (megatron's all-gather buffer, the RoPE cache, the autograd thread's
    cuBLAS workspace, MEMO's host slots and rounding buffers at their sizes), after which MEMO
    ends the micro-batch as its backward would (MemoOffload.abandon_forward). A whole
    iteration where a forward is not enough: MEMO with several micro-batches in flight (the
    others' host slots are taken in the recorded forward otherwise) and Megatron-FSDP (a
    forward leaves the next units' gathered-weight buckets allocated for the backward, which
    frees them: after a forward warm-up the recorded iteration would free "persistent"
    memory). The forward warm-up records MEMO's traces event for event as the whole
    iteration's did, about a quarter cheaper (tests/unit/megatron/training/test_tracing_warmup.py;
    docs/tracing.md "What a rank holds", item 5)."""
    if request.warmup != "auto":
        return request.warmup
    if request.megatron_fsdp or (request.memo_offload and request.microbatches_in_flight > 1):
        return "iteration"
    return "forward"


def traced_attention_kernel(request: TraceRequest, args: argparse.Namespace, target) -> str:
    """The CUDA tile kernel whose backward workspaces the trace declares: the one the trainer
    dispatches on the target GPU for its --attention-backend (memo_ext.attention.kernels.
    cuda_backend: cuDNN's fused attention on Hopper with 'auto', assuming the CUDA build of
    this torch release, which bundles cuDNN 9). FlashAttention-2's without CUDA semantics,
    as before the choice existed."""
    from memo_ext.attention import kernels

    if not request.cuda_semantics:
        return "cuda_flash"
    try:
        return kernels.cuda_backend(target.compute_capability,
                                    kernels.cudnn_attention_op_exists(), args.attention_backend,
                                    deterministic=bool(args.deterministic_mode))
    except ValueError as exc:
        raise TraceError(str(exc)) from None


def trace_header(request: TraceRequest, args, coordinates: dict, constants,
                 attention_kernel: str = "cuda_flash") -> dict:
    """Plain-data description of what was traced (the trace file's first line)."""
    from megatron.core import package_info

    from memo_ext.estimate.flops import gpt_shape

    memo = request.memo_offload
    return {
        "mode": "live" if request.live else "fake",
        "layout": {"tp": request.tp, "cp": request.cp, "pp": request.pp, "dp": request.dp,
                   "world_size": request.world_size, **coordinates,
                   "sequence_parallel": bool(args.sequence_parallel),
                   "micro_batch_size": args.micro_batch_size,
                   "microbatches_in_flight": request.microbatches_in_flight},
        # The shape fields as the trainer's MFU reads them (one function for both).
        "model": {"name": request.model.name, **gpt_shape(args, args.vocab_size),
                  "padded_vocab_size": args.padded_vocab_size,
                  "seq_length": args.seq_length, "params_dtype": str(args.params_dtype),
                  "normalization": args.normalization,
                  "position_embedding_type": args.position_embedding_type,
                  "add_bias_linear": bool(args.add_bias_linear)},
        "options": {"recompute_granularity": args.recompute_granularity,
                    "recompute_method": args.recompute_method,
                    "recompute_num_layers": args.recompute_num_layers,
                    "memo_offload": memo,
                    "memo_alpha": args.memo_alpha if memo else None,
                    "memo_checkpoint_layers": request.memo_checkpoint_layers if memo else None,
                    "memo_offload_fp8": bool(memo and request.memo_offload_fp8),
                    "memo_offload_buffers": request.memo_offload_buffers if memo else None,
                    "use_distributed_optimizer": bool(args.use_distributed_optimizer),
                    "optimizer": args.optimizer,
                    "optimizer_cpu_offload": bool(args.optimizer_cpu_offload),
                    "optimizer_offload_fraction": (args.optimizer_offload_fraction
                                                   if args.optimizer_cpu_offload else None),
                    "overlap_cpu_optimizer_d2h_h2d": bool(args.overlap_cpu_optimizer_d2h_h2d),
                    "grad_buffer_fp32": bool(args.accumulate_allreduce_grads_in_fp32),
                    "megatron_fsdp": (args.data_parallel_sharding_strategy
                                      if args.use_megatron_fsdp else None),
                    "fsdp_double_buffer": bool(args.fsdp_double_buffer),
                    "fsdp_unit_size": args.suggested_communication_unit_size,
                    "warmup": warmup_mode(request),
                    "flash_workspace": request.flash_workspace,
                    # The CUDA tile kernel whose backward workspaces are declared.
                    "attention_kernel": attention_kernel,
                    "cuda_semantics": request.cuda_semantics,
                    "attention": "memo_ext.attention (ring CP, flash tiles)"},
        "constants": dataclasses.asdict(constants),
        "cuda_target": None if not request.cuda_semantics else {
            "gpu": request.gpu, "cublas_workspace_mib": request.cublas_workspace_mib},
        "versions": {"torch": torch.__version__, "megatron_core": package_info.__version__},
        "trainer_argv": trainer_argv(request),
    }


def _optimizer_states(args, ddp, recorder):
    """The function record_iteration calls for the optimizer's states: megatron's optimizer as
    memo_ext.trace.model_state allocates it; with --optimizer-cpu-offload, its split as the
    trainer's own optimizer makes it (megatron.training.optimizer_offload, learnt here, before
    recording), the host part in the recorder's pool "host"."""
    from memo_ext.trace import allocate_offloaded_optimizer_states, allocate_optimizer_states

    if not args.optimizer_cpu_offload:
        return lambda: allocate_optimizer_states(ddp, args.use_distributed_optimizer,
                                                 adam=args.optimizer == "adam")
    from megatron.training.optimizer_offload import traced_offload_split

    split = traced_offload_split(args, ddp)
    device = next(ddp.parameters()).device
    return lambda: allocate_offloaded_optimizer_states(split, device, recorder.host_allocations)


def _check(request: TraceRequest) -> None:
    """The request's own limits, before the trainer's validation (one line each)."""
    if request.microbatches_in_flight < 1:
        raise TraceError("--microbatches-in-flight must be >= 1")
    if not 0 <= request.rank < request.world_size:
        raise TraceError(f"--rank {request.rank} is outside the world of {request.world_size} "
                         "ranks (TP x CP x PP x DP)")
    if request.memo_offload:
        from memo_ext.config import OffloadConfig

        try:
            OffloadConfig(offload=True, alpha=f"{request.memo_alpha:g}",
                          checkpoint_layers=str(request.memo_checkpoint_layers),
                          offload_fp8=request.memo_offload_fp8,
                          offload_buffers=request.memo_offload_buffers).validate()
        except MemoConfigError as exc:  # the trainer's fix, less the 'auto' a trace cannot take
            raise TraceError(str(exc).replace("use auto or ", "use ")) from None


@contextlib.contextmanager
def _validation_target(request: TraceRequest) -> Iterator[bool]:
    """The machine the trainer's validation is asked about (yields ``cuda_available``): a CUDA
    one, except that a trace of the CPU trainer with --optimizer-cpu-offload validates as the
    CPU trainer does (on CUDA that path needs Transformer Engine and 16-bit parameters). With
    CUDA semantics and --optimizer-cpu-offload, Transformer Engine counts as installed, as
    the trainer on the modelled GPU machine needs it (megatron.training.arguments)."""
    if not request.optimizer_cpu_offload:
        yield True
        return
    if not request.cuda_semantics:
        yield False
        return
    from megatron.training import arguments

    with mock.patch.object(arguments, "transformer_engine_installed", lambda: True):
        yield True


@contextlib.contextmanager
def traced_rank(request: TraceRequest) -> Iterator[TracedRank]:
    """Build the requested rank (inside a fake process group and, unless ``live``,
    FakeTensorMode); everything is torn down on exit."""
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_args,
        silence_expected_cpu_warnings,
    )

    silence_expected_cpu_warnings()
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core\..*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\..*")
    _check(request)
    with _validation_target(request) as cuda_available:
        args = parse_args(trainer_argv(request), world_size=request.world_size,
                          cuda_available=cuda_available)

    from megatron.training.compat import apply_cpu_shims
    from megatron.training.tokenizer import padded_vocab_size

    apply_cpu_shims()  # the trace runs on the CPU device whatever the machine has
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    from megatron.training import gpt, megatron_fsdp
    from memo_ext.attention import kernels
    from memo_ext.tile_loop import repeated_by
    from memo_ext.trace.cuda_rules import CudaTarget
    from memo_ext.trace import (
        AllocationRecorder,
        ProcessConstants,
        communicators_for_layout,
        fake_distributed,
        fake_tensors,
    )

    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)
    config = core_transformer_config_from_args(args)
    # CPU semantics everywhere (also on a CUDA machine): CPU-side init, no torch.compile fusions.
    config.use_cpu_initialization = True
    config.perform_initialization = bool(request.live)
    config.bias_activation_fusion = config.bias_dropout_fusion = False
    config.masked_softmax_fusion = False

    constants = ProcessConstants(**{
        key: int(value * MiB) for key, value in (
            ("cuda_context_bytes", request.cuda_context_mib),
            ("nccl_bytes_per_communicator", request.nccl_mib_per_communicator))
        if value is not None})
    try:
        target = CudaTarget.for_gpu(request.gpu, request.hardware_file, cublas_workspace_bytes=(
            None if request.cublas_workspace_mib is None
            else int(request.cublas_workspace_mib * MiB)))
    except ValueError as exc:  # HardwareProfileError: an unknown profile or one without the fields
        raise TraceError(str(exc)) from None
    recorder = AllocationRecorder(cuda_semantics=request.cuda_semantics, target=target)
    with contextlib.ExitStack() as stack:
        stack.callback(_forget_rope_tables)  # last out: after the model is torn down
        stack.enter_context(fake_distributed(request.world_size, request.rank, request.tp,
                                             request.pp, request.cp))
        coordinates = rank_coordinates(request.rank)
        fake_mode = None if request.live else stack.enter_context(fake_tensors())
        if fake_mode is not None:  # skipped tiles compute nothing: fake tensors only
            stack.enter_context(repeated_by(recorder.repeat_tiles))
        memo = None
        if request.memo_offload:
            memo = _tracing_memo(args, recorder, stack, request.microbatches_in_flight)
        # The trainer's model, built by its own spec (--transformer-impl local).
        model = gpt.model_provider(
            config, args, pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(), memo=memo)
        attention_kernel = traced_attention_kernel(request, args, target)
        stack.enter_context(kernels.declared_workspaces(
            request.flash_workspace, kernel=attention_kernel,
            capability=target.compute_capability))
        # FakeTensorMode's op cache costs more than it saves on DDP's thousands of one-off
        # views into the contiguous buffers (measured: 9.5 s -> 5.5 s for 7B).
        with uncached(fake_mode):
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                overlap_grad_reduce=False,
                use_distributed_optimizer=args.use_distributed_optimizer,
                **(megatron_fsdp.ddp_config_fields(args) if args.use_megatron_fsdp else {}))
            if args.use_megatron_fsdp:  # the trainer's wrap, with the fake world's seams
                stack.enter_context(megatron_fsdp.fake_world_seams(recorder.follow_resize))
                ddp = megatron_fsdp.wrap_fake(config, ddp_config, model)
            else:
                ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        ddp.train()
        forward_step, backward_done = make_forward_step(args, ddp, config)
        optimizer_states = _optimizer_states(args, ddp, recorder)
        record_kwargs = {
            "forward_step": forward_step,
            "microbatch_backward_done": backward_done,
            "abandon_warmup": None if memo is None else memo.abandon_forward,
            "microbatches": request.microbatches_in_flight,
            "warmup": warmup_mode(request),
            "optimizer_states": optimizer_states,
            # DDP's finish_grad_sync reduce-scatters / all-reduces the gradient buffer in place
            # (no allocation); FakeTensorMode has no rule for its coalesced collectives.
            "after_backward": None,
            "constants": constants.entries(
                communicators_for_layout(request.tp, request.cp, request.pp, request.dp)),
            "deallocate_pipeline_outputs": config.deallocate_pipeline_outputs,
        }
        yield TracedRank(args=args, config=config, model=ddp, recorder=recorder,
                         header=trace_header(request, args, coordinates, constants,
                                             attention_kernel),
                         record_kwargs=record_kwargs)


def _forget_rope_tables() -> None:
    """Empty megatron-core's RoPE table caches. ``RotaryEmbedding.forward`` (and YaRN's) is an
    ``lru_cache`` of 32 entries keyed by the module: a trace's table is a storage whose
    free-finalizer is bound to the trace's recorder, so each trace's recorder, with every event
    it recorded, stayed alive in a tracer worker until 32 later models pushed it out
    (tests/unit/megatron/training/test_tracing_leaves_nothing.py). A trace builds its own model,
    so it never hits an earlier trace's entry: emptying the cache changes no trace."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    for embedding in (RotaryEmbedding, YarnRotaryEmbedding):
        embedding.forward.cache_clear()


def record(request: TraceRequest):
    """Build the requested rank and record its iteration (or its persistent state alone,
    ``persistent_only``). Returns (trace, trainer args). Raises TraceError, or the trainer's
    own ArgumentValidationError / SystemExit for flags it refuses."""
    with traced_rank(request) as rank:
        return rank.record(persistent_only=request.persistent_only), rank.args


def trace_to_file(request: TraceRequest, output: str) -> None:
    """Record ``request`` and write the trace to ``output`` (gzipped JSON lines)."""
    from memo_ext.trace import write_trace

    trace, _args = record(request)
    write_trace(trace, output)


class _TailWriter:
    """A text stream that passes writes through to ``stream`` and keeps the last few KiB, so a
    failed request can answer with the last line it wrote."""

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


def _answer(line: str, stderr: _TailWriter) -> dict:
    """Trace one request line; the reply (module docstring)."""
    try:
        message = json.loads(line)
        trace_to_file(TraceRequest.from_dict(message["request"]), message["output"])
        return {"ok": True}
    except (TraceError, MemoConfigError) as exc:
        return {"ok": False, "error": f"error: {exc}"}
    except SystemExit as exc:  # the trainer's argparse refusals
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        return {"ok": False, "error": stderr.last_line() or f"exit status {exc.code}"}
    except Exception:  # as an uncaught exception would end a tracer process
        traceback.print_exc()
        return {"ok": False, "error": stderr.last_line()}


def serve() -> int:
    """Trace request after request in this process (module docstring). Importing torch and
    megatron costs ~3.5 s, more than tracing a small model; a worker pays it once."""
    # The protocol keeps the real stdout; fd 1 then points at stderr, so nothing else the
    # tracing prints (print, warnings, C libraries) can corrupt the protocol.
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    # The interpreter's and the libraries' objects live as long as the worker: moved out of the
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
            reply = _answer(line, stderr)
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


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        raise SystemExit("usage: python -m megatron.training.tracing --serve "
                         "(requests come on stdin; tools/trace.py traces one from flags)")
    sys.exit(serve())
