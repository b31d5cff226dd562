"""Builds MEMO's runtime for the trainer from the --memo-* flags (memo_ext.offload's,
memo_ext.planner's and memo_ext.telemetry's entry points and config dataclasses are all the
trainer knows of them)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.training.packed_documents import OFFSETS_KEY
from memo_ext.config import (BYTES_PER_MIB, METPConfig, MemoConfigError, OffloadConfig,
                             PlanConfig, SPPOConfig, StitchingConfig, TelemetryConfig,
                             config_from_args)
from memo_ext.device import CopyEngine, cuda_memory_headroom, measure_offload_bandwidth
from memo_ext.device_memory import current_allocator
from memo_ext.offload import ActivationShape, MemoOffload, position_wise_share_of
from memo_ext.offload.alpha import default_host_memory_bytes, microbatches_in_flight
from memo_ext.telemetry import MemoryTelemetry

BYTES_PER_GB = 1e9


def _all_ranks_minimum(value: float) -> float:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor.item()


class _LabelledCopyEngine(CopyEngine):
    """A CopyEngine whose device buffers (MEMO's rounding buffers) telemetry counts as
    "offload", and its host buffers (MEMO's slots) as host."""

    def __init__(self, device, telemetry: MemoryTelemetry):
        super().__init__(device)
        self._telemetry = telemetry

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        with self._telemetry.offload_allocations():
            return super().alloc_device(nbytes)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        # On CUDA the slot is mapped and page-locked, not made by an op the tracker sees.
        host = super().alloc_host(nbytes)
        self._telemetry.tracker.mark_host(host)
        return host


def _compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _copy_engine_and_bandwidth(device: torch.device, telemetry: Optional[MemoryTelemetry],
                               given_bytes_per_s: Optional[float]) -> tuple[CopyEngine, float]:
    """The offload copy engine (its buffers labelled for telemetry) and the D2H bandwidth per
    rank in bytes/s: the given one, or measured with every rank copying at once (collective)."""
    engine = CopyEngine(device) if telemetry is None else _LabelledCopyEngine(device, telemetry)
    bandwidth = given_bytes_per_s
    if bandwidth is None:
        bandwidth = _all_ranks_minimum(measure_offload_bandwidth(engine, barrier=dist.barrier))
    return engine, bandwidth


def build_memo_telemetry(args: argparse.Namespace, log) -> Optional[MemoryTelemetry]:
    """--memo-telemetry's per-rank memory telemetry (memo_ext.telemetry), or None when off.
    Built before the model so that MEMO's buffers can be attributed; call
    :func:`attach_memo_telemetry` once the model exists."""
    config = config_from_args(TelemetryConfig, args)
    if not config.telemetry:
        return None
    telemetry = MemoryTelemetry(config, log_interval=args.log_interval, log=log)
    capacity = (f"{telemetry.capacity_bytes / BYTES_PER_GB:.4g} GB per rank"
                if telemetry.capacity_bytes else "unlimited (no fail-fast)")
    allocator = current_allocator()
    source = ("CPU tracker" if not telemetry.cuda else
              allocator.name if allocator is not None else "CUDA caching allocator")
    log(f"> memory telemetry: {source} "
        f"| capacity {capacity} | fail-fast margin {config.telemetry_fail_fast_margin:g} after "
        f"{config.telemetry_warmup_steps} steps | reports in {config.oom_report_dir}")
    return telemetry


def attach_memo_telemetry(telemetry: Optional[MemoryTelemetry], model: list) -> None:
    """Register the model's parameters and gradient buffers and hook its chunks."""
    if telemetry is None:
        return
    from memo_ext.planner.trace import persistent_tensors

    params, grads = [], []
    for chunk in model:
        chunk_params, chunk_grads = persistent_tensors(chunk)
        params += [tensor for _, tensor in chunk_params]
        grads += [tensor for _, tensor in chunk_grads]

    def comm_buffers() -> list:
        buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
        return list(getattr(buffer, "buffer", {}).values())

    telemetry.attach(model, params, grads, comm_buffers)


def memo_offload(args: argparse.Namespace, engine: CopyEngine, *, host_memory_bytes: int,
                 bandwidth_bytes_per_s: float, microbatches_in_flight: int, log,
                 **runtime) -> MemoOffload:
    """MEMO's runtime for a rank of the trainer ``args`` describe, copying through ``engine``:
    the one place MemoOffload is built from the flags, for the trainer
    (:func:`build_memo_offload`) and the tracer (megatron.training.tracing), so both run the
    same MEMO. ``runtime``: MemoOffload's keywords that differ between them (the alpha
    agreement across ranks, the device headroom, the host allocations' scope)."""
    return MemoOffload(
        config_from_args(OffloadConfig, args), engine,
        layers_per_stage=args.num_layers // args.pipeline_model_parallel_size,
        microbatches_in_flight=microbatches_in_flight, shape=ActivationShape.of_trainer(args),
        host_memory_bytes=host_memory_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        log=log, position_wise_share=position_wise_share_of(args), **runtime)


def build_memo_offload(args: argparse.Namespace, log,
                       telemetry: Optional[MemoryTelemetry] = None) -> Optional[MemoOffload]:
    """MEMO's runtime for this rank, or None without --memo-offload. Collective (measures the
    node's D2H bandwidth with every rank copying at once unless --memo-pcie-gbps is given).
    With ``telemetry``, its tracker counts the host slots as host memory and the rounding
    buffers as "offload", and on CPU its simulated capacity is MEMO's device headroom."""
    config = config_from_args(OffloadConfig, args)
    if not config.offload:
        return None
    device = _compute_device()
    engine, bandwidth = _copy_engine_and_bandwidth(device, telemetry, config.pcie_bytes_per_s)
    bandwidth_source = ("--memo-pcie-gbps" if config.pcie_bytes_per_s is not None
                        else "measured, all ranks copying at once")
    host_memory = _host_memory_budget(config.host_memory_bytes)
    in_flight = microbatches_in_flight(
        parallel_state.get_pipeline_model_parallel_rank(),
        args.pipeline_model_parallel_size,
        args.num_microbatches,
    )
    memo = memo_offload(
        args, engine, host_memory_bytes=host_memory, bandwidth_bytes_per_s=bandwidth,
        microbatches_in_flight=in_flight, log=log, agree_on_alpha=_all_ranks_minimum,
        device_headroom=_device_headroom(device, telemetry),
        **({} if telemetry is None else {"host_allocation_scope": telemetry.tracker.host_allocations}),
    )
    log(f"> MEMO offload: alpha {config.alpha} | D2H bandwidth {bandwidth / BYTES_PER_GB:.2f} GB/s "
        f"per rank ({bandwidth_source}) | host memory {host_memory / BYTES_PER_GB:.2f} GB per rank "
        f"| {in_flight} micro-batch(es) in flight on this stage | {memo.describe_modes()}")
    _report_host_slots(memo)
    return memo


def host_slots_line(memo: MemoOffload, iteration: int) -> str:
    """This rank's host slots now (every slot is free between iterations): count, bytes as
    allocated, bytes in whole pages (what page-locking them takes on CUDA) and the process's
    resident memory, which on CUDA includes the locked pages (memo_ext.estimate.host_memory
    compares its prediction with these)."""
    import psutil

    from memo_ext.host_pages import page_locked_bytes

    slots = [slot.numel() for free in memo.manager.host_slots.free.values() for slot in free]
    return (f"> MEMO host slots [rank {dist.get_rank()}, pipeline stage "
            f"{parallel_state.get_pipeline_model_parallel_rank()}, after iteration {iteration}, "
            f"alpha {memo.alpha:.4f}]: {len(slots)} slots, "
            f"{memo.manager.host_slots.allocated_bytes} B allocated, "
            f"{sum(page_locked_bytes(n) for n in slots)} B in whole pages | "
            f"process RSS {psutil.Process().memory_info().rss} B")


def _report_host_slots(memo: MemoOffload) -> None:
    """Every rank prints :func:`host_slots_line` after its first iteration and after the first
    iteration at a new alpha (--memo-alpha auto), from its own process (no collective)."""
    after_iteration = memo.after_iteration
    state = {"iteration": 0, "alpha": None}

    def reporting_after_iteration() -> None:
        state["iteration"] += 1
        if memo.manager.host_slots.allocated_bytes and memo.alpha != state["alpha"]:
            state["alpha"] = memo.alpha
            sys.stdout.write(host_slots_line(memo, state["iteration"]) + "\n")
            sys.stdout.flush()
        after_iteration()

    memo.after_iteration = reporting_after_iteration


def _host_memory_budget(flag_bytes: Optional[int]) -> int:
    """Host bytes an offloader on this rank may fill: the flag's value, or the host memory
    available now divided by the ranks on this node."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return flag_bytes or default_host_memory_bytes(local_ranks)


def build_memo_sppo(args: argparse.Namespace, log,
                    telemetry: Optional[MemoryTelemetry] = None):
    """--memo-sppo's runtime (memo_ext.sppo's SubsequencePipeline), or None when off.
    Collective when --memo-sppo-offload auto measures the D2H bandwidth."""
    config = config_from_args(SPPOConfig, args)
    if not config.sppo:
        return None
    from memo_ext.sppo import LayerFlops, SubsequencePipeline

    engine = bandwidth = None
    offloader_options = {}
    if config.offload_alpha != 0.0:
        engine, bandwidth = _copy_engine_and_bandwidth(_compute_device(), telemetry,
                                                       config.pcie_bytes_per_s)
        offloader_options["host_budget_bytes"] = _host_memory_budget(config.host_memory_bytes)
    flops = LayerFlops.of_gpt_layer(args.hidden_size, args.ffn_hidden_size,
                                    args.num_attention_heads, args.num_query_groups,
                                    args.kv_channels, args.swiglu)
    sppo = SubsequencePipeline(
        config, seq_length=args.seq_length, pipeline_size=args.pipeline_model_parallel_size,
        micro_batch_size=args.micro_batch_size, hidden_size=args.hidden_size, layer_flops=flops,
        multiple_of=args.tensor_model_parallel_size if args.sequence_parallel else 1,
        engine=engine, bandwidth_bytes_per_s=bandwidth, log=log, whole_keys=(OFFSETS_KEY,),
        **offloader_options,
        **({} if telemetry is None else {"host_allocation_scope": telemetry.tracker.host_allocations}),
    )
    log(f"> {sppo.describe()}"
        + ("" if bandwidth is None else f" | D2H bandwidth {bandwidth / BYTES_PER_GB:.2f} GB/s"))
    return sppo


def build_memo_metp(args: argparse.Namespace, log):
    """--memo-metp's runtime (memo_ext.metp's MemoryEfficientTP), or None when off."""
    if not config_from_args(METPConfig, args).metp:
        return None
    from memo_ext.metp import MemoryEfficientTP

    metp = MemoryEfficientTP(config_from_args(METPConfig, args), seq_length=args.seq_length,
                             tensor_parallel_size=args.tensor_model_parallel_size)
    log(f"> {metp.describe()}")
    return metp


def _device_headroom(device: torch.device, telemetry: Optional[MemoryTelemetry]):
    """What MEMO's alpha LP reads as free device memory: CUDA's, or on CPU the telemetry
    tracker's simulated capacity, less the fail-fast margin, less its peak (None: no device
    row)."""
    if device.type == "cuda":
        return lambda: cuda_memory_headroom(device)
    if telemetry is not None and telemetry.tracker.capacity_bytes is not None:
        return telemetry.headroom_bytes
    return None


def build_memo_planner(args: argparse.Namespace, model: list, log):
    """``--memo-plan``'s runtime (memo_ext.planner's MemoPlanner), or None when it is off.
    Raises PlanFileError (a MemoConfigError: one line, exit status 2) for an unusable plan."""
    config = config_from_args(PlanConfig, args)
    if config.mode == "off":
        return None
    from memo_ext.planner import MemoPlanner

    run_header = {
        "model": {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                  "ffn_hidden_size": args.ffn_hidden_size,
                  "num_attention_heads": args.num_attention_heads,
                  "seq_length": args.seq_length, "padded_vocab_size": args.padded_vocab_size,
                  "params_dtype": str(args.params_dtype)},
        "layout": {"tp": args.tensor_model_parallel_size, "cp": args.context_parallel_size,
                   "pp": args.pipeline_model_parallel_size,
                   "micro_batch_size": args.micro_batch_size,
                   "sequence_parallel": args.sequence_parallel},
    }
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return MemoPlanner(config.mode, model, run_header, log,
                       path=config.plan if config.mode == "file" else None, device=device)


def install_memo_plan_allocator(args: argparse.Namespace) -> None:
    """On CUDA, ``--memo-plan`` serves the layers' tensors from its own allocator, which must
    replace PyTorch's before the first CUDA allocation: call this before anything touches the
    GPU (process groups included)."""
    if torch.cuda.is_available() and config_from_args(PlanConfig, args).mode != "off":
        from memo_ext.planner import install_cuda_allocator

        install_cuda_allocator()


def install_memo_stitching_allocator(args: argparse.Namespace, log) -> None:
    """``--memo-stitching-allocator``: build (when its sources changed) and install GMLake's
    stitching allocator as PyTorch's CUDA allocator, registered with memo_ext.device_memory, and
    say so once through ``log``. Like --memo-plan's arena it must replace PyTorch's allocator
    before the first CUDA allocation: call it where :func:`install_memo_plan_allocator` is
    called. Validation refused the flag without CUDA and with --memo-plan. A failed build raises
    the compiler's RuntimeError; an allocator already in use, MemoConfigError."""
    config = config_from_args(StitchingConfig, args)
    if not config.stitching_allocator:
        return
    from memo_ext.alloc.stitching_cuda import build_library, install

    library = build_library()
    try:
        install(frag_limit_bytes=config.frag_limit_bytes, library=library)
    except RuntimeError as error:
        raise MemoConfigError(
            f"--memo-stitching-allocator: cannot install the stitching allocator ({error}); it "
            "must be installed before the first CUDA tensor exists: do not allocate on the GPU "
            "before initialize_megatron, or drop the flag") from None
    log(f"> GMLake stitching allocator installed as PyTorch's CUDA allocator (frag limit "
        f"{config.frag_limit_bytes / BYTES_PER_MIB:g} MiB, {library}); memory statistics and "
        "record_stream go through memo_ext.device_memory")
