"""Issue 45: Megatron-LM's own launch scripts run here unchanged, with --memo-offload added.

Each reference script's flag line (megatron.training.upstream_scripts) is shrunk to a tiny
model on CPU: sizes, parallel degrees, iteration counts and paths substituted, nothing removed.
Run as it is, pretrain_gpt.py stops before anything starts with exactly the one line
docs/megatron_flags.md promises for its first refused flag (every reference script has one).
Run with the flags refused here dropped (and those that need CUDA: --bf16, --fp16, --profile
and the flags that only apply with them), it trains 3 iterations, evaluates, saves a checkpoint
and writes TensorBoard.

Default suite: per script one refusal (in-process, instant), and the Llama-3 script's tiny
training run (single-process, about 15 s). Slow: the other two default variants' training runs
(GPT-3's single-process, Megatron-FSDP's on 2 processes: DP=2 with the distributed optimizer's
overlapped parameter all-gather) and every other variant's. The other variants' refusals are
checked in-process too."""

from __future__ import annotations

import re

import pytest

from megatron.training.arguments import ArgumentValidationError, parse_args
from megatron.training.upstream_flags import REFUSED, refusal, registry
from megatron.training.upstream_scripts import REFERENCE_SCRIPTS
from tests.conftest import run_trainer
from tests.hf_models import TOKENIZER_TEXTS, save_gpt2_files, save_tiny_tokenizer
from tests.unit.tools.test_preprocess_data import _write_jsonl, preprocess_data

ITERATIONS = 3
#: Sizes, iteration counts and parallel degrees: a tiny model, 3 iterations, one process per
#: data-parallel rank. Values of flags not named here are the script's.
SHRINK = {
    "--num-layers": "4", "--hidden-size": "64", "--ffn-hidden-size": "128",
    "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "16",
    "--seq-length": "64", "--max-position-embeddings": "64", "--vocab-size": "512",
    "--micro-batch-size": "1", "--global-batch-size": "2",
    "--train-iters": str(ITERATIONS), "--lr-decay-iters": str(ITERATIONS),
    "--train-samples": str(2 * ITERATIONS), "--lr-decay-samples": str(2 * ITERATIONS),
    "--lr-warmup-samples": "2", "--log-interval": "1", "--eval-interval": "2",
    "--eval-iters": "1", "--save-interval": str(ITERATIONS),
    "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1",
    "--context-parallel-size": "1",
}
PATH_FLAGS = ("--save", "--load", "--tensorboard-dir", "--data-cache-path", "--data-path",
              "--vocab-file", "--merge-file", "--tokenizer-model")
#: How many processes each script's training run takes (the data-parallel size).
NPROC = {"examples/gpt3/train_gpt3_175b_distributed.sh": 1,
         "examples/llama/train_llama3_8b_h100_fp8.sh": 1,
         "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh": 2}


def _words(argv: list[str]) -> list[list[str]]:
    """The command line as [flag, values...] groups."""
    groups: list[list[str]] = []
    for word in argv:
        if word.startswith("--"):
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def shrink(argv: list[str], paths: dict[str, str]) -> list[str]:
    """``argv`` with SHRINK's values and ``paths`` substituted (one value each); the rest as
    written, in order, plus --memo-offload."""
    out = []
    for flag, *values in _words(argv):
        new = SHRINK.get(flag, paths.get(flag))
        if new is not None:
            assert len(values) == 1, (flag, values)
            values = [new]
        out += [flag, *values]
    return out + ["--memo-offload"]


def honoured_part(argv: list[str]) -> list[str]:
    """``argv`` without what is refused on this CPU machine: refused flags, refused values,
    flags that need CUDA and the flags that only apply with a dropped one."""
    entries, out, dropped = registry(), [], set()
    for flag, *values in _words(argv):
        entry = entries.get(flag)
        if entry is not None and (entry.status == REFUSED or entry.cuda_only
                                  or set(values) & set(entry.refused_values)
                                  or entry.requires in dropped):
            dropped.add(flag)
            continue
        out += [flag, *values]
    return out


def first_refusal(argv: list[str]) -> str:
    refused = [flag for flag, *_ in _words(argv) if registry().get(flag)
               and registry()[flag].status == REFUSED]
    return refusal(refused[0])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    """A GPT-2 vocab.json/merges.txt and a tiny Hugging Face tokenizer folder, each with an
    indexed dataset tools/preprocess_data.py wrote with it."""
    root = tmp_path_factory.mktemp("upstream_corpus")
    texts = [f"Document {i}. {TOKENIZER_TEXTS[i % len(TOKENIZER_TEXTS)]} " * (1 + i % 4)
             for i in range(300)]
    source = _write_jsonl(root / "corpus.jsonl", [{"text": text} for text in texts])
    vocab, merges = save_gpt2_files(root / "gpt2")
    hf = save_tiny_tokenizer(root / "hf")
    for name, flags in (("gpt2", [f"--vocab-file={vocab}", f"--merge-file={merges}",
                                  "--tokenizer-type=GPT2BPETokenizer"]),
                        ("hf", ["--tokenizer-type=HuggingFaceTokenizer",
                                f"--tokenizer-model={hf}"])):
        preprocess_data.main([f"--input={source}", f"--output-prefix={root / name}",
                              "--append-eod", *flags])
    return {"vocab": str(vocab), "merges": str(merges), "hf": str(hf),
            "gpt2_data": str(root / "gpt2_text_document"),
            "hf_data": str(root / "hf_text_document")}


def _script_paths(script, corpus: dict[str, str], tmp_path) -> dict[str, str]:
    """The paths of a run: its own checkpoint, TensorBoard and cache directories; the GPT-3
    script's data in GPT-2 tokens (--vocab-file), the Llama scripts' real data in the Hugging
    Face tokenizer's."""
    gpt2 = "--vocab-file" in script.default.flags
    return {"--save": str(tmp_path / "ckpt"), "--load": str(tmp_path / "ckpt"),
            "--tensorboard-dir": str(tmp_path / "tb"),
            "--data-cache-path": str(tmp_path / "cache"),
            "--vocab-file": corpus["vocab"], "--merge-file": corpus["merges"],
            "--tokenizer-model": corpus["hf"],
            "--data-path": corpus["gpt2_data" if gpt2 else "hf_data"]}


SCRIPTS = {script.path: script for script in REFERENCE_SCRIPTS}


@pytest.mark.parametrize("path", list(SCRIPTS))
def test_the_script_as_written_stops_at_its_one_line_refusal(path, corpus, tmp_path, capsys):
    """pretrain_gpt.py's entry point in this process (the refusal comes before
    torch.distributed, megatron.core or any model): exit status 2, one line on stderr."""
    import pretrain_gpt
    from megatron.training.arguments import run_main

    script = SCRIPTS[path]
    argv = shrink(script.default.argv, _script_paths(script, corpus, tmp_path))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_main(pretrain_gpt.main, argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {first_refusal(argv)}"]


_FP8 = {"--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"}
#: What each default variant loses on CPU: the refused flags, then what needs CUDA.
DROPPED = {
    "examples/gpt3/train_gpt3_175b_distributed.sh": {"--step-batch-size-schedule", "--fp16"},
    "examples/llama/train_llama3_8b_h100_fp8.sh": _FP8 | {
        "--bf16", "--grad-reduce-in-bf16", "--profile", "--profile-step-start",
        "--profile-step-end"},
    "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh": _FP8 | {
        "--init-model-with-meta-device", "--use-nccl-ub", "--fsdp-manual-registration",
        "--bf16"},
}


#: The script whose training run stays in the default suite: the Llama-3 one, the launch most
#: users start from. GPT-3's trains the same single-process path with other flags, and
#: Megatron-FSDP's training is a default case of tests/distributed/test_megatron_fsdp.py.
DEFAULT_TRAINING = "examples/llama/train_llama3_8b_h100_fp8.sh"


@pytest.mark.parametrize("path", [path if path == DEFAULT_TRAINING else
                                  pytest.param(path, marks=pytest.mark.slow)  # ~15 s each
                                  for path in SCRIPTS])
def test_the_scripts_honoured_flags_train_three_iterations(path, corpus, tmp_path):
    script = SCRIPTS[path]
    argv = honoured_part(shrink(script.default.argv, _script_paths(script, corpus, tmp_path)))
    kept = {word for word in argv if word.startswith("--")}
    assert set(script.default.flags) - kept == DROPPED[path]
    result = run_trainer(NPROC[path], argv, timeout=500)
    iterations = re.findall(rf" iteration +(\d+)/ +{ITERATIONS} \|", result.stdout)
    assert iterations == [str(i) for i in range(1, ITERATIONS + 1)], result.stdout[-3000:]
    assert " validation at iteration 2 " in result.stdout
    assert (tmp_path / "ckpt" / f"iter_{ITERATIONS:07d}").is_dir()
    assert any((tmp_path / "tb").iterdir())


VARIANTS = [(script.path, index) for script in REFERENCE_SCRIPTS
            for index in range(1, len(script.variants))]


@pytest.mark.parametrize("path,index", VARIANTS)
def test_every_other_variant_stops_at_its_refusal(path, index, corpus, tmp_path):
    script = SCRIPTS[path]
    argv = shrink(script.variants[index].argv, _script_paths(script, corpus, tmp_path))
    with pytest.raises(ArgumentValidationError) as raised:
        parse_args(argv, world_size=NPROC[path], cuda_available=False)
    assert str(raised.value) == first_refusal(argv)
    parse_args(honoured_part(argv), world_size=NPROC[path], cuda_available=False)


@pytest.mark.slow  # ~30 s each; the default suite trains each script's default variant
@pytest.mark.parametrize("path,index", VARIANTS)
def test_every_other_variants_honoured_flags_train(path, index, corpus, tmp_path):
    script = SCRIPTS[path]
    argv = honoured_part(shrink(script.variants[index].argv,
                                _script_paths(script, corpus, tmp_path)))
    result = run_trainer(NPROC[path], argv, timeout=500)
    assert len(re.findall(rf" iteration +\d+/ +{ITERATIONS} \|", result.stdout)) == ITERATIONS
