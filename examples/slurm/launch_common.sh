# shellcheck shell=bash
# Shared launcher of examples/slurm/pretrain_gpt_*.sbatch. The sbatch script sets MEMO_MODEL (the
# config's name: 7b, 7b_longest, 7b_4m, 13b, 30b or 65b), MEMO_SIGNAL_S (the seconds of its
# --signal=B:USR1@...) and MEMO_ROOT (the repository root) and sources this file, which sources
# examples/configs/gpt_${MEMO_MODEL}.sh and starts one torchrun per node with srun; torchrun
# starts one pretrain_gpt.py rank per GPU. Without Slurm, MEMO_SRUN=0 runs torchrun directly:
# run the script on every node with the same NNODES and MASTER_ADDR (the first node's address;
# torchrun's c10d rendezvous numbers the nodes), as docs/launch.md shows.
#
# Required environment:
#   DATA_PATH        indexed dataset prefix(es) from tools/preprocess_data.py, e.g.
#                    /data/pile_text_document, or weighted: "0.7 /data/a_text_document 0.3 /data/b"
#   TOKENIZER_MODEL  BPE tokenizer JSON containing <|endoftext|>, e.g. a local copy of GPT-2's
#                    tokenizer.json (50257 ids), the one the dataset was preprocessed with
# Optional environment (defaults in brackets):
#   RUN_DIR          [$MEMO_ROOT/runs/gpt_$MEMO_MODEL] holds checkpoints/, tensorboard/ and
#                    metrics.jsonl unless overridden by:
#   CHECKPOINT_DIR   [$RUN_DIR/checkpoints] --save and --load (resumes from the latest iteration)
#   TENSORBOARD_DIR  [$RUN_DIR/tensorboard]
#   TRAIN_ITERS [1000]  SAVE_INTERVAL [100]  EVAL_INTERVAL [100]  EVAL_ITERS [5]
#   LOG_INTERVAL [1]  GPUS_PER_NODE [8]  MASTER_PORT [from the job id]
#   NNODES           [$SLURM_NNODES, else 1] nodes of the job (with MEMO_SRUN=0)
#   SPLIT            [969,30,1] train,valid,test weights; each weighted split must receive at
#                    least one document (use e.g. 95,5,0 for a corpus of a few hundred)
#   TORCHRUN         [torchrun] the launcher on the compute nodes, e.g. $MEMO_ROOT/.venv/bin/torchrun
#   EXTRA_ARGS       more pretrain_gpt.py flags, word-split, e.g. "--peak-tflops 312"
#   LAYOUT_FLAGS     another layout (a recommender flag line): see examples/configs/gpt_common.sh
#   MEMO_SRUN [1]    0: start torchrun on this node only, without srun
#   MEMO_DRY_RUN=1   print the launch command line (srun ... torchrun ... pretrain_gpt.py and all
#                    its flags, shell-quoted) instead of running it
#
# Preemption and time limits: the sbatch scripts ask Slurm for SIGUSR1 to this batch shell
# MEMO_SIGNAL_S seconds before the time limit (--signal=B:USR1@$MEMO_SIGNAL_S). The trap below forwards SIGTERM to the
# training processes, whose --exit-signal-handler saves a checkpoint at the end of the current
# iteration and exits 0; the job then requeues itself and resumes from that checkpoint. A
# SIGTERM to the batch shell (scancel, or Slurm preemption, which requeues by itself with
# --requeue) is forwarded the same way, without a requeue. torchrun waits up to
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT (MEMO_SIGNAL_S - 60) seconds for its workers after forwarding
# the signal, then kills them. MEMO_SIGNAL_S must cover the rest of one iteration (the
# recommender's predicted step, up to hours at millions of tokens with a global batch of 16:
# examples/configs/recommended.md) plus one checkpoint save: each sbatch script sets it from its
# config's predicted step; raise it (and --signal) for slow storage.

set -euo pipefail

memo_die() {
    echo "launch_common.sh: error: $*" >&2
    exit 1
}

[[ -n "${MEMO_MODEL:-}" ]] || memo_die "MEMO_MODEL is not set; source this file from an sbatch script"
[[ -f "${MEMO_ROOT:-}/pretrain_gpt.py" ]] \
    || memo_die "MEMO_ROOT='${MEMO_ROOT:-}' is not the repository root (no pretrain_gpt.py there);" \
        "export MEMO_ROOT=/path/to/Megatron-MEMO or submit from the repository root"
MEMO_CONFIG="$MEMO_ROOT/examples/configs/gpt_${MEMO_MODEL}.sh"
[[ -f "$MEMO_CONFIG" ]] || memo_die "no model config $MEMO_CONFIG (MEMO_MODEL=$MEMO_MODEL)"
# shellcheck source=/dev/null
source "$MEMO_CONFIG"

[[ -n "${DATA_PATH:-}" ]] \
    || memo_die "DATA_PATH is not set; export DATA_PATH=/path/to/prefix_text_document" \
        "(an indexed dataset written by tools/preprocess_data.py)"
[[ -n "${TOKENIZER_MODEL:-}" ]] \
    || memo_die "TOKENIZER_MODEL is not set; export TOKENIZER_MODEL=/path/to/tokenizer.json" \
        "(the BPE tokenizer the dataset was preprocessed with)"
read -r -a MEMO_DATA_PATHS <<<"$DATA_PATH"

RUN_DIR="${RUN_DIR:-$MEMO_ROOT/runs/gpt_${MEMO_MODEL}}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$RUN_DIR/checkpoints}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-$RUN_DIR/tensorboard}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NNODES="${SLURM_NNODES:-${NNODES:-1}}"
MEMO_SIGNAL_S="${MEMO_SIGNAL_S:-900}"
JOB_ID="${SLURM_JOB_ID:-0}"

if command -v scontrol >/dev/null 2>&1 && [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
else
    MASTER_ADDR="${MASTER_ADDR:-$(hostname)}"
fi
MASTER_PORT="${MASTER_PORT:-$((20000 + JOB_ID % 20000))}"
export MASTER_ADDR MASTER_PORT

# Megatron's usual settings: one CUDA work queue, so that TP/SP communication kernels are
# issued in program order and overlap as scheduled.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# InfiniBand on, with a longer transport timeout for large CP/PP messages. NCCL_IB_HCA,
# NCCL_SOCKET_IFNAME and (RoCE only) NCCL_IB_GID_INDEX are cluster specific: export them
# before sbatch if NCCL picks the wrong devices.
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}"
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
# Split the task's CPUs between the ranks of a node.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(((${SLURM_CPUS_PER_TASK:-$GPUS_PER_NODE} + GPUS_PER_NODE - 1) / GPUS_PER_NODE))}"
# Since Slurm 22.05 srun no longer inherits --cpus-per-task from sbatch.
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi
# Leave torchrun's workers time to finish the iteration and write the checkpoint (its default
# is 30 s); below the MEMO_SIGNAL_S of --signal=B:USR1@... so Slurm's own kill does not come
# first.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$((MEMO_SIGNAL_S - 60))}"

read -r -a MEMO_EXTRA_ARGS <<<"${EXTRA_ARGS:-}"
PRETRAIN_ARGS=(
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}"
    --train-iters "${TRAIN_ITERS:-1000}"
    --data-path "${MEMO_DATA_PATHS[@]}" --split "${SPLIT:-969,30,1}"
    --tokenizer-type BPETokenizer --tokenizer-model "$TOKENIZER_MODEL"
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR"
    --save-interval "${SAVE_INTERVAL:-100}" --exit-signal-handler
    --eval-interval "${EVAL_INTERVAL:-100}" --eval-iters "${EVAL_ITERS:-5}"
    --log-interval "${LOG_INTERVAL:-1}" --tensorboard-dir "$TENSORBOARD_DIR"
    --log-metrics-jsonl "$RUN_DIR/metrics.jsonl"
    "${MEMO_EXTRA_ARGS[@]}"
)
LAUNCH_COMMAND=(
    "${TORCHRUN:-torchrun}" --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$JOB_ID"
    "$MEMO_ROOT/pretrain_gpt.py" "${PRETRAIN_ARGS[@]}"
)
if [[ "${MEMO_SRUN:-1}" != 0 ]]; then
    LAUNCH_COMMAND=(srun --kill-on-bad-exit=1 --nodes "$NNODES" --ntasks-per-node 1
        "${LAUNCH_COMMAND[@]}")
fi

if [[ "${MEMO_DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${LAUNCH_COMMAND[@]}"
    printf '\n'
    exit 0
fi

mkdir -p "$CHECKPOINT_DIR" "$TENSORBOARD_DIR"
cd "$MEMO_ROOT"
# megatron.training is imported from the checkout (also without `pip install -e .`).
export PYTHONPATH="$MEMO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
echo "memo-gpt-${MEMO_MODEL}: $NNODES node(s) x $GPUS_PER_NODE GPUs, SEQ_LENGTH=$SEQ_LENGTH," \
    "rendezvous $MASTER_ADDR:$MASTER_PORT, checkpoints in $CHECKPOINT_DIR" \
    "(restart ${SLURM_RESTART_COUNT:-0})"

MEMO_REQUEUE=0
MEMO_SRUN_PID=
memo_forward_term() {
    if [[ -n "$MEMO_SRUN_PID" ]]; then
        echo "launch_common.sh: $1: asking the training ranks to checkpoint and exit" >&2
        kill -TERM "$MEMO_SRUN_PID" 2>/dev/null || true
    fi
}
trap 'MEMO_REQUEUE=1; memo_forward_term "time limit near (SIGUSR1)"' USR1
trap 'memo_forward_term "SIGTERM"' TERM

"${LAUNCH_COMMAND[@]}" &
MEMO_SRUN_PID=$!
# `wait` returns early when a trapped signal arrives: keep waiting until srun has exited, then
# collect its exit status.
while kill -0 "$MEMO_SRUN_PID" 2>/dev/null; do
    wait "$MEMO_SRUN_PID" || true
done
MEMO_STATUS=0
wait "$MEMO_SRUN_PID" || MEMO_STATUS=$?

if [[ "$MEMO_REQUEUE" == 1 && -n "${SLURM_JOB_ID:-}" ]]; then
    echo "launch_common.sh: requeueing job $SLURM_JOB_ID; it resumes from $CHECKPOINT_DIR" >&2
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$MEMO_STATUS"
