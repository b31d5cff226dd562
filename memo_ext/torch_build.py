"""Compiler and linker flags for C++ that throws PyTorch's own errors (csrc/torch_errors.h).

The planned arena's allocator hooks (memo_ext._C, built by setup.py) and the CUDA stitching
allocator (built by memo_ext.alloc.stitching_cuda on the machine that uses it) report an
out-of-memory request by throwing ``c10::OutOfMemoryError``, which PyTorch's Python layer
raises as ``torch.OutOfMemoryError``. That needs c10's headers (``torch/include``) and its
library (``torch/lib/libc10.so``) from the torch installed where the code is built: the one
it runs with, since the library and its rpath name it. Loaded by path from setup.py (this
package is not importable there yet), so it imports nothing of memo_ext.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["torch_dirs", "compile_flags", "link_flags"]


def torch_dirs() -> tuple[Path, Path]:
    """(include directory, library directory) of the installed torch. Raises RuntimeError
    naming the fix when torch, or its C++ headers, are not there."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "building MEMO's allocator hooks needs torch's C++ headers: install the pinned torch "
            "first (pip install torch==<pin from pyproject.toml>), then build this package with "
            "--no-build-isolation (pip's isolated build environment has no torch)")
    root = Path(next(iter(spec.submodule_search_locations)))
    include, lib = root / "include", root / "lib"
    if not (include / "c10" / "util" / "Exception.h").is_file():
        raise RuntimeError(f"{include} has no c10/util/Exception.h: this torch installation "
                           "ships no C++ headers")
    return include, lib


def _cxx11_abi() -> int:
    """The libstdc++ string ABI torch was built with (c10::Error holds std::strings, so ours
    must match). Importing torch costs seconds; only the build pays it."""
    import torch

    return int(torch._C._GLIBCXX_USE_CXX11_ABI)


def compile_flags() -> list[str]:
    """-isystem (c10's own warnings are not ours: the CUDA sources build with -Werror) and the
    string ABI."""
    include, _ = torch_dirs()
    return ["-isystem", str(include), f"-D_GLIBCXX_USE_CXX11_ABI={_cxx11_abi()}"]


def link_flags(origin_relative: str | None = None) -> list[str]:
    """Link libc10 with an rpath to it: torch's library directory as installed now, and, when
    ``origin_relative`` is given, that path relative to the library's own directory ($ORIGIN),
    which follows a wheel into another environment."""
    _, lib = torch_dirs()
    rpaths = ([f"-Wl,-rpath,$ORIGIN/{origin_relative}"] if origin_relative else []) + [
        f"-Wl,-rpath,{lib}"]
    return [f"-L{lib}", "-lc10", *rpaths]
