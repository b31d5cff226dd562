"""The sequence-tiled MLP in the trainer: 20 iterations of pretrain_gpt.py with
--memo-mlp-tile-size give the untiled run's losses to 1e-5 relative at TP=2+SP, with and
without --memo-offload (--deterministic-mode, dropout 0, fp32 on CPU); so do the attention's
tiled projections and head chunks with MEMO's two offload modes, with the norms in the tiles
too (--memo-tile-norms).

Tile 24 tokens over a 64-token sequence: 12 rows per TP rank, so each rank's 32 rows run as
tiles of 12, 12 and 8 (and under MEMO's alpha 0.25 its kept 8 rows as one tile, its dropped 24
rows as 12 + 12). --memo-telemetry (CPU tracker; changes no loss) shows that the tiles really
ran: the activations alive at the peak lose (at least) what the untiled MLP saved for
backward."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_GPT_ARGS, read_records, run_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = TINY_GPT_ARGS + ["--deterministic-mode", "--position-embedding-type", "rope",
                          "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--memo-telemetry"]
TILE = ["--memo-mlp-tile-size", "24"]
MEMO = ["--memo-offload", "--memo-alpha", "0.25"]
# The whole layer tiled (what the recommender's tiled layouts run): the attention's projections
# in tiles of 24 tokens too, and its 2 query groups per TP rank one at a time.
LAYER = TILE + ["--memo-attention-projection-tile-size", "24", "--memo-attention-head-chunks", "2"]
# What each of the 4 layers' untiled MLP saves besides its input: fc1's output and GeLU's,
# [64 tokens (gathered), micro-batch 2, ffn 256 / TP 2] fp32 each.
MLP_SAVED_BYTES = 4 * 2 * 64 * 2 * 128 * 4

_untiled: list[dict] = []


def _run(extra: list[str], tmp_path) -> tuple[dict[int, float], list[dict]]:
    metrics = tmp_path / "metrics.jsonl"
    result = run_trainer(2, COMMON + extra + ["--log-metrics-jsonl", str(metrics)])
    if "--memo-offload" in extra:
        assert "> MEMO offload: alpha" in result.stdout
    records = read_records(metrics)
    losses = {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}
    return losses, [r for r in records if "mem_activations_mib" in r]


def _untiled_run(tmp_path_factory):
    if not _untiled:
        _untiled.extend(_run([], tmp_path_factory.mktemp("untiled")))
    return _untiled


@pytest.mark.parametrize("extra", [TILE, TILE + MEMO,
                                   LAYER + MEMO + ["--memo-checkpoint-layers", "1"],
                                   LAYER + MEMO + ["--memo-checkpoint-layers", "1",
                                                   "--memo-tile-norms"]],
                         ids=["tiled", "tiled_memo_offload", "tiled_layer_mixed_modes",
                              "tile_norms_mixed_modes"])
def test_tiled_mlp_losses_equal_untiled(extra, tmp_path, tmp_path_factory):
    (losses, memory), (reference, reference_memory) = (_run(extra, tmp_path),
                                                       _untiled_run(tmp_path_factory))
    assert sorted(losses) == sorted(reference) == list(range(1, 21))
    for iteration, loss in reference.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-5), iteration
    if extra == TILE:
        activations = max(r["mem_activations_mib"] for r in memory) * 2**20
        untiled = max(r["mem_activations_mib"] for r in reference_memory) * 2**20
        # At least the saved outputs; measured 32 KiB more (an [s, b, h] SP all-gather that
        # is tile-sized when tiled).
        assert untiled - activations >= MLP_SAVED_BYTES, (untiled, activations)
