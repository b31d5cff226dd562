"""The trainer's CPU memory figure is the peak RSS since the previous log line, not the RSS now
(issue 18: the log said 766 MiB while GNU time measured a 5.5 GB peak)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from megatron.training import metrics

MiB = 1024**2
SPIKE = 256 * MiB

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs procfs")


def _spike(hold_s: float) -> None:
    """Make SPIKE bytes resident (written pages), hold them, free them (mmap'd: back to the OS)."""
    tensor = torch.ones(SPIKE // 4, dtype=torch.float32)
    time.sleep(hold_s)
    del tensor


def test_reports_the_interval_peak_not_the_current_rss_and_resets():
    meter = metrics.RssPeakMeter(sample_interval_s=0.002)
    try:
        meter.read()  # from here on, each read covers the time since the previous one
        rss_before = metrics._current_rss_bytes() / MiB
        _spike(hold_s=0.05)
        with_spike = meter.read()
        without_spike = meter.read()
    finally:
        meter.close()
    assert with_spike["mem_rss_mib"] < rss_before + 64, with_spike  # the spike was freed
    # The old figure (RSS now) would miss the spike.
    assert with_spike["mem_peak_rss_mib"] >= rss_before + 0.9 * SPIKE / MiB, (rss_before, with_spike)
    # The next interval has no spike: its peak is lower again.
    assert without_spike["mem_peak_rss_mib"] < with_spike["mem_peak_rss_mib"] - 0.5 * SPIKE / MiB
    assert without_spike["mem_peak_rss_mib"] >= without_spike["mem_rss_mib"]


class _FakeProc:
    """Stand-in for /proc readings: VmHWM and RSS in bytes."""

    def __init__(self, monkeypatch, hwm: int, rss: int):
        self.hwm, self.rss = hwm, rss
        monkeypatch.setattr(metrics, "_read_proc_status_kib",
                            lambda field: self.hwm // 1024 if field == "VmHWM" else None)
        monkeypatch.setattr(metrics, "_current_rss_bytes", lambda: self.rss)


def test_high_water_mark_is_exact_when_it_rises_and_samples_otherwise(monkeypatch):
    proc = _FakeProc(monkeypatch, hwm=900 * MiB, rss=100 * MiB)
    meter = metrics.RssPeakMeter(sample_interval_s=None)  # no thread: samples set by hand below
    # First read: everything since the process started (the high-water mark so far).
    assert meter.read() == {"mem_peak_rss_mib": 900.0, "mem_rss_mib": 100.0}
    # The mark rose: the new high was set in this interval, however briefly.
    proc.hwm = 1500 * MiB
    assert meter.read()["mem_peak_rss_mib"] == 1500.0
    # The mark did not rise: the interval's peak is the largest sample (or the RSS now).
    meter._sampled_max = 400 * MiB
    assert meter.read()["mem_peak_rss_mib"] == 400.0
    assert meter.read()["mem_peak_rss_mib"] == 100.0


def test_without_procfs_it_says_the_peak_is_since_start(monkeypatch):
    monkeypatch.setattr(metrics, "_read_proc_status_kib", lambda field: None)
    monkeypatch.setattr(metrics, "_peak_rss_since_start_bytes", lambda: 700 * MiB)
    monkeypatch.setattr(metrics, "_current_rss_bytes", lambda: 100 * MiB)
    meter = metrics.RssPeakMeter()
    assert meter._thread is None
    assert meter.read() == {"mem_rss_mib": 100.0, "mem_peak_rss_since_start_mib": 700.0}


def test_cpu_memory_report_uses_the_process_meter(monkeypatch):
    monkeypatch.setattr(metrics, "_RSS_PEAK_METER", None)
    try:
        report = metrics.memory_report()
    finally:
        metrics._RSS_PEAK_METER.close()
    assert set(report) == {"mem_peak_rss_mib", "mem_rss_mib"}
    assert report["mem_peak_rss_mib"] >= report["mem_rss_mib"] > 0
