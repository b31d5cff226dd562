"""bench/shape_dominance.py: a model and GPU count with nothing to compare is refused in one
line, before any tracing (the pairs themselves are the bench's run: ~10 min)."""

from __future__ import annotations

import pytest

from bench import shape_dominance as bench


def test_no_data_parallel_context_parallel_shape_is_refused(tmp_path):
    with pytest.raises(SystemExit) as refused:
        bench.main(["--model", "7b", "--gpus", "2", "--output", str(tmp_path / "out.md")])
    assert str(refused.value) == ("7b on 2 GPUs: no layout with CP > 1 and DP > 1 to compare; "
                                  "try more --gpus")
    assert not (tmp_path / "out.md").exists()
