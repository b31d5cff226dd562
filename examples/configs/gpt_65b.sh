# shellcheck shell=bash
# GPT-65B of MEMO's Table 2: 80 layers, hidden 8192, FFN 32768, 64 heads, vocabulary 50257
# (65.2 B parameters with the untied output layer).
# Sourced by examples/slurm/pretrain_gpt_65b.sbatch; defines MODEL_ARGS, PARALLEL_ARGS and
# TRAINING_ARGS.
# Architecture, recipe and the LAYOUT_FLAGS override: see gpt_common.sh.
#
# Headline 65b: the recommended layout on 64 GPUs (8 nodes), at the longest sequence it predicts:
#   tools/estimate.py --model 65b --gpu a800 --gpus 64 --recommend --max-seq-length \
#       --checkpoint-fractions 0,1 --mlp-tiles 0
# (stages all in (a) or all in (b), untiled: examples/configs/recommend.py, WITHOUT_WHOLE_TRACES)
# (examples/configs/recommended.md, section 65b).

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#              layers hidden ffn    heads
memo_gpt_model 80     8192   32768  64
# BEGIN recommended layout: section 65b of examples/configs/recommended.md, written
# by examples/configs/recommend.py apply; its best row (predicted, not measured):
#   TP=8 CP=8 PP=1 DP=1 mbs=1 MEMO offload alpha 0
memo_layout \
    --tensor-model-parallel-size 8 --sequence-parallel --context-parallel-size 8 \
    --pipeline-model-parallel-size 1 --use-distributed-optimizer --seq-length 1966080 \
    --max-position-embeddings 1966080 --micro-batch-size 1 --global-batch-size 16 \
    --memo-offload --memo-alpha 0 --memo-checkpoint-layers 0 --cross-entropy-loss-fusion \
    --cross-entropy-fusion-impl chunked
# END recommended layout
