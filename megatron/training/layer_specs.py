"""Which layer implementation a GPT model is built from.

With CUDA and Transformer Engine: megatron.core's TE spec. Otherwise megatron.core's local spec
with two substitutions from megatron.training.compat (SequenceParallelTorchNorm for the norms,
SDPACoreAttention for the core attention), which add sequence- and context-parallel support.
"""

from __future__ import annotations

import argparse
import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.training.compat.attention import SDPACoreAttention
from megatron.training.compat.norm import SequenceParallelTorchNorm


def transformer_engine_available() -> bool:
    """True when TE can be used: CUDA present and transformer_engine importable."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def local_layer_spec(args: argparse.Namespace) -> ModuleSpec:
    """megatron.core's local GPT layer spec with SP-capable norms and SDPA/CP attention."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=args.normalization))
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType[args.attn_mask_type]
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


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
                layer_norm=SequenceParallelTorchNorm,
            )
    if transformer_engine_available():
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(normalization=args.normalization)
    return TransformerBlockSubmodules(
        layer_specs=[local_layer_spec(args)] * get_num_layers_to_build(config),
        layer_norm=SequenceParallelTorchNorm,
    )
