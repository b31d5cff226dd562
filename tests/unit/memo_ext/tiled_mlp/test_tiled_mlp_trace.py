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


def test_tracer_traces_the_norms_in_the_tiles():
    """tools/trace.py --memo-tile-norms gives the trainer the flag, its model has both norms of
    each layer in the tiles, and the trace allocates no whole-sequence norm output: the layer's
    norm modules allocate nothing, where without the flag each allocates its output
    [s/CP/TP, 1, h] (bf16)."""
    from megatron.training import tracing
    from megatron.memo_tools.cli import trace as tool

    def norm_allocations(extra):
        request = tool.request_from_argv([
            "--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
            "--seq-length", str(SEQ), "--vocab-size", "512",
            "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", str(TP),
            "--context-parallel-size", str(CP), "--bf16", "--use-distributed-optimizer",
            "--memo-mlp-tile-size", str(TILE), "--memo-attention-projection-tiles",
            str(SEQ // CP // TILE), *extra])
        with tracing.traced_rank(request) as rank:
            moved = [m for m in rank.model.modules() if getattr(m, "tile_norm", None)]
            trace = rank.record()
        return request, len(moved), [
            event["bytes"] for event in trace.events if event["action"] == "alloc"
            and (event["module"] or "").endswith("layernorm")
            and (event["module"] or "").startswith("decoder.layers.")]

    request, moved, allocations = norm_allocations(["--memo-tile-norms"])
    assert "--memo-tile-norms" in tracing.trainer_argv(request)
    assert (moved, allocations) == (4, [])
    _, moved, allocations = norm_allocations([])
    assert moved == 0
    assert max(allocations) == SEQ // CP // TP * HIDDEN * 2
