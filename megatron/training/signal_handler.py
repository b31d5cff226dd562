"""Clean exit on a termination signal (SLURM preemption sends SIGTERM).

The handler only records that the signal arrived; the training loop asks
:meth:`DistributedSignalHandler.any_rank_signalled` once per iteration, which agrees across
ranks (all-reduce MAX), so every rank saves the same iteration and leaves together.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class DistributedSignalHandler:
    """Records ``signal_name`` on this rank; see the module docstring."""

    def __init__(self, signal_name: str = "SIGTERM"):
        self.signal_number = getattr(signal, signal_name)
        self.received = False
        signal.signal(self.signal_number, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def any_rank_signalled(self) -> bool:
        """True on every rank if any rank has received the signal (collective call)."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        flag = torch.tensor([int(self.received)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
