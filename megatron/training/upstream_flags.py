"""Megatron-LM's launch-script flags and what each does here: the registry behind
docs/megatron_flags.md (``python -m megatron.training.upstream_flags_doc`` writes it).

Every flag of the reference scripts (megatron.training.upstream_scripts) has one entry, plus
the further Megatron-LM flags issue 45 names. A flag is

* ``honoured``: it does what it does in Megatron-LM. Most are defined by the trainer's own
  argument groups (megatron.training.arguments and the feature modules it calls);
* ``honoured (always so here)``: accepted because this trainer always behaves the way the flag
  asks (``--use-mcore-models``: megatron-core models are the only ones). Defined here;
* ``refused``: defined here so that it is never "unrecognized", and refused before anything
  starts with one line, ``<flag>: <reason>`` (:func:`refusal`).

An honoured flag may still refuse some values or some machines in one line naming it
(``--ckpt-format torch``, ``--bf16`` on CPU); its entry says which (``refuses``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

HONOURED = "honoured"
ALWAYS = "honoured (always so here)"
REFUSED = "refused"

#: The destination refused flags append themselves to, in command-line order.
REFUSED_DEST = "refused_upstream_flags"


class UpstreamFlagRefused(ValueError):
    """A Megatron-LM flag this trainer refuses; the message is the registry's one line."""


@dataclass(frozen=True)
class UpstreamFlag:
    """One Megatron-LM flag: its status, what it maps to here (for a refused flag, why), and
    what of it is refused in one line although the flag is honoured (values, machines).

    ``argparse`` is the definition of a flag this module adds to the parser (refused and
    always-so flags); None for a flag the trainer's own argument groups define."""

    flag: str
    status: str
    here: str
    refuses: str = ""
    requires: str = ""  # the flag it only applies with (refused without it)
    refused_values: tuple[str, ...] = ()  # values refused in one line
    cuda_only: bool = False  # refused in one line on a machine without CUDA
    argparse: Optional[dict] = field(default=None, compare=False)


def _refused(flag: str, reason: str, nargs=0) -> UpstreamFlag:
    return UpstreamFlag(flag, REFUSED, reason, argparse={"nargs": nargs})


def _always(flag: str, here: str, **argparse_kwargs) -> UpstreamFlag:
    return UpstreamFlag(flag, ALWAYS, here, argparse=argparse_kwargs or {"action": "store_true"})


def _honoured(flag: str, here: str, refuses: str = "", requires: str = "",
              refused_values: tuple[str, ...] = (), cuda_only: bool = False) -> UpstreamFlag:
    return UpstreamFlag(flag, HONOURED, here, refuses, requires, refused_values, cuda_only)


_CPU_16BIT = "on CPU (megatron-core's mixed-precision optimizer wraps CUDA tensors only)"
_FP8 = ("FP8 training is not supported yet: it needs Transformer Engine's FP8 layers and "
        "recipes, which this trainer does not wire (its layers train in bf16/fp16/fp32); drop "
        "the --fp8-* flags and train in --bf16")
_NCCL_UB = ("NCCL user-buffer registration is not supported yet: megatron-core 0.16.1 allocates "
            "Megatron-FSDP's buffers from an NCCL memory pool (ncclMemAlloc, megatron_fsdp/"
            "param_and_grad_buffer.py:1588-1600), which needs NCCL and CUDA; drop the flag")

#: Every flag of the reference scripts, in the order they first appear there.
SCRIPT_FLAGS: tuple[UpstreamFlag, ...] = (
    # examples/gpt3/train_gpt3_175b_distributed.sh
    _honoured("--num-layers", "TransformerConfig.num_layers"),
    _honoured("--hidden-size", "TransformerConfig.hidden_size"),
    _honoured("--num-attention-heads", "TransformerConfig.num_attention_heads"),
    _honoured("--seq-length", "the length of every training sample"),
    _honoured("--max-position-embeddings",
              "GPTModel's max_sequence_length: the learned position table (default "
              "--seq-length)"),
    _honoured("--attention-backend",
              "auto/flash/fused/unfused: the CUDA kernel of memo_ext's core attention "
              "(docs/attention.md; on CPU its one CPU kernel); with --transformer-impl "
              "transformer_engine megatron-core's AttnBackend",
              "local (megatron-core's own DotProductAttention, which memo_ext's core attention "
              "replaces)", refused_values=("local",)),
    _honoured("--micro-batch-size", "samples per micro-batch and data-parallel rank"),
    _honoured("--global-batch-size",
              "samples per optimizer step (micro-batches = global / (micro x data-parallel))"),
    _refused("--step-batch-size-schedule",
             "batch-size schedules are not supported yet (the global batch size is constant "
             "through the run); drop the flag and set --global-batch-size", nargs="*"),
    _honoured("--train-iters", "optimizer steps of the run"),
    _honoured("--weight-decay", "OptimizerConfig.weight_decay (biases and norms excluded)"),
    _honoured("--adam-beta1", "OptimizerConfig.adam_beta1"),
    _honoured("--adam-beta2", "OptimizerConfig.adam_beta2"),
    _honoured("--init-method-std", "TransformerConfig.init_method_std"),
    _honoured("--clip-grad", "OptimizerConfig.clip_grad (global gradient norm)"),
    _honoured("--fp16", "fp16 parameters (Float16Module) and megatron-core's fp16 optimizer with "
              "dynamic loss scaling", _CPU_16BIT, cuda_only=True),
    _honoured("--lr", "OptimizerParamScheduler's max_lr"),
    _honoured("--lr-decay-style", "OptimizerParamScheduler's lr_decay_style"),
    _honoured("--min-lr", "OptimizerParamScheduler's min_lr"),
    _honoured("--lr-warmup-fraction", "warmup = this fraction of the decay steps"),
    _honoured("--lr-decay-iters", "OptimizerParamScheduler's lr_decay_steps, in iterations"),
    _honoured("--tensor-model-parallel-size", "megatron-core tensor parallelism"),
    _honoured("--pipeline-model-parallel-size", "megatron-core pipeline parallelism (1F1B)"),
    _honoured("--data-path", "megatron-core GPTDataset over indexed .bin/.idx files (weighted "
              "blends too)"),
    _honoured("--vocab-file", "GPT2BPETokenizer's vocab.json (a byte-level BPE read with the "
              "tokenizers library); with --merge-file and no --tokenizer-type, "
              "GPT2BPETokenizer is implied (Megatron-LM at the reference commit stops there, "
              "naming no tokenizer type)"),
    _honoured("--merge-file", "GPT2BPETokenizer's merges.txt (with --vocab-file)"),
    _honoured("--split", "train/validation/test weights; quotes around the value are ignored, "
              "as Megatron-LM's parser ignores them"),
    _honoured("--log-interval", "iterations between log lines"),
    _honoured("--save-interval", "iterations between checkpoints"),
    _honoured("--eval-interval", "iterations between validations"),
    _honoured("--save", "checkpoint directory (megatron-core dist_checkpointing, torch_dist "
              "format, written atomically)"),
    _honoured("--load", "checkpoint directory to resume from"),
    _honoured("--eval-iters", "validation batches per evaluation"),
    _honoured("--tensorboard-dir", "TensorBoard scalars: loss, lr, grad norm, throughput, "
              "memory"),
    # examples/llama/train_llama3_8b_h100_fp8.sh
    _always("--use-mcore-models", "megatron-core models are the only ones (Megatron-LM "
            "ignores the flag too: deprecated)"),
    _honoured("--ffn-hidden-size", "TransformerConfig.ffn_hidden_size"),
    _honoured("--group-query-attention", "grouped-query attention (with --num-query-groups)"),
    _honoured("--num-query-groups", "TransformerConfig.num_query_groups"),
    _honoured("--kv-channels", "TransformerConfig.kv_channels (the head dimension)"),
    _honoured("--position-embedding-type",
              "learned_absolute, rope, yarn or none (GPTModel); relative and mrope are not "
              "choices"),
    _honoured("--rotary-base", "RoPE base (GPTModel rotary_base)"),
    _honoured("--rotary-percent", "fraction of the head dimension RoPE rotates"),
    _honoured("--attention-dropout", "TransformerConfig.attention_dropout"),
    _honoured("--hidden-dropout", "TransformerConfig.hidden_dropout"),
    _honoured("--swiglu", "gated SiLU MLP (TransformerConfig.gated_linear_unit)"),
    _honoured("--normalization", "LayerNorm or RMSNorm (torch's norms in the local layers)"),
    _honoured("--apply-layernorm-1p",
              "zero-centred gamma (TransformerConfig.layernorm_zero_centered_gamma): every norm "
              "scales by 1 + weight, the weight starting at 0 (megatron.training.norms in the "
              "local layers)"),
    _honoured("--untie-embeddings-and-output-weights", "separate output layer weights"),
    _honoured("--disable-bias-linear", "no biases in the linear layers"),
    _honoured("--train-samples", "sample-based training: --train-iters = train-samples // "
              "global-batch-size, as Megatron-LM; the LR schedule counts samples",
              "with --train-iters, --lr-decay-iters or --lr-warmup-iters (as Megatron-LM)"),
    _honoured("--lr-decay-samples", "OptimizerParamScheduler's lr_decay_steps, in samples "
              "(default --train-samples)", "without --train-samples",
              requires="--train-samples"),
    _honoured("--lr-warmup-samples", "OptimizerParamScheduler's lr_warmup_steps, in samples",
              "without --train-samples", requires="--train-samples"),
    _honoured("--decoupled-lr", "OptimizerConfig.decoupled_lr: the input embedding and output "
              "layer train at this max LR"),
    _honoured("--decoupled-min-lr", "OptimizerConfig.decoupled_min_lr: their min LR",
              "without --decoupled-lr", requires="--decoupled-lr"),
    _honoured("--bf16", "bf16 parameters (Float16Module), fp32 main parameters in the "
              "optimizer; gradients accumulated and reduced in fp32 unless "
              "--grad-reduce-in-bf16, as Megatron-LM", _CPU_16BIT, cuda_only=True),
    _honoured("--grad-reduce-in-bf16", "with --bf16: gradients accumulated and reduced in bf16 "
              "(DistributedDataParallelConfig.grad_reduce_in_fp32 False)",
              "without --bf16, or with --accumulate-allreduce-grads-in-fp32", requires="--bf16"),
    _honoured("--cross-entropy-loss-fusion", "TransformerConfig.cross_entropy_loss_fusion "
              "(implementation: --cross-entropy-fusion-impl, native by default)"),
    _honoured("--calculate-per-token-loss",
              "TransformerConfig.calculate_per_token_loss: each micro-batch's loss is its token "
              "sum, and megatron-core divides the gradients by the global batch's token count "
              "(summed over data- and context-parallel ranks)",
              "with --memo-sppo (its schedule divides per sequence)"),
    _honoured("--manual-gc", "Python's automatic garbage collector off; a full collection "
              "before training and around each evaluation (megatron.training.run_controls)"),
    _honoured("--empty-unused-memory-level",
              "1: torch.cuda.empty_cache() after each forward-backward and evaluation batch; 2: "
              "also after the optimizer step (on CPU there is no cache to release)"),
    _honoured("--exit-duration-in-mins",
              "after the iteration during which the run passes this many minutes (all ranks "
              "agree), save (with --save) and exit 0"),
    _honoured("--use-distributed-optimizer", "megatron-core's DistributedOptimizer: optimizer "
              "state sharded over data-parallel ranks"),
    _honoured("--overlap-grad-reduce", "DistributedDataParallelConfig.overlap_grad_reduce"),
    _honoured("--overlap-param-gather",
              "DistributedDataParallelConfig.overlap_param_gather: the distributed optimizer's "
              "parameter all-gather runs behind the next forward (forward pre-hooks); "
              "parameters are gathered before each evaluation and checkpoint",
              "without --use-distributed-optimizer and --overlap-grad-reduce"),
    _refused("--fp8-format", _FP8, nargs="*"),
    _refused("--fp8-amax-history-len", _FP8, nargs="*"),
    _refused("--fp8-amax-compute-algo", _FP8, nargs="*"),
    _refused("--fp8-param-gather", _FP8),
    _honoured("--context-parallel-size", "context parallelism: memo_ext's ring attention over "
              "load-balanced 2xCP chunks"),
    _honoured("--sequence-parallel", "megatron-core sequence parallelism (a no-op without TP, "
              "as Megatron-LM)"),
    _honoured("--mock-data", "megatron-core MockGPTDataset"),
    _honoured("--tokenizer-type",
              "NullTokenizer, HuggingFaceTokenizer (read with the tokenizers library), "
              "GPT2BPETokenizer, and this trainer's BytesTokenizer and BPETokenizer",
              "the others (SentencePiece, TikToken, multimodal ...)"),
    _honoured("--vocab-size", "NullTokenizer's ids; with HuggingFaceTokenizer the model's "
              "vocabulary when larger than the tokenizer's"),
    _honoured("--data-cache-path", "GPTDatasetConfig.path_to_cache (the sample index cache)"),
    _always("--tiktoken-pattern", "no effect, as in Megatron-LM with any tokenizer but "
            "TikTokenizer (which this trainer does not have: --tokenizer-type refuses it)",
            choices=("v1", "v2"), default=None),
    _always("--no-create-attention-mask-in-dataloader",
            "the data loader never builds attention masks (causal attention needs none)",
            action="store_false", dest="create_attention_mask_in_dataloader"),
    _honoured("--no-mmap-bin-files", "GPTDatasetConfig.mmap_bin_files False: .bin files read "
              "with file reads instead of memory maps (--mock-data reads none, as upstream)"),
    _honoured("--num-workers", "DataLoader worker processes"),
    _always("--log-throughput", "every log line reports TFLOP/s per device, tokens/s and MFU "
            "(and writes them to TensorBoard, JSON lines and W&B)"),
    _honoured("--profile",
              "on CUDA, iterations [--profile-step-start, --profile-step-end) inside "
              "cudaProfilerStart/Stop on the --profile-ranks, for nsys --capture-range="
              "cudaProfilerApi (Megatron-LM's default profiler)",
              "on CPU (there is no CUDA profiler range to open)", cuda_only=True),
    _honoured("--profile-step-start", "first profiled iteration (default 10)",
              "without --profile", requires="--profile"),
    _honoured("--profile-step-end", "iteration at which profiling stops (default 12)",
              "without --profile", requires="--profile"),
    _honoured("--ckpt-format",
              "torch_dist: megatron-core dist_checkpointing, what --save writes; "
              "fsdp_dtensor: Megatron-FSDP's DTensors through torch.distributed.checkpoint "
              "(with --use-megatron-fsdp, which needs it; it loads a torch_dist checkpoint's "
              "weights too, with --no-load-optim or --finetune)",
              "torch and torch_dcp; fsdp_dtensor without --use-megatron-fsdp and torch_dist "
              "with it", refused_values=("torch", "torch_dcp")),
    _honoured("--distributed-timeout-minutes", "torch.distributed process-group timeout"),
    _honoured("--tokenizer-model", "HuggingFaceTokenizer's folder (or tokenizer.json); "
              "BPETokenizer's JSON file"),
    # examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh
    _always("--no-check-for-nan-in-loss-and-grad",
            "this trainer does not run Megatron-LM's NaN check of the loss and gradients (on by "
            "default there), so the flag's 'no check' always holds",
            action="store_false", dest="check_for_nan_in_loss_and_grad"),
    _honoured("--use-megatron-fsdp",
              "megatron-core's Megatron-FSDP (FullyShardedDataParallel) instead of its DDP, "
              "stepped by the distributed optimizer; on CPU through gloo (docs/training.md)",
              "without --use-distributed-optimizer, --ckpt-format fsdp_dtensor or a "
              "--data-parallel-sharding-strategy other than no_shard (Megatron-LM's default); "
              "with --pipeline-model-parallel-size > 1 (megatron-core 0.16.1's mesh has no "
              "pipeline dimension) or at data-parallel x context-parallel size 1 (wrong "
              "gradients); with --optimizer-cpu-offload its hybrid optimizer steps "
              "the DTensors' local shards (megatron/training/fsdp_optimizer_offload.py)"),
    _honoured("--data-parallel-sharding-strategy",
              "with --use-megatron-fsdp: optim (optimizer states), optim_grads (and "
              "gradients) or optim_grads_params (and parameters) sharded over the "
              "data-parallel ranks",
              "no_shard (megatron-core 0.16.1's Megatron-FSDP builds no parameter buffer for "
              "it but all-gathers one at each step); without --use-megatron-fsdp",
              requires="--use-megatron-fsdp", refused_values=("no_shard",)),
    _always("--no-gradient-accumulation-fusion",
            "gradient accumulation is never fused here (TransformerConfig."
            "gradient_accumulation_fusion is False: no APEX/TE fused wgrad kernels)",
            action="store_false", dest="gradient_accumulation_fusion"),
    _refused("--init-model-with-meta-device",
             "meta-device initialisation is not supported yet (this trainer initialises the "
             "model on its device before wrapping it; Megatron-FSDP's meta-device path is not "
             "wired or tested here); drop the flag"),
    _refused("--use-nccl-ub", _NCCL_UB),
    _honoured("--fsdp-double-buffer",
              "with --use-megatron-fsdp: the all-gather and reduce-scatter buckets come from "
              "two persistent buffers instead of one allocation per communication",
              "without --use-megatron-fsdp", requires="--use-megatron-fsdp"),
    _refused("--fsdp-manual-registration", _NCCL_UB),
    _honoured("--logging-level", "the root Python logger's level (20 is INFO; default "
              "$MEGATRON_LOGGING_LEVEL), with a stderr handler when none is configured"),
    _honoured("--profile-ranks", "global ranks that profile (default all)", "without --profile",
              requires="--profile"),
    _refused("--record-memory-history",
             "PyTorch memory-history snapshots are not supported yet; drop the flag "
             "(--memo-telemetry reports the allocator's peaks and an out-of-memory report, "
             "docs/telemetry.md)"),
)

#: Further Megatron-LM flags issue 45 names (not in the reference scripts at their commit).
EXTRA_FLAGS: tuple[UpstreamFlag, ...] = (
    _honoured("--suggested-communication-unit-size",
              "with --use-megatron-fsdp: the elements reduce-scattered at once and, halved, "
              "all-gathered ahead (megatron-core's default: at least 1e9); the estimator "
              "traces its buckets", "without --use-megatron-fsdp",
              requires="--use-megatron-fsdp"),
    _always("--use-flash-attn", "no effect, as in Megatron-LM, where nothing reads it at the "
            "reference commit; the kernel is --attention-backend's (flash: FlashAttention-2)"),
    _honoured("--use-rotary-position-embeddings",
              "--position-embedding-type rope (Megatron-LM's legacy spelling)"),
    _honoured("--timing-log-level",
              "megatron-core Timers: 0 iteration time only; 1 adds forward-backward and the "
              "optimizer's phases; 2 adds forward/backward compute and pipeline send/receive; "
              "printed each log interval"),
    _honoured("--timing-log-option", "max, minmax (default) or all: how timers are reduced "
              "over ranks", "with --timing-log-level 0", requires="--timing-log-level"),
    _honoured("--log-timers-to-tensorboard",
              "iteration time and the timers of --timing-log-level to TensorBoard (and W&B)",
              "without --tensorboard-dir or --wandb-project"),
    _honoured("--manual-gc-interval",
              "with --manual-gc: a full collection every this many iterations (0: none)",
              "without --manual-gc", requires="--manual-gc"),
    _honoured("--no-manual-gc-eval", "with --manual-gc: no collections around evaluations",
              "without --manual-gc", requires="--manual-gc"),
    _honoured("--wandb-project",
              "Weights & Biases logging from the last rank (the optional 'wandb' extra): "
              "loss, lr, grad norm, throughput, memory, validation loss",
              "without the wandb package, or without --wandb-save-dir or --save"),
    _honoured("--wandb-exp-name", "the W&B run's name", "without --wandb-project",
              requires="--wandb-project"),
    _honoured("--wandb-save-dir", "W&B's local directory (default: --save/wandb)",
              "without --wandb-project", requires="--wandb-project"),
    _honoured("--wandb-entity", "the W&B entity", "without --wandb-project",
              requires="--wandb-project"),
)

UPSTREAM_FLAGS: tuple[UpstreamFlag, ...] = SCRIPT_FLAGS + EXTRA_FLAGS


def registry() -> dict[str, UpstreamFlag]:
    """flag -> entry (the first entry of a flag listed twice)."""
    entries: dict[str, UpstreamFlag] = {}
    for entry in UPSTREAM_FLAGS:
        entries.setdefault(entry.flag, entry)
    return entries


def refusal(flag: str) -> str:
    """The one line a refused flag stops the run with."""
    return f"{flag}: {registry()[flag].here}"


class _RecordRefused(argparse.Action):
    """Appends the flag to ``args.refused_upstream_flags`` (command-line order)."""

    def __call__(self, parser, namespace, values, option_string=None):
        recorded = list(getattr(namespace, REFUSED_DEST, None) or [])
        setattr(namespace, REFUSED_DEST, recorded + [self.option_strings[0]])


def add_upstream_args(parser: argparse.ArgumentParser) -> None:
    """The flags the registry defines (refused and always-so flags), as one argument group."""
    group = parser.add_argument_group(
        title="Megatron-LM flags accepted or refused here (docs/megatron_flags.md)")
    for entry in registry().values():
        if entry.argparse is None:
            continue
        if entry.status == REFUSED:
            group.add_argument(entry.flag, action=_RecordRefused, dest=REFUSED_DEST,
                               default=[], nargs=entry.argparse["nargs"] or 0,
                               help=f"Refused: {entry.here}.")
        else:
            group.add_argument(entry.flag, help=f"{entry.here}.", **entry.argparse)


def validate_upstream_flags(args: argparse.Namespace) -> None:
    """Refuse the first refused flag of the command line with its one line."""
    refused = getattr(args, REFUSED_DEST, None)
    if refused:
        raise UpstreamFlagRefused(refusal(refused[0]))
