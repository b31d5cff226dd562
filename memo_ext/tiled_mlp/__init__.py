"""Sequence-tiled MLP (docs/tiled_mlp.md).

Public entry point: :func:`with_tiled_mlp`. The trainer's layer spec
(megatron.training.layer_specs), and with it MEMO's layer, SPPO and the tracer, passes its
TransformerLayer ModuleSpec and the :class:`memo_ext.config.TiledMLPConfig` of
``--memo-mlp-tile-size``; with tiling on, the spec's MLP becomes :class:`TiledMLP`, which runs
megatron.core's MLP tile by tile and recomputes each tile in backward, so one layer's MLP
working set is one tile's intermediate [T, b, ffn/TP] instead of [s, b, ffn/TP].
:func:`tiled_recompute` is the mechanism itself, for any position-wise function.
"""

from __future__ import annotations

import copy

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from memo_ext.config import MemoConfigError, TiledMLPConfig
from memo_ext.tiled_mlp.function import tile_bounds, tiled_recompute
from memo_ext.tiled_mlp.module import TiledMLP

__all__ = ["TiledMLP", "tile_bounds", "tiled_recompute", "with_tiled_mlp"]


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
