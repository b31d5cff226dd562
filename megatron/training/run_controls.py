"""Megatron-LM's run controls: manual garbage collection (``--manual-gc``), the wall-clock exit
(``--exit-duration-in-mins``) and releasing cached device memory
(``--empty-unused-memory-level``), with Megatron-LM's meaning (megatron/training/training.py
at the reference commit of docs/megatron_flags.md). The training loop calls them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from typing import Iterator

import torch

#: When this process started, for --exit-duration-in-mins (Megatron-LM also counts from the
#: training module's import, before the expensive setup).
PROCESS_START = time.time()


def add_run_control_args(group) -> None:
    group.add_argument(
        "--manual-gc", action="store_true",
        help="Turn Python's automatic garbage collector off; collect before training, around "
        "each evaluation and every --manual-gc-interval iterations (aligns collections across "
        "ranks).",
    )
    group.add_argument(
        "--manual-gc-interval", type=int, default=0,
        help="With --manual-gc: a full collection every this many iterations (0: none).",
    )
    group.add_argument(
        "--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
        help="With --manual-gc: no collections around evaluations.",
    )
    group.add_argument(
        "--exit-duration-in-mins", type=float, default=None,
        help="Save (with --save) and exit after the iteration during which the run passes this "
        "many minutes.",
    )
    group.add_argument(
        "--empty-unused-memory-level", type=int, default=0, choices=(0, 1, 2),
        help="Release cached CUDA memory (torch.cuda.empty_cache): 1 after each forward-backward "
        "and evaluation batch, 2 also after the optimizer step.",
    )


class ManualGC:
    """--manual-gc: the collector off for the run; full collections at the start, every
    --manual-gc-interval iterations, and around evaluations (generation 0 after them), as
    Megatron-LM's training loop does. A no-op without the flag."""

    def __init__(self, args: argparse.Namespace):
        self.enabled = bool(args.manual_gc)
        self.interval = args.manual_gc_interval
        self.around_eval = args.manual_gc_eval
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.enabled:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        if self.enabled and self.around_eval:
            gc.collect()
        yield
        if self.enabled and self.around_eval:
            gc.collect(generation=0)

    def stop(self) -> None:
        """Give the collector back as it was (the trainer may be a library call)."""
        if self.enabled and self._was_enabled:
            gc.enable()


def duration_exceeded(args: argparse.Namespace, now: float | None = None) -> bool:
    """--exit-duration-in-mins: whether any rank has run longer (a MAX all-reduce, so that
    every rank takes the same decision)."""
    if not args.exit_duration_in_mins:
        return False
    import torch.distributed as dist

    minutes = ((time.time() if now is None else now) - PROCESS_START) / 60.0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    done = torch.tensor([int(minutes > args.exit_duration_in_mins)], dtype=torch.int,
                        device=device)
    if dist.is_initialized():
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return bool(done.item())


def empty_unused_memory(args: argparse.Namespace, level: int) -> None:
    """torch.cuda.empty_cache() when --empty-unused-memory-level is at least ``level`` (CPU:
    there is no cache to release)."""
    if args.empty_unused_memory_level >= level and torch.cuda.is_available():
        torch.cuda.empty_cache()
