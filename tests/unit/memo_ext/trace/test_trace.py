"""memo_ext.trace and tools/trace.py: allocation traces of one training iteration.

Small models only (seconds each) except the ``slow`` 7B/1M-token run and the ``gpu`` CUDA path.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import re
import resource
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from megatron.training import tracing
import torch

from memo_ext import trace as T

REPO_ROOT = Path(__file__).resolve().parents[4]
TOOL_PATH = REPO_ROOT / "tools" / "trace.py"

# A small GPT: 2 layers, h 64, 4 heads (head dim 16), untied embeddings, bf16, TP=2 + SP, CP=2,
# the distributed optimizer.
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128", "--vocab-size", "512", "--untie-embeddings-and-output-weights",
         "--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--bf16",
         "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def tool():
    from megatron.memo_tools.cli import trace

    return trace


def record(tool, argv, **overrides):
    opts = tool.request_from_argv(argv)
    with tracing.traced_rank(opts) as rank:
        return rank.record(**overrides), rank.args


def event_keys(trace):
    return [tuple(e[k] for k in T.EVENT_FIELDS) for e in trace.events]


def expected_layer_skeletal_bytes(b, s, h, heads, tp, cp, element=2, cuda_semantics=True):
    """docs/memo.md's 16*b*s*h/(TP*CP) plus the documented differences (docs/tracing.md): layer-norm
    mean/rstd (2 norms x 2 statistics per token, fp32 on CUDA), megatron's unfused RoPE cos/sin
    (bf16 [s/CP, 1, 1, head_dim], for q and for k), flash attention's fp32 log-sum-exp."""
    formula = T.skeletal_formula_bytes(b, s, h, tp, cp, element)
    tokens_sp = b * s // (tp * cp)
    layer_norm_stats = 2 * 2 * tokens_sp * (4 if cuda_semantics else element)
    rope = 2 * 2 * (s // cp) * (h // heads) * element
    lse = b * (heads // tp) * (s // cp) * 4
    return formula + layer_norm_stats + rope + lse


# ------------------------------------------------------------------------- attention tiles

def _recorded(fn, fake: bool):
    """Events of ``fn()`` under an AllocationRecorder (and FakeTensorMode when ``fake``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorder = T.AllocationRecorder()
    if fake:
        with FakeTensorMode(allow_non_fake_inputs=True), recorder:
            kept = fn()
    else:
        with recorder:
            kept = fn()
    events = [e for e in recorder.trace().events if e["action"] == "alloc"]
    del kept
    return events


def test_attention_tiles_record_out_lse_and_declared_workspaces_never_s_by_s():
    """A 1M-token tile in the trainer's layout ([b, heads, s, d] views of [s, b, heads, d],
    batch 1, GQA, bf16) on torch's FlashAttention-2 build: the ops' outputs, then the requests
    kernels.forward_workspaces / backward_workspaces state, all linear in s."""
    s, b, n, g, d = 1 << 20, 1, 8, 2, 128  # 1M tokens: an s x s fp32 score tensor is 4 TiB
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memo_ext.attention import kernels
    from memo_ext.trace.cuda_rules import CudaTarget

    with FakeTensorMode():
        q, dout = (torch.empty(s, b, n, d, dtype=torch.bfloat16).permute(1, 2, 0, 3)
                   for _ in range(2))
        k, v = (torch.empty(s, b, g, d, dtype=torch.bfloat16).permute(1, 2, 0, 3)
                for _ in range(2))
    target = CudaTarget(compute_capability=(9, 0), sm_count=132, flash_attn=None)
    recorder = T.AllocationRecorder(target=target)
    with FakeTensorMode(allow_non_fake_inputs=True), recorder, kernels.declared_workspaces():
        out, lse = torch.ops.memo_attention.tile_forward(q, k, v, 0.1, True, 0.0, 0)
        grads = torch.ops.memo_attention.tile_backward(dout, q, k, v, out, lse, 0.1, True, 0.0,
                                                       0)
    allocs = [e for e in recorder.trace().events if e["action"] == "alloc"]
    softmax_d, dq_accum = kernels.flash_backward_workspace_shapes(b, n, s, d)
    heads_bytes, group_bytes = s * b * n * d * 2, s * b * g * d * 2
    assert [e["bytes"] for e in allocs] == [
        heads_bytes, b * n * s * 4,  # forward: out (bf16), lse (fp32 [b, heads, s_q])
        heads_bytes, heads_bytes,  # torch's build: K and V expanded to the 8 query heads
        16, 8,  # its RNG state and unused offset (no split-KV: the tile fills the GPU)
        heads_bytes, group_bytes, group_bytes,  # dq, dk, dv
        heads_bytes, heads_bytes,  # K and V expanded again for the backward kernel
        heads_bytes, heads_bytes,  # dK/dV of every query head, summed into dk/dv after
        math.prod(softmax_d) * 4, math.prod(dq_accum) * 4]  # mha_bwd's workspaces
    categories = [e["category"] for e in allocs]
    assert categories[2:6] == ["workspace"] * 4 and categories[9:] == ["workspace"] * 6
    # Linear in s: the largest is dq_accum (fp32 per token and head).
    assert max(e["bytes"] for e in allocs) == s * b * n * d * 4 < s * s
    assert tuple(lse.shape) == (b, n, s) and lse.dtype == torch.float32
    assert len(grads) == 3


def test_attention_tiles_live_and_fake_allocate_the_same():
    from memo_ext.attention import kernels

    def run():
        # The trainer's layout, [b, heads, s, d] views of [s, b, heads, d] at batch 1. (With
        # [b, heads, s, d]-contiguous inputs at batch > 1 the CPU kernel's out is laid out as
        # [b, s, heads, d] where the CUDA kernels' and the fake rule's follow q, so torch's
        # build would copy grad_out/out on CUDA and a live CPU trace could not see it.)
        q = torch.randn(32, 1, 4, 16, dtype=torch.bfloat16).permute(1, 2, 0, 3)
        k, v = (torch.randn(32, 1, 2, 16, dtype=torch.bfloat16).permute(1, 2, 0, 3)
                for _ in range(2))
        with kernels.declared_workspaces():
            out, lse = torch.ops.memo_attention.tile_forward(q, k, v, 0.25, True, 0.0, 0)
            return out, lse, torch.ops.memo_attention.tile_backward(
                torch.ones_like(out), q, k, v, out, lse, 0.25, True, 0.0, 0)

    live = [(e["bytes"], e["op"], e["category"]) for e in _recorded(run, fake=False)]
    fake = [(e["bytes"], e["op"], e["category"]) for e in _recorded(run, fake=True)]
    assert live == fake
    # Only the ops' outputs and their CUDA kernels' stated requests are recorded, never what
    # the CPU kernel computes inside.
    assert {op for _, op, _ in live} == {
        "aten.randn.default", "aten.ones_like.default", "memo_attention.tile_forward.default",
        "memo_attention.tile_backward.default"}
    # randn x3; out, lse + expanded K/V, RNG state x2; ones_like; dq, dk, dv + expanded K/V,
    # dK/dV per query head, softmax_d, dq_accum
    assert len(live) == 3 + 2 + 4 + 1 + 3 + 6


def test_context_parallel_trace_allocations_grow_linearly(tool):
    """The trainer's attention under CP=2 with MEMO at 16K and 32K tokens: the two traces make
    the same allocations in the same order, and none grows faster than the sequence (a score,
    softmax or mask tensor of s_local x s_global would grow 4x); the largest stays far below
    one head's s_local x s_global boolean mask, which the all-gather attention built per
    layer. (At 8K some gradient reductions of this small model still fit one thread block per
    output and take no scratch on CUDA -- memo_ext.trace.cuda_rules -- so the sequence
    changes below 16K. Likewise the flash forward's split-KV accumulators: with 2 heads per
    rank the 16K tiles are too short to fill an A800's 108 SMs and are split, the 32K ones are
    not. The A800, where the trainer dispatches FlashAttention-2: on the default Hopper it
    dispatches cuDNN, which does not split.)"""
    memo = ["--num-layers", "3", "--memo-offload", "--memo-alpha", "0.5", "--gpu", "a800"]
    traces = [record(tool, SMALL + memo + ["--seq-length", str(seq)])[0] for seq in (16384, 32768)]
    split = [[e for e in t.events if (e["module"] or "").startswith("flash forward: split-KV")]
             for t in traces]
    assert split[0] and not split[1]
    allocations = [[e for e in t.events if e["action"] == "alloc" and e["op"] and e not in s]
                   for t, s in zip(traces, split)]
    assert [e["op"] for e in allocations[0]] == [e["op"] for e in allocations[1]]
    for short, long in zip(*allocations):
        assert long["bytes"] <= 2 * short["bytes"], (short, long)
    largest = max(e["bytes"] for e in allocations[1])
    assert largest < 16384 * 32768 // 8, largest
    ops = {e["op"] for e in allocations[1]}
    assert {"memo_attention.tile_forward.default", "memo_attention.tile_backward.default"} <= ops
    # K/V travel the CP ring (ranks 0 and 2 of TP2 x CP2) point to point, never all-gathered.
    ring = {(c["phase"], c["op"]) for c in traces[1].header["work"]["collectives"]
            if c["ranks"] == [0, 2]}
    assert {(phase, op) for phase in ("forward", "backward") for op in ("send", "recv")} <= ring


# ------------------------------------------------------------------- live vs fake traces

# full-recompute and gqa-dp2-2mb are slow (~8 and ~6 s on 2 idle cores): the default suite keeps
# TP+SP with CP, a pipeline stage, MEMO's swap and recompute, and the fused RMSNorm path.
@pytest.mark.parametrize("extra", [
    [],                                                    # TP2 + SP, CP2
    ["--pipeline-model-parallel-size", "2", "--rank", "4"],  # last pipeline stage
    pytest.param(["--recompute-granularity", "full"],      # megatron full recompute
                 marks=pytest.mark.slow),
    ["--num-layers", "3", "--memo-offload", "--memo-alpha", "0.5"],  # MEMO swap + recompute
    pytest.param(["--context-parallel-size", "1", "--gpus", "4", "--num-query-groups", "2",
                  "--microbatches-in-flight", "2"], marks=pytest.mark.slow),  # GQA, DP 2
    ["--normalization", "RMSNorm"],                        # the fused rms_norm kernel path
], ids=["tp2-cp2", "pp-last-stage", "full-recompute", "memo", "gqa-dp2-2mb", "rmsnorm"])
def test_live_and_fake_traces_are_identical(tool, extra):
    live, _ = record(tool, SMALL + extra + ["--live"])
    fake, _ = record(tool, SMALL + extra)
    assert len(live.events) > 100
    assert event_keys(live) == event_keys(fake)


# --------------------------------------------------------------- skeletal bytes vs formula

@pytest.mark.parametrize("cuda_semantics", [True, False])
def test_layer_forward_skeletal_bytes_match_formula_with_documented_differences(
        tool, cuda_semantics):
    b, s, h, heads, tp, cp = 2, 256, 64, 4, 2, 2
    argv = ["--num-layers", "3", "--hidden-size", str(h), "--num-attention-heads", str(heads),
            "--seq-length", str(s), "--micro-batch-size", str(b), "--vocab-size", "512",
            "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", str(tp),
            "--context-parallel-size", str(cp), "--bf16", "--use-distributed-optimizer"]
    trace, _ = record(tool, argv + ([] if cuda_semantics else ["--no-cuda-semantics"]))
    summary = T.summarize(trace)
    expected = expected_layer_skeletal_bytes(b, s, h, heads, tp, cp,
                                             cuda_semantics=cuda_semantics)
    assert summary.layer_forward_skeletal_bytes == {0: expected, 1: expected, 2: expected}
    # The 16 elements per token x hidden/(TP*CP) are the table's tensors: check them one by one.
    element = b * s * h // (tp * cp) * 2
    skeletal = _skeletal_allocations(trace, layer=1)
    big = sorted(e["bytes"] // element for e in skeletal if e["bytes"] >= element)
    # LN1 out, q, k, v, attention out, residual sum, LN2 out, layer output (1 each); FC1 out and
    # GeLU out (4 each).
    assert big == [1] * 8 + [4, 4]


def _skeletal_allocations(trace, layer):
    start = next(i for i, e in enumerate(trace.events) if e["phase"] == "backward")
    live = {}
    for event in trace.events[:start]:
        if event["action"] == "alloc":
            live[event["id"]] = event
        else:
            live.pop(event["id"], None)
    return [e for e in live.values() if e["phase"] == "forward" and e["layer"] == layer]


def test_full_recompute_keeps_only_the_layer_input(tool):
    trace, _ = record(tool, SMALL + ["--recompute-granularity", "full"])
    summary = T.summarize(trace)
    layer_input = 128 // 2 * 64 // 2 * 2  # b*s/CP * h/TP, bf16
    assert summary.layer_forward_skeletal_bytes == {0: layer_input, 1: layer_input}
    assert any(e["phase"] == "recompute" and e["layer"] == 1 for e in trace.events)


# ------------------------------------------------------------------ what a rank holds

def test_rank_state_categories_phases_and_attribution(tool):
    trace, _ = record(tool, SMALL)
    events = trace.events
    by = lambda **kw: [e for e in events if all(e[k] == v for k, v in kw.items())]
    params = sum(e["bytes"] for e in by(phase="init", category="parameter"))
    grads = sum(e["bytes"] for e in by(phase="init", category="gradient"))
    optimizer = by(phase="init", category="optimizer")
    # Distributed optimizer over DP x CP = 2: each rank holds half of every (padded) bucket in
    # fp32 three times (master weights, exp_avg, exp_avg_sq); the gradient buffer is fp32.
    assert grads == 2 * params  # fp32 grad buffer vs bf16 param buffer, same padded numel
    # (Up to the buckets' padding, which no parameter shard covers.)
    shard = sum(e["bytes"] for e in optimizer)
    assert 0 <= 3 * grads // 2 - shard < 0.01 * shard
    assert {e["module"].rsplit(".", 1)[-1] for e in optimizer} == {
        "master_fp32", "exp_avg", "exp_avg_sq"}
    constants = {e["module"]: e for e in by(phase="init", category="workspace")
                 if e["module"].startswith("constant:")}
    assert set(constants) == {"constant:cuda_context", "constant:nccl:tp", "constant:nccl:cp",
                              "constant:nccl:dp_cp"}
    assert constants["constant:cuda_context"]["pool"] == "external"
    # Steady state: the main and the autograd thread's cuBLAS workspaces (memo_ext cuda_rules).
    blas = [e for e in events if (e["module"] or "").startswith("cuBLAS workspace")]
    assert [(e["phase"], e["pool"], e["action"]) for e in blas] == [("init", "device", "alloc")] * 2
    # Steady state: the sequence-parallel all-gather buffer exists before the iteration.
    assert [e for e in by(phase="init", category="workspace")
            if (e["module"] or "").startswith("global_memory_buffer")]
    # Backward is attributed to layers through the autograd nodes' tags.
    backward_layers = {e["layer"] for e in by(phase="backward", action="alloc")}
    assert {0, 1} <= backward_layers
    # Weight gradients (before DDP adds them into main_grad) are category "gradient".
    wgrads = by(phase="backward", action="alloc", category="gradient")
    assert any(e["module"] == "decoder.layers.1.mlp.linear_fc1" for e in wgrads)
    flash_workspace = by(phase="backward", action="alloc", category="workspace")
    assert flash_workspace and all(e["layer"] in (0, 1) for e in flash_workspace)
    # Every allocation of the iteration is freed by its end; ids pair up.
    summary = T.summarize(trace)
    assert summary.iteration_leftover_bytes == 0
    assert summary.final_live_bytes == sum(summary.persistent_by_category.values())
    allocs = {e["id"] for e in by(action="alloc")}
    assert {e["id"] for e in by(action="free")} <= allocs
    assert len(allocs) == len(by(action="alloc"))


def test_memo_host_slots_are_host_pool(tool):
    trace, _ = record(tool, SMALL + ["--num-layers", "4", "--memo-offload", "--memo-alpha", "1"])
    host = [e for e in trace.events if e["pool"] == "host" and e["action"] == "alloc"]
    assert host and all(e["module"].startswith("decoder.layers.") for e in host)
    summary = T.summarize(trace)
    assert summary.host_peak_bytes == sum(e["bytes"] for e in host)


# ---------------------------------------------------------------- MemTracker cross-check

class _CallableBufferList(list):
    """megatron DDP keeps its gradient buffers in ``self.buffers`` (a list), shadowing
    nn.Module.buffers(), which MemTracker calls: answer both."""

    def __init__(self, items, module):
        super().__init__(items)
        self.module = module

    def __call__(self, recurse=True):
        return torch.nn.Module.buffers(self.module, recurse)


@pytest.mark.parametrize("extra", [[], ["--num-layers", "3", "--memo-offload", "--memo-alpha",
                                        "0.5"]], ids=["plain", "memo"])
def test_peak_agrees_with_memtracker(tool, extra):
    """torch.distributed._tools.mem_tracker.MemTracker on the same fake run sees the same peak
    (its snapshot counts every storage on the CPU device, host slots included; our constants are
    not tensors; CPU dtypes, since MemTracker sees real op outputs)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    opts = tool.request_from_argv(SMALL + extra + ["--no-cuda-semantics"])
    with tracing.traced_rank(opts) as rank:
        rank.model.buffers = _CallableBufferList(rank.model.buffers, rank.model)
        params, grads = T.persistent_tensors(rank.model)
        tracker = MemTracker()
        tracker.track_external(*[t for _, t in params + grads])
        with tracker:
            trace = rank.record(warmup="none")  # MemTracker refuses a module called twice
        theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    live = ours = 0
    for event in trace.events:
        if (event["module"] or "").startswith("constant:"):
            continue
        live += event["bytes"] if event["action"] == "alloc" else -event["bytes"]
        ours = max(ours, live)
    assert ours == theirs


# ------------------------------------------------------------------------ file format

def test_gzip_jsonl_round_trip_and_reader_checks(tool, tmp_path):
    trace, _ = record(tool, SMALL)
    path = tmp_path / "t.jsonl.gz"
    T.write_trace(trace, path)
    again = T.read_trace(path)
    assert again.events == trace.events
    assert again.header["format"] == T.TRACE_FORMAT and again.header["version"] == 1
    assert again.header["layout"]["tp"] == 2 and again.header["layout"]["cp_rank"] == 0
    assert again.header["model"]["padded_vocab_size"] == 512
    with gzip.open(path, "rt") as f:
        lines = f.read().splitlines()
    assert len(lines) == 1 + len(trace.events)
    assert set(json.loads(lines[1])) == set(T.EVENT_FIELDS)
    # Deterministic bytes (gzip mtime 0).
    T.write_trace(trace, tmp_path / "u.jsonl.gz")
    assert path.read_bytes() == (tmp_path / "u.jsonl.gz").read_bytes()
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps({"format": "something-else", "version": 1}) + "\n")
    with pytest.raises(ValueError, match="not a memo-alloc-trace"):
        T.read_trace(bad)
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps({"format": T.TRACE_FORMAT, "version": 1}) + "\n")
        f.write(json.dumps({"id": 1, "action": "alloc"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl.gz:2: event lacks"):
        T.read_trace(bad)


def test_allocator_models_read_the_trace(tool, tmp_path):
    import memo_ext.alloc as alloc

    trace, _ = record(tool, SMALL)
    path = tmp_path / "t.jsonl.gz"
    T.write_trace(trace, path)
    loaded = alloc.load_trace(path)
    device = [e for e in trace.events if e["pool"] == "device"]
    assert len(loaded) == len(device)
    assert loaded.sizes.tolist() == [e["bytes"] for e in device]


def test_snapshot_export_reads_back_through_the_restricted_reader(tool, tmp_path):
    """Exported as a PyTorch memory snapshot, the trace opens with our restricted unpickler
    (so it holds only builtin containers and scalars, as memory_viz needs) and converts back
    to the same device events, in order, and replays like the trace itself."""
    import memo_ext.alloc as alloc
    from memo_ext.alloc.snapshot import load_snapshot

    trace, _ = record(tool, SMALL)
    path = tmp_path / "t.pickle"
    T.write_snapshot(trace, path)
    assert not (tmp_path / "t.pickle.partial").exists()
    snapshot = load_snapshot(path)
    entries = snapshot["device_traces"][0]
    device = [e for e in trace.events if e["pool"] == "device"]
    assert [e["size"] for e in entries] == [e["bytes"] for e in device]
    assert {e["action"] for e in entries} == {"alloc", "free_completed"}
    assert json.loads(snapshot["memo_trace_header"])["layout"]["tp"] == 2
    forward = next(e for e in entries if "forward, layer 1" in e["frames"][0]["name"])
    assert forward["frames"][0]["line"] == 1
    back = T.trace_from_snapshot(snapshot)
    assert [(e["action"], e["bytes"]) for e in back.events] == [
        (e["action"], e["bytes"]) for e in device]
    from_snapshot = alloc.replay(alloc.snapshot_trace(snapshot), "caching")
    from_trace = alloc.replay(alloc.load_trace(_written(trace, tmp_path)), "caching")
    assert (from_snapshot.peak_allocated_bytes, from_snapshot.peak_reserved_bytes) == (
        from_trace.peak_allocated_bytes, from_trace.peak_reserved_bytes)


def _written(trace, tmp_path):
    path = tmp_path / "w.jsonl.gz"
    T.write_trace(trace, path)
    return path


def test_cli_writes_trace_and_prints_summary(tool, tmp_path):
    out = tmp_path / "cli.jsonl.gz"
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert tool.main(SMALL + ["-o", str(out)]) == 0
    text = buffer.getvalue()
    assert re.search(r"events: \d+ \(\d+ allocs, \d+ frees\)", text)
    assert "peak live:" in text and "at peak by category:" in text
    assert "per-layer forward skeletal bytes" in text and "layers 0-1:" in text
    assert T.read_trace(out).header["mode"] == "fake"


def test_cli_refuses_auto_alpha_and_bad_rank(tool):
    with pytest.raises(SystemExit, match="--memo-alpha auto"):
        tool.main(SMALL + ["--num-layers", "4", "--memo-offload", "--memo-alpha", "auto"])
    with pytest.raises(SystemExit, match="--rank 9 is outside"):
        tool.main(SMALL + ["--rank", "9"])


def test_communicators_and_constants():
    assert T.communicators_for_layout(1, 1, 1, 1) == []
    assert T.communicators_for_layout(4, 2, 1, 1) == ["tp", "cp", "dp_cp"]
    assert T.communicators_for_layout(8, 1, 4, 2) == ["tp", "dp_cp", "pp"]
    entries = T.ProcessConstants().entries(["tp"])
    assert [name for name, _, _ in entries] == ["constant:cuda_context", "constant:nccl:tp"]
    assert T.NCCL_BYTES_PER_COMMUNICATOR == 128 * T.MiB


# ------------------------------------------------------------------------------ 7B, 1M

@pytest.mark.slow
def test_7b_one_million_tokens_tp4_cp2_under_a_minute(tmp_path):
    """The whole process (imports included) in under 60 s. CPU time is always checked; wall
    time too unless other jobs already overload this machine's cores (then it measures them)."""
    out = tmp_path / "7b.jsonl.gz"
    command = [sys.executable, str(TOOL_PATH), "--model", "7b", "--seq-length", "1048576",
               "--tensor-model-parallel-size", "4", "--context-parallel-size", "2",
               "--pipeline-model-parallel-size", "1", "--rank", "0", "--bf16",
               "--use-distributed-optimizer", "-o", str(out)]
    overloaded = os.getloadavg()[0] > (os.cpu_count() or 1)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            check=False)
    wall = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (children.ru_utime - children_before.ru_utime
           + children.ru_stime - children_before.ru_stime)
    assert result.returncode == 0, result.stderr[-4000:]
    assert cpu < 60, f"7B 1M trace used {cpu:.1f} CPU seconds\n{result.stdout}"
    if not overloaded:
        assert wall < 60, f"7B 1M trace took {wall:.1f} s\n{result.stdout}"
    assert children.ru_maxrss < 2 * 1024 * 1024  # KiB: well under 2 GiB resident
    trace = T.read_trace(out)
    summary = T.summarize(trace)
    expected = expected_layer_skeletal_bytes(1, 1 << 20, 4096, 32, 4, 2)
    assert summary.layer_forward_skeletal_bytes == {layer: expected for layer in range(32)}
    assert "layers 0-31:" in result.stdout
    # Never an s x s tensor: the largest allocation is the fp32 logits [s/CP, b, V/TP].
    assert max(e["bytes"] for e in trace.events) <= (1 << 19) * 50688 // 4 * 4


# ----------------------------------------------------------------------------- (a) CUDA

@pytest.mark.gpu
def test_cuda_snapshot_trace_matches_recorder_on_cuda():
    """Mode (a): the caching allocator's own trace of a CUDA step has the recorder's requests,
    rounded up to the allocator's 512-byte granularity (or a not-split block)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 256)).cuda()
    x = torch.randn(64, 256, device="cuda")

    def step():
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    step()  # cuBLAS workspace and other first-call state
    torch.cuda.synchronize()
    recorder = T.AllocationRecorder()
    with recorder:
        step()
    torch.cuda.synchronize()
    ours = [e["bytes"] for e in recorder.trace().events if e["action"] == "alloc"]
    cuda_trace, summary = T.record_cuda_trace(step)
    theirs = [e["bytes"] for e in cuda_trace.events if e["action"] == "alloc"]
    assert len(theirs) == len(ours)
    for requested, block in zip(ours, theirs):
        assert requested <= block < requested + 2 * T.MiB
    assert summary.num_allocs == len(theirs)


class _Restarted(Exception):
    pass


@pytest.mark.parametrize("visible, available, restarts", [
    (None, True, True), ("0", True, True), ("", True, False), (None, False, False)])
def test_a_command_line_on_a_gpu_node_restarts_with_no_gpu_visible(
        tool, monkeypatch, visible, available, restarts):
    """The CPU shims refuse a process that sees CUDA (seen on an H100), so the command line
    replaces itself with CUDA_VISIBLE_DEVICES empty; an in-process caller is never replaced."""
    calls = []

    def execve(path, args, env):
        calls.append((path, args, env))
        raise _Restarted

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(sys, "argv", ["memo-trace", "--seq-length", "512"])
    if restarts:
        with pytest.raises(_Restarted):
            tool.main()
        (path, args, env), = calls
        assert path == sys.executable and env["CUDA_VISIBLE_DEVICES"] == ""
        assert args == [sys.executable, "-m", "megatron.memo_tools.cli.trace", "--seq-length", "512"]
    else:
        tool.hide_gpus_by_restarting()
        assert calls == []
