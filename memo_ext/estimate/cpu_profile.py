"""The ``cpu`` hardware profile: this machine, micro-benchmarked the way the estimator's time
model (memo_ext.estimate.cost) sees a GPU, so that the CPU trainer (pretrain_gpt.py under
torchrun, gloo, fp32) becomes a second oracle for the model's accounting (docs/cpu_oracle.md).

Nothing here is fitted to the trainer's iteration times: every number is a micro-benchmark,
taken in ``ranks`` processes at once, each with the threads a rank of the predicted job uses,
so that shared cores, caches and memory bandwidth are shared as they are in training. Measured,
per rank (rank 0's median of ``repeats`` runs after a warm-up):

* ``bf16_tflops``: the reference peak, the best of the runs of a square fp32 GEMM of
  PEAK_GEMM_SIZE (the key keeps the GPU profiles' name; the CPU trainer runs fp32). Every
  efficiency is a fraction of it;
* ``kernels.gemm``: the layout's GEMMs (memo_ext.estimate.kernels.model_gemms) as megatron's
  linear layers run them: forward ``x @ w.t()``, input gradient ``g @ w``, weight gradient
  ``g.t() @ x``. The cost model applies one GEMM efficiency to all three, so a row at the
  forward shape carries their combined rate (the three apart: ``forward_tflops``,
  ``input_grad_tflops``, ``weight_grad_tflops``);
* ``kernels.attention``: the trainer's own attention kernels (memo_ext.attention's
  ``tile_forward`` and ``tile_backward``) on the tiles one context-parallel rank computes over
  the whole ring (memo_ext.attention.zigzag), forward and backward, at ``seq_len`` = the rank's
  tokens, the key the kernel tables are read by;
* ``hbm_gbps``: six element-wise ops of a layer (residual add, bias add, GeLU and its
  backward, layer norm, RoPE's concatenation; :func:`_memory_gbps`), out of place as the
  trainer runs them, at the layout's activation shapes: bytes read and written over time, as
  memo_ext.trace.work counts ``memory_bytes``. Fresh outputs above glibc's mmap threshold
  fault their pages in on every call; that cost is part of what the trainer pays, so it is
  part of the rate;
* ``pcie_gbps`` and ``host_copy_overlap``: MEMO's offload copies through the CopyEngine the
  trainer uses (memo_ext.device: a worker thread per direction), bandwidth with every rank
  copying at once, and the fraction of a copy's time that hides under a concurrent GEMM loop
  (the CPU's copy thread competes with compute for the same cores);
* ``host_memory_gbps``: torch's fused AdamW on a layer's weights (the host step of
  --optimizer-cpu-offload), host bytes it reads and writes over time, every rank at once,
  summed over the ranks (a GPU profile's is the node's DRAM bandwidth);
* ``collective_ops`` (more than one rank): gloo's all-reduce, all-gather, reduce-scatter and
  the point-to-point exchange, each as a latency per call (a small message) and a bandwidth
  on the wire (a message of the layout's activation size, by the ring formula the cost model
  uses). ``nvlink_gbps``/``ib_gbps`` (one machine: both) is the all-reduce's;
* ``single_rank_ops`` (one rank): the distributed optimizer still reduce-scatters its gradient
  buffer and all-gathers its parameter buffer over its data-parallel group when that group has
  one rank (megatron-core calls the collectives whatever the size). NCCL does nothing for an
  in-place collective of one rank; gloo copies, at about a tenth of a memory copy's rate here
  (measured: 235 MB all-gathered in 0.19 s, reduce-scattered in 0.094 s). Each measured as
  megatron-core calls it, in place on a buffer the size of the rank's share of the model's
  parameters (fp32; the MFU formula's count), as a latency per call and a rate.

Profile entry point: :func:`measure_cpu_profile`; ``tools/estimate.py --gpu cpu`` calls it at
startup. Written here because no benchmark suite measures a machine in the cost model's terms.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from memo_ext.estimate.flops import parameter_count
from memo_ext.estimate.models import padded_vocab_size

CPU_PROFILE = "cpu"
#: Side of the square fp32 GEMM whose rate is the reference peak.
PEAK_GEMM_SIZE = 2048
#: Bytes of the small message whose time is a collective's latency.
LATENCY_PROBE_BYTES = 4096
#: Seconds a benchmark child gets before it is taken for hung.
WORKER_TIMEOUT_S = 600


class CpuProfileError(ValueError):
    """A CPU profile that cannot be measured; one line naming the input at fault and the fix."""


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0))


def cpu_name() -> str:
    """This machine's processor as /proc/cpuinfo names it (``platform`` elsewhere): what the
    benchmarks and recorded estimator runs say they ran on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def threads_per_rank(ranks: int) -> int:
    """Intra-op threads of each of ``ranks`` processes sharing this machine's cores."""
    return max(1, cores() // ranks)


def measure_cpu_profile(model: dict, layout: dict, *, ranks: int,
                        threads: Optional[int] = None, repeats: int = 3,
                        log: Callable[[str], None] = lambda line: None) -> dict:
    """The ``cpu`` profile (the keys of hardware.json's, plus ``kernels``,
    ``collective_ops`` and ``host_copy_overlap``) for ``layout`` (tp, cp, pp,
    micro_batch_size) of ``model`` (a trace header's ``model`` or a model shape with
    ``seq_length``), measured in ``ranks`` processes of ``threads`` threads (default: the
    cores shared out)."""
    threads = threads or threads_per_rank(ranks)
    if ranks < 1 or threads < 1 or repeats < 1:
        raise CpuProfileError(f"ranks {ranks}, threads {threads}, repeats {repeats}: each must "
                              "be at least 1")
    tp, cp = int(layout["tp"]), int(layout["cp"])
    heads = int(model["num_attention_heads"])
    groups = int(model.get("num_query_groups") or heads)
    if heads % tp or groups % tp:
        raise CpuProfileError(f"--tensor-model-parallel-size {tp}: {heads} heads ({groups} "
                              "groups) do not divide by it")
    if model["seq_length"] % (2 * cp if cp > 1 else 1):
        raise CpuProfileError(f"--seq-length {model['seq_length']}: context parallelism {cp} "
                              f"needs a multiple of {2 * cp}")
    # 128: the trainer's default --make-vocab-size-divisible-by.
    model = {**model, "padded_vocab_size": model.get("padded_vocab_size")
             or padded_vocab_size(model["vocab_size"], 128, tp)}
    spec = {"model": model, "layout": {"micro_batch_size": 1, "pp": 1, **layout},
            "threads": threads, "repeats": repeats}
    started = time.perf_counter()
    measured = _run_workers(spec, ranks)
    log(f"cpu profile: {ranks} rank(s) x {threads} thread(s) measured in "
        f"{time.perf_counter() - started:.0f} s")
    return _profile(measured, ranks, threads)


def _profile(measured: dict, ranks: int, threads: int) -> dict:
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    collectives = measured.get("collective_ops") or {}
    # One machine: every group is "within a node"; with one rank no collective moves bytes,
    # and the links stand at the host-copy bandwidth (a copy is what a one-rank link is).
    link = collectives.get("all_reduce", {}).get("gbps", measured["pcie_gbps"])
    return {
        "name": CPU_PROFILE, "hardware_file": None, "device_type": "cpu",
        "ranks": ranks, "threads_per_rank": threads,
        "device_memory_bytes": memory_bytes // ranks,
        "host_memory_gb_per_node": memory_bytes / 1e9,
        "gpus_per_node": ranks,
        "compute_capability": None, "sm_count": None,  # no CUDA kernels, no workspaces
        "bf16_tflops": measured["peak_tflops"],
        "hbm_gbps": measured["hbm_gbps"],
        "pcie_gbps": measured["pcie_gbps"],
        "nvlink_gbps": link, "ib_gbps": link,
        "host_copy_overlap": measured["host_copy_overlap"],
        # every rank's host Adam at once: the node's rate is the ranks' sum
        "host_memory_gbps": measured["host_adam_gbps"] * ranks,
        "collective_ops": collectives,
        "single_rank_ops": measured.get("single_rank_ops") or {},
        "kernels": measured["kernels"],
        # Bandwidths above are what the ops achieve, not datasheet peaks; CPU memory is
        # malloc'd, so there is no caching allocator to reorganise.
        "efficiency": {"memory": 1.0, "collective": 1.0, "pcie": 1.0,
                       "reorganisation_s": 0.0},
        "measured": measured["details"],
    }


# ----------------------------------------------------------------------------- the workers

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_workers(spec: dict, ranks: int) -> dict:
    """Run :func:`_worker` in ``ranks`` fresh processes (a gloo world, as torchrun starts the
    trainer's), rank 0's measurements back."""
    with tempfile.TemporaryDirectory(prefix="memo_cpu_profile_") as workdir:
        spec_path, out_path = Path(workdir) / "spec.json", Path(workdir) / "measured.json"
        spec_path.write_text(json.dumps(spec))
        port = free_port()
        children = []
        for rank in range(ranks):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": str(spec["threads"])}
            children.append(subprocess.Popen(
                [sys.executable, "-m", __name__, str(spec_path), str(out_path)], env=env,
                cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = []
        try:
            for child in children:
                outputs.append(child.communicate(timeout=WORKER_TIMEOUT_S)[0])
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        failed = [(child.returncode, out) for child, out in zip(children, outputs)
                  if child.returncode]
        if failed or not out_path.exists():
            status, out = failed[0] if failed else (0, outputs[0] if outputs else "")
            last = ([line for line in out.splitlines() if line.strip()] or ["(no output)"])[-1]
            raise CpuProfileError(f"the CPU micro-benchmarks failed (exit status {status}): "
                                  f"{last}")
        return json.loads(out_path.read_text())


def _worker(spec_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    bench = _Bench(spec["repeats"], dist.barrier if world > 1 else lambda: None)
    model, layout = spec["model"], spec["layout"]
    measured = {"peak_tflops": _peak_tflops(bench)}
    gemm_rows = _gemm_rows(bench, model, layout)
    # megatron's rank order puts TP innermost, then CP
    cp_rank = rank // layout["tp"] % layout["cp"]
    attention_rows = _attention_rows(bench, model, layout, cp_rank)
    measured["kernels"] = {"gemm": gemm_rows, "attention": attention_rows}
    measured["hbm_gbps"], memory_details = _memory_gbps(bench, model, layout)
    measured["pcie_gbps"], measured["host_copy_overlap"], copy_details = \
        _host_copies(bench, model, layout)
    measured["host_adam_gbps"] = _host_adam_gbps(bench, model)
    if world > 1:
        measured["collective_ops"] = _collective_ops(bench, model, layout)
    else:
        measured["collective_ops"], measured["single_rank_ops"] = {}, _single_rank_ops(
            bench, model, layout)
    measured["details"] = {"memory_ops": memory_details, "host_copies": copy_details,
                           "threads": torch.get_num_threads(), "repeats": spec["repeats"]}
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(measured))


class _Bench:
    """Seconds of a call: every rank runs it at once (a barrier before each run), ``repeats``
    runs after one warm-up."""

    def __init__(self, repeats: int, barrier: Callable[[], None]) -> None:
        self.repeats, self.barrier = repeats, barrier

    def times(self, call: Callable[[], object]) -> list[float]:
        call()
        times = []
        for _ in range(self.repeats):
            self.barrier()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return times

    def seconds(self, call: Callable[[], object]) -> float:
        """The median run."""
        return statistics.median(self.times(call))


def _peak_tflops(bench: _Bench) -> float:
    import torch

    a = torch.randn(PEAK_GEMM_SIZE, PEAK_GEMM_SIZE)
    b = torch.randn(PEAK_GEMM_SIZE, PEAK_GEMM_SIZE)
    return 2 * PEAK_GEMM_SIZE ** 3 / min(bench.times(lambda: torch.matmul(a, b))) / 1e12


def _gemm_rows(bench: _Bench, model: dict, layout: dict) -> list[dict]:
    """A row per distinct GEMM shape of the layout (module docstring)."""
    import torch

    from memo_ext.estimate.kernels import model_gemms

    rows = []
    for m, n, k in sorted({(m, n, k) for m, n, k, _ in model_gemms(model, layout)}):
        x, w, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
        times = [bench.seconds(lambda: torch.matmul(x, w.t())),
                 bench.seconds(lambda: g.matmul(w)),
                 bench.seconds(lambda: g.t().matmul(x))]
        flops = 2.0 * m * n * k
        rows.append({"m": m, "n": n, "k": k, "tflops": 3 * flops / sum(times) / 1e12,
                     **{f"{name}_tflops": flops / t / 1e12 for name, t in
                        zip(("forward", "input_grad", "weight_grad"), times)}})
    return rows


def _attention_rows(bench: _Bench, model: dict, layout: dict, cp_rank: int) -> list[dict]:
    """Forward and backward rows of the rank's causal attention over the context-parallel ring:
    every tile of every ring step, on views of [s, b, heads, d] tensors as
    memo_ext.attention.ring_attention takes them."""
    import torch

    import memo_ext.attention.kernels  # noqa: F401  (registers the tile ops)
    from memo_ext.attention.zigzag import ZigzagLayout
    from memo_ext.trace.work import TILE_BACKWARD_OP, TILE_FORWARD_OP, attention_flops

    tp, cp = layout["tp"], layout["cp"]
    heads = model["num_attention_heads"] // tp
    groups = (model.get("num_query_groups") or model["num_attention_heads"]) // tp
    head_dim = model.get("kv_channels") or model["hidden_size"] // model["num_attention_heads"]
    seq = model["seq_length"] // cp
    batch = layout["micro_batch_size"]
    zigzag = ZigzagLayout(model["seq_length"], cp)
    tiles = [tile for step in range(cp)
             for tile in zigzag.tiles(cp_rank, (cp_rank + step) % cp)]
    scale = 1.0 / math.sqrt(head_dim)

    def heads_first(*shape):
        return torch.randn(*shape).permute(1, 2, 0, 3)

    q, dout = heads_first(seq, batch, heads, head_dim), heads_first(seq, batch, heads, head_dim)
    k, v = heads_first(seq, batch, groups, head_dim), heads_first(seq, batch, groups, head_dim)
    forward_args = [(q[:, :, t.rows], k[:, :, t.cols], v[:, :, t.cols], scale, t.causal, 0.0, 0)
                    for t in tiles]
    outputs = [torch.ops.memo_attention.tile_forward(*args) for args in forward_args]
    backward_args = [(dout[:, :, t.rows], *args[:3], out, lse, scale, t.causal, 0.0, 0)
                     for t, args, (out, lse) in zip(tiles, forward_args, outputs)]

    def run(op, calls):
        return lambda: [op(*args) for args in calls]

    forward_s = bench.seconds(run(torch.ops.memo_attention.tile_forward, forward_args))
    backward_s = bench.seconds(run(torch.ops.memo_attention.tile_backward, backward_args))
    forward_flops = sum(attention_flops(TILE_FORWARD_OP, args) for args in forward_args)
    backward_flops = sum(attention_flops(TILE_BACKWARD_OP, args) for args in backward_args)
    return [{"direction": direction, "causal": True, "head_dim": head_dim, "seq_len": seq,
             "heads": heads, "tflops": flops / seconds / 1e12}
            for direction, flops, seconds in (("forward", forward_flops, forward_s),
                                              ("backward", backward_flops, backward_s))]


def _activation_shapes(model: dict, layout: dict) -> tuple[int, int, int, int]:
    """(tokens, tokens outside the TP region, hidden, MLP width per rank) of a micro-batch."""
    tp, cp = layout["tp"], layout["cp"]
    tokens = model["seq_length"] // cp * layout["micro_batch_size"]
    sequence_parallel = layout.get("sequence_parallel", tp > 1)
    return (tokens, tokens // tp if sequence_parallel else tokens, model["hidden_size"],
            model["ffn_hidden_size"] // tp)


def _memory_gbps(bench: _Bench, model: dict, layout: dict) -> tuple[float, dict]:
    """Bytes the ops move over their seconds, together and each op's own (GB/s)."""
    import torch
    import torch.nn.functional as F

    tokens, outside, hidden, ffn = _activation_shapes(model, layout)
    heads = model["num_attention_heads"] // layout["tp"]
    head_dim = model.get("kv_channels") or hidden // model["num_attention_heads"]
    residual, other = torch.randn(outside, hidden), torch.randn(outside, hidden)
    mlp, mlp_grad, bias = torch.randn(tokens, ffn), torch.randn(tokens, ffn), torch.randn(ffn)
    weight = torch.ones(hidden)
    half = torch.randn(tokens, heads, head_dim // 2)
    element = 4
    ops = {  # name: (call, bytes read and written, as memo_ext.trace.work counts them)
        "residual add": (lambda: residual + other, 3 * residual.numel() * element),
        "bias add": (lambda: mlp + bias, (2 * mlp.numel() + ffn) * element),
        "gelu": (lambda: F.gelu(mlp), 2 * mlp.numel() * element),
        "gelu backward": (lambda: torch.ops.aten.gelu_backward(mlp_grad, mlp),
                          3 * mlp.numel() * element),
        "layer norm": (lambda: F.layer_norm(residual, (hidden,), weight, weight),
                       2 * residual.numel() * element),
        "rope cat": (lambda: torch.cat([half, half], dim=-1), 4 * half.numel() * element),
    }
    seconds = {name: bench.seconds(call) for name, (call, _) in ops.items()}
    total = sum(nbytes for _, nbytes in ops.values()) / sum(seconds.values())
    return total / 1e9, {name: ops[name][1] / seconds[name] / 1e9 for name in ops}


def _host_adam_gbps(bench: _Bench, model: dict) -> float:
    """GB/s of host memory traffic torch's fused AdamW makes on one rank (the host step of
    --optimizer-cpu-offload, memo_ext.estimate.offload_step: ADAM_BYTES_PER_ELEMENT per element),
    on a tensor of one transformer layer's weights."""
    import torch

    from memo_ext.estimate.offload_step import ADAM_BYTES_PER_ELEMENT

    hidden = int(model["hidden_size"])
    numel = 4 * hidden * hidden + 2 * hidden * int(model.get("ffn_hidden_size") or 4 * hidden)
    param = torch.zeros(numel)
    param.grad = torch.ones(numel)
    optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
    seconds = statistics.median(bench.times(optimizer.step))
    return ADAM_BYTES_PER_ELEMENT * numel / seconds / 1e9


def _host_copies(bench: _Bench, model: dict, layout: dict) -> tuple[float, float, dict]:
    """(GB/s of an offload with every rank copying, fraction of copy time hidden under a
    concurrent GEMM loop, details) through memo_ext.device's CPU CopyEngine."""
    import torch

    from memo_ext.device import CopyEngine, measure_offload_bandwidth

    tokens, _, hidden, ffn = _activation_shapes(model, layout)
    nbytes = tokens * hidden * 4
    with CopyEngine("cpu", copy_delay_s=0.0) as engine:
        bandwidth = measure_offload_bandwidth(engine, nbytes, repeats=bench.repeats,
                                              barrier=bench.barrier)
        src, dst = engine.alloc_device(nbytes), engine.alloc_host(nbytes)
        src.fill_(1)
        x, w = torch.randn(tokens, hidden), torch.randn(ffn, hidden)
        gemm_s = bench.seconds(lambda: torch.matmul(x, w.t()))
        copies = max(1, round(2 * gemm_s * bandwidth / nbytes))  # ~ as long as the GEMMs

        def offload():
            for _ in range(copies):
                engine.offload(dst, src)
            engine.synchronize()

        def gemms():
            for _ in range(2):
                torch.matmul(x, w.t())

        def both():
            for _ in range(copies):
                engine.offload(dst, src)
            gemms()
            engine.synchronize()

        alone = (bench.seconds(gemms), bench.seconds(offload))
        together = bench.seconds(both)
    hidden_s = sum(alone) - together
    overlap = min(1.0, max(0.0, hidden_s / min(alone)))
    return bandwidth / 1e9, overlap, {"gemm_s": alone[0], "copy_s": alone[1],
                                      "together_s": together, "copy_bytes": copies * nbytes}


def _collective_ops(bench: _Bench, model: dict, layout: dict) -> dict:
    """{op: {"latency_s", "gbps"}} over the world group (module docstring)."""
    import torch
    import torch.distributed as dist

    from memo_ext.estimate.cost import wire_fraction

    world = dist.get_world_size()
    rank = dist.get_rank()
    tokens, _, hidden, _ = _activation_shapes(model, layout)
    large = tokens * hidden * 4

    def all_reduce(nbytes):
        buffer = torch.ones(nbytes // 4)
        return lambda: dist.all_reduce(buffer)

    def all_gather(nbytes):  # nbytes: the output, as memo_ext.trace.work counts it
        out = torch.empty(nbytes // 4)
        shard = torch.ones(nbytes // 4 // world)
        return lambda: dist.all_gather_into_tensor(out, shard)

    def reduce_scatter(nbytes):  # nbytes: the input
        full = torch.ones(nbytes // 4)
        out = torch.empty(nbytes // 4 // world)
        return lambda: dist.reduce_scatter_tensor(out, full)

    def send(nbytes):  # the ring's exchange: send to the previous rank, receive from the next
        out, into = torch.ones(nbytes // 4), torch.empty(nbytes // 4)

        def exchange():
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, out, (rank - 1) % world),
                dist.P2POp(dist.irecv, into, (rank + 1) % world)])
            for work in works:
                work.wait()
        return exchange

    measured = {}
    for op, make in (("all_reduce", all_reduce), ("all_gather", all_gather),
                     ("reduce_scatter", reduce_scatter), ("send", send)):
        latency = bench.seconds(make(LATENCY_PROBE_BYTES))
        seconds = bench.seconds(make(large))
        wire = wire_fraction(op, world) * large
        measured[op] = {"latency_s": latency,
                        "gbps": wire / max(seconds - latency, 1e-9) / 1e9}
    return measured


def _single_rank_ops(bench: _Bench, model: dict, layout: dict) -> dict:
    """{op: {"latency_s", "gbps"}} of gloo's all-gather and reduce-scatter in place over a
    group of this one rank, the message the rank's parameters in fp32 (module docstring)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        elements = parameter_count(model) // (layout["tp"] * layout.get("pp", 1))
        measured = {}
        for op, call in (("all_gather", dist.all_gather_into_tensor),
                         ("reduce_scatter", dist.reduce_scatter_tensor)):
            probe, buffer = torch.ones(LATENCY_PROBE_BYTES // 4), torch.ones(elements)
            latency = bench.seconds(lambda: call(probe, probe))
            seconds = bench.seconds(lambda: call(buffer, buffer))
            measured[op] = {"latency_s": latency,
                            "gbps": 4 * elements / max(seconds - latency, 1e-9) / 1e9}
            del buffer
        return measured
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
