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
# BEGIN recommended layout
# END recommended layout
