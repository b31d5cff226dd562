"""--optimizer-cpu-offload's step in the cost model (memo_ext.estimate.offload_step): bytes per
element, HybridDeviceOptimizer's order with and without --overlap-cpu-optimizer-d2h-h2d, the
CPU trainer's sequence, and predict_step taking it from a trace's persistent state."""

from __future__ import annotations

import pytest

from memo_ext.estimate.offload_step import ADAM_BYTES_PER_ELEMENT, offload_step

# 1 B/s links make the seconds the bytes: PCIe 1 B/s, host memory 2 B/s
RATES = dict(pcie_bytes_per_s=1.0, host_bytes_per_s=2.0)


def test_parts_count_the_bytes_each_element_moves():
    step = offload_step([10], 0.0, element=2, overlap=False, **RATES)
    assert step.d2h_s == 4 * 10  # the fp32 gradient down
    assert step.host_s == ADAM_BYTES_PER_ELEMENT * 10 / 2 == 140
    assert step.h2d_s == 2 * 10 + 6 * 10 / 2  # bf16 up, after the host's fp32 -> bf16 pass
    fp32 = offload_step([10], 0.0, element=4, overlap=False, **RATES)
    assert fp32.h2d_s == 4 * 10


def test_without_overlap_the_host_step_runs_beside_the_device_step():
    # down 40, host 140 beside the device's 200 (queued after the copies), up 50
    assert offload_step([10], 200.0, element=2, overlap=False, **RATES).step_s == 40 + 200 + 50
    assert offload_step([10], 100.0, element=2, overlap=False, **RATES).step_s == 40 + 140 + 50
    assert offload_step([], 7.0, element=2, overlap=False, **RATES).step_s == 7.0


def test_with_overlap_the_shards_pipeline_and_copies_up_wait_for_the_device_step():
    # two shards of 10: d = 40, c = 140, h = 50 each
    # down 40, 80; host 40-180, 180-320; up max(., 180, G) + 50 ...
    assert offload_step([10, 10], 0.0, element=2, overlap=True, **RATES).step_s == 320 + 50
    assert offload_step([10, 10], 400.0, element=2, overlap=True, **RATES).step_s == \
        400 + 50 + 50
    serial = offload_step([10, 10], 0.0, element=2, overlap=False, **RATES).step_s
    assert serial == 80 + 280 + 100


def test_on_the_cpu_trainer_everything_runs_in_sequence():
    step = offload_step([10, 10], 30.0, element=4, overlap=True, concurrent=False, **RATES)
    assert step.step_s == pytest.approx(80 + 280 + 80 + 30)


def test_persistent_bytes_keeps_the_host_part_out_of_the_device_and_reads_the_split():
    from types import SimpleNamespace

    from memo_ext.estimate.cost import persistent_bytes
    from memo_ext.trace import PINNED_MARK

    def alloc(nbytes, pool, module):
        return {"action": "alloc", "phase": "init", "category": "optimizer", "bytes": nbytes,
                "pool": pool, "module": module}

    events = [alloc(400, "host", "optimizer:a.host_param"),
              alloc(400, "host", "optimizer:a.host_grad" + PINNED_MARK),
              alloc(80, "device", "optimizer:b.master_fp32"),
              alloc(80, "device", "optimizer:b.exp_avg"),
              alloc(80, "device", "optimizer:b.exp_avg_sq"),
              alloc(400, "host", "optimizer:a.host_exp_avg")]
    trace = SimpleNamespace(events=events, header={"options": {"optimizer_cpu_offload": True}})
    totals = persistent_bytes(trace)
    assert totals["optimizer"] == 240
    assert totals["host_shards"] == (100,) and totals["device_elements"] == 20
