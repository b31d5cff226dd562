"""A position-wise function run over sequence tiles, each tile recomputed in backward.

``tiled_recompute(function, hidden, tile_rows)`` returns ``function(hidden)`` for a function
that acts on each row of ``hidden``'s first (sequence) dimension independently -- an MLP, also
under sequence parallelism, where gathering a tile from every TP rank and scattering its output
back is still per token. Forward runs the tiles one after another without recording a graph,
so at most one tile's intermediates exist; only ``hidden`` is saved for backward. Backward
re-runs each tile with a graph and back-propagates its slice of the output gradient before
moving on, so the recomputed intermediates are again one tile's.

Why a hand-written autograd Function and not ``torch.utils.checkpoint``:

- the non-reentrant checkpoint keeps its inputs alive by reference and installs its own
  saved-tensor hooks, which hide the MLP input from the hooks of MEMO's offload manager and
  SPPO's offload (they then can neither offload nor drop it); here the input is saved with
  ``ctx.save_for_backward``, so whoever packs saved tensors sees exactly one: the tile input;
- one Function for all tiles saves one tensor instead of one per tile, and lets the forward
  write each tile's result into one output.

Parameter gradients are accumulated the way Megatron's own (reentrant) activation
checkpointing accumulates them: the per-tile backward is a nested ``torch.autograd.backward``
that reaches the parameters' AccumulateGrad nodes, so the linear layers' own gradient path
(``.grad``, or ``main_grad`` through megatron DDP's per-accumulation hook, which handles
several accumulations per step) runs once per tile and sums over tiles.

The function must be deterministic and free of randomness: the recomputation restores no RNG
state. Megatron's MLP qualifies (its dropout is in the bias-dropout-add after the MLP).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from memo_ext.tile_loop import tile_indices

TileFunction = Callable[[torch.Tensor], torch.Tensor]


def tile_bounds(rows: int, tile_rows: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each tile of ``rows`` rows; the last tile may be shorter. Zero
    rows give one empty tile, so the function still runs once (and its collectives with it)."""
    if tile_rows < 1:
        raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
    if rows == 0:
        return [(0, 0)]
    return [(start, min(start + tile_rows, rows)) for start in range(0, rows, tile_rows)]


def _blocks(tensor: torch.Tensor, blocks: int) -> torch.Tensor:
    """``tensor`` [blocks * rows, ...] as [blocks, rows, ...] (a view)."""
    return tensor.view(blocks, tensor.size(0) // blocks, *tensor.shape[1:])


def _tile_of(tensor: torch.Tensor, blocks: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of each of ``tensor``'s ``blocks`` blocks, block after block (a
    view for one block, a tile-sized copy for several)."""
    if blocks == 1:
        return tensor[start:stop]
    tile = _blocks(tensor, blocks)[:, start:stop]
    return tile.reshape(blocks * (stop - start), *tensor.shape[1:])


def _run_tiles(function: TileFunction, hidden: torch.Tensor, tile_rows: int,
               input_blocks: int = 1, output_blocks: int = 1) -> torch.Tensor:
    rows = hidden.size(0) // input_blocks
    bounds = tile_bounds(rows, tile_rows)
    if len(bounds) == 1:
        return function(hidden)
    output = None
    for index in tile_indices(len(bounds)):
        start, stop = bounds[index]
        tile_output = function(_tile_of(hidden, input_blocks, start, stop))
        if tile_output.size(0) != output_blocks * (stop - start):
            raise ValueError(f"tiled function returned {tile_output.size(0)} rows for a tile of "
                             f"{output_blocks} x {stop - start}: it is not position-wise along "
                             "dimension 0")
        if output is None:
            output = tile_output.new_empty((output_blocks * rows, *tile_output.shape[1:]))
        _blocks(output, output_blocks)[:, start:stop].copy_(_blocks(tile_output, output_blocks))
        del tile_output  # this tile's intermediates are gone before the next tile starts
    return output


class _TiledRecompute(torch.autograd.Function):
    """Autograd of :func:`tiled_recompute` (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, function, tile_rows, hidden_needs_grad, input_blocks, output_blocks):
        ctx.function, ctx.tile_rows, ctx.hidden_needs_grad = function, tile_rows, hidden_needs_grad
        ctx.blocks = input_blocks, output_blocks
        ctx.save_for_backward(hidden)
        return _run_tiles(function, hidden, tile_rows, input_blocks, output_blocks)

    @staticmethod
    def backward(ctx, grad_output):
        (hidden,) = ctx.saved_tensors
        input_blocks, output_blocks = ctx.blocks
        grad_hidden = torch.empty_like(hidden) if ctx.hidden_needs_grad else None
        rows = hidden.size(0) // input_blocks
        bounds = tile_bounds(rows, ctx.tile_rows)
        for index in tile_indices(len(bounds)):
            start, stop = bounds[index]
            tile = _tile_of(hidden, input_blocks, start, stop).detach()
            tile.requires_grad_(grad_hidden is not None)
            with torch.enable_grad():
                tile_output = ctx.function(tile)
            if tile_output.requires_grad:
                torch.autograd.backward(tile_output,
                                        _tile_of(grad_output, output_blocks, start, stop))
            del tile_output  # frees the tile's recomputed graph before the next tile
            if grad_hidden is not None:
                target = _blocks(grad_hidden, input_blocks)[:, start:stop]
                if tile.grad is None:
                    target.zero_()
                else:
                    target.copy_(_blocks(tile.grad, input_blocks))
        return grad_hidden, None, None, None, None, None


def tiled_recompute(function: TileFunction, hidden: torch.Tensor, tile_rows: int,
                    parameters: Iterable[torch.Tensor] = (), input_blocks: int = 1,
                    output_blocks: int = 1) -> torch.Tensor:
    """``function(hidden)`` computed ``tile_rows`` rows (dimension 0) at a time.

    Args:
        function: position-wise along dimension 0 (row i of the output depends on row i of
            the input only), deterministic; may run collectives (every rank of a group must
            pass the same row count so that all run the same tiles).
        hidden: the input, [rows, ...].
        tile_rows: rows per tile (>= 1); the last tile takes the remainder.
        parameters: the tensors ``function`` uses besides ``hidden`` (its parameters). When
            ``hidden`` needs no gradient but one of them does, the tiles are still recorded
            for backward (the Function needs an input that requires grad to be in the graph).
        input_blocks, output_blocks: dimension 0 of the input (output) is this many equal
            blocks of rows, and a tile takes its rows from each block, block after block:
            a sequence-parallel projection's side that holds every TP rank's rows (the
            input of a row-parallel linear, the output of a column-parallel one), while the
            other side holds this rank's. ``tile_rows`` counts rows of one block.

    Without grad mode the tiles simply run one after another. With it, only ``hidden`` is
    saved and backward recomputes each tile (module docstring).
    """
    if not torch.is_grad_enabled():
        return _run_tiles(function, hidden, tile_rows, input_blocks, output_blocks)
    if hidden.size(0) % input_blocks:
        raise ValueError(f"{hidden.size(0)} rows do not split into {input_blocks} blocks")
    hidden_needs_grad = hidden.requires_grad
    if not hidden_needs_grad:
        if not any(p.requires_grad for p in parameters):
            return _run_tiles(function, hidden, tile_rows, input_blocks, output_blocks)
        hidden = hidden.detach().requires_grad_()
    return _TiledRecompute.apply(hidden, function, tile_rows, hidden_needs_grad, input_blocks,
                                 output_blocks)
