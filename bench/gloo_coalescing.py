"""Does torch's gloo survive asynchronous coalesced collectives? (docs/training.md, "On CPU",
and megatron.training.compat.gloo_coalescing)

Two gloo ranks (fresh processes, loopback) each run ``--steps`` steps of what Megatron-FSDP's
parameter prefetch does: six all-gathers of 1,000-1,200 floats issued and left in flight, fifty
small tensors allocated meanwhile, then the six waited and their gathered values checked; a
synchronous coalesced reduce-scatter closes each step. Each mode issues the six differently:

- ``coalesced-async``: each in ``_coalescing_manager(group, async_ops=True)`` (torch's own);
- ``coalesced-async-1-thread``: the same on a group with one gloo worker thread;
- ``coalesced-sync``: each in ``_coalescing_manager(group)``, waited at the block's exit;
- ``one-by-one-async``: each ``all_gather_into_tensor(..., async_op=True)``, not coalesced;
- ``shim``: each in megatron.training.compat.gloo_coalescing.coalescing_manager(group,
  async_ops=True), what the trainer uses on CPU;
- ``reduce-scatter-async`` / ``all-reduce-async``: coalesced asynchronous reduce-scatters or
  all-reduces of the same sizes instead of all-gathers.

A try "died" when a rank ended by a signal or an error, "hung" when both were still running
after ``--timeout`` seconds.

    python bench/gloo_coalescing.py                       # every mode, 3 tries of 3,000 steps
    python bench/gloo_coalescing.py --modes shim --tries 10

Writes bench/results/gloo_coalescing.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MODES = ("coalesced-async", "coalesced-async-1-thread", "coalesced-sync", "one-by-one-async",
         "shim", "reduce-scatter-async", "all-reduce-async")
IN_FLIGHT, SMALL_TENSORS = 6, 50


def _issue(mode: str, group, shard, out, full):
    """One collective of ``mode``; returns what to wait on (None when already done)."""
    import torch.distributed as dist
    from torch.distributed import _coalescing_manager

    from megatron.training.compat.gloo_coalescing import coalescing_manager

    if mode == "one-by-one-async":
        return dist.all_gather_into_tensor(out, shard, group=group, async_op=True)
    manager = coalescing_manager if mode == "shim" else _coalescing_manager
    with manager(group, async_ops=mode != "coalesced-sync") as handle:
        if mode == "reduce-scatter-async":
            dist.reduce_scatter_tensor(shard, full, group=group)
        elif mode == "all-reduce-async":
            dist.all_reduce(full, group=group)
        else:
            dist.all_gather_into_tensor(out, shard, group=group)
    return None if mode == "coalesced-sync" else handle


def stress(rank: int, mode: str, steps: int) -> None:
    """One rank's ``steps`` steps of ``mode`` on a two-rank group (see the module docstring)."""
    import torch
    import torch.distributed as dist

    options = None
    if mode == "coalesced-async-1-thread":
        options = dist.ProcessGroupGloo._Options()
        options._threads = 1
    group = dist.new_group([0, 1], backend="gloo", pg_options=options)
    for step in range(steps):
        pending = []
        for k in range(IN_FLIGHT):
            n = 1000 + 37 * k + step % 11
            shard, out = torch.full((n,), float(rank + k)), torch.empty(2 * n)
            full = (torch.full((2 * n,), float(rank + k))
                    if mode in ("reduce-scatter-async", "all-reduce-async") else None)
            pending.append((_issue(mode, group, shard, out, full), shard, out, full, n, k))
        churn = [torch.ones(17) for _ in range(SMALL_TENSORS)]
        for handle, shard, out, full, n, k in pending:
            if handle is not None:
                handle.wait()
            if mode == "reduce-scatter-async":
                assert shard[0].item() == 1 + 2 * k
            elif mode == "all-reduce-async":
                assert full[0].item() == 1 + 2 * k
            else:
                assert out[0].item() == k and out[n].item() == 1 + k
        del churn
        grad, reduced = torch.ones(1000), torch.empty(500)
        with torch.distributed.distributed_c10d._coalescing_manager(group):
            dist.reduce_scatter_tensor(reduced, grad, group=group)
        assert reduced[0].item() == 2


def _rank_main(rank: int, port: int, mode: str, steps: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    stress(rank, mode, steps)
    dist.barrier()
    dist.destroy_process_group()


def one_try(mode: str, steps: int, timeout: float) -> tuple[str, float]:
    """("finished" | "died" | "hung", seconds) of one two-rank try."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    context = mp.start_processes(_rank_main, args=(port, mode, steps), nprocs=2, join=False,
                                 start_method="spawn")
    try:
        while not context.join(timeout=max(0.1, started + timeout - time.monotonic())):
            if time.monotonic() - started >= timeout:
                for process in context.processes:
                    process.kill()
                return "hung", time.monotonic() - started
    except Exception:  # a rank ended by a signal or an error: ProcessExitedException/-RaisedException
        for process in context.processes:
            if process.is_alive():
                process.kill()
        return "died", time.monotonic() - started
    return "finished", time.monotonic() - started


def main(argv=None) -> int:
    # Here, not at the top: the spawned ranks import this module and need none of it.
    from bench.common import commit, machine, write_atomic

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per try")
    parser.add_argument("--output", type=Path,
                        default=REPO_ROOT / "bench" / "results" / "gloo_coalescing.md")
    opts = parser.parse_args(argv)
    modes = opts.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    started = time.time()
    rows = []
    for mode in modes:
        outcomes = [one_try(mode, opts.steps, opts.timeout) for _ in range(opts.tries)]
        kinds = [kind for kind, _ in outcomes]
        rows.append(f"| `{mode}` | {opts.tries} | {kinds.count('died')} | {kinds.count('hung')} "
                    f"| {kinds.count('finished')} | "
                    f"{', '.join(f'{seconds:.0f}' for _, seconds in outcomes)} |")
        print(rows[-1], flush=True)
    command = "python bench/gloo_coalescing.py" + "".join(
        f" {flag} {value}" for flag, value, default in (
            ("--modes", opts.modes, ",".join(MODES)), ("--tries", opts.tries, 3),
            ("--steps", opts.steps, 3000)) if value != default)
    lines = ["# Asynchronous coalesced collectives on gloo", "",
             f"Generated by `{command}` ({time.time() - started:.0f} s) on {machine()}, commit "
             f"{commit()}, torch {_torch_version()}. Two ranks, {opts.steps} steps a try, "
             f"{IN_FLIGHT} collectives in flight a step (the module docstring says what each "
             "mode issues).", "",
             "| mode | tries | died | hung | finished | seconds per try |",
             "|---|---|---|---|---|---|", *rows, ""]
    write_atomic(opts.output, "\n".join(lines))
    return 0


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
