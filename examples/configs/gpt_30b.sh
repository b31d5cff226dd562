# shellcheck shell=bash
# GPT-30B of MEMO's Table 2: 48 layers, hidden 7168, FFN 28672, 56 heads, vocabulary 50257
# (30.3 B parameters with the untied output layer).
# Sourced by examples/slurm/pretrain_gpt_30b.sbatch; defines MODEL_ARGS, PARALLEL_ARGS and
# TRAINING_ARGS.
# Architecture, recipe and the LAYOUT_FLAGS override: see gpt_common.sh.
#
# Headline 30b: the recommended layout on 32 GPUs (4 nodes), at the longest sequence it predicts:
#   tools/estimate.py --model 30b --gpu a800 --gpus 32 --recommend --max-seq-length \
#       --checkpoint-fractions 0,1 --mlp-tiles 0
# (no variant that is traced whole: examples/configs/recommend.py, WITHOUT_WHOLE_TRACES)
# (examples/configs/recommended.md, section 30b).

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#              layers hidden ffn    heads
memo_gpt_model 48     7168   28672  56
# BEGIN recommended layout
# END recommended layout
