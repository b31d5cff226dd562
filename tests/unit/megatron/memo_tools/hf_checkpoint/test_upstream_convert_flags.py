"""Issue 45: Megatron-LM's checkpoint-converter spellings on tools/checkpoint/convert.py
(megatron.memo_tools.hf_checkpoint.upstream_flags). Every flag its convert.py, loaders and
savers define has one entry and is recognized; each is accepted, or refused with one line naming
it and exit status 2; an unknown flag gets one line too, not argparse's usage block; an
upstream command line converts the tiny model to the checkpoint our spelling writes, and back;
docs/megatron_convert_flags.md is what the registry renders."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron.memo_tools.hf_checkpoint.cli import parse_convert_args, convert_main, convert_parser
from megatron.memo_tools.hf_checkpoint.errors import ConversionError
from megatron.memo_tools.hf_checkpoint.upstream_flags import (
    FLAGS,
    LOADERS,
    NO_EFFECT,
    SAVERS,
    UPSTREAM_FILES,
    registry,
)
from megatron.training.upstream_flags import ALWAYS, HONOURED, REFUSED
from tests.conftest import REPO_ROOT, subprocess_env
from tests.hf_models import save_tiny_model, save_tiny_tokenizer

IMPORT = ["--loader", "hf", "--saver", "core", "--load-dir", "HF", "--save-dir", "OUT"]
EXPORT = ["--loader", "core", "--saver", "hf", "--load-dir", "CKPT", "--save-dir", "OUT"]


def _refusal(argv: list[str]) -> str:
    with pytest.raises(ConversionError) as raised:
        parse_convert_args(argv)
    return str(raised.value)


def test_every_upstream_flag_has_one_entry_and_is_recognized():
    upstream = {flag for flags in UPSTREAM_FILES.values() for flag in flags}
    assert [entry.flag for entry in FLAGS if entry.flag not in upstream] == []
    assert sorted(upstream) == sorted(registry())
    assert len(FLAGS) == len(registry()), "a flag listed twice"
    assert {entry.status for entry in FLAGS} <= {HONOURED, ALWAYS, NO_EFFECT, REFUSED}
    known = set(convert_parser()._option_string_actions)
    assert [flag for flag in registry() if flag not in known] == []
    for entry in FLAGS:
        assert entry.here and "\n" not in entry.here


#: A value each flag is accepted with (on IMPORT, or on EXPORT for the loader-side flags).
ACCEPTED = {
    "--model-type": (IMPORT, ["GPT"]),
    "--max-queue-size": (IMPORT, ["10"]),
    "--no-checking": (IMPORT, []),
    "--megatron-path": (IMPORT, ["/opt/megatron-lm"]),
    "--target-tensor-parallel-size": (IMPORT, ["2"]),
    "--target-pipeline-parallel-size": (IMPORT, ["2"]),
    "--target-expert-parallel-size": (IMPORT, ["1"]),
    "--saver-transformer-impl": (IMPORT, ["transformer_engine"]),
    "--true-vocab-size": (EXPORT, ["1000"]),
    "--vocab-file": (EXPORT, ["vocab.json"]),
    "--position-embedding-type": (EXPORT, ["rope"]),
    "--loader-transformer-impl": (EXPORT, ["transformer_engine"]),
    "--model-size": (IMPORT, ["llama3"]),
    "--checkpoint-type": (IMPORT, ["hf"]),
    "--bf16": (IMPORT, []),
    "--fp16": (IMPORT, []),
    "--tokenizer-model": (IMPORT, ["HF"]),
    "--make-vocab-size-divisible-by": (IMPORT, ["64"]),
}
#: What each flag refuses on the command line alone: argv -> the start of its one line.
REFUSED_LINES = {
    "--model-type": [(IMPORT + ["--model-type", "BERT"], "--model-type BERT: only GPT"),
                     (IMPORT + ["--model-type", "T5"], "--model-type: invalid choice")],
    "--loader": [(["--loader", name] + IMPORT[2:], f"--loader {name}: ")
                 for name in ("mixtral_hf", "llava", "legacy", "megatron", "llama")],
    "--saver": [(IMPORT[:2] + ["--saver", name] + IMPORT[4:], f"--saver {name}: ")
                for name in ("llava", "hf_llava", "legacy", "megatron")]
    + [(["--loader", "llama_mistral", "--saver", "hf"] + IMPORT[4:], "--loader llama_mistral "
        "--saver hf converts nothing")],
    "--max-queue-size": [(IMPORT + ["--max-queue-size", "0"], "--max-queue-size: must be")],
    "--target-tensor-parallel-size": [
        (EXPORT + ["--target-tensor-parallel-size", "2"], "--target-tensor-parallel-size: only "
         "with --saver core")],
    "--target-pipeline-parallel-size": [
        (EXPORT + ["--target-pipeline-parallel-size", "2"], "--target-pipeline-parallel-size: "
         "only with --saver core")],
    "--target-expert-parallel-size": [
        (IMPORT + ["--target-expert-parallel-size", "2"], "--target-expert-parallel-size 2: "
         "mixture-of-experts")],
    "--saver-transformer-impl": [(EXPORT + ["--saver-transformer-impl", "local"],
                                  "--saver-transformer-impl: only with --saver core")],
    "--position-embedding-type": [(EXPORT + ["--position-embedding-type", "learned_absolute"],
                                   "--position-embedding-type learned_absolute: ")],
    "--model-size": [(EXPORT + ["--model-size", "llama3"], "--model-size: only with --loader "
                      "hf or llama_mistral")],
    "--checkpoint-type": [(IMPORT + ["--checkpoint-type", "meta"], "--checkpoint-type meta: "),
                          (EXPORT + ["--checkpoint-type", "hf"], "--checkpoint-type: only")],
    "--bf16": [(IMPORT + ["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
               (IMPORT + ["--bf16", "--dtype", "fp32"], "--bf16 and --dtype fp32 disagree")],
    "--fp16": [(IMPORT + ["--fp16", "--dtype", "bf16"], "--fp16 and --dtype bf16 disagree")],
    "--tokenizer-model": [(EXPORT + ["--tokenizer-model", "HF"], "--tokenizer-model: only")],
    "--vit-dummy-head-count": [(IMPORT + ["--vit-dummy-head-count", "1"],
                                "--vit-dummy-head-count: multimodal")],
    "unknown": [(IMPORT + ["--num-layers", "2"], "--num-layers: not a flag of "),
                (IMPORT + ["--target-pipeline-model-parallel-size=2"],
                 "--target-pipeline-model-parallel-size: not a flag of "),
                (IMPORT[:6], "the following arguments are required: --save-dir")],
}


#: The flags refused against config.json (test_upstream_command_lines_convert_as_ours).
CONFIG_REFUSED = {"--model-size", "--true-vocab-size", "--vocab-file", "--tokenizer-model"}


def test_every_flag_has_an_accepted_case_and_every_refused_flag_a_refusal():
    assert set(ACCEPTED) == {entry.flag for entry in FLAGS if entry.status != REFUSED} - {
        "--loader", "--saver", "--load-dir", "--save-dir"}
    refusing = {entry.flag for entry in FLAGS if entry.refuses or entry.refused_values
                or entry.requires or entry.status == REFUSED}
    assert refusing <= set(REFUSED_LINES) | CONFIG_REFUSED


@pytest.mark.parametrize("flag", sorted(ACCEPTED))
def test_an_upstream_flag_is_accepted(flag):
    base, values = ACCEPTED[flag]
    args = parse_convert_args(base + [flag] + values)
    assert (args.loader, args.saver) == (base[1], base[3])


@pytest.mark.parametrize("flag", sorted(REFUSED_LINES))
def test_a_refusal_is_one_line_naming_the_flag(flag):
    for argv, start in REFUSED_LINES[flag]:
        message = _refusal(argv)
        assert message.startswith(start) and "\n" not in message, (argv, message)


def test_upstream_names_map_to_ours():
    for kind, plugins in (("--loader", LOADERS), ("--saver", SAVERS)):
        for entry in plugins:
            if entry.ours is None:
                assert _refusal([kind, entry.name] + (IMPORT[2:] if kind == "--loader" else
                                                      IMPORT[:2] + IMPORT[4:])).startswith(
                    f"{kind} {entry.name}: ")
    args = parse_convert_args(["--loader", "llama_mistral", "--saver", "mcore"] + IMPORT[4:])
    assert (args.loader, args.saver, args.dtype) == ("hf", "core", "fp32")  # Megatron-LM's
    args = parse_convert_args(["--loader", "mcore", "--saver", "hf"] + IMPORT[4:] + ["--bf16"])
    assert (args.loader, args.saver, args.dtype) == ("core", "hf", "bf16")
    assert parse_convert_args(IMPORT).dtype is None  # ours: the dtype read


def test_an_unknown_flag_is_one_line_and_status_2():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools/checkpoint/convert.py"),
                             *IMPORT, "--target-pipeline-model-parallel-size", "2"],
                            cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: --target-pipeline-model-parallel-size: not a flag of tools/checkpoint/"
        "convert.py (its own and Megatron-LM's converter flags: docs/megatron_convert_flags.md)"]


# -- a real conversion with Megatron-LM's spellings -----------------------------------------

@pytest.fixture(scope="module")
def megatron_world():
    from megatron.memo_tools.hf_checkpoint.trainer_model import trainer_args, world_of_one

    with world_of_one(trainer_args(["--num-layers", "1", "--hidden-size", "64",
                                    "--num-attention-heads", "4", "--vocab-size", "1000"])):
        yield


def _checkpoint(root) -> tuple[dict, dict]:
    """(common state, tensors by dotted name) of the latest checkpoint under ``root``."""
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    from megatron.training.checkpointing import latest_checkpoint

    def flat(tree: dict, prefix: str = "") -> dict:
        tensors = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                tensors.update(flat(value, f"{prefix}{key}."))
            elif torch.is_tensor(value):  # the common state's values come back too
                tensors[prefix + key] = value
        return tensors

    directory, common = latest_checkpoint(root)
    return common, flat(load_plain_tensors(str(directory)))


def test_upstream_command_lines_convert_as_ours(megatron_world, tmp_path, capsys):
    """A bf16 Llama with a tokenizer: Megatron-LM's llama_mistral command line (with the flags
    it leaves without effect) writes our checkpoint bit for bit, model flags included; without
    --bf16 it stores fp32, as Megatron-LM; the mcore loader's command line exports it back to the
    original tensors; what needs config.json is refused in one line naming the flag."""
    hf = save_tiny_model(tmp_path / "hf", "llama", torch.bfloat16)
    save_tiny_tokenizer(hf)
    ours, theirs, fp32 = tmp_path / "ours", tmp_path / "theirs", tmp_path / "fp32"
    assert convert_main(["--loader", "hf", "--saver", "core", "--load-dir", str(hf),
                         "--save-dir", str(ours)]) == 0
    upstream = ["--model-type", "GPT", "--loader", "llama_mistral", "--checkpoint-type", "hf",
                "--model-size", "llama3", "--saver", "core", "--load-dir", str(hf),
                "--tokenizer-model", str(hf), "--target-tensor-parallel-size", "2",
                "--target-pipeline-parallel-size", "1", "--max-queue-size", "10",
                "--megatron-path", "/opt/megatron-lm", "--true-vocab-size", "1000",
                "--make-vocab-size-divisible-by", "128", "--saver-transformer-impl", "local"]
    assert convert_main(upstream + ["--bf16", "--save-dir", str(theirs)]) == 0
    assert convert_main(upstream + ["--save-dir", str(fp32)]) == 0
    capsys.readouterr()

    (common, tensors), (their_common, their_tensors) = _checkpoint(ours), _checkpoint(theirs)
    assert their_common["hf_config"] == common["hf_config"]
    assert their_common["train_state"]["model_args"] == common["train_state"]["model_args"]
    assert sorted(their_tensors) == sorted(tensors) and len(tensors) > 5
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(their_tensors[name], tensor), name
    flags = (ours / "model_flags.txt").read_text().replace(str(ours), str(theirs))
    assert (theirs / "model_flags.txt").read_text() == flags
    assert (theirs / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    for name, tensor in _checkpoint(fp32)[1].items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, tensors[name].float()), name

    exported = tmp_path / "exported"
    assert convert_main(["--model-type", "GPT", "--loader", "mcore", "--saver", "hf",
                         "--load-dir", str(theirs), "--save-dir", str(exported),
                         "--position-embedding-type", "rope", "--true-vocab-size", "1000",
                         "--loader-transformer-impl", "transformer_engine", "--no-checking",
                         "--hf-dir", str(hf)]) == 0
    assert load_file(exported / "model.safetensors").keys() == load_file(
        hf / "model.safetensors").keys()
    for name, tensor in load_file(hf / "model.safetensors").items():
        assert torch.equal(load_file(exported / "model.safetensors")[name], tensor), name

    (tmp_path / "vocab.json").write_text(json.dumps({str(i): i for i in range(999)}))
    (tmp_path / "no_tokenizer").mkdir()
    cases = {"--model-size": (["qwen2.5"], "--model-size qwen2.5: a qwen2 model, but "),
             "--true-vocab-size": (["999"], "--true-vocab-size 999: "),
             "--vocab-file": ([str(tmp_path / "vocab.json")],
                              f"--vocab-file {tmp_path / 'vocab.json'} (999 entries): "),
             "--tokenizer-model": ([str(tmp_path / "no_tokenizer")], "--tokenizer-model ")}
    assert set(cases) == CONFIG_REFUSED
    for flag, (values, start) in cases.items():
        extra = [flag] + values
        assert convert_main(["--loader", "llama_mistral", "--saver", "core", "--load-dir",
                             str(hf), "--save-dir", str(tmp_path / "refused")] + extra) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"error: {start}") and error.count("\n") == 1, error
    assert not (tmp_path / "refused").exists()
    assert convert_main(EXPORT[:5] + [str(theirs), "--save-dir", str(tmp_path / "refused"),
                                      "--true-vocab-size", "1024"]) == 2
    assert capsys.readouterr().err.startswith("error: --true-vocab-size 1024: ")


def test_the_flag_table_is_generated_from_the_registry():
    from megatron.memo_tools.hf_checkpoint.upstream_flags_doc import DOC_PATH, render

    text = render()
    assert DOC_PATH.read_text(encoding="utf-8") == text, (
        "docs/megatron_convert_flags.md is stale: run python -m "
        "megatron.memo_tools.hf_checkpoint.upstream_flags_doc")
    for entry in FLAGS:
        assert f"| `{entry.flag}` | {entry.status} |" in text
    for entry in LOADERS:
        assert f"| `--loader {entry.name}` |" in text
    for entry in SAVERS:
        assert f"| `--saver {entry.name}` |" in text
