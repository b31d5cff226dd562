"""What a trace depends on besides its command line, for the trace cache's key
(memo_ext.estimate.layout.TraceCache): the source of every project module the tracer imports,
and the versions of Python and of the dependencies it runs.

The modules come from the import graph, walked statically from the tracer's entry module (what
``python -m TRACE_MODULE`` runs, as the worker pool
memo_ext.estimate.tracer.TracerPool start it): every ``import`` and ``from ... import`` statement,
relative ones and those inside functions too, and the packages whose ``__init__`` importing a
module runs. Nothing is imported or executed: memo_ext does not import the trainer. The walk stays
in the project's own packages; torch and megatron-core are keyed by their versions instead.

Over-approximates on purpose: an import under ``if TYPE_CHECKING`` or in a function the tracer
never calls still counts; a miss would reuse a stale trace, an extra module only re-traces.
Imports by string (importlib.import_module) are not seen; the only ones in the project import
megatron.core modules, which the megatron-core version covers.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import platform
import sys
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from typing import Optional, Sequence

from memo_ext.estimate.memory import TRACE_MODULE

#: The import names the project owns: pyproject.toml's packages (megatron.training*,
#: megatron.memo_tools*, memo_ext*) and py-modules (pretrain_gpt). The graph is followed into
#: these only.
PROJECT_MODULES = ("memo_ext", "megatron.training", "megatron.memo_tools", "pretrain_gpt")
#: Distributions whose code the tracer runs, keyed by their installed versions; flash-attn's
#: decides which CUDA kernels' requests the attention tiles record (its absence: torch's own
#: FlashAttention-2 build, memo_ext.attention.kernels.installed_flash_attn).
DEPENDENCIES = ("torch", "megatron-core", "flash-attn")


def installed_versions() -> dict[str, Optional[str]]:
    """Python's version and each of DEPENDENCIES' (None when not installed), read from the
    distributions' metadata without importing them."""
    versions: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in DEPENDENCIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _owned(name: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in PROJECT_MODULES)


class _Finder:
    """Module specs found as the import system finds them (sys.meta_path's finders, or only
    the directories ``roots`` when given), without running any module or package."""

    def __init__(self, roots: Optional[Sequence[Path]] = None) -> None:
        self.roots = None if roots is None else [str(root) for root in roots]
        self._specs: dict[str, Optional[ModuleSpec]] = {}

    def spec(self, name: str) -> Optional[ModuleSpec]:
        if name not in self._specs:
            parent, _, _ = name.rpartition(".")
            search_path = self.roots
            if parent:
                parent_spec = self.spec(parent)
                search_path = parent_spec and parent_spec.submodule_search_locations
                if search_path is None:  # no parent, or a parent that is not a package
                    self._specs[name] = None
                    return None
            self._specs[name] = self._find(name, search_path)
        return self._specs[name]

    def _find(self, name: str, search_path) -> Optional[ModuleSpec]:
        if self.roots is not None:
            return PathFinder.find_spec(name, search_path)
        for finder in sys.meta_path:
            spec = finder.find_spec(name, search_path) if hasattr(finder, "find_spec") else None
            if spec is not None:
                return spec
        return None

    def file(self, name: str) -> Optional[Path]:
        """The file module ``name`` loads from (its ``__file__``); None when it is not
        installed or has none (a namespace package)."""
        spec = self.spec(name)
        return Path(spec.origin) if spec is not None and spec.has_location else None


def module_file(name: str, roots: Optional[Sequence[Path]] = None) -> Optional[Path]:
    """The file module ``name`` loads from, found as the import system finds it (within the
    directories ``roots`` only, when given) but without running it or its packages; None when
    it is not installed."""
    return _Finder(roots).file(name)


def _import_statements(statements: list) -> list:
    """The import statements among ``statements`` and the statements nested in them (function
    and class bodies, branches, handlers, match cases), without visiting expressions."""
    found = []
    for node in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            nested = getattr(node, name, None)
            if isinstance(nested, list):
                found += _import_statements(nested)
    return found


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """Every name an import statement of ``module`` may load as a module: ``import a.b``
    gives a.b; ``from a import b`` gives a and a.b (b may be a submodule or an attribute; the
    caller keeps what resolves); relative imports are made absolute."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in _import_statements(tree.body):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            anchor = ".".join(parts[:len(parts) - node.level + 1])
            base = f"{anchor}.{base}" if base else anchor
        names.append(base)
        names += [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    return names


def tracer_files(entry: str = TRACE_MODULE,
                 roots: Optional[Sequence[Path]] = None) -> dict[str, Path]:
    """Module name -> file of every project module running ``python -m entry`` imports (see
    the module docstring), found through sys.meta_path, or within ``roots`` only."""
    finder = _Finder(roots)
    files: dict[str, Path] = {}
    seen: set[str] = set()
    pending = [entry]
    while pending:
        name = pending.pop()
        if name in seen or not _owned(name):
            continue
        seen.add(name)
        path = finder.file(name)
        if path is None:  # an attribute imported with ``from``, or a namespace package
            continue
        files[name] = path
        parents = name.split(".")
        pending += [".".join(parents[:depth]) for depth in range(1, len(parents))]
        if path.suffix == ".py":
            tree = ast.parse(path.read_bytes(), filename=str(path))
            pending += _imported_names(tree, name, path.name == "__init__.py")
    return files


def tracer_digest(entry: str = TRACE_MODULE, roots: Optional[Sequence[Path]] = None,
                  versions: Optional[dict] = None) -> str:
    """sha256 over :func:`installed_versions` (or ``versions``) and the bytes of every file of
    :func:`tracer_files` (sources, and compiled extensions such as memo_ext._C). When the entry
    module cannot be found its name stands in for it."""
    digest = hashlib.sha256(json.dumps(installed_versions() if versions is None else versions,
                                       sort_keys=True).encode())
    files = tracer_files(entry, roots)
    if not files:
        digest.update(entry.encode())
    for name, path in sorted(files.items()):
        data = path.read_bytes()
        digest.update(f"\0{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


__all__ = ["DEPENDENCIES", "PROJECT_MODULES", "installed_versions", "module_file",
           "tracer_digest", "tracer_files"]
