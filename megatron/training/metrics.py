"""Throughput, MFU and memory figures for the training log.

Model FLOPs (6·s·P + 6·n·h·s² per sample of s tokens) and P come from
memo_ext.estimate.flops, the estimator's own definition, so the log's MFU and the estimator's
predicted MFU count the same FLOPs.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Optional

import psutil
import torch
import torch.distributed as dist

from memo_ext.device_memory import device_memory, reset_peak
from memo_ext.hardware import profile_for_device

_BYTES_PER_MIB = 1024**2


def measure_cpu_gemm_tflops(size: int = 1024, repeats: int = 4) -> float:
    """Dense fp32 GEMM throughput of this process's CPU threads, in TFLOP/s (measured)."""
    generator = torch.Generator().manual_seed(0)  # leaves the training RNG streams untouched
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    elapsed = time.perf_counter() - start
    return 2.0 * size**3 * repeats / elapsed / 1e12


def peak_tflops_per_device(args: argparse.Namespace) -> tuple[float, str]:
    """Per-device peak TFLOP/s for MFU and where it came from."""
    if args.peak_tflops is not None:
        return args.peak_tflops, "--peak-tflops"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        profile = profile_for_device(name)
        if profile is None:
            raise ValueError(f"unknown GPU {name!r} (no device_names pattern of "
                             "memo_ext/hardware.json matches it): pass --peak-tflops")
        return (float(profile["bf16_tflops"]),
                f"{name}: dense bf16 peak of hardware.json's {profile['name']} profile")
    return measure_cpu_gemm_tflops(), "measured CPU fp32 GEMM"


def _read_proc_status_kib(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (``VmHWM``, ``VmRSS``) in KiB; None without procfs."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _current_rss_bytes() -> int:
    """Resident set size now: /proc/self/statm (cheap enough to sample every few ms), or psutil."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return psutil.Process().memory_info().rss


def _peak_rss_since_start_bytes() -> Optional[int]:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` in bytes (the kernel gives KiB, macOS bytes)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


class RssPeakMeter:
    """Peak resident set size of this process between consecutive :meth:`read` calls.

    Linux: the kernel's high-water mark ``VmHWM`` (/proc/self/status) is exact but only ever
    grows. When it grew since the previous read, the interval's peak is ``VmHWM`` (exact: the
    new high was set in this interval). Otherwise the interval's peak lies below an earlier one
    and is the maximum of ``/proc/self/statm`` sampled every ``sample_interval_s`` by a daemon
    thread (a spike shorter than that, below the process's earlier high, can be missed).

    The high-water mark is deliberately not reset (``echo 5 > /proc/self/clear_refs`` would
    make it exact in every interval, and works on Linux, but it also resets what
    ``getrusage``'s ``ru_maxrss``, ``wait4`` and GNU ``time -v`` report for the process, so
    an outside measurement of the run's peak would silently read low).

    Without procfs (macOS, Windows) only the peak since the process started is known
    (``ru_maxrss``); :meth:`read` then names it ``mem_peak_rss_since_start_mib``.
    """

    def __init__(self, sample_interval_s: Optional[float] = 0.005):
        self.has_procfs = _read_proc_status_kib("VmHWM") is not None
        self._last_hwm = 0  # the first read covers everything since the process started
        self._lock = threading.Lock()
        self._sampled_max = _current_rss_bytes()
        self._stop = threading.Event()
        self._thread = None
        if self.has_procfs and sample_interval_s:
            self._thread = threading.Thread(target=self._sample, args=(sample_interval_s,),
                                            name="rss-peak-sampler", daemon=True)
            self._thread.start()

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            rss = _current_rss_bytes()
            with self._lock:
                if rss > self._sampled_max:
                    self._sampled_max = rss

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def read(self) -> dict[str, float]:
        """``mem_peak_rss_mib`` (since the previous read) and ``mem_rss_mib`` (now), in MiB."""
        rss = _current_rss_bytes()
        if not self.has_procfs:
            report = {"mem_rss_mib": rss / _BYTES_PER_MIB}
            peak = _peak_rss_since_start_bytes()
            if peak is not None:
                report["mem_peak_rss_since_start_mib"] = peak / _BYTES_PER_MIB
            return report
        hwm = (_read_proc_status_kib("VmHWM") or 0) * 1024
        with self._lock:
            sampled, self._sampled_max = max(self._sampled_max, rss), rss
        peak = hwm if hwm > self._last_hwm else sampled
        self._last_hwm = hwm
        return {"mem_peak_rss_mib": peak / _BYTES_PER_MIB, "mem_rss_mib": rss / _BYTES_PER_MIB}


_RSS_PEAK_METER: Optional[RssPeakMeter] = None


def rss_peak_meter() -> RssPeakMeter:
    """This process's :class:`RssPeakMeter` (started on first use)."""
    global _RSS_PEAK_METER
    if _RSS_PEAK_METER is None:
        _RSS_PEAK_METER = RssPeakMeter()
    return _RSS_PEAK_METER


def memory_report() -> dict[str, float]:
    """This process's memory in MiB since the previous call (the first: since it started).

    CUDA: allocated and reserved now, and the allocator's peak since the previous call
    (memo_ext.device_memory: PyTorch's caching allocator or the one that replaced it; this
    resets the peak). CPU: ``mem_peak_rss_mib``, the peak
    resident set size since the previous call (see :class:`RssPeakMeter`), and ``mem_rss_mib``,
    the RSS now; without procfs ``mem_peak_rss_since_start_mib`` replaces the former.
    """
    if torch.cuda.is_available():
        memory = device_memory()
        reset_peak()
        return {"mem_allocated_mib": memory.allocated / _BYTES_PER_MIB,
                "mem_reserved_mib": memory.reserved / _BYTES_PER_MIB,
                "mem_peak_allocated_mib": memory.peak_allocated / _BYTES_PER_MIB}
    return rss_peak_meter().read()


def max_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Element-wise maximum of a dict of floats over all ranks (same keys everywhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    keys = sorted(values)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return dict(zip(keys, tensor.tolist()))
