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
# BEGIN recommended layout
# END recommended layout
