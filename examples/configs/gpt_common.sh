# shellcheck shell=bash
# Shared by examples/configs/gpt_{7b,13b,30b,65b}.sh: the GPT architecture, parallel layout
# and training recipe of MEMO's Table 2 models, parameterised by the model shape. Sourcing it
# only defines memo_gpt_config; a model config calls it.
#
# Architecture (the same for every size):
#   * Plain GPT blocks as in MEMO: pre-LayerNorm, GeLU MLP (no SwiGLU), biases kept (append
#     --disable-bias-linear to MODEL_ARGS for bias-free linears).
#   * Rotary position embeddings rather than a learned table: positions are not capped by a
#     table size, which long-context training needs.
#   * Untied input embedding and output layer.
#   * Vocabulary: GPT-2's 50257 BPE ids. The tokenizers of this fork are offline, so the SLURM
#     scripts pass --tokenizer-type BPETokenizer --tokenizer-model "$TOKENIZER_MODEL" (a local
#     GPT-2 tokenizer.json, or any BPE JSON containing <|endoftext|>); with TP=8 the embedding
#     is padded to 51200 rows.
#
# Parallel layout for long context on 8-GPU A100/A800 (80 GB) nodes: TP=8 with sequence
# parallelism inside a node (NVLink), context parallelism (CP) across nodes (InfiniBand), and
# pipeline parallelism where the weights and optimizer state of one TP group do not fit. Full
# recomputation keeps only each layer's input. GPUs = TP x PP x CP x DP; extra nodes become data
# parallelism, where --use-distributed-optimizer shards the optimizer state.
#
# Environment overrides: SEQ_LENGTH (default 131072), TP_SIZE (8), PP_SIZE and CP_SIZE (the
# model's defaults). --seq-length must be divisible by 2 x CP x TP.
#
# Training recipe (MEMO's setup): micro batch 1, global batch 16 sequences; AdamW with cosine
# decay from 3e-4 to 3e-5 after a 1% warmup, gradient clipping 1.0, weight decay 0.1, bf16.
# No dropout: its masks cost activation memory at long sequence lengths.

# memo_gpt_config LAYERS HIDDEN FFN_HIDDEN HEADS DEFAULT_PP DEFAULT_CP
# Defines MODEL_ARGS, PARALLEL_ARGS and TRAINING_ARGS (and SEQ_LENGTH) for pretrain_gpt.py.
memo_gpt_config() {
    if (($# != 6)); then
        echo "memo_gpt_config: expected LAYERS HIDDEN FFN_HIDDEN HEADS DEFAULT_PP DEFAULT_CP," \
            "got $# arguments" >&2
        return 1
    fi
    SEQ_LENGTH="${SEQ_LENGTH:-131072}"
    MODEL_ARGS=(
        --num-layers "$1" --hidden-size "$2" --ffn-hidden-size "$3" --num-attention-heads "$4"
        --max-position-embeddings "$SEQ_LENGTH" --position-embedding-type rope
        --normalization LayerNorm --untie-embeddings-and-output-weights
    )
    PARALLEL_ARGS=(
        --tensor-model-parallel-size "${TP_SIZE:-8}" --sequence-parallel
        --pipeline-model-parallel-size "${PP_SIZE:-$5}"
        --context-parallel-size "${CP_SIZE:-$6}"
        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
        --use-distributed-optimizer
    )
    TRAINING_ARGS=(
        --seq-length "$SEQ_LENGTH" --micro-batch-size 1 --global-batch-size 16
        --bf16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01
        --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
        --attention-dropout 0.0 --hidden-dropout 0.0
    )
}
