"""Issue 45: the registry of Megatron-LM flags (megatron.training.upstream_flags) against the
parser and the reference scripts. Every reference flag has one entry and is recognized; every
refused flag stops validation with exactly its registry line; what an honoured flag still
refuses is one line naming it; the always-so flags change nothing; docs/megatron_flags.md is
what the registry renders. In-process parsing only (fast)."""

from __future__ import annotations

import pytest

from megatron.training.arguments import ArgumentValidationError, build_parser, parse_args
from megatron.training.upstream_flags import (
    ALWAYS,
    EXTRA_FLAGS,
    HONOURED,
    REFUSED,
    SCRIPT_FLAGS,
    UPSTREAM_FLAGS,
    refusal,
    registry,
)
from megatron.training.upstream_scripts import REFERENCE_SCRIPTS, reference_flags

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "10",
        "--mock-data", "--vocab-size", "512"]


def _refusal_of(argv: list[str], world_size: int = 1, cuda_available: bool = False) -> str:
    with pytest.raises(ArgumentValidationError) as raised:
        parse_args(argv, world_size=world_size, cuda_available=cuda_available)
    return str(raised.value)


def test_every_reference_flag_has_one_entry_in_script_order():
    assert [entry.flag for entry in SCRIPT_FLAGS] == reference_flags()
    flags = [entry.flag for entry in UPSTREAM_FLAGS]
    assert len(flags) == len(set(flags)), "a flag listed twice"
    assert {entry.status for entry in UPSTREAM_FLAGS} <= {HONOURED, ALWAYS, REFUSED}
    for entry in UPSTREAM_FLAGS:
        assert entry.here and "\n" not in entry.here
        assert (entry.argparse is not None) == (entry.status in (ALWAYS, REFUSED)), entry.flag


def test_no_flag_of_any_reference_script_variant_is_unrecognized():
    known = set(build_parser()._option_string_actions)
    assert [flag for flag in registry() if flag not in known] == []
    for script in REFERENCE_SCRIPTS:
        for variant in script.variants:
            _, unknown = build_parser().parse_known_args(variant.argv)
            assert unknown == [], (script.path, variant.name, unknown)


@pytest.mark.parametrize("flag", [entry.flag for entry in UPSTREAM_FLAGS
                                  if entry.status == REFUSED])
def test_a_refused_flag_stops_with_its_registry_line(flag):
    takes_values = registry()[flag].argparse["nargs"]
    argv = BASE + [flag] + (["x"] if takes_values else [])
    assert _refusal_of(argv) == refusal(flag)
    assert refusal(flag).startswith(f"{flag}: ") and "\n" not in refusal(flag)


def test_the_first_refused_flag_of_the_command_line_is_named():
    argv = BASE + ["--use-nccl-ub", "--fp8-format", "hybrid", "--use-megatron-fsdp"]
    assert _refusal_of(argv) == refusal("--use-nccl-ub")
    # before any other rule: a refused flag is named even when other flags are wrong too
    assert _refusal_of(argv + ["--fp16", "--bf16"]) == refusal("--use-nccl-ub")


#: What each honoured flag with a "refuses" entry still refuses: (argv, cuda_available).
STILL_REFUSED = {
    "--attention-backend": (["--attention-backend", "local"], False),
    "--fp16": (["--fp16"], False),
    "--bf16": (["--bf16"], False),
    "--grad-reduce-in-bf16": (["--grad-reduce-in-bf16"], True),
    "--calculate-per-token-loss": (["--calculate-per-token-loss", "--memo-sppo",
                                    "--attention-dropout", "0"], False),
    "--overlap-param-gather": (["--overlap-param-gather", "--overlap-grad-reduce"], False),
    "--tokenizer-type": (["--tokenizer-type", "SentencePieceTokenizer"], False),
    "--profile": (["--profile"], False),
    "--profile-step-start": (["--profile-step-start", "3"], False),
    "--profile-step-end": (["--profile-step-end", "3"], False),
    "--profile-ranks": (["--profile-ranks", "0"], False),
    "--ckpt-format": (["--ckpt-format", "fsdp_dtensor"], False),  # without Megatron-FSDP
    "--use-megatron-fsdp": (["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                             "optim", "--ckpt-format", "fsdp_dtensor"], False),  # plain optim.
    "--data-parallel-sharding-strategy": (["--data-parallel-sharding-strategy", "optim"],
                                          False),
    "--fsdp-double-buffer": (["--fsdp-double-buffer"], False),
    "--suggested-communication-unit-size": (["--suggested-communication-unit-size", "1000"],
                                            False),
    "--train-samples": (["--train-samples", "40"], False),  # with BASE's --train-iters
    "--lr-decay-samples": (["--lr-decay-samples", "5"], False),
    "--lr-warmup-samples": (["--lr-warmup-samples", "5"], False),
    "--decoupled-min-lr": (["--decoupled-min-lr", "1e-5"], False),
    "--timing-log-option": (["--timing-log-option", "max"], False),
    "--log-timers-to-tensorboard": (["--log-timers-to-tensorboard"], False),
    "--manual-gc-interval": (["--manual-gc-interval", "5"], False),
    "--no-manual-gc-eval": (["--no-manual-gc-eval"], False),
    "--wandb-project": (["--wandb-project", "p"], False),  # neither --save nor a save dir
    "--wandb-exp-name": (["--wandb-exp-name", "run"], False),
    "--wandb-save-dir": (["--wandb-save-dir", "wb"], False),
    "--wandb-entity": (["--wandb-entity", "team"], False),
}


def test_every_partial_refusal_has_a_case():
    partial = {entry.flag for entry in UPSTREAM_FLAGS if entry.refuses}
    assert partial == set(STILL_REFUSED)


@pytest.mark.parametrize("flag", sorted(STILL_REFUSED))
def test_what_an_honoured_flag_refuses_is_one_line_naming_it(flag):
    extra, cuda_available = STILL_REFUSED[flag]
    message = _refusal_of(BASE + extra, cuda_available=cuda_available)
    assert message.startswith(flag) and "\n" not in message, message


@pytest.mark.parametrize("value", ["torch", "torch_dcp", "fsdp_dtensor"])
def test_every_other_checkpoint_format_is_refused(value):
    """fsdp_dtensor without --use-megatron-fsdp (tests/unit/megatron/training/
    test_megatron_fsdp_cpu.py accepts it with)."""
    assert registry()["--ckpt-format"].refused_values == ("torch", "torch_dcp")
    assert _refusal_of(BASE + ["--ckpt-format", value]).startswith(f"--ckpt-format {value} ")
    assert parse_args(BASE + ["--ckpt-format", "torch_dist"], world_size=1,
                      cuda_available=False).ckpt_format == "torch_dist"


def test_always_so_flags_change_nothing_else():
    always = [entry for entry in UPSTREAM_FLAGS if entry.status == ALWAYS]
    argv = list(BASE)
    for entry in always:
        argv += [entry.flag] + (["v2"] if entry.argparse.get("choices") else [])
    plain = vars(parse_args(BASE, world_size=1, cuda_available=False))
    flagged = vars(parse_args(argv, world_size=1, cuda_available=False))
    own = {"deprecated_use_mcore_models", "use_mcore_models", "tiktoken_pattern",
           "create_attention_mask_in_dataloader", "check_for_nan_in_loss_and_grad",
           "gradient_accumulation_fusion", "use_flash_attn", "log_throughput"}
    assert {key for key in flagged if flagged[key] != plain.get(key)} <= own


def test_legacy_rope_spelling_and_quoted_split():
    args = parse_args(BASE + ["--use-rotary-position-embeddings", "--split", "'99,1,0'"],
                      world_size=1, cuda_available=False)
    assert args.position_embedding_type == "rope"
    assert args.split == "99,1,0"
    assert "--split" in _refusal_of(BASE + ["--split", "'99,x,0'"])


def test_bf16_accumulates_gradients_in_fp32_unless_grad_reduce_in_bf16():
    bf16 = parse_args(BASE + ["--bf16"], world_size=1, cuda_available=True)
    assert bf16.accumulate_allreduce_grads_in_fp32  # Megatron-LM's default under --bf16
    in_bf16 = parse_args(BASE + ["--bf16", "--grad-reduce-in-bf16"], world_size=1,
                         cuda_available=True)
    assert not in_bf16.accumulate_allreduce_grads_in_fp32
    assert "exclusive" in _refusal_of(
        BASE + ["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"],
        cuda_available=True)


def test_sample_based_training_is_iteration_based_training_in_samples():
    """--train-samples N: N // global-batch iterations; the schedule's steps (samples) equal
    those of the same run in iterations (Megatron-LM's update_train_iters and scheduler)."""
    from megatron.training.training import schedule_steps

    batch = ["--global-batch-size", "4", "--micro-batch-size", "2"]
    base = [flag for flag in BASE if flag not in ("--train-iters", "10")]
    iters = parse_args(base + batch + ["--train-iters", "10", "--lr-decay-iters", "8",
                                       "--lr-warmup-iters", "2"], world_size=1,
                       cuda_available=False)
    samples = parse_args(base + batch + ["--train-samples", "43", "--lr-decay-samples", "32",
                                         "--lr-warmup-samples", "8"], world_size=1,
                         cuda_available=False)
    assert samples.train_iters == iters.train_iters == 10
    assert schedule_steps(samples)["warmup"] == schedule_steps(iters)["warmup"] == 8
    assert schedule_steps(samples)["decay"] == schedule_steps(iters)["decay"] == 32
    assert schedule_steps(samples)["wd_incr"] == 43  # Megatron-LM: the samples asked for
    fraction = parse_args(base + batch + ["--train-samples", "40", "--lr-warmup-fraction",
                                          "0.25"], world_size=1, cuda_available=False)
    assert schedule_steps(fraction)["decay"] == 40 and schedule_steps(fraction)["warmup"] == 10
    assert _refusal_of(BASE + ["--train-samples", "40"]).startswith(
        "--train-samples and --train-iters are exclusive")
    assert "--lr-decay-iters" in _refusal_of(base + ["--train-samples", "40",
                                                     "--lr-decay-iters", "5"])
    assert "--lr-decay-samples" in _refusal_of(BASE + ["--lr-decay-samples", "5"])
    assert "--train-samples 1 " in _refusal_of(base + batch + ["--train-samples", "1"])


def test_gpt2_files_imply_gpt2bpe_and_must_exist(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    base = [flag for flag in BASE if flag != "--mock-data"]
    assert "--vocab-file" in _refusal_of(base + ["--data-path", "x", "--vocab-file", str(vocab),
                                                 "--merge-file", str(merges)])
    vocab.write_text("{}")
    merges.write_text("")
    args = build_parser().parse_args(base + ["--data-path", "x", "--vocab-file", str(vocab),
                                             "--merge-file", str(merges)])
    with pytest.raises(ArgumentValidationError, match="--data-path"):  # files checked after
        from megatron.training.arguments import validate_args

        validate_args(args, world_size=1, cuda_available=False)
    assert args.tokenizer_type == "GPT2BPETokenizer"


def test_values_out_of_range_are_refused():
    for extra, named in ((["--exit-duration-in-mins", "0"], "--exit-duration-in-mins"),
                         (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval"),
                         (["--logging-level", "-5"], "--logging-level")):
        assert _refusal_of(BASE + extra).startswith(named)


def test_the_flag_table_is_generated_from_the_registry():
    from megatron.training.upstream_flags_doc import DOC_PATH, render

    text = render()
    assert DOC_PATH.read_text(encoding="utf-8") == text, (
        "docs/megatron_flags.md is stale: run python -m megatron.training.upstream_flags_doc")
    for entry in UPSTREAM_FLAGS:
        assert f"| `{entry.flag}` | {entry.status} |" in text
    assert len(SCRIPT_FLAGS) == 96 and len(EXTRA_FLAGS) == 12
