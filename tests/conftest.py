"""Shared test helpers: launching pretrain_gpt.py under torchrun on loopback and reading the
metrics it writes."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
SNAPSHOTS = SHARED_DATA / "snapshots"
MEMORY_REPORT = REPO_ROOT / "tools" / "memory_report.py"
PRETRAIN_GPT = REPO_ROOT / "pretrain_gpt.py"

def load_script(path: Path, name: str):
    """Import a script that is not in a package (bench/*.py, examples/*.py) as module ``name``,
    registered in sys.modules before it runs: its dataclasses look their module up there."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# A model small enough for 2-4 CPU processes to run 20 iterations in ~10-25 s.
TINY_GPT_ARGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--train-iters", "20", "--mock-data", "--vocab-size", "512",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]


def pytest_addoption(parser):
    parser.addoption(
        "--slow-slice", metavar="K/N", default=None, type=parse_slow_slice,
        help="of the slow tests selected, keep only slice K of N (0 <= K < N, by a stable hash "
             "of the node id; the N slices partition them); other tests are not affected. "
             "Use with -m slow (tests/README.md, \"Slow tests in CI\").")


def parse_slow_slice(text: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N), 0 <= K < N; anything else is a usage error."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--slow-slice wants K/N (two integers), not {text!r}") from None
    if not 0 <= k < n:
        raise pytest.UsageError(f"--slow-slice {text}: K must be in 0..N-1")
    return k, n


def slow_slice(nodeid: str, n: int) -> int:
    """The slice, 0..n-1, a test belongs to: a hash of its node id that neither the Python
    process (hash() is salted) nor the collection order changes."""
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:8], "big") % n


def pytest_collection_modifyitems(config, items):
    chosen = config.getoption("--slow-slice", default=None)
    if chosen is not None:
        k, n = chosen
        dropped = [item for item in items
                   if "slow" in item.keywords and slow_slice(item.nodeid, n) != k]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            keep = set(map(id, items)) - set(map(id, dropped))
            items[:] = [item for item in items if id(item) in keep]
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def subprocess_env() -> dict:
    """The environment for launched processes, without any rendezvous variables this process
    may carry (they would point a child at a port that is not its own)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                          "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_torchrun(nproc: int, args: list[str], timeout: float = 300, check: bool = True,
                 script: Path = PRETRAIN_GPT) -> subprocess.CompletedProcess:
    """Run pretrain_gpt.py (or another trainer ``script``) under torchrun (standalone
    rendezvous on a free loopback port)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(script), *args,
    ]
    launcher = subprocess.Popen(command, cwd=REPO_ROOT, env=subprocess_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    except BaseException:  # a timeout, pytest-timeout, or an interrupt (CI's slow-slice budget)
        stop_launcher(launcher)
        raise
    result = subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(
            f"torchrun exited {result.returncode}\nstdout:\n{result.stdout[-4000:]}\n"
            f"stderr:\n{result.stderr[-6000:]}"
        )
    return result


def stop_launcher(launcher: subprocess.Popen, grace: float = 60) -> None:
    """Stop a torchrun launcher and its ranks. SIGTERM first: torchrun passes it on to the ranks,
    which run in sessions of their own and so would outlive a SIGKILLed torchrun; SIGKILL if
    it has not ended ``grace`` seconds later."""
    if launcher.poll() is not None:
        return
    launcher.terminate()
    try:
        launcher.communicate(timeout=grace)  # drains its pipes, if any, while it shuts down
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.communicate()


_TRAINING_LOSSES: dict[tuple, dict[int, float]] = {}


def _canonical_flags(args: list[str]) -> tuple:
    """``args`` as sorted (flag, value) pairs, the last of a repeated flag winning as in
    argparse: two spellings of one command line (flags in another order) give one key."""
    flags: dict[str, tuple] = {}
    index = 0
    while index < len(args):
        flag, index = args[index], index + 1
        values = []
        while index < len(args) and not args[index].startswith("--"):
            values.append(args[index])
            index += 1
        flags[flag] = tuple(values)
    return tuple(sorted(flags.items()))


def training_losses(nproc: int, args: list[str], tmp_path_factory,
                    script: Path = PRETRAIN_GPT) -> dict[int, float]:
    """iteration -> lm loss of pretrain_gpt.py (or ``script``) ``args`` on ``nproc`` ranks, run
    once per session for each distinct command line (the tests that compare against the same
    deterministic baseline share its run)."""
    key = (nproc, str(script), _canonical_flags(args))
    if key not in _TRAINING_LOSSES:
        metrics = tmp_path_factory.mktemp("baseline") / "metrics.jsonl"
        run_torchrun(nproc, [*args, "--log-metrics-jsonl", str(metrics)], script=script)
        _TRAINING_LOSSES[key] = read_losses(metrics)
    return _TRAINING_LOSSES[key]


def read_losses(metrics_path: Path) -> dict[int, float]:
    """iteration -> training lm loss from a --log-metrics-jsonl file."""
    losses = {}
    for line in metrics_path.read_text().splitlines():
        record = json.loads(line)
        if "lm_loss" in record:
            losses[record["iteration"]] = record["lm_loss"]
    return losses


def read_records(metrics_path: Path) -> list[dict]:
    return [json.loads(line) for line in metrics_path.read_text().splitlines()]


def snapshot_path(name: str) -> Path:
    """A real snapshot of shared/data/snapshots; skips the test where that folder is absent."""
    path = SNAPSHOTS / name
    if not path.is_file():
        pytest.skip(f"real snapshot {path} is absent (no shared/data/snapshots beside the repo)")
    return path


def run_memory_report(*args) -> subprocess.CompletedProcess:
    """tools/memory_report.py with ``args`` in a subprocess (text output captured)."""
    return subprocess.run([sys.executable, str(MEMORY_REPORT), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def run_estimate_cli(argv: list[str]) -> tuple[int, str]:
    """memo-estimate's main(argv) in this process: (exit code, stdout)."""
    import io
    from contextlib import redirect_stdout

    from megatron.memo_tools.cli import estimate

    out = io.StringIO()
    with redirect_stdout(out):
        code = estimate.main(argv)
    return code, out.getvalue()


def initialized_megatron(cuda_available: bool):
    """megatron initialised in this process (one rank, TINY_GPT_ARGS) for a with-block or a
    generator fixture; torn down after."""
    from megatron.core import parallel_state

    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron

    initialize_megatron(parse_args(TINY_GPT_ARGS, world_size=1, cuda_available=cuda_available))
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def megatron_world():
    """megatron initialised in this process: one rank, gloo, CPU (tests/unit in-process models)."""
    yield from initialized_megatron(cuda_available=False)


@pytest.fixture
def cuda_double(monkeypatch):
    """torch.cuda answered by tests/cuda_double.py's CudaDouble (one 80 GiB device) for the test;
    any allocator registered with memo_ext.device_memory is forgotten afterwards."""
    from memo_ext import device_memory
    from tests.cuda_double import CudaDouble

    double = CudaDouble().install(monkeypatch)
    yield double
    device_memory.unregister_allocator()


@pytest.fixture
def cudnn_attention_double(monkeypatch):
    """cuDNN's fused attention ops answered on CPU by tests/cuda_double.py's
    CudnnAttentionDouble for the test (kernels registered, then dropped); the process's
    --attention-backend is restored afterwards."""
    from memo_ext.attention import kernels
    from tests.cuda_double import CudnnAttentionDouble

    backend = kernels.attention_backend()
    double = CudnnAttentionDouble().install(monkeypatch)
    yield double
    double.uninstall()
    kernels.set_attention_backend(backend)


@pytest.fixture(scope="session")
def fake_cuda_runtime(tmp_path_factory) -> Path:
    """csrc/standalone/fake_cuda_runtime.c built as libcudart.so.13 (a CUDA 13 runtime's name),
    not loaded."""
    import shutil

    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc/cc) to build the fake CUDA runtime")
    library = tmp_path_factory.mktemp("fake_cudart") / "libcudart.so.13"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library),
                    str(REPO_ROOT / "csrc" / "standalone" / "fake_cuda_runtime.c")],
                   check=True, capture_output=True, timeout=120)
    return library


@pytest.fixture(scope="session")
def loaded_fake_cuda_runtime(fake_cuda_runtime):
    """The fake runtime loaded into this process as PyTorch loads its own: RTLD_LOCAL, so its
    symbols are not in the global scope. Never unloaded (the arena's hooks cache its symbols)."""
    import ctypes

    return ctypes.CDLL(str(fake_cuda_runtime), mode=ctypes.RTLD_LOCAL)


def trace_request(argv: list, seq: int):
    """The typed trace request (memo_ext.trace.request.TraceRequest) of a tools/trace.py
    command line at ``seq`` tokens: tests write small layouts as the command line a user types."""
    from megatron.memo_tools.cli.trace import request_from_argv

    return request_from_argv([*argv, "--seq-length", str(seq)])
