"""memo_ext.device on CPU: the copy workers really run asynchronously, so the overlap protocol
(FIFO per direction, `after` dependencies, compute waiting on copies) can be checked and a
missing wait shows up as stale data."""
import math
import time

import pytest
import torch

from memo_ext.device import COPY_DELAY_ENV, CopyEngine, CopyEvent, measure_offload_bandwidth

DELAY_S = 0.2


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + seed) % 251).to(torch.uint8)


@pytest.fixture
def engine():
    with CopyEngine(torch.device("cpu"), copy_delay_s=0.0) as eng:
        yield eng


@pytest.fixture
def slow_engine():
    with CopyEngine(torch.device("cpu"), copy_delay_s=DELAY_S) as eng:
        yield eng


def test_round_trip_through_slices(engine):
    nbytes = 4096
    device_buf = engine.alloc_device(2 * nbytes)
    host_buf = engine.alloc_host(3 * nbytes)
    assert device_buf.dtype == torch.uint8 and device_buf.device == engine.device
    assert host_buf.dtype == torch.uint8 and host_buf.device.type == "cpu"
    data = _pattern(nbytes, seed=3)
    device_buf[nbytes:].copy_(data)

    offloaded = engine.offload(host_buf[nbytes:2 * nbytes], device_buf[nbytes:])
    engine.wait(offloaded)
    assert offloaded.query()
    device_buf.zero_()  # safe: the offload finished
    prefetched = engine.prefetch(device_buf[:nbytes], host_buf[nbytes:2 * nbytes])
    engine.wait(prefetched)
    assert torch.equal(device_buf[:nbytes], data)
    assert torch.equal(device_buf[nbytes:], torch.zeros(nbytes, dtype=torch.uint8))

    stats = engine.stats
    assert (stats.offload_copies, stats.offload_bytes) == (1, nbytes)
    assert (stats.prefetch_copies, stats.prefetch_bytes) == (1, nbytes)
    assert stats.total_seconds >= 0


def test_each_direction_is_fifo():
    with CopyEngine("cpu", copy_delay_s=0.02) as engine:
        nbytes = 256
        host = engine.alloc_host(nbytes)
        sources = [torch.full((nbytes,), value, dtype=torch.uint8) for value in (1, 2, 3, 4)]
        events = [engine.offload(host, src) for src in sources]
        events[1].synchronize()
        assert events[0].query(), "a later copy finished before an earlier one"
        engine.synchronize()
        assert all(event.query() for event in events)
        assert torch.equal(host, sources[-1]), "copies into one buffer ran out of order"

        device = engine.alloc_device(nbytes)
        events = [engine.prefetch(device, src) for src in sources[::-1]]
        engine.wait(events[-1])
        assert all(event.query() for event in events)
        assert torch.equal(device, sources[0])


def test_prefetch_after_offload_sees_offloaded_data(slow_engine):
    nbytes = 1024
    data = _pattern(nbytes, seed=11)
    src = slow_engine.alloc_device(nbytes)
    src.copy_(data)
    host = slow_engine.alloc_host(nbytes)
    host.zero_()
    back = slow_engine.alloc_device(nbytes)
    back.zero_()

    offloaded = slow_engine.offload(host, src)
    # The prefetch worker is free right away; only `after` holds it behind the offload.
    prefetched = slow_engine.prefetch(back, host, after=offloaded)
    prefetched.synchronize()
    assert offloaded.query()
    assert torch.equal(back, data)


def test_copies_overlap_with_compute(slow_engine):
    nbytes = 1 << 16
    src = slow_engine.alloc_device(nbytes)
    host = slow_engine.alloc_host(nbytes)
    start = time.perf_counter()
    event = slow_engine.offload(host, src)
    issued_s = time.perf_counter() - start
    assert issued_s < DELAY_S / 4, f"offload() blocked for {issued_s:.3f} s"
    assert not event.query()
    # Compute keeps running while the copy is in flight.
    compute = torch.ones(64, 64) @ torch.ones(64, 64)
    assert compute[0, 0].item() == 64
    assert not event.query()
    event.synchronize()
    assert event.query()
    assert isinstance(slow_engine.record_compute(), CopyEvent)
    assert slow_engine.record_compute().query()


def test_missing_wait_reads_stale_data(slow_engine):
    nbytes = 2048
    data = _pattern(nbytes, seed=5)
    host = slow_engine.alloc_host(nbytes)
    host.copy_(data)
    device = slow_engine.alloc_device(nbytes)
    device.zero_()

    prefetched = slow_engine.prefetch(device, host)
    stale = device.clone()  # a caller that forgot wait()
    assert torch.equal(stale, torch.zeros(nbytes, dtype=torch.uint8))
    slow_engine.wait(prefetched)
    assert torch.equal(device, data)


def test_delay_from_environment(monkeypatch):
    monkeypatch.setenv(COPY_DELAY_ENV, "0.05")
    with CopyEngine("cpu") as engine:
        assert engine.copy_delay_s == 0.05
    monkeypatch.setenv(COPY_DELAY_ENV, "soon")
    with pytest.raises(ValueError, match=COPY_DELAY_ENV):
        CopyEngine("cpu")


def test_bad_buffers_raise_value_error(engine):
    host = engine.alloc_host(16)
    device = engine.alloc_device(32)
    with pytest.raises(ValueError, match="same size"):
        engine.offload(host, device)
    with pytest.raises(ValueError, match="same size"):
        engine.prefetch(device, host)
    with pytest.raises(ValueError, match="uint8"):
        engine.offload(host, torch.zeros(16, dtype=torch.float32))
    with pytest.raises(ValueError, match="1-D"):
        engine.offload(host, device[:16].view(4, 4))
    with pytest.raises(ValueError):
        engine.alloc_host(-1)
    with pytest.raises(ValueError, match="unsupported"):
        CopyEngine("meta")


def test_copy_error_is_reraised(engine):
    class FailedEvent(CopyEvent):
        def query(self):
            return True

        def synchronize(self):
            raise RuntimeError("upstream copy failed")

    host = engine.alloc_host(8)
    device = engine.alloc_device(8)
    event = engine.offload(host, device, after=FailedEvent())
    with pytest.raises(RuntimeError, match="upstream copy failed"):
        event.synchronize()
    with pytest.raises(RuntimeError, match="upstream copy failed"):
        engine.wait(event)
    engine.synchronize()  # errors stay with their events


def test_measure_offload_bandwidth(engine):
    calls = []
    bandwidth = measure_offload_bandwidth(engine, nbytes=1 << 20, repeats=2,
                                          barrier=lambda: calls.append(True))
    assert calls == [True]
    assert bandwidth > 0 and math.isfinite(bandwidth)
    assert engine.stats.offload_copies == 3  # warm-up + 2 timed


def test_close_is_idempotent():
    engine = CopyEngine("cpu")
    host = engine.alloc_host(8)
    device = engine.alloc_device(8)
    device.fill_(9)
    event = engine.offload(host, device)
    engine.close()
    assert event.query() and torch.equal(host, device)  # close finishes queued copies
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.offload(host, device)
