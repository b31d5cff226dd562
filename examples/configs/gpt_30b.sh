# shellcheck shell=bash
# GPT-30B of MEMO's Table 2: 48 layers, hidden 7168, FFN 28672, 56 heads, vocabulary 50257
# (30.3 B parameters with the untied output layer). Sourced by
# examples/slurm/pretrain_gpt_30b.sbatch; defines MODEL_ARGS, PARALLEL_ARGS and TRAINING_ARGS.
# Architecture, recipe and overrides: see gpt_common.sh.
#
# Default layout: TP=8 + SP, PP=2, CP=2 on 4 nodes (32 GPUs) for SEQ_LENGTH=131072 (128K).
# One TP group alone would hold ~68 GB of weights, gradients and Adam state per GPU, so two
# pipeline stages halve that to ~34 GB.
#   SEQ_LENGTH=262144   CP_SIZE=4   sbatch --nodes=8 ...   (256K on 64 GPUs)
#   SEQ_LENGTH=524288   CP_SIZE=8   sbatch --nodes=16 ...  (512K on 128 GPUs)

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#               layers hidden ffn    heads PP CP
memo_gpt_config 48     7168   28672  56    2  2
