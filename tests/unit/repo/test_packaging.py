"""What a non-editable `pip install .` carries, checked on the build tree alone (setuptools'
build_py, no compiler, a few seconds): every console script's module, the trainer's entry
script that memo-gpu-check launches and the module the tracer builds its model with, the
tracer the estimator spawns, the JSON tables the code reads (GPU profiles, kernel tables), and
the CUDA stitching allocator's sources with the headers they include. The slow
test_wheel_install.py builds the wheel, installs it into a fresh venv and runs each command."""
from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.conftest import REPO_ROOT, subprocess_env


def test_the_build_carries_what_an_installed_package_runs(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                   cwd=REPO_ROOT, env=subprocess_env(), check=True, capture_output=True,
                   timeout=300)
    sources = tmp_path / "memo_ext" / "alloc" / "_csrc"
    for name in ("cuda/stitching_cuda.cpp", "stitching_allocator.h", "stitching_rules.h",
                 "caching_rules.h"):
        assert (sources / name).is_file(), name
    for data in ("memo_ext/hardware.json", "memo_ext/estimate/kernel_tables.json",
                 "memo_ext/estimate/measured_kernels.json"):  # package data the code reads
        assert (tmp_path / data).is_file(), data
    from memo_ext.estimate.memory import TRACE_MODULE

    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"memo-estimate", "memo-trace", "memo-plan", "memo-memory-report",
            "memo-sppo-plan", "memo-gpu-check"} <= set(scripts)
    modules = {target.split(":")[0] for target in scripts.values()}
    modules |= {TRACE_MODULE, "pretrain_gpt", "megatron.training.gpt"}
    for module in modules:
        path = tmp_path.joinpath(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module
