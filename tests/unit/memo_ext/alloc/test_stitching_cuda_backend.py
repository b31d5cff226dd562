"""The CUDA backend of the stitching allocator (csrc/cuda/stitching_cuda.cpp), built by
memo_ext.alloc.stitching_cuda and driven through its CUDAPluggableAllocator hooks, on a machine
without a GPU: the driver's virtual-memory, event and context calls come from
csrc/standalone/fake_cuda_driver.cpp (host memfd/mmap, events the test completes, enforcing the
rules the CUDA documentation states for those calls). This checks the backend's bookkeeping of
2 MiB chunks, mappings and releases, that stitched pointers alias the right memory, that a block
used by another stream is not handed out before that stream's event completed, and the trainer
flag that installs it (under tests/cuda_double.py); it says nothing about a real GPU
(tests/gpu/test_stitching_cuda.py)."""
import ctypes
import random
import shutil
import subprocess

import pytest

from memo_ext.alloc import stitching_cuda
from tests.conftest import REPO_ROOT

MiB = 1 << 20
REPO = REPO_ROOT


def _cuda_home():
    try:
        return stitching_cuda.cuda_home()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    home = _cuda_home()
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    out = tmp_path_factory.mktemp("stitching_cuda")
    fake = out / "libfakecuda.so"
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{home / 'include'}",
                    str(REPO / "csrc/standalone/fake_cuda_driver.cpp"), "-o", str(fake)],
                   check=True, capture_output=True, timeout=600)
    lib = stitching_cuda.build_library(out, force=True, optimize="-O0")  # quicker to build
    assert lib.is_file() and lib.name == "libmemo_stitching_cuda.so"
    return fake, lib


@pytest.fixture
def allocator(libs, tmp_path, monkeypatch):
    """Fresh copies of the library and the fake driver per test (their globals start empty)."""
    built_fake, lib = libs
    fake = tmp_path / built_fake.name
    shutil.copy(built_fake, fake)
    monkeypatch.setenv("MEMO_STITCH_CUDA_DRIVER", str(fake))
    monkeypatch.delenv("FAKE_CUDA_CAPACITY", raising=False)
    copy = tmp_path / lib.name
    shutil.copy(lib, copy)
    a = stitching_cuda.CudaStitchingAllocator(copy)
    driver = ctypes.CDLL(str(fake))
    driver.fake_cuda_complete_events.argtypes = [ctypes.c_void_p, ctypes.c_int]
    counts = (ctypes.c_longlong * 6)()
    event_counts = (ctypes.c_longlong * 5)()

    def fake_counts():
        driver.fake_cuda_counts(counts)
        return dict(zip(("handles", "ranges", "mappings", "held", "creates", "violations"),
                        counts))

    def fake_events():
        driver.fake_cuda_event_counts(event_counts)
        return dict(zip(("live", "pending", "created", "syncs", "contexts"), event_counts))

    def complete_events(stream=None):
        """The device reaches the events recorded on ``stream`` (every stream: None)."""
        driver.fake_cuda_complete_events(stream, int(stream is None))

    a.fake_counts = fake_counts
    a.fake_events = fake_events
    a.complete_events = complete_events
    a.fake_driver = driver
    yield a
    a.lib.memo_stitch_teardown(0)


def test_stitched_pointer_aliases_the_chunks_through_the_cuda_hooks(allocator):
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB)
    first = a.lib.memo_stitch_try_malloc(8 * MiB, 0, None)
    assert first and a.stats()["new_pblocks"] == 1
    a.lib.memo_stitch_free(first, 8 * MiB, 0, None)
    block = a.lib.memo_stitch_try_malloc(14 * MiB, 0, None)  # 8 MiB + a new 6 MiB, stitched
    s = a.stats()
    assert s["stitches"] == 1 and s["reserved_bytes"] == s["backend_physical_bytes"] == 14 * MiB
    # one cuMemCreate per 2 MiB chunk: 4 + 3
    assert a.fake_counts()["creates"] == 7 and a.fake_counts()["held"] == 14 * MiB
    data = bytes(range(256)) * (14 * MiB // 256)
    ctypes.memmove(block, data, len(data))
    assert ctypes.string_at(first, 8 * MiB) == data[:8 * MiB]  # the old block's own view
    a.lib.memo_stitch_empty_cache(0)  # the stitched block is in use: nothing released
    assert a.stats()["reserved_bytes"] == 14 * MiB
    a.lib.memo_stitch_free(block, 14 * MiB, 0, None)
    a.lib.memo_stitch_empty_cache(0)
    c = a.fake_counts()
    assert (c["handles"], c["ranges"], c["mappings"], c["held"]) == (0, 0, 0, 0)
    assert c["violations"] == 0 and a.last_error() == ""


def test_random_use_breaks_no_driver_rule_and_leaks_nothing(allocator):
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB, max_sblocks=16)
    rng = random.Random(4)
    live = {}
    for step in range(3000):
        if live and (len(live) > 24 or rng.random() < 0.45):
            ptr, (size, tag) = live.popitem()
            assert ctypes.string_at(ptr, 64) == tag and ctypes.string_at(ptr + size - 64, 64) == tag
            a.lib.memo_stitch_free(ptr, size, 0, None)
        elif rng.random() < 0.01:
            a.lib.memo_stitch_empty_cache(0)
        else:
            size = rng.choice([rng.randint(1, MiB), rng.randint(MiB, 40 * MiB),
                               rng.randint(1, 20) * 2 * MiB])
            stream = rng.choice([None, 1])
            ptr = a.lib.memo_stitch_try_malloc(size, 0, stream)
            assert ptr, a.last_error()
            tag = step.to_bytes(8, "little") * 8
            ctypes.memmove(ptr, tag, 64)
            ctypes.memmove(ptr + size - 64, tag, 64) if size >= 64 else None
            live[ptr] = (size, tag) if size >= 64 else (64, tag)
        if step % 500 == 0:
            s = a.stats()
            assert s["reserved_bytes"] == s["backend_physical_bytes"] == a.fake_counts()["held"]
    s = a.stats()
    assert s["stitches"] > 50 and s["splits"] > 20 and s["sblocks_dropped"] > 0
    for ptr, (size, _) in live.items():
        a.lib.memo_stitch_free(ptr, size, 0, None)
    a.lib.memo_stitch_empty_cache(0)
    c = a.fake_counts()
    assert (c["handles"], c["ranges"], c["mappings"], c["held"], c["violations"]) == (0,) * 5
    assert a.last_error() == ""


def test_out_of_device_memory_reorganises_then_refuses(allocator, monkeypatch):
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB)
    monkeypatch.setenv("FAKE_CUDA_CAPACITY", str(30 * MiB))
    p = a.lib.memo_stitch_try_malloc(20 * MiB, 0, None)
    a.lib.memo_stitch_free(p, 20 * MiB, 0, None)
    q = a.lib.memo_stitch_try_malloc(24 * MiB, 0, ctypes.c_void_p(1))  # another stream
    assert q and a.stats()["reorganisations"] == 1  # the cached 20 MiB went back first
    # the variant for ctypes answers null; PyTorch's hook raises (the test after this one)
    assert a.lib.memo_stitch_try_malloc(40 * MiB, 0, None) is None
    assert "out of memory" in a.last_error() and a.stats()["ooms"] == 1
    assert a.fake_counts()["violations"] == 0
    with pytest.raises(RuntimeError, match="before the first CUDA allocation"):
        a.configure(frag_limit_bytes=8 * MiB)


def test_out_of_memory_is_pytorchs_out_of_memory_error_and_telemetry_reports_it(
        allocator, cuda_double, monkeypatch, tmp_path):
    """Issue 42, finding 4: PyTorch's pluggable allocator does not check the hook's pointer
    (tests/cuda_double.py calls the hook as it does): a null answer gave a 40 MiB tensor at
    address 0 and no error. The hook raises torch.OutOfMemoryError, naming itself and the
    bytes, and telemetry's out-of-memory report is written."""
    import torch

    from memo_ext.config import TelemetryConfig
    from memo_ext.telemetry import MemoryTelemetry
    from memo_ext.telemetry.monitor import MemoryBudgetExceeded

    stitching_cuda.install(frag_limit_bytes=4 * MiB, library=allocator.path)
    monkeypatch.setenv("FAKE_CUDA_CAPACITY", str(30 * MiB))
    telemetry = MemoryTelemetry(TelemetryConfig(telemetry=True, oom_report_dir=str(tmp_path)),
                                log_interval=1, log=lambda line: None)
    with pytest.raises(MemoryBudgetExceeded, match="out of device memory") as stopped:
        with telemetry.step(3):
            cuda_double.allocate(40 * MiB)
    error = stopped.value.__cause__
    assert isinstance(error, torch.OutOfMemoryError), repr(error)
    assert str(error).startswith("CUDA out of memory. Tried to allocate 40.00 MiB "
                                 f"({40 * MiB} bytes) on device 0 from MEMO's GMLake stitching "
                                 "allocator"), str(error)
    assert (tmp_path / "oom_rank0_iter3.json").is_file()
    address = cuda_double.allocate(8 * MiB)  # what fits is still served
    assert address
    cuda_double.free(address)
    allocs = allocator.stats()["allocs"]
    assert cuda_double.allocate(0) == 0  # 0 bytes: null, as the caching allocator answers
    assert allocator.stats()["allocs"] == allocs  # no block for it
    assert allocator.fake_counts()["violations"] == 0


# --------------------------------------------------------------- unmapping after the stream
SYNC, UNMAP, RELEASE = 1, 2, 3  # csrc/standalone/fake_cuda_driver.cpp's call log kinds


def call_log(a) -> list[tuple[int, int]]:
    """The fake driver's (kind, value) log of cuStreamSynchronize / cuMemUnmap / cuMemRelease."""
    out = (ctypes.c_longlong * 8192)()
    a.fake_driver.fake_cuda_call_log.restype = ctypes.c_longlong
    n = a.fake_driver.fake_cuda_call_log(out, ctypes.c_longlong(4096))
    return [(out[2 * i], out[2 * i + 1]) for i in range(min(n, 4096))]


def _unmapped_after_their_stream(log: list, stream: int) -> None:
    first = next(i for i, (kind, _) in enumerate(log) if kind in (UNMAP, RELEASE))
    assert (SYNC, stream) in log[:first], log
    assert log.count((SYNC, stream)) == 1, log  # once per stream and release batch


def test_memory_a_stream_used_is_unmapped_only_after_that_stream_is_synchronized(allocator):
    """Issue 42, finding 5: a block freed on its stream may still be read by kernels queued
    there, and cuMemUnmap / cuMemRelease do not wait for them (PyTorch's
    ExpandableSegment::unmapHandles synchronizes its stream first for that reason). The fake
    driver logs the calls in order: each stream is synchronized before memory it used goes."""
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB, max_sblocks=1)
    # empty_cache: a primitive block and a normal-path block freed on the copy stream
    for size in (8 * MiB, 4096):
        block = a.lib.memo_stitch_try_malloc(size, 0, COPY)
        a.lib.memo_stitch_free(block, size, 0, COPY)
    a.fake_driver.fake_cuda_clear_call_log()
    a.empty_cache()
    log = call_log(a)
    assert sum(kind == UNMAP for kind, _ in log) == 2
    _unmapped_after_their_stream(log, COPY)
    # StitchFree: above max_sblocks stitched blocks, the least recently used inactive one is
    # unmapped inside a malloc
    first = [a.lib.memo_stitch_try_malloc(size, 0, NCCL) for size in (8 * MiB, 6 * MiB)]
    for ptr, size in zip(first, (8 * MiB, 6 * MiB)):
        a.lib.memo_stitch_free(ptr, size, 0, NCCL)
    stitched = a.lib.memo_stitch_try_malloc(14 * MiB, 0, NCCL)  # 8 + 6 MiB, stitched
    a.lib.memo_stitch_free(stitched, 14 * MiB, 0, NCCL)
    assert (a.stats()["stitches"], a.stats()["sblocks_dropped"]) == (1, 0)
    a.fake_driver.fake_cuda_clear_call_log()
    again = a.lib.memo_stitch_try_malloc(10 * MiB, 0, NCCL)  # stitched anew: one too many
    assert again and (a.stats()["stitches"], a.stats()["sblocks_dropped"]) == (2, 1)
    _unmapped_after_their_stream(call_log(a), NCCL)
    a.lib.memo_stitch_free(again, 10 * MiB, 0, NCCL)
    assert a.fake_counts()["violations"] == 0 and a.last_error() == ""


# ------------------------------------------------------------------------- streams and events
# Stream handles (cudaStream_t) as the hooks receive them; 0 would be the NULL stream and 1
# CU_STREAM_LEGACY.
COMPUTE, COPY, NCCL = 0x10, 0x20, 0x30


def test_a_block_used_by_another_stream_waits_for_its_event_before_reuse(allocator):
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB)
    block = a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE)
    keep = a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE)  # so that reuse has one candidate
    a.record_stream(block, COMPUTE)  # its own stream: nothing to wait for
    a.record_stream(block, COPY)
    a.record_stream(block, COPY)  # once per stream
    a.lib.memo_stitch_free(block, 8 * MiB, 0, COMPUTE)
    # the copy stream may still read it: the next block of the same size is another one
    other = a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE)
    assert other and other != block
    s = a.stats()
    assert (s["deferred_frees"], s["deferred_bytes"], s["events_pending"],
            s["events_recorded"]) == (1, 8 * MiB, 1, 1)
    assert s["active_bytes"] == 24 * MiB  # not free until the copy stream is done with it
    assert a.fake_events()["pending"] == 1 and a.stats()["event_syncs"] == 0  # queried only
    a.complete_events(COPY)
    again = a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE)
    assert again == block
    s = a.stats()
    assert (s["deferred_frees"], s["deferred_bytes"], s["events_pending"], s["new_pblocks"]) == (
        0, 0, 0, 3)
    events = a.fake_events()
    assert (events["live"], events["created"], events["contexts"]) == (0, 1, 1)
    for ptr in (keep, other, again):
        a.lib.memo_stitch_free(ptr, 8 * MiB, 0, COMPUTE)
    assert a.fake_counts()["violations"] == 0 and a.last_error() == ""


def test_a_block_used_by_two_streams_waits_for_both(allocator):
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB)
    block = a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE)
    keep = a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE)
    a.record_stream(block, COPY)
    a.record_stream(block, NCCL)
    # freed from a thread with no current context: the events go to the streams' own context
    a.fake_driver.fake_cuda_set_current_context(0)
    a.lib.memo_stitch_free(block, 8 * MiB, 0, COMPUTE)
    assert a.stats()["events_pending"] == 2
    a.complete_events(COPY)
    other = a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE)
    assert other != block and a.stats()["deferred_frees"] == 1  # NCCL's event still pending
    a.complete_events(NCCL)
    assert a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE) == block
    assert a.fake_events()["live"] == 0 and a.fake_counts()["violations"] == 0
    assert a.last_error() == "" and keep


def test_empty_cache_waits_for_pending_frees_and_releases_them(allocator):
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB)
    block = a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE)
    small = a.lib.memo_stitch_try_malloc(4096, 0, COMPUTE)  # the embedded caching path's block
    a.record_stream(block, COPY)
    a.record_stream(small, NCCL)
    a.lib.memo_stitch_free(block, 8 * MiB, 0, COMPUTE)
    a.lib.memo_stitch_free(small, 4096, 0, COMPUTE)
    assert a.stats()["deferred_frees"] == 2
    a.empty_cache()
    s = a.stats()
    assert (s["deferred_frees"], s["events_pending"], s["event_syncs"]) == (0, 0, 2)
    assert s["active_bytes"] == s["reserved_bytes"] == 0
    c, events = a.fake_counts(), a.fake_events()
    assert (c["handles"], c["ranges"], c["mappings"], c["held"], c["violations"]) == (0,) * 5
    assert (events["live"], events["syncs"], events["contexts"]) == (0, 2, 1)


def test_a_request_out_of_memory_waits_for_pending_frees_and_retries(allocator, monkeypatch):
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB)
    monkeypatch.setenv("FAKE_CUDA_CAPACITY", str(20 * MiB))
    block = a.lib.memo_stitch_try_malloc(16 * MiB, 0, COMPUTE)
    a.record_stream(block, COPY)
    a.lib.memo_stitch_free(block, 16 * MiB, 0, COMPUTE)
    # no room for another 16 MiB: rather than fail, wait for the copy stream and reuse the block
    assert a.lib.memo_stitch_try_malloc(16 * MiB, 0, COMPUTE) == block
    s = a.stats()
    assert (s["ooms"], s["event_syncs"], s["deferred_frees"]) == (0, 1, 0)
    assert a.fake_counts()["violations"] == 0 and a.last_error() == ""


def test_record_stream_and_free_refuse_what_is_not_a_live_block(allocator):
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB)
    block = a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE)
    with pytest.raises(RuntimeError, match="not a live block of this allocator"):
        a.record_stream(block + 4096, COPY)  # inside the block, not its start
    a.record_stream(block, COPY)
    a.lib.memo_stitch_free(block, 8 * MiB, 0, COMPUTE)
    with pytest.raises(RuntimeError, match="not a live block"):
        a.record_stream(block, NCCL)  # its free is pending
    a.lib.memo_stitch_free(block, 8 * MiB, 0, COMPUTE)  # a second free while pending
    assert "freed already" in a.last_error() and a.stats()["deferred_frees"] == 1
    a.lib.memo_stitch_teardown(0)  # pending events are destroyed, not waited for
    assert a.fake_events()["live"] == 0 and a.fake_counts()["violations"] == 0


def test_memory_statistics_and_peak_reset_for_device_memory(allocator):
    from memo_ext.device_memory import DeviceMemory

    a = allocator
    a.configure(frag_limit_bytes=4 * MiB)
    assert a.memory(0) == DeviceMemory(0, 0, 0, 0)  # no allocation on the device yet
    first = a.lib.memo_stitch_try_malloc(8 * MiB, 0, COMPUTE)
    second = a.lib.memo_stitch_try_malloc(6 * MiB, 0, COMPUTE)
    a.lib.memo_stitch_free(first, 8 * MiB, 0, COMPUTE)
    assert a.memory(0) == DeviceMemory(allocated=6 * MiB, reserved=14 * MiB,
                                       peak_allocated=14 * MiB, peak_reserved=14 * MiB)
    a.empty_cache()
    a.reset_peak(0)
    assert a.memory(0) == DeviceMemory(6 * MiB, 6 * MiB, 6 * MiB, 6 * MiB)
    a.lib.memo_stitch_free(second, 6 * MiB, 0, COMPUTE)


# ------------------------------------------------------------------------------ the trainer flag
TRAINER_ARGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "64", "--micro-batch-size", "2", "--lr", "1e-3",
                "--train-iters", "10", "--mock-data", "--vocab-size", "512"]


@pytest.mark.parametrize("argv, cuda, message", [
    (["--memo-stitching-allocator"], False,
     "--memo-stitching-allocator replaces the CUDA allocator and needs a GPU"),
    (["--memo-stitching-allocator", "--memo-plan", "auto"], True,
     "--memo-stitching-allocator and --memo-plan auto both replace PyTorch's CUDA allocator"),
    (["--memo-stitching-frag-limit-mib", "64"], True,
     "--memo-stitching-frag-limit-mib 64 has no effect without --memo-stitching-allocator"),
    (["--memo-stitching-allocator", "--memo-stitching-frag-limit-mib", "-1"], True,
     "--memo-stitching-frag-limit-mib -1 is negative"),
])
def test_the_stitching_flags_are_refused_with_one_line(argv, cuda, message):
    from megatron.training.arguments import ArgumentValidationError, parse_args

    with pytest.raises(ArgumentValidationError, match=message) as error:
        parse_args(TRAINER_ARGS + argv, world_size=1, cuda_available=cuda)
    assert "\n" not in str(error.value)


def test_the_trainer_flag_installs_and_registers_the_allocator(allocator, cuda_double,
                                                               monkeypatch):
    import torch

    from megatron.training.arguments import parse_args
    from megatron.training.memo import install_memo_stitching_allocator
    from memo_ext import device_memory
    from memo_ext.config import MemoConfigError

    monkeypatch.setattr(stitching_cuda, "build_library", lambda: allocator.path)
    args = parse_args(TRAINER_ARGS + ["--memo-stitching-allocator",
                                      "--memo-stitching-frag-limit-mib", "4"],
                      world_size=1, cuda_available=True)
    logs = []
    install_memo_stitching_allocator(args, log=logs.append)
    assert len(logs) == 1 and "GMLake stitching allocator installed" in logs[0], logs
    backend = device_memory.current_allocator()
    assert backend.name == "GMLake stitching allocator" and backend.path == allocator.path
    # PyTorch's allocations now reach the library, on the current stream (the NULL stream)
    address = cuda_double.allocate(8 * MiB)
    assert backend.stats()["new_pblocks"] == 1  # above the 4 MiB limit: a primitive block
    assert device_memory.device_memory(0) == device_memory.DeviceMemory(*(4 * [8 * MiB]))
    # a tensor handed to the NCCL stream: Tensor.record_stream cannot reach a pluggable
    # allocator, memo_ext.device_memory.record_stream does
    storage = (ctypes.c_uint8 * (8 * MiB)).from_address(address)
    tensor = torch.frombuffer(storage, dtype=torch.uint8)
    device_memory.record_stream(tensor, cuda_double.nccl_stream())
    assert cuda_double.dropped_record_streams == 1
    cuda_double.free(address)
    assert backend.stats()["deferred_frees"] == 1
    assert cuda_double.allocate(8 * MiB) != address
    allocator.complete_events()
    assert cuda_double.allocate(8 * MiB) == address
    # too late for a second allocator: one line naming the flag
    with pytest.raises(MemoConfigError, match="--memo-stitching-allocator: cannot install"):
        install_memo_stitching_allocator(args, log=logs.append)
    assert len(logs) == 1 and allocator.fake_counts()["violations"] == 0
