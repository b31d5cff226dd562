"""RoPE scaling flags (Megatron-LM's spellings and defaults), their validation, and the config
attributes megatron.core's YaRN path reads.

The rules themselves are megatron.core 0.16.1's: linear position interpolation and Llama 3.1's
rule in ``RotaryEmbedding``, YaRN in ``YarnRotaryEmbedding`` with its attention temperature
applied to q and k by ``SelfAttention`` (docs/rope_scaling.md). Imports nothing from
megatron.core, so validation stays ahead of it.
"""

from __future__ import annotations

import argparse

# Megatron-LM's defaults for the YaRN flags it leaves at None (megatron.training.argument_utils
# ._apply_yarn_config_from_args); megatron.core's YarnRotaryEmbedding has the same defaults.
# Not --rotary-scaling-factor: upstream's default 1 would turn YaRN off silently, so it is
# required here.
YARN_DEFAULTS = {
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "yarn_original_max_position_embeddings": 4096,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_correction_range_round_to_int": True,
}
LLAMA3_DEFAULT_FACTOR = 8.0


class RopeScalingError(ValueError):
    """A RoPE scaling flag combination that cannot run; the message names the flag and fix."""


def add_rope_scaling_args(group: argparse._ArgumentGroup) -> None:
    """The scaling flags, in the group that holds --rotary-base and --rotary-percent. Those
    left at None here have Megatron-LM's defaults, filled in by :func:`validate_rope_scaling`
    (None tells a flag given without its rule from one left alone)."""
    group.add_argument(
        "--rotary-seq-len-interpolation-factor", type=float, default=None,
        help="Linear position interpolation for --position-embedding-type rope: positions are "
        "divided by this factor (transformers' rope_type 'linear').")
    group.add_argument(
        "--use-rope-scaling", action="store_true",
        help="Llama 3.1's frequency-dependent RoPE scaling for --position-embedding-type rope "
        "(transformers' rope_type 'llama3'; low/high_freq_factor 1/4 and "
        "original_max_position_embeddings 8192, fixed by megatron.core).")
    group.add_argument(
        "--rope-scaling-factor", type=float, default=None,
        help=f"Factor of --use-rope-scaling (default {LLAMA3_DEFAULT_FACTOR:g}).")
    group.add_argument(
        "--rotary-scaling-factor", type=float, default=None,
        help="YaRN's scaling factor for --position-embedding-type yarn (required with it).")
    group.add_argument(
        "--mscale", type=float, default=None,
        help="YaRN attention temperature numerator coefficient (default 1.0).")
    group.add_argument(
        "--mscale-all-dim", type=float, default=None,
        help="YaRN attention temperature denominator coefficient (default 0.0).")
    group.add_argument(
        "--yarn-original-max-position-embeddings", type=int, default=None,
        help="Context length the model was pretrained with, before YaRN (default 4096).")
    group.add_argument("--yarn-beta-fast", type=float, default=None,
                       help="YaRN: rotations above which a dimension extrapolates (default 32).")
    group.add_argument("--yarn-beta-slow", type=float, default=None,
                       help="YaRN: rotations below which a dimension interpolates (default 1).")
    group.add_argument(
        "--yarn-correction-range-round-to-int", action="store_true", default=None,
        help="Round YaRN's correction range to whole dimensions (default; transformers' "
        "truncate=True).")
    group.add_argument(
        "--no-yarn-correction-range-round-to-int", action="store_false",
        dest="yarn_correction_range_round_to_int",
        help="Keep YaRN's correction range fractional (transformers' truncate=False).")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RopeScalingError(message)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate_rope_scaling(args: argparse.Namespace) -> None:
    """Refuse scaling flags without their rule, two rules at once and out-of-range values;
    fill the defaults of the rule in use (in place)."""
    kind = args.position_embedding_type
    interpolation = args.rotary_seq_len_interpolation_factor
    for flag, given in (("--use-rope-scaling", args.use_rope_scaling),
                        ("--rotary-seq-len-interpolation-factor", interpolation is not None)):
        _require(not given or kind == "rope", f"{flag} scales rotary embeddings; it needs "
                 f"--position-embedding-type rope, got {kind}")
    _require(args.rope_scaling_factor is None or args.use_rope_scaling,
             "--rope-scaling-factor has no effect without --use-rope-scaling; add it")
    _require(not (args.use_rope_scaling and interpolation is not None),
             "--use-rope-scaling and --rotary-seq-len-interpolation-factor are two scaling rules; "
             "keep one")
    if args.rope_scaling_factor is None:
        args.rope_scaling_factor = LLAMA3_DEFAULT_FACTOR
    for flag, factor in (("--rope-scaling-factor", args.rope_scaling_factor),
                         ("--rotary-seq-len-interpolation-factor", interpolation),
                         ("--rotary-scaling-factor", args.rotary_scaling_factor)):
        _require(factor is None or factor >= 1.0,
                 f"{flag} must be >= 1 (it stretches the pretrained context), got {factor}")
    if kind != "yarn":
        for name in ("rotary_scaling_factor", *YARN_DEFAULTS):
            _require(getattr(args, name) is None, f"{_flag(name)} is a YaRN flag; add "
                     "--position-embedding-type yarn or drop it")
        return
    _require(args.rotary_scaling_factor is not None,
             "--position-embedding-type yarn needs --rotary-scaling-factor F (new context length "
             "/ --yarn-original-max-position-embeddings)")
    # megatron.core's YarnRotaryEmbedding rotates all kv-channels whatever rotary_percent says.
    _require(args.rotary_percent == 1.0, f"--position-embedding-type yarn rotates every "
             f"channel; drop --rotary-percent {args.rotary_percent}")
    for name, default in YARN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    original = args.yarn_original_max_position_embeddings
    _require(original > 0,
             f"--yarn-original-max-position-embeddings must be positive, got {original}")


def yarn_config_attributes(args: argparse.Namespace) -> dict:
    """The ``yarn_*`` attributes GPTModel's yarn branch and SelfAttention's temperature
    (``_yarn_get_concentration_factor_from_config``) read off a plain TransformerConfig, as
    Megatron-LM's ``_apply_yarn_config_from_args`` sets them; empty unless YaRN."""
    if args.position_embedding_type != "yarn":
        return {}
    return {
        "yarn_rotary_scaling_factor": args.rotary_scaling_factor,
        "yarn_original_max_position_embeddings": args.yarn_original_max_position_embeddings,
        "yarn_beta_fast": args.yarn_beta_fast,
        "yarn_beta_slow": args.yarn_beta_slow,
        "yarn_mscale": args.mscale,
        "yarn_mscale_all_dim": args.mscale_all_dim,
        "yarn_correction_range_round_to_int": args.yarn_correction_range_round_to_int,
    }
