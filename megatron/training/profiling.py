"""``--profile``: Megatron-LM's default (Nsight Systems) profiling range.

On the --profile-ranks (default: all), iterations [--profile-step-start, --profile-step-end)
run between ``cudaProfilerStart`` and ``cudaProfilerStop``, which is what
``nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop`` captures. The
iteration numbers count as Megatron-LM's loop does: the range opens before the step that
starts with ``--profile-step-start`` iterations done and closes after the one that completes
``--profile-step-end``. CUDA only: on CPU the trainer refuses --profile in one line.
"""

from __future__ import annotations

import argparse
from typing import Optional


def add_profile_args(group) -> None:
    group.add_argument(
        "--profile", action="store_true",
        help="CUDA: open cudaProfilerStart/Stop around iterations [--profile-step-start, "
        "--profile-step-end), for nsys --capture-range=cudaProfilerApi.",
    )
    group.add_argument("--profile-step-start", type=int, default=None,
                       help="With --profile: the iteration the range opens at (default 10).")
    group.add_argument("--profile-step-end", type=int, default=None,
                       help="With --profile: the iteration the range closes at (default 12).")
    group.add_argument("--profile-ranks", type=int, nargs="+", default=None,
                       help="With --profile: the global ranks that profile (default all).")


def profile_problem(args: argparse.Namespace, cuda_available: bool) -> Optional[str]:
    """Why the profiling flags cannot run (one line naming the flag), or None; fills the
    defaults."""
    if not args.profile:
        for flag in ("--profile-step-start", "--profile-step-end", "--profile-ranks"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                return f"{flag} has no effect without --profile; add --profile or drop the flag"
        return None
    if not cuda_available:
        return ("--profile opens a CUDA profiler range (cudaProfilerStart/Stop) for nsys; "
                "there is no CUDA device here, drop the flag on CPU")
    args.profile_step_start = 10 if args.profile_step_start is None else args.profile_step_start
    args.profile_step_end = 12 if args.profile_step_end is None else args.profile_step_end
    args.profile_ranks = args.profile_ranks or []
    if not 0 <= args.profile_step_start < args.profile_step_end:
        return (f"--profile-step-start {args.profile_step_start} must be >= 0 and below "
                f"--profile-step-end {args.profile_step_end}")
    return None


class ProfilerRange:
    """Opens and closes the CUDA profiler range of --profile on this rank."""

    def __init__(self, args: argparse.Namespace, rank: int, cudart=None):
        self.enabled = bool(args.profile) and (not args.profile_ranks
                                               or rank in args.profile_ranks)
        self.start_at = args.profile_step_start
        self.end_at = args.profile_step_end
        self._cudart = cudart
        self.active = False

    def _runtime(self):
        if self._cudart is None:
            import torch

            self._cudart = torch.cuda.cudart()
        return self._cudart

    def before_step(self, iterations_done: int) -> None:
        if self.enabled and iterations_done == self.start_at:
            self._runtime().cudaProfilerStart()
            self.active = True

    def after_step(self, iterations_done: int) -> None:
        if self.active and iterations_done == self.end_at:
            self._runtime().cudaProfilerStop()
            self.active = False

    def close(self) -> None:
        """Close a range the run ended inside (training stopped early)."""
        if self.active:
            self._runtime().cudaProfilerStop()
            self.active = False
