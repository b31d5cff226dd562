"""Allocation tags: what category and module name the allocations of a block get
(:func:`tagged_allocations`), and the tags autograd nodes carry so that backward work is
attributed to the module and layer that ran the forward."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Optional

import torch

from memo_ext.trace.format import CATEGORIES

_TAG = "memo_planner_tag"
# Per thread: tagged_allocations' (category, name) stack and _host_side's depth.
_TLS = threading.local()


@contextlib.contextmanager
def tagged_allocations(category: Optional[str] = None, name: Optional[str] = None):
    """Allocations made in this block (this thread) get ``category`` and ``module`` = ``name``
    in every active :class:`AllocationRecorder` (e.g. optimizer state, a modelled workspace)."""
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; use one of {CATEGORIES}")
    stack = getattr(_TLS, "overrides", None)
    if stack is None:
        stack = _TLS.overrides = []
    stack.append((category, name))
    try:
        yield
    finally:
        stack.pop()


def _current_override() -> tuple[Optional[str], Optional[str]]:
    """(category, name) of the innermost tagged_allocations blocks that set each."""
    category = name = None
    for entry_category, entry_name in reversed(getattr(_TLS, "overrides", None) or ()):
        category = category or entry_category
        name = name or entry_name
    return category, name


def _tensors_in(obj) -> Iterator[torch.Tensor]:
    """The tensors in nested tuples/lists/dicts (an op's arguments or outputs), in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list, dict)):
                yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)


def _tag_graph(roots: Iterable, tag: tuple) -> None:
    """Tag the autograd nodes reachable from ``roots`` (tensors or nodes) that carry no tag yet;
    stop at tagged nodes (they belong to earlier or inner modules)."""
    stack = []
    for root in roots:
        node = root.grad_fn if isinstance(root, torch.Tensor) else root
        if node is not None:
            stack.append(node)
    while stack:
        node = stack.pop()
        metadata = node.metadata
        if _TAG in metadata:
            continue
        metadata[_TAG] = tag
        for child, _ in node.next_functions:
            if child is not None:
                stack.append(child)



def _clean_module_name(name: str) -> str:
    """Module names without the wrappers' prefixes (DDP's and Float16Module's ``module.``)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return "model" if name in ("", "module") else name
