"""bench/pareto.py's own logic: the Pareto front of the recommender's rows and the comparison
with a published point (its estimator runs are the benchmark, not a test)."""

from __future__ import annotations


import pytest

from tests.conftest import REPO_ROOT, load_script


@pytest.fixture(scope="module")
def pareto():
    return load_script(REPO_ROOT / "bench" / "pareto.py", "pareto_bench")


def _row(seq: int, mfu: float) -> dict:
    return {"layout": f"{seq}@{mfu}", "seq": seq, "mfu": mfu, "peak_device_gib": 70.0,
            "host_gb_per_node": 1000.0, "trainer_flags": ["--seq-length", str(seq)]}


def test_front_keeps_rows_no_other_row_beats_on_length_and_mfu(pareto):
    rows = [_row(2_000_000, 0.45), _row(2_000_000, 0.40), _row(1_700_000, 0.46),
            _row(1_700_000, 0.44), _row(1_000_000, 0.46), _row(1_000_000, 0.52)]
    front = [(r["seq"], r["mfu"]) for r in pareto.pareto_front(rows)]
    assert front == [(2_000_000, 0.45), (1_700_000, 0.46), (1_000_000, 0.52)]


def test_anchor_comparison_says_ahead_or_behind_on_length_and_mfu(pareto):
    memo = next(a for a in pareto.ANCHORS if a["system"] == "MEMO")
    record = {"answer": {"rows": [_row(1_966_080, 0.454), _row(1_703_936, 0.457)]}}
    text = pareto.ours_against(memo, record)
    assert text.startswith("1,966,080 tokens, 1.88x the published length: ahead")
    assert text.endswith("MFU 45.4% vs 52.30%: behind")
    assert pareto.ours_against(memo, {"answer": {"rows": []}}) == "nothing fits"
    upipe = next(a for a in pareto.ANCHORS if a["system"] == "UPipe")
    assert "behind" in pareto.ours_against(upipe, record) and "MFU" not in \
        pareto.ours_against(upipe, record)
