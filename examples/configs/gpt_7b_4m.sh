# shellcheck shell=bash
# GPT-7B of MEMO's Table 2: 32 layers, hidden 4096, FFN 16384, 32 heads, vocabulary 50257
# (6.9 B parameters with the untied output layer).
# Sourced by examples/slurm/pretrain_gpt_7b_4m.sbatch; defines MODEL_ARGS, PARALLEL_ARGS and
# TRAINING_ARGS.
# Architecture, recipe and the LAYOUT_FLAGS override: see gpt_common.sh.
#
# Headline 7b_4m: 4M-token sequences (4194304) on 128 GPUs (16 nodes) with SPPO's subsequence
# pipeline; the layout is the best row of
#   tools/estimate.py --model 7b --gpu a800 --gpus 128 --recommend --seq-length 4194304 --policies sppo
# (examples/configs/recommended.md, section 7b_4m). SPPO's row is its solver's analytic model.

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#              layers hidden ffn    heads
memo_gpt_model 32     4096   16384  32
# BEGIN recommended layout: section 7b_4m of examples/configs/recommended.md, written
# by examples/configs/recommend.py apply; its best row (predicted, not measured):
#   TP=8 CP=1 PP=16 DP=1 mbs=1 SPPO N=256 MSP
memo_layout \
    --tensor-model-parallel-size 8 --sequence-parallel --context-parallel-size 1 \
    --pipeline-model-parallel-size 16 --use-distributed-optimizer --seq-length 4194304 \
    --max-position-embeddings 4194304 --micro-batch-size 1 --global-batch-size 16 --memo-sppo \
    --memo-sppo-subsequences 256 --memo-sppo-offload auto --memo-sppo-msp
# END recommended layout
