#!/usr/bin/env bash
# CPU quick start (`make demo`): train a small GPT for a few minutes on 2 CPU processes with
# tensor + sequence parallelism over gloo, on text that ships with CPython, then plot the loss.
#
#   bash examples/cpu_quickstart.sh          # from the repository root, after `make setup`
#
# Steps:
#   1. tools/prepare_demo_data.py builds data_cache/demo once (BPE tokenizer, 4096 ids, and an
#      indexed .bin/.idx dataset); later runs reuse it. Its last output line is the data flags.
#   2. torchrun starts 2 ranks of pretrain_gpt.py: TP=2 with --sequence-parallel, a 4-layer
#      GPT (hidden 256, 8 heads, rope, sequence length 256), global batch 16 = 4 micro-batches
#      of 4 sequences (4096 tokens per iteration). Each run starts from scratch in runs/demo.
#   3. The demo checks itself (the last logged loss must be below the first) and plots
#      runs/demo/loss.png with tools/plot_loss.py.
#
# Environment knobs: DEMO_TRAIN_ITERS (default 120), DEMO_RUN_DIR (default runs/demo; deleted
# and recreated), DEMO_MASTER_PORT (default: a free port).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

PYTHON=.venv/bin/python
TORCHRUN=.venv/bin/torchrun
if [[ ! -x "$PYTHON" || ! -x "$TORCHRUN" ]]; then
    echo "cpu_quickstart.sh: error: $REPO_ROOT/.venv is missing; run 'make setup' first" >&2
    exit 1
fi
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# One intra-op thread per rank: the 2 ranks share the 2 cores of a small machine.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Quiet two library notices that say nothing about this run: torch's deprecation of the
# collectives megatron-core calls, and megatron-core's CUDA stream advice for sequence
# parallelism (the variable has no effect on CPU).
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning:torch.distributed.c10d_logger}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

RUN_DIR="${DEMO_RUN_DIR:-runs/demo}"
METRICS="$RUN_DIR/metrics.jsonl"
TRAIN_ITERS="${DEMO_TRAIN_ITERS:-120}"
START_SECONDS=$SECONDS

echo "== 1/3 demo dataset (tools/prepare_demo_data.py)"
PREPARE_OUTPUT="$("$PYTHON" tools/prepare_demo_data.py)"
printf '%s\n' "$PREPARE_OUTPUT"
# The last line is the shell-quoted data and tokenizer flags; its paths are relative to the
# repository root and contain no spaces, so word splitting is exact.
read -r -a DATA_ARGS <<<"$(tail -n 1 <<<"$PREPARE_OUTPUT")"
if [[ "${DATA_ARGS[0]:-}" != "--data-path" ]]; then
    echo "cpu_quickstart.sh: error: tools/prepare_demo_data.py did not print the data flags" \
        "on its last line" >&2
    exit 1
fi

MASTER_PORT="${DEMO_MASTER_PORT:-$("$PYTHON" -c '
import socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    print(s.getsockname()[1])
')}"

MODEL_ARGS=(
    --num-layers 4 --hidden-size 256 --num-attention-heads 8
    --seq-length 256 --max-position-embeddings 256 --position-embedding-type rope
    # No dropout: the run is far too short to overfit, and dropout slows CPU training.
    --attention-dropout 0 --hidden-dropout 0
)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --sequence-parallel)
# MEMO token-wise activation swap + recompute: layers 1-2 of 4 offloaded (the last two stay on
# device); alpha solved by MEMO's LP after the first iteration and logged.
MEMO_ARGS=(--memo-offload --memo-alpha auto)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS"
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10
    --weight-decay 0.1 --clip-grad 1.0 --seed 1234
)
# 95% train / 5% validation / no test split: the corpus has only ~180 documents, and a split
# that rounds to zero documents must not be requested.
DATA_SPLIT_ARGS=(--split 95,5,0)
LOGGING_ARGS=(
    --log-interval 10 --eval-interval 40 --eval-iters 2
    --log-metrics-jsonl "$METRICS" --save "$RUN_DIR/checkpoints"
)

rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
RUN_DIR_ABS="$(cd "$RUN_DIR" && pwd)"
: >"$METRICS"

echo "== 2/3 training: torchrun, 2 CPU ranks, TP=2 + sequence parallel + MEMO offload, $TRAIN_ITERS iterations"
"$TORCHRUN" --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$MASTER_PORT" \
    pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MEMO_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${DATA_SPLIT_ARGS[@]}" "${LOGGING_ARGS[@]}" \
    2>&1 | tee "$RUN_DIR/train.log"

echo "== 3/3 results"
# Summarise the metrics and fail unless the loss went down.
"$PYTHON" - "$METRICS" <<'PY'
import json
import sys

path = sys.argv[1]
records = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
train = [r for r in records if "lm_loss" in r]
valid = [r for r in records if "validation_lm_loss" in r]
if not train:
    sys.exit(f"cpu_quickstart.sh: error: no training loss was logged to {path}")
first, last = train[0], train[-1]
tokens_per_s = sum(r["tokens_per_s"] for r in train) / len(train)
memory_keys = ("mem_peak_rss_mib", "mem_peak_rss_since_start_mib", "mem_peak_allocated_mib")
memory = max(next((r[k] for k in memory_keys if k in r), 0.0) for r in train)
print(f"lm loss: {first['lm_loss']:.3f} at iteration {first['iteration']} -> "
      f"{last['lm_loss']:.3f} at iteration {last['iteration']}")
if valid:
    print(f"validation lm loss: {valid[0]['validation_lm_loss']:.3f} at iteration "
          f"{valid[0]['iteration']} -> {valid[-1]['validation_lm_loss']:.3f} at iteration "
          f"{valid[-1]['iteration']}")
print(f"throughput: {tokens_per_s:.0f} tokens/s (mean of logged intervals) | "
      f"MFU: {100 * last['mfu']:.1f}% | peak memory per rank: {memory:.0f} MiB")
if not last["lm_loss"] < first["lm_loss"]:
    sys.exit(f"cpu_quickstart.sh: error: the loss did not fall ({first['lm_loss']:.3f} -> "
             f"{last['lm_loss']:.3f}); see {path}")
PY

"$PYTHON" tools/plot_loss.py "$METRICS" -o "$RUN_DIR/loss.png" \
    --labels "GPT 4x256, TP=2 + SP, MEMO offload (CPU)" --title "make demo: GPT pretraining on CPU"
echo "loss curve: $RUN_DIR_ABS/loss.png"
echo "checkpoint: $RUN_DIR_ABS/checkpoints | log: $RUN_DIR_ABS/train.log"
echo "demo finished in $((SECONDS - START_SECONDS)) s"
