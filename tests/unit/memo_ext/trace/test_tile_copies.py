"""memo_ext.trace.tile_copies: the tracer records the middle tiles of a loop (the tiled MLP's
and projections' sequence tiles, the attention's head chunks, a ring's steps, the chunked
loss's chunks) as copies of the
third, and the trace is the one running every tile records, event for event and in its work;
blocks that the copy would not reproduce run every tile."""

from __future__ import annotations

import pytest

from megatron.training import tracing
from memo_ext import tile_loop
from memo_ext.trace import fake_fast_path, tile_copies
from tests.conftest import trace_request

SHAPE = ["--num-layers", "3", "--hidden-size", "128", "--num-attention-heads", "8",
         "--vocab-size", "512", "--untie-embeddings-and-output-weights", "--bf16",
         "--use-distributed-optimizer"]
TILED = ["--memo-mlp-tiles", "8", "--memo-attention-projection-tiles", "8"]


def _record(argv: list, seq: int, copying: bool, monkeypatch) -> tuple:
    """(trace, loops copied) of the tracer's request ``argv`` at ``seq`` tokens; without
    ``copying``, the reference: every tile run, each op through FakeTensorMode (no
    memo_ext.trace.fake_fast_path either, so the default cases check it too)."""
    copied = []
    emit = tile_copies._emit_copies

    def counting(recorder, template, plan, copies):
        copied.append(copies)
        emit(recorder, template, plan, copies)

    with monkeypatch.context() as patch:
        patch.setattr(tile_copies, "_emit_copies", counting)
        if not copying:
            patch.setattr(tile_copies, "MIN_TILES_TO_COPY", 1 << 30)
            patch.setattr(fake_fast_path, "view", lambda *args: fake_fast_path.NOT_HANDLED)
            patch.setattr(fake_fast_path, "device_query",
                          lambda *args: fake_fast_path.NOT_HANDLED)
        trace, _ = tracing.record(trace_request(argv, seq))
    return trace, copied


@pytest.mark.parametrize("layout", [
    # MEMO offload (its warm-up forward ended by abandon_forward) over a CP=2 ring, 8 head
    # chunks of one query head, 4 sharing each of 2 GQA groups (their dK/dV summed), and the
    # chunked loss in 8 chunks of 256 of the rank's 2048 tokens
    ["--context-parallel-size", "2", "--memo-offload", "--memo-alpha", "1",
     "--num-query-groups", "2", "--memo-attention-head-chunks", "8",
     "--trainer-args=--cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked "
     "--cross-entropy-chunk-size 256"],
    # Megatron's full recompute (the tiles run again inside the recompute) at TP=2 with
    # sequence parallelism: the projections' tiles and the loss's 8 chunks (each gathering
    # 256 positions of both ranks) gather and scatter across TP ranks. Slow (7 s): the default
    # case covers every loop.
    pytest.param(["--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
                  "--memo-attention-head-chunks", "4",
                  "--trainer-args=--cross-entropy-loss-fusion --cross-entropy-fusion-impl "
                  "chunked --cross-entropy-chunk-size 512"], marks=pytest.mark.slow),
    # a CP=8 ring without tiles: rank 0's steps 1..7 attend alike tiles and are copied
    ["--context-parallel-size", "8"],
], ids=["memo-cp2", "full-recompute-tp2", "ring-cp8"])
def test_copied_tiles_record_the_trace_of_every_tile(layout, monkeypatch):
    argv = [*SHAPE, *TILED, *layout]
    copied, copied_loops = _record(argv, 4096, True, monkeypatch)
    every, none_copied = _record(argv, 4096, False, monkeypatch)
    assert copied_loops and not none_copied
    # 8 tiles (head chunks, ring steps): 3 + 1 run, 4 copied; 4 head chunks and a ring of 2
    # are too few to copy
    assert set(copied_loops) == {4}
    assert copied.events == every.events
    assert copied.header == every.header  # the work counts among it


def _alloc(event_id: int, nbytes: int = 512, op: str = "aten.mm.default") -> list:
    return [event_id, "alloc", nbytes, 0, 0, "forward", "activation", 0, "device", "mlp", op]


def _free(event_id: int, nbytes: int = 512) -> list:
    return [event_id, "free", nbytes, 0, 0, "forward", "activation", 0, "device", "mlp", None]


def _tiles(blocks: int, late_free: bool = True) -> list[list[list]]:
    """``blocks`` blocks of one loop: each allocates a tile-sized 512 B, frees a 256 B scratch
    it allocated, and (``late_free``) frees the previous block's 512 B at its start."""
    out, ids = [], iter(range(1000))
    previous = None
    for _ in range(blocks):
        block = []
        if previous is not None and late_free:
            block.append(_free(previous))
        keep, scratch = next(ids), next(ids)
        block += [_alloc(keep), _alloc(scratch, 256), _free(scratch, 256)]
        previous = keep
        out.append(block)
    return out


def test_copy_plan_of_alike_blocks():
    plan = tile_copies.copy_plan(_tiles(3))
    assert plan == [("prev", 0), ("alloc", 0), ("alloc", 1), ("own", 1)]


def test_copy_plan_refuses_what_copies_would_not_reproduce():
    unlike = _tiles(3)
    unlike[2][2][2] = 1024  # block 2's scratch is larger than block 1's
    assert tile_copies.copy_plan(unlike) is None
    # block 1's leftover is never freed: each copy would leave one more behind
    assert tile_copies.copy_plan(_tiles(3, late_free=False)) is None
    older = _tiles(3)
    older[2][0][0] = older[0][0][0]  # block 2 frees block 0's allocation, not block 1's
    assert tile_copies.copy_plan(older) is None


def test_loops_run_every_tile_without_a_repeater():
    """Training installs no repeater: every tile runs. The tracer's is gone once a trace is
    built, and loops of fewer than MIN_TILES_TO_COPY tiles run every tile under it too."""
    assert list(tile_loop.tile_indices(16)) == list(range(16))
    with tracing.traced_rank(trace_request([*SHAPE, *TILED], 1024)) as rank:
        assert tile_loop._repeater is not None
        assert list(rank.recorder.repeat_tiles(4)) == [0, 1, 2, 3]
    assert tile_loop._repeater is None
