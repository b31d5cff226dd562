"""Sequence-tiled MLP (docs/tiled_mlp.md).

Public entry point: :func:`with_tiled_mlp`. The trainer's layer spec
(megatron.training.layer_specs), and with it MEMO's layer, SPPO and the tracer, passes its
TransformerLayer ModuleSpec and the :class:`memo_ext.config.TiledMLPConfig` of
``--memo-mlp-tile-size``; with tiling on, the spec's MLP becomes :class:`TiledMLP`, which runs
megatron.core's MLP tile by tile and recomputes each tile in backward, so one layer's MLP
working set is one tile's intermediate [T, b, ffn/TP] instead of [s, b, ffn/TP].
:func:`with_tiled_projections` does the same for the attention's QKV and output projections
(``--memo-attention-projection-tile-size``), and :func:`with_tile_norms` moves a built model's
norms into those tiles (``--memo-tile-norms``). :func:`tiled_recompute` is the mechanism
itself, for any position-wise function.
"""

from __future__ import annotations

import copy

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from memo_ext.config import MemoConfigError, TiledMLPConfig
from memo_ext.tiled_mlp.function import tile_bounds, tiled_recompute
from memo_ext.tiled_mlp.linear import TiledColumnParallelLinear, TiledRowParallelLinear
from memo_ext.tiled_mlp.module import TiledMLP
from memo_ext.tiled_mlp.norms import with_tile_norms

__all__ = ["TiledColumnParallelLinear", "TiledMLP", "TiledRowParallelLinear", "tile_bounds",
           "tiled_recompute", "with_tile_norms", "with_tiled_mlp", "with_tiled_projections"]


def with_tiled_mlp(layer_spec: ModuleSpec, config: TiledMLPConfig) -> ModuleSpec:
    """``layer_spec`` (a TransformerLayer ModuleSpec) with its MLP tiled, or ``layer_spec``
    itself when tiling is off. The input spec is not modified. Raises MemoConfigError on an
    invalid config or when the layer's MLP is not megatron.core's dense MLP."""
    config.validate()
    if not config.enabled:
        return layer_spec
    mlp = layer_spec.submodules.mlp
    if not isinstance(mlp, ModuleSpec) or mlp.module is not MLP:
        name = getattr(mlp, "module", mlp)
        raise MemoConfigError(f"--memo-mlp-tile-size tiles megatron.core's dense MLP; this layer "
                              f"has {getattr(name, '__name__', name)}: drop --memo-mlp-tile-size")
    mlp = copy.copy(mlp)
    mlp.module = TiledMLP
    mlp.params = {**(mlp.params or {}), "tile_tokens": config.mlp_tile_size}
    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(layer_spec.submodules)
    spec.submodules.mlp = mlp
    return spec


def with_tiled_projections(layer_spec: ModuleSpec, tile_tokens: int) -> ModuleSpec:
    """``layer_spec`` with its attention's linear_qkv and linear_proj run over tiles of
    ``tile_tokens`` (``--memo-attention-projection-tile-size``), or ``layer_spec`` itself for
    0. The input spec is not modified. Raises MemoConfigError when the projections are not
    megatron.core's Column/RowParallelLinear (Transformer Engine's fused ones)."""
    if not tile_tokens:
        return layer_spec
    attention = layer_spec.submodules.self_attention
    projections = attention.submodules
    if (projections.linear_qkv is not ColumnParallelLinear
            or projections.linear_proj is not RowParallelLinear):
        raise MemoConfigError("--memo-attention-projection-tile-size tiles megatron.core's "
                              "ColumnParallelLinear/RowParallelLinear projections (--transformer-"
                              "impl local); drop it")
    params = {"tile_tokens": tile_tokens}
    attention = copy.copy(attention)
    attention.submodules = copy.copy(projections)
    attention.submodules.linear_qkv = ModuleSpec(module=TiledColumnParallelLinear, params=params)
    attention.submodules.linear_proj = ModuleSpec(module=TiledRowParallelLinear, params=params)
    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(layer_spec.submodules)
    spec.submodules.self_attention = attention
    return spec
