"""memo_ext.device on CUDA: side streams, events and pinned host memory follow the same overlap
protocol as the CPU copy workers (see tests/unit/memo_ext/test_device.py)."""
import math

import pytest
import torch

from memo_ext.device import CopyEngine, measure_offload_bandwidth

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + seed) % 251).to(torch.uint8)


@pytest.fixture
def engine():
    with CopyEngine(torch.device("cuda")) as eng:
        yield eng


def test_buffers_live_where_they_should(engine):
    assert engine.device.type == "cuda" and engine.device.index is not None
    host = engine.alloc_host(1024)
    device = engine.alloc_device(1024)
    assert host.is_pinned() and host.dtype == torch.uint8
    assert device.device == engine.device and device.dtype == torch.uint8


def test_host_slot_page_locked_at_its_size_round_trips(engine):
    """alloc_host registers the buffer's own pages (no power-of-two block): is_pinned() sees
    them and non_blocking copies through them keep every byte; three times over, each buffer
    dropped (unregistered and unmapped) before the next."""
    nbytes = (8 << 20) + 4096 + 5  # neither whole pages nor a power of two
    data = _pattern(nbytes, seed=5).to(engine.device)
    for _ in range(3):
        host = engine.alloc_host(nbytes)
        assert host.is_pinned() and host.numel() == nbytes
        offloaded = engine.offload(host, data)
        device = engine.alloc_device(nbytes)
        engine.wait(engine.prefetch(device, host, after=offloaded))
        assert torch.equal(device, data)
        engine.synchronize()
        assert torch.equal(host, data.cpu())
        del host


def test_round_trip_on_streams(engine):
    nbytes = 1 << 20
    data = _pattern(nbytes, seed=2).to(engine.device)
    device = engine.alloc_device(2 * nbytes)
    host = engine.alloc_host(2 * nbytes)
    device[nbytes:].copy_(data)  # compute on the current stream, not yet synchronized

    offloaded = engine.offload(host[:nbytes], device[nbytes:])
    engine.wait(offloaded)
    device.zero_()  # ordered after the offload on the compute stream
    prefetched = engine.prefetch(device[:nbytes], host[:nbytes], after=offloaded)
    engine.wait(prefetched)
    assert torch.equal(device[:nbytes], data)
    engine.synchronize()
    assert offloaded.query() and prefetched.query()
    stats = engine.stats
    assert (stats.offload_copies, stats.offload_bytes) == (1, nbytes)
    assert (stats.prefetch_copies, stats.prefetch_bytes) == (1, nbytes)
    assert stats.offload_seconds > 0 and stats.prefetch_seconds > 0


def test_copy_does_not_block_host_and_missing_wait_is_visible():
    with CopyEngine("cuda", copy_delay_s=0.2) as engine:
        nbytes = 1 << 16
        data = _pattern(nbytes, seed=9)
        host = engine.alloc_host(nbytes)
        host.copy_(data)
        device = engine.alloc_device(nbytes)
        device.zero_()
        torch.cuda.synchronize()
        prefetched = engine.prefetch(device, host)
        assert not prefetched.query()
        stale = device.clone()  # forgot wait(): the compute stream does not wait for the copy
        engine.wait(prefetched)
        fresh = device.clone()
        torch.cuda.synchronize()
        assert torch.equal(stale.cpu(), torch.zeros(nbytes, dtype=torch.uint8))
        assert torch.equal(fresh.cpu(), data)


def test_record_compute_orders_copies(engine):
    nbytes = 1 << 20
    device = engine.alloc_device(nbytes)
    host = engine.alloc_host(nbytes)
    device.fill_(7)
    marker = engine.record_compute()
    event = engine.offload(host, device, after=marker)
    event.synchronize()
    assert marker.query()
    assert bool((host == 7).all())


def test_bandwidth_is_positive(engine):
    bandwidth = measure_offload_bandwidth(engine, nbytes=8 << 20, repeats=2)
    assert bandwidth > 0 and math.isfinite(bandwidth)


def test_bad_sizes_and_close(engine):
    with pytest.raises(ValueError):
        engine.offload(engine.alloc_host(8), engine.alloc_device(16))
    with pytest.raises(ValueError, match="must live on"):
        engine.offload(engine.alloc_host(8), torch.zeros(8, dtype=torch.uint8))
    engine.close()
    engine.close()
