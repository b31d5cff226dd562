"""bench/trace_fidelity.py's measuring pieces on small inputs: the order-preserving match of two
allocation sequences, the choice of a snapshot's step window, and the peak above the window's
start. The programs themselves are public repositories the bench reads from a checkout given on
its command line (docs/tracing.md); they are not part of the suite."""
from __future__ import annotations

import itertools
import random

import pytest

from tests.conftest import REPO_ROOT, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script(REPO_ROOT / "bench" / "trace_fidelity.py", "trace_fidelity_bench")


def _lcs_length(a, b) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, j in itertools.product(range(len(a)), range(len(b))):
        table[i + 1][j + 1] = (table[i][j] + 1 if a[i] == b[j]
                               else max(table[i][j + 1], table[i + 1][j]))
    return table[-1][-1]


def test_alignment_is_a_longest_common_subsequence(bench):
    rng = random.Random(7)
    for _ in range(50):
        a = [rng.choice((512, 1024, 4096)) for _ in range(rng.randint(0, 12))]
        b = [rng.choice((512, 1024, 4096)) for _ in range(rng.randint(0, 12))]
        length, matched_a, matched_b = bench.lcs_alignment(a, b)
        assert length == _lcs_length(a, b) == sum(matched_a) == sum(matched_b)
        assert [x for x, m in zip(a, matched_a) if m] == [y for y, m in zip(b, matched_b) if m]


def test_alignment_prefers_equal_requested_sizes(bench):
    # Both 4-byte and 256-byte requests are one 512-byte block; the 256-byte one is unmatched.
    real = [4, 256]
    ours = [4]
    _, _, matched_real = bench.lcs_alignment([bench.block(s) for s in ours],
                                             [bench.block(s) for s in real], ours, real)
    assert matched_real == [True, False]


def test_window_starts_at_the_last_step_and_peak_counts_from_there(bench):
    def event(action, size, line):
        return {"action": action, "size": size,
                "frames": [{"filename": "/x/train.py", "line": line, "name": "step"}]}

    trace = [event("alloc", 100, 10), event("alloc", 50, 11), event("free_completed", 100, 12),
             event("alloc", 100, 10), event("alloc", 30, 10), event("free_completed", 50, 11),
             event("free_completed", 100, 12)]
    program = bench.Program("toy", "", "s.pickle", (), "2.13", ((9, 0), 132, "toy"), "train.py", 10,
                            run=None)
    window, allocs, how = bench.snapshot_window(program, {"device_traces": [trace]})
    assert [a.size for a in allocs] == [100, 30]
    assert "2 step(s)" in how
    assert bench.peak_above_start(window) == (130, -20)


def test_every_program_names_the_cuda_run_it_is_compared_with(bench):
    programs = bench.all_programs()
    assert "cs336-medium-bf16" in programs  # the kept-aside program is checked the same way
    for program in programs.values():
        target = bench.target_of(program)
        assert target.sm_count > 0 and target.torch_version >= (2, 3), program.name
        assert program.gpu[2], f"{program.name}: say how the GPU is known"
