"""GMLake stitching on the GPU: build ``csrc/cuda/stitching_cuda.cpp`` (the allocator core of
csrc/stitching_allocator.h over cuMemCreate / cuMemAddressReserve / cuMemMap / cuMemSetAccess /
cuMemUnmap / cuMemRelease) and install it as PyTorch's CUDA allocator through
``torch.cuda.memory.CUDAPluggableAllocator``, without rebuilding PyTorch.

    from memo_ext.alloc.stitching_cuda import install
    stitching = install(frag_limit_bytes=128 << 20)  # before the first CUDA tensor
    ...
    print(stitching.stats())

The trainer installs it with ``--memo-stitching-allocator`` (megatron.training.memo). Once
installed, PyTorch's memory statistics raise and ``Tensor.record_stream`` does nothing (the
Python API cannot set a pluggable allocator's record-stream hook): read memory and hand tensors
to other streams through :mod:`memo_ext.device_memory`, with which :func:`install` registers it.

The library is compiled with the host C++ compiler against the CUDA toolkit's ``cuda.h`` (the
driver is opened at run time) and the installed torch's c10 (memo_ext.torch_build: its alloc
hook throws ``c10::OutOfMemoryError``, which PyTorch raises as ``torch.OutOfMemoryError``), on
the machine that uses it. Status: exercised on a CPU
machine against a fake driver (tests/unit/memo_ext/alloc/test_stitching_cuda_backend.py); the GPU test
(tests/gpu/test_stitching_cuda.py) has not run in this project. See docs/stitching.md.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from memo_ext import torch_build

__all__ = ["CudaStitchingAllocator", "build_library", "cuda_home", "install"]

REPO_ROOT = Path(__file__).resolve().parents[2]
#: csrc/ of a checkout, else the copy an installed package carries (setup.py's build_py puts it
#: in memo_ext/alloc/_csrc/, in csrc/'s layout).
CSRC = (REPO_ROOT / "csrc" if (REPO_ROOT / "csrc" / "cuda" / "stitching_cuda.cpp").is_file()
        else Path(__file__).resolve().with_name("_csrc"))
SOURCE = CSRC / "cuda" / "stitching_cuda.cpp"
HEADERS = tuple(CSRC / name for name in (
    "stitching_allocator.h", "stitching_rules.h", "caching_rules.h", "torch_errors.h"))
LIBRARY_NAME = "libmemo_stitching_cuda.so"


def _default_build_dir() -> Path:
    """build/stitching_cuda/ of a writable checkout; otherwise (an installed package, whose
    directory may be read-only) $XDG_CACHE_HOME/megatron-memo/stitching_cuda/<sources hash>,
    default ~/.cache: one directory per version of the sources, so installs that share the
    cache never load each other's library."""
    if CSRC == REPO_ROOT / "csrc" and os.access(REPO_ROOT, os.W_OK):
        return REPO_ROOT / "build" / "stitching_cuda"
    digest = hashlib.sha256()
    for path in (SOURCE, *HEADERS):
        digest.update(path.read_bytes() if path.is_file() else b"")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "megatron-memo" / "stitching_cuda" / digest.hexdigest()[:16]


DEFAULT_BUILD_DIR = _default_build_dir()


def cuda_home(explicit: str | os.PathLike | None = None) -> Path:
    """The CUDA toolkit directory holding include/cuda.h: ``explicit``, $CUDA_HOME, $CUDA_PATH,
    torch's CUDA_HOME, or /usr/local/cuda. Raises RuntimeError when none has it."""
    candidates = [explicit, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    try:
        from torch.utils.cpp_extension import CUDA_HOME
        candidates.append(CUDA_HOME)
    except ImportError:  # torch is optional for building
        pass
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "include" / "cuda.h").is_file():
            return Path(c)
    raise RuntimeError("no CUDA toolkit with include/cuda.h found: set CUDA_HOME to the toolkit "
                       "directory (tried " + ", ".join(str(c) for c in candidates if c) + ")")


def build_library(out_dir: str | os.PathLike | None = None, *,
                  cuda_home_dir: str | os.PathLike | None = None,
                  cxx: str | None = None, force: bool = False, optimize: str = "-O3") -> Path:
    """Compile the CUDA stitching allocator into ``out_dir``/libmemo_stitching_cuda.so (default
    DEFAULT_BUILD_DIR) and return its path. Skips the build when the
    library is newer than its sources, unless ``force``. cxx: the compiler ($CXX, else g++);
    optimize: its optimisation flag.
    Raises RuntimeError naming what is missing or the compiler's error."""
    out = Path(out_dir) if out_dir is not None else DEFAULT_BUILD_DIR
    lib = out / LIBRARY_NAME
    newest = max(p.stat().st_mtime for p in (SOURCE, *HEADERS))
    if lib.is_file() and lib.stat().st_mtime >= newest and not force:
        return lib
    compiler = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found: install g++ or set CXX")
    include = cuda_home(cuda_home_dir) / "include"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{LIBRARY_NAME}.{os.getpid()}"
    # c10 (the torch this process runs): the alloc hook throws PyTorch's out-of-memory error
    cmd = [compiler, "-std=c++17", optimize, "-shared", "-fPIC", "-fvisibility=hidden",
           f"-I{CSRC}", f"-I{include}", *torch_build.compile_flags(), str(SOURCE), "-o",
           str(tmp), "-ldl", *torch_build.link_flags()]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building {SOURCE} failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    os.replace(tmp, lib)  # atomic: a concurrent loader never sees half a file
    return lib


class CudaStitchingAllocator:
    """The installed (or merely loaded) library: statistics, cache control and stream uses per
    device; the :class:`memo_ext.device_memory.AllocatorBackend` of the process once
    :func:`install` registered it."""

    name = "GMLake stitching allocator"

    def __init__(self, library: str | os.PathLike, pluggable=None):
        self.path = Path(library)
        self.lib = ctypes.CDLL(str(self.path))
        self.lib.memo_stitch_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                                               ctypes.c_int]
        self.lib.memo_stitch_stat_names.restype = ctypes.c_char_p
        self.lib.memo_stitch_last_error.restype = ctypes.c_char_p
        self.lib.memo_stitch_configure.argtypes = [ctypes.c_int64] * 3
        # memo_stitch_malloc raises (a C++ exception: PyTorch's out-of-memory error) and is for
        # PyTorch alone; ctypes callers use memo_stitch_try_malloc, which answers null instead
        for name in ("memo_stitch_malloc", "memo_stitch_try_malloc"):
            getattr(self.lib, name).restype = ctypes.c_void_p
            getattr(self.lib, name).argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.lib.memo_stitch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                                              ctypes.c_void_p]
        self.lib.memo_stitch_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.memo_stitch_record_stream.restype = ctypes.c_int
        for fn in (self.lib.memo_stitch_empty_cache, self.lib.memo_stitch_reset_peak,
                   self.lib.memo_stitch_teardown):
            fn.argtypes = [ctypes.c_int]
            fn.restype = None
        self.pluggable = pluggable  # keeps PyTorch's allocator object alive

    def configure(self, frag_limit_bytes: int | None = None, max_sblocks: int | None = None,
                  capacity_bytes: int | None = None) -> None:
        """Options for the per-device allocators (None: the default: 128 MiB, 1024,
        unlimited). Raises RuntimeError once an allocator exists."""
        args = [-1 if v is None else int(v) for v in (frag_limit_bytes, max_sblocks,
                                                     capacity_bytes)]
        if self.lib.memo_stitch_configure(*args) != 0:
            raise RuntimeError("the stitching allocator already serves a device: configure it "
                               "before the first CUDA allocation")

    def stats(self, device: int = 0) -> dict:
        """Counters of ``device`` (bytes, counts; map_nanoseconds): {} before its first
        allocation. Stream safety: deferred_frees / deferred_bytes are the blocks (and their
        bytes, still counted in active_bytes) whose free waits for another stream's events,
        events_pending the events not yet seen complete, events_recorded and event_syncs
        (cuEventSynchronize waits) counts since the allocator was created."""
        names = self.lib.memo_stitch_stat_names().decode().split(",")
        buf = (ctypes.c_int64 * len(names))()
        n = self.lib.memo_stitch_stats(device, buf, len(names))
        return dict(zip(names[:n], buf[:n]))

    def empty_cache(self, device: int = 0) -> None:
        """Wait for the frees deferred for other streams, then drop unused stitched blocks and
        release free physical memory of ``device`` (torch.cuda.empty_cache() does not reach a
        pluggable allocator)."""
        self.lib.memo_stitch_empty_cache(device)

    # memo_ext.device_memory.AllocatorBackend
    def memory(self, device: int):
        """``device``'s :class:`~memo_ext.device_memory.DeviceMemory` (bytes): allocated = the
        active blocks' bytes (a block whose free waits for another stream still counts),
        reserved = physical memory held; all 0 before the device's first allocation."""
        from memo_ext.device_memory import DeviceMemory

        s = self.stats(device)
        return DeviceMemory(allocated=s.get("active_bytes", 0),
                            reserved=s.get("reserved_bytes", 0),
                            peak_allocated=s.get("peak_active_bytes", 0),
                            peak_reserved=s.get("peak_reserved_bytes", 0))

    def reset_peak(self, device: int) -> None:
        """Peak active and reserved bytes of ``device`` back to their current values."""
        self.lib.memo_stitch_reset_peak(device)

    def record_stream(self, data_ptr: int, stream_handle: int) -> None:
        """The block starting at ``data_ptr`` (a storage's data_ptr) is used by the stream
        ``stream_handle`` (a cudaStream_t as an int; 0 is the NULL stream) too: its free will
        wait for the work queued there until the free. Its allocation stream is ignored.
        Raises RuntimeError when no live block of this allocator starts at ``data_ptr``."""
        if self.lib.memo_stitch_record_stream(data_ptr, stream_handle) != 0:
            raise RuntimeError(f"{self.name}: record_stream({data_ptr:#x}, "
                               f"{stream_handle:#x}): {self.last_error()}")

    def last_error(self) -> str:
        return self.lib.memo_stitch_last_error().decode()


def install(frag_limit_bytes: int | None = None, max_sblocks: int | None = None,
            capacity_bytes: int | None = None,
            library: str | os.PathLike | None = None) -> CudaStitchingAllocator:
    """Build (if needed) and install the stitching allocator as the process's CUDA allocator.

    Must run before the first CUDA allocation (PyTorch refuses to change an allocator in use).
    frag_limit_bytes: requests below it take the embedded caching path (default 128 MiB);
    max_sblocks: stitched blocks cached (default 1024); capacity_bytes: physical memory it may
    hold (default: whatever cuMemCreate gives). library: a prebuilt .so (default:
    :func:`build_library`). Registers the allocator with :mod:`memo_ext.device_memory` (the
    source of memory statistics and record_stream from then on). Raises RuntimeError without
    CUDA or when too late.
    """
    import torch

    from memo_ext.device_memory import register_allocator

    if not torch.cuda.is_available():
        raise RuntimeError("install() needs CUDA: this process sees no GPU")
    path = Path(library) if library is not None else build_library()
    handle = CudaStitchingAllocator(path)
    handle.configure(frag_limit_bytes, max_sblocks, capacity_bytes)
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(str(path), "memo_stitch_malloc",
                                                         "memo_stitch_free")
    torch.cuda.memory.change_current_allocator(pluggable)
    handle.pluggable = pluggable
    register_allocator(handle)
    return handle
