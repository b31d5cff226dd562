"""Shared test helpers: launching pretrain_gpt.py's ranks on loopback as torchrun would and
reading the metrics it writes."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.gloo_ranks import free_port

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


def run_trainer(nproc: int, args: list[str], timeout: float = 300, check: bool = True,
                script: Path = PRETRAIN_GPT) -> subprocess.CompletedProcess:
    """Run pretrain_gpt.py (or another trainer ``script``) on ``nproc`` ranks on this machine,
    each started as ``torchrun --standalone`` starts its workers (``python -u script args``
    with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and a free loopback
    MASTER_PORT; rank 0's init_process_group serves the store) but without torchrun's own
    process, which imports torch only to start them: 2.6 s a launch on 2 cores, about a
    minute and a half of the default suite. The tests of the launch itself use torchrun
    (test_determinism_and_resume.py's SIGTERM, test_long_context_peak_rss.py, the examples).

    As under torchrun, a rank that fails ends the run: the others are given ``grace`` seconds
    to end on their own (a rank blocked in a collective fails once its peer is gone) and are
    then stopped. The result's stdout and stderr are the ranks' own, rank 0 first; its return
    code is 0, or 1 when a rank failed (torchrun's)."""
    with tempfile.TemporaryDirectory(prefix="ranks_") as logs:
        port = free_port()
        ranks = [_start_rank(rank, nproc, port, script, args, Path(logs))
                 for rank in range(nproc)]
        try:
            failed = _wait_for_ranks(ranks, timeout)
        except BaseException:  # a timeout, pytest-timeout, or an interrupt (CI's slow-slice budget)
            stop_ranks(ranks)
            raise
        stdout, stderr = ("".join((Path(logs) / f"{rank}.{stream}").read_text(errors="replace")
                                  for rank in range(nproc)) for stream in ("out", "err"))
    command = [sys.executable, "-u", str(script), *args]
    result = subprocess.CompletedProcess(command, int(failed), stdout, stderr)
    if check and failed:
        raise AssertionError(
            f"a rank of {nproc} exited non-zero\nstdout:\n{result.stdout[-4000:]}\n"
            f"stderr:\n{result.stderr[-6000:]}"
        )
    return result


def _start_rank(rank: int, nproc: int, port: int, script: Path, args: list[str],
                logs: Path) -> subprocess.Popen:
    env = subprocess_env() | {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    with open(logs / f"{rank}.out", "w") as out, open(logs / f"{rank}.err", "w") as err:
        # A session of its own, as under torchrun: stop_ranks ends it with its children.
        return subprocess.Popen([sys.executable, "-u", str(script), *args], cwd=REPO_ROOT,
                                env=env, stdout=out, stderr=err, start_new_session=True)


def _wait_for_ranks(ranks: list[subprocess.Popen], timeout: float, grace: float = 10) -> bool:
    """Wait for every rank; True when one failed. Raises subprocess.TimeoutExpired after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [rank.poll() for rank in ranks]
        if all(code is not None for code in codes):
            return any(codes)
        if any(codes):  # one failed: the rest get ``grace`` seconds, then are stopped
            deadline = min(deadline, time.monotonic() + grace)
            if time.monotonic() >= deadline:
                stop_ranks(ranks)
                return True
        elif time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired([rank.args for rank in ranks], timeout)
        time.sleep(0.05)


def stop_ranks(ranks: list[subprocess.Popen], grace: float = 30) -> None:
    """SIGTERM to each running rank's session, SIGKILL to what is left ``grace`` s later."""
    for signal_number in (signal.SIGTERM, signal.SIGKILL):
        for rank in ranks:
            if rank.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rank.pid, signal_number)
        end = time.monotonic() + grace
        while any(rank.poll() is None for rank in ranks) and time.monotonic() < end:
            time.sleep(0.05)
    for rank in ranks:
        rank.wait()


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
        run_trainer(nproc, [*args, "--log-metrics-jsonl", str(metrics)], script=script)
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
