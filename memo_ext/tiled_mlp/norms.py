"""Norms in the tiles (``--memo-tile-norms``): a layer's pre-MLP norm runs on each MLP tile and
its input norm on each QKV projection tile, recomputed with the tile in backward.

Without it the layer normalises the whole sequence once and the tiled module saves the norm's
output, [s/CP/TP, b, h]: a whole layer input per norm, on top of the norm's own input, which
the norm saves anyway. In it, the tiled module receives the norm's input (saved once, for both
uses) and normalises each tile of rows before its GEMM: the norm is position-wise, so every row
gets the value the whole-sequence norm gives it, and the normalised sequence never exists.
Under sequence parallelism a tile is rows of this rank's shard, normalised before the tile's
all-gather, as the whole shard was.

:func:`with_tile_norms` rewires a built model: each norm that feeds a tiled module becomes an
instance of a subclass of its own class whose ``forward`` returns its input, and whose
``normalize`` is the class's forward; the tiled module keeps a plain (unregistered) reference
to it. The norm stays where it was, the same object with the same parameters, so parameter
names, checkpoints, gradient buffers and the sequence-parallel gradient sum are unchanged.

Hand-written: megatron-core fuses a norm into a projection only inside Transformer Engine's
LayerNormColumnParallelLinear, which saves the normalised input whole.
"""

from __future__ import annotations

import functools

import torch

from memo_ext.tiled_mlp.linear import TiledColumnParallelLinear
from memo_ext.tiled_mlp.module import TiledMLP


@functools.lru_cache(maxsize=None)
def _deferred(norm_class: type) -> type:
    """``norm_class`` with its forward deferred to the tiles (module docstring)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # the tiled module after this norm normalises each tile

    def normalize(self, tile: torch.Tensor) -> torch.Tensor:
        return norm_class.forward(self, tile)

    name = f"TileDeferred{norm_class.__name__}"
    return type(name, (norm_class,), {"forward": forward, "normalize": normalize,
                                      "__module__": __name__, "__qualname__": name})


def _defer(norm: torch.nn.Module, tiled: torch.nn.Module) -> None:
    norm.__class__ = _deferred(type(norm))
    # A plain attribute, not a submodule: the norm is registered in its layer already.
    tiled.__dict__["tile_norm"] = norm


def with_tile_norms(model: torch.nn.Module) -> None:
    """Move every transformer layer's norms of ``model`` into the tiled modules they feed
    (module docstring): the pre-MLP norm into a TiledMLP, the input norm into a tiled QKV
    projection (megatron.training.arguments refuses the flag where there is neither)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for layer in model.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        qkv = getattr(layer.self_attention, "linear_qkv", None)
        for norm, tiled, kind in ((layer.pre_mlp_layernorm, layer.mlp, TiledMLP),
                                  (layer.input_layernorm, qkv, TiledColumnParallelLinear)):
            if isinstance(tiled, kind) and not hasattr(norm, "normalize"):
                _defer(norm, tiled)
