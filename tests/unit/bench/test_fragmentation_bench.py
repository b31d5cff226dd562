"""bench/fragmentation.py and bench/common.py: repeating a traced iteration for the allocator models, and a smoke
run (--quick --skip-search: a tiny model's traces on a 160 MiB device, one size that fits and
one that does not)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bench import common
from memo_ext import _C
from memo_ext.planner.trace import Trace as EventTrace
from tests.conftest import REPO_ROOT, load_script, subprocess_env

BENCH = REPO_ROOT / "bench" / "fragmentation.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH, "fragmentation_bench")


def _event(event_id, action, nbytes, phase, pool="device"):
    return {"id": event_id, "action": action, "bytes": nbytes, "stream": 0, "layer": None,
            "phase": phase, "category": "activation", "microbatch": None, "pool": pool,
            "module": None, "op": None}


def _trace(events, seq=1024):
    return EventTrace(header={"model": {"seq_length": seq}}, events=events)


def test_repeated_iterations_keep_persistent_state_once_and_rename_blocks():
    trace = _trace([
        _event(0, "alloc", 4096, "init"),
        _event(1, "alloc", 1 << 20, "init", pool="external"),
        _event(2, "alloc", 512, "forward"),
        _event(3, "alloc", 2048, "forward"),
        _event(2, "free", 512, "backward"),
        _event(3, "free", 2048, "backward"),
        _event(4, "alloc", 8, "backward", pool="host"),
    ])
    repeated, starts, step_rows = common.repeated_iterations(trace, 3)
    assert starts == [1, 5, 9]
    assert repeated.actions.tolist() == [_C.ALLOC] + [_C.ALLOC, _C.ALLOC, _C.FREE, _C.FREE] * 3
    assert repeated.sizes.tolist() == [4096] + [512, 2048, 0, 0] * 3
    ids = repeated.ids.tolist()
    assert ids[0] == 0
    per_iteration = [ids[s:s + 4] for s in starts]
    assert len({tuple(block) for block in per_iteration}) == 3  # renamed per iteration
    for block in per_iteration:
        assert block[0] == block[2] and block[1] == block[3]  # alloc/free pairs kept
    assert len(set(ids)) == 1 + 2 * 3
    assert step_rows == [1, 2, 3, 4]  # rows among the device events (external, host: not)
    assert common.external_bytes(trace) == 1 << 20


def test_an_iteration_freeing_persistent_state_is_refused():
    trace = _trace([_event(0, "alloc", 4096, "init"), _event(0, "free", 4096, "forward")])
    with pytest.raises(ValueError, match="frees a persistent allocation"):
        common.repeated_iterations(trace, 2)


def test_last_iteration_counts_and_oom_iteration(bench):
    """Three 3 MiB blocks per iteration share one 20 MiB segment, reused from the cache after
    the first iteration; on an 8 MiB device that segment cannot exist: OOM in iteration 1."""
    events = [_event(0, "alloc", 1 << 20, "init")]
    for block in (1, 2, 3):
        events.append(_event(block, "alloc", 3 << 20, "forward"))
    events += [_event(block, "free", 3 << 20, "backward") for block in (1, 2, 3)]
    setup = bench.Setup(model_argv=(), seqs=(1024,), capacity_bytes=64 << 20, search_step=1,
                        search_max=1, iterations=3)
    run, result, starts = bench.run_policy(_trace(events), "caching", setup)
    assert not run.oom and run.device_mallocs_last_iteration == 0  # served from the cache
    assert run.peak_allocated_bytes == (1 << 20) + 3 * (3 << 20)
    small = bench.Setup(**{**setup.__dict__, "capacity_bytes": 8 << 20})
    run, _, _ = bench.run_policy(_trace(events), "caching", small)
    assert run.oom and run.oom_iteration == 1 and run.oom_request_bytes == 3 << 20


def test_longest_fitting_bisects():
    probed = []

    def fits(seq):
        probed.append(seq)
        return seq <= 7

    assert common.longest_fitting(fits, 1, 16) == 7
    assert len(probed) <= 5
    assert common.longest_fitting(lambda seq: False, 2, 16) == 0


@pytest.mark.slow  # ~35 s: the whole quick bench
def test_quick_run_writes_report_and_plots(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--skip-search", "-o", str(tmp_path)],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "fragmentation.json").read_text())
    runs = {(r["seq"], r["policy"]): r for r in report["runs"]}
    assert not runs[(2048, "caching")]["oom"] and runs[(8192, "caching")]["oom"]
    for run in report["runs"]:
        assert run["peak_reserved_bytes"] >= run["peak_allocated_bytes"] > 0
        assert 0.0 <= run["fragmentation"] < 1.0
    # Near and past the capacity the model reorganises (frees its cache and retries).
    assert runs[(8192, "caching")]["reorganisations_total"] > 0
    text = (tmp_path / "fragmentation.md").read_text()
    assert "Predicted, not measured on a GPU" in text and "paper" in text
    for name in ("fragmentation.png", "fragmentation_seq.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.isfinite(report["seconds"])
