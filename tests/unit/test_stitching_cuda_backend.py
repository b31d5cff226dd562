"""The CUDA backend of the stitching allocator (csrc/cuda/stitching_cuda.cpp), built by
memo_ext.alloc.stitching_cuda and driven through its CUDAPluggableAllocator hooks, on a machine
without a GPU: the driver's nine virtual-memory calls come from csrc/standalone/fake_cuda_driver.cpp
(host memfd/mmap, enforcing the rules the CUDA documentation states for those calls). This checks
the backend's bookkeeping of 2 MiB chunks, mappings and releases, and that stitched pointers
alias the right memory; it says nothing about a real GPU (tests/gpu/test_stitching_cuda.py)."""
import ctypes
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from memo_ext.alloc import stitching_cuda

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


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
    counts = (ctypes.c_longlong * 6)()

    def fake_counts():
        driver.fake_cuda_counts(counts)
        return dict(zip(("handles", "ranges", "mappings", "held", "creates", "violations"),
                        counts))

    a.fake_counts = fake_counts
    yield a
    a.lib.memo_stitch_teardown(0)


def test_stitched_pointer_aliases_the_chunks_through_the_cuda_hooks(allocator):
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB)
    first = a.lib.memo_stitch_malloc(8 * MiB, 0, None)
    assert first and a.stats()["new_pblocks"] == 1
    a.lib.memo_stitch_free(first, 8 * MiB, 0, None)
    block = a.lib.memo_stitch_malloc(14 * MiB, 0, None)  # 8 MiB + a new 6 MiB, stitched
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
            ptr = a.lib.memo_stitch_malloc(size, 0, stream)
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


def test_out_of_device_memory_reorganises_then_returns_null(allocator, monkeypatch):
    a = allocator
    a.configure(frag_limit_bytes=4 * MiB)
    monkeypatch.setenv("FAKE_CUDA_CAPACITY", str(30 * MiB))
    p = a.lib.memo_stitch_malloc(20 * MiB, 0, None)
    a.lib.memo_stitch_free(p, 20 * MiB, 0, None)
    q = a.lib.memo_stitch_malloc(24 * MiB, 0, ctypes.c_void_p(1))  # another stream
    assert q and a.stats()["reorganisations"] == 1  # the cached 20 MiB went back first
    assert a.lib.memo_stitch_malloc(40 * MiB, 0, None) is None
    assert "out of memory" in a.last_error() and a.stats()["ooms"] == 1
    assert a.fake_counts()["violations"] == 0
    with pytest.raises(RuntimeError, match="before the first CUDA allocation"):
        a.configure(frag_limit_bytes=8 * MiB)
