"""Helpers the benchmarks share (import as ``bench.common`` once the repository root is on
sys.path, as every bench script puts it): the longest-sequence search, rank traces from
tools/trace.py, and replaying several training iterations of a trace through the allocator
models."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from memo_ext.alloc import ReplayResult, repeated_iterations, replay
# longest_fitting is re-exported for the bench scripts.
from memo_ext.estimate import external_bytes, longest_fitting  # noqa: F401
from memo_ext.planner.plan import arena_plan
from memo_ext.trace import Trace as EventTrace

MiB, GiB = 1 << 20, 1 << 30
REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """HEAD's short hash, noting uncommitted changes to tracked files."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return head + (" + uncommitted changes" if dirty else "")


def machine() -> str:
    """This machine in words: host name, CPU model and cores, no GPU."""
    from memo_ext.estimate.cpu_profile import cpu_name

    return f"{platform.node()} ({cpu_name()}, {os.cpu_count()} CPU cores; no GPU)"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary name beside ``path`` and rename it over ``path``."""
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / GiB:.2f}"


def seq_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def mfu_axis(axis, title: str) -> None:
    """An MFU-against-sequence-length panel's scales, labels, title and legend."""
    axis.set_xscale("log", base=2)
    axis.set_xlabel("sequence length (K tokens)")
    axis.set_ylabel("MFU %")
    axis.set_title(title)
    axis.legend(fontsize=8)


# ------------------------------------------------------------------------------------ traces

def trace_rank(trace_argv: list[str], seq: int, workdir: Path) -> EventTrace:
    """The trace of a tools/trace.py command line at ``seq`` tokens, written into ``workdir``:
    its typed request traced by a tracer worker (memo_ext.estimate.tracer), as the estimator
    traces."""
    from memo_ext.estimate.tracer import TracerPool

    from megatron.memo_tools.cli.trace import request_from_argv

    request = request_from_argv([*trace_argv, "--seq-length", str(seq)])
    with TracerPool(1) as pool:
        return pool.trace(request, Path(workdir) / f"trace_{seq}.jsonl.gz")


def record_trace(trace_argv: list[str], seq: int, workdir: Path) -> tuple[EventTrace, float]:
    """Rank 0's trace at ``seq`` tokens (:func:`trace_rank`) and its seconds."""
    start = time.perf_counter()
    return trace_rank(trace_argv, seq, workdir), time.perf_counter() - start


class TraceCache:
    """Traces by sequence length, recorded once each."""

    def __init__(self, trace_argv: list[str], workdir: Path, log: Callable[[str], None]):
        self.trace_argv, self.workdir, self.log = list(trace_argv), workdir, log
        self.traces: dict[int, EventTrace] = {}
        self.seconds: dict[int, float] = {}

    def __getitem__(self, seq: int) -> EventTrace:
        if seq not in self.traces:
            self.traces[seq], self.seconds[seq] = record_trace(self.trace_argv, seq, self.workdir)
            self.log(f"  traced seq {seq}: {len(self.traces[seq].events)} events in "
                     f"{self.seconds[seq]:.1f} s")
        return self.traces[seq]


# ------------------------------------------------------------------------------------ replay

@dataclass
class PolicyRun:
    policy: str
    seq: int
    allocator_capacity_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fragmentation: float
    device_mallocs_last_iteration: int
    reorganisations_last_iteration: int
    reorganisations_total: int
    oom: bool
    oom_request_bytes: Optional[int]
    oom_iteration: Optional[int]     # 1-based; 0: in the persistent state
    replay_seconds: float
    arena_fallbacks: int = 0         # arena policy: planned requests served elsewhere

    @property
    def fits(self) -> bool:
        return not self.oom


def _iteration_of(row: int, starts: list[int]) -> int:
    return sum(1 for start in starts if row >= start)


def replay_iterations(trace: EventTrace, policy: str, device_bytes: int, iterations: int,
                      plan=None) -> tuple[PolicyRun, ReplayResult, list[int]]:
    """Replay ``iterations`` iterations of ``trace`` through ``policy`` on a device of
    ``device_bytes`` (less the memory outside the allocator). ``plan`` (a memo_ext.planner
    MemoryPlan of this trace) drives the "arena" policy. The last-iteration counts are the
    difference with a replay of one iteration fewer (the models are deterministic)."""
    capacity = device_bytes - external_bytes(trace)
    seq = trace.header["model"]["seq_length"]
    if capacity <= 0:
        raise SystemExit(f"a device of {device_bytes / GiB:g} GiB: the CUDA context and NCCL "
                         f"buffers alone take {external_bytes(trace) / GiB:.2f} GiB; give a "
                         "larger device")

    def run(n: int, timelines: bool):
        repeated, starts, _ = repeated_iterations(trace, n)
        arena = None if plan is None else arena_plan(plan, trace, n)
        return replay(repeated, policy, capacity, plan=arena, timelines=timelines), starts

    start = time.perf_counter()
    result, starts = run(iterations, True)
    seconds = time.perf_counter() - start
    before, _ = run(iterations - 1, False)
    oom_row = result.oom.event_index if result.oom else None
    return PolicyRun(
        policy=policy, seq=seq, allocator_capacity_bytes=capacity,
        peak_allocated_bytes=result.peak_allocated_bytes,
        peak_reserved_bytes=result.peak_reserved_bytes, fragmentation=result.fragmentation,
        device_mallocs_last_iteration=result.device_mallocs - before.device_mallocs,
        reorganisations_last_iteration=result.reorganisations - before.reorganisations,
        reorganisations_total=result.reorganisations, oom=result.oom is not None,
        oom_request_bytes=result.oom.request_bytes if result.oom else None,
        oom_iteration=None if oom_row is None else _iteration_of(oom_row, starts),
        replay_seconds=seconds, arena_fallbacks=result.counters.get("fallbacks", 0),
    ), result, starts
