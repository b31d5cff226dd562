"""bench/stitching.py --quick: one real snapshot through the caching and stitching models and the
real host allocator, and a short fuzz; the report, JSON and plot are written."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO_ROOT, snapshot_path, subprocess_env

BENCH = REPO_ROOT / "bench" / "stitching.py"


def test_quick_run_writes_the_report(tmp_path):
    snapshot_path("transformer_small_from_empty.pickle")  # skips without the snapshots
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "-o", str(tmp_path)],
                            cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "stitching.json").read_text())
    (row,) = report["rows"]
    assert row["same_decisions"] and row["data_errors"] == 0 and not any(row["leaked"].values())
    assert row["real_peak_reserved"] == row["model_peak_reserved"] <= row["caching_peak_reserved"]
    assert report["fuzz"]["ops"] == 5000 and report["fuzz"]["data_errors"] == 0
    text = (tmp_path / "stitching.md").read_text()
    assert "Measured on the CPU dev machine (no GPU)" in text
    assert "| transformer_small_from_empty.pickle | 0 | 97 |" in text
    assert (tmp_path / "stitching.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
