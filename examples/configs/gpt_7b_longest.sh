# shellcheck shell=bash
# GPT-7B of MEMO's Table 2: 32 layers, hidden 4096, FFN 16384, 32 heads, vocabulary 50257
# (6.9 B parameters with the untied output layer).
# Sourced by examples/slurm/pretrain_gpt_7b_longest.sbatch; defines MODEL_ARGS, PARALLEL_ARGS and
# TRAINING_ARGS.
# Architecture, recipe and the LAYOUT_FLAGS override: see gpt_common.sh.
#
# Headline 7b_longest: the longest sequence the recommender predicts one 8-GPU A800/A100-80GB node
# reaches with 2 TB of host memory, every policy searched (MEMO's token-wise offload and
# whole-layer checkpoint offload, Megatron's recompute, SPPO; tiled MLP):
#   tools/estimate.py --model 7b --gpu a800 --gpus 8 --host-memory-gb 2048 --recommend \
#       --max-seq-length
# (examples/configs/recommended.md, section 7b_longest). The node needs that host memory.

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#              layers hidden ffn    heads
memo_gpt_model 32     4096   16384  32
# BEGIN recommended layout: section 7b_longest of examples/configs/recommended.md, written
# by examples/configs/recommend.py apply; its best row (predicted, not measured):
#   TP=4 CP=2 PP=1 DP=1 mbs=1 MEMO offload alpha 0 + 8 checkpoint layers, 1 offload buffer, MLP in 16 tiles, attention projections in 16 tiles, heads in 8 chunks
memo_layout \
    --tensor-model-parallel-size 4 --sequence-parallel --context-parallel-size 2 \
    --pipeline-model-parallel-size 1 --use-distributed-optimizer --seq-length 4456448 \
    --max-position-embeddings 4456448 --micro-batch-size 1 --global-batch-size 16 \
    --memo-offload --memo-alpha 0 --memo-checkpoint-layers 8 --cross-entropy-loss-fusion \
    --cross-entropy-fusion-impl chunked --memo-offload-buffers 1 --memo-mlp-tile-size 139264 \
    --memo-attention-projection-tile-size 139264 --memo-attention-head-chunks 8
# END recommended layout
