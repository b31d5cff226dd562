"""bench/soak.py's judgement on made-up RSS series (no training): the slope after warm-up, the
noise floor from the plain run's quarters, the verdict (flat, settling, grows), and the report
it renders."""

from __future__ import annotations

import random

import pytest

from tests.conftest import REPO_ROOT, load_script

BENCH = REPO_ROOT / "bench" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    return load_script(BENCH, "soak_bench")


def _series(slope: float, noise: float, seed: int, iterations: int = 400,
            warmup_jump: float = 50.0, warmup: int = 40) -> list[tuple[int, float]]:
    """RSS in MiB: a warm-up rise, then ``slope`` per iteration, glibc-like steps and jitter."""
    generator = random.Random(seed)
    points, level = [], 400.0
    for iteration in range(1, iterations + 1):
        if iteration <= warmup:
            level += warmup_jump / warmup
        else:
            level += slope
            if generator.random() < 0.02:  # an arena grows or shrinks by a page run
                level += generator.choice((-1, 1)) * 0.25
        points.append((iteration, level + generator.uniform(-noise, noise)))
    return points


def test_slope_ignores_the_warm_up_and_fits_the_steady_growth(soak):
    figures = soak.analyse({0: _series(0.36, 0.05, 0), 1: _series(0.1, 0.05, 1)}, warmup=40)
    assert figures["slope_mib_per_iteration"] == pytest.approx(0.36, abs=0.01)
    assert figures["worst_rank"] == 0
    assert figures["growth_mib"] == pytest.approx(0.36 * 359, rel=0.05)


def test_a_leak_grows_and_plain_noise_stays_flat(soak):
    plain = soak.analyse({0: _series(0.0, 0.2, 2), 1: _series(0.0, 0.2, 3)}, warmup=40)
    floor = soak.noise_floor(plain)
    assert 0 < floor < 0.05
    assert soak.verdict(plain["slope_mib_per_iteration"], floor) == "flat"
    other = soak.analyse({0: _series(0.0, 0.2, 4), 1: _series(0.0, 0.2, 5)}, warmup=40)
    assert soak.verdict(other["slope_mib_per_iteration"], floor) == "flat"
    leak = soak.analyse({0: _series(0.36, 0.2, 6), 1: _series(0.36, 0.2, 7)}, warmup=40)
    assert soak.verdict(leak["slope_mib_per_iteration"], floor) == "grows"
    second = leak["second_half_slope_mib_per_iteration"]
    assert soak.verdict(leak["slope_mib_per_iteration"], floor, second) == "grows"
    # Growth that stops (an arena still filling after the warm-up) is told from a leak.
    settling = [(x, y + (min(x, 220) - 40) * 0.05 if x > 40 else y)
                for x, y in _series(0.0, 0.05, 8)]
    settled = soak.analyse({0: settling}, warmup=40)
    assert soak.verdict(settled["slope_mib_per_iteration"], floor,
                        settled["second_half_slope_mib_per_iteration"]) == "settling"
    assert soak.verdict(None, floor) == "no data"
    assert soak.verdict(0.1, None).startswith("no noise floor")


def test_report_has_the_table_the_pairs_and_the_plot(soak, tmp_path):
    def row(name, group_slope, seed, seq=128):
        samples = {0: _series(group_slope, 0.1, seed), 1: _series(group_slope, 0.1, seed + 1)}
        return {"mechanism": name, "layout": "TP=2+SP", "flags": [], "iterations": 400,
                "requested_iterations": 400, "seq_length": seq, "warmup": 40, "exit_status": 0,
                "wall_s": 1.0, "seconds_per_iteration": 0.2, "source_tree": "x",
                "commit": "abc1234", "command": "torchrun ...",
                "series": {str(r): [list(p) for p in s] for r, s in samples.items()},
                **soak.analyse(samples, 40)}

    data = {"meta": {"machine": "test", "written": "now"},
            "groups": {"soak": {"plain": row("plain", 0.0, 10),
                                "memo-alpha-1": row("memo-alpha-1", 0.0, 12)},
                       "seq512-before": {"memo-alpha-1": row("memo-alpha-1", 1.5, 14, 512)}}}
    md, png = tmp_path / "soak.md", tmp_path / "soak.png"
    soak.render(data, md, png)
    text = md.read_text()
    assert "| plain | TP=2+SP | 2 | 400 |" in text and "| flat |" in text
    assert "| seq512-before | memo-alpha-1 | 512 |" in text
    assert "Not run yet: memo-alpha-0" in text
    assert png.stat().st_size > 10_000


def test_each_row_is_judged_by_the_plain_run_of_its_layout(soak, tmp_path):
    """A DP=2 row against plain-dp2's floor, a TP=2+SP row against plain's: the same slope is
    within a noisy layout's floor and above a quiet one's."""
    def row(name, slope, noise, seed, layout="TP=2+SP", floor="plain", batch=2):
        samples = {0: _series(slope, noise, seed), 1: _series(slope, noise, seed + 1)}
        return {"mechanism": name, "layout": layout, "floor": floor, "flags": [],
                "iterations": 400, "requested_iterations": 400, "seq_length": 128,
                "micro_batch_size": 1, "global_batch_size": batch, "warmup": 40,
                "exit_status": 0, "wall_s": 1.0, "seconds_per_iteration": 0.2,
                "source_tree": "x", "commit": "abc1234", "command": "torchrun ...",
                "series": {str(r): [list(p) for p in s] for r, s in samples.items()},
                **soak.analyse(samples, 40)}

    assert soak.BY_NAME["distributed-optimizer"].floor == "plain-dp2"
    assert soak.BY_NAME["timers"].floor == "plain"
    data = {"groups": {"soak": {
        "plain": row("plain", 0.0, 0.01, 20),  # a quiet layout: a low floor
        "plain-dp2": row("plain-dp2", 0.0, 6.0, 22, "DP=2", "plain-dp2", 4),  # a noisy one
        "timers": row("timers", 0.012, 0.01, 24),
        "distributed-optimizer": row("distributed-optimizer", 0.012, 0.01, 26, "DP=2",
                                     "plain-dp2", 4)}}}
    floors = {name: soak.noise_floor(data["groups"]["soak"][name])
              for name in ("plain", "plain-dp2")}
    assert floors["plain"] < 0.01 < 0.02 < floors["plain-dp2"]
    md = tmp_path / "soak.md"
    soak.render(data, md, tmp_path / "soak.png")
    lines = {line.split(" | ")[0].strip("| "): line for line in md.read_text().splitlines()
             if line.startswith("| ")}
    assert f"| {floors['plain']:.4f} (plain) |" in lines["timers"]
    assert lines["timers"].endswith("| grows |")
    assert f"| {floors['plain-dp2']:.4f} (plain-dp2) |" in lines["distributed-optimizer"]
    assert lines["distributed-optimizer"].endswith("| flat |")
    assert "| DP=2 | 4 | 400 |" in lines["plain-dp2"]
