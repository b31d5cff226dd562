"""Run a function on N gloo ranks in fresh processes (loopback, a free port, a timeout).

For tests of collective code below the trainer (METP's ring autograd functions): each rank runs
``fn(rank, world_size, *args)`` after ``init_process_group``; an exception in any rank fails the
call with that rank's traceback, and a hang fails it after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import socket
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free loopback port (bound to 0 and released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 120) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raises on error or hang.
    ``fn`` must be a module-level function (it is pickled into spawned processes)."""
    context = mp.start_processes(_rank_main, args=(world_size, free_port(), fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{world_size} gloo ranks still running after {timeout} s")
