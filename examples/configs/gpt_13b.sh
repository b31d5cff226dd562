# shellcheck shell=bash
# GPT-13B of MEMO's Table 2: 40 layers, hidden 5120, FFN 20480, 40 heads, vocabulary 50257
# (13.1 B parameters with the untied output layer). Sourced by
# examples/slurm/pretrain_gpt_13b.sbatch; defines MODEL_ARGS, PARALLEL_ARGS and TRAINING_ARGS.
# Architecture, recipe and overrides: see gpt_common.sh.
#
# Default layout: TP=8 + SP, PP=1, CP=2 on 2 nodes (16 GPUs) for SEQ_LENGTH=131072 (128K,
# 64K tokens per CP rank). Weights, gradients and Adam state take ~30 GB per GPU.
#   SEQ_LENGTH=262144   CP_SIZE=4   sbatch --nodes=4 ...   (256K on 32 GPUs)
#   SEQ_LENGTH=524288   CP_SIZE=8   sbatch --nodes=8 ...   (512K on 64 GPUs)
#   SEQ_LENGTH=1048576  CP_SIZE=16  sbatch --nodes=16 ...  (1M on 128 GPUs)

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#               layers hidden ffn    heads PP CP
memo_gpt_config 40     5120   20480  40    1  2
