"""DeviceMemoryTracker: storage-level accounting of the CPU stand-in's "device" memory."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from memo_ext.telemetry import DeviceMemoryTracker, SimulatedOutOfMemoryError

F32 = 4


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_stats_are_plain_data_and_start_at_zero():
    stats = DeviceMemoryTracker().stats()
    assert stats == {"current_device_bytes": 0, "peak_device_bytes": 0, "current_host_bytes": 0,
                     "peak_host_bytes": 0, "num_allocations": 0}


def test_allocation_and_free():
    tracker = DeviceMemoryTracker()
    with tracker:
        a = torch.empty(1000)
        b = torch.zeros(500, dtype=torch.float64)
        assert tracker.stats()["current_device_bytes"] == 1000 * F32 + 500 * 8
        del a
        gc.collect()
        stats = tracker.stats()
        assert stats["current_device_bytes"] == 500 * 8
        assert stats["peak_device_bytes"] == 1000 * F32 + 500 * 8
        assert stats["num_allocations"] == 2
    del b
    gc.collect()  # frees are seen after the mode exits too
    assert tracker.stats()["current_device_bytes"] == 0


def test_views_and_inplace_ops_are_not_allocations():
    tracker = DeviceMemoryTracker()
    with tracker:
        a = torch.ones(256, 4)
        v = a.view(1024)[10:20]
        a.add_(1.0)
        a.mul_(2.0)
        torch.add(a, 1.0, out=a)
        stats = tracker.stats()
    assert stats["num_allocations"] == 1
    assert stats["current_device_bytes"] == 1024 * F32
    del a
    gc.collect()
    # The view keeps the storage alive.
    assert tracker.stats()["current_device_bytes"] == 1024 * F32
    del v
    gc.collect()
    assert tracker.stats()["current_device_bytes"] == 0


def test_out_resize_is_followed():
    tracker = DeviceMemoryTracker()
    x = torch.ones(1000)
    with tracker:
        out = torch.empty(0)
        torch.mul(x, 2.0, out=out)
        assert tracker.stats()["current_device_bytes"] == 1000 * F32
    del out


def test_forward_with_saved_activations_peaks_higher_than_no_grad():
    model, x = _mlp(), torch.randn(128, 64)
    params = _param_bytes(model)

    with_grad = DeviceMemoryTracker()
    with_grad.register_existing(model.parameters())
    assert with_grad.stats()["current_device_bytes"] == params
    with with_grad:
        loss = model(x).sum()
    after_forward = with_grad.stats()

    no_grad = DeviceMemoryTracker()
    no_grad.register_existing(model.parameters())
    with no_grad, torch.no_grad():
        out = model(x).sum()
    del out

    # Saved activations (both 128x256 hidden tensors and the output) stay alive with autograd.
    assert after_forward["peak_device_bytes"] > no_grad.stats()["peak_device_bytes"]
    assert after_forward["current_device_bytes"] >= params + 2 * 128 * 256 * F32

    with with_grad:
        loss.backward()
    after_backward = with_grad.stats()
    assert after_backward["num_allocations"] > after_forward["num_allocations"]
    # Backward allocates gradients (at least the parameter grads) on top of the saved tensors.
    assert after_backward["peak_device_bytes"] >= after_forward["current_device_bytes"] + params
    del loss
    gc.collect()
    # The graph is freed: what remains are the parameters and their gradients.
    assert with_grad.stats()["current_device_bytes"] == pytest.approx(2 * params, abs=64)
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert with_grad.stats()["current_device_bytes"] == pytest.approx(params, abs=64)


def test_mark_host_moves_bytes_out_of_device():
    tracker = DeviceMemoryTracker()
    with tracker:
        arena = torch.empty(4096)
        activation = torch.empty(100)
    tracker.mark_host(arena)
    stats = tracker.stats()
    assert stats["current_device_bytes"] == 100 * F32
    assert stats["current_host_bytes"] == 4096 * F32
    assert tracker.is_host(arena) and tracker.is_host(arena[10:]) and not tracker.is_host(activation)
    with tracker:
        arena[:100].copy_(activation)  # writing into the arena allocates nothing
    assert tracker.stats()["current_device_bytes"] == 100 * F32
    del arena
    gc.collect()
    assert tracker.stats()["current_host_bytes"] == 0
    assert tracker.stats()["peak_host_bytes"] == 4096 * F32


def test_mark_host_on_preexisting_and_host_allocations_block():
    tracker = DeviceMemoryTracker(capacity_bytes=1000)
    outside = torch.empty(10_000)
    tracker.mark_host(outside)
    assert tracker.stats()["current_host_bytes"] == 10_000 * F32
    with tracker:
        with tracker.host_allocations():
            arena = torch.empty(100_000)  # above capacity, but host memory
        small = torch.empty(10)
    stats = tracker.stats()
    assert stats["current_host_bytes"] == 110_000 * F32
    assert stats["current_device_bytes"] == 10 * F32
    del arena, small, outside


def test_capacity_raises_with_numbers_in_message():
    tracker = DeviceMemoryTracker(capacity_bytes=10_000)
    with tracker:
        keep = torch.empty(2000)  # 8000 bytes
        with pytest.raises(SimulatedOutOfMemoryError) as info:
            torch.empty(1000)  # +4000 > 10000
        assert isinstance(info.value, RuntimeError)
        message = str(info.value)
        assert "4000" in message and "8000" in message and "10000" in message
        torch.empty(500)  # fits: 8000 + 2000
    assert tracker.stats()["current_device_bytes"] == 8000
    del keep


def test_capacity_counts_registered_parameters():
    model = _mlp()
    tracker = DeviceMemoryTracker(capacity_bytes=_param_bytes(model) + 128 * 256 * F32)
    tracker.register_existing(model.parameters())
    with pytest.raises(SimulatedOutOfMemoryError):
        with tracker:
            model(torch.randn(128, 64)).sum().backward()


def test_capacity_raises_inside_backward():
    model, x = _mlp(), torch.randn(128, 64)
    probe = DeviceMemoryTracker()
    probe.register_existing(model.parameters())
    with probe:
        loss = model(x).sum()
    forward_peak = probe.stats()["peak_device_bytes"]
    del loss

    tracker = DeviceMemoryTracker(capacity_bytes=forward_peak + 1024)
    tracker.register_existing(model.parameters())
    with tracker:
        loss = model(x).sum()  # fits
        with pytest.raises(SimulatedOutOfMemoryError):
            loss.backward()  # the first 128x256 gradient does not


def test_reset_peak():
    tracker = DeviceMemoryTracker()
    with tracker:
        big = torch.empty(10_000)
    del big
    gc.collect()
    assert tracker.stats()["peak_device_bytes"] == 40_000
    tracker.reset_peak()
    assert tracker.stats()["peak_device_bytes"] == 0
    with tracker:
        small = torch.empty(10)
    assert tracker.stats()["peak_device_bytes"] == 40
    del small


def test_free_from_another_thread():
    tracker = DeviceMemoryTracker()
    with tracker:
        tensors = [torch.empty(100) for _ in range(50)]
    assert tracker.stats()["current_device_bytes"] == 50 * 100 * F32

    def drop(items):
        while items:
            items.pop()

    worker = threading.Thread(target=drop, args=(tensors,))
    worker.start()
    worker.join()
    gc.collect()
    assert tracker.stats()["current_device_bytes"] == 0


def test_meta_tensors_are_tracked():
    tracker = DeviceMemoryTracker()
    with tracker:
        a = torch.empty(1 << 20, device="meta")
        b = torch.empty(1 << 10, device="meta")  # meta storages share data_ptr 0
        c = a + 1
    assert tracker.stats()["current_device_bytes"] == ((1 << 21) + (1 << 10)) * F32
    del a, b, c
    gc.collect()
    assert tracker.stats()["current_device_bytes"] == 0
