#!/usr/bin/env bash
# Continue pretraining a Hugging Face Llama (or Mistral, Qwen2) at a long context on one node
# (docs/continue_pretraining.md):
#   1. tools/checkpoint/convert.py turns HF_DIR into the trainer's checkpoint CKPT_DIR: the
#      weights, the tokenizer files, and model_flags.txt (the model, its RoPE and its tokenizer
#      as pretrain_gpt.py flags). A CKPT_DIR that has model_flags.txt is reused.
#   2. tools/estimate.py --model @CKPT_DIR/model_flags.txt --recommend asks whether SEQ tokens
#      fit on GPUS x GPU, for the model those flags build, and takes its best row's flag line:
#      TP/CP/PP, sequence length, batch and the --memo-* memory policy (predicted, on CPU).
#   3. torchrun pretrain_gpt.py @CKPT_DIR/model_flags.txt --load CKPT_DIR with that line. The
#      converted checkpoint holds weights only, so the run starts at iteration 0 with a fresh
#      optimizer, as --finetune does; once the run has saved, a restart resumes from its own
#      checkpoints in RUN_DIR/checkpoints instead.
#
#   HF_DIR=Meta-Llama-3.1-8B DATA_PATH=data/corpus_text_document GPU=h100 GPUS=8 \
#       bash examples/continue_pretraining_llama.sh
#
# Required environment:
#   HF_DIR     a Hugging Face model folder: config.json, *.safetensors, tokenizer.json and
#              tokenizer_config.json
#   DATA_PATH  indexed dataset prefix(es) written with that tokenizer, e.g. by
#              tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer
#              --tokenizer-model "$HF_DIR" --append-eod; weighted: "0.7 /data/a 0.3 /data/b"
#   GPU        a profile of memo_ext/hardware.json (h100, h200, a800, a100-80gb, ...)
# Optional environment (defaults in brackets):
#   SEQ [1048576] tokens per sequence  GPUS [8] GPUs of this node
#   RUN_DIR [runs/continue_<HF_DIR's name>] holds checkpoints/, recommended.json, metrics.jsonl
#   CKPT_DIR [$RUN_DIR/converted] the converted checkpoint
#   TRAIN_ITERS [1000]  LR [1e-5]  MIN_LR [1e-6]  SAVE_INTERVAL [100]  EVAL_INTERVAL [100]
#   EVAL_ITERS [5]  LOG_INTERVAL [1]  SPLIT [969,30,1]
#   PRECISION [--bf16] ("" for fp32, as the CPU trainer needs)
#   ESTIMATE_ARGS  more tools/estimate.py flags, word-split, e.g. "--host-memory-gb 2048" or a
#                  narrower search ("--policies memo")
#   RECOMMENDED    an answer of the estimator recorded before (its --json output, such as the
#                  RUN_DIR/recommended.json step 2 writes) to take instead of asking again: the
#                  full search for an 8B model at 1M tokens takes minutes to an hour on CPU
#   EXTRA_ARGS     more pretrain_gpt.py flags, word-split; they come last and win, e.g.
#                  "--rotary-base 8000000" for a longer RoPE wavelength
#   PYTHON [python]  TORCHRUN [torchrun]
#   MEMO_DRY_RUN=1   steps 1 and 2 run (they need no GPU); the launch command is printed
#                    (shell-quoted, on stdout) instead of run
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
memo_die() {
    echo "continue_pretraining_llama.sh: error: $*" >&2
    exit 1
}
memo_step() {
    echo "== $*" >&2
}

[[ -f "${HF_DIR:-}/config.json" ]] \
    || memo_die "HF_DIR='${HF_DIR:-}' has no config.json; export HF_DIR=/path/to/the/model" \
        "(a Hugging Face model folder)"
[[ -n "${DATA_PATH:-}" ]] \
    || memo_die "DATA_PATH is not set; export DATA_PATH=/path/to/prefix_text_document" \
        "(tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer" \
        "--tokenizer-model \$HF_DIR)"
[[ -n "${GPU:-}" ]] \
    || memo_die "GPU is not set; export GPU=h100 (a profile of memo_ext/hardware.json)"
read -r -a MEMO_DATA_PATHS <<<"$DATA_PATH"
read -r -a MEMO_ESTIMATE_ARGS <<<"${ESTIMATE_ARGS:-}"
read -r -a MEMO_EXTRA_ARGS <<<"${EXTRA_ARGS:-}"
read -r -a MEMO_PRECISION <<<"${PRECISION-"--bf16"}"
SEQ="${SEQ:-1048576}"
GPUS="${GPUS:-8}"
RUN_DIR="${RUN_DIR:-runs/continue_$(basename "$HF_DIR")}"
CKPT_DIR="${CKPT_DIR:-$RUN_DIR/converted}"
PYTHON="${PYTHON:-python}"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$RUN_DIR"

if [[ -f "$CKPT_DIR/model_flags.txt" ]]; then
    memo_step "1/3 using the converted checkpoint $CKPT_DIR"
else
    memo_step "1/3 converting $HF_DIR to $CKPT_DIR"
    "$PYTHON" "$REPO_ROOT/tools/checkpoint/convert.py" --loader hf --saver core \
        --load-dir "$HF_DIR" --save-dir "$CKPT_DIR" >&2
fi
grep -qx HuggingFaceTokenizer "$CKPT_DIR/model_flags.txt" \
    || memo_die "$CKPT_DIR/model_flags.txt names no tokenizer (the conversion said why); give" \
        "HF_DIR a tokenizer.json and tokenizer_config.json and convert again"

if [[ -n "${RECOMMENDED:-}" ]]; then
    memo_step "2/3 the recorded recommendation $RECOMMENDED"
else
    memo_step "2/3 does $SEQ tokens fit on $GPUS x $GPU? (tools/estimate.py --recommend," \
        "predicted)"
    RECOMMENDED="$RUN_DIR/recommended.json"
    ESTIMATE_STATUS=0
    "$PYTHON" "$REPO_ROOT/tools/estimate.py" --model "@$CKPT_DIR/model_flags.txt" --gpu "$GPU" \
        --gpus "$GPUS" --seq-length "$SEQ" --recommend --json "${MEMO_ESTIMATE_ARGS[@]}" \
        >"$RECOMMENDED" || ESTIMATE_STATUS=$?
    # 1: no layout fits (the answer says so); anything else: an error, printed above
    ((ESTIMATE_STATUS <= 1)) || memo_die "tools/estimate.py failed (status $ESTIMATE_STATUS)"
fi
# The best row's pretrain_gpt.py flags, one a line; none when nothing fits.
LAYOUT_TEXT="$("$PYTHON" - "$RECOMMENDED" "$GPUS" "$SEQ" <<'PY'
import json
import sys

path, gpus, seq = sys.argv[1:]
answer = json.load(open(path))
if (answer.get("gpus"), answer.get("seq_length")) != (int(gpus), int(seq)):
    sys.exit(f"continue_pretraining_llama.sh: error: {path} answers --gpus {answer.get('gpus')} "
             f"--seq-length {answer.get('seq_length')}, not GPUS={gpus} SEQ={seq}; unset "
             "RECOMMENDED to ask the estimator")
rows = answer["rows"]
sys.stdout.write("".join(f"{flag}\n" for flag in (rows[0]["trainer_flags"] if rows else [])))
PY
)"
[[ -n "$LAYOUT_TEXT" ]] \
    || memo_die "no layout fits $SEQ tokens on $GPUS x $GPU (predicted); lower SEQ, raise GPUS," \
        "or ask for the longest: tools/estimate.py --model @$CKPT_DIR/model_flags.txt --gpu" \
        "$GPU --gpus $GPUS --recommend --max-seq-length"
mapfile -t LAYOUT_ARGS <<<"$LAYOUT_TEXT"

# A restart resumes the run's own checkpoints; the first start loads the converted weights.
LOAD_DIR="$CKPT_DIR"
if [[ -f "$RUN_DIR/checkpoints/latest_checkpointed_iteration.txt" ]]; then
    LOAD_DIR="$RUN_DIR/checkpoints"
fi
LAUNCH_COMMAND=(
    "${TORCHRUN:-torchrun}" --standalone --nproc-per-node "$GPUS" "$REPO_ROOT/pretrain_gpt.py"
    "@$CKPT_DIR/model_flags.txt" --load "$LOAD_DIR" --save "$RUN_DIR/checkpoints"
    "${LAYOUT_ARGS[@]}"
    --data-path "${MEMO_DATA_PATHS[@]}" --split "${SPLIT:-969,30,1}"
    --train-iters "${TRAIN_ITERS:-1000}" --lr "${LR:-1e-5}" --min-lr "${MIN_LR:-1e-6}"
    --lr-decay-style cosine --lr-warmup-fraction 0.01 --clip-grad 1.0 --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.95 "${MEMO_PRECISION[@]}"
    --save-interval "${SAVE_INTERVAL:-100}" --exit-signal-handler
    --eval-interval "${EVAL_INTERVAL:-100}" --eval-iters "${EVAL_ITERS:-5}"
    --log-interval "${LOG_INTERVAL:-1}" --log-metrics-jsonl "$RUN_DIR/metrics.jsonl"
    "${MEMO_EXTRA_ARGS[@]}"
)
if [[ "${MEMO_DRY_RUN:-0}" == 1 ]]; then
    memo_step "3/3 the launch (MEMO_DRY_RUN=1: printed, not run)"
    printf '%q ' "${LAUNCH_COMMAND[@]}"
    printf '\n'
    exit 0
fi
memo_step "3/3 training: ${LAUNCH_COMMAND[*]}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec "${LAUNCH_COMMAND[@]}"
