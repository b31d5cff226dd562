"""Memory side of the estimator: a rank's allocation trace at any sequence length from two
traces, replayed through an allocator model.

Tracing a 7B model on fake tensors takes 15-25 s whatever the sequence length, because the cost
is building and running the model, not its sizes. The allocation sequence itself does not
depend on the length: the same ops allocate in the same order, and every request's bytes are
a linear function of the sequence length. Measured on 7B, TP=4 CP=2, at 128K, 256K and 1M
tokens: 6,929 events each, and the line through the 128K and 256K sizes gives every 1M size
exactly. :class:`LinearTrace` therefore traces twice and produces the trace at any length by
that interpolation. It refuses when the two traces differ in structure, and reports any
non-integer size rather than guessing. :func:`estimate_at` replays the persistent state once and
then several iterations through a memo_ext.alloc model on the device's capacity (less the
memory outside the allocator), which is all the OOM check needs. That takes milliseconds, so a
max-sequence search costs two traces.

Hand-written because no library predicts a PyTorch program's allocations at another input
size; AMP (Cheng et al., SoCC'23) extrapolates peaks the same way, but from one point.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Optional

from memo_ext.trace import POOL_EXTERNAL, Trace
from memo_ext.trace.cuda_rules import STEPWISE_SCRATCH

#: The tracer engine, which the trace pool's workers run (``python -m TRACE_MODULE --serve``,
#: memo_ext.estimate.tracer): memo_ext never imports the trainer, and each worker builds its own
#: fake world.
TRACE_MODULE = "megatron.training.tracing"


def tracer_environment() -> dict[str, str]:
    """This process's environment with no GPU visible, for a tracer worker: a trace runs on
    the CPU device whatever the machine has, and its CPU shims refuse a process that sees CUDA
    (on a GPU node every trace failed so)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}

#: Event fields that must agree between the two traces of a LinearTrace (everything but bytes).
STRUCTURE_FIELDS = ("id", "action", "stream", "layer", "phase", "category", "microbatch", "pool",
                    "module", "op")


class EstimateError(ValueError):
    """An estimate that cannot be made; one line naming the input at fault and the fix."""


def _pair_outside_scratch(shorter: list[dict], longer: list[dict]) -> Optional[list]:
    """The longer trace's events, each with its counterpart in the shorter trace (None for
    stepwise scratch -- reduction scratch, split-KV accumulators -- which is not paired), or
    None when the two differ in anything but sizes outside the scratch. Ids are compared by
    order of first appearance: scratch blocks take ids too."""
    def scratch_ids(events) -> set:
        return {e["id"] for e in events
                if e["action"] == "alloc" and e["module"] in STEPWISE_SCRATCH}

    def outside(events, scratch):
        ids: dict[int, int] = {}
        kept = []
        for event in events:
            if event["id"] in scratch:
                continue
            number = ids.setdefault(event["id"], len(ids))
            kept.append((number, *(event[k] for k in STRUCTURE_FIELDS if k != "id")))
        return kept

    short_scratch, long_scratch = scratch_ids(shorter), scratch_ids(longer)
    if outside(shorter, short_scratch) != outside(longer, long_scratch):
        return None
    others = iter(e for e in shorter if e["id"] not in short_scratch)
    return [(None, e) if e["id"] in long_scratch else (next(others), e) for e in longer]


def sized_events(events: list[dict], intercepts: list[Fraction], slopes: list[Fraction],
                 seq: int) -> list[dict]:
    """``events`` with their bytes at ``seq`` tokens, a + b·seq rounded up where the line is
    not integral."""
    sized = []
    for event, a, b in zip(events, intercepts, slopes):
        # a + b·seq over the product of the denominators, in ints: Fraction arithmetic (a
        # gcd per operation) was a third of a 32-layer replay's time.
        numerator = a.numerator * b.denominator + b.numerator * seq * a.denominator
        nbytes = -(-numerator // (a.denominator * b.denominator))
        if nbytes < 0:
            raise EstimateError(f"{seq} tokens is below the traced range: a request size "
                                "turns negative; trace a shorter length")
        sized.append({**event, "bytes": nbytes})
    return sized


@dataclass
class LinearTrace:
    """A trace whose every request size is ``a + b * seq`` (exact rationals).

    Except the CUDA reductions' scratch and the flash forward's split-KV accumulators
    (memo_ext.trace.cuda_rules, :data:`STEPWISE_SCRATCH`). The accumulators exist only while a
    tile is too short to fill the GPU, in as many splits as the kernel's heuristic picks: kept as
    the longer trace has them, they overstate a longer run a little (they are gone there) and
    never understate it. Whether a reduction takes scratch, how much and in how many
    launches depends on the length in steps: it grows with the blocks per output, then splits
    into 32-bit-indexable launches, one after the other. So a line through two lengths would
    overshoot far beyond them, and the two traces may even differ in how many scratch blocks
    they hold. The scratch is therefore left out of the comparison and the line, and kept as the
    longer trace has it. The estimate then understates it beyond the longer length, below the
    per-launch cap (about 0.5 GiB for a 4096-wide bias gradient): by 0.19 GiB for the 7B bias
    gradients at 1792K tokens from traces at 128K and 256K (docs/tracing.md).
    """

    base: Trace
    intercepts: list[Fraction]
    slopes: list[Fraction]
    seqs: tuple[int, int]

    @classmethod
    def from_traces(cls, first: Trace, second: Trace) -> "LinearTrace":
        s1 = first.header["model"]["seq_length"]
        s2 = second.header["model"]["seq_length"]
        if s1 == s2:
            raise EstimateError("the two traces have the same sequence length; trace two lengths")
        shorter, longer = (first, second) if s1 < s2 else (second, first)
        pairs = _pair_outside_scratch(shorter.events, longer.events)
        if pairs is None:
            raise EstimateError(f"the allocation sequence differs between {s1} and {s2} tokens "
                                "(not only in sizes); trace at the target length instead")
        (sa, sb) = sorted((s1, s2))
        slopes, intercepts = [], []
        for x, y in pairs:
            if x is None:  # scratch: as the longer trace holds it
                slopes.append(Fraction(0))
                intercepts.append(Fraction(y["bytes"]))
                continue
            slope = Fraction(y["bytes"] - x["bytes"], sb - sa)
            slopes.append(slope)
            intercepts.append(x["bytes"] - slope * sa)
        return cls(longer, intercepts, slopes, (s1, s2))

    def at(self, seq: int) -> Trace:
        """The trace at ``seq`` tokens (sizes rounded up where the line is not integral)."""
        events = sized_events(self.base.events, self.intercepts, self.slopes, seq)
        header = json.loads(json.dumps(self.base.header))
        header.setdefault("model", {})["seq_length"] = seq
        header["estimated_from_seq_lengths"] = list(self.seqs)
        return Trace(header=header, events=events)


@dataclass
class MemoryEstimate:
    """One rank's predicted memory at one sequence length (bytes)."""

    seq: int
    policy: str                      # allocator model
    capacity_bytes: int              # the device
    external_bytes: int              # CUDA context, NCCL: outside the allocator
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fragmentation: float
    reorganisations: int
    fits: bool
    oom_request_bytes: Optional[int]
    peak_by_category: dict = field(default_factory=dict)  # live bytes at the allocated peak
    host_bytes: int = 0              # MEMO's offload slots

    @property
    def peak_device_bytes(self) -> int:
        """What nvidia-smi would show at the peak: reserved + memory outside the allocator."""
        return self.peak_reserved_bytes + self.external_bytes


def external_bytes(trace: Trace) -> int:
    """Device bytes outside the caching allocator (CUDA context, NCCL buffers)."""
    return sum(e["bytes"] for e in trace.events
               if e["pool"] == POOL_EXTERNAL and e["action"] == "alloc")


def estimate_at(trace: Trace, capacity_bytes: int, policy: str = "caching",
                iterations: int = 3) -> MemoryEstimate:
    """Replay ``trace`` (persistent state once, then ``iterations`` iterations) through the
    ``policy`` model on ``capacity_bytes`` less the memory outside the allocator."""
    from memo_ext.alloc import repeated_iterations, replay
    from memo_ext.trace import summarize

    external = external_bytes(trace)
    seq = trace.header["model"]["seq_length"]
    summary = summarize(trace)
    allocator_capacity = capacity_bytes - external
    if allocator_capacity <= 0:
        return MemoryEstimate(seq, policy, capacity_bytes, external, 0, 0, 0.0, 0, False, None,
                              summary.peak_by_category, summary.host_peak_bytes)
    repeated, _, _ = repeated_iterations(trace, iterations)
    plan = None
    if policy == "arena":  # MEMO's planned arena: plan this very trace
        from memo_ext.planner.plan import arena_plan, plan_trace

        # The greedy placement first: the MIP only ever shrinks an arena, so when the greedy
        # one fits, the verdict is the MIP's (its solves take ~10 s each on 7B); when it does
        # not, the MIP decides. The peak reported may then be the greedy plan's, a little above.
        plan = arena_plan(plan_trace(trace, use_mip=False, digest=False), trace, iterations)
        result = replay(repeated, policy, allocator_capacity, plan=plan, timelines=False)
        if result.oom is not None:
            plan = arena_plan(plan_trace(trace, digest=False), trace, iterations)
            result = replay(repeated, policy, allocator_capacity, plan=plan, timelines=False)
    else:
        result = replay(repeated, policy, allocator_capacity, plan=plan, timelines=False)
    return MemoryEstimate(
        seq=seq, policy=policy, capacity_bytes=capacity_bytes, external_bytes=external,
        peak_allocated_bytes=result.peak_allocated_bytes,
        peak_reserved_bytes=result.peak_reserved_bytes, fragmentation=result.fragmentation,
        reorganisations=result.reorganisations, fits=result.oom is None,
        oom_request_bytes=None if result.oom is None else result.oom.request_bytes,
        peak_by_category=summary.peak_by_category, host_bytes=summary.host_peak_bytes)


def longest_fitting(fits: Callable[[int], bool], step: int, maximum: int) -> int:
    """Largest multiple of ``step`` <= ``maximum`` with fits(seq) (0 if none), by bisection
    (fitting is assumed monotone in the sequence length)."""
    lo, hi = 0, maximum // step + 1  # lo fits (0 trivially), hi does not (assumed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step


def max_sequence_length(estimate: Callable[[int], MemoryEstimate], step: int,
                        maximum: int, fine_step: Optional[int] = None) -> int:
    """Longest multiple of ``step`` that fits (of ``fine_step`` when not even ``step`` does);
    0 when nothing does."""
    def fits(seq: int) -> bool:
        return estimate(seq).fits

    longest = longest_fitting(fits, step, maximum)
    if longest or not fine_step:
        return longest
    return longest_fitting(fits, fine_step, step - fine_step)
