"""The runtime arena on a GPU (skipped on the CPU machines): the allocator hooks in a fresh
process (PyTorch accepts a pluggable allocator only before its first CUDA allocation), and
``--memo-plan auto`` training with the losses of a run without a plan. The hooks' decisions are
also tested on CPU against a fake CUDA runtime (tests/unit/memo_ext/planner/test_planned_arena_hooks.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT, TINY_GPT_ARGS, read_losses, run_trainer, subprocess_env

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from memo_ext.planner.arena import ArenaRuntime, CudaArena, install_cuda_allocator

    class Plan:  # one layer-phase kind: two 1 MiB requests planned at 0 and 1 MiB
        level1 = [{"peak": 2 << 20, "phases": [[0, "forward", None, 0]],
                   "table": [[1 << 20, 0], [1 << 20, 1 << 20]]}]

    install_cuda_allocator()
    runtime = ArenaRuntime(Plan())
    arena = CudaArena(runtime, torch.device("cuda", 0))
    base = arena.base  # planned offset 0, past the buffer's own address
    runtime.enter(0, "forward")
    a = torch.empty(1 << 18, dtype=torch.float32, device="cuda")   # 1 MiB: planned at 0
    b = torch.empty(1 << 18, dtype=torch.float32, device="cuda")   # planned at 1 MiB
    c = torch.empty(1 << 18, dtype=torch.float32, device="cuda")   # beyond the plan: the pool
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


ISSUE_42_SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from memo_ext import _C
    from memo_ext.planner.arena import ArenaRuntime, CudaArena, install_cuda_allocator

    class Plan:  # 1 KiB at 0, 2 KiB at 1 KiB, 512 B at 3 KiB, 1 KiB at 3.5 KiB
        level1 = [{"peak": 4608, "phases": [[0, "forward", None, 0]],
                   "table": [[1024, 0], [2048, 1024], [512, 3072], [1024, 3584]]}]

    install_cuda_allocator()
    assert [torch.empty(0, device="cuda").data_ptr() for _ in range(3)] == [0, 0, 0]
    runtime = ArenaRuntime(Plan())
    arena = CudaArena(runtime, torch.device("cuda", 0))
    runtime.enter(0, "forward")
    # a 16-byte RNG state and a zero-byte tensor between planned requests leave the plan alone
    ts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 16, 0, 2000, 500, 1024)]
    offsets = [t.data_ptr() - arena.base for t in ts]
    assert [offsets[i] for i in (0, 3, 4, 5)] == [0, 1024, 3072, 3584], offsets
    assert not 0 <= offsets[1] < 4608 and ts[2].data_ptr() == 0, offsets
    for t in ts:
        t.fill_(1)
    torch.cuda.synchronize()
    del ts
    # out of memory: PyTorch's error, naming the allocator; CUDA stays usable
    try:
        torch.empty(2 * torch.cuda.mem_get_info()[1], dtype=torch.uint8, device="cuda")
        raise AssertionError("no out-of-memory error")
    except torch.OutOfMemoryError as error:
        assert "planned-arena allocator" in str(error), str(error)
    assert torch.ones(1024, device="cuda").sum().item() == 1024
    # a planned tensor freed after the close goes back to the arena
    runtime.close()
    runtime.enter(0, "forward")
    held = torch.empty(1000, dtype=torch.uint8, device="cuda")
    assert held.data_ptr() == arena.base
    arena.close()
    assert _C.cuda_arena_hooks()["draining_live_blocks"] == 1
    held.fill_(2)
    torch.cuda.synchronize()
    del held
    assert _C.cuda_arena_hooks()["draining"] == 0
    print("ok")
""")


def test_zero_bytes_small_untraced_requests_out_of_memory_and_a_late_free():
    """Issue 42's arena findings on a GPU (CPU versions: tests/unit/memo_ext/planner/test_arena_cuda_requests.py,
    tests/unit/memo_ext/test_gpu_readiness.py); not yet run on one."""
    result = subprocess.run([sys.executable, "-c", ISSUE_42_SCRIPT], cwd=REPO_ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_auto_plan_trains_with_the_losses_of_no_plan(tmp_path):
    common = TINY_GPT_ARGS + ["--deterministic-mode", "--train-iters", "8"]
    baseline, planned = tmp_path / "baseline.jsonl", tmp_path / "planned.jsonl"
    run_trainer(1, common + ["--log-metrics-jsonl", str(baseline)])
    result = run_trainer(1, common + ["--memo-plan", "auto", "--log-metrics-jsonl",
                                       str(planned)])
    assert read_losses(planned) == read_losses(baseline)
    served = [int(n) for n in re.findall(r"MEMO arena: served (\d+) layer requests", result.stdout)]
    assert served and served[-1] > 0, result.stdout[-3000:]
