"""The CUDA-facing sources compiled by nvcc, so that a type or syntax error surfaces on a
machine without a GPU: csrc/cuda/check_runtime_subset.cu checks the planned arena's CUDA runtime
signatures and constants (csrc/cuda_runtime_subset.h) against the toolkit's cuda_runtime_api.h,
and the GMLake stitching backend (csrc/cuda/stitching_cuda.cpp) builds through nvcc against the
toolkit's cuda.h (and torch's c10, whose out-of-memory error its alloc hook throws). Compiling says nothing about running on a GPU (tests/gpu/ is for that)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import REPO_ROOT


def _nvcc() -> str:
    """nvcc on PATH, else in the toolkit the stitching backend builds against."""
    from memo_ext.alloc.stitching_cuda import cuda_home

    found = shutil.which("nvcc")
    if found:
        return found
    try:
        candidate = cuda_home() / "bin" / "nvcc"
    except RuntimeError as exc:
        pytest.skip(f"nvcc not found on PATH and {exc}")
    if not os.access(candidate, os.X_OK):
        pytest.skip(f"nvcc not found (PATH, {candidate}): install the CUDA toolkit to compile "
                    "the CUDA sources")
    return str(candidate)


def _compile(arguments: list[str]) -> None:
    result = subprocess.run([_nvcc(), "-std=c++17", "-Xcompiler", "-Wall,-Wextra,-Werror",
                             *arguments], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_arena_runtime_subset_matches_the_toolkits_cuda_runtime_api(tmp_path):
    _compile(["-c", str(REPO_ROOT / "csrc" / "cuda" / "check_runtime_subset.cu"),
              "-o", str(tmp_path / "check.o")])


def test_stitching_backend_builds_with_nvcc(tmp_path):
    from memo_ext import torch_build

    _, torch_lib = torch_build.torch_dirs()
    _compile(["-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden",
              f"-I{REPO_ROOT / 'csrc'}", *torch_build.compile_flags(),
              str(REPO_ROOT / "csrc" / "cuda" / "stitching_cuda.cpp"),
              "-o", str(tmp_path / "libmemo_stitching_cuda.so"), "-ldl", f"-L{torch_lib}",
              "-lc10"])
