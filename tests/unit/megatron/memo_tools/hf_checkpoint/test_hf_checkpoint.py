"""Hugging Face <-> trainer checkpoint conversion (docs/hf_checkpoint.md), with transformers as
the oracle, in one process (TP = PP = 1; the layouts are in
tests/distributed/test_hf_checkpoint_layouts.py):

- config.json -> the trainer's flag line, for real configs and for every RoPE rule;
- logits of our model loaded from a converted tiny random model equal transformers' to 1e-5
  relative (Llama with GQA and Llama 3.1 scaling, Mistral with MHA and tied embeddings, Qwen2
  with query/key/value bias and one key/value head in bf16, YaRN, linear);
- HF -> ours -> HF gives the same tensors bit for bit and the same config.json;
- a model trained 10 iterations with a longer RoPE base, exported, gives transformers our
  logits;
- vocabulary padding both ways, the architecture check on --load, bad input (one line naming the
  file or flag), no pickle ever opened, no half-written output."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron.training.arguments import ArgumentValidationError
from megatron.memo_tools.hf_checkpoint.errors import ConversionError
from megatron.memo_tools.hf_checkpoint.hf_config import trainer_flags
from tests.conftest import REPO_ROOT, subprocess_env
from tests.hf_models import (
    hf_logits,
    model_flags,
    our_logits,
    relative_error,
    save_tiny_model,
    tokens,
)

TOLERANCE = 1e-5
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# case -> (family, dtype, config overrides)
CASES = {
    "llama_gqa_untied_llama3": ("llama", torch.float32, dict(
        tie_word_embeddings=False, max_position_embeddings=16384, rope_parameters=LLAMA3)),
    "mistral_mha_tied": ("mistral", torch.float32, dict(
        num_key_value_heads=4, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2_bias_one_group_tied_bf16": ("qwen2", torch.bfloat16, dict(
        num_key_value_heads=1, tie_word_embeddings=True)),
    "llama_yarn": ("llama", torch.float32, dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama_linear": ("llama", torch.float32, dict(rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
}


def quiet(_message: str) -> None:
    pass


@pytest.fixture(scope="module")
def megatron_world():
    from megatron.memo_tools.hf_checkpoint.trainer_model import trainer_args, world_of_one

    with world_of_one(trainer_args(["--num-layers", "1", "--hidden-size", "64",
                                    "--num-attention-heads", "4", "--vocab-size", "1000"])):
        yield


@pytest.fixture(scope="module")
def converted(tmp_path_factory, megatron_world):
    """case -> (Hugging Face directory, converted checkpoint), made once per module."""
    from megatron.memo_tools.hf_checkpoint.convert import import_hf

    made = {}

    def get(case: str):
        if case not in made:
            family, dtype, overrides = CASES[case]
            root = tmp_path_factory.mktemp(case)
            hf = save_tiny_model(root / "hf", family, dtype, **overrides)
            import_hf(hf, root / "checkpoint", log=quiet)
            made[case] = hf, root / "checkpoint"
        return made[case]

    return get


def assert_same_tensors(directory, reference_directory) -> None:
    ours, reference = load_hf_tensors(directory), load_hf_tensors(reference_directory)
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


def load_hf_tensors(directory) -> dict:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


# -- config.json -> flags -------------------------------------------------------------------

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192,
                                            "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 128256}
QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 131072,
    "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 152064}
MISTRAL_7B_V0_1 = {
    "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000}


def test_llama_3_1_config_gives_the_flag_line():
    from megatron.memo_tools.hf_checkpoint.trainer_model import trainer_args

    flags = trainer_flags(LLAMA_3_1_8B, "config.json")
    assert " ".join(flags) == (
        "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --kv-channels 128 --normalization RMSNorm "
        "--norm-epsilon 1e-05 --swiglu --disable-bias-linear "
        "--untie-embeddings-and-output-weights --position-embedding-type rope "
        "--rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8.0 "
        "--max-position-embeddings 131072 --attention-dropout 0.0 --hidden-dropout 0.0 "
        "--vocab-size 128256 --make-vocab-size-divisible-by 128")
    args = trainer_args(flags)
    assert (args.num_query_groups, args.kv_channels, args.norm_epsilon) == (8, 128, 1e-5)
    assert args.use_rope_scaling and args.rope_scaling_factor == 8.0
    assert not args.add_bias_linear and not args.add_qkv_bias


def test_qwen2_5_config_gives_qkv_bias_and_its_rope_base():
    from megatron.memo_tools.hf_checkpoint.trainer_model import trainer_args

    args = trainer_args(trainer_flags(QWEN2_5_7B, "config.json"))
    assert args.add_qkv_bias and not args.add_bias_linear
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (28, 3584, 18944)
    assert (args.num_attention_heads, args.num_query_groups, args.kv_channels) == (28, 4, 128)
    assert (args.rotary_base, args.position_embedding_type) == (1000000, "rope")
    assert args.untie_embeddings_and_output_weights and args.vocab_size == 152064


def test_sliding_window_is_refused_unless_ignored():
    with pytest.raises(ConversionError, match="sliding_window 4096.*--ignore-sliding-window"):
        trainer_flags(MISTRAL_7B_V0_1, "config.json")
    flags = trainer_flags(MISTRAL_7B_V0_1, "config.json", ignore_sliding_window=True)
    assert "--max-position-embeddings" in flags and "--add-qkv-bias" not in flags


@pytest.mark.parametrize("rope,expected", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}},
     "--position-embedding-type rope --rotary-base 500000 "
     "--rotary-seq-len-interpolation-factor 2.0"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6,
                          "original_max_position_embeddings": 4096}},  # factor: 131072 / 4096
     "--position-embedding-type yarn --rotary-base 1000000 --rotary-scaling-factor 32.0 "
     "--yarn-original-max-position-embeddings 4096"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 32768, "beta_fast": 16,
                       "mscale": 0.8, "mscale_all_dim": 0.4, "truncate": False}},
     "--position-embedding-type yarn --rotary-base 500000 --rotary-scaling-factor 4.0 "
     "--yarn-original-max-position-embeddings 32768 --yarn-beta-fast 16.0 --mscale 0.8 "
     "--mscale-all-dim 0.4 --no-yarn-correction-range-round-to-int"),
], ids=["old_style_linear", "yarn_factor_from_lengths", "yarn_all_parameters"])
def test_rope_settings_map_to_the_rope_scaling_flags(rope, expected):
    from megatron.memo_tools.hf_checkpoint.trainer_model import trainer_args

    config = {key: value for key, value in LLAMA_3_1_8B.items() if key != "rope_scaling"}
    config.update(rope)
    flags = trainer_flags(config, "config.json")
    start = flags.index("--position-embedding-type")
    assert " ".join(flags[start:flags.index("--max-position-embeddings")]) == expected
    trainer_args(flags)  # the trainer accepts them


# -- logits and round trip ------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(converted, case):
    hf, checkpoint = converted(case)
    ids = tokens()
    ours, reference = our_logits(checkpoint, ids), hf_logits(hf, ids)
    error = relative_error(ours, reference)
    print(f"{case}: max relative logit error {error:.3g}")
    assert error <= TOLERANCE
    assert ours.shape[-1] == 1024 and torch.all(ours[..., 1000:] == 0)  # zero padding rows


@pytest.mark.parametrize("case", list(CASES))
def test_export_round_trip_is_bit_identical(converted, case, tmp_path):
    from megatron.memo_tools.hf_checkpoint.convert import export_hf

    hf, checkpoint = converted(case)
    export_hf(checkpoint, tmp_path / "hf", log=quiet)  # config.json: the one it carries
    assert_same_tensors(tmp_path / "hf", hf)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == \
        json.loads((hf / "config.json").read_text())


def test_sharded_safetensors_read_and_written(megatron_world, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron.memo_tools.hf_checkpoint.convert import export_hf, import_hf

    hf = save_tiny_model(tmp_path / "hf", "llama")
    AutoModelForCausalLM.from_pretrained(hf).save_pretrained(tmp_path / "sharded",
                                                             max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    import_hf(tmp_path / "sharded", tmp_path / "checkpoint", log=quiet)
    export_hf(tmp_path / "checkpoint", tmp_path / "out", hf_dir=hf, max_shard_bytes=200_000,
              log=quiet)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_same_tensors(tmp_path / "out", hf)
    assert (tmp_path / "out" / "generation_config.json").is_file()  # copied from --hf-dir
    ids = tokens()
    assert torch.equal(hf_logits(tmp_path / "out", ids), hf_logits(hf, ids))


def test_trained_then_exported_model_gives_transformers_our_logits(converted, tmp_path):
    """Continued pretraining as the trainer runs it: --load the converted checkpoint with a
    larger --rotary-base and --max-position-embeddings, 10 iterations, save; the export's
    config.json has the new RoPE and transformers computes our logits."""
    from megatron.core.distributed import finalize_model_grads

    from megatron.training import checkpointing
    from megatron.training import gpt
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.data import build_data_iterator, build_datasets
    from megatron.memo_tools.hf_checkpoint.convert import export_hf
    from megatron.memo_tools.hf_checkpoint.trainer_model import trainer_args
    from megatron.training.tokenizer import build_tokenizer, padded_vocab_size
    from megatron.training.training import build_model, build_optimizer, train_step

    hf, checkpoint = converted("llama_gqa_untied_llama3")
    args = trainer_args(model_flags(checkpoint) + [
        "--load", str(checkpoint), "--save", str(tmp_path / "trained"), "--rotary-base",
        "2000000", "--max-position-embeddings", "32768", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--eval-iters", "0"])
    args.padded_vocab_size = padded_vocab_size(1000, 128, 1)
    config = core_transformer_config_from_args(args)
    model = build_model(args, config, gpt.model_provider)
    optimizer, scheduler = build_optimizer(args, model)
    config.finalize_model_grads_func = finalize_model_grads
    state = checkpointing.load_checkpoint(args, model, optimizer, scheduler)
    dataset = build_datasets(args, build_tokenizer("NullTokenizer", None, args.vocab_size))[0]
    iterator = build_data_iterator(dataset, 0, args)
    for _ in range(10):
        train_step(gpt.forward_step, iterator, model, optimizer, scheduler, args)
        state.iteration += 1
    checkpointing.save_checkpoint(args, state, model, optimizer, scheduler)

    export_hf(tmp_path / "trained", tmp_path / "hf", log=quiet)
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["rope_parameters"] == {**LLAMA3, "rope_theta": 2000000.0}
    assert exported["max_position_embeddings"] == 32768
    ids = tokens()
    module = model[0].module.eval()
    with torch.no_grad():
        ours = module(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
    reference = hf_logits(tmp_path / "hf", ids)
    error = relative_error(ours, reference)
    print(f"trained 10 iterations, exported: max relative logit error {error:.3g}")
    assert error <= TOLERANCE
    assert relative_error(ours, hf_logits(hf, ids)) > 1e-3  # it did train


# -- vocabulary, load checks ----------------------------------------------------------------


def test_other_vocabulary_padding_loads_and_dropping_rows_is_refused(converted):
    _, checkpoint = converted("llama_gqa_untied_llama3")
    ids = tokens()
    padded_1024 = our_logits(checkpoint, ids)
    padded_1056 = our_logits(checkpoint, ids, ["--make-vocab-size-divisible-by", "96"])
    assert padded_1056.shape[-1] == 1056
    assert torch.equal(padded_1056[..., :1024], padded_1024)
    assert torch.all(padded_1056[..., 1000:] == 0)
    with pytest.raises(ArgumentValidationError, match="1000 vocabulary rows.*pads its "
                       "vocabulary to 904.*--vocab-size 1000"):
        our_logits(checkpoint, ids, ["--vocab-size", "900", "--make-vocab-size-divisible-by", "8"])


def test_load_refuses_other_architecture_flags_and_reports_changed_positions(converted, capsys):
    _, checkpoint = converted("llama_gqa_untied_llama3")
    with pytest.raises(ArgumentValidationError, match=r"saved with --norm-epsilon 1e-06, this "
                       r"run has --norm-epsilon 1e-05"):
        our_logits(checkpoint, tokens(), ["--norm-epsilon", "1e-5"])
    our_logits(checkpoint, tokens(), ["--rotary-base", "1000000"])
    assert "--rotary-base 1000000 (checkpoint: --rotary-base 500000)" in capsys.readouterr().out


# -- bad input ------------------------------------------------------------------------------


def _config(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


def _write_config(directory, **changes) -> None:
    (directory / "config.json").write_text(json.dumps({**_config(directory), **changes}))


class _Trap:
    """Unpickling this creates a file: proof that a pickle was (not) opened."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _only_pickle(directory, tmp_path) -> None:
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(tmp_path / "unpickled")))


def _missing_shard(directory, tmp_path) -> None:
    (directory / "model.safetensors").rename(directory / "model-00001-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors"
                  for name in load_file(directory / "model-00001-of-00002.safetensors")}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


BAD_INPUTS = {
    "no_config": (lambda d, t: (d / "config.json").unlink(), "config.json does not exist"),
    "pickle_only": (_only_pickle, "pickled weights .* safetensors only"),
    "missing_shard": (_missing_shard, "names model-00002-of-00002.safetensors, which is missing"),
    "other_family": (lambda d, t: _write_config(d, model_type="gpt2"),
                     "model_type 'gpt2' is not supported"),
    "attention_bias": (lambda d, t: _write_config(d, attention_bias=True),
                       "attention_bias true is not supported"),
    "dynamic_rope": (lambda d, t: _write_config(d, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
        "rope type 'dynamic' is not supported"),
    "weights_of_another_shape": (lambda d, t: _write_config(d, intermediate_size=128),
                                 "model.safetensors: model.layers.0.mlp.gate_proj.weight has "
                                 "shape \\[96, 64\\], config.json implies \\[128, 64\\]"),
    "tied_but_lm_head_differs": (lambda d, t: _write_config(d, tie_word_embeddings=True),
                                 "lm_head.weight differs from the embedding"),
    "output_not_empty": (lambda d, t: (t / "checkpoint").mkdir() or
                         (t / "checkpoint" / "x").write_text("x"),
                         "--save-dir .*checkpoint exists and is not empty"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_naming_the_file(case, tmp_path):
    from megatron.memo_tools.hf_checkpoint.convert import import_hf

    hf = save_tiny_model(tmp_path / "hf", "llama")
    damage, message = BAD_INPUTS[case]
    damage(hf, tmp_path)
    with pytest.raises(ConversionError, match=message) as error:
        import_hf(hf, tmp_path / "checkpoint", log=quiet)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "unpickled").exists()


def test_failed_import_leaves_no_output(megatron_world, tmp_path, monkeypatch):
    from megatron.training import checkpointing
    from megatron.memo_tools.hf_checkpoint.convert import import_hf

    def disk_full(args, module, root, hf_config=None):
        (root / "half_written").write_text("x")
        raise OSError("disk full")

    hf = save_tiny_model(tmp_path / "hf", "llama")
    monkeypatch.setattr(checkpointing, "save_weights_checkpoint", disk_full)
    with pytest.raises(OSError):
        import_hf(hf, tmp_path / "out" / "checkpoint", log=quiet)
    assert list((tmp_path / "out").iterdir()) == []


def test_commands_convert_and_print_the_flag_line(megatron_world, tmp_path, capsys):
    from megatron.memo_tools.hf_checkpoint.cli import convert_main, hf_args_main

    hf = save_tiny_model(tmp_path / "hf", "qwen2")
    assert hf_args_main([str(hf)]) == 0
    flag_line = capsys.readouterr().out.strip()
    assert "--add-qkv-bias" in flag_line
    assert convert_main(["--loader", "hf", "--saver", "core", "--load-dir", str(hf),
                         "--save-dir", str(tmp_path / "checkpoint")]) == 0
    assert capsys.readouterr().out.strip().endswith(flag_line)
    assert " ".join(model_flags(tmp_path / "checkpoint")) == flag_line
    assert convert_main(["--loader", "core", "--saver", "hf", "--load-dir",
                         str(tmp_path / "checkpoint"), "--save-dir", str(tmp_path / "out"),
                         "--dtype", "bf16"]) == 0
    exported = load_hf_tensors(tmp_path / "out")
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert _config(tmp_path / "out")["dtype"] == "bfloat16"  # transformers 5 spelling


def test_command_error_is_one_line_and_status_2(tmp_path):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools/checkpoint/hf_args.py"),
                             str(tmp_path)], cwd=REPO_ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'config.json'} does not exist; point " \
        "the flag at a Hugging Face model directory (config.json and *.safetensors)"
