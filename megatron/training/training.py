"""pretrain(): build, resume, train, evaluate, checkpoint. Read it top to bottom.

Parallelism, the pipeline schedule, gradient reduction and the optimizer are megatron.core's;
this module wires them together the way Megatron-LM's training loop does, with explicit
arguments instead of global state. The optional MEMO mechanisms (offload, SPPO, METP,
telemetry, planner) reach the loop only through megatron.training.mechanisms' registry.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from memo_ext.attention import attention_dropout_notice
from memo_ext.estimate.flops import gpt_shape, model_flops_per_sequence, parameter_count

from megatron.training import checkpointing, megatron_fsdp, metrics
from megatron.training.arguments import ArgumentValidationError, core_transformer_config_from_args
from megatron.training.fsdp_optimizer_offload import building_sharded_offload
from megatron.training.data import build_data_iterator, build_datasets
from megatron.training.initialize import initialize_megatron
from megatron.training.mechanisms import Mechanisms, build_mechanisms, build_planner_mechanism
from megatron.training.optimizer_offload import host_tensors_line
from megatron.training.profiling import ProfilerRange
from megatron.training.run_controls import ManualGC, duration_exceeded, empty_unused_memory
from megatron.training.signal_handler import DistributedSignalHandler
from megatron.training.timing import build_timers, log_timers
from megatron.training.tokenizer import build_tokenizer, model_vocab_size, padded_vocab_size
from megatron.training.wandb_logging import open_wandb_run

ModelProvider = Callable[..., torch.nn.Module]
ForwardStep = Callable[[Iterator, torch.nn.Module], tuple]


@dataclass
class TrainState:
    """What a checkpoint must carry besides model and optimizer to resume exactly."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def print_rank_last(message: str) -> None:
    """Print from the last rank, which holds the loss (last pipeline stage)."""
    if dist.get_rank() == dist.get_world_size() - 1:
        print(message, flush=True)


def print_rank_0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def build_stage_module(args: argparse.Namespace, config, model_provider: ModelProvider,
                       mechanisms: Optional[Mechanisms] = None) -> torch.nn.Module:
    """This pipeline stage's model on the device, in fp16/bf16 when asked (no DDP: what
    evaluation runs; training wraps it in DDP, :func:`build_model`), with the layer specs of
    ``mechanisms`` (megatron.training.mechanisms)."""
    model = model_provider(
        config=config,
        args=args,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **(mechanisms or Mechanisms()).model_options(),
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.fp16 or args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def build_model(args: argparse.Namespace, config, model_provider: ModelProvider,
                mechanisms: Optional[Mechanisms] = None) -> list:
    """This stage's model chunk wrapped in megatron.core DDP (a one-element list), with
    ``mechanisms`` attached to it."""
    mechanisms = mechanisms or Mechanisms()
    model = build_stage_module(args, config, model_provider, mechanisms)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        **(megatron_fsdp.ddp_config_fields(args) if args.use_megatron_fsdp else {}),
    )
    if args.use_megatron_fsdp:
        model = [megatron_fsdp.wrap(config, ddp_config, model, args.optimizer_cpu_offload)]
    else:
        model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)]
    mechanisms.attach(model)  # last: moving to CUDA, casting and DDP's buffers replace storages
    return model


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    """megatron.core's OptimizerConfig of the trainer's flags (also the tracer's, which builds
    the same optimizer to learn --optimizer-offload-fraction's split:
    megatron.training.optimizer_offload)."""
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=args.params_dtype,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        use_distributed_optimizer=args.use_distributed_optimizer,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        use_torch_optimizer_for_cpu_offload=args.use_torch_optimizer_for_cpu_offload,
        overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
        pin_cpu_grads=args.pin_cpu_grads,
        pin_cpu_params=args.pin_cpu_params,
    )


def build_optimizer(args: argparse.Namespace, model: list):
    """megatron.core optimizer (torch AdamW/SGD without apex/TE; with --optimizer-cpu-offload its
    HybridDeviceOptimizer inside the distributed optimizer) and its LR/WD scheduler."""
    with building_sharded_offload():
        optimizer = get_megatron_optimizer(optimizer_config(args), model)
    samples = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=schedule_steps(args)["warmup"],
        lr_decay_steps=schedule_steps(args)["decay"],
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=schedule_steps(args)["wd_incr"],
        wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=(args.lr_wsd_decay_iters or 0) * samples,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
    return optimizer, scheduler


def schedule_steps(args: argparse.Namespace) -> dict[str, float]:
    """The LR/WD schedule's warmup, decay and weight-decay increment, in samples (what
    OptimizerParamScheduler counts), as Megatron-LM derives them: from iterations times the
    global batch, or with --train-samples from --lr-warmup-samples/--lr-decay-samples (or
    --lr-warmup-fraction of the decay)."""
    if args.train_samples is None:
        samples = args.global_batch_size
        return {"warmup": args.lr_warmup_iters * samples, "decay": args.lr_decay_iters * samples,
                "wd_incr": args.train_iters * samples}
    decay = args.lr_decay_samples
    warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
              else args.lr_warmup_samples)
    return {"warmup": warmup, "decay": decay, "wd_incr": args.train_samples}


def logged_lr(optimizer, scheduler) -> float:
    """The LR of the log line: that of the parameters on the default schedule (not
    --decoupled-lr's embedding and output layer), as Megatron-LM logs it."""
    groups = optimizer.param_groups
    group = next((g for g in groups if g.get("default_config", True)), groups[0])
    return scheduler.get_lr(group)


def reduce_losses(loss_dicts: list[dict]) -> dict[str, float]:
    """Token-weighted mean of each reported loss over micro-batches and data-parallel ranks.

    Each micro-batch reports ``name -> tensor([loss_sum, num_tokens])``.
    """
    if not parallel_state.is_pipeline_last_stage():
        return {}
    reduced = {}
    for name in loss_dicts[0] if loss_dicts else ():
        total = torch.stack([d[name] for d in loss_dicts]).sum(dim=0).double()
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        reduced[name] = (total[0] / total[1].clamp(min=1)).item()
    return reduced


def run_schedule(forward_step: ForwardStep, data_iterator, model: list,
                 args: argparse.Namespace, forward_only: bool,
                 mechanisms: Optional[Mechanisms] = None) -> list[dict]:
    """One global batch through megatron.core's schedule (1F1B with PP), or the one a mechanism
    replaces it with (SPPO's subsequence schedule); loss reports (per micro-batch or
    subsequence) on the last stage."""
    schedule = (mechanisms or Mechanisms()).schedule()
    if schedule is not None:
        return schedule(
            forward_step_func=forward_step, data_iterator=data_iterator, model=model,
            num_microbatches=args.num_microbatches, forward_only=forward_only,
            config=get_model_config(model[0]))
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length // args.context_parallel_size,
        micro_batch_size=args.micro_batch_size,
        forward_only=forward_only,
    )


def train_step(forward_step: ForwardStep, data_iterator, model: list, optimizer, scheduler,
               args: argparse.Namespace,
               mechanisms: Optional[Mechanisms] = None) -> tuple[dict[str, float], float, bool]:
    """One global batch: forward/backward over all micro-batches, then the optimizer step
    (inside the mechanisms' ``optimizer_phase()``: telemetry attributes its allocations).

    Returns (losses, grad norm, skipped) -- skipped is True when fp16 overflowed.
    """
    mechanisms = mechanisms or Mechanisms()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss_dicts = run_schedule(forward_step, data_iterator, model, args, forward_only=False,
                              mechanisms=mechanisms)
    empty_unused_memory(args, level=1)
    timers = get_model_config(model[0]).timers  # --timing-log-level
    if timers is not None:
        timers("optimizer", log_level=1).start()
    with mechanisms.optimizer_phase():
        update_successful, grad_norm, _ = optimizer.step()
    if timers is not None:
        timers("optimizer").stop()
    empty_unused_memory(args, level=2)
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    return reduce_losses(loss_dicts), grad_norm if grad_norm is not None else 0.0, not update_successful


def evaluate(forward_step: ForwardStep, data_iterator, model: list,
             args: argparse.Namespace, mechanisms: Optional[Mechanisms] = None) -> dict[str, float]:
    """Mean validation loss over --eval-iters global batches."""
    for chunk in model:
        chunk.eval()
    loss_dicts = []
    with torch.no_grad():
        for _ in range(args.eval_iters):
            loss_dicts += run_schedule(forward_step, data_iterator, model, args, forward_only=True,
                                       mechanisms=mechanisms)
            empty_unused_memory(args, level=1)
    for chunk in model:
        chunk.train()
    return reduce_losses(loss_dicts)


class TrainingLogger:
    """Formats the per-interval line and writes tensorboard / JSON-lines metrics (last rank)."""

    def __init__(self, args: argparse.Namespace, flops_per_iteration: float, peak_tflops: float,
                 timers=None):
        self.args = args
        self.flops_per_iteration = flops_per_iteration
        self.peak_tflops = peak_tflops
        self.timers = timers  # --timing-log-level's megatron-core Timers, or None
        self.is_writer = dist.get_rank() == dist.get_world_size() - 1
        self.tensorboard = None
        if self.is_writer and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir)
        self.wandb = open_wandb_run(args, self.is_writer)  # --wandb-project, else None
        self.interval_start = time.perf_counter()
        self.interval_iterations = 0
        if not torch.cuda.is_available():
            metrics.rss_peak_meter()  # start sampling now: each line reports its interval's peak

    def log(self, iteration: int, losses: dict[str, float], lr: float, grad_norm: float,
            skipped: bool) -> None:
        self.interval_iterations += 1
        if iteration % self.args.log_interval != 0:
            return
        # Memory is gathered from every rank, so all ranks take part in logging. Peaks are
        # since the previous log line (CPU: peak RSS, mem_peak_rss_mib; CUDA: allocator peak).
        memory = metrics.max_over_ranks(metrics.memory_report())
        iterations = self.interval_iterations
        elapsed = (time.perf_counter() - self.interval_start) / iterations
        self.interval_start = time.perf_counter()
        self.interval_iterations = 0
        tokens_per_s = self.args.global_batch_size * self.args.seq_length / elapsed
        achieved_tflops = self.flops_per_iteration / elapsed / 1e12 / self.args.world_size
        record = {
            "iteration": iteration,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "skipped": skipped,
            "iteration_time_s": elapsed,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": achieved_tflops,
            "mfu": achieved_tflops / self.peak_tflops,
            **{name.replace(" ", "_"): value for name, value in losses.items()},
            **memory,
        }
        if self.args.log_timers_to_tensorboard:
            record["iteration-time"] = elapsed  # Megatron-LM's scalar name
        if self.is_writer:
            self._print_line(iteration, losses, lr, grad_norm, skipped, record, memory)
            self._write(record)
        # Collective (the timers are reduced over ranks): after the line, as Megatron-LM.
        log_timers(self.timers, iterations, iteration, self.args.log_timers_to_tensorboard,
                   self if self.is_writer else None)

    def _print_line(self, iteration: int, losses: dict[str, float], lr: float, grad_norm: float,
                    skipped: bool, record: dict, memory: dict) -> None:
        elapsed, tokens_per_s = record["iteration_time_s"], record["tokens_per_s"]
        achieved_tflops = record["tflops_per_device"]
        memory_text = " | ".join(f"{k.removeprefix('mem_')}: {v:.1f}" for k, v in memory.items())
        if not any(k.endswith("_since_start_mib") for k in memory):
            memory_text += " (MiB, max over ranks; peaks since the previous log line)"
        else:
            memory_text += " (MiB, max over ranks)"
        loss_text = " | ".join(f"{name}: {value:.6E}" for name, value in losses.items())
        print(
            f" iteration {iteration:8d}/{self.args.train_iters:8d} | {loss_text} | lr: {lr:.4E} "
            f"| grad norm: {float(grad_norm):.3f} | iter time (s): {elapsed:.3f} "
            f"| tokens/s: {tokens_per_s:.1f} | TFLOP/s/device: {achieved_tflops:.3f} "
            f"| MFU: {100 * record['mfu']:.2f}% | {memory_text}"
            + (" | skipped (overflow)" if skipped else ""),
            flush=True,
        )

    def log_validation(self, iteration: int, losses: dict[str, float]) -> None:
        if not self.is_writer or not losses:
            return
        text = " | ".join(
            f"{name} value: {value:.6E} | {name} PPL: {math.exp(min(20.0, value)):.4E}"
            for name, value in losses.items()
        )
        print(f" validation at iteration {iteration} | {text}", flush=True)
        self._write({"iteration": iteration,
                     **{f"validation_{k.replace(' ', '_')}": v for k, v in losses.items()}})

    def log_memory(self, record: dict) -> None:
        """Write a --memo-telemetry record (already printed by rank 0) to the metrics files."""
        if self.is_writer:
            self._write(record)

    def add_scalar(self, name: str, value: float, iteration: int) -> None:
        """One scalar to TensorBoard and W&B (the timers, megatron.training.timing)."""
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(name, value, iteration)
        if self.wandb is not None:
            self.wandb.log({name: value}, step=iteration)

    def close(self) -> None:
        """Flush and close TensorBoard and the W&B run."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

    def _write(self, record: dict) -> None:
        scalars = {key: value for key, value in record.items()
                   if key != "iteration" and isinstance(value, (int, float))}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, record["iteration"])
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["iteration"])
        if self.args.log_metrics_jsonl:
            with open(self.args.log_metrics_jsonl, "a") as handle:
                handle.write(json.dumps(record) + "\n")


def pretrain(args: argparse.Namespace, model_provider: ModelProvider, forward_step: ForwardStep,
             extra_initialization: Optional[Callable[[argparse.Namespace], None]] = None) -> TrainState:
    """Train a GPT model as configured by validated ``args``. Returns the final state."""
    initialize_megatron(args)
    if extra_initialization is not None:
        extra_initialization(args)
    try:  # a tokenizer file the flags name but cannot be used: one line, as a bad flag
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                                    args.vocab_file, args.merge_file)
        vocab_size = model_vocab_size(tokenizer, args.tokenizer_type, args.vocab_size)
    except ValueError as error:
        raise ArgumentValidationError(str(error)) from None
    args.padded_vocab_size = padded_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    config = core_transformer_config_from_args(args)
    config.timers = timers = build_timers(args)  # --timing-log-level: megatron-core times phases
    mechanisms = build_mechanisms(args, log=print_rank_0)  # telemetry, MEMO, SPPO, METP
    model = build_model(args, config, model_provider, mechanisms)
    # Once per run: what --attention-dropout > 0 costs (the explicit kernel, not flash).
    dropout_notice = attention_dropout_notice(model, args.seq_length, args.micro_batch_size)
    if dropout_notice is not None:
        print_rank_0(dropout_notice)
    optimizer, scheduler = build_optimizer(args, model)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner.config.timers = timers  # the optimizer's phases (copy, clip, step, all-gather)
    mechanisms.register(build_planner_mechanism(args, model, log=print_rank_0))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model[0].no_sync
    if args.fp16:
        config.grad_scale_func = optimizer.scale_loss

    train_ds, valid_ds, _ = build_datasets(args, tokenizer)
    # The estimator's P and FLOPs (memo_ext.estimate.flops), from the unpadded vocabulary.
    shape = gpt_shape(args, vocab_size)
    num_parameters = parameter_count(shape)
    peak_tflops, peak_source = metrics.peak_tflops_per_device(args)

    # Loaded last, so that no setup step can advance the restored random generators.
    state = TrainState()
    if args.load is not None:
        state = checkpointing.load_checkpoint(args, model, optimizer, scheduler) or state
    train_iterator = build_data_iterator(train_ds, state.consumed_train_samples, args)
    valid_iterator = build_data_iterator(valid_ds, state.consumed_valid_samples, args, cyclic=True)

    flops_per_iteration = model_flops_per_sequence(shape, args.seq_length) * args.global_batch_size
    print_rank_0(
        f"> model: {num_parameters / 1e6:.2f} M parameters in per-token GEMMs (MFU's P) | layout "
        f"TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
        f"CP={args.context_parallel_size} DP={args.data_parallel_size} SP={args.sequence_parallel}"
        " | micro-batches per step: "
        f"{args.num_microbatches} | MFU peak {peak_tflops:.3f} TFLOP/s per device ({peak_source})"
    )
    logger = TrainingLogger(args, flops_per_iteration, peak_tflops, timers)
    signal_handler = DistributedSignalHandler(args.exit_signal) if args.exit_signal_handler else None

    train_forward_step = mechanisms.wrap_forward_step(forward_step)  # evaluation's is not

    for chunk in model:
        chunk.train()
    try:
        return _train(args, state, model, optimizer, scheduler, mechanisms, logger, signal_handler,
                      train_forward_step, forward_step, train_iterator, valid_iterator)
    finally:
        # Training is over, or died: --memo-plan's CUDA arena stops serving before the caller
        # (or the interpreter's teardown) frees what is left.
        mechanisms.close()
        logger.close()


def gather_parameters(model: list, args: argparse.Namespace) -> None:
    """--overlap-param-gather: all-gather now the parameter shards the next forward's pre-hooks
    would (before a checkpoint, as Megatron-LM). Megatron-FSDP checkpoints its shards, which
    the step updated: nothing to gather."""
    if args.overlap_param_gather and not args.use_megatron_fsdp:
        for chunk in model:
            chunk.start_param_sync(force_sync=True)


@contextlib.contextmanager
def parameters_gathered(model: list, args: argparse.Namespace):
    """--overlap-param-gather: evaluation runs with the forward pre-hooks off and every
    parameter gathered (as Megatron-LM); training's hooks come back afterwards. Megatron-FSDP
    keeps its hooks: they gather each unit's parameters in evaluation too (Megatron-LM's
    should_disable_forward_pre_hook is False with it)."""
    if not args.overlap_param_gather or args.use_megatron_fsdp:
        yield
        return
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in model:
            chunk.enable_forward_pre_hook()


def _train(args, state, model, optimizer, scheduler, mechanisms, logger, signal_handler,
           train_forward_step, forward_step, train_iterator, valid_iterator) -> TrainState:
    """pretrain's loop: train to --train-iters, evaluating and saving on their intervals; with
    Megatron-LM's run controls (megatron.training.run_controls: --manual-gc,
    --exit-duration-in-mins) and --profile's range."""
    manual_gc, profiler = ManualGC(args), ProfilerRange(args, dist.get_rank())
    manual_gc.start()
    try:
        return _train_loop(args, state, model, optimizer, scheduler, mechanisms, logger,
                           signal_handler, train_forward_step, forward_step, train_iterator,
                           valid_iterator, manual_gc, profiler)
    finally:
        profiler.close()
        manual_gc.stop()


def _train_loop(args, state, model, optimizer, scheduler, mechanisms, logger, signal_handler,
                train_forward_step, forward_step, train_iterator, valid_iterator, manual_gc,
                profiler) -> TrainState:
    def save() -> None:
        gather_parameters(model, args)
        checkpointing.save_checkpoint(args, state, model, optimizer, scheduler)

    while state.iteration < args.train_iters:
        profiler.before_step(state.iteration)
        # An out-of-memory error in the step becomes a report and MemoryBudgetExceeded.
        with mechanisms.step(state.iteration + 1):
            losses, grad_norm, skipped = train_step(
                train_forward_step, train_iterator, model, optimizer, scheduler, args, mechanisms,
            )
        state.iteration += 1
        profiler.after_step(state.iteration)
        manual_gc.after_step(state.iteration)
        state.consumed_train_samples += args.global_batch_size
        mechanisms.end_step(state.iteration)
        logger.log(state.iteration, losses, logged_lr(optimizer, scheduler), grad_norm, skipped)
        mechanisms.report(state.iteration, logger)  # collective (telemetry's fail-fast)
        if args.optimizer_cpu_offload and state.iteration == 1:  # its host state now exists
            # one write: the ranks share stdout, and print writes the newline apart
            sys.stdout.write(host_tensors_line(optimizer, dist.get_rank(), state.iteration)
                             + "\n")
            sys.stdout.flush()

        if args.eval_iters > 0 and valid_iterator is not None and state.iteration % args.eval_interval == 0:
            with manual_gc.evaluation(), parameters_gathered(model, args):
                losses = evaluate(forward_step, valid_iterator, model, args, mechanisms)
            logger.log_validation(state.iteration, losses)
            state.consumed_valid_samples += args.eval_iters * args.global_batch_size

        if signal_handler is not None and signal_handler.any_rank_signalled():
            save()
            print_rank_0(f"> {args.exit_signal} received: checkpoint saved at iteration "
                         f"{state.iteration}, exiting")
            return state
        saved = bool(args.save and args.save_interval and state.iteration % args.save_interval == 0)
        if saved:
            save()
        if args.exit_interval and state.iteration % args.exit_interval == 0:
            if args.save and not saved:
                save()
            print_rank_0(f"> exiting at iteration {state.iteration} (--exit-interval)")
            return state
        if duration_exceeded(args):  # collective: every rank takes the same decision
            if args.save and not saved:
                save()
            print_rank_0(f"> exiting at iteration {state.iteration}: the run passed "
                         f"--exit-duration-in-mins {args.exit_duration_in_mins:g}")
            return state

    if args.save and not (args.save_interval and state.iteration % args.save_interval == 0):
        save()
    return state
