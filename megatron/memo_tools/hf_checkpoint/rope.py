"""transformers' RoPE settings (``rope_theta`` with ``rope_scaling``, or transformers 5's
``rope_parameters``) to the trainer's RoPE flags and back, as the table "From a transformers
config" of docs/rope_scaling.md lays out."""

from __future__ import annotations

import argparse
import math
from typing import Optional

from megatron.memo_tools.hf_checkpoint.errors import ConversionError

# megatron-core's Llama 3.1 rule fixes these (docs/rope_scaling.md).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
DEFAULT_THETA = 10000.0


def rope_settings(config: dict, source: str) -> tuple[float, str, dict]:
    """(theta, rope type, scaling parameters) of a config.json in either spelling."""
    parameters = config.get("rope_parameters")
    if parameters is not None:
        nested = isinstance(parameters, dict) and any(isinstance(v, dict)
                                                      for v in parameters.values())
        if not isinstance(parameters, dict) or nested:
            raise ConversionError(f"{source}: rope_parameters per layer type are not supported; "
                                  "only one RoPE for every layer")
        theta = parameters.get("rope_theta", config.get("rope_theta", DEFAULT_THETA))
        scaling = parameters
    else:
        theta = config.get("rope_theta", DEFAULT_THETA)
        scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConversionError(f"{source}: rope_theta {theta!r} must be a positive number")
    return float(theta), kind, scaling


def _number(value, source: str, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConversionError(f"{source}: rope {key} {value!r} must be a positive number")
    return float(value)


def rope_flags(config: dict, source: str) -> dict:
    """The trainer's flags for the RoPE of ``config`` (refusing what megatron-core lacks), as
    memo_ext.flags.render_flags takes them."""
    theta, kind, scaling = rope_settings(config, source)
    if theta != int(theta):
        raise ConversionError(f"{source}: rope_theta {theta} is not a whole number, which "
                              "--rotary-base needs")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(f"{source}: partial_rotary_factor "
                              f"{config['partial_rotary_factor']} is not supported; only 1")
    base = {"rotary_base": int(theta)}
    if kind == "default":
        return {"position_embedding_type": "rope", **base}
    if kind == "linear":
        factor = _number(scaling.get("factor"), source, "factor")
        return {"position_embedding_type": "rope", **base,
                "rotary_seq_len_interpolation_factor": factor}
    if kind == "llama3":
        for key, fixed in LLAMA3_FIXED.items():
            if scaling.get(key) != fixed:
                raise ConversionError(
                    f"{source}: rope llama3 {key} {scaling.get(key)!r}: megatron-core fixes it "
                    f"to {fixed:g}; this scaling is not supported")
        factor = _number(scaling.get("factor"), source, "factor")
        return {"position_embedding_type": "rope", **base, "use_rope_scaling": True,
                "rope_scaling_factor": factor}
    if kind == "yarn":
        return _yarn_flags(config, scaling, source, base)
    raise ConversionError(f"{source}: rope type {kind!r} is not supported; use default, linear, "
                          "llama3 or yarn")


def _yarn_flags(config: dict, scaling: dict, source: str, base: dict) -> dict:
    if scaling.get("attention_factor") is not None:
        raise ConversionError(f"{source}: yarn attention_factor is not supported; give mscale "
                              "and mscale_all_dim instead")
    # transformers' defaults: the top-level value first, then the rope dict's, then
    # max_position_embeddings; the factor, when absent, from the two lengths.
    original = (config.get("original_max_position_embeddings")
                or scaling.get("original_max_position_embeddings")
                or config.get("max_position_embeddings"))
    original = _number(original, source, "original_max_position_embeddings")
    if original != int(original):
        raise ConversionError(f"{source}: yarn original_max_position_embeddings {original} is "
                              "not a whole number")
    factor = scaling.get("factor")
    if factor is None:
        factor = _number(config.get("max_position_embeddings"), source,
                         "max_position_embeddings") / original
    flags = {"position_embedding_type": "yarn", **base,
             "rotary_scaling_factor": _number(factor, source, "factor"),
             "yarn_original_max_position_embeddings": int(original)}
    for key in ("beta_fast", "beta_slow"):
        if scaling.get(key):
            flags[f"yarn_{key}"] = _number(scaling[key], source, key)
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        flags.update(mscale=float(scaling["mscale"]),
                     mscale_all_dim=float(scaling["mscale_all_dim"]))
    if scaling.get("truncate", True) is False:
        flags["no_yarn_correction_range_round_to_int"] = True
    return flags


def hf_rope(args: argparse.Namespace) -> tuple[float, Optional[dict]]:
    """(rope_theta, scaling parameters or None) of the trainer's position flags."""
    theta = float(args.rotary_base)
    if args.position_embedding_type == "rope":
        if args.rotary_seq_len_interpolation_factor is not None:
            return theta, {"rope_type": "linear",
                           "factor": float(args.rotary_seq_len_interpolation_factor)}
        if args.use_rope_scaling:
            return theta, {"rope_type": "llama3", "factor": float(args.rope_scaling_factor),
                           **LLAMA3_FIXED}
        return theta, None
    if args.position_embedding_type != "yarn":
        raise ConversionError(f"--position-embedding-type {args.position_embedding_type} has no "
                              "Hugging Face Llama/Mistral/Qwen2 spelling; only rope and yarn")
    scaling = {"rope_type": "yarn", "factor": float(args.rotary_scaling_factor),
               "original_max_position_embeddings": args.yarn_original_max_position_embeddings,
               "beta_fast": float(args.yarn_beta_fast), "beta_slow": float(args.yarn_beta_slow)}
    if args.mscale_all_dim:
        scaling.update(mscale=float(args.mscale), mscale_all_dim=float(args.mscale_all_dim))
    elif not math.isclose(args.mscale, 1.0):
        raise ConversionError(f"--mscale {args.mscale} with --mscale-all-dim 0 has no "
                              "transformers spelling; give --mscale-all-dim too")
    if not args.yarn_correction_range_round_to_int:
        scaling["truncate"] = False
    return theta, scaling


def write_rope(config: dict, args: argparse.Namespace) -> None:
    """Set the RoPE fields of ``config`` (in its own spelling) to the trainer's flags."""
    theta, scaling = hf_rope(args)
    if "rope_parameters" in config:
        config["rope_parameters"] = {"rope_theta": theta, "rope_type": "default",
                                     **(scaling or {})}
        config.pop("rope_scaling", None)
        config.pop("rope_theta", None)
    else:
        config["rope_theta"] = theta
        config["rope_scaling"] = scaling
