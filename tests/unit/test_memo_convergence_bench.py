"""Smoke test of bench/memo_convergence.py: --quick (tiny model, 10 iterations, baseline plus one
MEMO run per alpha) into a temporary directory; the report and the plot must be written and the
report must carry the verdict line. About 2-3 minutes on 2 CPU cores."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, subprocess_env


@pytest.mark.slow
def test_quick_bench_writes_report_and_plot(tmp_path):
    output_dir = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "memo_convergence.py"), "--quick",
         "--output-dir", str(output_dir)],
        check=False, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-6000:]}"

    png = output_dir / "memo_convergence.png"
    md = output_dir / "memo_convergence.md"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = md.read_text(encoding="utf-8")

    verdicts = [line for line in report.splitlines() if line.startswith("Verdict: ")]
    assert len(verdicts) == 1, report
    # MEMO only moves activations around: with --deterministic-mode the curves must coincide.
    assert verdicts[0].startswith("Verdict: COINCIDE"), verdicts[0]

    for run in ("baseline", "alpha=0", "alpha=0.25", "alpha=0.5", "alpha=1"):
        assert f"| {run} |" in report, f"no table row for {run}:\n{report}"
        assert (output_dir / "memo_convergence_runs" / run.replace("=", "_")
                / "metrics.jsonl").is_file()
    assert report.count("--memo-offload --memo-alpha") == 4  # the exact commands
