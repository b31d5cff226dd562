"""SPPO's heuristic solver (docs/sppo.md "Pipeline and solver"): pick the SP/TP size ``t``, the
pipeline size ``p``, DP = GPUs / (t·p) and the subsequence count ``N`` minimising the predicted
step time, subject to device memory per GPU and host memory per node.

Everything here is an analytic model -- predicted, not measured. Pure Python (no torch).

Layout and placement (assumed): ranks are ordered TP innermost, then PP, then DP; TP never
crosses a node (``t <= gpus_per_node``); a PP neighbour is on another node iff ``t·p`` exceeds
the GPUs of a node; DP crosses nodes iff the job has more than one node. Micro-batch 1, one
sequence per DP replica per step, bf16.

Memory per GPU (bytes), the terms of :class:`Memory`:

- ``model_states``: the traced rows' bytes per parameter of the stage
  (memo_ext.estimate.rank_constants: bf16 weights and fp32 gradients, 6, and fp32 main weights
  and two Adam moments, 12), the stage holding ``P/p`` parameters (embedding/output spread
  evenly: a simplification), sharded over ``t``. Without ``distributed_optimizer`` (Megatron's
  default, assumed) nothing is sharded over DP; with it the 12 optimizer bytes are divided by
  DP.
- ``kv_cache``: K and V of the whole sequence stay on device for the whole pass (docs/sppo.md
  "Subsequences and causal attention"): ``layers_per_stage · 2 · S · kv_width · 2 bytes / t``.
- ``activations``: the offloadable activations of subsequence ``i`` are
  ``A_i = layers_per_stage · 36 · s_i · h / t`` bytes (docs/sppo.md: "the paper counts them as
  36·B·S·H bytes"); the unrolled peak is ``max_i [A_i + sum_{j<i} (1 - alpha_j) A_j]``.
- ``dkv_accumulators``: dK/dV of subsequences ``0..i`` live on device during ``i``'s backward
  (bf16, the ``.grad`` of the cached K/V leaves in memo_ext/sppo/attention.py): the size of the
  KV cache up to the end of ``i``, counted at the same ``i`` as the activation peak.
- ``staging``: one subsequence's offloaded share being prefetched back, ``max_j alpha_j A_j``.
- ``logits``: fp32 logits of the longest subsequence on the last stage, ``s_max · V · 4 / t``.
- ``workspaces``: the cuBLAS workspaces of the two GEMM threads on the profile's GPU, and
  ``reserved``: the CUDA context and NCCL buffers of the layout's communicators, outside the
  allocator; both as a trace of the layout records them (memo_ext.estimate.rank_constants).

Host memory per node: every GPU of the node keeps ``sum_j alpha_j A_j`` on the host. When
that exceeds the node's host memory the alphas are scaled down together until it fits (the
device then keeps the rest).

Step time (seconds): per layer and subsequence, forward compute is the linear FLOPs at
``peak · efficiency.gemm`` plus the causal attention FLOPs at ``peak ·
efficiency.attention_forward`` (FLOPs from :meth:`LayerFlops.of_range`, divided by ``t``;
both efficiencies read from the GPU's kernel tables at the subsequence's length,
memo_ext.estimate.kernels, so short subsequences pay for small kernels), plus
:data:`LAUNCH_OVERHEAD_S`; the backward is :data:`LINEAR_BACKWARD_RATIO` times the linear part
and :data:`ATTENTION_BACKWARD_RATIO` times the attention FLOPs at
``efficiency.attention_backward`` (SPPO recomputes nothing). Sequence
parallelism adds 4 collectives per
layer forward (all-gather before attention and MLP, reduce-scatter after each) and 4 in
backward, each of ``s_i · h · 2`` bytes over NVLink (ring: (t-1)/t of it on the wire), not
overlapped. Each stage boundary moves ``s_i · h · 2 / t`` bytes forward and the same gradient
backward (IB or NVLink, see placement). Stage time per subsequence ``tau_i``; the pipeline
takes ``sum_i tau_i + (p - 1) · max_i tau_i`` (= docs/sppo.md's ``(p-1+N)/N · F(N)`` when the
``tau_i`` are equal), plus offload time not hidden under the next subsequence's forward, plus
one DP all-reduce of the stage's bf16 gradients.

With MSP (``Problem.msp``, ``--memo-sppo-msp``) the pipeline time is the makespan of
:func:`memo_ext.sppo.msp_plan.pipeline_bubble_ratio`'s simulation of the multiplexed order
(each subsequence's forward and backward, collectives split 1:2 between them, a multiplexed
backward recomputing its forward), plus the weight traffic of every slot with multiplexed
tasks, not overlapped: the stage's bf16 parameters broadcast once before a forward slot,
broadcast again and their gradients reduced after a backward slot, over the PP link. A helper
holds the owner's bf16 weights while it helps (``msp_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from memo_ext.estimate.cost import Efficiency
from memo_ext.estimate.flops import model_flops_per_sequence, parameter_count
from memo_ext.estimate.kernels import at_model_shapes, profile_key
from memo_ext.estimate.rank_constants import (  # the traced rows' (rows ranked together)
    OPTIMIZER_BYTES_PER_PARAM,
    WEIGHT_AND_GRAD_BYTES_PER_PARAM,
    outside_allocator_bytes,
    workspace_bytes,
)
from memo_ext.layer_flops import LayerFlops
from memo_ext.sppo.msp_plan import forward_slot, pipeline_bubble_ratio, plan_multiplexing
from memo_ext.sppo.offload import solve_alphas
from memo_ext.sppo.partition import flops_boundaries

GiB = 1 << 30
GB = 10**9

#: Offloadable activation bytes per token per hidden unit per layer (docs/sppo.md, from the paper).
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 36
BF16_BYTES = 2
FP32_BYTES = 4
#: Backward over forward time: a GEMM's backward computes the input and the weight gradients
#: (2x); flash attention's recomputes the scores (five GEMMs against the forward's two, 2.5x).
#: The traced cost model counts the same (memo_ext/trace/work.py).
LINEAR_BACKWARD_RATIO = 2.0
ATTENTION_BACKWARD_RATIO = 2.5
#: Fixed cost per layer per subsequence forward (backward counted twice, like its FLOPs):
#: ~15 kernel launches of ~3 us each plus the host-side bookkeeping of the subsequence
#: scheduler. Small beside the kernels: what makes short subsequences lose is the attention
#: kernels' lower throughput at short lengths (the kernel tables).
LAUNCH_OVERHEAD_S = 50e-6
#: Shortest subsequence tried, tokens (far below the paper's 2K sweet spot; the kernel tables
#: decide, this only bounds the search).
MIN_SUBSEQUENCE_TOKENS = 256
#: Most subsequences tried.
MAX_SUBSEQUENCES = 1024

PREDICTED = "predicted (analytic model, not measured)"


class SolverError(ValueError):
    """Input the solver cannot use; one line naming the flag and the fix."""


@dataclass(frozen=True)
class Memory:
    """Predicted device bytes per GPU by term (see the module docstring)."""

    model_states: float
    kv_cache: float
    activations: float
    dkv_accumulators: float
    staging: float
    logits: float
    workspaces: float
    reserved: float  # outside the allocator
    msp_weights: float = 0.0

    @property
    def total(self) -> float:
        return (self.model_states + self.kv_cache + self.activations + self.dkv_accumulators
                + self.staging + self.logits + self.workspaces + self.reserved
                + self.msp_weights)

    def terms(self) -> dict:
        terms = {"model states": self.model_states, "KV cache": self.kv_cache,
                 "activations": self.activations, "dK/dV accumulators": self.dkv_accumulators,
                 "offload staging": self.staging, "logits": self.logits,
                 "cuBLAS workspaces": self.workspaces, "CUDA context, NCCL": self.reserved}
        if self.msp_weights:
            terms["MSP weights"] = self.msp_weights
        return terms


@dataclass
class Candidate:
    """One (t, p, DP, N) with its predicted memory and time."""

    tp: int
    pp: int
    dp: int
    subsequences: int
    lengths: list[int]
    alphas: list[float]
    memory: Memory
    host_bytes_per_node: float
    host_full_bytes_per_node: float  # before scaling the alphas to the host memory
    step_s: float
    mfu: float
    capacity_bytes: int
    time_terms: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity_bytes

    def describe(self) -> str:
        return f"TP{self.tp} PP{self.pp} DP{self.dp} N{self.subsequences}"


@dataclass(frozen=True)
class Problem:
    """What the solver plans for: ``model`` a shape dict (memo_ext.estimate.models),
    ``hardware`` a profile from memo_ext.estimate.load_hardware, ``seq`` tokens."""

    model: dict
    gpus: int
    hardware: dict
    seq: int
    host_memory_bytes_per_node: Optional[float] = None
    distributed_optimizer: bool = False
    msp: bool = False

    @property
    def gpus_per_node(self) -> int:
        return min(int(self.hardware["gpus_per_node"]), self.gpus)

    @property
    def host_bytes(self) -> float:
        if self.host_memory_bytes_per_node is not None:
            return self.host_memory_bytes_per_node
        return float(self.hardware["host_memory_gb_per_node"]) * GB


def layer_flops(model: dict) -> LayerFlops:
    heads = model["num_attention_heads"]
    head_dim = model.get("kv_channels") or model["hidden_size"] // heads
    return LayerFlops.of_gpt_layer(model["hidden_size"], model["ffn_hidden_size"], heads,
                                   model.get("num_query_groups") or heads, head_dim,
                                   bool(model.get("swiglu")))


def kv_width(model: dict) -> int:
    heads = model["num_attention_heads"]
    head_dim = model.get("kv_channels") or model["hidden_size"] // heads
    return (model.get("num_query_groups") or heads) * head_dim


def _powers_of_two(limit: int) -> list[int]:
    values, value = [], 1
    while value <= limit:
        values.append(value)
        value *= 2
    return values


def layouts(problem: Problem) -> list[tuple[int, int, int]]:
    """(t, p, DP) triples: t a power of two up to the GPUs of a node dividing the heads and
    query groups, p dividing the layers, DP = GPUs / (t·p) a whole number >= 1."""
    model = problem.model
    heads = model["num_attention_heads"]
    groups = model.get("num_query_groups") or heads
    layers = model["num_layers"]
    result = []
    for t in _powers_of_two(problem.gpus_per_node):
        if heads % t or groups % t:
            continue
        for p in range(1, layers + 1):
            if layers % p == 0 and problem.gpus % (t * p) == 0:
                result.append((t, p, problem.gpus // (t * p)))
    return result


def evaluate(problem: Problem, tp: int, pp: int, subsequences: int) -> Candidate:
    """Predicted memory and step time of one layout (see the module docstring)."""
    model, hardware, seq = problem.model, problem.hardware, problem.seq
    efficiency = Efficiency.from_profile(hardware)
    tables = profile_key(hardware)
    dp = problem.gpus // (tp * pp)
    hidden, layers = model["hidden_size"], model["num_layers"]
    per_stage = layers // pp
    flops = layer_flops(model)
    bounds = flops_boundaries(seq, subsequences, flops, multiple_of=tp)
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    peak = float(hardware["bf16_tflops"]) * 1e12
    nvlink = float(hardware["nvlink_gbps"]) * GB * efficiency.collective
    ib = float(hardware["ib_gbps"]) * GB * efficiency.collective
    pcie = float(hardware["pcie_gbps"]) * GB * efficiency.pcie

    # --- time
    forward, backward, tau = [], [], []
    tp_wire = (tp - 1) / tp
    p2p_link = ib if tp * pp > problem.gpus_per_node else nvlink
    tp_s = p2p_s = 0.0
    for (a, b), s in zip(zip(bounds, bounds[1:]), lengths):
        # The kernels' efficiencies at the subsequence's own length: short subsequences run
        # small GEMMs and short attention calls, which the kernel tables price.
        kernels = at_model_shapes(efficiency, hardware, {**model, "seq_length": s},
                                  {"tp": tp, "cp": 1, "pp": pp}, tables)
        linear = flops.linear * s / tp / (peak * kernels.gemm)
        attention_flops = (flops.of_range(a, b) - flops.linear * s) / tp
        attention = attention_flops / (peak * kernels.attention_forward)
        layer_forward = linear + attention + LAUNCH_OVERHEAD_S
        layer_backward = (LINEAR_BACKWARD_RATIO * (linear + LAUNCH_OVERHEAD_S)
                          + ATTENTION_BACKWARD_RATIO * attention_flops
                          / (peak * kernels.attention_backward))
        collectives = 8 * tp_wire * s * hidden * BF16_BYTES / nvlink if tp > 1 else 0.0
        p2p = 2 * s * hidden * BF16_BYTES / tp / p2p_link if pp > 1 else 0.0
        forward.append(per_stage * layer_forward)
        backward.append(per_stage * layer_backward)
        tau.append(per_stage * (layer_forward + layer_backward + collectives) + p2p)
        tp_s += per_stage * collectives
        p2p_s += p2p

    # --- offload
    activation = [per_stage * ACTIVATION_BYTES_PER_TOKEN_HIDDEN * s * hidden / tp
                  for s in lengths]
    alphas = solve_alphas(activation, forward, pcie)
    node_gpus = problem.gpus_per_node
    host_full = node_gpus * sum(al * a for al, a in zip(alphas, activation))
    if host_full > problem.host_bytes:  # keep on device what the host cannot take
        scale = problem.host_bytes / host_full
        alphas = [al * scale for al in alphas]
    host = node_gpus * sum(al * a for al, a in zip(alphas, activation))
    exposed = sum(max(0.0, alphas[i] * activation[i] / pcie - forward[i + 1])
                  for i in range(subsequences - 1))
    exposed *= 2  # the same bytes come back before the backward

    # --- memory
    width = kv_width(model)
    kv_per_token = per_stage * 2 * width * BF16_BYTES / tp
    kept, activation_peak, dkv_at_peak = 0.0, 0.0, 0.0
    for i, a in enumerate(activation):
        resident = a + kept + kv_per_token * bounds[i + 1]
        if resident > activation_peak + dkv_at_peak:
            activation_peak, dkv_at_peak = a + kept, kv_per_token * bounds[i + 1]
        kept += (1 - alphas[i]) * a
    stage_params = parameter_count(model) / pp / tp
    optimizer_shards = dp if problem.distributed_optimizer else 1
    state_bytes = WEIGHT_AND_GRAD_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM / optimizer_shards
    memory = Memory(model_states=stage_params * state_bytes,
                    kv_cache=kv_per_token * seq,
                    activations=activation_peak, dkv_accumulators=dkv_at_peak,
                    staging=max(al * a for al, a in zip(alphas, activation)),
                    logits=max(lengths) * model["vocab_size"] * FP32_BYTES / tp,
                    workspaces=workspace_bytes(hardware),
                    reserved=outside_allocator_bytes(tp, 1, pp, dp),
                    msp_weights=stage_params * BF16_BYTES if problem.msp and pp > 1 else 0.0)

    # --- step
    dp_s = 0.0
    if dp > 1:
        dp_link = ib if problem.gpus > int(hardware["gpus_per_node"]) else nvlink
        dp_s = stage_params * BF16_BYTES * 2 * (dp - 1) / dp / dp_link
    msp_s = 0.0
    if problem.msp and pp > 1:
        rest = [t - f - b for t, f, b in zip(tau, forward, backward)]  # collectives, p2p
        forward_work = [f + r / 3 for f, r in zip(forward, rest)]
        backward_work = [t - f for t, f in zip(tau, forward_work)]
        tasks = plan_multiplexing(pp, forward_work)
        bubble = sum(tau) * pipeline_bubble_ratio(pp, forward_work, backward_work, tasks)
        forward_slots = {forward_slot(stage, index) for stage, index in tasks}
        msp_s = len(forward_slots) * 3 * stage_params * BF16_BYTES / p2p_link
    else:
        bubble = (pp - 1) * max(tau)
    step = sum(tau) + bubble + msp_s + exposed + dp_s
    mfu = dp * model_flops_per_sequence(model, seq) / (problem.gpus * peak * step)
    terms = {"compute and overhead": sum(tau) - tp_s - p2p_s, "TP collectives": tp_s,
             "PP p2p": p2p_s, "bubble": bubble, "offload not hidden": exposed,
             "DP all-reduce": dp_s}
    if problem.msp and pp > 1:
        terms["MSP weight traffic"] = msp_s
    return Candidate(tp, pp, dp, subsequences, lengths, alphas, memory, host, host_full, step,
                     mfu, int(hardware["device_memory_bytes"]), terms)


def subsequence_counts(seq: int, tp: int) -> list[int]:
    """Powers of two N with subsequences of at least MIN_SUBSEQUENCE_TOKENS (and of ``tp``)."""
    return [n for n in _powers_of_two(MAX_SUBSEQUENCES)
            if seq // n >= max(MIN_SUBSEQUENCE_TOKENS, tp)]


def all_candidates(problem: Problem) -> list[Candidate]:
    _check(problem)
    return [evaluate(problem, t, p, n) for t, p, _ in layouts(problem)
            for n in subsequence_counts(problem.seq, t)]


def solve(problem: Problem) -> tuple[list[Candidate], list[Candidate]]:
    """(fitting candidates fastest first, every candidate smallest device memory first)."""
    candidates = all_candidates(problem)
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: (c.step_s, c.memory.total))
    return fitting, sorted(candidates, key=lambda c: c.memory.total)


def not_fit_message(smallest: Candidate, problem: Problem) -> str:
    """What is missing, for the layout that needs the least device memory."""
    message = (f"does not fit: the smallest layout ({smallest.describe()}) needs "
               f"{smallest.memory.total / GiB:.1f} GiB per GPU (KV cache alone "
               f"{smallest.memory.kv_cache / GiB:.1f} GiB, model states "
               f"{smallest.memory.model_states / GiB:.1f} GiB); "
               f"{smallest.capacity_bytes / GiB:.1f} GiB available")
    if smallest.host_full_bytes_per_node > problem.host_bytes:
        message += (f"; host memory: its full offload needs "
                    f"{smallest.host_full_bytes_per_node / 1e12:.1f} TB per node, have "
                    f"{problem.host_bytes / 1e12:.1f} TB")
    return message


def alpha_range(alphas: list[float]) -> str:
    """min/max over the subsequences that offload (the last one never does: its backward
    comes first)."""
    if len(alphas) < 2:
        return "none (one subsequence: nothing runs while it would be copied)"
    offloading = alphas[:-1]
    return f"min {min(offloading):.3f}, max {max(offloading):.3f} (last subsequence 0)"


def report_lines(best: Candidate, problem: Problem) -> list[str]:
    """The plan of ``best`` as printed lines: layout, subsequences, alphas, memory terms, host
    memory, step time and its terms."""
    memory = best.memory
    lines = [f"SPPO plan{' with MSP' if problem.msp else ''}, {PREDICTED}:",
             f"  layout: TP/SP {best.tp}, PP {best.pp}, DP {best.dp}, N {best.subsequences} "
             f"subsequences",
             f"  subsequence tokens: first {best.lengths[0]}, last {best.lengths[-1]} "
             f"(FLOPs-balanced)",
             f"  offload alpha: {alpha_range(best.alphas)}",
             f"  device memory per GPU: {memory.total / GiB:.1f} GiB of "
             f"{best.capacity_bytes / GiB:.1f} GiB"]
    lines += [f"    {name:<20} {value / GiB:8.2f} GiB" for name, value in memory.terms().items()]
    lines.append(f"  host memory per node: {best.host_bytes_per_node / GB:.0f} GB of "
                 f"{problem.host_bytes / GB:.0f} GB")
    lines.append(f"  step time: {best.step_s:.2f} s, MFU {100 * best.mfu:.1f}%")
    lines += [f"    {name:<20} {value:8.3f} s" for name, value in best.time_terms.items()]
    return lines


def _check(problem: Problem) -> None:
    if problem.gpus < 1:
        raise SolverError(f"--gpus {problem.gpus}: give at least 1 GPU")
    if problem.seq < MIN_SUBSEQUENCE_TOKENS:
        raise SolverError(f"--seq-length {problem.seq}: give at least "
                          f"{MIN_SUBSEQUENCE_TOKENS} tokens")
    if problem.host_memory_bytes_per_node is not None and problem.host_memory_bytes_per_node < 0:
        raise SolverError("--host-memory-gb: give a size >= 0 (GB per node)")
    if not layouts(problem):
        raise SolverError(f"--gpus {problem.gpus}: no TP x PP layout divides it (TP a power of "
                          f"two dividing the heads, PP dividing "
                          f"{problem.model['num_layers']} layers); give a multiple of "
                          "a power of two")
