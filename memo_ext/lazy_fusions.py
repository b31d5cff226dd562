"""megatron-core's fused element-wise functions compiled at their first call, not at import.

megatron-core decorates 38 functions with ``torch.compile`` as it is imported
(``megatron.core.jit`` binds its ``jit_fuser`` to it: the bias-GeLU/GeGLU/SwiGLU fusions,
activations, MoE helpers). torch.compile compiles only at a function's first call, but each
decoration builds dynamo's wrapper and the first one imports inductor: on a 2-core CPU machine
``import megatron.core`` takes 6.3 s, 3.7 s with the decorations deferred (``python -c "import
megatron.core"``, torch 2.13, megatron-core 0.16.1). Every trainer rank, tracer worker and tool
pays it, and most never call one of those functions (the CPU trainer turns the fusions off).

:func:`install` adds an import hook: once ``megatron.core.jit`` has run, its ``jit_fuser`` is
:func:`compile_on_first_call` instead of torch.compile itself. That calls torch.compile with the
same arguments at the function's first call and the compiled function from then on, so what
runs is what ran before, on every device; only the decoration's cost moves to the first call.
megatron-core's own ``enable_jit_fuser()`` / ``disable_jit_fuser()`` still rebind it.

Hand-written: megatron-core offers only the fuser on or off, and off would change what runs on
a GPU.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

#: The module whose ``jit_fuser`` the hook rebinds.
JIT_MODULE = "megatron.core.jit"


def compile_on_first_call(function=None, **options):
    """``torch.compile(function, **options)``, made at the first call; usable as
    ``@compile_on_first_call`` or ``@compile_on_first_call(**options)`` like torch.compile."""
    if function is None:
        return functools.partial(compile_on_first_call, **options)
    compiled = None

    @functools.wraps(function)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:  # two threads may both compile once: the same function either way
            import torch

            compiled = torch.compile(function, **options)
        return compiled(*args, **kwargs)

    return call


class _JitModuleLoader(importlib.machinery.SourceFileLoader):
    def exec_module(self, module) -> None:
        super().exec_module(module)
        import torch

        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = compile_on_first_call


class _JitModuleFinder(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit where the path finder does, and loads it with
    :class:`_JitModuleLoader` (a module installed without its source is left alone)."""

    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _JitModuleLoader(spec.loader.name, spec.loader.path)
        return spec


def install() -> None:
    """Add the import hook (once; without effect if megatron.core.jit is already imported)."""
    if not any(isinstance(finder, _JitModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _JitModuleFinder())
