"""Smoke tests of bench/memo_convergence.py.

- ``--quick`` (tiny model, 10 iterations, baseline plus one MEMO run per alpha) into a temporary
  directory: the report and the plot must be written and the report must carry the verdict
  line. About 2-3 minutes on 2 CPU cores (marked slow).
- ``--suite fp8 --quick`` with the alpha-0.25 checkpoint-offload pair (baseline, exact,
  fp8): the exact run must coincide with the baseline, the fp8 run must differ from the exact one
  (else fp8 is not in effect) and stay within the fp8 tolerance. About 30-80 s on 2 CPU cores
  (marked slow).
- The fp8 suite's judgement (compare_lossy, fp8_verdict_line) on made-up curves: a gap over the
  tolerance, a non-finite loss, a missing iteration and an inexact exact run must each FAIL.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, load_script, subprocess_env

BENCH = REPO_ROOT / "bench" / "memo_convergence.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH, "memo_convergence_bench")


@pytest.mark.slow
def test_quick_bench_writes_report_and_plot(tmp_path):
    output_dir = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--output-dir", str(output_dir)],
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


def _row(report: str, name: str) -> list[str]:
    rows = [line for line in report.splitlines() if line.startswith(f"| {name} |")]
    assert len(rows) == 1, f"expected one table row for {name}:\n{report}"
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


# Slow (~1 minute: three trainings): --memo-offload-fp8's rounding is close, not exact, and halves
# the host bytes in tests/unit/memo_ext/offload/test_memo_offload.py; the checkpoint-offload pair equals the
# baseline in tests/distributed/test_memo_exactness.py; the suite's judgement is
# test_fp8_judgement_fails_what_it_should below (all default).
@pytest.mark.slow
def test_quick_fp8_suite(tmp_path, bench):
    output_dir = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, str(BENCH), "--suite", "fp8", "--quick", "--strict",
         "--runs", "exact-ckpt-a0.25", "fp8-ckpt-a0.25", "--output-dir", str(output_dir)],
        check=False, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, (f"stdout:\n{result.stdout[-4000:]}\n"
                                    f"stderr:\n{result.stderr[-6000:]}")

    png = output_dir / "memo_offload_fp8.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (output_dir / "memo_offload_fp8.md").read_text(encoding="utf-8")
    verdicts = [line for line in report.splitlines() if line.startswith("Verdict: ")]
    assert len(verdicts) == 1 and verdicts[0].startswith("Verdict: PASS"), report

    # Exact checkpoint offload (mode (b) beside a token-wise layer at alpha 0.25): the baseline's
    # curve to float32 round-off.
    exact = _row(report, "exact-ckpt-a0.25")
    assert "--memo-checkpoint-layers 1" in exact[1]
    assert float(exact[4]) <= bench.RELATIVE_TOLERANCE, exact

    # fp8 against that exact run: measurably different (the rounding is in effect), yet within
    # the tolerance; the table's cells are the numbers the verdict used.
    fp8 = _row(report, "fp8-ckpt-a0.25")
    assert fp8[1] == "exact-ckpt-a0.25", fp8
    max_abs_gap, window_gap = float(fp8[5]), float(fp8[9])
    assert max_abs_gap > 0, "fp8 run equals the exact run bit for bit: is --memo-offload-fp8 used?"
    assert 0 <= window_gap <= bench.FP8_TOLERANCE and fp8[10] == "yes", fp8
    assert "last-10 mean rel gap" in report

    commands = report.split("## Commands")[1]
    assert "--memo-checkpoint-layers 1 --memo-offload-fp8" in commands
    assert re.search(r"`python bench/memo_convergence.py --suite fp8 --quick --iterations 10 "
                     r"--runs exact-ckpt-a0.25 fp8-ckpt-a0.25 --output-dir \S+`", report), report
    for run in ("baseline", "exact-ckpt-a0.25", "fp8-ckpt-a0.25"):
        assert (output_dir / "memo_convergence_runs" / "fp8" / run / "metrics.jsonl").is_file()


def _curve(values):
    return {iteration: value for iteration, value in enumerate(values, start=1)}


def test_fp8_judgement_fails_what_it_should(bench):
    exact = [10.0 - 0.02 * i for i in range(100)]  # 10.0 -> 8.02
    reference = _curve(exact)

    within = bench.compare_lossy("exact", reference, _curve([v * 1.005 for v in exact]))
    assert within.passes and within.window == bench.FP8_WINDOW
    assert within.window_rel == pytest.approx(0.005)

    # Only the trailing window counts: an early excursion passes, a late one fails.
    early = bench.compare_lossy("exact", reference,
                                _curve([v * (1.5 if i < 50 else 1.0) for i, v in enumerate(exact)]))
    assert early.passes and early.max_rel == pytest.approx(0.5)
    late = bench.compare_lossy("exact", reference, _curve([v * 1.02 for v in exact]))
    assert not late.passes and late.window_rel == pytest.approx(0.02)

    nan = bench.compare_lossy("exact", reference, _curve(exact[:60] + [float("nan")] * 40))
    assert not nan.passes and nan.nonfinite[0] == 61
    short = bench.compare_lossy("exact", reference, _curve(exact[:90]))
    assert not short.passes and short.missing == list(range(91, 101))

    coincide = bench.compare(reference, _curve(exact))
    inexact = bench.compare(reference, _curve([v * (1 + 1e-4) for v in exact]))
    assert coincide.coincides and not inexact.coincides

    assert bench.fp8_verdict_line({"exact-ckpt": coincide},
                                  {"fp8-ckpt": within}).startswith("Verdict: PASS")
    for exact_runs, lossy_runs in (({"exact-ckpt": coincide}, {"fp8-ckpt": late}),
                                   ({"exact-ckpt": coincide}, {"fp8-ckpt": nan}),
                                   ({"exact-ckpt": coincide}, {"fp8-ckpt": short}),
                                   ({"exact-ckpt": inexact}, {"fp8-ckpt": within})):
        verdict = bench.fp8_verdict_line(exact_runs, lossy_runs)
        assert verdict.startswith("Verdict: FAIL"), verdict
