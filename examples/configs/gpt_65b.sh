# shellcheck shell=bash
# GPT-65B of MEMO's Table 2: 80 layers, hidden 8192, FFN 32768, 64 heads, vocabulary 50257
# (65.2 B parameters with the untied output layer). Sourced by
# examples/slurm/pretrain_gpt_65b.sbatch; defines MODEL_ARGS, PARALLEL_ARGS and TRAINING_ARGS.
# Architecture, recipe and overrides: see gpt_common.sh.
#
# Default layout: TP=8 + SP, PP=4, CP=2 on 8 nodes (64 GPUs) for SEQ_LENGTH=131072 (128K).
# Four pipeline stages of 20 layers keep weights, gradients and Adam state at ~37 GB per GPU.
#   SEQ_LENGTH=262144   CP_SIZE=4   sbatch --nodes=16 ...  (256K on 128 GPUs)
#   SEQ_LENGTH=524288   CP_SIZE=8   sbatch --nodes=32 ...  (512K on 256 GPUs)

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#               layers hidden ffn    heads PP CP
memo_gpt_config 80     8192   32768  64    4  2
