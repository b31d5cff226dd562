"""Which trainings ``make gpu-check`` runs on G GPUs: one per mechanism, each with its layout
(TP x CP x PP x DP) and pretrain_gpt.py flags, and on which GPUs.

A one-GPU mechanism trains at DP=2 from 4 GPUs on (DP=1 below), the others at DP=1; the
trainings are packed into waves that run at once on disjoint GPUs (:func:`waves`: four at a
time on 8 GPUs). A context-parallel run is paired with a CP=1
reference on one GPU with the same global batch (:attr:`PlannedRun.reference`).

The trainer flags mirror what tools/trace.py traces for the estimator (bf16, distributed
optimizer, fp32 gradient accumulation, untied embeddings, rope, no dropout, sequence parallelism
always asked for), so the measured run and the prediction describe the same configuration;
tests/unit/megatron/memo_tools/gpu_check/test_gpu_check.py checks that against the tracer's own command line
(megatron.training.tracing.trainer_argv).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from memo_ext.flags import render_flags

#: Flags the CPU runs drop: --bf16, which the CPU trainer refuses (arguments.py), and
#: --use-distributed-optimizer, which trains on CPU too (docs/training.md) but which the CPU
#: double's runs leave out as the estimator's CPU traces do (memo_ext.estimate CPU_TRACE_FIELDS).
CUDA_ONLY_FLAGS = ("--bf16", "--use-distributed-optimizer")
#: Most GPUs a check uses (one node of 8).
MAX_GPUS = 8
#: Data-parallel replicas of a one-GPU mechanism from 4 GPUs on: 2 covers data parallelism
#: while 8 GPUs run four trainings at once (docs/gpu_check.md, "Time budget").
LANE_GPUS = 2


@dataclass(frozen=True)
class ModelSettings:
    """The small model every mechanism trains, and how its log is read.

    Sizes in tokens; ``steady_from``: the first iteration counted for the steady-state time
    and peak (MEMO's alpha is solved after iteration 1, the planned arena serves from 3).
    """

    num_layers: int = 4  # MEMO offload needs > 2 layers per stage
    hidden_size: int = 512
    ffn_hidden_size: int = 2048
    num_attention_heads: int = 8
    vocab_size: int = 4096
    seq_length: int = 4096
    microbatches_per_replica: int = 4  # fills PP=2's pipeline; micro-batch 1
    train_iters: int = 10
    steady_from: int = 3

    def describe(self) -> str:
        return (f"GPT {self.num_layers} layers, hidden {self.hidden_size}, FFN "
                f"{self.ffn_hidden_size}, {self.num_attention_heads} heads, vocabulary "
                f"{self.vocab_size}, {self.seq_length} tokens per sequence, micro-batch 1, "
                f"{self.microbatches_per_replica} micro-batches per data-parallel replica, bf16, "
                f"mock data, {self.train_iters} iterations (steady state: iterations "
                f"{self.steady_from}-{self.train_iters})")


@dataclass(frozen=True)
class Mechanism:
    """One row of the check.

    ``estimator``: (tools/estimate.py policy, allocator model) predicting this run, None when
    the estimator has no policy for it; ``sppo`` is SPPO's analytic solver, not a trace.
    """

    name: str
    flags: tuple[str, ...]
    tp: int = 1
    pp: int = 1
    estimator: Optional[tuple[str, str]] = ("megatron-none", "caching")
    cp: int = 1

    @property
    def min_gpus(self) -> int:
        return self.tp * self.cp * self.pp


#: SPPO's subsequences per sequence in the check (two of 2048 tokens at the default length).
SPPO_SUBSEQUENCES = 2

MECHANISMS = (
    Mechanism("plain", ()),
    # The estimator's memo policy traces MEMO with the chunked loss (layout.POLICY_FLAGS), so the
    # run uses it too; alpha auto cannot be traced: the prediction takes the alpha the run solved.
    Mechanism("memo-offload-alpha-auto",
              ("--memo-offload", "--memo-alpha", "auto", "--cross-entropy-loss-fusion",
               "--cross-entropy-fusion-impl", "chunked"), estimator=("memo", "caching")),
    # One offload buffer: each copy waits, one layer's data on device at a time.
    Mechanism("memo-offload-one-buffer",
              ("--memo-offload", "--memo-alpha", "auto", "--memo-offload-buffers", "1",
               "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "chunked"),
              estimator=("memo", "caching")),
    Mechanism("planned-arena", ("--memo-plan", "auto"), estimator=("megatron-none", "arena")),
    # SPPO's exactness tests run PP >= 2 (its point is the pipeline), so it needs 2 GPUs.
    Mechanism("sppo", ("--memo-sppo", "--memo-sppo-subsequences", str(SPPO_SUBSEQUENCES),
                       "--memo-sppo-offload", "auto"), pp=2, estimator=("sppo", "solver")),
    Mechanism("metp", ("--memo-metp",), tp=2, estimator=None),
    # The zigzag ring across 2 GPUs, its losses and grad norms compared with CP=1 (check.py).
    Mechanism("context-parallel", (), cp=2),
    Mechanism("telemetry", ("--memo-telemetry",)),
    Mechanism("stitching-allocator", ("--memo-stitching-allocator",),
              estimator=("megatron-none", "stitching")),
)


@dataclass(frozen=True)
class PlannedRun:
    """One training: ``nproc`` ranks as TP x CP x PP x DP, or a skip with its reason;
    ``reference``: for CP > 1, the same model and global batch at CP=1 on one GPU, whose
    per-iteration loss and grad norm the run must reproduce."""

    mechanism: Mechanism
    model: ModelSettings
    tp: int
    pp: int
    dp: int
    skip_reason: Optional[str] = None
    cp: int = 1
    reference: Optional["PlannedRun"] = None

    @property
    def nproc(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        """Sequences per iteration."""
        return self.dp * self.model.microbatches_per_replica

    def layout(self) -> str:
        cp = f" CP={self.cp}" if self.cp > 1 else ""
        return (f"TP={self.tp}{cp} PP={self.pp} DP={self.dp} "
                f"({self.nproc} GPU{'s' * (self.nproc > 1)})")

    def argv(self, metrics_path: Path, cuda: bool = True) -> list[str]:
        """pretrain_gpt.py's flags; ``cuda=False`` drops :data:`CUDA_ONLY_FLAGS` (the CPU
        trainer, e.g. the test double's runner)."""
        m = self.model
        argv = render_flags({
            "num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "ffn_hidden_size": m.ffn_hidden_size, "num_attention_heads": m.num_attention_heads,
            "seq_length": m.seq_length, "max_position_embeddings": m.seq_length,
            "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True,
            "attention_dropout": 0, "hidden_dropout": 0, "micro_batch_size": 1,
            "global_batch_size": self.global_batch, "train_iters": m.train_iters,
            "lr": 1e-4, "mock_data": True, "vocab_size": m.vocab_size, "log_interval": 1,
            "eval_interval": m.train_iters + 1, "eval_iters": 0,
            "tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
            "context_parallel_size": self.cp,
            # As the tracer: SP always asked for (the trainer drops it at TP=1).
            "sequence_parallel": True, "accumulate_allreduce_grads_in_fp32": True,
            "bf16": True, "use_distributed_optimizer": True,
            "log_metrics_jsonl": str(metrics_path)}) + list(self.mechanism.flags)
        return argv if cuda else [flag for flag in argv if flag not in CUDA_ONLY_FLAGS]


def lane_gpus(gpus: int) -> int:
    """GPUs a one-GPU mechanism trains on (its data-parallel replicas) when ``gpus`` are
    visible: :data:`LANE_GPUS` from 4 GPUs on, else 1 (on 2 or 3 GPUs, two such trainings run
    at once rather than one at DP=2, which would not fit the budget, docs/gpu_check.md)."""
    return LANE_GPUS if min(gpus, MAX_GPUS) >= 2 * LANE_GPUS else 1


def plan(gpus: int, model: ModelSettings = ModelSettings(),
         mechanisms: tuple[Mechanism, ...] = MECHANISMS) -> list[PlannedRun]:
    """The runs for ``gpus`` visible GPUs: a one-GPU mechanism at DP=:func:`lane_gpus`, the
    others at their TP x CP x PP with DP=1, or skipped when they need more GPUs than present.
    A CP > 1 run carries its CP=1 reference (one GPU, DP=1: with the run's DP=1 both see the
    same micro-batches in the same order, the global batch split into micro-batches of one)."""
    usable = min(gpus, MAX_GPUS)
    runs = []
    for mechanism in mechanisms:
        reason = None
        if usable < mechanism.min_gpus:
            reason = (f"skipped: needs {mechanism.min_gpus} GPUs (TP={mechanism.tp} "
                      + (f"CP={mechanism.cp} " if mechanism.cp > 1 else "")
                      + f"PP={mechanism.pp}), {usable} present")
        dp = lane_gpus(gpus) if mechanism.min_gpus == 1 else 1
        reference = None
        if mechanism.cp > 1:
            reference = PlannedRun(
                Mechanism(f"{mechanism.name}-cp1-reference", mechanism.flags, mechanism.tp,
                          mechanism.pp, None), model, mechanism.tp, mechanism.pp, 1)
        runs.append(PlannedRun(mechanism, model, mechanism.tp, mechanism.pp, dp, reason,
                               mechanism.cp, reference))
    return runs


def launches(runs: list[PlannedRun]) -> list[PlannedRun]:
    """The trainings to launch: each run not skipped, its CP=1 reference after it."""
    out = []
    for run in runs:
        if run.skip_reason is None:
            out.append(run)
            if run.reference is not None:
                out.append(run.reference)
    return out


def waves(runs: list[PlannedRun], gpus: int) -> list[list[tuple[PlannedRun, tuple[int, ...]]]]:
    """:func:`launches` packed first-fit, in order, into waves of trainings that run at once on
    disjoint GPUs, each with its GPUs (indices into the visible GPUs); a wave starts when the
    previous one has ended."""
    usable = min(gpus, MAX_GPUS)
    packed: list[list[PlannedRun]] = []
    for run in launches(runs):
        for wave in packed:
            if sum(r.nproc for r in wave) + run.nproc <= usable:
                wave.append(run)
                break
        else:
            packed.append([run])
    out = []
    for wave in packed:
        first, placed = 0, []
        for run in wave:
            placed.append((run, tuple(range(first, first + run.nproc))))
            first += run.nproc
        out.append(placed)
    return out
