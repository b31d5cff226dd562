"""SPPO layouts in the recommender: memo_ext.sppo.solver's analytic model behind the interface of
:class:`memo_ext.estimate.layout.LayoutModel` (a prediction at any length, the longest fitting
length), so ``tools/estimate.py --recommend`` ranks SPPO's (TP, PP, DP, N) beside the traced
policies.

SPPO is not traced: tools/trace.py records megatron's 1F1B iteration, not SPPO's subsequence
schedule. Its rows are the solver's memory terms and step time, on the same GPU profile and
efficiency table as the traced rows and with their bytes per parameter, workspaces and memory
outside the allocator (memo_ext.estimate.rank_constants), so they are comparable in MFU and in
device memory per rank, with the solver's analytic approximations (docs/sppo.md) in place of a
replayed trace.

One :class:`SPPOLayoutModel` per (TP, PP): its prediction at a length is the fastest fitting
subsequence count N (with and without multiplexed sequence partitioning when PP > 1), or the
one needing the least device memory when none fits. The solver plans one sequence per
data-parallel replica and step; a step of ``global_batch`` sequences runs
``global_batch / DP`` of them one after another (each with its own pipeline fill and drain:
an upper bound), so the MFU is the solver's.

It lives beside the solver, above the estimator: the solver prices with the estimator's cost
model and rank constants, so the estimator never imports SPPO (the recommender,
megatron/memo_tools/cli/estimate.py, imports both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from memo_ext.estimate.kernels import kernel_rows_line
from memo_ext.estimate.memory import EstimateError, max_sequence_length
from memo_ext.flags import render_flags
from memo_ext.sppo.solver import (
    MIN_SUBSEQUENCE_TOKENS,
    Candidate,
    Problem,
    evaluate,
    layouts,
    report_lines,
    subsequence_counts,
)

GiB = 1 << 30


def shortest_sequence(tp: int) -> int:
    """The fewest tokens the solver plans at TP ``tp``: one subsequence of its minimum length,
    a whole number of sequence-parallel shards."""
    return max(MIN_SUBSEQUENCE_TOKENS, tp)


@dataclass
class SPPOPrediction:
    """An SPPO layout at one sequence length (the solver's best candidate for it)."""

    candidate: Candidate
    problem: Problem
    global_batch: int

    @property
    def seq(self) -> int:
        return self.problem.seq

    @property
    def peak_device_bytes(self) -> float:
        return self.candidate.memory.total

    @property
    def host_bytes_per_node(self) -> float:
        return self.candidate.host_bytes_per_node

    @property
    def step_s(self) -> float:
        return self.candidate.step_s * self.global_batch / self.candidate.dp

    @property
    def mfu(self) -> float:
        return self.candidate.mfu

    @property
    def kernel_rows(self) -> str:
        """Which kernel rows priced the plan (memo_ext.estimate.kernels.kernel_rows_line)."""
        return kernel_rows_line(self.problem.hardware)

    @property
    def fits(self) -> bool:
        # the solver scales the offloaded fractions down to the host memory, so the host fits
        return self.candidate.fits

    def trainer_flags(self, global_batch: int) -> list[str]:
        """pretrain_gpt.py's flags for this plan (as Layout.trainer_flags: the model's own
        flags come from its config script). Offload is ``auto`` when the plan offloads: the
        trainer solves the same fractions from its measured bandwidth and host memory."""
        c = self.candidate
        return render_flags({
            "tensor_model_parallel_size": c.tp, "sequence_parallel": c.tp > 1,
            "context_parallel_size": 1, "pipeline_model_parallel_size": c.pp,
            "use_distributed_optimizer": True, "seq_length": self.seq,
            "max_position_embeddings": self.seq, "micro_batch_size": 1,
            "global_batch_size": global_batch, "memo_sppo": True,
            "memo_sppo_subsequences": c.subsequences,
            "memo_sppo_offload": "auto" if any(c.alphas) else "none",
            "memo_sppo_msp": self.problem.msp})

    def describe(self) -> str:
        c = self.candidate
        return (f"TP={c.tp} CP=1 PP={c.pp} DP={c.dp} mbs=1 SPPO N={c.subsequences}"
                + (" MSP" if self.problem.msp else ""))

    def verdict(self) -> str:
        if self.fits:
            return "FITS"
        terms = self.candidate.memory.terms()
        name = max(terms, key=terms.get)
        return (f"OOM on device (every rank: {self.peak_device_bytes / GiB:.1f} GiB; largest "
                f"term: {name} {terms[name] / GiB:.1f} GiB)")

    def lines(self) -> list[str]:
        """The solver's report of the plan, with the step for ``global_batch`` sequences."""
        return [f"seq {self.seq}: {self.verdict()}",
                *report_lines(self.candidate, self.problem),
                f"  {self.global_batch} sequences per iteration: {self.step_s:.2f} s "
                f"({self.global_batch // self.candidate.dp} after one another per replica); "
                f"predicted MFU {self.mfu:.1%}"]


@dataclass
class SPPOLayoutModel:
    """SPPO at one (TP, PP) for ``gpus`` GPUs, at any sequence length."""

    shape: dict
    gpus: int
    hardware: dict
    tp: int
    pp: int
    global_batch: int
    host_memory_bytes_per_node: Optional[float] = None
    _cache: dict = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def multiple(self) -> int:
        """Lengths are rounded down to a multiple of this (sequence parallelism splits by TP)."""
        return self.tp

    def predict(self, seq: int) -> SPPOPrediction:
        if seq < shortest_sequence(self.tp):
            raise EstimateError(f"--seq-length {seq}: SPPO needs at least "
                                f"{shortest_sequence(self.tp)} tokens")
        if seq not in self._cache:
            candidates = []
            for msp in ((False, True) if self.pp > 1 else (False,)):
                problem = Problem(self.shape, self.gpus, self.hardware, seq,
                                  self.host_memory_bytes_per_node, distributed_optimizer=True,
                                  msp=msp)
                candidates += [(evaluate(problem, self.tp, self.pp, n), problem)
                               for n in subsequence_counts(seq, self.tp)]
            fitting = [pair for pair in candidates if pair[0].fits]
            if fitting:
                best = min(fitting, key=lambda pair: pair[0].step_s)
            else:
                best = min(candidates, key=lambda pair: pair[0].memory.total)
            self._cache[seq] = SPPOPrediction(*best, global_batch=self.global_batch)
        return self._cache[seq]

    def longest(self, step: int, maximum: int, fine_step: Optional[int] = None) -> int:
        """Longest sequence with a fitting N, in ``step`` tokens (0 if none)."""
        def estimate(seq: int):
            seq -= seq % self.multiple
            return self.predict(seq) if seq >= shortest_sequence(self.tp) else _Fits(True)

        return max_sequence_length(estimate, step, maximum, fine_step)


@dataclass
class _Fits:
    fits: bool


def sppo_layout_models(shape: dict, gpus: int, hardware: dict, *, global_batch: int,
                       host_memory_gb_per_node: Optional[float] = None,
                       seq: Optional[int] = None
                       ) -> tuple[list[SPPOLayoutModel], list[tuple[str, str]]]:
    """(an SPPOLayoutModel per (TP, PP) the solver would try, [(layout, why it was dropped)]);
    ``seq``: the one length asked for, if any."""
    host = None if host_memory_gb_per_node is None else host_memory_gb_per_node * 1e9
    kept, dropped = [], []
    for tp, pp, dp in layouts(Problem(shape, gpus, hardware, 1 << 20, host)):
        if seq is not None and seq < shortest_sequence(tp):
            dropped.append((f"TP={tp} PP={pp} DP={dp} SPPO",
                            f"{seq} tokens: SPPO needs at least {shortest_sequence(tp)}"))
            continue
        if global_batch % dp:
            dropped.append((f"TP={tp} PP={pp} DP={dp} SPPO",
                            f"global batch {global_batch} does not divide by DP {dp}"))
            continue
        kept.append(SPPOLayoutModel(shape, gpus, hardware, tp, pp, global_batch, host))
    return kept, dropped
