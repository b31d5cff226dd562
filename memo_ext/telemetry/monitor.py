"""Training-time memory telemetry: one sample per step per rank, gathered to every rank each
``--log-interval`` steps; rank 0 prints one line; fail-fast near capacity; OOM reports.

Per step, each rank samples (bytes):
* CPU: :class:`memo_ext.telemetry.attribution.AttributedTracker` -- the step's peak of tracked
  device bytes, the bytes alive at the step's end, and the bytes per category at that peak;
* CUDA: the allocator's peak (reset each step), allocated and reserved bytes
  (memo_ext.device_memory: PyTorch's caching allocator, or the pluggable allocator that
  replaced it); the tracker runs too (without a capacity) for the categories.

Each log interval the interval's samples (each rank's highest step peak, with its categories)
are all-gathered (every rank gets every sample, so every rank takes the same fail-fast
decision and none is left waiting in a collective), and rank 0 prints::

    memory [step 20] peak max 412.3 MiB (rank 3) mean 380.1 MiB skew 1.08 | ranks 379.0 ...
      | at rank 3's peak: activations 200.1, params 50.0, ... MiB | capacity 512.0 MiB (80.5%)

``skew`` is max / mean over ranks (SoCC'23 finds the worst worker 47% above the mean: provision
for the worst rank). Fail-fast: from step ``warmup_steps`` on, at the warm-up step and every
interval, if the worst rank's peak >= (1 - margin) x capacity, rank 0 writes a report and every
rank raises :class:`MemoryBudgetExceeded`. An out-of-memory error inside a step (the CPU
tracker's simulated one, or CUDA's) makes that rank write ``oom_rank<R>_iter<I>.json`` with the
phase, layer, micro-batch, the bytes in use by category and the estimate, plus a snapshot, and
raise :class:`MemoryBudgetExceeded` (the trainer exits with status 3).

Nothing here imports megatron.training.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from memo_ext.device_memory import (current_allocator, device_memory, reset_peak,
                                    snapshots_supported)
from memo_ext.telemetry.attribution import (
    CATEGORIES,
    COMM,
    GRADS,
    OFFLOAD,
    PARAMS,
    AttributedTracker,
)
from memo_ext.storage_tracker import SimulatedOutOfMemoryError

MiB = 1 << 20
#: Exit status of a run stopped by the fail-fast check or an out-of-memory error.
MEMORY_EXIT_STATUS = 3
#: Fields of one rank's sample, in the gathered tensor's order (bytes), then CATEGORIES.
SAMPLE_FIELDS = ("peak", "current", "reserved", "host_peak")


class MemoryBudgetExceeded(RuntimeError):
    """Training stopped for memory: an out-of-memory error or the fail-fast check. The message
    is one line (what, where, the report's path); the report has the details.

    ``peers_waiting``: True for an out-of-memory error on this rank alone, whose peers may be
    blocked in a collective with it (the process should exit without a collective teardown);
    False for fail-fast, which every rank raises at the same step."""

    def __init__(self, message: str, peers_waiting: bool = False):
        super().__init__(message)
        self.peers_waiting = peers_waiting


@dataclass
class RankSample:
    """One rank's memory over a log interval (bytes): its highest step peak and what held it."""

    peak: int = 0
    current: int = 0
    reserved: int = 0  # CUDA caching allocator (0 on CPU)
    host_peak: int = 0
    peak_step: int = 0
    by_category: dict = field(default_factory=dict)

    def as_list(self) -> list[float]:
        return ([float(self.peak), float(self.current), float(self.reserved),
                 float(self.host_peak)] + [float(self.by_category.get(c, 0)) for c in CATEGORIES])

    @classmethod
    def from_list(cls, values: list[float]) -> "RankSample":
        n = len(SAMPLE_FIELDS)
        return cls(*(int(v) for v in values[:n]),
                   by_category={c: int(v) for c, v in zip(CATEGORIES, values[n:])})


@dataclass
class GatheredMemory:
    """All ranks' samples of one interval and the summary the line prints."""

    step: int
    samples: list[RankSample]

    @property
    def worst_rank(self) -> int:
        return max(range(len(self.samples)), key=lambda r: self.samples[r].peak)

    @property
    def max_peak(self) -> int:
        return self.samples[self.worst_rank].peak

    @property
    def mean_peak(self) -> float:
        return sum(s.peak for s in self.samples) / len(self.samples)

    @property
    def skew(self) -> float:
        """Max over mean of the ranks' peaks (1.0 = balanced)."""
        mean = self.mean_peak
        return self.max_peak / mean if mean else 1.0

    def as_record(self) -> dict:
        """Plain data for metrics files (MiB)."""
        worst = self.samples[self.worst_rank]
        return {"iteration": self.step, "mem_peak_max_bytes": self.max_peak,
                "mem_peak_max_mib": self.max_peak / MiB,
                "mem_peak_mean_mib": self.mean_peak / MiB, "mem_peak_skew": self.skew,
                "mem_peak_worst_rank": self.worst_rank,
                "mem_peak_per_rank_mib": [s.peak / MiB for s in self.samples],
                **{f"mem_{c}_mib": worst.by_category.get(c, 0) / MiB for c in CATEGORIES}}


def _mib(nbytes: float) -> str:
    """MiB with one decimal (two below 10 MiB, so small test models still read)."""
    value = nbytes / MiB
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def format_line(gathered: GatheredMemory, capacity_bytes: Optional[int],
                estimated_peak_bytes: Optional[int], cuda: bool) -> str:
    """The telemetry line rank 0 prints each log interval (MiB = 2**20 bytes)."""
    worst = gathered.samples[gathered.worst_rank]
    parts = [f"memory [step {gathered.step}] peak max {_mib(gathered.max_peak)} MiB "
             f"(rank {gathered.worst_rank}) mean {_mib(gathered.mean_peak)} MiB "
             f"skew {gathered.skew:.2f}"]
    if len(gathered.samples) <= 16:
        parts.append("ranks " + " ".join(_mib(s.peak) for s in gathered.samples))
    categories = sorted(((c, b) for c, b in worst.by_category.items() if b >= MiB / 20),
                        key=lambda item: -item[1])
    if categories:
        parts.append(f"at rank {gathered.worst_rank}'s peak: "
                     + ", ".join(f"{c} {_mib(b)}" for c, b in categories) + " MiB")
    if cuda:
        parts.append(f"reserved max {_mib(max(s.reserved for s in gathered.samples))} MiB")
    host = max(s.host_peak for s in gathered.samples)
    if host:
        parts.append(f"host peak max {_mib(host)} MiB")
    if estimated_peak_bytes:
        parts.append(f"estimate {_mib(estimated_peak_bytes)} MiB "
                     f"({gathered.max_peak / estimated_peak_bytes:.3f} x)")
    if capacity_bytes:
        parts.append(f"capacity {_mib(capacity_bytes)} MiB "
                     f"({100 * gathered.max_peak / capacity_bytes:.1f}% used)")
    return " | ".join(parts)


class MemoryTelemetry:
    """Per-step, per-rank memory telemetry for the trainer (one object per rank).

    Typical use (megatron.training wires it)::

        telemetry = MemoryTelemetry(config, log_interval=args.log_interval)
        memo = ...(host_allocation_scope=telemetry.tracker.host_allocations, ...)
        telemetry.attach(model_chunks, params=..., grads=...)
        forward_step = telemetry.wrap_forward_step(forward_step)
        with telemetry.step(iteration):
            ... forward/backward ...
            with telemetry.phase("optimizer"):
                optimizer.step()
        telemetry.after_step(iteration)   # collective every log interval

    Args:
        config: a memo_ext.config.TelemetryConfig (validated).
        log_interval: steps between gathers (the trainer's --log-interval).
        log: prints a line (the trainer passes a rank-0 printer).
    """

    def __init__(self, config, log_interval: int, log: Callable[[str], None] = print,
                 group=None) -> None:
        self.config = config
        self.log_interval = log_interval
        self.log = log
        self.group = group
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.cuda = torch.cuda.is_available()
        self.capacity_bytes = config.device_capacity_bytes
        if self.cuda:
            device = torch.cuda.current_device()
            total = torch.cuda.get_device_properties(device).total_memory
            if self.capacity_bytes is not None:
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.capacity_bytes / total),
                                                           device)
            else:
                self.capacity_bytes = total
            if snapshots_supported():
                # For the OOM snapshot; Python stacks only (C++ symbolisation is the costly part).
                torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
            else:
                allocator = current_allocator()
                log(f"> memory telemetry: {allocator.name} serves CUDA memory: no allocator "
                    "snapshot in OOM reports, and the capacity is enforced by the fail-fast "
                    "check only (a pluggable allocator ignores the per-process memory fraction)")
        # On CUDA the allocator enforces the capacity; the tracker only attributes.
        self.tracker = AttributedTracker(None if self.cuda else self.capacity_bytes)
        self.estimated_peak_bytes = config.estimated_peak_bytes
        self.interval = RankSample()
        self.last: Optional[GatheredMemory] = None
        self.history: list[GatheredMemory] = []
        self._comm_buffers: Callable[[], list] = lambda: []

    # ------------------------------------------------------------------ wiring
    def attach(self, chunks: list, params: list, grads: list,
               comm_buffers: Callable[[], list] = lambda: []) -> None:
        """Register the persistent tensors (parameters, gradient buffers) and hook the model
        chunks; ``comm_buffers()`` lists buffers to count as "comm" after each step."""
        self.tracker.register(params, PARAMS)
        self.tracker.register(grads, GRADS)
        for chunk in chunks:
            self.tracker.attach(chunk)
        self._comm_buffers = comm_buffers

    def offload_allocations(self):
        """Context in which MEMO's device buffers are created (category "offload")."""
        return self.tracker.labelled(OFFLOAD)

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """``forward_step`` marking the start of each micro-batch's forward."""
        def forward_step_with_telemetry(*args, **kwargs):
            self.tracker.start_forward()
            return forward_step(*args, **kwargs)

        return forward_step_with_telemetry

    def phase(self, name: str):
        """The driver's phase in a block, e.g. ``phase("optimizer")`` around optimizer.step()."""
        return self.tracker.phase_scope(name)

    # ------------------------------------------------------------------ steps
    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """One training step under the tracker. An out-of-memory error inside it becomes a
        report and :class:`MemoryBudgetExceeded`."""
        self.tracker.begin_step()
        self.tracker.last_oom = None
        if self.cuda:
            reset_peak()
        try:
            with self.tracker:
                yield
        except (SimulatedOutOfMemoryError, torch.OutOfMemoryError) as error:
            raise self._out_of_memory(iteration, error) from error
        finally:
            self.tracker.phase = "idle"
        self._sample(iteration)

    def headroom_bytes(self) -> Optional[int]:
        """Device bytes still usable above this step's tracked peak (CPU tracker), or None
        without a capacity: the fail-fast limit (1 - margin) x capacity less the peak, so that
        MEMO's --memo-alpha auto, which fills the headroom it is given, stays below the limit
        the fail-fast check enforces."""
        if self.tracker.capacity_bytes is None:
            return None
        limit = int((1.0 - self.config.telemetry_fail_fast_margin) * self.tracker.capacity_bytes)
        return limit - self.tracker.stats()["peak_device_bytes"]

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """Track allocations made between steps (e.g. MEMO resizing its buffers after solving
        alpha), without starting a step: they count from then on."""
        with self.tracker:
            yield

    def _sample(self, iteration: int) -> None:
        for tensor in self._comm_buffers():
            self.tracker.relabel(tensor, COMM)
        stats = self.tracker.stats()
        if self.cuda:
            memory = device_memory()
            peak, current, reserved = memory.peak_allocated, memory.allocated, memory.reserved
        else:
            peak, current, reserved = stats["peak_device_bytes"], stats["current_device_bytes"], 0
        if peak >= self.interval.peak or self.interval.peak_step == 0:
            self.interval = RankSample(peak, current, max(reserved, self.interval.reserved),
                                       max(stats["peak_host_bytes"], self.interval.host_peak),
                                       iteration, self.tracker.peak_category_bytes())
        else:
            self.interval.current = current
            self.interval.reserved = max(reserved, self.interval.reserved)
            self.interval.host_peak = max(stats["peak_host_bytes"], self.interval.host_peak)

    def gather(self, iteration: int) -> GatheredMemory:
        """All ranks' interval samples on every rank (collective); starts a new interval."""
        local = torch.tensor(self.interval.as_list(), dtype=torch.float64)
        if self.world_size > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else "cpu"
            local = local.to(device)
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(parts, local, group=self.group)
            rows = [p.cpu().tolist() for p in parts]
        else:
            rows = [local.tolist()]
        gathered = GatheredMemory(iteration, [RankSample.from_list(r) for r in rows])
        self.interval = RankSample()
        self.last = gathered
        self.history.append(gathered)
        return gathered

    def after_step(self, iteration: int) -> Optional[GatheredMemory]:
        """Every log interval (and at the warm-up step): gather, print the line on rank 0,
        and run the fail-fast check. Collective: call it on every rank after every step."""
        warmup_done = iteration == self.config.telemetry_warmup_steps
        if iteration % self.log_interval != 0 and not warmup_done:
            return None
        gathered = self.gather(iteration)
        if self.rank == 0:
            self.log(format_line(gathered, self.capacity_bytes, self.estimated_peak_bytes,
                                 self.cuda))
        self._fail_fast(gathered)
        return gathered

    # ------------------------------------------------------------------ fail-fast / OOM
    def _fail_fast(self, gathered: GatheredMemory) -> None:
        margin = self.config.telemetry_fail_fast_margin
        if (margin <= 0 or not self.capacity_bytes
                or gathered.step < self.config.telemetry_warmup_steps):
            return
        limit = (1.0 - margin) * self.capacity_bytes
        if gathered.max_peak < limit:
            return
        worst = gathered.worst_rank
        summary = (f"memory fail-fast at step {gathered.step}: rank {worst}'s peak "
                   f"{_mib(gathered.max_peak)} MiB is within {margin:.0%} of the capacity "
                   f"{_mib(self.capacity_bytes)} MiB (limit {_mib(limit)} MiB)")
        path = Path(self.config.oom_report_dir) / f"failfast_iter{gathered.step}.json"
        if self.rank == 0:
            report = {
                "kind": "fail-fast", "step": gathered.step, "rank": worst,
                "world_size": self.world_size, "margin": margin,
                "capacity_bytes": self.capacity_bytes, "limit_bytes": int(limit),
                "peak_bytes": gathered.max_peak,
                "peak_by_category_bytes": gathered.samples[worst].by_category,
                "peak_per_rank_bytes": [s.peak for s in gathered.samples],
                "skew": gathered.skew, "estimated_peak_bytes": self.estimated_peak_bytes,
                "message": summary, "device": self._device_name()}
            self._write_json(path, report)
            self.log(f"> {summary} | by category: {_categories(report['peak_by_category_bytes'])}"
                     f"{self._estimate_text(gathered.max_peak)} | report: {path}")
        raise MemoryBudgetExceeded(f"{summary}; stopped before an out-of-memory error "
                                   f"(report: {path}); lower the memory per rank or raise "
                                   "--memo-device-capacity-gb / --memo-telemetry-fail-fast-margin "
                                   "if the capacity is wrong")

    def _estimate_text(self, measured: int) -> str:
        if not self.estimated_peak_bytes:
            return ""
        return (f" | estimate {_mib(self.estimated_peak_bytes)} MiB vs measured "
                f"{_mib(measured)} MiB ({measured / self.estimated_peak_bytes:.3f} x)")

    def _device_name(self) -> str:
        if self.cuda:
            return f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
        return "cpu (memo_ext.telemetry tracker: tensor storage bytes)"

    def _out_of_memory(self, iteration: int, error: BaseException) -> MemoryBudgetExceeded:
        """Write this rank's OOM report and snapshot; the exception to raise."""
        record = self.tracker.last_oom
        context = record.context if record is not None else self.tracker.context()
        in_use = record.in_use_by_category if record is not None else self.tracker.category_bytes()
        directory = Path(self.config.oom_report_dir)
        stem = directory / f"oom_rank{self.rank}_iter{iteration}"
        report = {
            "kind": "oom", "rank": self.rank, "world_size": self.world_size,
            "iteration": iteration, "phase": context.phase, "layer": context.layer,
            "microbatch": context.microbatch,
            "op": record.op if record is not None else None,
            "request_bytes": record.request_bytes if record is not None else None,
            "in_use_bytes": record.in_use_bytes if record is not None else None,
            "capacity_bytes": self.capacity_bytes,
            "in_use_by_category_bytes": in_use,
            "step_peak_bytes": self.tracker.stats()["peak_device_bytes"],
            "step_peak_by_category_bytes": self.tracker.peak_category_bytes(),
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "error": str(error).splitlines()[0] if str(error) else type(error).__name__,
            "device": self._device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        report["snapshot"], report["trace"] = self._dump(stem)
        self._write_json(stem.with_suffix(".json"), report)
        where = context.describe()
        request = report["request_bytes"]
        if report["op"]:
            where += f" ({report['op']})"
        lines = [f"> OOM on rank {self.rank} at iteration {iteration}, {where}: "
                 + (f"{_mib(request)} MiB requested with " if request is not None else "")
                 + (f"{_mib(report['in_use_bytes'])} MiB in use" if report["in_use_bytes"]
                    is not None else "")
                 + (f" of {_mib(self.capacity_bytes)} MiB" if self.capacity_bytes else ""),
                 f"  in use by category: {_categories(in_use)}"]
        if self.estimated_peak_bytes:
            needed = (report["in_use_bytes"] or 0) + (request or 0)
            lines.append(f"  estimate: {_mib(self.estimated_peak_bytes)} MiB predicted peak; "
                         f"this step needed at least {_mib(needed)} MiB (in use + request)")
        lines.append(f"  report: {stem.with_suffix('.json')}"
                     + (f" | snapshot: {report['snapshot']}" if report["snapshot"] else ""))
        print("\n".join(lines), flush=True)
        return MemoryBudgetExceeded(
            f"out of device memory on rank {self.rank} at iteration {iteration}, {where} "
            f"(report: {stem.with_suffix('.json')})", peers_waiting=True)

    def _dump(self, stem: Path) -> tuple[Optional[str], Optional[str]]:
        """The snapshot: CUDA's own, or on CPU the step's allocation trace (our trace format)
        and the same as a PyTorch snapshot pickle for memory_viz. Never raises."""
        try:
            stem.parent.mkdir(parents=True, exist_ok=True)
            if self.cuda and not snapshots_supported():
                return None, None
            if self.cuda:
                path = f"{stem}.snapshot.pickle"
                torch.cuda.memory._dump_snapshot(path)
                return path, None
            from memo_ext.trace import Trace, write_snapshot, write_trace

            trace = Trace(header={"mode": "telemetry", "rank": self.rank,
                                  "note": "storages alive at the step's start (phase init), then "
                                          "the step's allocations and frees up to the failed "
                                          "request (not included)"},
                          events=self.tracker.step_trace_events())
            trace_path, snapshot_path = f"{stem}.trace.jsonl.gz", f"{stem}.snapshot.pickle"
            write_trace(trace, trace_path)
            write_snapshot(trace, snapshot_path)
            return snapshot_path, trace_path
        except Exception as exc:  # the report matters more than the dump
            print(f"> telemetry: could not write the snapshot ({exc!r})", flush=True)
            return None, None

    @staticmethod
    def _write_json(path: Path, report: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = f"{path}.partial"
        with open(partial, "w") as handle:
            json.dump(report, handle, indent=1, sort_keys=True)
        os.replace(partial, path)


def _categories(by_category: dict) -> str:
    items = sorted(((c, b) for c, b in by_category.items() if b >= MiB / 20),
                   key=lambda kv: -kv[1])
    return ", ".join(f"{c} {_mib(b)}" for c, b in items) + " MiB" if items else "n/a"
