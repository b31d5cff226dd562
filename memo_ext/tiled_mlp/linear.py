"""The attention's projections (linear_qkv, linear_proj) run over sequence tiles.

Under sequence parallelism megatron.core's ColumnParallelLinear all-gathers its whole input
([s/CP, b, h]: TP times a rank's share) and RowParallelLinear produces [s/CP, b, h] partial
sums before its reduce-scatter; for the longest sequences these, not the weights, set the
layer's peak (docs/memo_offload_modes.md, "The device wall"). These subclasses run the
unchanged megatron forward tile by tile through :func:`tiled_recompute`, which saves only the
input and recomputes each tile in backward, so gather buffers, partial sums and the backward's
gathered input and input gradient are one tile's. A tile takes ``tile_rows`` rows of this
rank's shard and the same rows of every other rank's (the tile's all-gather and reduce-scatter
then pair up exactly as the untiled ones do), so every token gets the untiled result. Same
parameters, names and state dict as the parent classes.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from memo_ext.config import TiledMLPConfig
from memo_ext.tiled_mlp.function import tiled_recompute


def _tiled(linear, parent, input_: torch.Tensor, input_blocks: int, output_blocks: int):
    """(output, bias) of ``parent.forward(linear, ...)`` run tile by tile."""
    biases: list[Optional[torch.Tensor]] = [None]

    norm = linear.tile_norm  # the QKV projection's input norm, run on each tile, or None

    def tile_forward(tile: torch.Tensor) -> torch.Tensor:
        if norm is not None:
            tile = norm.normalize(tile)
        output, biases[0] = parent.forward(linear, tile)
        return output

    parameters = [*linear.parameters(), *([] if norm is None else norm.parameters())]
    output = tiled_recompute(tile_forward, input_, linear.tile_rows, parameters,
                             input_blocks, output_blocks)
    bias = biases[0]
    if bias is not None and not isinstance(bias, torch.nn.Parameter):
        raise RuntimeError(f"{parent.__name__} returned a computed bias; tiles need the bias "
                           "parameter itself (skip_bias_add)")
    return output, bias


def _tile_rows(config, tile_tokens: int) -> int:
    return TiledMLPConfig(mlp_tile_size=tile_tokens).tile_rows(
        config.tensor_model_parallel_size, config.sequence_parallel,
        flag="--memo-attention-projection-tile-size")


class TiledColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear over tiles of ``tile_tokens`` tokens as the GEMM sees them (after
    the all-gather); its output holds every TP rank's rows (blocks of the tile)."""

    #: the layer's input norm, run on each tile (memo_ext.tiled_mlp.norms); None: the layer
    #: normalised the input
    tile_norm = None

    def __init__(self, *args, tile_tokens: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.tile_rows = _tile_rows(self.config, tile_tokens)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        if weight is not None or runtime_gather_output:
            raise ValueError("--memo-attention-projection-tile-size tiles linear_qkv with its "
                             "own weight and without gathering the output")
        blocks = self.tp_group.size() if self.sequence_parallel else 1
        return _tiled(self, ColumnParallelLinear, input_, 1, blocks)


class TiledRowParallelLinear(RowParallelLinear):
    """RowParallelLinear over tiles of ``tile_tokens`` tokens as the GEMM sees them (before
    the reduce-scatter); its input holds every TP rank's rows (blocks of the tile)."""

    tile_norm = None  # no norm feeds the output projection

    def __init__(self, *args, tile_tokens: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.tile_rows = _tile_rows(self.config, tile_tokens)

    def forward(self, input_: torch.Tensor):
        blocks = self.tp_group.size() if self.sequence_parallel else 1
        return _tiled(self, RowParallelLinear, input_, blocks, 1)
