# shellcheck shell=bash
# Shared by the configs of examples/configs: the GPT architecture and training recipe of MEMO's
# Table 2 models, parameterised by the model shape, and the layout flags a config takes from
# the recommender (tools/estimate.py --recommend). Sourcing it only defines the functions
# memo_gpt_model and memo_layout; a config calls both.
#
# Architecture (the same for every size):
#   * Plain GPT blocks as in MEMO: pre-LayerNorm, GeLU MLP (no SwiGLU), biases kept (append
#     --disable-bias-linear to MODEL_ARGS for bias-free linears).
#   * Rotary position embeddings rather than a learned table: positions are not capped by a
#     table size, which long-context training needs.
#   * Untied input embedding and output layer.
#   * Vocabulary: GPT-2's 50257 BPE ids. The tokenizers of this fork are offline, so the SLURM
#     scripts pass --tokenizer-type BPETokenizer --tokenizer-model "$TOKENIZER_MODEL" (a local
#     GPT-2 tokenizer.json, or any BPE JSON containing <|endoftext|>); the embedding is padded
#     to a multiple of 128 x TP rows.
#
# Layout (PARALLEL_ARGS): the best row of the recommender for the config's question, copied
# verbatim from its flag line: parallel sizes (TP with sequence parallelism, CP, PP; extra GPUs
# are data parallel with --use-distributed-optimizer), --seq-length and
# --max-position-embeddings, micro and global batch, and the memory policy's flags (MEMO's
# --memo-offload/--memo-alpha/--memo-checkpoint-layers with the chunked loss, or SPPO's
# --memo-sppo...). examples/configs/recommended.md records each config's command and flag
# line (written by examples/configs/recommend.py); tests/unit/examples/test_examples.py checks that
# PARALLEL_ARGS equal it. Its step times and MFU are predicted, not measured.
#
# Environment override: LAYOUT_FLAGS replaces PARALLEL_ARGS (word-split), e.g. another row of
# the recommender: LAYOUT_FLAGS="$(tools/estimate.py ... --recommend | sed -n 's/^#2: pretrain_gpt.py //p')".
# GPUs = TP x CP x PP x DP must equal the job's nodes x 8.
#
# Training recipe (MEMO's setup; the batch comes with the layout, micro batch 1 and global
# batch 16 sequences in every recommended row): AdamW with cosine decay from 3e-4 to 3e-5
# after a 1% warmup, gradient clipping 1.0, weight decay 0.1, bf16. No dropout: its masks cost
# activation memory at long sequence lengths (and SPPO refuses attention dropout).

# memo_gpt_model LAYERS HIDDEN FFN_HIDDEN HEADS
# Defines MODEL_ARGS and TRAINING_ARGS for pretrain_gpt.py.
memo_gpt_model() {
    if (($# != 4)); then
        echo "memo_gpt_model: expected LAYERS HIDDEN FFN_HIDDEN HEADS, got $# arguments" >&2
        return 1
    fi
    MODEL_ARGS=(
        --num-layers "$1" --hidden-size "$2" --ffn-hidden-size "$3" --num-attention-heads "$4"
        --position-embedding-type rope
        --normalization LayerNorm --untie-embeddings-and-output-weights
    )
    TRAINING_ARGS=(
        --bf16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01
        --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
        --attention-dropout 0.0 --hidden-dropout 0.0
    )
}

# memo_layout FLAG...
# Defines PARALLEL_ARGS: the recommender's flag line given (or $LAYOUT_FLAGS when set), and
# SEQ_LENGTH: its --seq-length.
memo_layout() {
    if [[ -n "${LAYOUT_FLAGS:-}" ]]; then
        read -r -a PARALLEL_ARGS <<<"$LAYOUT_FLAGS"
    else
        PARALLEL_ARGS=("$@")
    fi
    SEQ_LENGTH=
    local i
    for ((i = 0; i + 1 < ${#PARALLEL_ARGS[@]}; i++)); do
        if [[ "${PARALLEL_ARGS[i]}" == --seq-length ]]; then
            SEQ_LENGTH="${PARALLEL_ARGS[i + 1]}"
        fi
    done
    if [[ -z "$SEQ_LENGTH" ]]; then
        echo "memo_layout: the layout flags have no --seq-length (a recommender flag line has)" >&2
        return 1
    fi
}
