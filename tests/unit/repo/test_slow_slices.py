"""tests/conftest.py's --slow-slice K/N, which CI uses to run a rotating part of the slow tests
(tests/README.md, "Slow tests in CI"): the N slices partition the slow tests, a test's slice
does not depend on the process or the order of collection, and only slow tests are dropped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import (REPO_ROOT, parse_slow_slice, pytest_collection_modifyitems,
                            slow_slice)

NODE_IDS = [f"tests/unit/x/test_{i % 7}.py::test_case[{i}]" for i in range(500)] + [
    "tests/distributed/test_memo_exactness.py::test_memo_matches_baseline[cp2-0.5]",
    "tests/unit/memo_ext/estimate/test_estimate.py::test_predicted_mfu_against_published",
]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_slices_partition_the_tests(n):
    slices = [{nodeid for nodeid in NODE_IDS if slow_slice(nodeid, n) == k} for k in range(n)]
    assert sum(map(len, slices)) == len(NODE_IDS)  # each test in exactly one slice ...
    assert set().union(*slices) == set(NODE_IDS)   # ... and every test in one
    if n > 1:  # no slice empty or holding nearly all (the hash spreads them)
        assert all(len(NODE_IDS) / n / 2 < len(s) < len(NODE_IDS) / n * 2 for s in slices)


def test_a_tests_slice_is_the_same_in_another_process_and_order():
    here = [slow_slice(nodeid, 5) for nodeid in NODE_IDS]
    assert [slow_slice(nodeid, 5) for nodeid in reversed(NODE_IDS)] == here[::-1]
    code = ("import json, sys; from tests.conftest import slow_slice; "
            "print(json.dumps([slow_slice(n, 5) for n in json.load(sys.stdin)]))")
    env = dict(os.environ, PYTHONHASHSEED="12345",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(NODE_IDS), env=env,
                         capture_output=True, text=True, check=True, timeout=120, cwd=REPO_ROOT)
    assert json.loads(out.stdout) == here
    # Pinned, so that a change of the hash (which reshuffles CI's rotation) is deliberate.
    assert [slow_slice(nodeid, 5) for nodeid in NODE_IDS[-2:]] == [1, 4]




def _item(nodeid: str, slow: bool):
    return SimpleNamespace(nodeid=nodeid, keywords={"slow": True} if slow else {})


def test_the_option_drops_other_slices_slow_tests_only():
    items = [_item(nodeid, slow=i % 3 != 0) for i, nodeid in enumerate(NODE_IDS)]
    kept_per_slice = []
    for k in range(3):
        deselected = []
        config = SimpleNamespace(
            getoption=lambda name, default=None, k=k: (k, 3),
            hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
        chosen = list(items)
        pytest_collection_modifyitems(config, chosen)
        assert {id(i) for i in chosen} | {id(i) for i in deselected} == {id(i) for i in items}
        assert not {id(i) for i in chosen} & {id(i) for i in deselected}
        assert all("slow" in i.keywords for i in deselected)
        assert all(slow_slice(i.nodeid, 3) == k for i in chosen if "slow" in i.keywords)
        assert [i for i in items if i in chosen] == chosen  # collection order kept
        kept_per_slice.append({i.nodeid for i in chosen if "slow" in i.keywords})
    assert sum(map(len, kept_per_slice)) == sum("slow" in i.keywords for i in items)
    assert set().union(*kept_per_slice) == {i.nodeid for i in items if "slow" in i.keywords}


@pytest.mark.parametrize("text", ["3/3", "-1/3", "0/0", "1", "a/b", "1/2/3"])
def test_bad_slices_are_usage_errors(text):
    with pytest.raises(pytest.UsageError):
        parse_slow_slice(text)


def test_good_slice_parses():
    assert parse_slow_slice("2/5") == (2, 5)
