"""Time side of the estimator: predicted step time and MFU of one iteration from the work a
trace counted (memo_ext.trace.work), a GPU profile and efficiency factors.

Every figure here is *predicted*: a roofline per class of work with efficiency factors, never a
measurement (no GPU is involved). Per micro-batch on the traced rank:

* compute, per phase (forward, recompute, backward): GEMM FLOPs / (peak · e_gemm) + attention
  FLOPs / (peak · e_attention) + bytes moved by the other ops / (HBM bandwidth · e_memory);
* tensor/context-parallel collectives the trace saw, by the ring algorithm's bytes on the wire
  ((g-1)/g of the buffer for all-gather and reduce-scatter, twice that for all-reduce) over
  NVLink when the group sits in one node, InfiniBand otherwise, times e_collective; a profile
  that measured its collectives (``collective_ops``: the cpu profile's gloo) gives each op its
  own bandwidth and a latency per call. Not overlapped with compute: megatron-core without
  Transformer Engine's comm overlap runs them on the compute stream;
* the context-parallel ring's point-to-point K/V (and dK/dV) transfers (memo_ext.attention):
  posted before each step's tiles compute, so only their excess over the phase's compute is
  exposed; a send and its matching receive are the same bytes on a full-duplex link, counted
  once;
* MEMO's offload (forward) and prefetch (backward) over PCIe at e_pcie of the link, overlapped
  with that phase's compute: only the excess is exposed (docs/memo.md's LP keeps it hidden). A
  profile's ``host_copy_overlap`` (default 1: a GPU's copy engines run beside its SMs) is the
  fraction of a copy's time that can hide at all; the rest is exposed whatever the compute
  (on a CPU the copy thread takes cores from compute). With one offload buffer
  (``--memo-offload-buffers 1``) every copy waits, so all of it is exposed;
* pipeline: (micro-batches + PP - 1) micro-batch times (1F1B's fill and drain) plus the stage
  boundary's point-to-point sends;
* per iteration: data-parallel gradient reduce-scatter and parameter all-gather (distributed
  optimizer) or all-reduce, the optimizer's memory traffic (with --optimizer-cpu-offload, the
  device part's, beside the host part's Adam and PCIe copies as HybridDeviceOptimizer orders
  them: memo_ext.estimate.offload_step), and the caching allocator's
  reorganisations (each a device synchronisation, cudaFree of every cached block and cudaMalloc
  again), which the allocator model counts.

MFU follows docs/memo.md's definition: (6·s·P + 6·n·h·s²) FLOPs per sequence over (GPUs · step time ·
peak), so recomputation is not credited; P and the FLOPs are memo_ext.estimate.flops', the
trainer's log's too.

Work at any sequence length comes from the work at two traced lengths: attention FLOPs are
quadratic in the length, everything else linear (exact, as the allocation sizes are).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from fractions import Fraction

from memo_ext.estimate.flops import model_flops_per_sequence
from memo_ext.estimate.offload_step import offload_step
from memo_ext.trace.work import PHASE_FIELDS

GB = 10**9

def wire_fraction(op: str, group_size: int) -> float:
    """Fraction of the buffer each rank sends over its link (ring algorithms)."""
    if op in ("all_gather", "reduce_scatter"):
        return (group_size - 1) / group_size
    if op == "all_reduce":
        return 2 * (group_size - 1) / group_size
    return 1.0


class CostModelError(ValueError):
    """A step time that cannot be predicted; one line naming the input at fault and the fix."""


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a GPU's peak the kernels reach, and the cost of one allocator
    reorganisation (seconds). ``gemm`` and the attention pair depend on the model's shapes
    and come from kernel tables (memo_ext.estimate.kernels.at_model_shapes); the others are
    the profile's ``efficiency`` table (hardware.json, provenance in its comment)."""

    memory: float
    collective: float
    pcie: float
    reorganisation_s: float
    gemm: float = math.nan
    attention_forward: float = math.nan
    attention_backward: float = math.nan

    @classmethod
    def from_profile(cls, profile: dict) -> "Efficiency":
        """The profile's shape-independent factors; the kernel ones are NaN until
        kernels.at_model_shapes sets them (a prediction without them is NaN, never a guess)."""
        values = profile.get("efficiency")
        names = [f.name for f in fields(cls) if f.default is MISSING]
        if not isinstance(values, dict):
            raise CostModelError("the GPU profile has no 'efficiency' table; add one "
                                 "(keys: " + ", ".join(names) + ")")
        missing = [name for name in names if name not in values]
        if missing:
            raise CostModelError(f"the GPU profile's 'efficiency' lacks {', '.join(missing)}")
        return cls(**{name: float(values[name]) for name in names})


# ----------------------------------------------------------------------------- work at any s

def _collective_key(record: dict) -> tuple:
    return record["phase"], record["op"], tuple(record["ranks"])


@dataclass
class WorkLine:
    """Work of a rank's iteration as a function of the sequence length, fitted through two
    traces' ``header["work"]``: attention FLOPs b·s + c·s² (causal pairs are s(s+1)/2),
    everything else a + b·s."""

    seqs: tuple[int, int]
    phases: dict[str, dict[str, tuple[Fraction, Fraction]]]  # field -> (a, b), or (b, c) for s²
    collectives: dict[tuple, tuple[Fraction, Fraction, int]]

    @classmethod
    def from_headers(cls, first: dict, second: dict) -> "WorkLine":
        s1, s2 = first["model"]["seq_length"], second["model"]["seq_length"]
        w1, w2 = first.get("work"), second.get("work")
        if w1 is None or w2 is None:
            raise CostModelError("a trace has no work counts (written before they existed); "
                                 "trace it again with tools/trace.py")
        if s1 == s2:
            raise CostModelError("the two traces have the same sequence length")
        phases: dict = {}
        for phase in sorted(set(w1["phases"]) | set(w2["phases"])):
            p1 = w1["phases"].get(phase, {})
            p2 = w2["phases"].get(phase, {})
            fitted = {}
            for name in PHASE_FIELDS:
                y1, y2 = p1.get(name, 0), p2.get(name, 0)
                if name == "attention_flops":  # b·s + c·s² (causal pairs: s(s+1)/2)
                    c = (Fraction(y2, s2) - Fraction(y1, s1)) / (s2 - s1)
                    fitted[name] = (Fraction(y1, s1) - c * s1, c)
                else:
                    slope = Fraction(y2 - y1, s2 - s1)
                    fitted[name] = (y1 - slope * s1, slope)
            phases[phase] = fitted
        c1 = {_collective_key(r): r for r in w1["collectives"]}
        c2 = {_collective_key(r): r for r in w2["collectives"]}
        if c1.keys() != c2.keys():
            raise CostModelError("the collectives differ between the two traces; trace at the "
                                 "target length instead")
        collectives = {}
        for key, r1 in c1.items():
            r2 = c2[key]
            slope = Fraction(r2["bytes"] - r1["bytes"], s2 - s1)
            collectives[key] = (r1["bytes"] - slope * s1, slope, r1["calls"])
        return cls((s1, s2), phases, collectives)

    def at(self, seq: int) -> dict:
        """``header["work"]`` as the trace at ``seq`` tokens would have it."""
        phases = {}
        for phase, fitted in self.phases.items():
            phases[phase] = {name: max(0, round(a * seq + b * seq * seq
                                                if name == "attention_flops" else a + b * seq))
                             for name, (a, b) in fitted.items()}
        collectives = [{"phase": p, "op": op, "ranks": list(ranks),
                        "bytes": max(0, round(a + b * seq)), "calls": calls}
                       for (p, op, ranks), (a, b, calls) in sorted(self.collectives.items())]
        return {"phases": phases, "collectives": collectives}


@dataclass
class StepTime:
    """One iteration's predicted time on the traced rank (seconds) and MFU (fraction)."""

    seq: int
    microbatches: int
    forward_s: float          # per micro-batch, compute + collectives
    recompute_s: float
    backward_s: float
    collectives_s: float      # per micro-batch, the part of the above spent in TP/CP collectives
    offload_exposed_s: float  # per micro-batch, PCIe time not hidden under compute
    pipeline_s: float         # per micro-batch, stage-boundary sends
    bubble_s: float           # per iteration, pipeline fill and drain
    data_parallel_s: float
    optimizer_s: float
    reorganisation_s: float
    step_s: float
    mfu: float

    def breakdown(self) -> str:
        """One line: where the step's time goes."""
        per_mb = self.forward_s + self.recompute_s + self.backward_s + self.offload_exposed_s \
            + self.pipeline_s
        return (f"step {self.step_s:.2f} s = {self.microbatches} micro-batches x "
                f"{per_mb:.3f} s (forward {self.forward_s:.3f}, recompute {self.recompute_s:.3f},"
                f" backward {self.backward_s:.3f}; collectives {self.collectives_s:.3f}, exposed "
                f"offload {self.offload_exposed_s:.3f}) + bubble {self.bubble_s:.2f} + data "
                f"parallel {self.data_parallel_s:.2f} + optimizer {self.optimizer_s:.2f} + "
                f"reorganisations {self.reorganisation_s:.2f}")


def _link_bytes_per_s(ranks, hardware: dict) -> float:
    per_node = int(hardware["gpus_per_node"])
    nodes = {rank // per_node for rank in ranks}
    return float(hardware["nvlink_gbps" if len(nodes) == 1 else "ib_gbps"]) * GB


def _collective_s(op: str, ranks, nbytes: int, calls: int, hardware: dict,
                  efficiency: "Efficiency") -> float:
    """Seconds of ``calls`` calls of ``op`` moving ``nbytes`` in all over the group ``ranks``:
    the ring's bytes on the wire over the link, plus the op's latency per call where the
    profile measured the op (``collective_ops``); a group of one rank moves nothing."""
    if len(ranks) < 2:
        return 0.0
    wire = wire_fraction(op, len(ranks)) * nbytes
    measured = hardware.get("collective_ops", {}).get(op)
    if measured is None:
        return wire / (_link_bytes_per_s(ranks, hardware) * efficiency.collective)
    return calls * float(measured["latency_s"]) \
        + wire / (float(measured["gbps"]) * GB * efficiency.collective)


def _single_rank_s(measured: dict, nbytes: int) -> float:
    """Seconds of one in-place collective of ``nbytes`` over a group of one rank, as measured."""
    return float(measured["latency_s"]) + nbytes / (float(measured["gbps"]) * GB)


def predict_step(work: dict, header: dict, hardware: dict, efficiency: Efficiency, *,
                 global_batch: int, persistent: dict, reorganisations_per_iteration: float = 0.0
                 ) -> StepTime:
    """Predicted time of one iteration of the traced rank's job.

    ``work``: ``header["work"]`` at the sequence length (WorkLine.at); ``header``: the trace's
    header (layout, model); ``persistent``: the rank's parameter, gradient and optimizer bytes
    (trace "init" allocations by category); ``global_batch``: sequences per iteration."""
    layout, model = header["layout"], header["model"]
    seq = model["seq_length"]
    tp, cp, pp, dp = layout["tp"], layout["cp"], layout["pp"], layout["dp"]
    micro_batch = layout["micro_batch_size"]
    traced_microbatches = layout.get("microbatches_in_flight", 1)
    if global_batch % (dp * micro_batch):
        raise CostModelError(f"--global-batch-size {global_batch} is not a multiple of DP x "
                             f"micro-batch = {dp * micro_batch}")
    microbatches = global_batch // (dp * micro_batch)
    peak = float(hardware["bf16_tflops"]) * 1e12
    hbm = float(hardware["hbm_gbps"]) * GB
    pcie = float(hardware["pcie_gbps"]) * GB * efficiency.pcie

    def compute_s(totals: dict, attention_efficiency: float = 1.0) -> float:
        attention = totals.get("attention_flops", 0)
        return (totals.get("gemm_flops", 0) / (peak * efficiency.gemm)
                + (attention and attention / (peak * attention_efficiency))
                + totals.get("memory_bytes", 0) / (hbm * efficiency.memory))

    collectives = dict.fromkeys(("forward", "recompute", "backward", "optimizer"), 0.0)
    ring = dict.fromkeys(collectives, 0.0)
    for record in work["collectives"]:
        if record["op"] == "recv":  # the matching send's bytes
            continue
        seconds = _collective_s(record["op"], record["ranks"], record["bytes"], record["calls"],
                                hardware, efficiency)
        exposed = ring if record["op"] == "send" else collectives
        exposed[record["phase"]] = exposed.get(record["phase"], 0.0) + seconds
    phases = work["phases"]
    per_mb = {}
    attention_efficiency = {"forward": efficiency.attention_forward,  # recompute: forward
                            "recompute": efficiency.attention_forward,  # kernels again
                            "backward": efficiency.attention_backward}
    for phase in ("forward", "recompute", "backward"):
        compute = compute_s(phases.get(phase, {}), attention_efficiency[phase])
        per_mb[phase] = (max(compute, ring[phase]) + collectives[phase]) / traced_microbatches
    forward, backward = phases.get("forward", {}), phases.get("backward", {})
    overlap = float(hardware.get("host_copy_overlap", 1.0))
    if header.get("options", {}).get("memo_offload_buffers") == 1:
        overlap = 0.0  # memo_ext.offload.manager: each copy waits, nothing hides it

    def exposed_copy_s(nbytes: int, compute: float) -> float:
        return (1 - overlap) * nbytes / pcie + max(0.0, overlap * nbytes / pcie - compute)

    offload_exposed = (exposed_copy_s(forward.get("d2h_bytes", 0), per_mb["forward"])
                       + exposed_copy_s(backward.get("h2d_bytes", 0),
                                        per_mb["backward"] + per_mb["recompute"])
                       ) / traced_microbatches
    element = 2 if "16" in model.get("params_dtype", "") else 4
    pipeline = 0.0
    if pp > 1:  # one activation out forward, one gradient back, per micro-batch
        boundary = seq // cp // (tp if layout.get("sequence_parallel") else 1) * micro_batch \
            * model["hidden_size"] * element
        pipeline = 2 * _collective_s("send", (0, tp * cp), boundary, 1, hardware, efficiency)
    microbatch_s = sum(per_mb.values()) + offload_exposed + pipeline
    bubble = (pp - 1) * microbatch_s
    data_parallel = 0.0
    if dp > 1:
        dp_ranks = range(0, tp * cp * dp, tp * cp)
        wire = (dp - 1) / dp * (persistent["gradient"] + persistent["parameter"])
        data_parallel = wire / (_link_bytes_per_s(dp_ranks, hardware) * efficiency.collective)
    options = header.get("options", {})
    # The distributed optimizer over a group of one rank: NCCL's in-place collectives do
    # nothing; gloo's copy (the CPU profile's single_rank_ops). Its gradient reduce-scatter is
    # the data-parallel step's, its parameter all-gather part of the optimizer's step.
    parameter_gather = 0.0
    single_rank = hardware.get("single_rank_ops")
    if single_rank and dp * cp == 1 and options.get("use_distributed_optimizer"):
        data_parallel += _single_rank_s(single_rank["reduce_scatter"], persistent["gradient"])
        parameter_gather = _single_rank_s(single_rank["all_gather"], persistent["parameter"])
    host_shards = persistent.get("host_shards") if options.get("optimizer_cpu_offload") else None
    # the gradient read and parameter write of the optimizer's shard, on the device the part
    # it updates there (the host part is offload_step's)
    device_part = 1.0 if not host_shards else persistent["device_elements"] / (
        persistent["device_elements"] + sum(host_shards))
    optimizer = (compute_s(phases.get("optimizer", {}))
                 + (2 * persistent["optimizer"] + device_part * (
                     persistent["gradient"] / max(dp, 1) + persistent["parameter"]))
                 / (hbm * efficiency.memory))
    if host_shards:
        optimizer = offload_step_of(host_shards, optimizer, element, hardware, efficiency,
                                    tp * cp * pp * dp, bool(options.get(
                                        "overlap_cpu_optimizer_d2h_h2d"))).step_s
    optimizer += parameter_gather
    reorganisation = reorganisations_per_iteration * efficiency.reorganisation_s
    step = microbatches * microbatch_s + bubble + data_parallel + optimizer + reorganisation
    gpus = tp * cp * pp * dp
    mfu = global_batch * model_flops_per_sequence(model, seq) / (gpus * step * peak)
    return StepTime(seq=seq, microbatches=microbatches, forward_s=per_mb["forward"],
                    recompute_s=per_mb["recompute"], backward_s=per_mb["backward"],
                    collectives_s=sum(collectives[p] for p in ("forward", "recompute",
                                                               "backward"))
                    / traced_microbatches,
                    offload_exposed_s=offload_exposed, pipeline_s=pipeline, bubble_s=bubble,
                    data_parallel_s=data_parallel, optimizer_s=optimizer,
                    reorganisation_s=reorganisation, step_s=step, mfu=mfu)


def offload_step_of(host_shards, device_step_s: float, element: int, hardware: dict,
                    efficiency: Efficiency, world: int, overlap: bool):
    """memo_ext.estimate.offload_step for a rank of ``hardware``: PCIe at e_pcie of the link,
    host memory at e_memory of the node's ``host_memory_gbps`` shared by the node's ranks."""
    if "host_memory_gbps" not in hardware:
        raise CostModelError("the GPU profile has no 'host_memory_gbps' (the node's host memory "
                             "bandwidth, GB/s), which --optimizer-cpu-offload's step needs; add it")
    ranks = max(1, min(int(hardware["gpus_per_node"]), world))
    host = float(hardware["host_memory_gbps"]) * GB * efficiency.memory / ranks
    pcie = float(hardware["pcie_gbps"]) * GB * efficiency.pcie
    return offload_step(host_shards, device_step_s, element=element, pcie_bytes_per_s=pcie,
                        host_bytes_per_s=host, overlap=overlap,
                        concurrent=hardware.get("device_type") != "cpu")


def persistent_bytes(trace) -> dict:
    """Parameter, gradient and optimizer bytes the rank allocates on its device at init (trace
    events), and with --optimizer-cpu-offload the optimizer's split
    (memo_ext.trace.offloaded_elements): ``host_shards``, ``device_elements``."""
    from memo_ext.trace import POOL_HOST, offloaded_elements

    totals = {"parameter": 0, "gradient": 0, "optimizer": 0}
    for event in trace.events:
        if event["action"] == "alloc" and event["phase"] == "init" \
                and event["category"] in totals and event.get("pool") != POOL_HOST:
            totals[event["category"]] += event["bytes"]
    if trace.header.get("options", {}).get("optimizer_cpu_offload"):
        totals["host_shards"], totals["device_elements"] = offloaded_elements(trace.events)
    return totals


__all__ = ["CostModelError", "Efficiency", "StepTime", "WorkLine", "persistent_bytes",
           "predict_step"]
