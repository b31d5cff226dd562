"""The trace cache's key (memo_ext/estimate/trace_key.py): every project module the tracer
imports, found from the import graph, plus the Python, torch and megatron-core versions."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from memo_ext.estimate.trace_key import (
    PROJECT_MODULES,
    installed_versions,
    tracer_digest,
    tracer_files,
)

REPO_ROOT = Path(__file__).resolve().parents[4]
VERSIONS = {"python": "3.11.7", "torch": "2.5.1", "megatron-core": "0.16.1",
            "flash-attn": "2.8.3"}
UNREACHED = "memo_ext/estimate/search.py"  # the recommender's ranking: no tracer imports it


@pytest.fixture(scope="module")
def repo_files() -> dict[str, Path]:
    return tracer_files()


@pytest.fixture
def tree(tmp_path, repo_files) -> Path:
    """A copy of the files the tracer imports, and one it does not, in their repository
    layout."""
    for path in [*repo_files.values(), REPO_ROOT / UNREACHED]:
        target = tmp_path / path.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return tmp_path


def _digest(tree: Path) -> str:
    return tracer_digest(roots=[tree], versions=VERSIONS)


def test_the_graph_reaches_what_a_hand_list_missed(repo_files):
    for module in ("memo_ext.storage_tracker", "megatron.training.arguments",
                   "megatron.training.compat.devices", "memo_ext.trace",
                   "megatron.training.gpt", "memo_ext._C",
                   *(f"memo_ext.trace.{name}" for name in (
                       "constants", "cuda_snapshot", "format", "iteration", "model_state",
                       "offline", "recorder", "summary", "tagging"))):
        assert module in repo_files, module
    assert repo_files["memo_ext._C"].suffix == ".so"  # compiled, hashed by its bytes
    assert "memo_ext.estimate.search" not in repo_files
    assert not any(name.startswith("megatron.core") for name in repo_files)


@pytest.mark.parametrize("changed", ["memo_ext/storage_tracker.py",
                                     "memo_ext/trace/summary.py",
                                     "megatron/training/compat/rng.py",
                                     "megatron/training/arguments.py"])
def test_changing_an_imported_module_changes_the_key(tree, repo_files, changed):
    assert tracer_files(roots=[tree]).keys() == repo_files.keys()  # the copy is the same graph
    before = _digest(tree)
    with open(tree / changed, "a") as handle:
        handle.write("\n# changed\n")
    assert _digest(tree) != before


def test_changing_a_module_no_one_imports_keeps_the_key(tree):
    before = _digest(tree)
    with open(tree / UNREACHED, "a") as handle:
        handle.write("\n# changed\n")
    assert _digest(tree) == before


def test_an_import_inside_a_function_brings_its_module_in(tree):
    tracker = tree / "memo_ext/storage_tracker.py"
    tracker.write_text(tracker.read_text()
                       + "\n\ndef _rank():\n    from memo_ext.estimate import search\n")
    before = _digest(tree)
    with open(tree / UNREACHED, "a") as handle:
        handle.write("\n# changed\n")
    assert _digest(tree) != before


def test_relative_imports_resolve_against_their_package(tmp_path):
    files = {"memo_ext/__init__.py": "", "memo_ext/top.py": "",
             "memo_ext/pkg/__init__.py": "from . import a\n",
             "memo_ext/pkg/a.py": "from .b import name\nfrom .. import top\n",
             "memo_ext/pkg/b.py": "name = 1\n", "memo_ext/pkg/unused.py": ""}
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    found = tracer_files("memo_ext.pkg", roots=[tmp_path])
    assert sorted(found) == ["memo_ext", "memo_ext.pkg", "memo_ext.pkg.a", "memo_ext.pkg.b",
                             "memo_ext.top"]


@pytest.mark.parametrize("dependency", ["python", "torch", "megatron-core", "flash-attn"])
def test_another_version_changes_the_key(tree, dependency):
    other = {**VERSIONS, dependency: VERSIONS[dependency] + ".post1"}
    assert tracer_digest(roots=[tree], versions=other) != _digest(tree)


def test_installed_versions_come_from_metadata():
    versions = installed_versions()
    assert set(versions) == {"python", "torch", "megatron-core", "flash-attn"}
    assert versions["megatron-core"] == "0.16.1"


def test_the_project_modules_are_pyprojects():
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = {p.rstrip("*") for p in config["packages"]["find"]["include"]}
    assert set(PROJECT_MODULES) == shipped | set(config["py-modules"])
