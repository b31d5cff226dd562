# shellcheck shell=bash
# GPT-7B of MEMO's Table 2: 32 layers, hidden 4096, FFN 16384, 32 heads, vocabulary 50257
# (6.9 B parameters with the untied output layer). Sourced by
# examples/slurm/pretrain_gpt_7b.sbatch; defines MODEL_ARGS, PARALLEL_ARGS and TRAINING_ARGS.
# Architecture, recipe and overrides: see gpt_common.sh.
#
# Default layout: TP=8 + SP, PP=1, CP=1 on 1 node (8 GPUs) for SEQ_LENGTH=131072 (128K).
# Weights, gradients and Adam state take ~16 GB per GPU. Longer sequences, CP across nodes:
#   SEQ_LENGTH=262144   CP_SIZE=2  sbatch --nodes=2 ...   (256K on 16 GPUs)
#   SEQ_LENGTH=524288   CP_SIZE=4  sbatch --nodes=4 ...   (512K on 32 GPUs)
#   SEQ_LENGTH=1048576  CP_SIZE=8  sbatch --nodes=8 ...   (1M on 64 GPUs)

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#               layers hidden ffn    heads PP CP
memo_gpt_config 32     4096   16384  32    1  1
