"""Which layer implementation a GPT model is built from.

By default (``--transformer-impl local``, on CPU and GPU) megatron.core's local spec with two
substitutions: megatron.training.compat's SequenceParallelTorchNorm for the norms and
memo_ext.attention's CoreAttention (flash tiles, context parallelism as a ring) for the core
attention, the same modules tools/trace.py traces. ``--transformer-impl transformer_engine``
builds megatron.core's TE spec instead (CUDA only).
"""

from __future__ import annotations

import argparse
import copy

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.training.compat.norm import SequenceParallelTorchNorm
from megatron.training.norms import ZeroCenteredTorchNorm
from memo_ext.attention import CoreAttention
from memo_ext.config import AttentionConfig, TiledMLPConfig, config_from_args
from memo_ext.tiled_mlp import with_tiled_mlp, with_tiled_projections


def local_norm(args: argparse.Namespace):
    """The torch norm factory of the local layers: SP-capable, zero-centred with
    --apply-layernorm-1p (megatron.training.norms)."""
    return ZeroCenteredTorchNorm if getattr(args, "apply_layernorm_1p", False) \
        else SequenceParallelTorchNorm


def local_layer_spec(args: argparse.Namespace) -> ModuleSpec:
    """megatron.core's local GPT layer spec with SP-capable norms and memo_ext's attention."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=args.normalization))
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType[args.attn_mask_type]
    spec.submodules.input_layernorm = local_norm(args)
    spec.submodules.pre_mlp_layernorm = local_norm(args)
    attention = config_from_args(AttentionConfig, args)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=CoreAttention, params={"head_chunks": attention.attention_head_chunks})
    spec = with_tiled_projections(spec, attention.attention_projection_tile_size)
    return with_tiled_mlp(spec, config_from_args(TiledMLPConfig, args))  # --memo-mlp-tile-size


def gpt_block_spec(
    args: argparse.Namespace, config: TransformerConfig, memo=None, sppo=None, metp=None
) -> TransformerBlockSubmodules | ModuleSpec:
    """The transformer block of this pipeline stage; with ``memo`` (a
    memo_ext.offload.MemoOffload) its layers are MEMO layers built from the local spec, with
    ``sppo`` (a memo_ext.sppo.SubsequencePipeline) local layers with SPPO's attention, with
    ``metp`` (a memo_ext.metp.MemoryEfficientTP) local layers with METP's attention and MLP."""
    for mechanism in (memo, sppo, metp):
        if mechanism is not None:
            return TransformerBlockSubmodules(
                layer_specs=[mechanism.layer_spec(local_layer_spec(args))]
                * get_num_layers_to_build(config),
                layer_norm=local_norm(args),
            )
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return with_tiled_mlp(get_gpt_layer_with_transformer_engine_spec(
            normalization=args.normalization), config_from_args(TiledMLPConfig, args))
    return TransformerBlockSubmodules(
        layer_specs=[local_layer_spec(args)] * get_num_layers_to_build(config),
        layer_norm=local_norm(args),
    )
