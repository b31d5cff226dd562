"""Megatron-style command line: ``_add_*_args`` groups with Megatron-LM's flag names and
semantics, cross-flag validation, and the translation to megatron.core config dataclasses.

Validation runs before torch.distributed is initialised, before megatron.core is imported and
before any model is built, so a bad launch fails within seconds with one line naming the flag
at fault and the fix.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from megatron.training.profiling import add_profile_args, profile_problem
from megatron.training.rope_scaling import (
    RopeScalingError,
    add_rope_scaling_args,
    validate_rope_scaling,
    yarn_config_attributes,
)
from megatron.training.megatron_fsdp import add_megatron_fsdp_args, validate_megatron_fsdp
from megatron.training.run_controls import add_run_control_args
from megatron.training.timing import add_timing_args
from megatron.training.upstream_flags import (
    UpstreamFlagRefused,
    add_upstream_args,
    validate_upstream_flags,
)
from megatron.training.wandb_logging import add_wandb_args, wandb_problem
from memo_ext.config import (
    CONFIG_GROUPS,
    AttentionConfig,
    METPConfig,
    MemoConfigError,
    OffloadConfig,
    PlanConfig,
    SPPOConfig,
    StitchingConfig,
    TiledMLPConfig,
    add_config_arguments,
    validated_configs,
)
from memo_ext.loss.chunked import DEFAULT_CHUNK_BYTES as DEFAULT_CROSS_ENTROPY_CHUNK_BYTES
from memo_ext.telemetry.monitor import MEMORY_EXIT_STATUS, MemoryBudgetExceeded

TOKENIZER_TYPES = ("BytesTokenizer", "BPETokenizer", "NullTokenizer", "HuggingFaceTokenizer",
                   "GPT2BPETokenizer")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ATTN_MASK_TYPES = ("causal", "no_mask")
CROSS_ENTROPY_FUSION_IMPLS = ("native", "te", "chunked")
CKPT_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")  # Megatron-LM's choices


#: The model-shape flags tools/trace.py takes as the trainer does (one definition each): its
#: --model presets fill what is not given.
MODEL_SHAPE_FLAGS = {
    "--num-layers": dict(type=int, default=None, help="Number of transformer layers."),
    "--hidden-size": dict(type=int, default=None, help="Transformer hidden size."),
    "--ffn-hidden-size": dict(
        type=int, default=None,
        help="MLP hidden size. Default 4*hidden-size, or 8/3*hidden-size rounded down to a "
        "multiple of 64 with --swiglu."),
    "--num-attention-heads": dict(type=int, default=None),
    "--kv-channels": dict(
        type=int, default=None,
        help="Projection size per head. Default hidden-size / num-attention-heads."),
    "--normalization": dict(default="LayerNorm", choices=NORMALIZATIONS),
    "--swiglu": dict(action="store_true", help="SwiGLU MLP (gated SiLU)."),
}


#: Megatron-LM's optimizer CPU offload flags (core_v0.16.1 arguments.py), one definition for
#: the trainer and the tools that model it (tools/trace.py, tools/estimate.py).
OPTIMIZER_OFFLOAD_FLAGS = {
    "--optimizer-cpu-offload": dict(
        action="store_true",
        help="Keep (a fraction of) the optimizer's states and step on the host: megatron-core's "
        "HybridDeviceOptimizer. Needs --use-precision-aware-optimizer."),
    "--optimizer-offload-fraction": dict(
        type=float, default=1.0,
        help="With --optimizer-cpu-offload: the fraction of the optimizer's parameters (by "
        "elements, in parameter order) whose states and update live on the host."),
    "--use-torch-optimizer-for-cpu-offload": dict(
        action="store_true",
        help="With --optimizer-cpu-offload: torch.optim for the device part too (megatron-core "
        "0.16.1 uses torch's AdamW on both sides with --optimizer adam regardless)."),
    "--overlap-cpu-optimizer-d2h-h2d": dict(
        action="store_true",
        help="With --optimizer-cpu-offload: one host optimizer per parameter, gradients copied "
        "to the host and parameters back on side streams, overlapping the host step."),
    "--no-pin-cpu-grads": dict(
        action="store_false", dest="pin_cpu_grads",
        help="With --optimizer-cpu-offload: host gradient copies in pageable memory."),
    "--no-pin-cpu-params": dict(
        action="store_false", dest="pin_cpu_params",
        help="With --optimizer-cpu-offload: host parameter copies in pageable memory "
        "(megatron-core 0.16.1 pins them regardless)."),
}


def add_optimizer_offload_args(group, flags=tuple(OPTIMIZER_OFFLOAD_FLAGS)) -> None:
    """Add the named :data:`OPTIMIZER_OFFLOAD_FLAGS` to ``group``, in that order."""
    for flag in flags:
        group.add_argument(flag, **OPTIMIZER_OFFLOAD_FLAGS[flag])


def add_grad_reduce_in_bf16_arg(group) -> None:
    """Megatron-LM's --grad-reduce-in-bf16, one definition for the trainer and the tools that
    model it (tools/trace.py, tools/estimate.py)."""
    group.add_argument(
        "--grad-reduce-in-bf16", action="store_true",
        help="With --bf16: accumulate and reduce gradients in bf16, a gradient buffer half "
        "the size (default fp32, as Megatron-LM).")


def add_model_shape_args(group, flags=tuple(MODEL_SHAPE_FLAGS)) -> None:
    """Add the named :data:`MODEL_SHAPE_FLAGS` to ``group``, in that order."""
    for flag in flags:
        group.add_argument(flag, **MODEL_SHAPE_FLAGS[flag])


class ArgumentValidationError(ValueError):
    """A flag combination that cannot run. The message names the flag and the fix."""


def _add_network_size_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="network size")
    group.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="Layer implementation. 'local' (default): megatron.core's local spec with "
        "memo_ext.attention's core attention, the modules tools/trace.py and tools/estimate.py "
        "measure, on CPU and GPU. 'transformer_engine': megatron.core's TE spec (CUDA and "
        "transformer_engine needed; not what the estimator predicts; no --memo-* mechanism).",
    )
    group.add_argument(
        "--attention-backend",
        choices=("flash", "fused", "unfused", "local", "auto"),
        default="auto",
        help="Megatron-LM's attention backend switch, for memo_ext.attention's tile kernels on "
        "CUDA (docs/attention.md): 'auto' (default) the fastest exact kernel, cuDNN's fused "
        "attention on Hopper and later (compute capability >= 9.0), FlashAttention-2 before; "
        "'flash' FlashAttention-2 (flash-attn >= 2.7 when installed, else torch's build); "
        "'fused' cuDNN's fused attention (refused where it cannot run); 'unfused' the explicit "
        "fp32 softmax, scores materialised per tile. 'local' (megatron.core's own "
        "DotProductAttention) is refused: memo_ext's core attention replaces it. With "
        "--transformer-impl transformer_engine the value goes to megatron.core as upstream.",
    )
    add_model_shape_args(group, ("--num-layers", "--hidden-size", "--ffn-hidden-size",
                                 "--num-attention-heads", "--kv-channels"))
    group.add_argument("--group-query-attention", action="store_true")
    group.add_argument("--num-query-groups", type=int, default=1)
    group.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Positions of the learned position table. Default: --seq-length.",
    )
    group.add_argument(
        "--position-embedding-type", default="learned_absolute", choices=POSITION_EMBEDDING_TYPES
    )
    group.add_argument(
        "--use-rotary-position-embeddings", action="store_true",
        help="Megatron-LM's legacy spelling of --position-embedding-type rope.",
    )
    group.add_argument("--rotary-base", type=int, default=10000)
    group.add_argument("--rotary-percent", type=float, default=1.0)
    add_rope_scaling_args(group)  # docs/rope_scaling.md
    add_model_shape_args(group, ("--normalization",))
    group.add_argument("--norm-epsilon", type=float, default=1e-5)
    group.add_argument(
        "--apply-layernorm-1p", action="store_true",
        help="Zero-centred gamma: every norm scales by 1 + weight, the weight starting at 0 "
        "(TransformerConfig.layernorm_zero_centered_gamma).",
    )
    add_model_shape_args(group, ("--swiglu",))
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    group.add_argument(
        "--add-qkv-bias",
        action="store_true",
        help="Bias on the query/key/value projection even with --disable-bias-linear "
        "(Qwen2/2.5).",
    )
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this times the TP size.",
    )
    group.add_argument(
        "--attn-mask-type",
        default="causal",
        choices=ATTN_MASK_TYPES,
        help="Self-attention mask. Context parallelism needs causal.",
    )


def _add_regularization_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="regularization")
    group.add_argument("--attention-dropout", type=float, default=0.1)
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=1.0, help="Gradient norm clip; 0 disables.")
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--sgd-momentum", type=float, default=0.9)


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, default=None)
    group.add_argument("--global-batch-size", type=int, default=None)
    group.add_argument("--train-iters", type=int, default=None)
    group.add_argument(
        "--train-samples", type=int, default=None,
        help="Sample-based training (instead of --train-iters): train-samples // "
        "global-batch-size iterations; the LR schedule then counts samples.",
    )
    group.add_argument(
        "--exit-interval", type=int, default=None, help="Exit (after saving) at this iteration."
    )
    group.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On SIGTERM (e.g. SLURM preemption), save a checkpoint at the end of the current "
        "iteration and exit 0.",
    )
    group.add_argument(
        "--exit-signal",
        default="SIGTERM",
        choices=("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"),
        help="Signal caught by --exit-signal-handler.",
    )
    group.add_argument(
        "--recompute-granularity", default=None, choices=("full", "selective"),
        help="Megatron activation recomputation.",
    )
    group.add_argument("--recompute-method", default=None, choices=("uniform", "block"))
    group.add_argument("--recompute-num-layers", type=int, default=None)
    group.add_argument(
        "--recompute-modules",
        nargs="*",
        default=None,
        help="Modules recomputed with --recompute-granularity selective (default core_attn).",
    )
    add_run_control_args(group)  # --manual-gc, --exit-duration-in-mins, ...
    group.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    group.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard optimizer state (fp32 master weights, Adam moments) over the data-parallel x "
             "context-parallel ranks (megatron-core DistributedOptimizer; CPU via gloo too).",
    )
    # Optimizer CPU offload: Megatron-LM's flags (core_v0.16.1 arguments.py), megatron-core's
    # HybridDeviceOptimizer (docs/training.md, "On CPU").
    add_optimizer_offload_args(group)
    group.add_argument(
        "--use-precision-aware-optimizer", action="store_true",
        help="Main parameters and gradients held by the optimizer (decoupled gradients): "
        "Transformer Engine's FusedAdam, or the HybridDeviceOptimizer of "
        "--optimizer-cpu-offload. Needs --use-distributed-optimizer.",
    )
    group.add_argument(
        "--deterministic-mode",
        action="store_true",
        help="Deterministic algorithms only: two runs give bitwise-identical losses.",
    )
    group.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes.")
    group.add_argument(
        "--cross-entropy-loss-fusion", action="store_true",
        help="Fuse the output layer and the cross-entropy (implementation: "
        "--cross-entropy-fusion-impl). Default off: megatron's unfused vocab-parallel loss.",
    )
    group.add_argument(
        "--cross-entropy-fusion-impl", default=None, choices=CROSS_ENTROPY_FUSION_IMPLS,
        help="With --cross-entropy-loss-fusion: 'native' (megatron-core's fused kernel), 'te' "
        "(Transformer Engine, CUDA), 'chunked' (memo_ext.loss: logits computed "
        "--cross-entropy-chunk-size tokens at a time and never kept; for long sequences, "
        "docs/loss.md). Default native.",
    )
    group.add_argument(
        "--calculate-per-token-loss", action="store_true",
        help="Each micro-batch's loss is its token sum; gradients are divided by the global "
        "batch's token count (over data- and context-parallel ranks), as Megatron-LM.",
    )
    group.add_argument(
        "--cross-entropy-chunk-size", type=int, default=None, metavar="TOKENS",
        help="With --cross-entropy-fusion-impl chunked: tokens whose logits exist at once. "
        f"Default: as many as fit {DEFAULT_CROSS_ENTROPY_CHUNK_BYTES >> 20} MiB of logits "
        "(3328 tokens at 7B TP4 bf16; docs/loss.md).",
    )


def _add_initialization_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="initialization")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--init-method-std", type=float, default=0.02)


def _add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, default=None)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES)
    group.add_argument("--lr-decay-iters", type=int, default=None, help="Default: --train-iters.")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--lr-warmup-fraction", type=float, default=None)
    group.add_argument("--lr-warmup-init", type=float, default=0.0)
    group.add_argument("--lr-decay-samples", type=int, default=None,
                       help="With --train-samples: decay over this many samples (default all).")
    group.add_argument("--lr-warmup-samples", type=int, default=0,
                       help="With --train-samples: warm up over this many samples.")
    group.add_argument("--decoupled-lr", type=float, default=None,
                       help="Max LR of the input embedding and output layer.")
    group.add_argument("--decoupled-min-lr", type=float, default=None,
                       help="Min LR of the input embedding and output layer (with "
                       "--decoupled-lr).")
    group.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    group.add_argument("--lr-wsd-decay-style", default="exponential")
    group.add_argument("--start-weight-decay", type=float, default=None)
    group.add_argument("--end-weight-decay", type=float, default=None)
    group.add_argument("--weight-decay-incr-style", default="constant")


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", default=None, help="Checkpoint directory to write.")
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument(
        "--load", default=None, help="Checkpoint directory to resume from (latest iteration)."
    )
    group.add_argument("--no-load-optim", action="store_true")
    group.add_argument("--no-load-rng", action="store_true")
    group.add_argument("--finetune", action="store_true", help="Load weights only, iteration 0.")
    group.add_argument(
        "--ckpt-format", default="torch_dist", choices=CKPT_FORMATS,
        help="torch_dist (megatron-core dist_checkpointing), the only format written and read "
        "here; the others are refused.",
    )


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--fp16", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--loss-scale", type=float, default=None)
    group.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    group.add_argument("--attention-softmax-in-fp32", action="store_true")
    add_grad_reduce_in_bf16_arg(group)


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--context-parallel-size", type=int, default=1)
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument(
        "--distributed-backend",
        default=None,
        choices=("nccl", "gloo"),
        help="Default: nccl with CUDA, gloo without.",
    )
    group.add_argument("--distributed-timeout-minutes", type=int, default=10)
    group.add_argument("--overlap-grad-reduce", action="store_true")
    group.add_argument(
        "--overlap-param-gather", action="store_true",
        help="With --use-distributed-optimizer: all-gather updated parameters behind the next "
        "forward (forward pre-hooks) instead of at the end of the optimizer step.",
    )
    group.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    add_megatron_fsdp_args(group)  # --use-megatron-fsdp, --data-parallel-sharding-strategy


def _add_validation_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="validation")
    group.add_argument("--eval-interval", type=int, default=1000)
    group.add_argument("--eval-iters", type=int, default=100)


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="data and tokenizer")
    group.add_argument("--seq-length", type=int, default=None)
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Indexed dataset prefix(es) (PREFIX.bin/PREFIX.idx), optionally weighted: "
        "'0.3 A 0.7 B'.",
    )
    group.add_argument("--mock-data", action="store_true", help="Synthetic tokens, no files.")
    group.add_argument("--split", default="969,30,1", help="Train,valid,test proportions.")
    group.add_argument("--data-cache-path", default=None)
    group.add_argument(
        "--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
        help="Read the .bin files with file reads instead of memory maps.",
    )
    group.add_argument("--tokenizer-type", default=None, help=f"One of {', '.join(TOKENIZER_TYPES)}.")
    group.add_argument("--tokenizer-model", default=None,
                       help="BPETokenizer: its JSON file. HuggingFaceTokenizer: a Hugging Face "
                       "tokenizer folder or its tokenizer.json.")
    group.add_argument("--vocab-file", default=None,
                       help="GPT2BPETokenizer: its vocab.json (with --merge-file).")
    group.add_argument("--merge-file", default=None,
                       help="GPT2BPETokenizer: its merges.txt (with --vocab-file).")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer: its ids. HuggingFaceTokenizer: the model's "
                       "vocabulary when it has more rows than the tokenizer has ids.")
    group.add_argument("--reset-position-ids", action="store_true")
    group.add_argument("--reset-attention-mask", action="store_true")
    group.add_argument("--eod-mask-loss", action="store_true")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="logging")
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--tensorboard-dir", default=None)
    group.add_argument(
        "--logging-level", type=int, default=None,
        help="The root Python logger's level (20: INFO, 30: WARNING), as Megatron-LM; default "
        "$MEGATRON_LOGGING_LEVEL, else logging is left as it is.",
    )
    add_timing_args(group)  # --timing-log-level, --timing-log-option, --log-timers-to-tensorboard
    add_wandb_args(group)  # --wandb-project, ...
    add_profile_args(group)  # --profile, --profile-step-start, ...
    group.add_argument(
        "--log-metrics-jsonl",
        default=None,
        help="Append one JSON line of metrics per logged iteration (rank 0) to this file.",
    )
    group.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="Per-device peak TFLOP/s for MFU. Default: the dense bf16 peak (bf16_tflops) of "
        "the memo_ext/hardware.json profile whose device_names match "
        "torch.cuda.get_device_name() (A100, A800, H100 SXM, H200 SXM; another GPU needs this "
        "flag); on CPU, a fp32 GEMM throughput measured at startup.",
    )


def _add_memo_args(parser: argparse.ArgumentParser) -> None:
    """--memo-* flags, generated from memo_ext's config dataclasses (one definition per flag)."""
    for config_cls, title in CONFIG_GROUPS:
        add_config_arguments(parser, config_cls, title=title)


ArgsProvider = Callable[[argparse.ArgumentParser], None]


def build_parser(extra_args_providers: Iterable[ArgsProvider] = ()) -> argparse.ArgumentParser:
    """The full Megatron-MEMO parser; extra providers add their own argument groups."""
    parser = argparse.ArgumentParser(
        description="Megatron-MEMO arguments", allow_abbrev=False, fromfile_prefix_chars="@"
    )
    for add_group in (
        _add_network_size_args,
        _add_regularization_args,
        _add_training_args,
        _add_initialization_args,
        _add_learning_rate_args,
        _add_checkpointing_args,
        _add_mixed_precision_args,
        _add_distributed_args,
        _add_validation_args,
        _add_data_args,
        _add_logging_args,
        add_upstream_args,  # Megatron-LM's flags refused, or always so here
        _add_memo_args,
        *extra_args_providers,
    ):
        add_group(parser)
    return parser


def parse_args(
    argv: Optional[Sequence[str]] = None,
    extra_args_providers: Iterable[ArgsProvider] = (),
    world_size: Optional[int] = None,
    cuda_available: Optional[bool] = None,
) -> argparse.Namespace:
    """Parse and validate. ``world_size`` defaults to $WORLD_SIZE (torchrun) or 1."""
    args = build_parser(extra_args_providers).parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    validate_args(args, world_size, cuda_available)
    return args


def silence_expected_cpu_warnings() -> None:
    """Hide megatron.core's import-time notices that Apex/Transformer Engine are missing:
    on a CPU machine that is the expected state, and they would bury real errors."""
    from megatron.training.library_warnings import hide_library_warnings

    hide_library_warnings()


def run_main(main: Callable[[list[str]], None], argv: Optional[Sequence[str]] = None) -> None:
    """Run an entry point's ``main(argv)``; an ArgumentValidationError becomes one line on
    stderr (rank 0 only) and exit status 2; a memory stop of --memo-telemetry (out of memory or
    fail-fast, its report already written) one line on the stopping rank's stderr and exit
    status 3."""
    if not torch.cuda.is_available():
        silence_expected_cpu_warnings()
    try:
        main(list(sys.argv[1:] if argv is None else argv))
    except (ArgumentValidationError, MemoConfigError) as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except MemoryBudgetExceeded as error:  # --memo-telemetry: OOM or fail-fast, report written
        print(f"error: rank {os.environ.get('RANK', '0')}: {error}", file=sys.stderr, flush=True)
        if error.peers_waiting:
            # Peers may be blocked in a collective with this rank: no teardown, exit now (the
            # launcher then stops them).
            sys.stdout.flush()
            os._exit(MEMORY_EXIT_STATUS)
        sys.exit(MEMORY_EXIT_STATUS)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentValidationError(message)


def _validate_required(args: argparse.Namespace) -> None:
    for flag in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "lr",
    ):
        _require(
            getattr(args, flag) is not None,
            f"--{flag.replace('_', '-')} is required; add it to the command line",
        )
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size"):
        value = getattr(args, flag)
        _require(value > 0, f"--{flag.replace('_', '-')} must be positive, got {value}")
    _require(args.train_iters is not None or args.train_samples is not None,
             "--train-iters is required (or Megatron-LM's --train-samples); add it to the "
             "command line")
    _require(args.train_iters is None or args.train_samples is None,
             "--train-samples and --train-iters are exclusive; keep one")
    for flag in ("train_iters", "train_samples"):
        value = getattr(args, flag)
        _require(value is None or value > 0,
                 f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.use_rotary_position_embeddings:  # Megatron-LM's legacy spelling
        args.position_embedding_type = "rope"


def _validate_parallel_layout(args: argparse.Namespace, world_size: int) -> None:
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    for flag, size in (("tensor-model-parallel-size", tp), ("pipeline-model-parallel-size", pp),
                       ("context-parallel-size", cp)):
        _require(size >= 1, f"--{flag} must be >= 1, got {size}")
    model_parallel = tp * pp * cp
    _require(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
        f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = "
        f"{model_parallel}; change the parallel sizes or the number of processes",
    )
    args.world_size = world_size
    args.data_parallel_size = world_size // model_parallel
    _require(
        args.num_attention_heads % tp == 0,
        f"--num-attention-heads {args.num_attention_heads} is not divisible by "
        f"--tensor-model-parallel-size {tp}; pick a TP size that divides the head count",
    )
    _require(
        args.num_layers % pp == 0,
        f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
        f"{pp}; pick a PP size that divides the layer count",
    )
    if args.sequence_parallel and tp == 1:
        # Megatron-LM's behaviour: sequence parallelism is a no-op without TP.
        args.sequence_parallel = False
    if args.sequence_parallel:
        _require(
            args.seq_length % (tp * cp) == 0,
            f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size "
            f"{tp} x --context-parallel-size {cp} as --sequence-parallel needs; pad the "
            f"sequence length",
        )
    if cp > 1:
        _require(
            args.seq_length % (2 * cp) == 0,
            f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size "
            f"{cp} (load-balanced CP splits the sequence into 2*CP chunks); pad the sequence "
            f"length to a multiple of {2 * cp}",
        )
        _require(
            args.attn_mask_type == "causal",
            f"--context-parallel-size {cp} needs --attn-mask-type causal, got "
            f"{args.attn_mask_type}; drop --attn-mask-type or set CP to 1",
        )


def _validate_model_shape(args: argparse.Namespace) -> None:
    tp = args.tensor_model_parallel_size
    if args.kv_channels is None:
        _require(
            args.hidden_size % args.num_attention_heads == 0,
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}; set --kv-channels explicitly or change the head count",
        )
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.group_query_attention:
        _require(
            args.num_query_groups >= 1
            and args.num_attention_heads % args.num_query_groups == 0,
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {args.num_query_groups}; use a group count that divides it",
        )
        _require(
            args.num_query_groups % tp == 0,
            f"--num-query-groups {args.num_query_groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}; each TP rank needs whole KV groups",
        )
    else:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    _require(
        args.ffn_hidden_size % tp == 0,
        f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
        f"--tensor-model-parallel-size {tp}; change one of them",
    )
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        _require(
            args.max_position_embeddings >= args.seq_length,
            f"--max-position-embeddings {args.max_position_embeddings} is smaller than "
            f"--seq-length {args.seq_length}; raise it or use --position-embedding-type rope",
        )
    for flag in ("attention_dropout", "hidden_dropout"):
        value = getattr(args, flag)
        _require(0.0 <= value < 1.0, f"--{flag.replace('_', '-')} must be in [0, 1), got {value}")
    validate_rope_scaling(args)


def _validate_batch(args: argparse.Namespace) -> None:
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    _require(
        args.global_batch_size > 0 and args.global_batch_size % per_step == 0,
        f"--global-batch-size {args.global_batch_size} is not divisible by "
        f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
        f"{args.data_parallel_size}; use a multiple of {per_step}",
    )
    args.num_microbatches = args.global_batch_size // per_step


def _validate_schedule(args: argparse.Namespace) -> None:
    """--train-samples, --lr-decay-samples, --lr-warmup-samples (Megatron-LM's rules): the
    iterations are train-samples // global-batch-size; the schedule's own steps (samples) are
    kept for build_optimizer. --decoupled-min-lr applies to --decoupled-lr only."""
    _require(args.decoupled_min_lr is None or args.decoupled_lr is not None,
             "--decoupled-min-lr applies to --decoupled-lr; add it or drop the flag")
    if args.train_samples is None:
        for flag in ("lr_decay_samples", "lr_warmup_samples"):
            _require(not getattr(args, flag), f"--{flag.replace('_', '-')} counts samples, which "
                     "needs --train-samples; with --train-iters use --lr-decay-iters/"
                     "--lr-warmup-iters")
        return
    _require(args.lr_decay_iters is None and not args.lr_warmup_iters,
             "--lr-decay-iters/--lr-warmup-iters count iterations; with --train-samples use "
             "--lr-decay-samples/--lr-warmup-samples")
    _require(not (args.lr_warmup_fraction is not None and args.lr_warmup_samples),
             "--lr-warmup-fraction and --lr-warmup-samples are exclusive; keep one")
    args.train_iters = args.train_samples // args.global_batch_size
    _require(args.train_iters > 0, f"--train-samples {args.train_samples} is less than one "
             f"--global-batch-size {args.global_batch_size}; raise it")
    if args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples
    _require(args.lr_decay_samples > 0,
             f"--lr-decay-samples must be positive, got {args.lr_decay_samples}")
    _require(0 <= args.lr_warmup_samples <= args.lr_decay_samples,
             f"--lr-warmup-samples {args.lr_warmup_samples} must be in [0, --lr-decay-samples "
             f"{args.lr_decay_samples}]")


def _validate_recompute(args: argparse.Namespace) -> None:
    if args.recompute_granularity == "full":
        _require(
            args.recompute_method is not None,
            "--recompute-granularity full needs --recompute-method uniform or block",
        )
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
        _require(
            args.recompute_num_layers >= 1,
            f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}",
        )
    elif args.recompute_granularity == "selective":
        _require(
            args.recompute_method is None,
            "--recompute-method applies to --recompute-granularity full only; drop it",
        )
        if args.recompute_modules is None:
            args.recompute_modules = ["core_attn"]
        # megatron-core 0.16.1's CheckpointWithoutOutput (the layernorm recompute) sets its fp8
        # switch to `fp8 is not None`, true for fp8=False, and then calls Transformer Engine's
        # FP8GlobalStateManager: a NameError mid-forward without TE (docs/training.md).
        _require("layernorm" not in args.recompute_modules or transformer_engine_installed(),
                 "--recompute-modules layernorm needs Transformer Engine installed (megatron-core "
                 "0.16.1's layernorm recompute calls it even without fp8); drop layernorm from "
                 "--recompute-modules or install transformer-engine")
    else:
        _require(
            args.recompute_method is None and args.recompute_num_layers is None,
            "--recompute-method/--recompute-num-layers need --recompute-granularity full",
        )


def _validate_precision(args: argparse.Namespace, cuda_available: bool) -> None:
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are exclusive; keep one")
    _require(
        args.transformer_impl == "local"
        or (cuda_available and importlib.util.find_spec("transformer_engine") is not None),
        "--transformer-impl transformer_engine needs CUDA and transformer_engine installed; "
        "use --transformer-impl local",
    )
    _require(
        args.transformer_impl == "local"
        or not (args.memo_offload or args.memo_sppo or args.memo_metp),
        "--memo-offload, --memo-sppo and --memo-metp build local layers; drop "
        "--transformer-impl transformer_engine",
    )
    if not cuda_available:
        _require(
            not (args.fp16 or args.bf16),
            f"--{'bf16' if args.bf16 else 'fp16'} needs CUDA: megatron-core's mixed-precision "
            "optimizer only wraps CUDA tensors; on CPU drop the flag and train in fp32",
        )
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def _validate_gradients(args: argparse.Namespace) -> None:
    """Gradient dtype under --bf16 (Megatron-LM: fp32 unless --grad-reduce-in-bf16), the
    parameter all-gather overlap, and --calculate-per-token-loss's schedules."""
    _require(not args.grad_reduce_in_bf16 or args.bf16,
             "--grad-reduce-in-bf16 applies to --bf16 training; add --bf16 or drop the flag")
    _require(not (args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32),
             "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are exclusive; "
             "keep one")
    if args.bf16 and not args.grad_reduce_in_bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer, "--overlap-param-gather overlaps the "
                 "distributed optimizer's parameter all-gather; add --use-distributed-optimizer "
                 "or drop the flag")
        _require(args.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce "
                 "(as in Megatron-LM); add it")
    _require(not (args.calculate_per_token_loss and getattr(args, "memo_sppo", False)),
             "--calculate-per-token-loss is not supported with --memo-sppo (its subsequence "
             "schedule divides each sequence's loss by its own tokens); drop one of them")


def _validate_run_controls(args: argparse.Namespace, cuda_available: bool) -> None:
    """--manual-gc, --exit-duration-in-mins, --ckpt-format, --logging-level, the timers, W&B
    and --profile."""
    _require(args.manual_gc_interval >= 0,
             f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    _require(args.manual_gc or args.manual_gc_interval == 0,
             "--manual-gc-interval applies to --manual-gc; add it or drop the flag")
    _require(args.manual_gc or args.manual_gc_eval,
             "--no-manual-gc-eval applies to --manual-gc; add it or drop the flag")
    _require(args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
             f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}")
    _require(args.ckpt_format in ("torch_dist", "fsdp_dtensor"),
             f"--ckpt-format {args.ckpt_format} is not supported: checkpoints here are "
             "megatron-core dist_checkpointing's torch_dist format (fsdp_dtensor with "
             "--use-megatron-fsdp); use --ckpt-format torch_dist or drop the flag")
    _require(args.logging_level is None or args.logging_level >= 0,
             f"--logging-level must be >= 0, got {args.logging_level}")
    _require(not args.log_timers_to_tensorboard or args.tensorboard_dir or args.wandb_project,
             "--log-timers-to-tensorboard writes to --tensorboard-dir (or W&B); give one")
    _require(args.timing_log_option is None or args.timing_log_level > 0,
             "--timing-log-option applies to --timing-log-level 1 or 2; add one or drop it")
    args.timing_log_option = args.timing_log_option or "minmax"
    for problem in (wandb_problem(args), profile_problem(args, cuda_available)):
        _require(problem is None, problem or "")


def _validate_attention_backend(args: argparse.Namespace, cuda_available: bool) -> None:
    """--attention-backend for memo_ext's core attention: 'local' refused; 'fused' checked
    against this machine's GPU (when it has one; a trace for another GPU checks its target)."""
    if args.transformer_impl != "local":
        return  # megatron.core's TE spec reads it as Megatron-LM does
    from memo_ext.attention import kernels

    _require(args.attention_backend != "local", kernels.LOCAL_BACKEND_REFUSAL)
    if args.attention_backend == "fused" and cuda_available and torch.cuda.is_available():
        try:
            kernels.cuda_backend(torch.cuda.get_device_capability(),
                                 kernels.cudnn_attention_available(), "fused",
                                 deterministic=bool(args.deterministic_mode))
        except ValueError as error:
            raise ArgumentValidationError(str(error)) from None


def _validate_cross_entropy(args: argparse.Namespace, cuda_available: bool) -> None:
    impl = args.cross_entropy_fusion_impl
    _require(
        impl is None or args.cross_entropy_loss_fusion,
        f"--cross-entropy-fusion-impl {impl} has no effect without --cross-entropy-loss-fusion; "
        "add --cross-entropy-loss-fusion",
    )
    args.cross_entropy_fusion_impl = impl = impl or "native"
    _require(
        impl != "te" or (cuda_available and importlib.util.find_spec("transformer_engine")),
        "--cross-entropy-fusion-impl te needs Transformer Engine on CUDA; use native or chunked",
    )
    chunk = args.cross_entropy_chunk_size
    _require(
        chunk is None or (args.cross_entropy_loss_fusion and impl == "chunked"),
        "--cross-entropy-chunk-size applies to --cross-entropy-loss-fusion "
        "--cross-entropy-fusion-impl chunked only; add those flags or drop it",
    )
    _require(chunk is None or chunk > 0, f"--cross-entropy-chunk-size must be positive, got {chunk}")


def _validate_optimization(args: argparse.Namespace) -> None:
    _require(args.lr > 0, f"--lr must be positive, got {args.lr}")
    _require(
        0.0 <= args.min_lr <= args.lr,
        f"--min-lr {args.min_lr} must be in [0, --lr {args.lr}]; lower --min-lr",
    )
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        _require(
            args.lr_warmup_iters == 0,
            "--lr-warmup-fraction and --lr-warmup-iters are exclusive; keep one",
        )
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    _require(
        0 <= args.lr_warmup_iters <= args.lr_decay_iters,
        f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --lr-decay-iters "
        f"{args.lr_decay_iters}]",
    )
    _require(args.clip_grad >= 0, f"--clip-grad must be >= 0, got {args.clip_grad}")
    _require(
        not (args.use_distributed_optimizer and args.optimizer != "adam"),
        "--use-distributed-optimizer takes --optimizer adam only (megatron-core's "
        "DistributedOptimizer checkpoints Adam's states); drop one of them",
    )
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay


def transformer_engine_installed() -> bool:
    """Whether Transformer Engine is importable here. The tracer (megatron.training.tracing)
    answers for the GPU machine it models instead, where the trainer needs it installed."""
    return importlib.util.find_spec("transformer_engine") is not None


def _validate_optimizer_cpu_offload(args: argparse.Namespace, cuda_available: bool) -> None:
    """Megatron-LM's rules for --optimizer-cpu-offload (megatron/training/arguments.py),
    megatron-core 0.16.1's OptimizerConfig asserts, and what its offload path needs, each as
    one line (docs/training.md, "On CPU")."""
    offload = args.optimizer_cpu_offload
    fraction = args.optimizer_offload_fraction
    _require(0.0 <= fraction <= 1.0,
             f"--optimizer-offload-fraction must be in [0, 1], got {fraction}")
    unused = [flag for flag, given in (
        ("--optimizer-offload-fraction", fraction != 1.0),
        ("--use-torch-optimizer-for-cpu-offload", args.use_torch_optimizer_for_cpu_offload),
        ("--overlap-cpu-optimizer-d2h-h2d", args.overlap_cpu_optimizer_d2h_h2d),
        ("--no-pin-cpu-grads", not args.pin_cpu_grads),
        ("--no-pin-cpu-params", not args.pin_cpu_params)) if given]
    _require(offload or not unused,
             f"{unused[0] if unused else ''} has no effect without --optimizer-cpu-offload; add "
             "it or drop the flag")
    _require(not offload or args.use_precision_aware_optimizer,
             "--optimizer-cpu-offload needs --use-precision-aware-optimizer (Megatron-LM: the "
             "hybrid device optimizer reuses its code path); add it")
    if not args.use_precision_aware_optimizer:
        return
    _require(args.use_distributed_optimizer,
             "--use-precision-aware-optimizer needs --use-distributed-optimizer; add it")
    _require(args.optimizer == "adam",
             f"--use-precision-aware-optimizer takes --optimizer adam only, got {args.optimizer}")
    have_te = transformer_engine_installed()
    _require(offload or have_te,
             "--use-precision-aware-optimizer without --optimizer-cpu-offload needs Transformer "
             "Engine's FusedAdam (not installed); add --optimizer-cpu-offload or drop the flag")
    if cuda_available:  # megatron.training.compat's fixes for these apply on CPU only
        _require(have_te,
                 "--use-precision-aware-optimizer on CUDA needs Transformer Engine installed "
                 "(megatron-core 0.16.1's OptimizerConfig reads its version); install it")
        _require(not offload or args.bf16 or args.fp16,
                 "--optimizer-cpu-offload on CUDA takes 16-bit parameters (megatron-core 0.16.1 "
                 "refuses fp32 shards); add --bf16")


def _validate_checkpointing(args: argparse.Namespace) -> None:
    if args.save_interval is not None:
        _require(args.save is not None, "--save-interval needs --save DIR")
        _require(args.save_interval > 0, f"--save-interval must be positive, got {args.save_interval}")
    if args.exit_signal_handler:
        _require(args.save is not None, "--exit-signal-handler needs --save DIR to save into")
    if args.load is not None and Path(args.load).exists():
        _require(Path(args.load).is_dir(), f"--load {args.load} is a file, not a directory")


def _validate_data(args: argparse.Namespace) -> None:
    _require(
        args.mock_data or args.data_path,
        "no training data: pass --data-path PREFIX (see tools/preprocess_data.py) or --mock-data",
    )
    _require(
        not (args.mock_data and args.data_path),
        "--mock-data and --data-path are exclusive; keep one",
    )
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"  # the only type those files are for
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data else None
    _require(
        args.tokenizer_type in TOKENIZER_TYPES,
        f"--tokenizer-type {args.tokenizer_type!r} is not supported; use one of "
        f"{', '.join(TOKENIZER_TYPES)}",
    )
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None and args.vocab_size > 1,
                 "--vocab-size N is required with --tokenizer-type NullTokenizer (and --mock-data)")
    if args.tokenizer_type == "BPETokenizer":
        _require(args.tokenizer_model is not None,
                 "--tokenizer-model FILE.json is required with --tokenizer-type BPETokenizer")
        _require(Path(args.tokenizer_model).is_file(),
                 f"--tokenizer-model {args.tokenizer_model} does not exist; train one with "
                 "tools/prepare_demo_data.py (or train_bpe_tokenizer) or fix the path")
    if args.tokenizer_type == "GPT2BPETokenizer":
        for flag in ("vocab_file", "merge_file"):
            path = getattr(args, flag)
            _require(path is not None and Path(path).is_file(),
                     f"--{flag.replace('_', '-')} {path} does not exist; GPT2BPETokenizer reads "
                     "a GPT-2 vocab.json and merges.txt (--vocab-file, --merge-file)")
    if args.tokenizer_type == "HuggingFaceTokenizer":
        _require(args.tokenizer_model is not None,
                 "--tokenizer-model DIR is required with --tokenizer-type HuggingFaceTokenizer "
                 "(a Hugging Face tokenizer folder or its tokenizer.json)")
        _require(Path(args.tokenizer_model).exists(),
                 f"--tokenizer-model {args.tokenizer_model} does not exist; give a Hugging Face "
                 "tokenizer folder (tokenizer.json, tokenizer_config.json) or fix the path")
    if args.data_path:
        for prefix in data_path_prefixes(args.data_path):
            for suffix in (".bin", ".idx"):
                _require(
                    Path(prefix + suffix).is_file(),
                    f"--data-path {prefix}: {prefix + suffix} does not exist; create it with "
                    "tools/preprocess_data.py or fix the prefix (no .bin/.idx suffix)",
                )
    # Megatron-LM reads the numbers out of the value, so quotes a script passes through are
    # ignored (the Llama scripts' --split "'99,1,0'"); anything else must be numbers.
    args.split = args.split.strip().strip("'\"")
    split = args.split.replace("/", ",").split(",")
    _require(
        len(split) <= 3 and all(part.strip().replace(".", "", 1).isdigit() for part in split)
        and sum(float(part) for part in split) > 0,
        f"--split {args.split!r} must be up to three non-negative numbers like 969,30,1",
    )
    _require(args.num_workers >= 0, f"--num-workers must be >= 0, got {args.num_workers}")


def data_path_prefixes(data_path: list[str]) -> list[str]:
    """Prefixes from '--data-path A B' or the weighted form '--data-path 0.3 A 0.7 B'."""
    if len(data_path) > 1 and len(data_path) % 2 == 0:
        try:
            float(data_path[0])
            return data_path[1::2]
        except ValueError:
            pass
    return list(data_path)


def _validate_logging(args: argparse.Namespace) -> None:
    _require(args.log_interval > 0, f"--log-interval must be positive, got {args.log_interval}")
    _require(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")
    _require(args.eval_interval > 0, f"--eval-interval must be positive, got {args.eval_interval}")
    if args.peak_tflops is not None:
        _require(args.peak_tflops > 0, f"--peak-tflops must be positive, got {args.peak_tflops}")


def _validate_memo(args: argparse.Namespace, cuda_available: bool) -> None:
    """The --memo-* flags: each config's own rules (memo_ext.config), then the combinations
    with the trainer's other flags."""
    configs = validated_configs(args)
    offload, sppo = configs[OffloadConfig], configs[SPPOConfig]
    tiled_mlp, attention = configs[TiledMLPConfig], configs[AttentionConfig]
    configs[StitchingConfig].validate_with(configs[PlanConfig].plan, cuda_available)
    if sppo.sppo:
        _validate_sppo(args, sppo, offload.offload)
    metp = configs[METPConfig].metp
    if metp:
        _validate_metp(args, sppo.sppo, offload.offload)
    if tiled_mlp.enabled:
        _validate_tiled_mlp(args, tiled_mlp, metp)
    _validate_attention(args, attention, sppo.sppo or metp)
    if tiled_mlp.tile_norms:
        _validate_tile_norms(args, tiled_mlp, attention)
    if args.reset_attention_mask:
        _validate_packed_documents(args, sppo)
    if not offload.offload:
        return
    _require(
        args.recompute_granularity is None,
        f"--memo-offload replaces Megatron recompute; drop --recompute-granularity "
        f"{args.recompute_granularity}",
    )
    layers_per_stage = args.num_layers // args.pipeline_model_parallel_size
    _require(
        layers_per_stage > 2,
        f"--memo-offload keeps the last 2 layers of each pipeline stage on device, so it needs "
        f"more than 2 layers per stage (this run has {layers_per_stage}); raise --num-layers or "
        "lower --pipeline-model-parallel-size",
    )


def _validate_sppo(args: argparse.Namespace, sppo: SPPOConfig, memo_offload: bool) -> None:
    _require(not memo_offload, "--memo-sppo has its own offloading (--memo-sppo-offload); drop "
             "--memo-offload")
    _require(args.context_parallel_size == 1, f"--memo-sppo splits the sequence itself; drop "
             f"--context-parallel-size {args.context_parallel_size}")
    _require(args.attention_dropout == 0, f"--memo-sppo needs --attention-dropout 0 (got "
             f"{args.attention_dropout})")
    _require(args.attn_mask_type == "causal", "--memo-sppo needs --attn-mask-type causal")
    _require(args.recompute_granularity is None, f"--memo-sppo replaces recomputation by "
             f"offloading; drop --recompute-granularity {args.recompute_granularity}")
    if sppo.sppo_msp:
        _require(args.pipeline_model_parallel_size > 1, "--memo-sppo-msp multiplexes idle "
                 "pipeline stages; set --pipeline-model-parallel-size > 1 or drop it")
        _require(args.tensor_model_parallel_size == 1 or args.sequence_parallel,
                 "--memo-sppo-msp with --tensor-model-parallel-size "
                 f"{args.tensor_model_parallel_size} needs --sequence-parallel")
        _require(args.hidden_dropout == 0, f"--memo-sppo-msp recomputes multiplexed layers in "
                 f"backward and needs --hidden-dropout 0 (got {args.hidden_dropout})")
    split = args.tensor_model_parallel_size if args.sequence_parallel else 1
    count = sppo.subsequences
    _require(count is None or args.seq_length // split >= count,
             f"--memo-sppo-subsequences {count} is more than --seq-length {args.seq_length} "
             f"allows (subsequences are whole multiples of {split} tokens)")


def _validate_tiled_mlp(args: argparse.Namespace, tiled_mlp: TiledMLPConfig, metp: bool) -> None:
    """--memo-mlp-tile-size's flag combinations (the tile is counted after SP's all-gather)."""
    _require(not metp, f"--memo-mlp-tile-size {tiled_mlp.mlp_tile_size} tiles Megatron's MLP, "
             "which --memo-metp replaces by its ring MLP; drop one")
    tiled_mlp.tile_rows(args.tensor_model_parallel_size, args.sequence_parallel)


def _validate_packed_documents(args: argparse.Namespace, sppo: SPPOConfig) -> None:
    """--reset-attention-mask: per-document offsets reach the attention of every pipeline stage
    (megatron.training.packed_documents), one sequence per micro-batch."""
    _require(args.micro_batch_size == 1, "--reset-attention-mask packs documents into one "
             f"sequence per micro-batch; give --micro-batch-size 1, got {args.micro_batch_size}")
    _require(not sppo.sppo_msp, "--reset-attention-mask is not supported by --memo-sppo-msp "
             "(its helper stages never see the documents); drop one")
    _require(args.transformer_impl == "local", "--reset-attention-mask needs memo_ext's core "
             f"attention (--transformer-impl local), got {args.transformer_impl}")


def _validate_tile_norms(args: argparse.Namespace, tiled_mlp: TiledMLPConfig,
                         attention: AttentionConfig) -> None:
    """--memo-tile-norms moves the local spec's norms into the tiles
    (memo_ext.tiled_mlp.with_tile_norms): it needs tiles to move them into, the local norms,
    and no recompute of the norms by megatron-core (they would be recomputed twice)."""
    _require(tiled_mlp.enabled or attention.attention_projection_tile_size > 0,
             "--memo-tile-norms runs the norms inside the MLP and projection tiles; give "
             "--memo-mlp-tile-size or --memo-attention-projection-tile-size, or drop it")
    _require(args.transformer_impl == "local", "--memo-tile-norms needs the local spec's norms "
             f"(--transformer-impl local), got {args.transformer_impl}")
    _require(not (args.recompute_granularity == "selective"
                  and "layernorm" in (args.recompute_modules or ())),
             "--memo-tile-norms already recomputes the norms in the tiles; drop layernorm from "
             "--recompute-modules")


def _validate_attention(args: argparse.Namespace, attention: AttentionConfig,
                        attention_replaced: bool) -> None:
    """--memo-attention-*: they change memo_ext's core attention and megatron's projections of
    the local spec, which --memo-sppo and --memo-metp replace and Transformer Engine lacks."""
    flags = []
    if attention.attention_head_chunks > 1:
        flags.append(f"--memo-attention-head-chunks {attention.attention_head_chunks}")
    if attention.attention_projection_tile_size:
        flags.append(f"--memo-attention-projection-tile-size "
                     f"{attention.attention_projection_tile_size}")
    if not flags:
        return
    named = " and ".join(flags)
    _require(not attention_replaced, f"{named} change the local spec's attention, which "
             "--memo-sppo and --memo-metp replace by their own; drop one")
    _require(args.transformer_impl == "local", f"{named} need --transformer-impl local, got "
             f"{args.transformer_impl}")
    groups = args.num_query_groups or args.num_attention_heads
    attention.validate_with(args.num_attention_heads // args.tensor_model_parallel_size,
                            groups // args.tensor_model_parallel_size)
    if attention.attention_projection_tile_size:
        TiledMLPConfig(mlp_tile_size=attention.attention_projection_tile_size).tile_rows(
            args.tensor_model_parallel_size, args.sequence_parallel,
            flag="--memo-attention-projection-tile-size")


def _validate_metp(args: argparse.Namespace, sppo: bool, memo_offload: bool) -> None:
    """METP's flag combinations; implies --sequence-parallel (METP keeps its layout)."""
    tp = args.tensor_model_parallel_size
    _require(tp > 1, "--memo-metp is a form of tensor parallelism; set "
             "--tensor-model-parallel-size > 1")
    _require(not sppo, "--memo-metp and --memo-sppo cannot be combined; drop one")
    _require(not memo_offload, "--memo-metp and --memo-offload cannot be combined; drop one")
    _require(args.context_parallel_size == 1, f"--memo-metp shards the sequence over TP itself; "
             f"drop --context-parallel-size {args.context_parallel_size}")
    _require(args.attention_dropout == 0, f"--memo-metp needs --attention-dropout 0 (got "
             f"{args.attention_dropout})")
    _require(args.attn_mask_type == "causal", "--memo-metp needs --attn-mask-type causal")
    _require(args.recompute_granularity is None, f"--memo-metp recomputes inside its layers; "
             f"drop --recompute-granularity {args.recompute_granularity}")
    _require(args.seq_length % (2 * tp) == 0, f"--memo-metp cuts the sequence into 2 x TP = "
             f"{2 * tp} equal chunks; make --seq-length {args.seq_length} a multiple of {2 * tp}")
    query_groups = args.num_query_groups or args.num_attention_heads
    _require(query_groups % tp == 0, f"--memo-metp needs --num-query-groups {query_groups} "
             f"divisible by --tensor-model-parallel-size {tp}")
    args.sequence_parallel = True


def validate_args(args: argparse.Namespace, world_size: int, cuda_available: bool) -> None:
    """Check cross-flag constraints and fill derived values (in place).

    Raises ArgumentValidationError naming the flag at fault and the fix: the one place where
    the rule modules' errors (memo_ext.config's MemoConfigError, rope_scaling's
    RopeScalingError, upstream_flags' UpstreamFlagRefused) become it.
    """
    try:
        _validate_all(args, world_size, cuda_available)
    except (MemoConfigError, RopeScalingError, UpstreamFlagRefused) as error:
        raise ArgumentValidationError(str(error)) from None


def _validate_all(args: argparse.Namespace, world_size: int, cuda_available: bool) -> None:
    validate_upstream_flags(args)  # a Megatron-LM flag refused here: its one line, first
    _validate_required(args)
    _validate_parallel_layout(args, world_size)
    _validate_model_shape(args)
    _validate_batch(args)
    _validate_schedule(args)
    _validate_recompute(args)
    _validate_precision(args, cuda_available)
    _validate_attention_backend(args, cuda_available)
    _validate_cross_entropy(args, cuda_available)
    _validate_optimization(args)
    _validate_optimizer_cpu_offload(args, cuda_available)
    _validate_checkpointing(args)
    _validate_data(args)
    _validate_logging(args)
    _validate_memo(args, cuda_available)
    _validate_gradients(args)
    _validate_run_controls(args, cuda_available)
    validate_megatron_fsdp(args)
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda_available else "gloo"
    _require(
        cuda_available or args.distributed_backend == "gloo",
        "--distributed-backend nccl needs CUDA; use gloo on CPU",
    )


def core_transformer_config_from_args(args: argparse.Namespace):
    """The megatron.core TransformerConfig for validated ``args``."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = torch.cuda.is_available()
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        normalization=args.normalization,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=args.recompute_modules,
        deterministic_mode=args.deterministic_mode,
        # CPU initialisation draws the full weight and slices it, so every TP size starts from
        # the same model; required without CUDA.
        use_cpu_initialization=not cuda,
        # The torch.compile-based fusions cost 5-35 s to compile on CPU and gain nothing there.
        bias_activation_fusion=cuda and not args.swiglu,
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=cuda,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        calculate_per_token_loss=args.calculate_per_token_loss,
        # "chunked" is not megatron-core's: megatron.training.gpt.model_provider builds
        # memo_ext.loss's GPTModel for it (the dataclass does not check its Literal).
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        batch_p2p_comm=True,
        # 0.16.1's default "full" only triggers a deprecation warning; [] means the same.
        cuda_graph_scope=[],
    )
    if args.transformer_impl == "transformer_engine":
        # megatron.core's TE attention reads it (NVTE_* switches); memo_ext's core attention
        # takes it from initialize_megatron instead (memo_ext.attention.kernels).
        from megatron.core.transformer.enums import AttnBackend

        config.attention_backend = AttnBackend[args.attention_backend]
    # Not dataclass fields of a plain TransformerConfig: GPTModel and SelfAttention getattr them.
    for name, value in yarn_config_attributes(args).items():
        setattr(config, name, value)
    return config
