"""A Hugging Face config.json of the Llama, Mistral or Qwen2 family read into the shape of the
network (:class:`Architecture`), and the trainer's flag line that builds that network."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron.memo_tools.hf_checkpoint.errors import ConversionError
from megatron.memo_tools.hf_checkpoint.rope import rope_flags
from memo_ext.flags import render_flags

FAMILIES = ("llama", "mistral", "qwen2")
DEFAULT_VOCAB_DIVISOR = 128  # --make-vocab-size-divisible-by's default


@dataclass(frozen=True)
class Architecture:
    """What the weight mapping needs of a config.json."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_epsilon: float
    vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    attention_dropout: float


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; a missing or malformed file is a ConversionError. (Here and
    not in safetensors_io, which imports torch: a missing config.json is refused at once.)"""
    if not path.is_file():
        raise ConversionError(f"{path} does not exist; point the flag at a Hugging Face model "
                              "directory (config.json and *.safetensors)")
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path} is not valid JSON ({error}); re-download it") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def read_config(path: Path) -> dict:
    """config.json of a model directory (or the file itself)."""
    path = Path(path)
    return read_json(path / "config.json" if path.is_dir() else path)


def _positive_int(config: dict, key: str, source: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConversionError(f"{source}: {key} {value!r} must be a positive integer")
    return value


def _check_supported(config: dict, source: str, ignore_sliding_window: bool) -> None:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ConversionError(f"{source}: model_type {model_type!r} is not supported; "
                              f"convert one of {', '.join(FAMILIES)}")
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{source}: hidden_act {config['hidden_act']!r}: the trainer's "
                              "--swiglu gates with silu only")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ConversionError(f"{source}: {key} true is not supported (no trainer flag adds "
                                  "that bias alone); only Qwen2's query/key/value bias")
    window = config.get("sliding_window") if (
        model_type == "mistral" or config.get("use_sliding_window")) else None
    layer_types = set(config.get("layer_types") or ())
    if (window is not None or layer_types - {"full_attention"}) and not ignore_sliding_window:
        raise ConversionError(
            f"{source}: sliding_window {window} (layer_types {sorted(layer_types)}): the trainer "
            "attends to the whole causal context; pass --ignore-sliding-window to convert "
            "anyway (identical for sequences up to the window)")


def architecture(config: dict, source: str, ignore_sliding_window: bool = False) -> Architecture:
    """The network of ``config`` (``source`` names the file in errors)."""
    _check_supported(config, source, ignore_sliding_window)
    hidden = _positive_int(config, "hidden_size", source)
    heads = _positive_int(config, "num_attention_heads", source)
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or heads % kv_heads:
        raise ConversionError(f"{source}: num_key_value_heads {kv_heads!r} must divide "
                              f"num_attention_heads {heads}")
    head_dim = config.get("head_dim") or hidden // heads
    if config.get("head_dim") is None and hidden % heads:
        raise ConversionError(f"{source}: hidden_size {hidden} is not divisible by "
                              f"num_attention_heads {heads} and head_dim is not given")
    epsilon = config.get("rms_norm_eps", 1e-6)
    if not isinstance(epsilon, (int, float)) or epsilon <= 0:
        raise ConversionError(f"{source}: rms_norm_eps {epsilon!r} must be a positive number")
    return Architecture(
        model_type=config["model_type"],
        num_layers=_positive_int(config, "num_hidden_layers", source),
        hidden_size=hidden,
        ffn_hidden_size=_positive_int(config, "intermediate_size", source),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm_epsilon=float(epsilon),
        vocab_size=_positive_int(config, "vocab_size", source),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=config["model_type"] == "qwen2",
        max_position_embeddings=_positive_int(config, "max_position_embeddings", source),
        attention_dropout=float(config.get("attention_dropout", 0.0)),
    )


def trainer_flags(config: dict, source: str, make_vocab_size_divisible_by: int =
                  DEFAULT_VOCAB_DIVISOR, ignore_sliding_window: bool = False) -> list[str]:
    """pretrain_gpt.py's model flags for ``config``: the network, its positions, dropout as
    the model was trained (none in the MLP and residual) and the vocabulary."""
    arch = architecture(config, source, ignore_sliding_window)
    grouped = arch.num_kv_heads != arch.num_heads
    return render_flags({
        "num_layers": arch.num_layers, "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.ffn_hidden_size, "num_attention_heads": arch.num_heads,
        "group_query_attention": grouped,
        "num_query_groups": arch.num_kv_heads if grouped else None,
        "kv_channels": arch.head_dim, "normalization": "RMSNorm",
        "norm_epsilon": arch.norm_epsilon, "swiglu": True, "disable_bias_linear": True,
        "add_qkv_bias": arch.qkv_bias,
        "untie_embeddings_and_output_weights": not arch.tie_embeddings,
        **rope_flags(config, source),
        "max_position_embeddings": arch.max_position_embeddings,
        "attention_dropout": arch.attention_dropout, "hidden_dropout": 0.0,
        "vocab_size": arch.vocab_size,
        "make_vocab_size_divisible_by": make_vocab_size_divisible_by})
