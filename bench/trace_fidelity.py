"""Fidelity of our fake-tensor allocation traces to real CUDA runs (issue 25 item 1): public
programs whose repository ships a CUDA memory snapshot beside its source, re-run step for step
on fake tensors under memo_ext.trace's AllocationRecorder, and compared with the
snapshot read by memo_ext.alloc's restricted reader.

    python bench/trace_fidelity.py \\
        --program cs336-large --checkout /work/.mirror/notHanmin+assignment2-systems/repo@33be88e \\
        --program linear-grad --checkout /work/.mirror/shreyansh26+MLSys-Experiments/repo@b63fb8c7 \\
        --program linear-no-grad --checkout /work/.mirror/shreyansh26+MLSys-Experiments/repo@b63fb8c7 \\
        --program mlp-sgd --checkout /work/.mirror/Da1sypetals+tomi/repo@f289cab \\
        --program attention-fp32 \\
        --checkout /work/.mirror/silmont2000+assignment2-systems/repo@133f0643dd71 \\
        --program cs336-medium-bf16 \\
        --checkout /work/.mirror/Wedsonlin+assignment2-systems/repo@8630bcfe2d6f \\
        [--snapshot FILE ...] [-o bench/results]

One ``--program NAME --checkout SOURCE [--snapshot FILE]`` group per program (NAME from
``--list``). SOURCE is a directory holding the program's files, or ``GIT_DIR@COMMIT`` (a bare
mirror): the files the program needs (its model/optimizer code and the snapshot) are then
extracted with ``git show`` into a temporary directory -- nothing of them lands in this tree.
``--snapshot`` overrides the snapshot's path (default: the registry's path in the checkout).

The step of each program is written here, statement for statement as the program's own loop
(same variable lifetimes), and calls the checkout's model and optimizer classes, imported from
the checkout at run time. Everything runs on CPU under ``fake_tensors()`` (no memory is
allocated: the 36-layer model costs nothing). Per program the report gives

(a) allocations matched in order: the longest common subsequence of the two alloc sequences,
    sizes rounded as the caching allocator rounds a request (512-byte blocks,
    memo_ext.alloc.models' kMinBlockSize), as matched / real allocations;
(b) peak live bytes above the recording's start (requested bytes; frees of blocks allocated
    before the window count negative), ours vs the snapshot's;
(c) the unmatched allocations of that alignment grouped by rounded size and side, each with its
    op: ours the aten op the recorder saw (event field ``op``), the snapshot's the innermost
    ``at::_ops::NAME`` (or at::native / at::cuda function) of its C++ frames and the innermost
    Python frame of the program.

Windows: a snapshot's trace may span several steps. A program names the Python line (file,
line) of its step's first statement; the window starts at the first event of the last run of
events whose innermost frame of that file is that line (for a single-step recording that is
event 0) and ends at the end of the trace. Ours: the recorder's event index when the program's
loop enters its last step, to the end of that step.

Writes OUT/trace_fidelity.md (table, unmatched lists) and OUT/trace_fidelity.json, atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memo_ext.alloc.models import KMIN_BLOCK  # noqa: E402
from memo_ext.alloc.snapshot import load_snapshot  # noqa: E402
from memo_ext.trace.cuda_rules import CudaTarget  # noqa: E402
from memo_ext.trace import AllocationRecorder, fake_tensors  # noqa: E402

MiB = 1 << 20


# ------------------------------------------------------------------------------ programs

@dataclass
class Program:
    name: str
    description: str
    snapshot: str                      # path in the checkout
    files: tuple[str, ...]             # paths a GIT_DIR@COMMIT checkout extracts
    snapshot_torch: str                # the recording's torch version (documented or inferred)
    gpu: tuple[tuple[int, int], int, str]  # (compute capability, SMs, how we know) of the run
    step_file: Optional[str]           # (file name, line) of the step's first statement
    step_line: Optional[int]
    run: Callable = field(repr=False)  # run(checkout: Path, step: Callable, end: Callable)


@contextlib.contextmanager
def _imported_from(directory: Path, names: tuple[str, ...], stubs: dict):
    """Import ``names`` from ``directory`` (first on sys.path); ``stubs`` stand in for modules
    that are not installed and that the program uses only for annotations or its tokenizer.
    Everything imported is removed from sys.modules afterwards."""
    before = set(sys.modules)
    added = []
    for mod_name, module in stubs.items():
        try:
            importlib.import_module(mod_name)
        except ImportError:
            sys.modules[mod_name] = module
            added.append(mod_name)
    sys.path.insert(0, str(directory))
    try:
        yield [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(str(directory))
        for mod_name in set(sys.modules) - before:
            if mod_name in names or mod_name in added or mod_name in ("common",):
                sys.modules.pop(mod_name, None)


def _jaxtyping_stub() -> types.ModuleType:
    """jaxtyping's Float/Int are annotations only (no runtime checks in the program)."""
    module = types.ModuleType("jaxtyping")

    class _Annotation:
        def __class_getitem__(cls, item):
            return cls

    for name in ("Float", "Int", "Bool", "Shaped", "Array"):
        setattr(module, name, type(name, (_Annotation,), {}))
    return module


def _regex_stub() -> types.ModuleType:
    """regex is used only by the program's BPE tokenizer (not run here)."""
    module = types.ModuleType("regex")
    module.__dict__.update({k: getattr(re, k) for k in ("compile", "finditer", "findall",
                                                        "escape", "split", "sub")})
    return module


@contextlib.contextmanager
def _no_value_init():
    """torch 2.13's trunc_normal_ loops on ``mask.any()``, a data-dependent branch fake tensors
    cannot take; initial values do not matter here (in-place, before the compared window: the
    program builds its model on CPU and moves it), so the initialiser is a no-op."""
    original = torch.nn.init.trunc_normal_
    torch.nn.init.trunc_normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        torch.nn.init.trunc_normal_ = original


def run_cs336_large(checkout: Path, step, end) -> None:
    """cs336_systems/benchmarking_script.py run_benchmark_with_nvtx, 'large_256' on CUDA: the
    checkout's TransformerLM (36 layers, d_model 1280, d_ff 5120, 20 heads, context 256, vocab
    10000, fp32) and AdamW; batch 4; per step forward, logits.sum(), zero_grad(), backward,
    step. Two steps: the snapshot is the last of many, so optimizer state and the previous
    step's gradients, logits and loss exist when it starts."""
    with _imported_from(checkout / "cs336_systems", ("adapters",),
                        {"jaxtyping": _jaxtyping_stub(), "regex": _regex_stub()}) as (adapters,):
        with _no_value_init():
            model = adapters.TransformerLM(vocab_size=10000, context_length=256, d_model=1280,
                                           num_layers=36, num_heads=20, d_ff=5120,
                                           rope_theta=10000)
        optimizer = adapters.AdamW(model.parameters())
        model.train()
        input_data = torch.randint(0, model.vocab_size, (4, 256))
        for index in range(2):
            if index == 1:
                step()
            logits = model(input_data)
            loss = logits.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        end()


def _run_linear(no_grad: bool, end) -> None:
    """shreyansh26 model_memory_usage/profile_{grad,no_grad}.py: nn.Linear(10000, 50000) and
    three forwards of randn(5000, 10000) (under no_grad for the second), recorded from the
    start of the script."""
    from torch import nn

    model = nn.Linear(10_000, 50_000)
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        for _ in range(3):
            inputs = torch.randn(5_000, 10_000)
            outputs = model(inputs)  # noqa: F841
    end()


def run_linear_grad(checkout: Path, step, end) -> None:
    step()
    _run_linear(False, end)


def run_linear_no_grad(checkout: Path, step, end) -> None:
    step()
    _run_linear(True, end)


def run_mlp_sgd(checkout: Path, step, end) -> None:
    """Da1sypetals/tomi generate_snapshot/generate_snapshot.py: the checkout's SimpleModel
    (Linear 10-20, ReLU, Linear 20-1), MSELoss, SGD lr 0.01, batch 64, 17 iterations of
    forward, loss, backward, step, zero_grad(set_to_none=True). ``loss.item()`` (a device to
    host copy, no device allocation) is left out: fake tensors have no value."""
    with _imported_from(checkout / "generate_snapshot", ("generate_snapshot",), {}) as (gen,):
        from torch import nn, optim

        model = gen.SimpleModel()
        loss_fn = nn.MSELoss()
        optimizer = optim.SGD(model.parameters(), lr=0.01)
        inputs = torch.randn(64, 10)
        labels = torch.randn(64, 1)
        for i in range(17):
            if i == 16:
                step()
            pred = model(inputs)
            loss = loss_fn(pred, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        end()


def run_attention_fp32(checkout: Path, step, end) -> None:
    """silmont2000/assignment2-systems cs336_systems/trace_peak_memory.py main(): the
    checkout's custom_scaled_dot_product_attention (einops einsum of Q, K^T, scaling, its
    custom_softmax, einsum with V; no mask, no heads) on Q, K, V = randn(8, 4096, 16) fp32
    with requires_grad, output.sum(), backward; recorded from before the randn calls on an
    empty cache (``empty_cache()``, then ``_record_memory_history``): the first iteration,
    with the cuBLAS workspaces of the main and the autograd thread. pandas is imported by the
    script but used only after the step."""
    stubs = {"pandas": types.ModuleType("pandas")}
    with _imported_from(checkout / "cs336_systems", ("trace_peak_memory",), stubs) as (tpm,):
        batch_size, seq_len, d_model = 8, 4096, 16
        step()
        Q = torch.randn(batch_size, seq_len, d_model, requires_grad=True)
        K = torch.randn(batch_size, seq_len, d_model, requires_grad=True)
        V = torch.randn(batch_size, seq_len, d_model, requires_grad=True)
        output = tpm.custom_scaled_dot_product_attention(Q, K, V)
        loss = output.sum()
        loss.backward()
        end()


PROGRAMS = {p.name: p for p in [
    Program("cs336-large", "notHanmin/assignment2-systems @ 33be88e: TransformerLM 36x1280 "
            "(d_ff 5120, 20 heads, ctx 256, vocab 10000), batch 4, fp32, logits.sum(), AdamW; "
            "last of 40 steps", "memory_snapshot.pickle",
            ("memory_snapshot.pickle", "cs336_systems/adapters.py", "cs336_systems/common.py",
             "cs336_systems/benchmarking_script.py"),
            # ``logits = model(input_data)``: line 99 of the committed script, line 100 in the
            # recording's frames (the file the snapshot was taken with had one more line)
            "2.6 (documented)",
            ((8, 9), 128, "RTX 4090 class: the 8 MiB + 128 KiB cuBLAS workspace is not "
             "Hopper's; logits.sum() takes [1536, 4] B of reduction scratch = 384 blocks = "
             "128 SMs x 1536 threads / 512 (memo_ext.trace.cuda_reduce)"),
            "benchmarking_script.py", 100, run_cs336_large),
    Program("linear-grad", "shreyansh26/MLSys-Experiments @ b63fb8c7: nn.Linear(10000, 50000) "
            "fp32, 3 forwards of randn(5000, 10000), grad enabled",
            "model_memory_usage/profile_grad.pkl",
            ("model_memory_usage/profile_grad.pkl", "model_memory_usage/profile_grad.py"),
            "2.4 (documented)",
            ((9, 0), 132, "Hopper: the 32 MiB cuBLAS workspace is the sm90 default"),
            None, None, run_linear_grad),
    Program("linear-no-grad", "shreyansh26/MLSys-Experiments @ b63fb8c7: the same under "
            "torch.no_grad()", "model_memory_usage/profile_no_grad.pkl",
            ("model_memory_usage/profile_no_grad.pkl", "model_memory_usage/profile_no_grad.py"),
            "2.4 (documented)",
            ((9, 0), 132, "Hopper: the 32 MiB cuBLAS workspace is the sm90 default"),
            None, None, run_linear_no_grad),
    Program("mlp-sgd", "Da1sypetals/tomi @ f289cab: MLP 10-20-1, SGD, batch 64, MSE, 17 "
            "iterations (last one compared)", "snapshots/snapshot.pickle",
            # the generator was removed after 91de3ed; the snapshot is the one of f289cab
            ("snapshots/snapshot.pickle", "generate_snapshot/generate_snapshot.py@91de3ed"),
            "2.3 (inferred: torch/nn/modules/module.py _call_impl at line 1541)",
            ((8, 0), 108, "pre-Hopper (8 MiB + 128 KiB cuBLAS workspace); A100 assumed"),
            "generate_snapshot.py", 52, run_mlp_sgd),
    Program(name="attention-fp32",
            description="silmont2000/assignment2-systems @ 133f064: cs336_systems/"
            "trace_peak_memory.py, unmasked single-head attention in plain ops (einops einsum, "
            "max/exp/sum softmax) on Q, K, V randn(8, 4096, 16) fp32, output.sum(), backward; "
            "from an empty cache (first iteration)",
            snapshot="mem_snapshot.pickle",
            files=("mem_snapshot.pickle", "cs336_systems/trace_peak_memory.py"),
            # uv.lock pins torch 2.6.0 (pyproject ~=2.6.0 off Intel Macs); frames from a
            # python3.12 uv .venv: torch/functional.py einsum 407, _tensor.py backward 626,
            # autograd/__init__.py backward 340 / _make_grads 220
            snapshot_torch="2.6.0 (documented: uv.lock)",
            gpu=((8, 9), 128, "not recorded; pre-Hopper (the 8 MiB + 128 KiB cuBLAS "
                 "workspace of both threads is not sm90's 32 MiB); an AutoDL host "
                 "(/root/autodl-tmp paths): RTX 4090 assumed; the sum's [256, 4] B reduction "
                 "scratch is the same for any card of 22 SMs or more"),
            # the recording starts with the program's first CUDA tensor (Q, line 35): event 0
            step_file=None, step_line=None, run=run_attention_fp32),
]}


def materialise(program: Program, source: str, scratch: Path) -> Path:
    """A directory with the program's files: ``source`` itself, or extracted from a bare git
    mirror ``GIT_DIR@COMMIT`` with ``git show`` (blobs absent from a partial mirror are
    skipped: only ``program.files`` are needed; ``path@commit`` takes that file from another
    commit of the same repository)."""
    if "@" not in source:
        return Path(source)
    git_dir, commit = source.rsplit("@", 1)
    target = scratch / program.name
    for entry in program.files:
        path, _, own_commit = entry.partition("@")
        blob = subprocess.run(["git", "--git-dir", git_dir, "show",
                               f"{own_commit or commit}:{path}"],
                              capture_output=True)
        if blob.returncode != 0:
            raise SystemExit(f"error: {program.name}: {path} not in {git_dir} @ "
                             f"{own_commit or commit}: "
                             f"{blob.stderr.decode().strip()}")
        (target / path).parent.mkdir(parents=True, exist_ok=True)
        (target / path).write_bytes(blob.stdout)
    return target


# ------------------------------------------------------------------------------ ours

@dataclass
class Alloc:
    size: int        # requested bytes
    op: str          # aten op (ours) or innermost C++ op/function (snapshot)
    where: str       # Python frame (snapshot) or phase (ours)


class LocatingRecorder(AllocationRecorder):
    """The recorder, also noting the innermost Python frame outside torch of each allocation
    (the snapshot's frames give the same for the real side). trace.py keeps the op name of an
    allocation (event field ``op``) but no Python location."""

    def __init__(self, target: CudaTarget) -> None:
        super().__init__(cuda_semantics=True, target=target)
        self.where: dict[int, str] = {}

    def _emit_alloc(self, token: int, nbytes: int, pool: str) -> None:
        before = len(self.events)
        super()._emit_alloc(token, nbytes, pool)
        if len(self.events) > before:
            self.where[self.events[-1][0]] = _python_location()


def _python_location() -> str:
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"backward: {node.name()}"
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "/torch/" not in filename and "/memo_ext/" not in filename \
                and not filename.endswith("trace_fidelity.py"):
            return f"{Path(filename).name}:{frame.f_lineno}"
        frame = frame.f_back
    return "(bench step)"


def target_of(program: Program) -> CudaTarget:
    """The CUDA run the snapshot comes from: its GPU and its torch release."""
    major, minor = (int(x) for x in program.snapshot_torch.split(" ")[0].split(".")[:2])
    capability, sms, _ = program.gpu
    return CudaTarget(compute_capability=capability, sm_count=sms,
                      torch_version=(major, minor))


def record_ours(program: Program, checkout: Path) -> tuple[list, list[Alloc], float]:
    """(window events as (action, bytes), the window's allocations, seconds)."""
    recorder = LocatingRecorder(target_of(program))
    marks = {}

    def step():
        marks["start"] = len(recorder.events)

    def end():
        marks["end"] = len(recorder.events)
        recorder.recording = False

    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    start = time.perf_counter()
    try:
        with fake_tensors(), recorder:
            program.run(checkout, step, end)
    finally:
        recorder.recording = False
        if gc_was_enabled:
            gc.enable()
    seconds = time.perf_counter() - start
    events = recorder.trace().events[marks["start"]:marks["end"]]
    window = [(e["action"], e["bytes"]) for e in events if e["pool"] == "device"]
    allocs = [Alloc(e["bytes"], _short_op(e["op"]), recorder.where.get(e["id"], "?"))
              for e in events if e["action"] == "alloc" and e["pool"] == "device"]
    return window, allocs, seconds


def _short_op(op: Optional[str]) -> str:
    if not op:
        return "?"
    return op.replace("aten.", "").replace(".default", "")


# ------------------------------------------------------------------------------ snapshot

_CPP_OP = re.compile(r"at::_ops::(\w+)::(?:call|redispatch)")
_CPP_FN = re.compile(r"(at::(?:native|cuda|detail)::[\w:<>]+?)\(")
_SKIP_FN = ("at::detail::empty", "at::detail::_empty", "at::native::empty_cuda",
            "at::native::empty_strided_cuda", "at::native::resize_bytes_cuda",
            "at::native::resize_cuda_")


def _frame_summary(frames: list, program_file: Optional[str]) -> tuple[str, str]:
    """(op, Python location) of a trace event: the innermost aten op (or, when the innermost
    interesting C++ function is a kernel's own helper such as a cuBLAS workspace, that helper),
    and the innermost Python frame outside torch plus the program's own frame."""
    op = None
    helper = None
    for f in frames:
        name = f.get("name", "")
        m = _CPP_OP.search(name)
        if m:
            op = m.group(1)
            break
        m = _CPP_FN.search(name)
        if m and helper is None and not m.group(1).startswith(_SKIP_FN):
            helper = m.group(1)
    if helper and (op is None or "blas" in helper or "Workspace" in helper
                   or "cuda::" in helper):
        op = f"{op or '-'} [{helper}]"
    python = [(f["filename"], f["line"]) for f in frames if f.get("filename", "").endswith(".py")]
    if not python:
        return op or "?", "(autograd engine, no Python frame)"
    inner = f"{Path(python[0][0]).name}:{python[0][1]}"
    own = [f"{Path(n).name}:{line}" for n, line in python if "/torch/" not in n]
    where = inner if not own or own[0] == inner else f"{inner} < {own[0]}"
    return op or "?", where


def snapshot_window(program: Program, snapshot: dict) -> tuple[list, list[Alloc], str]:
    """(window events as (action, bytes), its allocations, how the window was chosen)."""
    trace = snapshot["device_traces"][0]
    start = 0
    how = "whole trace (the recording starts with the program)"
    if program.step_file is not None:
        def at_step_line(e) -> bool:
            return any(Path(f.get("filename", "")).name == program.step_file
                       and f.get("line") == program.step_line for f in e.get("frames", ()))

        marks = [at_step_line(e) for e in trace]
        hits = [i for i, hit in enumerate(marks) if hit]
        if not hits:
            raise SystemExit(f"error: {program.name}: no event at {program.step_file}:"
                             f"{program.step_line}; not this program's snapshot?")
        start = hits[-1]
        while start > 0 and marks[start - 1]:
            start -= 1
        steps = 1 + sum(1 for a, b in zip(hits, hits[1:]) if b != a + 1)
        how = (f"event {start} of {len(trace)}: first event of the last run of events at "
               f"{program.step_file}:{program.step_line} (the trace holds {steps} step(s))")
    window, allocs = [], []
    for e in trace[start:]:
        if e["action"] == "alloc":
            window.append(("alloc", e["size"]))
            op, where = _frame_summary(e.get("frames", ()), program.step_file)
            allocs.append(Alloc(e["size"], op, where))
        elif e["action"] == "free_completed":
            window.append(("free", e["size"]))
    return window, allocs, how


# ------------------------------------------------------------------------------ compare

def block(size: int) -> int:
    """The caching allocator's rounding of a request (memo_ext.alloc.recorded._round_request)."""
    return max(KMIN_BLOCK, -(-size // KMIN_BLOCK) * KMIN_BLOCK)


def lcs_alignment(a: list[int], b: list[int], exact_a: Optional[list[int]] = None,
                  exact_b: Optional[list[int]] = None) -> tuple[int, list[bool], list[bool]]:
    """Longest common subsequence of ``a`` and ``b`` (block sizes) and which items of each are
    matched. Among alignments of that length the one with most equal requested sizes
    (``exact_a``/``exact_b``) is taken, so that the unmatched items named are the likely ones
    (a 4-byte and a 256-byte request are both one 512-byte block). Max-plus DP with weight
    SCALE per match plus 1 per exact match, rows vectorised:
    L[i][j] = cummax_j(max(L[i-1][j], L[i-1][j-1] + w[i][j]))."""
    n, m = len(a), len(b)
    scale = max(n, m) + 1
    exact_a = a if exact_a is None else exact_a
    exact_b = b if exact_b is None else exact_b
    dtype = np.int32 if scale * (min(n, m) + 1) < 2**31 else np.int64
    table = np.zeros((n + 1, m + 1), dtype=dtype)
    bb = np.asarray(b, dtype=np.int64)
    eb = np.asarray(exact_b, dtype=np.int64)
    for i, (x, ex) in enumerate(zip(a, exact_a), start=1):
        prev = table[i - 1]
        t = prev.copy()
        eq = bb == x
        w = (scale + (eb[eq] == ex)).astype(dtype)
        t[1:][eq] = np.maximum(prev[1:][eq], prev[:-1][eq] + w)
        table[i] = np.maximum.accumulate(t)
    matched_a, matched_b = [False] * n, [False] * m
    i, j = n, m
    while i > 0 and j > 0:
        w = scale + (exact_a[i - 1] == exact_b[j - 1])
        if a[i - 1] == b[j - 1] and table[i, j] == table[i - 1, j - 1] + w:
            matched_a[i - 1] = matched_b[j - 1] = True
            i, j = i - 1, j - 1
        elif table[i - 1, j] == table[i, j]:
            i -= 1
        else:
            j -= 1
    return sum(matched_b), matched_a, matched_b


def peak_above_start(window: list) -> tuple[int, int]:
    """(peak, final) of live bytes relative to the window's start."""
    live = peak = 0
    for action, nbytes in window:
        live += nbytes if action == "alloc" else -nbytes
        peak = max(peak, live)
    return peak, live


def unmatched_groups(allocs: list[Alloc], matched: list[bool]) -> list[dict]:
    """Unmatched allocations grouped by (rounded size, op, where), largest bytes first."""
    groups: dict = defaultdict(lambda: {"count": 0, "sizes": Counter()})
    for alloc, ok in zip(allocs, matched):
        if not ok:
            g = groups[(block(alloc.size), alloc.op, alloc.where)]
            g["count"] += 1
            g["sizes"][alloc.size] += 1
    out = [{"block": k[0], "op": k[1], "where": k[2], "count": g["count"],
            "requested": sorted(g["sizes"])} for k, g in groups.items()]
    return sorted(out, key=lambda g: (-g["block"] * g["count"], g["op"]))


def compare(program: Program, checkout: Path, snapshot_path: Path, log) -> dict:
    ours_window, ours_allocs, seconds = record_ours(program, checkout)
    log(f"  {program.name}: recorded {len(ours_allocs)} allocations on fake tensors in "
        f"{seconds:.1f} s")
    snapshot = load_snapshot(snapshot_path)
    real_window, real_allocs, how = snapshot_window(program, snapshot)
    a = [block(x.size) for x in ours_allocs]
    b = [block(x.size) for x in real_allocs]
    start = time.perf_counter()
    lcs, matched_ours, matched_real = lcs_alignment(
        a, b, [x.size for x in ours_allocs], [x.size for x in real_allocs])
    log(f"  {program.name}: LCS {lcs} of {len(b)} real allocations in "
        f"{time.perf_counter() - start:.1f} s")
    ours_peak, ours_final = peak_above_start(ours_window)
    real_peak, real_final = peak_above_start(real_window)
    size_only = {
        "ours": sorted(set(a) - set(b)),
        "real": sorted(set(b) - set(a)),
    }
    count_diff = {s: Counter(a)[s] - Counter(b)[s] for s in set(a) & set(b)
                  if Counter(a)[s] != Counter(b)[s]}
    return {
        "program": program.name, "description": program.description,
        "snapshot": str(snapshot_path), "snapshot_torch": program.snapshot_torch,
        "gpu": {"compute_capability": list(program.gpu[0]), "sm_count": program.gpu[1],
                "how": program.gpu[2]},
        "window": how, "record_seconds": round(seconds, 2),
        "ours_allocs": len(a), "real_allocs": len(b), "lcs": lcs,
        "matched_pct": 100.0 * lcs / len(b) if b else 100.0,
        "ours_peak": ours_peak, "real_peak": real_peak,
        "ours_final": ours_final, "real_final": real_final,
        "ours_bytes_allocated": sum(x.size for x in ours_allocs),
        "real_bytes_allocated": sum(x.size for x in real_allocs),
        "unmatched_ours": unmatched_groups(ours_allocs, matched_ours),
        "unmatched_real": unmatched_groups(real_allocs, matched_real),
        "sizes_only_ours": size_only["ours"], "sizes_only_real": size_only["real"],
        "count_diff": dict(sorted(count_diff.items())),
    }


# ------------------------------------------------------------------------------ report

def fmt_bytes(n: int) -> str:
    if abs(n) >= MiB:
        return f"{n / MiB:,.2f} MiB"
    return f"{n:,} B"


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                           capture_output=True, text=True).stdout.strip()
    return (out or "?") + (" (uncommitted changes present)" if dirty else "")


def report(results: list[dict], command: str, total_seconds: float) -> str:
    lines = [
        "# Trace fidelity: fake-tensor recordings against real CUDA snapshots",
        "",
        f"Command: `{command}`; {platform.node()} ({os.cpu_count()} CPUs, "
        f"{platform.machine()}), this tree at {_commit()}, ours torch {torch.__version__} "
        f"(CPU, FakeTensorMode, AllocationRecorder cuda_semantics=True); {total_seconds:.0f} s "
        "in all.",
        "",
        "Allocations are compared in order as block sizes (requests rounded up to 512 B, "
        "minimum 512 B: the caching allocator's rounding). Matched: longest common "
        "subsequence / real allocations. Peaks: live requested bytes above the window's start "
        "(frees of blocks older than the window count negative).",
        "",
        "| program | snapshot torch | real allocs | ours allocs | matched (LCS) | matched % "
        "| real peak | ours peak | ours/real peak | real end | ours end |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = r["ours_peak"] / r["real_peak"] if r["real_peak"] else float("nan")
        lines.append(
            f"| {r['program']} | {r['snapshot_torch'].split(' ')[0]} | {r['real_allocs']:,} "
            f"| {r['ours_allocs']:,} | {r['lcs']:,} | {r['matched_pct']:.1f} % "
            f"| {fmt_bytes(r['real_peak'])} | {fmt_bytes(r['ours_peak'])} | {ratio:.3f} "
            f"| {fmt_bytes(r['real_final'])} | {fmt_bytes(r['ours_final'])} |")
    lines.append("")
    for r in results:
        lines += [f"## {r['program']}", "", r["description"] + ".", "",
                  f"Snapshot window: {r['window']}. Snapshot torch {r['snapshot_torch']}. "
                  f"Fake-tensor run: {r['record_seconds']} s.", "",
                  f"CUDA target of our recording: "
                  f"sm{''.join(map(str, r['gpu']['compute_capability']))}, "
                  f"{r['gpu']['sm_count']} SMs, torch {r['snapshot_torch'].split(' ')[0]} "
                  f"({r['gpu']['how']}).", ""]
        if r["sizes_only_real"] or r["sizes_only_ours"]:
            lines.append("Block sizes on one side only: real "
                         f"{[fmt_bytes(s) for s in r['sizes_only_real']]}, ours "
                         f"{[fmt_bytes(s) for s in r['sizes_only_ours']]}.")
            lines.append("")
        for side, title in (("unmatched_real", "Real (snapshot) allocations not matched"),
                            ("unmatched_ours", "Our allocations not matched")):
            groups = r[side]
            lines.append(f"{title}: {sum(g['count'] for g in groups)}")
            lines.append("")
            if groups:
                lines += ["| block | count | requested sizes | op | where |",
                          "|---:|---:|---|---|---|"]
                for g in groups[:60]:
                    req = ", ".join(f"{s:,}" for s in g["requested"][:4])
                    if len(g["requested"]) > 4:
                        req += ", ..."
                    lines.append(f"| {fmt_bytes(g['block'])} | {g['count']} | {req} "
                                 f"| `{g['op']}` | {g['where']} |")
                if len(groups) > 60:
                    lines.append(f"| ... | {len(groups) - 60} more groups (see the JSON) | | | |")
                lines.append("")
    return "\n".join(lines) + "\n"


def all_programs() -> dict[str, Program]:
    """The programs above and the kept-aside one (bench/fidelity_kept_aside.py: checked the
    same way, never used to tune the rules; imported here, not at the top, because it builds on
    this module)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fidelity_kept_aside import KEPT_ASIDE

    return {**PROGRAMS, KEPT_ASIDE.name: KEPT_ASIDE}


def main(argv=None) -> int:
    programs = all_programs()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--program", action="append", default=[],
                        help=f"One of {', '.join(programs)}; repeat for several.")
    parser.add_argument("--checkout", action="append", default=[],
                        help="Directory with the program's files, or GIT_DIR@COMMIT; one per "
                             "--program, in order.")
    parser.add_argument("--snapshot", action="append", default=[],
                        help="Snapshot path per --program (optional; 'default' keeps the "
                             "registry's path in the checkout).")
    parser.add_argument("--list", action="store_true", help="List the known programs.")
    parser.add_argument("-o", "--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    if args.list:
        for p in programs.values():
            print(f"{p.name}: {p.description} (snapshot {p.snapshot})")
        return 0
    if not args.program or len(args.checkout) != len(args.program) or \
            len(args.snapshot) > len(args.program):
        parser.error("give one --checkout per --program (and at most one --snapshot each)")
    unknown = [p for p in args.program if p not in programs]
    if unknown:
        parser.error(f"unknown program(s) {', '.join(unknown)}; pick from {', '.join(programs)}")
    snapshots = args.snapshot + ["default"] * (len(args.program) - len(args.snapshot))
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="trace_fidelity_") as scratch:
        for name, source, snap in zip(args.program, args.checkout, snapshots):
            program = programs[name]
            checkout = materialise(program, source, Path(scratch))
            snapshot_path = checkout / program.snapshot if snap == "default" else Path(snap)
            print(f"{name}: checkout {checkout}, snapshot {snapshot_path}", flush=True)
            results.append(compare(program, checkout, snapshot_path,
                                   lambda s: print(s, flush=True)))
    total = time.perf_counter() - started
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python bench/trace_fidelity.py {argv_text}"
    args.out.mkdir(parents=True, exist_ok=True)
    md = report(results, command, total)
    _write_atomic(args.out / "trace_fidelity.md", md)
    _write_atomic(args.out / "trace_fidelity.json",
                  json.dumps({"command": command, "torch": torch.__version__,
                              "results": results}, indent=1, sort_keys=True) + "\n")
    print(md)
    print(f"written: {args.out / 'trace_fidelity.md'}, {args.out / 'trace_fidelity.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
