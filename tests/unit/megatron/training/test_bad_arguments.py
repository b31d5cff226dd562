"""Must-show 5 of the trainer issue: each wrong flag combination exits non-zero before the
model is built (before megatron.core is even imported), with one line on stderr that names the
flag at fault and says what to do."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron.training.arguments import ArgumentValidationError, parse_args
from tests.conftest import REPO_ROOT, subprocess_env

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10",
        "--mock-data", "--vocab-size", "512"]


def without(args: list[str], flag: str, takes_value: bool = True) -> list[str]:
    index = args.index(flag)
    return args[:index] + args[index + (2 if takes_value else 1):]


# (case id, world size, argv, flag the error must name)
BAD_INPUTS = [
    ("heads_not_divisible_by_tp", 4,
     BASE + ["--num-attention-heads", "6", "--hidden-size", "60", "--tensor-model-parallel-size", "4"],
     "--num-attention-heads"),
    ("seq_not_divisible_by_2cp", 2, BASE + ["--seq-length", "66", "--context-parallel-size", "2"],
     "--seq-length"),
    ("global_batch_not_divisible", 2, BASE + ["--global-batch-size", "6"], "--global-batch-size"),
    ("missing_data_path_file", 1,
     without(BASE, "--mock-data", False) + ["--data-path", "/nonexistent/corpus_text_document",
                                            "--tokenizer-type", "BytesTokenizer"],
     "--data-path"),
    ("unknown_tokenizer", 1, BASE + ["--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-type"),
    ("cp_with_non_causal_mask", 2,
     BASE + ["--context-parallel-size", "2", "--attn-mask-type", "no_mask"], "--attn-mask-type"),
    ("world_not_divisible_by_model_parallel", 3, BASE + ["--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size"),
    ("layers_not_divisible_by_pp", 2,
     BASE + ["--num-layers", "3", "--pipeline-model-parallel-size", "2"], "--num-layers"),
    ("hidden_not_divisible_by_heads", 1, BASE + ["--hidden-size", "66"], "--hidden-size"),
    ("query_groups_not_dividing_heads", 1,
     BASE + ["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups"),
    ("fp16_and_bf16", 1, BASE + ["--fp16", "--bf16"], "--fp16"),
    ("bf16_on_cpu", 1, BASE + ["--bf16"], "--bf16"),
    ("distributed_optimizer_with_sgd", 1,
     BASE + ["--use-distributed-optimizer", "--optimizer", "sgd"], "--use-distributed-optimizer"),
    ("no_training_data", 1, without(BASE, "--mock-data", False), "--data-path"),
    ("bpe_without_model_file", 1,
     without(BASE, "--mock-data", False) + ["--data-path", "x", "--tokenizer-type", "BPETokenizer"],
     "--tokenizer-model"),
    ("save_interval_without_save", 1, BASE + ["--save-interval", "5"], "--save-interval"),
    ("min_lr_above_lr", 1, BASE + ["--min-lr", "0.1"], "--min-lr"),
    ("positions_shorter_than_sequence", 1, BASE + ["--max-position-embeddings", "32"],
     "--max-position-embeddings"),
    ("full_recompute_without_method", 1, BASE + ["--recompute-granularity", "full"],
     "--recompute-granularity"),
    ("missing_lr", 1, without(BASE, "--lr"), "--lr"),
    ("signal_handler_without_save", 1, BASE + ["--exit-signal-handler"], "--exit-signal-handler"),
    ("sequence_parallel_seq_not_divisible", 4,
     BASE + ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--seq-length", "66"],
     "--seq-length"),
    ("malformed_split", 1, BASE + ["--split", "90,x,5"], "--split"),
    ("nccl_on_cpu", 1, BASE + ["--distributed-backend", "nccl"], "--distributed-backend"),
    ("memo_alpha_not_a_number", 1, BASE + ["--memo-offload", "--memo-alpha", "abc"], "--memo-alpha"),
    ("memo_alpha_above_one", 1, BASE + ["--memo-offload", "--memo-alpha", "1.5"], "--memo-alpha"),
    ("memo_alpha_negative", 1, BASE + ["--memo-offload", "--memo-alpha", "-0.1"], "--memo-alpha"),
    ("memo_alpha_without_offload", 1, BASE + ["--memo-alpha", "0.5"], "--memo-alpha"),
    ("memo_host_memory_not_positive", 1,
     BASE + ["--memo-offload", "--memo-host-memory-gb", "0"], "--memo-host-memory-gb"),
    ("memo_with_megatron_recompute", 1,
     BASE + ["--memo-offload", "--recompute-granularity", "selective"], "--memo-offload"),
    ("memo_two_layers_per_stage", 2,
     BASE + ["--memo-offload", "--pipeline-model-parallel-size", "2"], "--memo-offload"),
    ("sppo_with_memo_offload", 1, BASE + ["--memo-sppo", "--memo-offload"], "--memo-offload"),
    ("sppo_with_context_parallel", 2,
     BASE + ["--memo-sppo", "--context-parallel-size", "2"], "--context-parallel-size"),
    ("sppo_with_attention_dropout", 1, BASE + ["--memo-sppo"], "--attention-dropout"),
    ("transformer_engine_on_cpu", 1, BASE + ["--transformer-impl", "transformer_engine"],
     "--transformer-impl transformer_engine needs CUDA"),
    ("sppo_too_many_subsequences", 1,
     BASE + ["--memo-sppo", "--attention-dropout", "0", "--memo-sppo-subsequences", "65"],
     "--memo-sppo-subsequences"),
    ("sppo_flag_without_sppo", 1, BASE + ["--memo-sppo-offload", "auto"], "--memo-sppo"),
    ("sppo_msp_without_pipeline", 1,
     BASE + ["--memo-sppo", "--attention-dropout", "0", "--hidden-dropout", "0",
             "--memo-sppo-msp"], "--memo-sppo-msp"),
    ("sppo_msp_with_tensor_parallel_without_sp", 4,
     BASE + ["--memo-sppo", "--attention-dropout", "0", "--hidden-dropout", "0",
             "--memo-sppo-msp", "--pipeline-model-parallel-size", "2",
             "--tensor-model-parallel-size", "2"], "--sequence-parallel"),
    ("sppo_msp_with_hidden_dropout", 2,
     BASE + ["--memo-sppo", "--attention-dropout", "0", "--memo-sppo-msp",
             "--pipeline-model-parallel-size", "2"], "--hidden-dropout"),
    ("memo_plan_missing_file", 1, BASE + ["--memo-plan", "/nonexistent/plan.json"],
     "--memo-plan"),
    ("mlp_tile_not_split_by_sequence_parallel", 2,
     BASE + ["--memo-mlp-tile-size", "7", "--tensor-model-parallel-size", "2",
             "--sequence-parallel"], "--memo-mlp-tile-size"),
    ("projection_tile_not_split_by_sequence_parallel", 2,
     BASE + ["--memo-attention-projection-tile-size", "7", "--tensor-model-parallel-size", "2",
             "--sequence-parallel"], "--memo-attention-projection-tile-size"),
    ("head_chunks_not_dividing_the_groups", 1,
     BASE + ["--memo-attention-head-chunks", "3"], "--memo-attention-head-chunks"),
]


def test_layernorm_recompute_without_transformer_engine_is_one_line(monkeypatch):
    """Megatron-LM's --recompute-modules layernorm: megatron-core 0.16.1 runs it through
    Transformer Engine even without fp8 (a NameError mid-forward without it), so without TE it
    is refused before anything is built; with TE it passes."""
    from megatron.training import arguments

    argv = BASE + ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"]
    monkeypatch.setattr(arguments, "transformer_engine_installed", lambda: False)
    with pytest.raises(ArgumentValidationError, match=r"^--recompute-modules layernorm needs "
                                                      r"Transformer Engine installed"):
        parse_args(argv, world_size=1, cuda_available=False)
    monkeypatch.setattr(arguments, "transformer_engine_installed", lambda: True)
    assert parse_args(argv, world_size=1, cuda_available=False).recompute_modules == ["layernorm"]


def test_memo_plan_with_telemetry_is_accepted_on_cuda():
    """Telemetry reads the arena's counters through memo_ext.device_memory
    (tests/unit/memo_ext/test_gpu_readiness.py), not PyTorch's statistics, which raise under it."""
    parse_args(BASE + ["--memo-plan", "auto", "--memo-telemetry"], world_size=1,
               cuda_available=True)


@pytest.mark.parametrize("case,world_size,argv,flag", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_validation_names_the_flag(case, world_size, argv, flag):
    with pytest.raises(ArgumentValidationError) as error:
        parse_args(argv, world_size=world_size, cuda_available=False)
    assert flag in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("case,world_size,argv,flag", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_trainer_entry_point_exits_2_with_one_line(case, world_size, argv, flag, monkeypatch,
                                                    capsys):
    """Every case through pretrain_gpt.main under run_main, as ``python pretrain_gpt.py`` runs
    it, in this process: exit status 2, one line on stderr, nothing on stdout. The world size
    comes from $WORLD_SIZE, as under torchrun."""
    import pretrain_gpt
    from megatron.training.arguments import run_main

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exited:
        run_main(pretrain_gpt.main, argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and flag in lines[0]
    assert out == ""  # nothing was built: the model summary line never printed


#: The cases also run as ``python pretrain_gpt.py`` in a process of their own in the default
#: suite (about 5 s each on 2 cores; every case does with -m slow). Every case leaves through
#: the same path (parse_args raises, run_main prints one line and exits 2, checked above for
#: all); these add what only a fresh process shows (its exit status, and that nothing else
#: reaches stderr): the world size from $WORLD_SIZE, the one case whose validation imports
#: megatron.core (whose import-time warnings must stay off stderr), and the CUDA check.
IN_A_PROCESS = {"heads_not_divisible_by_tp", "missing_data_path_file", "transformer_engine_on_cpu"}


@pytest.mark.parametrize("case,world_size,argv,flag", [
    pytest.param(*c, marks=() if c[0] in IN_A_PROCESS else pytest.mark.slow, id=c[0])
    for c in BAD_INPUTS])
def test_pretrain_gpt_exits_with_one_line(case, world_size, argv, flag):
    env = subprocess_env()
    env["WORLD_SIZE"] = str(world_size)
    result = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *argv],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and flag in lines[0]
    assert result.stdout == ""  # nothing was built: the model summary line never printed


def test_host_memory_too_small_for_memo_refuses_to_start():
    """Known only once the layout is (the per-rank activation shape): refused after process
    setup, still before the model is built and with the same one-line error."""
    env = subprocess_env()
    env["WORLD_SIZE"] = "1"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *BASE, "--memo-offload",
         "--memo-host-memory-gb", "0.000001", "--memo-pcie-gbps", "10"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--memo-host-memory-gb" in lines[0] and "GB short" in lines[0]


def test_split_without_documents_is_refused(tmp_path):
    """megatron.core's GPTDataset would loop forever on a split without documents."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "document number {i}"}}\n' for i in range(5)))
    env = subprocess_env()
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "preprocess_data.py"), "--input",
                    str(corpus), "--output-prefix", str(tmp_path / "c"), "--tokenizer-type",
                    "BytesTokenizer", "--append-eod"], check=True, env=env, capture_output=True)
    env["WORLD_SIZE"] = "1"
    argv = without(BASE, "--mock-data", False) + [
        "--data-path", str(tmp_path / "c_text_document"), "--tokenizer-type", "BytesTokenizer",
        "--split", "99,1,0", "--eval-iters", "1", "--eval-interval", "5"]
    result = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *argv],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--split" in lines[0] and "validation" in lines[0]


def test_valid_command_line_fills_derived_values():
    args = parse_args(BASE + ["--swiglu", "--tensor-model-parallel-size", "2",
                              "--global-batch-size", "8"], world_size=4, cuda_available=False)
    assert args.data_parallel_size == 2
    assert args.num_microbatches == 2
    assert args.ffn_hidden_size == 128  # 8/3 * 64 rounded down to a multiple of 64
    assert args.kv_channels == 16
    assert args.num_query_groups == 4
    assert args.distributed_backend == "gloo"
    assert args.tokenizer_type == "NullTokenizer"


def test_sequence_parallel_without_tp_is_dropped_like_megatron():
    args = parse_args(BASE + ["--sequence-parallel"], world_size=1, cuda_available=False)
    assert args.sequence_parallel is False
