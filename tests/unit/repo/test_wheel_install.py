"""A non-editable install works without the checkout: the wheel built from this repository,
installed into a fresh venv that sees the dependencies of .venv but not the repository nor the
editable install, runs every console script from a directory outside the repository, loads
memo_ext._C from the wheel, and builds the CUDA stitching allocator from the sources the wheel
ships into a user cache directory.

Offline: the wheel is built with --no-build-isolation (this process's setuptools and pybind11)
and installed with --no-index --no-deps; the dependencies (torch, megatron-core, pulp, ...) are
.venv's, made visible through a .pth file naming a directory of links to .venv's site-packages
that leaves out this project's editable finder, its .pth files and its dist-info. Slow (about
a minute and a half on 2 cores, most of it compiling memo_ext._C).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

#: Entries of .venv's site-packages that belong to this project's editable install.
EDITABLE_INSTALL = re.compile(r"^(__editable__.*|megatron_memo-.*|.*\.pth)$")
#: tests/unit/memo_ext/planner/test_planner.py's small traced model (seconds on fake tensors).
TRACE_ARGS = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "256", "--vocab-size", "512",
              "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2",
              "--use-distributed-optimizer"]


@dataclass
class Installed:
    """The fresh venv (``python``, its ``bin`` and ``site_packages``), the environment to run
    it in (XDG_CACHE_HOME under ``cache``) and a working directory outside the repository."""

    python: Path
    bin: Path
    site_packages: Path
    cache: Path
    work: Path
    env: dict

    def run(self, *argv, timeout: float = 300) -> str:
        """stdout of ``argv`` run in ``work``; fails the test on a non-zero exit."""
        done = subprocess.run([str(a) for a in argv], cwd=self.work, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stderr[-4000:]}"
        return done.stdout


def _check(command: list, cwd: Path, env: dict | None = None, timeout: float = 600) -> None:
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("wheel_install")
    # Build from a copy of the tracked and unignored files: an in-tree build would reuse (and
    # ship) whatever a previous build left in the checkout's build/.
    source = root / "source"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO_ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, source / name)
    dist = root / "dist"
    _check([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--no-index", "-q", "-w", dist, source], cwd=root)
    wheel, = dist.glob("megatron_memo-*.whl")

    venv = root / "venv"
    _check([sys.executable, "-m", "venv", venv], cwd=root)
    python = venv / "bin" / "python"
    site_packages = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    deps = root / "deps"
    deps.mkdir()
    for our_site in site.getsitepackages():
        for entry in Path(our_site).iterdir():
            if not EDITABLE_INSTALL.match(entry.name) and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    (site_packages / "memo_test_deps.pth").write_text(f"{deps}\n")

    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MEMO_ESTIMATE_CACHE")}
    env.update(XDG_CACHE_HOME=str(root / "cache"), OMP_NUM_THREADS="1")
    _check([python, "-m", "pip", "install", "--no-index", "--no-deps", "-q",
            "--disable-pip-version-check", wheel], cwd=root, env=env)
    work = root / "work"
    work.mkdir()
    return Installed(python, venv / "bin", site_packages, root / "cache", work, env)


def test_the_installed_modules_come_from_the_wheel(installed):
    report = json.loads(installed.run(installed.python, "-c", """if True:
        import importlib.metadata, json, sys
        import megatron.core, megatron.memo_tools.cli.trace, megatron.training.gpt, memo_ext
        import memo_ext._C, pretrain_gpt
        from memo_ext.alloc import stitching_cuda
        from memo_ext.estimate.trace_key import tracer_files
        print(json.dumps({
            "files": {m.__name__: m.__file__ for m in (
                memo_ext, memo_ext._C, megatron.memo_tools.cli.trace, megatron.training.gpt,
                pretrain_gpt)},
            "core": megatron.core.__file__,
            "dists": [str(d.locate_file("")) for d in
                      importlib.metadata.distributions(name="megatron-memo")],
            "finders": [type(f).__module__ for f in sys.meta_path],
            "path": sys.path,
            "tracer_sources": [str(p) for p in tracer_files().values()],
            "stitching": [str(p) for p in (stitching_cuda.SOURCE, *stitching_cuda.HEADERS)],
            "stitching_build_dir": str(stitching_cuda.DEFAULT_BUILD_DIR)}))
        """))
    ours = installed.site_packages.resolve()
    for name, file in report["files"].items():
        assert Path(file).resolve().is_relative_to(ours), (name, file)
    dependencies = Path(site.getsitepackages()[0]).resolve()
    assert Path(report["core"]).resolve().is_relative_to(dependencies)
    assert [Path(d).resolve() for d in report["dists"]] == [ours]
    assert not any("__editable__" in finder for finder in report["finders"])
    # "" (the working directory) and relative entries are the child's, in ``work``.
    assert not any((installed.work / p).resolve() == REPO_ROOT for p in report["path"])
    # The trace cache key hashes the installed tracer's files, not the checkout's.
    assert len(report["tracer_sources"]) > 50, report  # the tracer's import graph
    assert all(Path(p).resolve().is_relative_to(ours) for p in report["tracer_sources"]), report
    assert all(Path(p).is_file() and Path(p).resolve().is_relative_to(ours)
               for p in report["stitching"]), report["stitching"]
    assert Path(report["stitching_build_dir"]).is_relative_to(
        installed.cache / "megatron-memo" / "stitching_cuda")


def test_console_scripts_run_outside_the_checkout(installed):
    run, bin_, work = installed.run, installed.bin, installed.work
    out = run(bin_ / "memo-trace", *TRACE_ARGS, "-o", "trace.jsonl.gz")
    assert out.startswith("trace: custom model, seq 256, TP=2 CP=1 PP=1 DP=1, rank 0"), out
    assert re.search(r"^events: \d+ \(\d+ allocs, \d+ frees\) -> trace.jsonl.gz$", out, re.M)

    out = run(bin_ / "memo-plan", "--trace", "trace.jsonl.gz", "-o", "plan.json")
    assert re.search(r"^plan peak \d+ lower bound \d+ gap \d+\.\d\d%$", out.splitlines()[-1])
    out = run(bin_ / "memo-plan", "--trace", "trace.jsonl.gz", "--check", "plan.json")
    assert out.startswith("plan.json: valid for trace.jsonl.gz"), out

    out = run(bin_ / "memo-memory-report", "trace.jsonl.gz", "--policies", "caching,arena",
              "--capacity-gb", "1", "--plan", "plan.json")
    assert re.match(r"trace trace.jsonl.gz: \d+ events, \d+ allocations, 1 stream", out), out
    assert "### policy arena (capacity 1.00 GiB)" in out
    assert re.search(r"planned \d+, fallbacks 0", out), out

    (work / "tiny.json").write_text(json.dumps({"num_layers": 2, "hidden_size": 64,
                                                "num_attention_heads": 4, "vocab_size": 512}))
    out = run(bin_ / "memo-estimate", "--model", "tiny.json", "--gpu", "a100-40gb",
              "--seq-length", "131072", "--cache-dir", "traces")
    assert re.search(r"^seq 131072: peak .* GiB per rank: FITS$", out, re.M), out
    assert re.search(r"^  predicted MFU \d+\.\d%", out, re.M), out
    assert len(list((work / "traces").glob("*.jsonl.gz"))) == 2  # the two fitted lengths

    out = run(bin_ / "memo-sppo-plan", "--model", "7b", "--gpus", "8", "--gpu", "a100-80gb",
              "--seq-length", "256K")
    assert out.startswith("7b at 262144 tokens on 8 x a100-80gb"), out
    assert re.search(r"^  layout: TP/SP \d+, PP \d+, DP \d+, N \d+ subsequences", out, re.M)

    done = subprocess.run([str(bin_ / "memo-gpu-check")], cwd=work, env=installed.env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("gpu-check: no CUDA GPU"), done


def test_stitching_allocator_builds_from_the_packaged_sources(installed):
    """build_library() of the installed package compiles the sources the wheel carries (their
    relative #include intact) into $XDG_CACHE_HOME, not into site-packages."""
    from memo_ext.alloc import stitching_cuda

    try:
        stitching_cuda.cuda_home()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    if shutil.which("g++") is None and not os.environ.get("CXX"):
        pytest.skip("no C++ compiler (g++ or $CXX)")
    library = Path(installed.run(installed.python, "-c",
                                 "from memo_ext.alloc import stitching_cuda; "
                                 "print(stitching_cuda.build_library(optimize='-O0'))").strip())
    assert library.is_file() and library.name == "libmemo_stitching_cuda.so"
    assert library.is_relative_to(installed.cache / "megatron-memo" / "stitching_cuda")
