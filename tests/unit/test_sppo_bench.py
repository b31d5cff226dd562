"""bench/sppo.py --quick: stage memory vs. N measured under the tracker with the formula beside
it, bubble ratios from two PP=2 runs, the predicted partition comparison; report, JSON, PNG."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO_ROOT, subprocess_env

BENCH = REPO_ROOT / "bench" / "sppo.py"


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
    assert all(b["measured"] > 0 for b in report["bubbles"])
    for row in report["partitions"]:  # FLOPs-balanced subsequences leave the smaller bubble
        assert row["flops"] < row["length"] and abs(row["flops"] - row["formula"]) < 0.02
    assert "MSP) is not built" in (tmp_path / "sppo.md").read_text()
    assert (tmp_path / "sppo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
