"""Smoke test of bench/offload_memory.py --quick: it runs, writes its outputs where told, and its
measurements show what MEMO is for: fewer device activation bytes than no recompute, a device
footprint flat in the number of layers at every alpha (growing far less per layer than full
recompute's), and nothing left on device after backward but the rounding buffers.
The bench runs once per module, in a subprocess (it initialises its own megatron world)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, subprocess_env

# Slow: the bench's quick run takes ~30 s on 2 loaded cores. What it shows of MEMO is in the
# default suite: tests/unit/memo_ext/offload/test_memo_offload.py (one layer on device at a
# time, exact gradients, host bytes, auto alpha within the device headroom).
pytestmark = pytest.mark.slow

BENCH = REPO_ROOT / "bench" / "offload_memory.py"
OUTPUTS = ("offload_memory.md", "offload_memory.json", "offload_memory.png",
           "offload_memory_layers.png")
MEMO_KEYS = ("memo-0", "memo-0.5", "memo-1")


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("offload_memory")
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--output-dir", str(out_dir)],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, (
        f"bench exited {result.returncode}\nstdout:\n{result.stdout[-4000:]}\n"
        f"stderr:\n{result.stderr[-6000:]}")
    return out_dir, json.loads((out_dir / "offload_memory.json").read_text())


def test_outputs_written_to_output_dir(quick_report):
    out_dir, report = quick_report
    for name in OUTPUTS:
        assert (out_dir / name).stat().st_size > 0, name
    with open(out_dir / "offload_memory.png", "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"
    text = (out_dir / "offload_memory.md").read_text()
    for needle in ("DeviceMemoryTracker", "--quick", "Formulas", "Capacity",
                   "device activation bytes do not grow with the number of layers"):
        assert needle in text, needle
    assert report["sizes"]["seqs"]
    depth = report["capacity"]["depths"][0]
    assert depth["methods"]["full"]["longest_seq"] > 0


def test_capacity_search_hands_memo_the_measured_device_headroom(quick_report):
    """Under the simulated cap MEMO auto's LP gets the tracker's headroom as its device row, and
    the alpha it picks keeps iteration 2 inside the cap (the longest sequence fits twice)."""
    _, report = quick_report
    auto = report["capacity"]["depths"][0]["methods"]["memo-auto"]
    assert auto["longest_seq"] > 0
    assert "free at the alpha=0 peak" in auto["alpha_log"], auto["alpha_log"]
    assert 0.0 <= auto["alpha"] < 1.0


def _sweep(report, method, seq):
    return next(m for m in report["sweep"] if m["method"] == method and m["seq"] == seq)


def test_memo_uses_fewer_device_activation_bytes_than_no_recompute(quick_report):
    _, report = quick_report
    longest = max(report["sizes"]["seqs"])
    baseline = _sweep(report, "none", longest)
    for key in MEMO_KEYS:
        memo = _sweep(report, key, longest)
        assert memo["activation_bytes"] < baseline["activation_bytes"], key
        assert memo["peak_host_bytes"] > 0, f"{key}: host slots were not counted as host"
    # Megatron's own methods are what the theory column describes almost exactly.
    for key in ("none", "full"):
        row = _sweep(report, key, longest)
        assert 0.9 < row["activation_bytes"] / row["theory_bytes"] < 1.1, key


def test_layer_growth_of_the_baselines(quick_report):
    _, report = quick_report
    flat = report["flatness"]
    assert flat["none"]["u_per_layer"] > 10  # no recompute adds a whole layer (~19 u) per layer
    assert 0.5 < flat["full"]["u_per_layer"] < 2  # full recompute adds each layer's input (1 u)


def test_memo_alpha_one_flat_in_layer_count(quick_report):
    """At alpha = 1 nothing is recomputed: the device footprint is the two rounding buffers plus
    one layer's working set, whatever the depth."""
    _, report = quick_report
    assert report["flatness"]["memo-1"]["flat"], report["flatness"]["memo-1"]


@pytest.mark.parametrize("key", MEMO_KEYS)
def test_memo_grows_with_depth_far_less_than_full_recompute(quick_report, key):
    _, report = quick_report
    flat = report["flatness"]
    assert flat[key]["u_per_layer"] < 0.75 * flat["full"]["u_per_layer"], flat[key]


@pytest.mark.parametrize("key", ["memo-0", "memo-0.5"])
def test_memo_recomputing_alphas_flat_in_layer_count(quick_report, key):
    _, report = quick_report
    assert report["flatness"][key]["flat"], report["flatness"][key]


def _gives_back_all_but_buffers(report, key):
    """After backward + gc, a MEMO run holds its two rounding buffers and at most small
    per-layer leftovers (< 1 u = s*b*h*4 bytes per offloaded layer; a layer saves ~19 u)."""
    hidden = report["sizes"]["hidden"]
    for row in report["layers"]:
        if row["method"] == key:
            left = row["residual_bytes"] - row["buffer_bytes"]
            per_layer_u = left / (4 * row["seq"] * hidden * (row["layers"] - 2))
            assert per_layer_u < 1.0, (
                f"{key}, {row['layers']} layers: {left} bytes ({per_layer_u:.1f} u per offloaded "
                "layer) still on device after backward")


@pytest.mark.parametrize("key", MEMO_KEYS)
def test_memo_gives_back_all_but_rounding_buffers(quick_report, key):
    _gives_back_all_but_buffers(quick_report[1], key)
