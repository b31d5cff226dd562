"""Megatron-LM's timers: ``--timing-log-level``, ``--timing-log-option`` and
``--log-timers-to-tensorboard``, on megatron-core's own Timers.

megatron-core's schedules and optimizers time their phases into ``config.timers`` when it is
set (forward-backward at level 1; forward/backward compute and pipeline send/receive at level
2; the optimizer's copy, clip, inner step and parameter all-gather at level 1). The training
loop adds 'optimizer' (level 1) around the step, as Megatron-LM does. Each log interval the
timers are printed on the last rank (per iteration, reduced over ranks by
--timing-log-option) and, with --log-timers-to-tensorboard, written to TensorBoard and W&B.
Level 0 (the default) times nothing beyond the iteration time the log line always has.
"""

from __future__ import annotations

import argparse

#: The timers printed, in Megatron-LM's order (training_log's timers_to_log); those that did not
#: run in an interval are left out of the printout.
TIMER_NAMES = (
    "forward-backward", "forward-compute", "backward-compute", "batch-generator",
    "forward-recv", "forward-send", "backward-recv", "backward-send",
    "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
    "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
    "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
    "optimizer-copy-main-to-model-params", "optimizer",
)


def add_timing_args(group) -> None:
    group.add_argument(
        "--timing-log-level", type=int, default=0, choices=(0, 1, 2),
        help="megatron-core timers printed each log interval: 0 none (iteration time only); 1 "
        "forward-backward and the optimizer's phases; 2 also forward/backward compute and "
        "pipeline send/receive (more synchronisation, slower iterations).",
    )
    group.add_argument(
        "--timing-log-option", default=None, choices=("max", "minmax", "all"),
        help="With --timing-log-level > 0: how timers are reduced over ranks (default minmax).",
    )
    group.add_argument(
        "--log-timers-to-tensorboard", action="store_true",
        help="Write the iteration time and the timers to TensorBoard (and W&B).",
    )


def build_timers(args: argparse.Namespace):
    """megatron-core Timers for --timing-log-level > 0, else None (nothing timed)."""
    if args.timing_log_level == 0:
        return None
    from megatron.core.timers import Timers

    return Timers(args.timing_log_level, args.timing_log_option)


def log_timers(timers, iterations: int, iteration: int, write: bool, scalars=None) -> None:
    """Print on the last rank, per iteration over the last ``iterations``, the timers that ran,
    then reset them. With ``write`` (--log-timers-to-tensorboard) first write each one's
    maximum over ranks as ``<name>-time`` (seconds per iteration, as Megatron-LM) to
    ``scalars`` (an object with ``add_scalar``; None on ranks that do not write). Collective:
    every rank calls it."""
    if timers is None:
        return
    import torch.distributed as dist

    names = list(TIMER_NAMES)  # the same on every rank (the all-gather's shape); unused: left out
    if write:  # Timers.write's values (max over ranks, s per iteration); it takes only a
        # SummaryWriter or the wandb module, ``scalars`` writes to both
        maxima = timers._get_global_min_max_time(names, reset=False, barrier=False,
                                                 normalizer=iterations)
        if scalars is not None:
            for name, (_, longest) in maxima.items():
                scalars.add_scalar(f"{name}-time", longest, iteration)
    text = timers.get_all_timers_string(names, normalizer=iterations, reset=True)
    if text is not None and dist.get_rank() == dist.get_world_size() - 1:
        print(text, flush=True)
