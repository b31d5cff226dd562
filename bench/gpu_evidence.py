"""GPU evidence in one short run (`make gpu-evidence`): what a lent GPU must bring back.

Sections, each written to ``<out>/gpu_evidence_<gpu>.jsonl`` the moment it is measured, so a
run cut off by its time limit still leaves data; the markdown and JSON reports are rendered
(atomically) after every section:

* ``env``: GPU, driver, torch, CUDA, cuDNN, commit; the call signatures of the attention ops.
* ``correctness``: the one attention's tile compositions (zigzag ring CP=2/4, packed documents,
  head chunks at micro-batch 2) with the kernels this device dispatches, and with
  FlashAttention-2's too where that is cuDNN's fused attention, against a dense fp32 reference
  (megatron.memo_tools.gpu_check.ring_composition).
* ``attention``: one attention tile forward and backward, bf16, head dim 128, 32 query heads
  in 8 K/V groups (GQA 4:1), batch 1, causal and not, 2K-64K tokens: the tile ops as the
  trainer dispatches them (``memo_attention::tile_forward/backward``; cuDNN's fused attention
  on Hopper with --attention-backend auto), the tile ops' FlashAttention-2 path (forced, for the
  comparison), and each exact backend of torch's scaled_dot_product_attention present
  (FlashAttention-2, cuDNN, efficient).
  FLOPs counted as the kernel tables count them (memo_ext/estimate/kernel_tables.json).
* ``gemm``: bf16 matmuls at the 7B and 8B layer shapes for TP 1/2/4/8, forward and both
  backward orientations.
* ``bandwidth``: page-locked host <-> device copies alone, both at once, and while a GEMM runs
  (the overlap MEMO's cost model assumes).

``--dry-run`` (CPU, no GPU) runs the correctness section on the CPU kernels in fp32 and renders
every planned measurement as "not measured"; tests/unit/bench/test_gpu_evidence.py runs it so.

    python bench/gpu_evidence.py                 # on a GPU node, ~5 minutes on one H100
    python bench/gpu_evidence.py --dry-run --out /tmp/evidence
    python bench/gpu_evidence.py --import-rows bench/results/gpu_evidence_h200.json

``--import-rows FILE`` (no GPU) derives the estimator's measured kernel rows from an evidence
file and writes them into memo_ext/estimate/measured_kernels.json under the GPU's hardware.json
profile (memo_ext/estimate/measured_kernels.py); the estimator then prices that GPU with them.

Timings use CUDA events, the median of the timed repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NOT_MEASURED = "not measured"
ATTENTION_LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)
ATTENTION_HEADS, ATTENTION_GROUPS, HEAD_DIM = 32, 8, 128
#: (name, hidden, ffn, heads, groups, vocab) of the layer shapes the estimator prices.
GEMM_MODELS = (("7b", 4096, 11008, 32, 32, 32000), ("8b", 4096, 14336, 32, 8, 128256))
GEMM_TOKENS = 16384
TENSOR_PARALLEL = (1, 2, 4, 8)
COPY_BYTES = 1 << 30
CORRECTNESS_SEQ = 4096
#: An 8B-shaped stack (Llama-3-8B's layer: GQA 32/8, SwiGLU 14336, RMSNorm, vocabulary 128256)
#: with few layers: at these lengths a layer's attention takes seconds, and the kit has minutes.
LONG_MODEL_FLAGS = ("--num-layers", "4", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
                    "--num-attention-heads", "32", "--group-query-attention",
                    "--num-query-groups", "8", "--swiglu", "--normalization", "RMSNorm",
                    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                    "--vocab-size", "128256")
LONG_LENGTHS = (32768, 65536, 131072)
LONG_ITERATIONS = 3
#: MEMO with the tiled MLP in this many sequence tiles (and the chunked loss); the peer is
#: Megatron-LM's full recompute.
LONG_MLP_TILES = 16
LONG_POLICIES = ("memo", "megatron")


def commit() -> str:
    """HEAD's short hash; MEMO_EVIDENCE_COMMIT overrides it where the checkout's git metadata is
    not the tree's (a device machine's copy of a working tree)."""
    if os.environ.get("MEMO_EVIDENCE_COMMIT"):
        return os.environ["MEMO_EVIDENCE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


class Evidence:
    """The run's records: appended to the .jsonl at once, rendered to .md/.json on demand."""

    def __init__(self, out: Path, stem: str, deadline: float, records: Optional[list] = None):
        """A new evidence file, or (``records``) the records of an existing one, kept as they
        are on disk until :meth:`render` rewrites them."""
        self.out, self.stem, self.deadline = out, stem, deadline
        out.mkdir(parents=True, exist_ok=True)
        self.lines = out / f"{stem}.jsonl"
        # A new run streams each record to disk at once (a cut-off run keeps them); a reloaded
        # file changes only when render() rewrites it whole.
        self.run_dir = out / "long_runs"  # each long run's train.log and metrics.jsonl
        self.streaming = records is None
        if self.streaming:
            self.lines.write_text("")
        self.records: list[dict] = list(records or [])

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, section: str, **record) -> None:
        record = {"section": section, **record}
        self.records.append(record)
        if not self.streaming:
            return
        with self.lines.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def of(self, section: str) -> list[dict]:
        return [r for r in self.records if r["section"] == section]

    def render(self) -> None:
        _write_atomic(self.lines, "".join(json.dumps(r) + "\n" for r in self.records))
        _write_atomic(self.out / f"{self.stem}.json", json.dumps(self.records, indent=1) + "\n")
        _write_atomic(self.out / f"{self.stem}.md", render_markdown(self))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cuda_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` timed calls after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


# ------------------------------------------------------------------------------------ env

def section_env(evidence: Evidence, dry_run: bool) -> None:
    record = {"python": platform.python_version(), "torch": torch.__version__,
              "commit": commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if not dry_run:
        props = torch.cuda.get_device_properties(0)
        record.update(gpu=torch.cuda.get_device_name(0), memory_gib=props.total_memory / 2**30,
                      multiprocessors=props.multi_processor_count, cuda=torch.version.cuda,
                      cudnn=torch.backends.cudnn.version())
        try:
            record["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as error:
            record["driver"] = f"unknown ({error})"
    schemas = {}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"):
        op = getattr(torch.ops.aten, name, None)
        schemas[name] = str(op.default._schema) if op is not None else "absent"
    record["schemas"] = schemas
    evidence.add("env", **record)


# ---------------------------------------------------------------------------- correctness

def section_correctness(evidence: Evidence, dry_run: bool) -> None:
    from memo_ext.attention import kernels
    from megatron.memo_tools.gpu_check import ring_composition

    # A dry run checks the compositions on the CPU kernels at a size the unit suite affords.
    device, dtype, seq, shape = (("cpu", torch.float32, 128, dict(heads=4, groups=2, head_dim=32))
                                 if dry_run else ("cuda", torch.bfloat16, CORRECTNESS_SEQ, {}))
    probe = torch.empty(1, 1, 1, shape.get("head_dim", HEAD_DIM), device=device, dtype=dtype)
    # The kernels this device dispatches, and FlashAttention-2's too where that is cuDNN (the
    # ring's ranks are threads: --attention-backend is process-wide, forced_kernel is not).
    saved = kernels.attention_backend()
    backends = [saved]
    if kernels.kernel_for(probe) == "cuda_cudnn":
        backends.append("flash")
    try:
        for backend in backends:
            kernels.set_attention_backend(backend)
            for case in ring_composition.cases(seq):
                _correctness_case(evidence, case, seq, device, dtype, shape,
                                  kernels.kernel_for(probe))
    finally:
        kernels.set_attention_backend(saved)


def _correctness_case(evidence: Evidence, case, seq: int, device: str, dtype, shape: dict,
                      kernel: str) -> None:
    from megatron.memo_tools.gpu_check import ring_composition

    if evidence.left_s() < 20:
        evidence.add("correctness", case=case.name, kernel=kernel, status=NOT_MEASURED,
                     reason="time")
        return
    started = time.monotonic()
    try:
        result = ring_composition.check(case, seq, device=device, dtype=dtype, **shape)
        evidence.add("correctness", case=case.name, seq=seq, kernel=kernel,
                     dtype=str(dtype), errors=result.errors, tolerance=result.tolerance,
                     status="PASS" if result.passed else "FAIL",
                     seconds=time.monotonic() - started)
    except Exception as error:  # a failing case must not stop the evidence
        evidence.add("correctness", case=case.name, kernel=kernel, status="ERROR",
                     reason=f"{type(error).__name__}: {error}"[:500],
                     trace=traceback.format_exc()[-2000:])


# ------------------------------------------------------------------------------ attention

def attention_flops(direction: str, causal: bool, seq: int, heads: int = ATTENTION_HEADS,
                    head_dim: int = HEAD_DIM, batch: int = 1) -> float:
    """FLOPs as the kernel tables count them: forward 4*b*s^2*h*d, halved when causal;
    backward 2.5x forward."""
    forward = 4 * batch * seq * seq * heads * head_dim / (2 if causal else 1)
    return {"forward": forward, "backward": 2.5 * forward, "forward_backward": 3.5 * forward}[direction]


def _attention_backends() -> dict:
    """Backends to time: name -> (forward, backward) builders over (q, k, v, causal)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from memo_ext.attention import kernels

    def tile_op(kernel=None):
        """The tile ops with ``kernel`` forced (None: as dispatched on this device). The timed
        calls run in this thread, where forced_kernel applies."""
        def build(q, k, v, causal):
            scale = 1.0 / math.sqrt(q.shape[-1])
            with kernels.forced_kernel(kernel):
                out, lse = torch.ops.memo_attention.tile_forward(q, k, v, scale, causal, 0.0, 0)
            grad = torch.randn_like(out)

            def forward():
                with kernels.forced_kernel(kernel):
                    return torch.ops.memo_attention.tile_forward(q, k, v, scale, causal, 0.0, 0)

            def backward():
                with kernels.forced_kernel(kernel):
                    return torch.ops.memo_attention.tile_backward(grad, q, k, v, out, lse, scale,
                                                                  causal, 0.0, 0)
            return forward, backward, True
        return build

    def sdpa(backend):
        def build(q, k, v, causal):
            """GQA native where the backend takes it, else K/V expanded to every head (the
            expansion is outside the timed calls; the record says which)."""
            grad = torch.randn_like(q)
            for gqa in (True, False):
                if not gqa:
                    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]

                def forward(leaves=leaves, gqa=gqa):
                    with sdpa_kernel([backend]), torch.no_grad():
                        return F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                              enable_gqa=gqa)

                def forward_backward(leaves=leaves, gqa=gqa):
                    with sdpa_kernel([backend]):
                        out = F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                             enable_gqa=gqa)
                    out.backward(grad)
                try:
                    forward_backward()  # raises here if the backend refuses the shape
                except RuntimeError:
                    if not gqa:
                        raise
                    continue
                return forward, forward_backward, gqa
        return build

    return {"memo tile ops (as dispatched)": (tile_op(), "separate"),
            "memo tile ops (FA2 path)": (tile_op("cuda_flash"), "separate"),
            "sdpa flash (FA2)": (sdpa(SDPBackend.FLASH_ATTENTION), "combined"),
            "sdpa cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION), "combined"),
            "sdpa efficient": (sdpa(SDPBackend.EFFICIENT_ATTENTION), "combined")}


#: What the attention section times, in order (keys of _attention_backends).
ATTENTION_BACKENDS = ("memo tile ops (as dispatched)", "memo tile ops (FA2 path)",
                      "sdpa flash (FA2)", "sdpa cudnn", "sdpa efficient")


def section_attention(evidence: Evidence, dry_run: bool) -> None:
    names = ATTENTION_BACKENDS
    if dry_run:
        for name in names:
            for causal in (True, False):
                for seq in ATTENTION_LENGTHS:
                    evidence.add("attention", backend=name, causal=causal, seq=seq,
                                 status=NOT_MEASURED, reason="dry run")
        return
    from memo_ext.attention import kernels

    backends = _attention_backends()
    for causal in (True, False):
        for seq in ATTENTION_LENGTHS:
            q = torch.randn(1, ATTENTION_HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, ATTENTION_GROUPS, seq, HEAD_DIM, device="cuda",
                                dtype=torch.bfloat16) for _ in range(2))
            repeats = 5 if seq <= 16384 else 2
            for name in names:
                build, mode = backends[name]
                common = dict(backend=name, causal=causal, seq=seq, heads=ATTENTION_HEADS,
                              groups=ATTENTION_GROUPS, head_dim=HEAD_DIM, dtype="bf16")
                if name == "memo tile ops (as dispatched)":
                    common["kernel"] = kernels.kernel_for(q, key_length=seq)
                elif name == "memo tile ops (FA2 path)":
                    common["kernel"] = "cuda_flash"
                if evidence.left_s() < 30:
                    evidence.add("attention", **common, status=NOT_MEASURED, reason="time")
                    continue
                try:
                    forward, second, gqa_native = build(q, k, v, causal)
                    common["kv"] = "GQA native" if gqa_native else "K/V expanded"
                    t_forward = _cuda_time(forward, repeats)
                    t_second = _cuda_time(second, repeats)
                    t_backward = t_second if mode == "separate" else t_second - t_forward
                    evidence.add(
                        "attention", **common, status="measured",
                        forward_s=t_forward, backward_s=t_backward,
                        forward_tflops=attention_flops("forward", causal, seq) / t_forward / 1e12,
                        backward_tflops=attention_flops("backward", causal, seq) / t_backward / 1e12,
                        forward_backward_tflops=attention_flops("forward_backward", causal, seq)
                        / (t_forward + t_backward) / 1e12)
                except Exception as error:
                    evidence.add("attention", **common, status="ERROR",
                                 reason=f"{type(error).__name__}: {error}"[:400])
                torch.cuda.empty_cache()
            del q, k, v
    _cudnn_lse_layout(evidence)


def _cudnn_lse_layout(evidence: Evidence) -> None:
    """The shape, strides and dtype of cuDNN's log-sum-exp, beside FA2's (the one attention
    merges tiles by it, so a new backend must give the same convention)."""
    q = torch.randn(1, 4, 256, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    record = {}
    for name, call in (
            ("flash", lambda: torch.ops.aten._scaled_dot_product_flash_attention(
                q, q, q, 0.0, True, False, scale=0.1)),
            ("cudnn", lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, q, q, None, True, 0.0, True, False, scale=0.1))):
        try:
            out, lse = call()[:2]
            record[name] = {"out": [list(out.shape), list(out.stride())],
                            "lse": [list(lse.shape), list(lse.stride()), str(lse.dtype)]}
            record[name + "_lse_values"] = lse.flatten()[:4].tolist()
        except Exception as error:
            record[name] = f"{type(error).__name__}: {error}"[:400]
    evidence.add("lse_layout", **record)


# ----------------------------------------------------------------------------------- gemm

def gemm_shapes() -> list[dict]:
    """(model, tp, layer, pass, m, n, k) of every GEMM of a layer and the output layer:
    forward C(m x n) = A(m x k) B(k x n) with m tokens; backward dgrad (m, k, n) and
    wgrad (k, n, m) of the same weight."""
    shapes = []
    for model, hidden, ffn, heads, groups, vocab in GEMM_MODELS:
        head_dim = hidden // heads
        for tp in TENSOR_PARALLEL:
            layers = {"qkv": (hidden, (heads + 2 * groups) * head_dim // tp),
                      "proj": (hidden // tp, hidden), "fc1": (hidden, 2 * ffn // tp),
                      "fc2": (ffn // tp, hidden), "output": (hidden, vocab // tp)}
            for layer, (k, n) in layers.items():
                m = GEMM_TOKENS
                for direction, (a, b, c) in (("forward", (m, n, k)), ("dgrad", (m, k, n)),
                                             ("wgrad", (k, n, m))):
                    shapes.append(dict(model=model, tp=tp, layer=layer, direction=direction,
                                       m=a, n=b, k=c))
    return shapes


def section_gemm(evidence: Evidence, dry_run: bool) -> None:
    seen: dict = {}
    for shape in gemm_shapes():
        key = (shape["m"], shape["n"], shape["k"])
        if dry_run or evidence.left_s() < 20:
            evidence.add("gemm", **shape, status=NOT_MEASURED,
                         reason="dry run" if dry_run else "time")
            continue
        if key not in seen:
            m, n, k = key
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            seconds = _cuda_time(lambda: torch.matmul(a, b), 10)
            seen[key] = seconds
            del a, b
        seconds = seen[key]
        evidence.add("gemm", **shape, status="measured", seconds=seconds,
                     tflops=2 * shape["m"] * shape["n"] * shape["k"] / seconds / 1e12)


# ------------------------------------------------------------------------------ bandwidth

def section_bandwidth(evidence: Evidence, dry_run: bool) -> None:
    cases = ("host_to_device", "device_to_host", "both_directions", "host_to_device_with_gemm",
             "device_to_host_with_gemm", "gemm_alone", "gemm_with_copies")
    if dry_run:
        for case in cases:
            evidence.add("bandwidth", case=case, status=NOT_MEASURED, reason="dry run")
        return
    host = [torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    device = [torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda") for _ in range(2)]
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemms = 40

    def copies(h2d: bool, d2h: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        if h2d:
            with torch.cuda.stream(up):
                device[0].copy_(host[0], non_blocking=True)
        if d2h:
            with torch.cuda.stream(down):
                host[1].copy_(device[1], non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def gemm_loop() -> None:
        for _ in range(gemms):
            torch.matmul(a, a)

    copies(True, True)
    gemm_flops = gemms * 2 * 8192 ** 3
    torch.cuda.synchronize()
    start = time.perf_counter()
    gemm_loop()
    torch.cuda.synchronize()
    gemm_alone = time.perf_counter() - start
    evidence.add("bandwidth", case="gemm_alone", status="measured", seconds=gemm_alone,
                 tflops=gemm_flops / gemm_alone / 1e12)
    for case, h2d, d2h in (("host_to_device", True, False), ("device_to_host", False, True),
                           ("both_directions", True, True)):
        seconds = min(copies(h2d, d2h) for _ in range(3))
        evidence.add("bandwidth", case=case, status="measured", seconds=seconds,
                     gb_per_s=COPY_BYTES * (h2d + d2h) / seconds / 1e9)
    for case, stream, copy in (
            ("host_to_device_with_gemm", up, lambda: device[0].copy_(host[0], non_blocking=True)),
            ("device_to_host_with_gemm", down, lambda: host[1].copy_(device[1], non_blocking=True))):
        torch.cuda.synchronize()
        done = torch.cuda.Event(enable_timing=True)
        begin = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            begin.record()
            copy()
            done.record()
        gemm_loop()
        torch.cuda.synchronize()
        seconds = begin.elapsed_time(done) / 1e3
        evidence.add("bandwidth", case=case, status="measured", seconds=seconds,
                     gb_per_s=COPY_BYTES / seconds / 1e9)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.cuda.stream(up):
        for _ in range(4):
            device[0].copy_(host[0], non_blocking=True)
    with torch.cuda.stream(down):
        for _ in range(4):
            host[1].copy_(device[1], non_blocking=True)
    gemm_loop()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    evidence.add("bandwidth", case="gemm_with_copies", status="measured", seconds=seconds,
                 note=f"{gemms} 8192^3 GEMMs beside 4 GiB each way; alone {gemm_alone:.3f} s")
    del host, device, a


# --------------------------------------------------------------------------- long sequences

def long_argv(policy: str, seq: int, metrics: Path) -> list[str]:
    """pretrain_gpt.py flags of one long-sequence training on one GPU: the layout's flags as
    the recommender renders them (memo_ext.estimate.layout.Layout.trainer_flags)."""
    from memo_ext.estimate.layout import Layout

    layout = Layout(1, 1, 1, 1, policy, 0.0 if policy == "memo" else None,
                    mlp_tiles=LONG_MLP_TILES if policy == "memo" else 0)
    flags = layout.trainer_flags(seq, global_batch=1)
    if policy == "memo":
        # alpha auto: MEMO's LP needs the run's measured layer times; the estimator predicts
        # afterwards at the alpha the run solved (as make gpu-check does).
        flags[flags.index("--memo-alpha") + 1] = "auto"
    return [*LONG_MODEL_FLAGS, *flags, "--position-embedding-type", "rope",
            "--attention-dropout", "0",
            "--hidden-dropout", "0", "--bf16", "--accumulate-allreduce-grads-in-fp32",
            "--train-iters", str(LONG_ITERATIONS), "--lr", "1e-4", "--mock-data",
            "--log-interval", "1", "--eval-interval", str(LONG_ITERATIONS + 1),
            "--eval-iters", "0", "--log-metrics-jsonl", str(metrics)]


def section_long(evidence: Evidence, dry_run: bool) -> None:
    from megatron.memo_tools.gpu_check.measure import (RunFailure, failure_reason, launch,
                                                     measure, read_records)

    run_root = evidence.run_dir
    # Longest first, both policies at each length: a run cut off by the budget loses the
    # shortest lengths, which say least about the regime the kit is for.
    for seq in sorted(LONG_LENGTHS, reverse=True):
        for policy in LONG_POLICIES:
            run_dir = run_root / f"{policy}_{seq}"
            run_dir.mkdir(parents=True, exist_ok=True)
            metrics, log = run_dir / "metrics.jsonl", run_dir / "train.log"
            argv = long_argv(policy, seq, metrics)
            common = dict(policy=policy, seq=seq, argv=" ".join(argv))
            if dry_run or evidence.left_s() < 60:
                evidence.add("long", **common, status=NOT_MEASURED,
                             reason="dry run" if dry_run else "time")
                continue
            metrics.unlink(missing_ok=True)
            completed = launch(1, argv, log, evidence.left_s() - 15)
            text = log.read_text(errors="replace")
            reason = failure_reason(completed, text)
            records = read_records(metrics)
            record = dict(common, wall_s=completed.wall_s,
                          iterations=[r for r in records if "iteration_time_s" in r])
            if reason is None:
                try:
                    measured = measure(records, text, memory_key="mem_peak_allocated_mib",
                                       train_iters=LONG_ITERATIONS, steady_from=2)
                    evidence.add("long", **record, status="measured",
                                 peak_allocated_mib=measured.peak_mib,
                                 iteration_s=measured.iteration_s, memo_alpha=measured.memo_alpha)
                    continue
                except RunFailure as failure:
                    reason = str(failure)
            evidence.add("long", **record, status="FAIL", reason=reason,
                         log_tail=text[-3000:])


def long_layout(policy: str, alpha: Optional[float]):
    from memo_ext.estimate.layout import Layout

    return Layout(1, 1, 1, 1, policy, alpha if policy == "memo" else None,
                  mlp_tiles=LONG_MLP_TILES if policy == "memo" else 0)


def predict_long(evidence: Evidence, profile: str) -> None:
    """The estimator's peak allocated memory and iteration time for every measured long run,
    at the run's own length and (MEMO) the alpha the run solved, with the caching allocator
    model (the runs use PyTorch's allocator); traced on this CPU through the trace cache. Also
    the longest length the estimator says fits one GPU at that alpha."""
    from memo_ext.hardware import load_hardware
    from memo_ext.estimate.layout import LayoutModel, TraceCache, default_cache_dir

    from megatron.memo_tools.cli.estimate import traced_model_and_shape

    # The trainer's model flags as a flag file, read the way `tools/estimate.py --model @FILE`
    # reads a converted checkpoint's model_flags.txt (one reading of trainer flags).
    flag_file = evidence.out / f"{evidence.stem}_model_flags.txt"
    _write_atomic(flag_file, "\n".join(LONG_MODEL_FLAGS) + "\n")
    network, _ = traced_model_and_shape(f"@{flag_file}")
    hardware = load_hardware(profile)
    with TraceCache(default_cache_dir()) as cache:  # ends its tracer servers
        longest_done = set()
        for record in [r for r in evidence.of("long") if r["status"] == "measured"]:
            policy, seq = record["policy"], record["seq"]
            alpha = record.get("memo_alpha") if policy == "memo" else None
            model = LayoutModel.build(network, long_layout(policy, alpha), hardware,
                                      global_batch=1, cache=cache, allocator="caching",
                                      fit_seqs=(seq, 2 * seq))
            prediction = model.predict(seq)
            entry = dict(policy=policy, seq=seq, memo_alpha=alpha, profile=profile,
                         peak_allocated_mib=prediction.memory.peak_allocated_bytes / 2**20,
                         iteration_s=prediction.step_s, mfu=prediction.mfu)
            if (policy, alpha) not in longest_done:
                longest_done.add((policy, alpha))
                entry["longest_one_gpu"] = model.longest(step=8192, maximum=4 << 20)
            evidence.add("long_prediction", **entry)


# ------------------------------------------------------------------------------- markdown

def _cell(value, fmt="{:.1f}") -> str:
    return NOT_MEASURED if value is None else fmt.format(value)


def render_markdown(evidence: Evidence) -> str:
    env = (evidence.of("env") or [{}])[0]
    lines = [f"# GPU evidence: {env.get('gpu', 'no GPU (dry run)')}", "",
             f"Command: `python bench/gpu_evidence.py` ({'dry run' if 'gpu' not in env else 'measured'}); "
             f"commit {env.get('commit', '?')}, {env.get('date', '?')}; torch {env.get('torch', '?')}, "
             f"CUDA {env.get('cuda', '-')}, cuDNN {env.get('cudnn', '-')}, driver "
             f"{env.get('driver', '-')}. Raw records: `{evidence.stem}.jsonl`.", "",
             "## Correctness: tile compositions against a dense fp32 reference", "",
             "| case | kernel | dtype | tokens | dQ error | dK error | dV error | tolerance | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in evidence.of("correctness"):
        errors = r.get("errors", {})
        lines.append(f"| {r['case']} | {r.get('kernel', '-')} | {r.get('dtype', '-')} | "
                     f"{r.get('seq', '-')} | " + " | ".join(
                         _cell(errors.get(g), "{:.2e}") for g in ("dq", "dk", "dv")) +
                     f" | {r.get('tolerance', '-')} | {r['status']} "
                     f"{r.get('reason', '')} |")
    lines += ["", "Error: max |gradient - reference| / max |reference| over the whole tensor.", "",
              "## Attention tile, bf16, head dim 128, 32 heads in 8 K/V groups, batch 1 (TFLOP/s)",
              "", "| backend | K/V | causal | tokens | forward | backward | forward+backward | forward ms | backward ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in evidence.of("attention"):
        if r["status"] == "measured":
            lines.append(f"| {r['backend']} | {r.get('kv', '-')} | {r['causal']} | {r['seq']} | "
                         f"{r['forward_tflops']:.1f} | {r['backward_tflops']:.1f} | "
                         f"{r['forward_backward_tflops']:.1f} | {r['forward_s'] * 1e3:.2f} | "
                         f"{r['backward_s'] * 1e3:.2f} |")
        else:
            reason = r.get("reason", "")
            lines.append(f"| {r['backend']} | - | {r['causal']} | {r['seq']} | {r['status']} "
                         f"({reason}) | | | | |")
    layout = evidence.of("lse_layout")
    if layout:
        lines += ["", "Log-sum-exp layout ([shape, strides, dtype]):", "", "```",
                  json.dumps(layout[0], indent=1), "```"]
    lines += ["", f"## GEMMs, bf16, {GEMM_TOKENS} tokens (TFLOP/s)", "",
              "| model | TP | layer | pass | m | n | k | TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    for r in evidence.of("gemm"):
        lines.append(f"| {r['model']} | {r['tp']} | {r['layer']} | {r['direction']} | {r['m']} | "
                     f"{r['n']} | {r['k']} | {_cell(r.get('tflops'))} |")
    lines += ["", f"## Page-locked host <-> device copies ({COPY_BYTES >> 20} MiB each)", "",
              "| case | GB/s | s | note |", "|---|---|---|---|"]
    for r in evidence.of("bandwidth"):
        value = r.get("gb_per_s") or r.get("tflops")
        unit = "" if r.get("gb_per_s") else " TFLOP/s"
        rate = "-" if value is None and r["status"] == "measured" else _cell(value)
        lines.append(f"| {r['case']} | {rate}{unit if value else ''} | "
                     f"{_cell(r.get('seconds'), '{:.4f}')} | {r.get('note', '')} |")
    lines += ["", "## Long sequences on one GPU: 8B-shaped stack, "
              f"{LONG_MODEL_FLAGS[1]} layers, {LONG_ITERATIONS} iterations", "",
              "| policy | tokens | verdict | peak allocated MiB | predicted MiB | iteration s | "
              "predicted s | MEMO alpha | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    predicted = {(r["policy"], r["seq"]): r for r in evidence.of("long_prediction")}
    for r in evidence.of("long"):
        guess = predicted.get((r.get("policy"), r.get("seq")), {})
        lines.append(f"| {r.get('policy')} | {r.get('seq')} | {r['status']} | "
                     f"{_cell(r.get('peak_allocated_mib'))} | {_cell(guess.get('peak_allocated_mib'))} | "
                     f"{_cell(r.get('iteration_s'), '{:.2f}')} | {_cell(guess.get('iteration_s'), '{:.2f}')} | "
                     f"{_cell(r.get('memo_alpha'), '{:.3f}') if r.get('policy') == 'memo' else '-'} | "
                     f"{r.get('reason', '')} |")
    for r in evidence.of("long_prediction"):
        if "longest_one_gpu" in r:
            lines.append(f"\nEstimator's longest one-GPU length, {r['policy']}"
                         f"{'' if r['memo_alpha'] is None else ' alpha %.3f' % r['memo_alpha']}: "
                         f"{r['longest_one_gpu']} tokens (profile {r['profile']}, predicted).")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- main

def import_rows(evidence: Path, table: Optional[Path] = None) -> int:
    """--import-rows: the evidence file's rows into the estimator's measured table."""
    from megatron.memo_tools.cli.quiet import hide_library_warnings

    hide_library_warnings()  # memo_ext.estimate imports megatron.core
    from memo_ext.estimate.measured_kernels import MEASURED_FILE, MeasuredRowsError, \
        import_evidence, repo_path

    table = table or MEASURED_FILE
    try:
        profile, entry = import_evidence(evidence, table)
    except MeasuredRowsError as error:
        print(f"gpu-evidence: error: {error}", file=sys.stderr)
        return 2
    kernels = sorted({row["kernel"] for row in entry["attention"]})
    provenance = entry["provenance"]
    print(f"gpu-evidence: {len(entry['gemm'])} GEMM and {len(entry['attention'])} attention rows "
          f"({', '.join(kernels) or 'no kernel'}) measured on {provenance['gpu']} (commit "
          f"{provenance['commit']}, {provenance['date']}) -> {repo_path(table)}, profile {profile!r}")
    return 0


SECTIONS = {"env": section_env, "correctness": section_correctness,
            "attention": section_attention, "gemm": section_gemm, "bandwidth": section_bandwidth,
            "long": section_long}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                        help="folder for gpu_evidence_<gpu>.{jsonl,json,md}")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: correctness on the CPU kernels, the rest 'not measured'")
    parser.add_argument("--budget-s", type=float, default=480,
                        help="stop starting measurements after this many seconds")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="each long run's train.log and metrics.jsonl (default "
                             "<out>/long_runs; the evidence file keeps their figures)")
    parser.add_argument("--predict", type=Path, metavar="JSONL",
                        help="no measuring: add the estimator's predictions for the long runs "
                             "of this evidence file (runs on CPU) and render it again")
    parser.add_argument("--profile", default="h200",
                        help="the hardware.json profile --predict predicts for (default h200)")
    parser.add_argument("--import-rows", type=Path, default=None, metavar="FILE",
                        help="measure nothing: import the GEMM and attention rows of the "
                             "evidence FILE (gpu_evidence_<gpu>.json) into the estimator's "
                             "memo_ext/estimate/measured_kernels.json")
    args = parser.parse_args(argv)
    if args.predict:
        return _predict_file(args.predict, args.profile)
    if args.import_rows is not None:
        return import_rows(args.import_rows)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {','.join(unknown)}; choose from {','.join(SECTIONS)}")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-evidence: no CUDA GPU visible; run it on a GPU node, or pass --dry-run",
              file=sys.stderr)
        return 2
    gpu = "dry_run" if args.dry_run else \
        torch.cuda.get_device_name(0).lower().replace("nvidia ", "").split()[0]
    evidence = Evidence(args.out, f"gpu_evidence_{gpu}", time.monotonic() + args.budget_s)
    if args.run_dir is not None:
        evidence.run_dir = args.run_dir
    for name in ["env"] + [s for s in sections if s != "env"]:
        started = time.monotonic()
        try:
            SECTIONS[name](evidence, args.dry_run)
        except Exception as error:
            evidence.add(name, status="ERROR", reason=f"{type(error).__name__}: {error}"[:500],
                         trace=traceback.format_exc()[-2000:])
        print(f"gpu-evidence: {name} done in {time.monotonic() - started:.1f} s", flush=True)
        evidence.render()
    print(f"gpu-evidence: wrote {evidence.out / evidence.stem}.md")
    if not args.dry_run:
        print(f"gpu-evidence: the estimator reads these rows once imported: python "
              f"bench/gpu_evidence.py --import-rows {evidence.out / evidence.stem}.json")
    return 0


def _predict_file(path: Path, profile: str) -> int:
    """--predict: reload an evidence file, predict its long runs, write it and its reports."""
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as error:
        print(f"gpu-evidence: --predict {path}: not a readable evidence file ({error})",
              file=sys.stderr)
        return 2
    # Earlier predictions are replaced; the file on disk changes only at render (atomic).
    evidence = Evidence(path.parent, path.stem, time.monotonic() + 3600,
                        [r for r in records if r["section"] != "long_prediction"])
    predict_long(evidence, profile)
    evidence.render()
    print(f"gpu-evidence: wrote {evidence.out / evidence.stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
