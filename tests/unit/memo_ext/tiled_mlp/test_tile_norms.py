"""Norms in the tiles (memo_ext.tiled_mlp.norms, --memo-tile-norms): the same loss and
gradients as the tiles fed by whole-sequence norms (plain, inside MEMO's layer in both of its
modes, under TP=2+SP on gloo), the same parameter names, less saved by MEMO, and the flag's
refusals."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_GPT_ARGS
from tests.gloo_ranks import run_ranks
from tests.unit.memo_ext.tiled_mlp.test_tiled_mlp import (
    MODEL_RELATIVE_TOLERANCE,
    _loss_and_grads,
    _memo_saved_bytes,
    _model_args,
    assert_close,
)

# Tile 12 over 64 tokens: five tiles and one of 4 rows, for the MLP and the QKV projection.
TILES = ["--memo-mlp-tile-size", "12", "--memo-attention-projection-tile-size", "12"]


def _assert_same(loss, grads, reference_loss, reference):
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert sorted(grads) == sorted(reference)  # the same parameters under the same names
    for name, expected in reference.items():
        assert_close(grads[name], expected, name, MODEL_RELATIVE_TOLERANCE)


def test_norms_in_the_tiles_give_the_same_loss_and_gradients(megatron_world):
    from memo_ext.tiled_mlp import TiledColumnParallelLinear, TiledMLP

    _, reference_loss, reference = _loss_and_grads(_model_args(TILES))
    model, loss, grads = _loss_and_grads(_model_args([*TILES, "--memo-tile-norms"]))
    moved = [m for m in model.modules() if isinstance(m, (TiledMLP, TiledColumnParallelLinear))
             and m.tile_norm is not None]
    assert len(moved) == 12  # both norms of each of 6 layers
    layer = model.decoder.layers[0]
    assert layer.mlp.tile_norm is layer.pre_mlp_layernorm  # the layer's own, not a copy
    assert isinstance(layer.pre_mlp_layernorm, torch.nn.LayerNorm)
    assert torch.equal(layer.pre_mlp_layernorm(reference_input := torch.ones(3, 1, 64)),
                       reference_input)  # the layer's call passes the input to the tiles
    _assert_same(loss, grads, reference_loss, reference)


@pytest.mark.parametrize("memo", [("0.5", 0), ("0", 3)], ids=["alpha0.5", "checkpoint3"])
def test_inside_memo_the_norm_outputs_are_no_longer_saved(megatron_world, memo):
    """MEMO's (a) layers run the MLP and QKV on kept and dropped tokens apart (alpha 0.5), its
    (b) layers megatron-core's forward in a drop region (3 of 6 layers). The loss and gradients
    are the tiles' with whole-sequence norms; what MEMO offloads and recomputes loses the norms'
    outputs, one [tokens, batch, hidden] fp32 tensor per norm and layer, and the LayerNorms'
    statistics (mean and rstd, [tokens, batch] each); the norms' inputs were saved already."""
    alpha, checkpoint_layers = memo
    _, reference_loss, reference, plain = _memo_saved_bytes(_model_args(TILES), alpha,
                                                            checkpoint_layers)
    _, loss, grads, fused = _memo_saved_bytes(_model_args([*TILES, "--memo-tile-norms"]),
                                              alpha, checkpoint_layers)
    _assert_same(loss, grads, reference_loss, reference)
    norms, layers, tokens = 2, 6, 64 * 2
    per_norm = tokens * 64 * 4 + 2 * tokens * 4
    saved_less = sum(plain.values()) - sum(fused.values())
    assert saved_less == norms * layers * per_norm, (plain, fused)


def _check_tp2_sequence_parallel(rank, world_size):
    from megatron.core import parallel_state

    from megatron.training.arguments import parse_args
    from megatron.training.compat import apply_cpu_shims

    apply_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        def run(extra):
            args = parse_args(TINY_GPT_ARGS + ["--num-layers", "3", "--tensor-model-parallel-size",
                                               "2", "--sequence-parallel", *extra],
                              world_size=world_size, cuda_available=False)
            args.padded_vocab_size = 512
            return _loss_and_grads(args)

        # Tile 8 tokens = 4 rows of each rank's 32: eight tiles of a rank's shard.
        tiles = ["--memo-mlp-tile-size", "8", "--memo-attention-projection-tile-size", "8"]
        _, reference_loss, reference = run(tiles)
        _, loss, grads = run([*tiles, "--memo-tile-norms"])
        _assert_same(loss, grads, reference_loss, reference)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.distributed
def test_norms_in_the_tiles_under_tp2_sequence_parallel():
    run_ranks(2, _check_tp2_sequence_parallel, timeout=180)


def test_flag_refusals():
    from megatron.training.arguments import ArgumentValidationError, parse_args

    def parse(extra):
        return parse_args(TINY_GPT_ARGS + extra, world_size=1, cuda_available=False)

    assert not parse([]).memo_tile_norms
    assert parse(["--memo-mlp-tile-size", "8", "--memo-tile-norms"]).memo_tile_norms
    for extra, message in [
        (["--memo-tile-norms"], "give --memo-mlp-tile-size or "
                                "--memo-attention-projection-tile-size, or drop it"),
        (["--memo-mlp-tile-size", "8", "--memo-tile-norms", "--recompute-granularity",
          "selective", "--recompute-modules", "layernorm"], "drop layernorm from"),
    ]:
        with pytest.raises(ArgumentValidationError, match=message) as error:
            parse(extra)
        assert "\n" not in str(error.value)
