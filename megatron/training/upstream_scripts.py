"""Megatron-LM's own dense-GPT launch scripts, the reference of docs/megatron_flags.md.

Each variant is the flag line its script hands pretrain_gpt.py (after the launcher's own
arguments), as bash expands it at :data:`UPSTREAM_COMMIT`: run with ``torchrun``/``python``
stubbed to print their argv, placeholders (``$CHECKPOINT_PATH``, ...) passed for the paths the
script takes as arguments, every other value as the script sets it. Word splitting included:
the GPT-3 script's ``--step-batch-size-schedule`` value reaches the trainer as six words, and
the Llama scripts' ``--split '99,1,0'`` with its quotes. The lines are put together from the
scripts' own bash arrays (MODEL_ARGS, TRAINING_ARGS, ...), in the order the scripts append them;
the two Llama-3 scripts share some arrays word for word.

megatron.training.upstream_flags gives every flag here a status; tests/unit/megatron/training/
test_upstream_scripts.py runs each default variant shrunk to a tiny model on CPU. Data only:
nothing here is read at training time.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

UPSTREAM_REPOSITORY = "https://github.com/NVIDIA/Megatron-LM"
UPSTREAM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
UPSTREAM_COMMIT_DATE = "2026-08-22"


@dataclass(frozen=True)
class Variant:
    """One way a script runs: ``name`` and the flag line (shell words) it launches."""

    name: str
    flag_line: str

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.flag_line)

    @property
    def flags(self) -> list[str]:
        """The flags of the line, in order, once each."""
        return list(dict.fromkeys(word for word in self.argv if word.startswith("--")))


@dataclass(frozen=True)
class ReferenceScript:
    """An upstream launch script: its path in the repository, the model it trains, the
    ``torchrun --nproc_per_node`` it launches with, and its variants (the first is what the
    script runs with no environment set)."""

    path: str
    model: str
    nproc_per_node: int
    variants: tuple[Variant, ...]

    @property
    def default(self) -> Variant:
        return self.variants[0]


def _line(*arrays: str) -> str:
    return "\n".join(arrays)


# examples/gpt3/train_gpt3_175b_distributed.sh: GPT_MODEL_ARGS TRAINING_ARGS MODEL_PARALLEL_ARGS
# DATA_ARGS EVAL_AND_LOGGING_ARGS.
GPT3 = """
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
    --max-position-embeddings 2048 --attention-backend auto
    --micro-batch-size 1 --global-batch-size 1536
    --step-batch-size-schedule 0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536
    --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine
    --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    --data-path '$DATA_PATH' --vocab-file '$VOCAB_FILE' --merge-file '$MERGE_FILE'
    --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --save '$CHECKPOINT_PATH'
    --load '$CHECKPOINT_PATH' --eval-iters 10 --tensorboard-dir '$TENSORBOARD_LOGS_PATH'
"""

# The Llama-3 8B scripts (examples/llama/train_llama3_8b_h100_fp8.sh and the Megatron-FSDP
# one): the arrays both have word for word.
LLAMA3_MODEL_ARGS = """
    --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
    --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
    --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
    --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
"""
LLAMA3_TRAINING_ARGS = """
    --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
    --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
    --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
"""
LLAMA3_DDP_ARGS = """
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
"""
LLAMA3_DTYPE_ARGS = """
    --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
    --fp8-param-gather
"""
LLAMA3_MODEL_PARALLEL_ARGS = """
    --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
"""
LLAMA3_MOCK_DATA = """
    --mock-data --tokenizer-type NullTokenizer --vocab-size 128256
    --data-cache-path '$PWD/{cache}' --tiktoken-pattern v2 --split "'99,1,0'"
    --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
"""
LLAMA3_REAL_DATA = """
    --data-path '$DATA_ARG' --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model '$TOKENIZER_ARG' --data-cache-path '$PWD/{cache}' --split "'99,1,0'"
    --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
    --vocab-size 128256
"""
LLAMA3_SAVE = """
    --save '$CHECKPOINT_PATH' --load '$CHECKPOINT_PATH'
    --tensorboard-dir '$TENSORBOARD_LOGS_PATH'
"""

# examples/llama/train_llama3_8b_h100_fp8.sh: MODEL_ARGS TRAINING_ARGS(+DDP_ARGS) DTYPE_ARGS
# MODEL_PARALLEL_ARGS DATA_ARGS_LIST EVAL_AND_LOGGING_ARGS.
LLAMA_TRAINING = LLAMA3_TRAINING_ARGS + """
    --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
    --empty-unused-memory-level 1 --exit-duration-in-mins 235
""" + LLAMA3_DDP_ARGS
LLAMA_EVAL_AND_LOGGING = """
    --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000
    --log-throughput --profile --profile-step-start 4 --profile-step-end 6
    --ckpt-format torch_dist --distributed-timeout-minutes 60
""" + LLAMA3_SAVE
LLAMA_CACHE = "benchmark_cache_llama3_8b_fp8"


def _llama(data: str) -> str:
    return _line(LLAMA3_MODEL_ARGS, LLAMA_TRAINING, LLAMA3_DTYPE_ARGS,
                 LLAMA3_MODEL_PARALLEL_ARGS, data.format(cache=LLAMA_CACHE),
                 LLAMA_EVAL_AND_LOGGING)


# examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh: MODEL_ARGS, TRAINING_ARGS (+ the
# Megatron-FSDP block with USE_MEGATRON_FSDP=1, + DDP_ARGS, + the profiling block with
# NSYS_PROFILE=1), DTYPE_ARGS, MODEL_PARALLEL_ARGS, DATA_ARGS_LIST, EVAL_AND_LOGGING_ARGS.
FSDP_TRAINING = LLAMA3_TRAINING_ARGS + """
    --cross-entropy-loss-fusion --no-check-for-nan-in-loss-and-grad --manual-gc
    --empty-unused-memory-level 1 --exit-duration-in-mins 235
"""
FSDP_BLOCK = """
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
    --no-gradient-accumulation-fusion --calculate-per-token-loss --init-model-with-meta-device
    --ckpt-format fsdp_dtensor --use-nccl-ub --fsdp-double-buffer --fsdp-manual-registration
"""
FSDP_PROFILE = """
    --profile --profile-step-start 8 --profile-step-end 12 --profile-ranks 0
    --record-memory-history
"""
FSDP_EVAL_AND_LOGGING = """
    --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000
    --log-throughput --logging-level 20 --distributed-timeout-minutes 60
""" + LLAMA3_SAVE
FSDP_CACHE = "benchmark_cache_llama3_8b_fsdp_fp8"


def _fsdp(data: str, fsdp: bool = True, nsys: bool = False) -> str:
    training = FSDP_TRAINING + (FSDP_BLOCK if fsdp else "") + LLAMA3_DDP_ARGS
    return _line(LLAMA3_MODEL_ARGS, training + (FSDP_PROFILE if nsys else ""),
                 LLAMA3_DTYPE_ARGS, LLAMA3_MODEL_PARALLEL_ARGS, data.format(cache=FSDP_CACHE),
                 FSDP_EVAL_AND_LOGGING)


REFERENCE_SCRIPTS: tuple[ReferenceScript, ...] = (
    ReferenceScript("examples/gpt3/train_gpt3_175b_distributed.sh", "GPT-3 175B", 8, (
        Variant("as written (CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE "
                "DATA_PATH)", GPT3),
    )),
    ReferenceScript("examples/llama/train_llama3_8b_h100_fp8.sh", "Llama-3 8B, FP8", 8, (
        Variant("mock data (the default: TOKENIZER_ARG and DATA_ARG are MOCK)",
                _llama(LLAMA3_MOCK_DATA)),
        Variant("real data (TOKENIZER_ARG and DATA_ARG given)", _llama(LLAMA3_REAL_DATA)),
    )),
    ReferenceScript("examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
                    "Llama-3 8B, FP8, Megatron-FSDP", 8, (
        Variant("mock data (the default: USE_MEGATRON_FSDP=1, NSYS_PROFILE=0)",
                _fsdp(LLAMA3_MOCK_DATA)),
        Variant("real data (DATA_ARG and TOKENIZER_ARG given)", _fsdp(LLAMA3_REAL_DATA)),
        Variant("NSYS_PROFILE=1 (under nsys profile)", _fsdp(LLAMA3_MOCK_DATA, nsys=True)),
        Variant("USE_MEGATRON_FSDP=0", _fsdp(LLAMA3_MOCK_DATA, fsdp=False)),
    )),
)


def reference_flags() -> list[str]:
    """Every flag of every variant, in first-seen order."""
    return list(dict.fromkeys(flag for script in REFERENCE_SCRIPTS
                              for variant in script.variants for flag in variant.flags))
