"""The runtime arena's CUDA allocator hooks (needs a GPU; skipped on the CPU machines). Runs in
a fresh process: PyTorch accepts a pluggable allocator only before its first CUDA allocation."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from memo_ext.planner.arena import ArenaRuntime, CudaArena

    class Plan:  # one layer-phase kind: two 1 MiB requests planned at 0 and 1 MiB
        level1 = [{"peak": 2 << 20, "phases": [[0, "forward", None, 0]],
                   "table": [[1 << 20, 0], [1 << 20, 1 << 20]]}]

    runtime = ArenaRuntime(Plan())
    arena = CudaArena(runtime)
    base = arena.buffer.data_ptr()
    runtime.arena.begin_phase(0)
    a = torch.empty(1 << 18, dtype=torch.float32, device="cuda")   # 1 MiB: planned at 0
    b = torch.empty(1 << 18, dtype=torch.float32, device="cuda")   # planned at 1 MiB
    c = torch.empty(1 << 18, dtype=torch.float32, device="cuda")   # beyond the plan: cudaMalloc
    assert a.data_ptr() == base and b.data_ptr() == base + (1 << 20), (a.data_ptr(), base)
    assert not base <= c.data_ptr() < base + (2 << 20)
    a.fill_(1); b.fill_(2); c.fill_(3)
    assert a.sum().item() == 1 << 18 and b.sum().item() == 2 << 18
    del a, b, c
    stats = runtime.stats()
    assert stats["served"] == 2 and stats["beyond_plan"] >= 1 and stats["live_blocks"] == 0, stats
    print("ok")
""")


def test_pluggable_allocator_serves_planned_offsets():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
