# shellcheck shell=bash
# GPT-13B of MEMO's Table 2: 40 layers, hidden 5120, FFN 20480, 40 heads, vocabulary 50257
# (13.1 B parameters with the untied output layer).
# Sourced by examples/slurm/pretrain_gpt_13b.sbatch; defines MODEL_ARGS, PARALLEL_ARGS and
# TRAINING_ARGS.
# Architecture, recipe and the LAYOUT_FLAGS override: see gpt_common.sh.
#
# Headline 13b: the recommended layout on 16 GPUs (2 nodes), at the longest sequence it predicts:
#   tools/estimate.py --model 13b --gpu a800 --gpus 16 --recommend --max-seq-length \
#       --checkpoint-fractions 0,1 --mlp-tiles 0
# (stages all in (a) or all in (b), untiled: examples/configs/recommend.py, WITHOUT_WHOLE_TRACES)
# (examples/configs/recommended.md, section 13b).

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#              layers hidden ffn    heads
memo_gpt_model 40     5120   20480  40
# BEGIN recommended layout: section 13b of examples/configs/recommended.md, written
# by examples/configs/recommend.py apply; its best row (predicted, not measured):
#   TP=4 CP=4 PP=1 DP=1 mbs=1 MEMO offload alpha 0 + 38 checkpoint layers
memo_layout \
    --tensor-model-parallel-size 4 --sequence-parallel --context-parallel-size 4 \
    --pipeline-model-parallel-size 1 --use-distributed-optimizer --seq-length 2359296 \
    --max-position-embeddings 2359296 --micro-batch-size 1 --global-batch-size 16 \
    --memo-offload --memo-alpha 0 --memo-checkpoint-layers 38 --cross-entropy-loss-fusion \
    --cross-entropy-fusion-impl chunked
# END recommended layout
