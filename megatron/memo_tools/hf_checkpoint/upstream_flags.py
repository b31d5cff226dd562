"""Megatron-LM's checkpoint-converter spellings (its tools/checkpoint/convert.py, loaders and
savers) and what each does here: the registry behind docs/megatron_convert_flags.md
(``python -m megatron.memo_tools.hf_checkpoint.upstream_flags_doc`` writes it).

The pattern of the launch-script registry (megatron.training.upstream_flags), with its statuses
and one more: ``accepted, no effect here``, for a flag that steers machinery Megatron-LM's
converter has and this one does not (its loader and saver processes, the queue between them,
its sys.path). Anything else is refused before anything is read, in one line naming the flag
(and value) and why (:func:`check_command_line`); the command line's other checks against the
model's config.json are :func:`config_check`'s.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megatron.memo_tools.hf_checkpoint.errors import ConversionError
from megatron.training.upstream_flags import ALWAYS, HONOURED, REFUSED, UpstreamFlag

NO_EFFECT = "accepted, no effect here"
#: loader_llama_mistral.py is gone at the reference commit (Megatron-LM 39ec5eb, "remove legacy
#: GPT code"); its flags are read at the last commit that has it, where most conversion
#: scripts written for Megatron-LM come from.
LLAMA_MISTRAL_COMMIT = "fd443f26abb03643c6f812a79a020e622054c749"


@dataclass(frozen=True)
class Plugin:
    """An upstream --loader/--saver name: ours (hf or core), or None with the reason."""

    name: str
    ours: Optional[str]
    here: str


_MOE = "mixture-of-experts models are not supported (the three families converted here are dense)"
_VISION = "multimodal (LLaVA) models are not supported; only the GPT families Llama, Mistral, Qwen2"
_LEGACY = ("Megatron-LM's legacy (non-core) GPT checkpoints are not supported (Megatron-LM "
           "removed them too, 39ec5eb); the trainer's checkpoints are megatron-core's: use core")

LOADERS: tuple[Plugin, ...] = (
    Plugin("hf", "hf", "a Hugging Face model directory (this converter's own name)"),
    Plugin("llama_mistral", "hf",
           f"a Hugging Face Llama, Mistral or Qwen2 directory (Megatron-LM's loader at "
           f"{LLAMA_MISTRAL_COMMIT[:7]}, with --checkpoint-type hf). The rows kept are "
           "config.json's vocab_size, where Megatron-LM cut them to the tokenizer's ids, so an "
           "export gives the model back; weights in fp32 unless --bf16/--fp16, as there"),
    Plugin("core", "core", "a checkpoint of the trainer (megatron-core dist_checkpointing, any "
           "TP/PP)"),
    Plugin("mcore", "core", "core (Megatron-LM's older name for it, which it still maps so)"),
    Plugin("mixtral_hf", None, _MOE),
    Plugin("llava", None, _VISION),
    Plugin("legacy", None, _LEGACY),
    Plugin("megatron", None, _LEGACY + " (megatron is Megatron-LM's default, which names no "
           "loader at the reference commit)"),
)
SAVERS: tuple[Plugin, ...] = (
    Plugin("core", "core", "a weights-only checkpoint of the trainer, iteration 0 (loads at "
           "any TP/PP/CP)"),
    Plugin("mcore", "core", "core (Megatron-LM's older name for it, which it still maps so)"),
    Plugin("hf", "hf", "a Hugging Face model directory (this converter's own name; "
           "Megatron-LM has no GPT saver to Hugging Face)"),
    Plugin("llava", None, _VISION),
    Plugin("hf_llava", None, _VISION),
    Plugin("legacy", None, _LEGACY),
    Plugin("megatron", None, _LEGACY + " (megatron is Megatron-LM's default, which names no "
           "saver at the reference commit)"),
)

#: The families of loader_llama_mistral's --model-size (config.json's model_type). Yi is a
#: Llama model in transformers.
MODEL_SIZES = {"llama2-7B": "llama", "llama2-13B": "llama", "llama2-70B": "llama",
               "llama2-7Bf": "llama", "llama2-13Bf": "llama", "llama2-70Bf": "llama",
               "llama3": "llama", "mistral": "mistral", "yi-34B": "llama", "qwen2.5": "qwen2"}
IMPLS = ("local", "transformer_engine")
#: Why each value in an entry's refused_values is refused.
VALUE_REASONS = {
    ("--model-type", "BERT"): "only GPT models convert here (Llama, Mistral, Qwen2)",
    ("--position-embedding-type", "learned_absolute"):
        "no family converted here has a learned position table: they use rope (Megatron-LM's "
        "loader defaults to learned_absolute; pass rope or drop the flag)",
    ("--checkpoint-type", "meta"):
        "Meta's consolidated.*.pth files are pickles, which this converter never opens: convert "
        "them with transformers' convert_llama_weights_to_hf.py and pass that directory with "
        "--checkpoint-type hf",
}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


_IMPL = ("Megatron-LM's choice of the layer implementation whose tensor names its legacy-format "
         "checkpoint uses; here the converter builds the local layers whatever it says, and "
         "their dist_checkpointing keys are Transformer Engine's too (megatron-core's local "
         "spec names its norms so), though no Transformer Engine run has loaded a converted "
         "checkpoint on a GPU yet")
_HF_SIDE = "--loader hf"  # or llama_mistral: the loaders that read a Hugging Face directory
#: What an entry's ``requires`` refuses, for the table.
REQUIRES_REFUSES = {"--saver core": "with --saver hf", _HF_SIDE: "with --loader core"}
_VOCAB = ("must equal config.json's vocab_size: the rows converted and exported are the "
          "model's, where Megatron-LM cuts or pads the embedding to this size")

FLAGS: tuple[UpstreamFlag, ...] = (
    # Megatron-LM's convert.py
    UpstreamFlag("--model-type", HONOURED, "GPT, the only model type here (Megatron-LM requires "
                 "the flag; here it may be left out)", "BERT", refused_values=("BERT",),
                 argparse={"choices": ("GPT", "BERT"), "default": "GPT"}),
    UpstreamFlag("--loader", HONOURED, "the format read; Megatron-LM's names map to hf or core "
                 "(the table of names)", "the names refused in that table"),
    UpstreamFlag("--saver", HONOURED, "the format written; Megatron-LM's names map to core or "
                 "hf (the table of names)", "the names refused in that table"),
    UpstreamFlag("--load-dir", HONOURED, "the directory read"),
    UpstreamFlag("--save-dir", HONOURED, "the directory written (new or empty; it appears "
                 "only when complete)"),
    UpstreamFlag("--max-queue-size", NO_EFFECT, "Megatron-LM's bound on the tensors in flight "
                 "from its loader process to its saver process; here one process converts, with "
                 "no queue", argparse={"type": _positive, "default": 50}),
    UpstreamFlag("--no-checking", NO_EFFECT, "Megatron-LM's switch off of the name and order "
                 "checks of its loader-to-saver messages; there are none here, and the "
                 "conversion's own checks (every tensor's name and shape) always run",
                 argparse={"action": "store_false", "dest": "checking"}),
    # Megatron-LM's saver_core.py
    UpstreamFlag("--megatron-path", NO_EFFECT, "Megatron-LM's directory put on sys.path to "
                 "import it; this converter is part of the trainer and imports its own code",
                 argparse={"default": None}),
    UpstreamFlag("--target-tensor-parallel-size", ALWAYS, "the checkpoint loads at this TP: "
                 "megatron-core reshards it on load to any TP, and a vocabulary padded for "
                 "another TP loads zero-filled (docs/hf_checkpoint.md, Vocabulary padding)",
                 requires="--saver core", argparse={"type": _positive, "default": None}),
    UpstreamFlag("--target-pipeline-parallel-size", ALWAYS, "the checkpoint loads at this PP: "
                 "megatron-core reshards it on load to any PP", requires="--saver core", argparse={"type": _positive, "default": None}),
    UpstreamFlag("--target-expert-parallel-size", HONOURED, "1 (Megatron-LM's default): the "
                 "models converted here have no experts", f"above 1: {_MOE}",
                 requires="--saver core", argparse={"type": _positive, "default": 1}),
    UpstreamFlag("--saver-transformer-impl", NO_EFFECT, _IMPL, requires="--saver core", argparse={"choices": IMPLS, "default": None}),
    # Megatron-LM's loader_core.py
    UpstreamFlag("--true-vocab-size", HONOURED, _VOCAB, "another size",
                 argparse={"type": _positive, "default": None}),
    UpstreamFlag("--vocab-file", HONOURED, "a JSON vocabulary, whose entry count (as Megatron-LM "
                 f"counts it) {_VOCAB}", "a file with another count, or one that is not JSON",
                 argparse={"default": None}),
    UpstreamFlag("--position-embedding-type", HONOURED, "rope: what every family converted "
                 "here uses (config.json's RoPE settings are read with it)",
                 "learned_absolute", refused_values=("learned_absolute",),
                 argparse={"choices": ("learned_absolute", "rope"), "default": None}),
    UpstreamFlag("--loader-transformer-impl", NO_EFFECT, _IMPL,
                 argparse={"choices": IMPLS, "default": None}),
    # Megatron-LM's loader_llama_mistral.py (at LLAMA_MISTRAL_COMMIT)
    UpstreamFlag("--model-size", HONOURED, "checked against config.json's model_type: llama2-*, "
                 "llama3 and yi-34B are llama, mistral is mistral, qwen2.5 is qwen2 (the "
                 "sizes come from config.json)", "a family other than config.json's",
                 requires=_HF_SIDE,
                 argparse={"choices": tuple(MODEL_SIZES), "default": None}),
    UpstreamFlag("--checkpoint-type", HONOURED, "hf: a Hugging Face directory",
                 "meta", requires=_HF_SIDE,
                 refused_values=("meta",), argparse={"choices": ("meta", "hf"), "default": None}),
    UpstreamFlag("--bf16", HONOURED, "--dtype bf16: the weights stored in bf16",
                 "with --fp16 or another --dtype", argparse={"action": "store_true"}),
    UpstreamFlag("--fp16", HONOURED, "--dtype fp16: the weights stored in fp16",
                 "with --bf16 or another --dtype", argparse={"action": "store_true"}),
    UpstreamFlag("--tokenizer-model", HONOURED, "the tokenizer folder (or its tokenizer.json) "
                 "copied into the checkpoint and named in model_flags.txt (default: --load-dir)",
                 "a folder without tokenizer.json", requires=_HF_SIDE,
                 argparse={"default": None}),
    UpstreamFlag("--make-vocab-size-divisible-by", HONOURED, "pad the vocabulary rows to a "
                 "multiple of this (default 128, as the trainer)"),
    # Megatron-LM's loader_llava.py
    UpstreamFlag("--vit-dummy-head-count", REFUSED, _VISION, argparse={"nargs": 1}),
)

#: The flags each Megatron-LM converter file defines (at the reference commit, and
#: loader_llama_mistral.py at LLAMA_MISTRAL_COMMIT), in their order there.
UPSTREAM_FILES: dict[str, tuple[str, ...]] = {
    "convert.py": ("--model-type", "--loader", "--saver", "--load-dir", "--save-dir",
                   "--max-queue-size", "--no-checking"),
    "saver_core.py": ("--megatron-path", "--target-tensor-parallel-size",
                      "--target-pipeline-parallel-size", "--target-expert-parallel-size",
                      "--saver-transformer-impl"),
    "loader_core.py": ("--true-vocab-size", "--vocab-file", "--megatron-path",
                       "--position-embedding-type", "--loader-transformer-impl"),
    "loader_llama_mistral.py": ("--model-size", "--checkpoint-type", "--bf16", "--fp16",
                                "--true-vocab-size", "--vocab-file", "--tokenizer-model",
                                "--megatron-path", "--make-vocab-size-divisible-by",
                                "--loader-transformer-impl"),
    "loader_mixtral_hf.py": ("--true-vocab-size", "--vocab-file", "--tokenizer-model",
                             "--megatron-path"),
    "loader_llava.py": ("--true-vocab-size", "--vocab-file", "--megatron-path",
                        "--loader-transformer-impl", "--vit-dummy-head-count"),
    "saver_llava.py": ("--megatron-path", "--target-tensor-parallel-size",
                       "--target-pipeline-parallel-size", "--saver-transformer-impl",
                       "--target-expert-parallel-size"),
    "saver_hf_llava.py": ("--megatron-path",),
}


def registry() -> dict[str, UpstreamFlag]:
    return {entry.flag: entry for entry in FLAGS}


def plugin(kind: str, name: str) -> str:
    """Our loader or saver for an upstream name (``kind`` is "--loader" or "--saver")."""
    known = {entry.name: entry for entry in (LOADERS if kind == "--loader" else SAVERS)}
    if name not in known:
        names = ", ".join(known)
        raise ConversionError(f"{kind} {name}: not a {kind[2:]} here; one of {names} "
                              "(docs/megatron_convert_flags.md)")
    if known[name].ours is None:
        raise ConversionError(f"{kind} {name}: {known[name].here}")
    return known[name].ours


def add_upstream_args(parser: argparse.ArgumentParser) -> None:
    """The registry's flags that the converter's own arguments do not define."""
    group = parser.add_argument_group(
        title="Megatron-LM converter flags accepted or refused here "
        "(docs/megatron_convert_flags.md)")
    for entry in FLAGS:
        if entry.argparse is not None:
            group.add_argument(entry.flag, help=f"{entry.status}: {entry.here}.".replace("%", "%%"),
                               **entry.argparse)


def _value(args: argparse.Namespace, entry: UpstreamFlag):
    """The flag's value, or None when the command line leaves it at its default."""
    action = entry.argparse.get("action")
    default = {"store_true": False, "store_false": True}.get(action, entry.argparse.get("default"))
    value = getattr(args, entry.argparse.get("dest") or entry.flag[2:].replace("-", "_"))
    return None if value == default else value


def check_command_line(args: argparse.Namespace) -> None:
    """Refuse, in one line, what of the command line this converter cannot do. ``args.loader``
    and ``args.saver`` must already be ours (:func:`plugin`)."""
    for entry in FLAGS:
        value = _value(args, entry) if entry.argparse else None
        if value is None:
            continue
        if entry.status == REFUSED:
            raise ConversionError(f"{entry.flag}: {entry.here}")
        if entry.requires == "--saver core" and args.saver != "core":
            raise ConversionError(f"{entry.flag}: only with --saver core (a flag of "
                                  "Megatron-LM's core saver; a Hugging Face directory has no "
                                  "parallel layout or layer implementation)")
        if entry.requires == _HF_SIDE and args.loader != "hf":
            raise ConversionError(f"{entry.flag}: only with --loader hf or llama_mistral "
                                  "(Megatron-LM's Hugging Face loader flag)")
        if value in entry.refused_values:
            raise ConversionError(f"{entry.flag} {value}: {VALUE_REASONS[entry.flag, value]}")
    if args.target_expert_parallel_size > 1:
        raise ConversionError(f"--target-expert-parallel-size {args.target_expert_parallel_size}"
                              f": {_MOE}")
    if args.bf16 and args.fp16:
        raise ConversionError("--bf16 and --fp16 are exclusive: pick the one dtype to store")
    half = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if half and args.dtype not in (None, half):
        raise ConversionError(f"--{half} and --dtype {args.dtype} disagree: give one of them")


def _vocabulary_count(path: str) -> int:
    """Entries of a JSON vocabulary, as Megatron-LM's loader counts them (len of the JSON)."""
    try:
        vocabulary = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConversionError(f"--vocab-file {path}: not a JSON vocabulary ({error}); give the "
                              "model's vocab.json or drop the flag") from None
    if not isinstance(vocabulary, (dict, list)):
        raise ConversionError(f"--vocab-file {path}: holds a JSON {type(vocabulary).__name__}, "
                              "not a vocabulary; give the model's vocab.json or drop the flag")
    return len(vocabulary)


def config_check(args: argparse.Namespace) -> Optional[Callable[[dict, str], None]]:
    """The command line's checks against the model's config.json (``source`` names it), or
    None when it asks for none."""
    expected = []
    if args.true_vocab_size is not None:
        expected.append((f"--true-vocab-size {args.true_vocab_size}", args.true_vocab_size))
    if args.vocab_file is not None:
        count = _vocabulary_count(args.vocab_file)
        expected.append((f"--vocab-file {args.vocab_file} ({count} entries)", count))
    if not expected and args.model_size is None:
        return None

    def check(config: dict, source: str) -> None:
        for named, size in expected:
            if size != config["vocab_size"]:
                raise ConversionError(f"{named}: {source} has vocab_size "
                                      f"{config['vocab_size']}; {_VOCAB}")
        family = MODEL_SIZES.get(args.model_size)
        if family is not None and family != config["model_type"]:
            raise ConversionError(f"--model-size {args.model_size}: a {family} model, but "
                                  f"{source} is {config['model_type']}; give the size of that "
                                  "family or drop the flag")

    return check
