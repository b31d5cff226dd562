"""GPT model presets and the ``--model`` argument shared by tools/trace.py, tools/estimate.py and
tools/sppo_plan.py (one definition; torch-free so planners import it without torch)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

# (layers, hidden, ffn hidden, heads) of examples/configs/gpt_{7b,13b,30b,65b}.sh.
MODELS = {
    "7b": (32, 4096, 16384, 32),
    "13b": (40, 5120, 20480, 40),
    "30b": (48, 7168, 28672, 56),
    "65b": (80, 8192, 32768, 64),
}
# GPT-2's BPE vocabulary, as in examples/configs (padded to a multiple of 128 x TP).
DEFAULT_VOCAB_SIZE = 50257
#: Keys a --model JSON file must carry.
REQUIRED_MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


#: pretrain_gpt.py's flags of the shape keys (a --model @FILE of trainer flags).
SHAPE_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
               "ffn_hidden_size": "--ffn-hidden-size",
               "num_attention_heads": "--num-attention-heads",
               "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels",
               "vocab_size": "--vocab-size"}


class ModelError(ValueError):
    """A --model argument that names no preset and no usable JSON file (one line)."""


def _flag_file_shape(name: str) -> dict:
    """The shape of ``@FILE``, pretrain_gpt.py flags one a line as ``pretrain_gpt.py @FILE``
    reads them (a converted checkpoint's model_flags.txt): the model the trainer will build."""
    path = Path(name[1:])
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ModelError(f"--model {name}: {path} is not a readable flag file "
                         f"({exc.__class__.__name__})") from None
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for key, flag in SHAPE_FLAGS.items():
        parser.add_argument(flag, dest=key, type=int)
    parser.add_argument("--normalization", default="LayerNorm")
    for flag in ("--swiglu", "--group-query-attention", "--disable-bias-linear",
                 "--untie-embeddings-and-output-weights"):
        parser.add_argument(flag, action="store_true")
    try:
        flags, _ = parser.parse_known_args(lines)
    except argparse.ArgumentError as exc:
        raise ModelError(f"--model {name}: {exc}") from None
    shape = {key: value for key, value in vars(flags).items()
             if key in SHAPE_FLAGS and value is not None}
    if not flags.group_query_attention:  # the trainer's rule: groups only with that flag
        shape.pop("num_query_groups", None)
    shape.update(swiglu=flags.swiglu, normalization=flags.normalization,
                 disable_bias_linear=flags.disable_bias_linear,
                 tie_embeddings=not flags.untie_embeddings_and_output_weights)
    return shape


def model_shape(name: str) -> dict:
    """The shape dict (num_layers, hidden_size, ffn_hidden_size, num_attention_heads,
    vocab_size, optional num_query_groups/kv_channels/swiglu/normalization/
    disable_bias_linear/tie_embeddings) of a preset, a JSON file, or ``@FILE`` of
    pretrain_gpt.py flags."""
    if name in MODELS:
        layers, hidden, ffn, heads = MODELS[name]
        return {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn,
                "num_attention_heads": heads, "vocab_size": DEFAULT_VOCAB_SIZE}
    if name.startswith("@"):
        shape = _flag_file_shape(name)
    else:
        try:
            shape = json.loads(Path(name).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelError(f"--model {name}: neither {', '.join(MODELS)}, a readable JSON "
                             f"file nor @FILE of trainer flags ({exc.__class__.__name__})"
                             ) from None
    missing = [SHAPE_FLAGS[key] if name.startswith("@") else key
               for key in REQUIRED_MODEL_KEYS if key not in shape]
    if missing:
        raise ModelError(f"--model {name}: the file lacks {', '.join(missing)}")
    shape.setdefault("ffn_hidden_size", 4 * shape["hidden_size"])
    return shape


#: The shape keys a traced model takes from a shape dict (model_shape's keys).
TRACED_SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "kv_channels", "vocab_size", "swiglu", "normalization",
                     "disable_bias_linear", "tie_embeddings")


def traced_model(name: Optional[str], shape: Optional[dict] = None, **fields):
    """The network a trace builds (memo_ext.planner.trace.request.TracedModel): preset
    ``name``'s (None: none), with ``shape``'s given entries over it, and ``fields``. A preset's
    FFN size stays only where the hidden size is the preset's."""
    from memo_ext.planner.trace.request import TracedModel

    values = {"vocab_size": DEFAULT_VOCAB_SIZE}
    if name is not None:
        layers, hidden, ffn, heads = MODELS[name]
        values.update(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                      num_attention_heads=heads, name=name)
    given = {key: value for key, value in (shape or {}).items()
             if key in TRACED_SHAPE_KEYS and value is not None}
    if name is not None and given.get("hidden_size", values["hidden_size"]) != \
            values["hidden_size"] and given.get("ffn_hidden_size") is None:
        values["ffn_hidden_size"] = None
    values.update(given)
    values.update({key: value for key, value in fields.items() if value is not None})
    return TracedModel(**values)


def padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int
) -> int:
    """Round ``vocab_size`` up to a multiple of divisible_by * TP (Megatron's padding rule; the
    trainer's tokenizer module and the estimator's CPU profile both use this one).

    The embedding table is split row-wise across tensor-parallel ranks, and each shard should keep
    a GEMM-friendly size, hence the product.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab size must be positive, got {vocab_size}")
    if make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by must be positive, got {make_vocab_size_divisible_by}"
        )
    if tensor_model_parallel_size < 1:
        raise ValueError(
            f"--tensor-model-parallel-size must be positive, got {tensor_model_parallel_size}"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple
