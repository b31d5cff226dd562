"""Which trainings ``make gpu-check`` runs on G GPUs: one per mechanism, each with its layout
(TP x PP x DP, at most G ranks) and pretrain_gpt.py flags.

The trainer flags mirror what tools/trace.py traces for the estimator (bf16, distributed
optimizer, fp32 gradient accumulation, untied embeddings, rope, no dropout, sequence parallelism
always asked for), so the measured run and the prediction describe the same configuration;
tests/unit/test_gpu_check.py checks that against the tracer's own command line
(megatron.training.cli.trace.trainer_argv).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

#: Flags only a CUDA run accepts (the CPU trainer refuses them; see arguments.py).
CUDA_ONLY_FLAGS = ("--bf16", "--use-distributed-optimizer")
#: Most GPUs a check uses (one node of 8).
MAX_GPUS = 8


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

    @property
    def min_gpus(self) -> int:
        return self.tp * self.pp


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
    Mechanism("telemetry", ("--memo-telemetry",)),
    Mechanism("stitching-allocator", ("--memo-stitching-allocator",),
              estimator=("megatron-none", "stitching")),
)


@dataclass(frozen=True)
class PlannedRun:
    """One training: ``nproc`` ranks as TP x PP x DP, or a skip with its reason."""

    mechanism: Mechanism
    model: ModelSettings
    tp: int
    pp: int
    dp: int
    skip_reason: Optional[str] = None

    @property
    def nproc(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        """Sequences per iteration."""
        return self.dp * self.model.microbatches_per_replica

    def layout(self) -> str:
        return f"TP={self.tp} PP={self.pp} DP={self.dp} ({self.nproc} GPU{'s' * (self.nproc > 1)})"

    def argv(self, metrics_path: Path, cuda: bool = True) -> list[str]:
        """pretrain_gpt.py's flags; ``cuda=False`` drops :data:`CUDA_ONLY_FLAGS` (the CPU
        trainer, e.g. the test double's runner)."""
        m = self.model
        argv = [
            "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
            "--ffn-hidden-size", str(m.ffn_hidden_size),
            "--num-attention-heads", str(m.num_attention_heads),
            "--seq-length", str(m.seq_length), "--max-position-embeddings", str(m.seq_length),
            "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
            "--attention-dropout", "0", "--hidden-dropout", "0",
            "--micro-batch-size", "1", "--global-batch-size", str(self.global_batch),
            "--train-iters", str(m.train_iters), "--lr", "1e-4",
            "--mock-data", "--vocab-size", str(m.vocab_size),
            "--log-interval", "1", "--eval-interval", str(m.train_iters + 1), "--eval-iters", "0",
            "--tensor-model-parallel-size", str(self.tp),
            "--pipeline-model-parallel-size", str(self.pp),
            # As the tracer: SP always asked for (the trainer drops it at TP=1).
            "--sequence-parallel", "--accumulate-allreduce-grads-in-fp32", *CUDA_ONLY_FLAGS,
            "--log-metrics-jsonl", str(metrics_path),
            *self.mechanism.flags,
        ]
        return argv if cuda else [flag for flag in argv if flag not in CUDA_ONLY_FLAGS]


def plan(gpus: int, model: ModelSettings = ModelSettings(),
         mechanisms: tuple[Mechanism, ...] = MECHANISMS) -> list[PlannedRun]:
    """The runs for ``gpus`` visible GPUs (at most :data:`MAX_GPUS` used): each mechanism at its
    TP x PP with as many data-parallel replicas as fit, or skipped when it needs more GPUs."""
    usable = min(gpus, MAX_GPUS)
    runs = []
    for mechanism in mechanisms:
        reason = None
        if usable < mechanism.min_gpus:
            reason = (f"skipped: needs {mechanism.min_gpus} GPUs (TP={mechanism.tp} "
                      f"PP={mechanism.pp}), {usable} present")
        dp = max(1, usable // mechanism.min_gpus)
        runs.append(PlannedRun(mechanism, model, mechanism.tp, mechanism.pp, dp, reason))
    return runs
