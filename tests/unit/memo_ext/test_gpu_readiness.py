"""The CUDA-only paths of the trainer under tests/cuda_double.py, the CPU test double of
torch.cuda: memory statistics (the log line, telemetry, MEMO's auto-alpha headroom) with
PyTorch's caching allocator and with the planned arena's pluggable allocator installed, and the
offload copy engine's streams, events, page-locked and pinned host memory and record_stream. Each of these raised or
silently lost information on the first GPU run before memo_ext.device_memory existed
(docs/gpu.md lists the call sites). The arena's hooks run for real, against the fake CUDA
runtime loaded as PyTorch loads its own."""
from __future__ import annotations

import threading

import pytest
import torch

from memo_ext import _C, device_memory
from memo_ext.config import MemoConfigError, TelemetryConfig
from memo_ext.device import CUDA_FRAGMENTATION_RESERVE, CopyEngine, cuda_memory_headroom
from memo_ext.offload.buffers import HostSlotPool
from memo_ext.planner.arena import install_cuda_allocator
from memo_ext.telemetry import MemoryTelemetry
from megatron.training import metrics

MiB = 1 << 20


@pytest.fixture
def planned_arena(cuda_double, loaded_fake_cuda_runtime):
    """The planned arena's hooks installed as PyTorch's CUDA allocator (before any allocation,
    as --memo-plan does), over the fake CUDA runtime."""
    install_cuda_allocator()
    return cuda_double


def test_log_line_reads_the_planned_arena_not_pytorch(planned_arena):
    before = metrics.memory_report()["mem_allocated_mib"] * MiB
    big = planned_arena.allocate(3 * MiB)
    small = planned_arena.allocate(MiB)
    planned_arena.free(small)
    report = metrics.memory_report()
    assert report["mem_allocated_mib"] * MiB == before + 3 * MiB
    assert report["mem_peak_allocated_mib"] * MiB == before + 4 * MiB
    assert report["mem_reserved_mib"] * MiB == _C.cuda_arena_memory(0)["reserved"]
    # The log line started a new peak: the freed MiB is no longer in it.
    assert metrics.memory_report()["mem_peak_allocated_mib"] * MiB == before + 3 * MiB
    planned_arena.free(big)
    with pytest.raises(RuntimeError, match="CUDAPluggableAllocator does not yet support"):
        torch.cuda.memory_allocated()  # what the log line called before


def test_auto_alpha_headroom_under_the_planned_arena(planned_arena):
    device = torch.device("cuda", 0)
    cuda_memory_headroom(device)  # what raised under the arena before device_memory
    device_memory.reset_peak(0)  # other tests in this process used the same hooks
    fresh = cuda_memory_headroom(device)
    held = planned_arena.allocate(64 * MiB)
    # The fake pool caches nothing: while the block is held, free memory is 64 MiB less.
    assert cuda_memory_headroom(device) == fresh - 64 * MiB
    planned_arena.free(held)
    memory = device_memory.device_memory(0)
    free, total = torch.cuda.mem_get_info(0)
    expected = free + memory.reserved - memory.peak_reserved - CUDA_FRAGMENTATION_RESERVE * total
    assert cuda_memory_headroom(device) == int(expected)


def test_telemetry_samples_the_planned_arena_and_skips_snapshots(planned_arena, tmp_path):
    lines = []
    config = TelemetryConfig(telemetry=True, oom_report_dir=str(tmp_path))
    telemetry = MemoryTelemetry(config, log_interval=1, log=lines.append)
    assert any("no allocator snapshot" in line for line in lines), lines
    with telemetry.step(1):
        block = planned_arena.allocate(5 * MiB)
    arena = _C.cuda_arena_memory(0)
    assert (telemetry.interval.peak, telemetry.interval.current) == (arena["peak_allocated"],
                                                                     arena["allocated"])
    assert telemetry._dump(tmp_path / "oom") == (None, None)
    planned_arena.free(block)


def test_out_of_memory_under_the_planned_arena_is_pytorchs_error_and_telemetry_reports_it(
        planned_arena, loaded_fake_cuda_runtime, tmp_path):
    """Issue 42, finding 4: PyTorch's pluggable allocator does not check the hook's pointer
    (the double calls the hook as it does), so the hook's null answer to a request the pool
    refused gave a 64 MiB tensor at address 0, left the runtime's error pending, and no
    torch.OutOfMemoryError reached telemetry. Now: PyTorch's error naming the allocator and the
    bytes, the runtime's error cleared, telemetry's report written, the next request served."""
    import ctypes
    import json

    from memo_ext.telemetry.monitor import MemoryBudgetExceeded

    fake = loaded_fake_cuda_runtime
    capacity = ctypes.c_int64.in_dll(fake, "fake_capacity")
    telemetry = MemoryTelemetry(TelemetryConfig(telemetry=True, oom_report_dir=str(tmp_path)),
                                log_interval=1, log=lambda line: None)
    capacity.value = ctypes.c_int64.in_dll(fake, "fake_reserved").value + MiB
    try:
        with pytest.raises(MemoryBudgetExceeded, match="out of device memory") as stopped:
            with telemetry.step(7):
                planned_arena.allocate(64 * MiB)
        assert ctypes.c_int.in_dll(fake, "fake_last_error").value == 0  # cleared
        block = planned_arena.allocate(MiB // 2)  # what fits is still served
        assert block
        planned_arena.free(block)
    finally:
        capacity.value = -1
    error = stopped.value.__cause__
    assert isinstance(error, torch.OutOfMemoryError), repr(error)
    assert str(error).startswith(f"CUDA out of memory. Tried to allocate 64.00 MiB ({64 * MiB} "
                                 "bytes) on device 0 from MEMO's planned-arena allocator"), error
    report = json.loads((tmp_path / "oom_rank0_iter7.json").read_text())
    assert report["kind"] == "oom" and report["error"].startswith("CUDA out of memory")


class OnePhasePlan:
    """One forward phase kind of layer 0: 1 KiB at 0, 1 KiB at 1 KiB."""

    level1 = [{"peak": 2048, "phases": [[0, "forward", None, 0]],
               "table": [[1024, 0], [1024, 1024]]}]


def test_a_closed_arena_takes_back_its_late_frees_whatever_python_dropped(
        planned_arena, loaded_fake_cuda_runtime, monkeypatch):
    """Issue 42, finding 8 (the arena part): CudaArena.close() was never called, and a planned
    tensor freed late (after its iteration's traceback, or while the interpreter tears down
    modules) met either the hooks still pointing at an arena Python had destroyed, or, after a
    close, cudaFreeAsync of an address inside the arena's buffer. The hooks now keep the arena
    until its last block comes back, and the close stops it serving."""
    import ctypes
    import gc

    from memo_ext.planner.arena import ArenaRuntime, CudaArena

    host_empty = torch.empty  # the arena's buffer on the host: the hooks only use its address
    monkeypatch.setattr(torch, "empty", lambda *size, device=None, **kwargs: host_empty(
        *size, **kwargs))
    invalid_frees = ctypes.c_int.in_dll(loaded_fake_cuda_runtime, "fake_invalid_frees")
    before = invalid_frees.value
    _C.set_cuda_arena(None, 0, 0)
    runtime = ArenaRuntime(OnePhasePlan())
    arena = CudaArena(runtime, torch.device("cuda", 0))
    runtime.enter(0, "forward")
    held = planned_arena.allocate(1000)
    assert held == arena.base
    arena.close()  # what the trainer does when training ends (and atexit, if it did not)
    arena.close()  # idempotent
    pooled = planned_arena.allocate(1000)  # requests go to the pool once it is closed
    assert not arena.base <= pooled < arena.base + 2048
    planned_arena.free(pooled)
    del runtime, arena  # Python's share of the arena goes first, as at interpreter teardown
    gc.collect()
    planned_arena.free(held)  # the late free: back to the arena the hooks kept
    assert invalid_frees.value == before  # never passed to cudaFreeAsync
    hooks = _C.cuda_arena_hooks()  # the hooks let go of it with its last block
    assert (hooks["serving"], hooks["draining_live_blocks"]) == (False, 0)


def test_caching_allocator_statistics_and_snapshots_still_come_from_pytorch(cuda_double,
                                                                            tmp_path):
    telemetry = MemoryTelemetry(TelemetryConfig(telemetry=True, oom_report_dir=str(tmp_path)),
                                log_interval=1, log=lambda line: None)
    assert cuda_double.history_enabled
    with telemetry.step(1):
        cuda_double.allocate(3 * MiB)
    assert telemetry.interval.peak == torch.cuda.max_memory_allocated() == 3 * MiB
    report = metrics.memory_report()
    assert (report["mem_allocated_mib"], report["mem_reserved_mib"]) == (3, 3)
    assert telemetry._dump(tmp_path / "oom")[0].endswith(".snapshot.pickle")


def test_the_arena_cannot_replace_an_allocator_in_use(cuda_double, loaded_fake_cuda_runtime):
    cuda_double.allocate(MiB)
    with pytest.raises(MemoConfigError, match="--memo-plan: .*already initialized"):
        install_cuda_allocator()


class RecordingAllocator:
    """An allocator registered with memo_ext.device_memory that keeps what it is told."""

    name = "recording test allocator"

    def __init__(self):
        self.recorded = []

    def record_stream(self, data_ptr: int, stream_handle: int) -> None:
        self.recorded.append((data_ptr, stream_handle))


def test_copy_engine_streams_events_pinned_memory_and_record_stream(cuda_double):
    allocator = RecordingAllocator()
    device_memory.register_allocator(allocator)
    cuda_double.pluggable = object()  # Tensor.record_stream no longer reaches it, as in PyTorch
    engine = CopyEngine("cuda")
    host = engine.alloc_host(4096)
    assert cuda_double.cudart.registered == {host.data_ptr(): 4096}
    assert engine.alloc_host_cached(4096).numel() == 4096 and cuda_double.pinned_bytes == 4096
    # A host tensor stands for a CUDA buffer, so the copier is driven below the engine's
    # device checks.
    device = torch.arange(4096, dtype=torch.uint8)
    event = engine._copier.submit("offload", host, device, after=engine.record_compute())
    engine.wait(event)
    engine.synchronize()
    assert torch.equal(host, device)
    offload_stream = engine._copier._streams["offload"]
    assert offload_stream.waited_for[0] == torch.cuda.current_stream()
    assert allocator.recorded == [(device.untyped_storage().data_ptr(),
                                   offload_stream.cuda_stream)]
    assert cuda_double.dropped_record_streams == 1
    assert engine.stats.offload_bytes == 4096 and engine.stats.offload_seconds >= 0
    engine.close()


def test_host_slots_are_page_locked_at_their_own_size_once_and_unlocked_when_dropped(
        cuda_double):
    cudart = cuda_double.cudart
    pool = HostSlotPool(CopyEngine("cuda"))
    sizes = {0: 3 * 4096 + 5, 1: 5000, 2: 8192 + 1}  # neither pages nor powers of two
    slots = {layer: pool.acquire(layer, nbytes) for layer, nbytes in sizes.items()}
    addresses = {layer: slot.data_ptr() for layer, slot in slots.items()}
    assert cudart.register_calls == [(addresses[layer], nbytes, 0)
                                     for layer, nbytes in sizes.items()]
    assert all(address % 4096 == 0 for address in addresses.values())  # whole pages, no more
    for layer in sizes:
        pool.release(layer, slots[layer])
    again = pool.acquire(0, sizes[0])  # a free slot is reused, not registered again
    assert again.data_ptr() == addresses[0] and len(cudart.register_calls) == 3
    pool.release(0, again)
    kept = slots[1][7:]  # a view keeps its slot's storage, and so its pages, alive
    del slots, again
    pool.reset()  # alpha changed: every slot dropped
    assert sorted(cudart.unregister_calls) == sorted([addresses[0], addresses[2]])
    assert cudart.registered == {addresses[1]: sizes[1]}
    del kept
    assert sorted(cudart.unregister_calls) == sorted(addresses.values())
    assert cudart.registered == {}


def test_a_dropped_host_buffer_is_unlocked_after_its_queued_copy(cuda_double, monkeypatch):
    """PyTorch guards only its own pinned blocks with an event; alloc_host's buffer waits for
    the last copy queued on it before it is unregistered and unmapped."""
    engine = CopyEngine("cuda")
    host = engine.alloc_host(4096)
    event = engine._copier.submit("offload", host[:1024], torch.ones(1024, dtype=torch.uint8),
                                  after=None)
    order = []
    monkeypatch.setattr(event.event, "synchronize", lambda: order.append("copy finished"))
    unregister = cuda_double.cudart.cudaHostUnregister
    monkeypatch.setattr(cuda_double.cudart, "cudaHostUnregister",
                        lambda ptr: order.append("unregistered") or unregister(ptr))
    del host
    assert order == ["copy finished", "unregistered"]
    engine.close()


def test_a_refused_page_lock_names_the_flags_to_change(cuda_double):
    cuda_double.cudart.lockable_bytes = 8192
    engine = CopyEngine("cuda")
    first = engine.alloc_host(4096)
    with pytest.raises(RuntimeError, match=r"^MEMO could not page-lock a host buffer of 8192 "
                       r"bytes \(cudaHostRegister: out of memory\); lower "
                       r"--memo-host-memory-gb or raise the locked-memory limit \(ulimit -l\)$"):
        engine.alloc_host(8192)
    assert cuda_double.cudart.registered == {first.data_ptr(): 4096}


def test_telemetry_counts_page_locked_slots_as_host(cuda_double, tmp_path):
    """A page-locked slot is no aten op's output: the trainer's engine registers it with the
    tracker, which counts it until its storage dies."""
    from megatron.training.memo import _LabelledCopyEngine

    telemetry = MemoryTelemetry(TelemetryConfig(telemetry=True, oom_report_dir=str(tmp_path)),
                                log_interval=1, log=lambda line: None)
    engine = _LabelledCopyEngine("cuda", telemetry)
    host = engine.alloc_host(3 * 4096 + 5)
    assert telemetry.tracker.stats()["current_host_bytes"] == 3 * 4096 + 5
    del host
    assert telemetry.tracker.stats()["current_host_bytes"] == 0
    assert telemetry.tracker.stats()["peak_host_bytes"] == 3 * 4096 + 5


def test_collective_buffers_recorded_on_the_nccl_stream_reach_the_allocator(cuda_double):
    allocator = RecordingAllocator()
    device_memory.register_allocator(allocator)
    buffer = torch.zeros(16)
    device_memory.record_stream(buffer, cuda_double.nccl_stream())
    assert allocator.recorded == [(buffer.untyped_storage().data_ptr(),
                                   cuda_double.nccl_stream().cuda_stream)]


def test_one_replacement_allocator_per_process(cuda_double):
    device_memory.register_allocator(RecordingAllocator())
    with pytest.raises(RuntimeError, match="already replaced PyTorch's CUDA allocator"):
        device_memory.register_allocator(RecordingAllocator())


def test_double_raises_where_pytorch_raises(cuda_double):
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.memory_allocated(1)
    start, end = torch.cuda.Event(), torch.cuda.Event()
    start.record()
    end.record()
    with pytest.raises(RuntimeError):
        start.elapsed_time(end)  # created without enable_timing
    with pytest.raises(ValueError, match="Invalid fraction"):
        torch.cuda.set_per_process_memory_fraction(1.5)
    with pytest.raises(TypeError):
        torch.zeros(1).record_stream(threading.Lock())


def test_cuda_traces_need_pytorchs_allocator(planned_arena):
    from memo_ext.planner.trace import record_cuda_trace

    with pytest.raises(RuntimeError, match="MEMO planned arena .* replaced that allocator"):
        record_cuda_trace(lambda: None)


STATE = torch.arange(16, dtype=torch.uint8)


def test_checkpoint_saves_and_restores_the_cuda_generator(cuda_double):
    from megatron.training import checkpointing

    cuda_double.set_rng_state(STATE)
    saved = checkpointing._rng_state()
    cuda_double.set_rng_state(torch.zeros(16, dtype=torch.uint8))
    checkpointing._set_rng_state(saved)
    assert torch.equal(torch.cuda.get_rng_state(), STATE)
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.cuda.set_rng_state(torch.zeros(16))  # as PyTorch refuses a float state


def test_memo_recomputation_restores_the_cuda_generator(cuda_double):
    from memo_ext.offload.manager import _RngSnapshot

    cuda_double.set_rng_state(STATE)
    snapshot = _RngSnapshot.take()
    cuda_double.set_rng_state(torch.zeros(16, dtype=torch.uint8))
    snapshot.restore()
    assert torch.equal(torch.cuda.get_rng_state(), STATE)
