"""tools/trace.py --memo-mlp-tile-size traces the trainer's tiled MLP (a module of its own:
the tracer's fake process group needs a process where torch.distributed is not initialised,
which test_tiled_mlp.py's in-process megatron is)."""

from __future__ import annotations

SEQ, CP, TP, HIDDEN, TILE = 512, 2, 2, 64, 64


def _largest_mlp_allocation(tile_tokens: int) -> tuple[int, int]:
    """(largest allocation of layer 0's fc1/fc2 in the iteration, number of TiledMLP modules)
    in a fake-tensor trace of a small bf16 model at TP=2+SP, CP=2."""
    from megatron.training import tracing
    from megatron.memo_tools.cli import trace as tool
    from memo_ext.tiled_mlp import TiledMLP

    opts = tool.request_from_argv([
        "--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--vocab-size", "512", "--untie-embeddings-and-output-weights",
        "--tensor-model-parallel-size", str(TP), "--context-parallel-size", str(CP),
        "--bf16", "--use-distributed-optimizer", "--memo-mlp-tile-size", str(tile_tokens)])
    with tracing.traced_rank(opts) as rank:
        tiled_modules = sum(isinstance(m, TiledMLP) for m in rank.model.modules())
        trace = rank.record()
    largest = max(event["bytes"] for event in trace.events if event["action"] == "alloc"
                  and (event["module"] or "").startswith("decoder.layers.0.mlp.linear_fc"))
    return largest, tiled_modules


def test_tracer_traces_the_tiled_mlp():
    """With the flag the traced model has the trainer's TiledMLP in both layers, and its
    fc1/fc2 allocate at most one tile's [TILE, 1, ffn/TP] (bf16) in forward, recompute and
    backward, where the untiled MLP allocates [s/CP, 1, ffn/TP]."""
    ffn_per_rank = 4 * HIDDEN // TP
    untiled, untiled_modules = _largest_mlp_allocation(0)
    tiled, tiled_modules = _largest_mlp_allocation(TILE)
    assert (untiled_modules, tiled_modules) == (0, 2)
    assert untiled == SEQ // CP * ffn_per_rank * 2
    assert tiled == TILE * ffn_per_rank * 2
