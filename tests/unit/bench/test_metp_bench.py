"""bench/metp_memory.py --quick: per-rank peak bytes of one layer under TP+SP and METP at p=2
and p=4 measured by the tracker, with docs/metp.md's ratio beside them; report, JSON, PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, subprocess_env

BENCH = REPO_ROOT / "bench" / "metp_memory.py"


@pytest.mark.slow  # ~45 s: the whole quick bench
def test_quick_run_writes_the_report(tmp_path):
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "-o", str(tmp_path)],
                            cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "metp_memory.json").read_text())
    keys = {(r["tp"], r["seq"], r["block"], r["mechanism"]) for r in report["rows"]}
    assert keys == {(p, s, b, m) for p in (2, 4) for s in (64, 512)
                    for b in ("attention", "layer") for m in ("tp_sp", "metp")}
    assert all(r["forward_peak"] > 0 and r["peak"] >= r["forward_peak"] for r in report["rows"])
    ratios = {(c["tp"], c["seq"]): c for c in report["comparison"]}
    for p in (2, 4):
        # The longer sequence: METP below TP+SP, and the weight buffers' share shrinks.
        assert ratios[(p, 512)]["attention_forward_peak_ratio"] < 1
        assert (ratios[(p, 512)]["attention_forward_peak_ratio"]
                < ratios[(p, 64)]["attention_forward_peak_ratio"])
        assert abs(ratios[(p, 512)]["spec_ratio"] - (3 + 2 * p) / (p * (4 + p))) < 1e-12
    # The crossover: at 64 tokens and p=2 METP's double-buffered weights outweigh the sequence.
    assert ratios[(2, 64)]["attention_forward_peak_ratio"] > 1
    assert "under METP needs more than under TP+SP at 64 tokens" in (
        tmp_path / "metp_memory.md").read_text()
    assert (tmp_path / "metp_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
