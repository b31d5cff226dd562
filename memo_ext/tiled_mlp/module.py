"""TiledMLP: megatron.core's MLP run over sequence tiles with per-tile recomputation.

Same parameters, names, initialisation and sharded state dict as megatron.core's MLP (it is a
subclass that only replaces ``forward``), so checkpoints interchange with the untiled model.
Each tile runs the unchanged ``MLP.forward``: under sequence parallelism fc1
(ColumnParallelLinear) all-gathers the tile from every TP rank, the activation (GeLU, SwiGLU)
runs on [T, b, ffn/TP], fc2 (RowParallelLinear) reduce-scatters the tile's output back. The
MLP is position-wise, so every token gets the result the untiled MLP gives it.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.mlp import MLP

from memo_ext.config import TiledMLPConfig
from memo_ext.tiled_mlp.function import tiled_recompute


class TiledMLP(MLP):
    """megatron.core's MLP whose forward tiles the sequence (module docstring).

    Args (besides MLP's): ``tile_tokens``, tokens per tile after SP's all-gather
    (``--memo-mlp-tile-size``).
    """

    #: the layer's pre-MLP norm, run on each tile (memo_ext.tiled_mlp.norms); None: the
    #: layer normalised the input
    tile_norm = None

    def __init__(self, config, submodules, tile_tokens: int, **kwargs):
        super().__init__(config, submodules, **kwargs)
        self.tile_tokens = tile_tokens
        self.tile_rows = TiledMLPConfig(mlp_tile_size=tile_tokens).tile_rows(
            config.tensor_model_parallel_size, config.sequence_parallel)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise ValueError("--memo-mlp-tile-size tiles dense MLPs only (MoE experts pass a "
                             "per-token scale); drop --memo-mlp-tile-size")
        # Other keywords (the layer's padding_mask) are not passed on: megatron's MLP ignores
        # them, and a per-token one would need slicing per tile.
        biases: list[Optional[torch.Tensor]] = [None]

        def tile_forward(tile: torch.Tensor) -> torch.Tensor:
            if self.tile_norm is not None:
                tile = self.tile_norm.normalize(tile)
            output, biases[0] = MLP.forward(self, tile)
            return output

        norm_parameters = [] if self.tile_norm is None else list(self.tile_norm.parameters())
        output = tiled_recompute(tile_forward, hidden_states, self.tile_rows,
                                 [*self.parameters(), *norm_parameters])
        # fc2 is built with skip_bias_add: its bias comes back unapplied (the layer's
        # bias-dropout-add adds it). It must be the parameter itself, identical for every tile;
        # a bias computed from the tile could not leave the tiles without its graph.
        bias = biases[0]
        if bias is not None and not isinstance(bias, torch.nn.Parameter):
            raise RuntimeError(f"{type(self.linear_fc2).__name__} returned a computed bias; the "
                               "tiled MLP needs fc2's bias parameter (skip_bias_add)")
        return output, bias
