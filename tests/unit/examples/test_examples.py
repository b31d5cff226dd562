"""Tests for examples/ (model configs, SLURM scripts, CPU quick start) and tools/plot_loss.py.

Each headline configuration (examples/configs/recommend.py's HEADLINES) is a config script whose
PARALLEL_ARGS are the recommender's best flag line, recorded with its command in
examples/configs/recommended.md: the configs are sourced in bash, their flags compared with the
recorded line (so they cannot drift from it silently) and validated by
megatron.training.arguments.parse_args for the GPU count of the matching sbatch script. The
sbatch scripts are run with MEMO_DRY_RUN=1 (they print the srun/torchrun command instead of
running it), and once against a fake srun/scontrol to check the preemption path: SIGUSR1 ->
SIGTERM to the ranks -> requeue.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memo_ext.estimate.flops import gpt_shape, parameter_count
from memo_ext.estimate.models import model_shape

from megatron.training.arguments import ArgumentValidationError, parse_args

from tests.conftest import REPO_ROOT, load_script

EXAMPLES = REPO_ROOT / "examples"
CONFIGS = EXAMPLES / "configs"
SLURM = EXAMPLES / "slurm"

# MEMO Table 2: layers, hidden, FFN hidden, heads; nominal size in billions.
TABLE_2 = {
    "7b": (32, 4096, 16384, 32, 7),
    "13b": (40, 5120, 20480, 40, 13),
    "30b": (48, 7168, 28672, 56, 30),
    "65b": (80, 8192, 32768, 64, 65),
}
GPUS_PER_NODE = 8
GPT2_VOCAB = 50257
ARRAYS = ("MODEL_ARGS", "PARALLEL_ARGS", "TRAINING_ARGS")
SHELL_SCRIPTS = sorted([*EXAMPLES.rglob("*.sh"), *EXAMPLES.rglob("*.sbatch")])


def _load(name: str, path: Path):
    return load_script(path, name)


plot_loss = _load("plot_loss", REPO_ROOT / "tools" / "plot_loss.py")
recommend = _load("memo_recommend", CONFIGS / "recommend.py")
HEADLINES = recommend.HEADLINES
# config name (examples/configs/gpt_<stem>.sh, examples/slurm/pretrain_gpt_<stem>.sbatch) per
# headline
STEMS = {name: re.fullmatch(r"gpt_(\w+)\.sh", h.config).group(1) for name, h in HEADLINES.items()}


def _clean_env(**overrides: str) -> dict[str, str]:
    """The environment minus anything the scripts read, plus ``overrides``."""
    read_by_scripts = re.compile(
        r"(SLURM_.*|MEMO_.*|LAYOUT_FLAGS|DATA_PATH|TOKENIZER_MODEL|RUN_DIR|NNODES|"
        r"CHECKPOINT_DIR|TENSORBOARD_DIR|EXTRA_ARGS|MASTER_ADDR|MASTER_PORT|GPUS_PER_NODE|TORCHRUN|"
        r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT|HF_DIR|GPUS?|SEQ|CKPT_DIR|ESTIMATE_ARGS|PRECISION|PYTHON|"
        r"TRAIN_ITERS|LR|MIN_LR|SAVE_INTERVAL|EVAL_INTERVAL|EVAL_ITERS|LOG_INTERVAL|SPLIT)"
    )
    env = {key: value for key, value in os.environ.items() if not read_by_scripts.fullmatch(key)}
    env.update(overrides)
    return env


def source_config(stem: str, **env: str) -> dict[str, list[str]]:
    """MODEL_ARGS, PARALLEL_ARGS and TRAINING_ARGS after sourcing examples/configs/gpt_<stem>.sh."""
    script = (
        'source "$1" || exit 1\n'
        f"for name in {' '.join(ARRAYS)}; do\n"
        '    declare -n array="$name"\n'
        '    printf "%s\\0" "$name" "${#array[@]}" "${array[@]}"\n'
        "    unset -n array\n"
        "done\n"
        'printf "SEQ_LENGTH\\0%s\\0" "$SEQ_LENGTH"\n'
    )
    result = subprocess.run(
        ["bash", "-c", script, "bash", str(CONFIGS / f"gpt_{stem}.sh")],
        capture_output=True, text=True, env=_clean_env(**env), check=True, timeout=30,
    )
    fields = result.stdout.split("\0")[:-1]
    arrays = {}
    for _ in ARRAYS:
        name, count, fields = fields[0], int(fields[1]), fields[2:]
        arrays[name], fields = fields[:count], fields[count:]
    assert set(arrays) == set(ARRAYS), result.stderr
    assert fields[0] == "SEQ_LENGTH"
    arrays["SEQ_LENGTH"] = fields[1]
    return arrays


def sbatch_text(stem: str) -> str:
    return (SLURM / f"pretrain_gpt_{stem}.sbatch").read_text()


def sbatch_nodes(stem: str) -> int:
    """The #SBATCH --nodes of examples/slurm/pretrain_gpt_<stem>.sbatch."""
    return int(re.search(r"^#SBATCH --nodes=(\d+)$", sbatch_text(stem), re.MULTILINE).group(1))


def validate(arrays: dict[str, list[str]], world_size: int, *extra: str):
    argv = [*arrays["MODEL_ARGS"], *arrays["PARALLEL_ARGS"], *arrays["TRAINING_ARGS"],
            "--mock-data", "--vocab-size", str(GPT2_VOCAB), "--train-iters", "10", *extra]
    return parse_args(argv, world_size=world_size, cuda_available=True)


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[str]]:
    """The best flag line of each section of examples/configs/recommended.md."""
    return recommend.recorded_flags()


def test_recommended_file_records_every_headline_from_its_command():
    sections = recommend.read_sections()
    assert set(sections) == set(HEADLINES), "run examples/configs/recommend.py run <missing>"
    text = recommend.RECOMMENDED.read_text()
    assert "predicted, not measured" in text
    for name, section in sections.items():
        headline = HEADLINES[name]
        # the command named is the one the generator runs, with its date, machine and commit
        assert f"- command: `.venv/bin/python {headline.command()}`" in section, name
        assert re.search(r"^- ran: \d{4}-\d\d-\d\d \d\d:\d\d UTC on .+, \d+ s$", section,
                         re.MULTILINE), name
        assert re.search(r"^- commit: [0-9a-f]{40}", section, re.MULTILINE), name
        # the summary's flag line is the best row's line of the recorded output
        output = re.search(r"^```text\n(.*?)^```$", section, re.MULTILINE | re.DOTALL).group(1)
        flags = recommend.FLAGS_LINE.search(section).group("flags")
        assert flags == recommend.best_flags(output), name
        assert re.search(r"^\| 1 \| ", output, re.MULTILINE), name


@pytest.mark.parametrize("name", list(HEADLINES))
def test_config_is_its_recommended_row_and_validates_on_its_nodes(name, recorded):
    headline, stem = HEADLINES[name], STEMS[name]
    layers, hidden, ffn, heads, billions = TABLE_2[stem.split("_")[0]]
    arrays = source_config(stem)
    assert name in recorded, f"examples/configs/recommended.md has no section {name}"
    assert arrays["PARALLEL_ARGS"] == recorded[name], (
        f"examples/configs/{headline.config} differs from recommended.md's flag line: run "
        f"examples/configs/recommend.py apply {name}")
    assert sbatch_nodes(stem) * GPUS_PER_NODE == headline.gpus
    args = validate(arrays, headline.gpus)

    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads) == (
        layers, hidden, ffn, heads)
    assert args.position_embedding_type == "rope"
    assert args.normalization == "LayerNorm" and not args.swiglu
    assert args.untie_embeddings_and_output_weights
    parameters = parameter_count(gpt_shape(args, GPT2_VOCAB))
    assert parameters == parameter_count(model_shape(stem.split("_")[0]))  # the estimator's preset
    # MFU's P leaves out the input embedding (a lookup): 7B's is 6.65 billion
    assert 0.9 * billions < parameters / 1e9 < 1.1 * billions
    # the layout fills the job's GPUs
    assert (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
            * args.context_parallel_size * args.data_parallel_size) == headline.gpus
    assert str(args.seq_length) == arrays["SEQ_LENGTH"]
    assert args.max_position_embeddings == args.seq_length
    # the question asked: the length, and the policy searched
    question = dict(zip(headline.argv, headline.argv[1:]))
    if "--seq-length" in question:
        assert args.seq_length == int(question["--seq-length"])
    if question.get("--policies") == "memo":
        assert args.memo_offload
    if question.get("--policies") == "sppo":
        assert args.memo_sppo
    # MEMO's training setup.
    assert (args.micro_batch_size, args.global_batch_size) == (1, 16)
    assert args.bf16 and args.params_dtype == torch.bfloat16
    assert (args.lr, args.min_lr, args.lr_decay_style) == (3e-4, 3e-5, "cosine")
    assert (args.clip_grad, args.weight_decay) == (1.0, 0.1)
    assert args.attention_dropout == args.hidden_dropout == 0.0


def test_memo_flags_in_the_headline_configs(recorded):
    """MEMO's offload at one node (1M and the longest length), SPPO at 4M on 128 GPUs."""
    assert "--memo-offload" in recorded["7b_1m"] and "--memo-offload" in recorded["7b_longest"]
    assert "--memo-sppo" in recorded["7b_4m"]


def test_layout_flags_override_the_recommended_row():
    flags = ("--tensor-model-parallel-size 8 --sequence-parallel --context-parallel-size 1 "
             "--pipeline-model-parallel-size 1 --use-distributed-optimizer --seq-length 131072 "
             "--max-position-embeddings 131072 --micro-batch-size 1 --global-batch-size 16 "
             "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    arrays = source_config("7b", LAYOUT_FLAGS=flags)
    assert arrays["PARALLEL_ARGS"] == flags.split() and arrays["SEQ_LENGTH"] == "131072"
    args = validate(arrays, world_size=8)
    assert args.recompute_granularity == "full" and not args.memo_offload


def test_config_rejects_a_layout_that_does_not_fit():
    with pytest.raises(ArgumentValidationError, match="world size 4"):
        validate(source_config("13b"), world_size=4)


def _dry_run(stem: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SLURM / f"pretrain_gpt_{stem}.sbatch")],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
        env=_clean_env(**{"MEMO_ROOT": str(REPO_ROOT), "MEMO_DRY_RUN": "1", **env}),
    )


@pytest.fixture
def fake_data(tmp_path):
    """Empty stand-ins for an indexed dataset and a tokenizer (parse_args checks they exist)."""
    prefix = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).touch()
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.touch()
    return {"DATA_PATH": str(prefix), "TOKENIZER_MODEL": str(tokenizer),
            "RUN_DIR": str(tmp_path / "run")}


def _seconds(limit: str) -> int:
    """Slurm's [days-]hours:minutes:seconds."""
    days, _, clock = limit.rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


@pytest.mark.parametrize("name", list(HEADLINES))
def test_sbatch_launch_command_validates(name, tmp_path, fake_data, recorded):
    stem = STEMS[name]
    nodes = sbatch_nodes(stem)
    header = sbatch_text(stem)
    for directive in ("--ntasks-per-node=1", f"--gpus-per-node={GPUS_PER_NODE}", "--exclusive",
                      "--requeue", "--signal=B:USR1@", "--cpus-per-task=", "--time="):
        assert f"#SBATCH {directive}" in header
    assert re.search(rf"^MEMO_MODEL={stem}$", header, re.MULTILINE)
    # The time-limit signal leaves one predicted iteration and a checkpoint save (10 minutes).
    signal_s = int(re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", header, re.MULTILINE).group(1))
    assert re.search(rf"^MEMO_SIGNAL_S={signal_s}$", header, re.MULTILINE)
    step_s = float(re.search(r"^- best row \(predicted\): .* step ([\d.]+) s,",
                             recommend.read_sections()[name], re.MULTILINE).group(1))
    assert signal_s >= step_s + 600, (name, signal_s, step_s)
    limit = _seconds(re.search(r"^#SBATCH --time=(\S+)$", header, re.MULTILINE).group(1))
    assert limit >= 3 * signal_s, (name, limit, signal_s)

    result = _dry_run(stem, tmp_path, SLURM_NNODES=str(nodes), SLURM_JOB_ID="4242", **fake_data)
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout)
    script = command.index(str(REPO_ROOT / "pretrain_gpt.py"))
    launcher = command[:script]
    assert launcher[0] == "srun" and "torchrun" in launcher
    launcher_text = " ".join(launcher)
    for expected in (f"--nnodes {nodes}", f"--nproc-per-node {GPUS_PER_NODE}",
                     "--rdzv-backend c10d", "--rdzv-id 4242", "--ntasks-per-node 1"):
        assert expected in launcher_text

    flags = command[script + 1:]
    line = recorded[name]
    assert any(flags[i:i + len(line)] == line for i in range(len(flags))), "flag line missing"
    args = parse_args(flags, world_size=nodes * GPUS_PER_NODE, cuda_available=True)
    run_dir = Path(fake_data["RUN_DIR"])
    assert args.save == args.load == str(run_dir / "checkpoints")
    assert args.exit_signal_handler and args.exit_signal == "SIGTERM"
    assert args.tensorboard_dir == str(run_dir / "tensorboard")
    assert args.data_path == [fake_data["DATA_PATH"]]
    assert args.tokenizer_type == "BPETokenizer"
    assert args.tokenizer_model == fake_data["TOKENIZER_MODEL"]


def test_dry_run_without_srun_prints_the_torchrun_command(tmp_path, fake_data):
    result = _dry_run("7b", tmp_path, MEMO_SRUN="0", NNODES="1", MASTER_ADDR="node001",
                      **fake_data)
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout)
    assert command[0] == "torchrun" and "srun" not in command
    assert " ".join(command[:command.index(str(REPO_ROOT / "pretrain_gpt.py"))]).endswith(
        "--rdzv-endpoint node001:20000 --rdzv-id 0")
    assert "--memo-offload" in command


def test_sbatch_without_data_path_fails_with_a_clear_message(tmp_path):
    result = _dry_run("7b", tmp_path, TOKENIZER_MODEL="tokenizer.json")
    assert result.returncode == 1
    assert "DATA_PATH is not set" in result.stderr


def test_sbatch_without_repository_root_fails_with_a_clear_message(tmp_path):
    result = _dry_run("7b", tmp_path, MEMO_ROOT=str(tmp_path))
    assert result.returncode == 1
    assert "submit from the repository root or export MEMO_ROOT" in result.stderr


FAKE_SRUN = """#!/bin/bash
trap 'echo terminated >> "$FAKE_LOG"; exit 0' TERM
echo started >> "$FAKE_LOG"
while true; do sleep 0.05; done
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ "$1" == show ]]; then echo node001; else echo "scontrol $*" >> "$FAKE_LOG"; fi
"""


def test_time_limit_signal_checkpoints_and_requeues(tmp_path, fake_data):
    """SIGUSR1 to the batch shell (--signal=B:USR1@900) -> SIGTERM to srun -> requeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "fake.log"
    env = _clean_env(MEMO_ROOT=str(REPO_ROOT), SLURM_JOB_ID="99", SLURM_NNODES="1",
                     SLURM_JOB_NODELIST="node001", FAKE_LOG=str(log),
                     PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **fake_data)
    batch = subprocess.Popen(["bash", str(SLURM / "pretrain_gpt_7b.sbatch")], env=env,
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 20
        while not (log.exists() and "started" in log.read_text()):
            assert batch.poll() is None, batch.communicate()
            assert time.monotonic() < deadline, "fake srun never started"
            time.sleep(0.05)
        batch.send_signal(signal.SIGUSR1)
        stdout, stderr = batch.communicate(timeout=20)
    finally:
        if batch.poll() is None:
            batch.kill()
    assert batch.returncode == 0, stderr
    assert log.read_text().split("\n") == ["started", "terminated", "scontrol requeue 99", ""]
    assert "requeueing job 99" in stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda path: path.name)
def test_shell_script_syntax(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_every_example_script_is_covered():
    names = {path.name for path in SHELL_SCRIPTS}
    assert {"cpu_quickstart.sh", "launch_common.sh", "gpt_common.sh",
            "continue_pretraining_llama.sh"} <= names
    configs = {f"gpt_{stem}.sh" for stem in STEMS.values()}
    sbatches = {f"pretrain_gpt_{stem}.sbatch" for stem in STEMS.values()}
    # every model of Table 2 has a config, and every config and sbatch script is a headline
    assert {f"gpt_{model}.sh" for model in TABLE_2} <= configs
    assert {name for name in names if re.fullmatch(r"gpt_(?!common).*\.sh", name)} == configs
    assert {name for name in names if name.endswith(".sbatch")} == sbatches


CONTINUE = EXAMPLES / "continue_pretraining_llama.sh"
# The narrowest recommender question (MEMO at alpha 0 alone, one variant per layout, one tracer
# process): the estimator's shortest real answer, still about 20 s of CPU from an empty cache.
NARROW_SEARCH = ("--policies memo --alphas 0 --checkpoint-fractions 0 --offload-buffers 2 "
                 "--mlp-tiles 0 --jobs 1")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A random Llama of 4 layers (MEMO keeps 2 per stage on the device and needs more) with
    a tokenizer folder, as a Hugging Face model directory."""
    from tests.hf_models import save_tiny_model, save_tiny_tokenizer

    return save_tiny_tokenizer(save_tiny_model(tmp_path_factory.mktemp("llama") / "hf", "llama",
                                               num_hidden_layers=4))


def _continue(tmp_path: Path, hf: Path, timeout: float = 60,
              **env: str) -> subprocess.CompletedProcess:
    """examples/continue_pretraining_llama.sh run in ``tmp_path`` (its RUN_DIR default is
    relative to it), the estimator narrowed and its trace cache there too."""
    search = f"{NARROW_SEARCH} --cache-dir {tmp_path / 'traces'}"
    return subprocess.run(
        ["bash", str(CONTINUE)], capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
        env=_clean_env(**{"HF_DIR": str(hf), "GPU": "h100", "PYTHON": sys.executable,
                          "ESTIMATE_ARGS": search, **env}))


def _continue_launch(stdout: str) -> tuple[list[str], list[str]]:
    """(launcher, pretrain_gpt.py flags) of the printed launch command (its last line)."""
    command = shlex.split(stdout.strip().splitlines()[-1])
    script = command.index(str(REPO_ROOT / "pretrain_gpt.py"))
    return command[:script], command[script + 1:]


def test_continue_pretraining_dry_run_prints_a_launch_the_trainer_accepts(
        tiny_llama, tmp_path, monkeypatch):
    """With the conversion done and the estimator's answer recorded (both real, made here;
    the script asking the estimator itself is the slow test below), the printed launch reads
    the converted model's flags, loads it, trains on its Hugging Face tokenizer with the answer's
    layout and --memo-* flags, and pretrain_gpt.py's argument validation accepts it."""
    from megatron.memo_tools.hf_checkpoint.convert import import_hf
    from memo_ext.estimate.layout import Layout

    checkpoint = tmp_path / "converted"
    import_hf(tiny_llama, checkpoint, log=lambda _: None)
    layout = Layout(tp=1, cp=2, pp=1, dp=1, policy="memo", alpha=0.0, checkpoint_layers=1)
    line = layout.trainer_flags(8192, 16)
    answer = tmp_path / "answer.json"
    answer.write_text(json.dumps({"gpus": 2, "seq_length": 8192,
                                  "rows": [{"trainer_flags": line}]}))
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{suffix}").touch()
    result = _continue(tmp_path, tiny_llama, CKPT_DIR="converted", RECOMMENDED=str(answer),
                       DATA_PATH="corpus_text_document", GPUS="2", SEQ="8192", MEMO_DRY_RUN="1")
    assert result.returncode == 0, result.stderr[-3000:]
    launcher, flags = _continue_launch(result.stdout)
    assert launcher == ["torchrun", "--standalone", "--nproc-per-node", "2"]
    assert any(flags[i:i + len(line)] == line for i in range(len(flags))), "flag line missing"
    assert flags[:3] == ["@converted/model_flags.txt", "--load", "converted"]

    monkeypatch.chdir(tmp_path)  # @FILE, --load and --data-path are the launch directory's
    args = parse_args(flags, world_size=2, cuda_available=True)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_query_groups,
            args.kv_channels, args.vocab_size) == (4, 64, 96, 2, 16, 1000)
    assert args.normalization == "RMSNorm" and args.swiglu and args.rotary_base == 10000
    assert args.tokenizer_type == "HuggingFaceTokenizer"
    assert args.tokenizer_model == str(checkpoint)
    assert args.context_parallel_size == 2 and args.seq_length == 8192
    assert args.memo_offload and str(args.memo_checkpoint_layers) == "1" and args.bf16
    assert args.save == str(Path("runs/continue_hf/checkpoints"))

    result = _continue(tmp_path, tiny_llama, CKPT_DIR="converted", RECOMMENDED=str(answer),
                       DATA_PATH="corpus_text_document", GPUS="4", MEMO_DRY_RUN="1")
    assert result.returncode == 1
    assert result.stderr.strip().endswith(f"error: {answer} answers --gpus 2 --seq-length 8192, "
                                          "not GPUS=4 SEQ=1048576; unset RECOMMENDED to ask "
                                          "the estimator")


def test_continue_pretraining_without_gpu_fails_with_a_clear_message(tiny_llama, tmp_path):
    result = _continue(tmp_path, tiny_llama, DATA_PATH="corpus_text_document", GPU="")
    assert result.returncode == 1
    assert result.stderr.strip() == ("continue_pretraining_llama.sh: error: GPU is not set; "
                                     "export GPU=h100 (a profile of memo_ext/hardware.json)")


@pytest.mark.slow
def test_continue_pretraining_trains_the_converted_llama_on_cpu(tiny_llama, tmp_path):
    """The example end to end on 2 CPU ranks: text tokenized with the model's tokenizer
    folder; a dry run converts and asks the estimator (its best 2-GPU row at 256 tokens); the
    run trains 3 iterations from the converted weights at that row (with its
    --use-distributed-optimizer; fp32, PRECISION=""), and saves; a second start resumes."""
    from tests.hf_models import TOKENIZER_TEXTS

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in TOKENIZER_TEXTS))
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "preprocess_data.py"),
                    "--input", str(corpus), "--output-prefix", str(tmp_path / "corpus"),
                    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                    str(tiny_llama), "--append-eod"], check=True, capture_output=True,
                   timeout=120)
    env = dict(DATA_PATH="corpus_text_document", GPUS="2", SEQ="256", PRECISION="",
               TRAIN_ITERS="3", SAVE_INTERVAL="3", EVAL_ITERS="0", SPLIT="100,0,0",
               TORCHRUN=str(Path(sys.executable).parent / "torchrun"), OMP_NUM_THREADS="1")
    result = _continue(tmp_path, tiny_llama, timeout=600, MEMO_DRY_RUN="1", **env)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "continue_hf"
    answer = json.loads((run_dir / "recommended.json").read_text())
    best = answer["rows"][0]
    print(f"recommended: {best['layout']}")
    assert "--memo-offload" in best["trainer_flags"]
    assert _continue_launch(result.stdout)[1][5:5 + len(best["trainer_flags"])] \
        == best["trainer_flags"]
    assert "--use-distributed-optimizer" in best["trainer_flags"]  # trained as it is on CPU
    (tmp_path / "cpu_answer.json").write_text(json.dumps(answer))

    env["RECOMMENDED"] = str(tmp_path / "cpu_answer.json")
    result = _continue(tmp_path, tiny_llama, timeout=600, **env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "holds weights only" in result.stdout
    losses = plot_loss.read_loss_curves(run_dir / "metrics.jsonl").train
    assert [iteration for iteration, _ in losses] == [1, 2, 3]
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "3"
    again = _continue(tmp_path, tiny_llama, MEMO_DRY_RUN="1", **env)
    assert _continue_launch(again.stdout)[1][1:3] == ["--load", "runs/continue_hf/checkpoints"]


def _write_metrics(path: Path, losses: dict[int, float], validation: dict[int, float]) -> Path:
    records = [{"iteration": it, "lm_loss": loss, "lr": 1e-3, "tokens_per_s": 1000.0}
               for it, loss in losses.items()]
    records += [{"iteration": it, "validation_lm_loss": loss} for it, loss in validation.items()]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_plot_loss_writes_png(tmp_path):
    first = _write_metrics(tmp_path / "a.jsonl", {10: 8.3, 20: 6.5, 30: 5.2}, {20: 6.4, 30: 5.3})
    second = _write_metrics(tmp_path / "b.jsonl", {10: 8.1, 20: 7.0}, {})
    output = tmp_path / "plots" / "loss.png"
    assert plot_loss.main([str(first), str(second), "-o", str(output), "--labels", "a", "b"]) == 0
    data = output.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_plot_loss_reads_train_and_validation_points(tmp_path):
    path = _write_metrics(tmp_path / "m.jsonl", {10: 8.0, 20: 6.0}, {20: 6.5})
    with path.open("a") as handle:
        handle.write("not json\n")
    curves = plot_loss.read_loss_curves(path)
    assert curves.train == [(10, 8.0), (20, 6.0)]
    assert curves.validation == [(20, 6.5)]


@pytest.mark.parametrize("content", [None, "", "{\"iteration\": 1, \"lr\": 0.1}\n"],
                         ids=["missing", "empty", "no-loss"])
def test_plot_loss_bad_file_exits_2(tmp_path, content):
    path = tmp_path / "metrics.jsonl"
    if content is not None:
        path.write_text(content)
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "plot_loss.py"), str(path), "-o",
         str(tmp_path / "out.png")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and str(path) in result.stderr
    assert not (tmp_path / "out.png").exists()


def test_plot_loss_label_count_must_match(tmp_path):
    path = _write_metrics(tmp_path / "m.jsonl", {10: 8.0}, {})
    with pytest.raises(SystemExit) as excinfo:
        plot_loss.main([str(path), "-o", str(tmp_path / "x.png"), "--labels", "a", "b"])
    assert excinfo.value.code == 2


@pytest.mark.slow
def test_cpu_quickstart_runs_and_checks_itself(tmp_path):
    """`make demo` end to end, shortened to 20 iterations (about a minute on 2 cores)."""
    run_dir = tmp_path / "demo"
    result = subprocess.run(
        ["bash", str(EXAMPLES / "cpu_quickstart.sh")], cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=600, env=_clean_env(DEMO_TRAIN_ITERS="20", DEMO_RUN_DIR=str(run_dir)),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"loss curve: {run_dir}/loss.png" in result.stdout
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert len(plot_loss.read_loss_curves(run_dir / "metrics.jsonl").train) == 2
