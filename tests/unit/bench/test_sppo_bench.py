"""bench/sppo.py --quick: stage memory vs. N measured under the tracker with the formula beside
it, PP=2 runs of every N with and without MSP (iteration times, bubble ratios, the simulated
bubbles), the predicted partition and MSP comparison; report, JSON, PNG."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, subprocess_env

BENCH = REPO_ROOT / "bench" / "sppo.py"


# Slow (~3 minutes: five torchrun launches): what it measures is in the default suite elsewhere:
# offloading lowers the stage's device peak (tests/unit/memo_ext/sppo/test_sppo.py), the MSP plan, programs and
# bubbles (tests/unit/memo_ext/sppo/test_sppo_msp.py), MSP training with the trainer's task list
# (tests/distributed/test_sppo_exactness.py); only the bench's own report is left to -m slow.
@pytest.mark.slow
def test_quick_run_writes_the_report(tmp_path):
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "-o", str(tmp_path)],
                            cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "sppo.json").read_text())
    rows = {(r["subsequences"], r["offload"]): r for r in report["memory"]}
    assert set(rows) == {(n, o) for n in (1, 2, 4) for o in ("none", "1")}
    # Offloading frees device memory once there is an earlier subsequence to offload.
    assert rows[(4, "1")]["activation_bytes"] < rows[(4, "none")]["activation_bytes"]
    assert rows[(4, "1")]["offloaded_bytes"] > 0 and rows[(1, "1")]["offloaded_bytes"] == 0
    # Smaller subsequences, smaller working set.
    assert rows[(4, "none")]["activation_bytes"] < rows[(1, "none")]["activation_bytes"]
    assert [b["subsequences"] for b in report["bubbles"]] == [1, 4]
    for b in report["bubbles"]:
        plain, msp = b["plain"], b["msp"]
        # One job per mode in --quick, every iteration logged; the median is over iterations 3..
        assert len(plain["runs"]) == len(msp["runs"]) == 1
        for mode in (plain, msp):
            times = mode["runs"][0]["iteration_seconds"]
            assert len(times) == 4 and min(times) > 0
            assert mode["seconds"] == statistics.median(times[2:])
        assert b["measured"] > 0 and b["measured_msp"] >= 0
        assert b["time_ratio"] == msp["seconds"] / plain["seconds"]
        assert b["time_ratio_range"][0] <= b["time_ratio"] <= b["time_ratio_range"][1]
        assert all(b["msp_traffic_bytes"][kind] > 0 for kind in ("weights", "hidden", "kv"))
        # The MSP job multiplexed: the trainer listed its tasks and predicted what we did.
        assert plain["tasks"] is None and msp["tasks"] and b["msp_tasks"] == 2
        assert abs(msp["trainer_predicted"] - b["predicted_msp"]) < 1e-3
        # Fill-drain without MSP is (p-1)/N; multiplexing idle stages shrinks it.
        assert abs(b["predicted"] - 1 / b["subsequences"]) < 1e-9
        assert 0 <= b["predicted_msp"] < b["predicted"]
        assert b["predicted_time_ratio"] < 1
    for row in report["partitions"]:  # FLOPs-balanced subsequences leave the smaller bubble
        assert row["flops"] < row["length"] and abs(row["flops"] - row["formula"]) < 0.02
        assert 0 <= row["msp"] < row["flops"] and row["msp_tasks"] > 0
    text = (tmp_path / "sppo.md").read_text()
    assert "plain SPPO vs. MSP (measured on CPU)" in text and "FLOPs partition + MSP" in text
    assert "NVLink" in text and "predicted, not measured" in text
    assert (tmp_path / "sppo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
