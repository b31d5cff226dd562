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
# (no variant that is traced whole: examples/configs/recommend.py, WITHOUT_WHOLE_TRACES)
# (examples/configs/recommended.md, section 65b).

source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
#              layers hidden ffn    heads
memo_gpt_model 80     8192   32768  64
# BEGIN recommended layout
# END recommended layout
