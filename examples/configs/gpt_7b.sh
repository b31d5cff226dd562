# shellcheck shell=bash
# GPT-7B of MEMO's Table 2: 32 layers, hidden 4096, FFN 16384, 32 heads, vocabulary 50257
# (6.9 B parameters with the untied output layer).
# Sourced by examples/slurm/pretrain_gpt_7b.sbatch; defines MODEL_ARGS, PARALLEL_ARGS and
# TRAINING_ARGS.
# Architecture, recipe and the LAYOUT_FLAGS override: see gpt_common.sh.
#
# Headline 7b_1m: 1M-token sequences (1048576) on one 8-GPU A800/A100-80GB node with MEMO's
# token-wise activation offload; the layout is the best MEMO row of
#   tools/estimate.py --model 7b --gpu a800 --gpus 8 --recommend --seq-length 1048576 --policies memo \
#       --checkpoint-fractions 0 --mlp-tiles 0
# (examples/configs/recommended.md, section 7b_1m: its predicted memory, step time and MFU).

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#              layers hidden ffn    heads
memo_gpt_model 32     4096   16384  32
# BEGIN recommended layout: section 7b_1m of examples/configs/recommended.md, written
# by examples/configs/recommend.py apply; its best row (predicted, not measured):
#   TP=1 CP=8 PP=1 DP=1 mbs=1 MEMO offload alpha 0
memo_layout \
    --tensor-model-parallel-size 1 --context-parallel-size 8 --pipeline-model-parallel-size 1 \
    --use-distributed-optimizer --seq-length 1048576 --max-position-embeddings 1048576 \
    --micro-batch-size 1 --global-batch-size 16 --memo-offload --memo-alpha 0 \
    --memo-checkpoint-layers 0 --cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked
# END recommended layout
