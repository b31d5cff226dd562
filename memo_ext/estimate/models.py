"""GPT model presets and the ``--model`` argument shared by tools/trace.py, tools/estimate.py and
tools/sppo_plan.py (one definition; torch-free so planners import it without torch)."""

from __future__ import annotations

import json
from pathlib import Path

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


class ModelError(ValueError):
    """A --model argument that names no preset and no usable JSON file (one line)."""


def model_shape(name: str) -> dict:
    """The shape dict (num_layers, hidden_size, ffn_hidden_size, num_attention_heads,
    vocab_size, optional num_query_groups/kv_channels/swiglu) of a preset or a JSON file."""
    if name in MODELS:
        layers, hidden, ffn, heads = MODELS[name]
        return {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn,
                "num_attention_heads": heads, "vocab_size": DEFAULT_VOCAB_SIZE}
    path = Path(name)
    try:
        shape = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"--model {name}: neither {', '.join(MODELS)} nor a readable JSON "
                         f"file ({exc.__class__.__name__})") from None
    missing = [key for key in REQUIRED_MODEL_KEYS if key not in shape]
    if missing:
        raise ModelError(f"--model {name}: the file lacks {', '.join(missing)}")
    shape.setdefault("ffn_hidden_size", 4 * shape["hidden_size"])
    return shape


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
