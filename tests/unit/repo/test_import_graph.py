"""The import graph of our Python sources keeps the layers of docs/architecture.md ("Layers") and
has no cycles. Read with ast: nothing is imported or executed.

Sources: every .py in memo_ext/, megatron/training/ and megatron/memo_tools/ (ours;
megatron.core is the wheel), tools/ and pretrain_gpt.py. An import counts wherever it is written -- at module level, in a class
body, inside a function -- except under ``if TYPE_CHECKING:`` (type-only, never executed), and
``from package import name`` counts as an import of ``package.name`` when that is a module.

- (a) memo_ext's packages (memo_ext.estimate, memo_ext.trace, ...; a top-level module such as
  memo_ext.config is one too) form no cycle, whatever scope their imports are written at: a
  function-level import that closes a circle is the same knot, only hidden.
- (b) no cycle among the imports that run when a module is imported (module level and class
  bodies), module by module. Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and
  ``a.b``; those count, except the importer's own packages, which are already running.
- (c) the layers: memo_ext never imports the trainer (megatron.training, pretrain_gpt) or the
  tools (megatron.memo_tools, tools/); megatron/training never imports the tools; no package
  imports ``pretrain_gpt``, the entry script.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tests.conftest import REPO_ROOT

ROOTS = ("memo_ext", "megatron/training", "megatron/memo_tools", "tools", "pretrain_gpt.py")
#: The packages (pretrain_gpt.py and tools/ are scripts).
PACKAGES = ("memo_ext", "megatron.training", "megatron.memo_tools")
#: Compiled modules (csrc/, built into the package): leaves of the graph.
EXTENSIONS = ("memo_ext._C",)


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (a known module, or the name as written)
    path: str  # the importing file, relative to the repository
    line: int
    module_level: bool  # runs when the importing module is imported
    type_only: bool  # under ``if TYPE_CHECKING:``

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def _sources() -> dict[str, Path]:
    """Module name -> file, for every tracked or new (not ignored) source under ROOTS."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "--", *ROOTS], cwd=REPO_ROOT, check=True, capture_output=True,
                            text=True).stdout.split()
    files = sorted({Path(name) for name in listed
                    if name.endswith(".py") and (REPO_ROOT / name).is_file()})
    return {_module_name(path): path for path in files}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, path: Path, is_package: bool, known: dict[str, Path]):
        self.module, self.path, self.known = module, str(path), known
        self.package = module if is_package else module.rpartition(".")[0]
        self.function_depth = 0
        self.type_only = 0
        self.imports: list[Import] = []

    def _add(self, target: str, node: ast.stmt) -> None:
        self.imports.append(Import(self.module, target, self.path, node.lineno,
                                   self.function_depth == 0, self.type_only > 0))

    def _resolve(self, name: str) -> str:
        """A module name as the import system finds it: tools/ scripts import their siblings by
        bare name (their directory is on sys.path)."""
        if self.path.startswith("tools"):
            sibling = f"{self.package}.{name}" if self.package else name
            if name.split(".")[0] not in sys.stdlib_module_names and sibling in self.known:
                return sibling
        return name

    def visit_FunctionDef(self, node) -> None:
        self.function_depth += 1
        self.generic_visit(node)
        self.function_depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.type_only += 1
            for statement in node.body:
                self.visit(statement)
            self.type_only -= 1
            for statement in node.orelse:
                self.visit(statement)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(self._resolve(alias.name), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".") if self.package else []
            base = base[:len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = self._resolve(node.module)
        for alias in node.names:
            submodule = f"{module}.{alias.name}"
            known = submodule in self.known or submodule in EXTENSIONS
            self._add(submodule if known else module, node)


@lru_cache(maxsize=None)
def _imports() -> tuple[Import, ...]:
    known = _sources()
    found: list[Import] = []
    for module, path in known.items():
        tree = ast.parse((REPO_ROOT / path).read_text(encoding="utf-8"), filename=str(path))
        collector = _Collector(module, path, path.name == "__init__.py", known)
        collector.visit(tree)
        found += collector.imports
    return tuple(found)


def _known_module(name: str) -> str | None:
    """``name`` or the longest of its prefixes that is one of our modules, or None."""
    known = _sources()
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known or candidate in EXTENSIONS:
            return candidate
    return None


def _is_within(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


def _memo_package(name: str) -> str:
    """memo_ext.estimate.layout.model -> memo_ext.estimate; memo_ext.config -> memo_ext.config."""
    return ".".join(name.split(".")[:2])


def _components(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """The strongly connected components with more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return components


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component with more than one node (a
    breadth-first search inside the component)."""
    cycles = []
    for component in _components(edges):
        start = min(component)
        parents: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parents:
            following = []
            for node in frontier:
                for nxt in sorted(edges.get(node, ())):
                    if nxt in component and nxt not in parents:
                        parents[nxt] = node
                        following.append(nxt)
            frontier = following
        cycle = [start]
        node = parents[start]
        while node != start:
            cycle.append(node)
            node = parents[node]
        cycles.append([start, *reversed(cycle[1:]), start])
    return cycles


def _describe(cycle: list[str], edges: dict[str, dict[str, Import]]) -> str:
    """The cycle with the file:line of each edge, and every node of its knot (breaking this
    cycle may leave another through them)."""
    steps = [cycle[0]]
    for here, there in zip(cycle, cycle[1:]):
        steps.append(f"-> {there} ({edges[here][there].where()})")
    knot = next(c for c in _components(edges) if cycle[0] in c)
    return " ".join(steps) + f" [knot: {', '.join(sorted(knot))}]"


def _graph(imports, node_of) -> dict[str, dict[str, Import]]:
    """node -> node it imports -> the first import that makes the edge."""
    edges: dict[str, dict[str, Import]] = defaultdict(dict)
    for imp in sorted(imports, key=lambda i: (i.path, i.line)):
        source, target = node_of(imp.source), node_of(imp.target)
        if source and target and source != target:
            edges[source].setdefault(target, imp)
    return edges


def test_the_reader_sorts_imports_by_scope():
    source = ("from typing import TYPE_CHECKING\nimport a\nif TYPE_CHECKING:\n    import b\n"
              "else:\n    import e\ndef f():\n    import c\nclass K:\n    from . import d\n")
    collector = _Collector("pkg.mod", Path("pkg/mod.py"), False, {"pkg.d": Path("pkg/d.py")})
    collector.visit(ast.parse(source))
    seen = {imp.target: (imp.module_level, imp.type_only) for imp in collector.imports}
    assert seen == {"typing": (True, False), "a": (True, False), "b": (True, True),
                    "e": (True, False), "c": (False, False), "pkg.d": (True, False)}


def test_the_cycle_finder_names_each_cycle():
    edge = Import("x", "y", "x.py", 1, True, False)
    edges = {"a": {"b": edge}, "b": {"c": edge, "d": edge}, "c": {"a": edge}, "d": {}}
    assert _cycles(edges) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b": edge}, "b": {}}) == []


def test_the_sources_are_found_and_read():
    modules = _sources()
    for name in ("memo_ext.trace.recorder", "memo_ext.planner", "memo_ext.hardware",
                 "megatron.training.training", "pretrain_gpt"):
        assert name in modules, name
    edges = {(imp.source, imp.target) for imp in _imports()}
    assert ("memo_ext.planner.arena", "memo_ext.trace") in edges


def test_memo_ext_packages_form_no_cycle():
    """(a): at any scope, type-only imports aside."""
    imports = [imp for imp in _imports() if not imp.type_only
               and _is_within(imp.source, "memo_ext") and _is_within(imp.target, "memo_ext")]
    edges = _graph(imports, lambda name: None if name == "memo_ext" else _memo_package(name))
    cycles = _cycles(edges)
    assert not cycles, "memo_ext packages import each other in a circle (move the shared piece " \
        "down a layer, or put an import only annotations use under TYPE_CHECKING): " + "; ".join(
            _describe(cycle, edges) for cycle in cycles)


def test_no_module_level_import_cycle():
    """(b): the imports that run at import time, with the packages' __init__ they run."""
    edges: dict[str, dict[str, Import]] = defaultdict(dict)
    for imp in sorted(_imports(), key=lambda i: (i.path, i.line)):
        if imp.type_only or not imp.module_level:
            continue
        target = _known_module(imp.target)
        if target is None:
            continue
        parts = target.split(".")
        executed = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
        for module in executed:
            already_running = _is_within(imp.source, module)
            if module in _sources() and module != imp.source and not already_running:
                edges[imp.source].setdefault(module, imp)
    cycles = _cycles(edges)
    assert not cycles, "module-level import cycles: " + "; ".join(
        _describe(cycle, edges) for cycle in cycles)


def _tool_module(name: str) -> bool:
    """megatron.memo_tools or a tools/ script."""
    return _is_within(name, "megatron.memo_tools") or name == "tools" or (
        name.startswith("tools.") and _known_module(name) is not None)


def _violations(importer_top: str, forbidden) -> list[str]:
    return sorted(f"{imp.where()}: {imp.source} imports {imp.target}" for imp in _imports()
                  if _is_within(imp.source, importer_top) and forbidden(imp.target))


def test_memo_ext_imports_no_trainer_and_no_tool():
    """(c): memo_ext is the bottom layer; the estimator runs the tracer in worker processes."""
    bad = _violations("memo_ext", lambda name: _is_within(name, "megatron.training")
                      or _is_within(name, "pretrain_gpt") or _tool_module(name))
    assert not bad, "memo_ext imports a layer above it: " + "; ".join(bad)


def test_the_trainer_imports_no_tool():
    """(c): the tools (megatron/memo_tools, tools/) call megatron/training, never the reverse."""
    bad = _violations("megatron.training", _tool_module)
    assert not bad, "megatron/training imports the tools: " + "; ".join(bad)


def test_no_package_imports_pretrain_gpt():
    """(c): pretrain_gpt.py is the entry script; its model provider and forward step live in
    megatron/training/gpt.py, which the tracer and the tools import."""
    bad = [line for package in PACKAGES
           for line in _violations(package, lambda name: _is_within(name, "pretrain_gpt"))]
    assert not bad, "packages import the pretrain_gpt script: " + "; ".join(bad)
