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
# (no variant that is traced whole: examples/configs/recommend.py, WITHOUT_WHOLE_TRACES)
# (examples/configs/recommended.md, section 13b).

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#              layers hidden ffn    heads
memo_gpt_model 40     5120   20480  40
# BEGIN recommended layout
# END recommended layout
