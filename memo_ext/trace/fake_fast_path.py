"""FakeTensorMode's own answers for the two kinds of op that make most of a trace's dispatches,
given by the recorder without a second trip through FakeTensorMode's dispatch cache.

A tiled 7B MEMO trace (TP=4 CP=2, 16 MLP and projection tiles, 8 head chunks, 5 layers)
dispatches about 62,000 ops: 35,000 device queries that the autograd engine and TensorIterator
make of every fake tensor, and 14,000 views (the tiles' and heads' slices, permutes, selects);
neither allocates. Through FakeTensorMode a view costs its cache key (every argument's metadata
flattened and hashed) and a replay of the cached output, hundreds of microseconds; here it is
the meta kernel and the wrap FakeTensorMode itself does on a cache miss. Written by hand because
torch offers no cheaper entry point into FakeTensorMode for ops it already knows how to run;
what it does follows torch/_subclasses/fake_tensor.py (FakeTensor.__torch_dispatch__ for
``prim.device``; ``in_kernel_invocation_manager`` and ``FakeTensor(mode, meta, device)`` as
``FakeTensorMode._dispatch_impl`` and ``from_meta_and_device`` run a view). Anything outside
the plain case (a constant fake tensor, other tensor arguments, a mutating view, a real
tensor) returns :data:`NOT_HANDLED` and goes through FakeTensorMode as before.
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

NOT_HANDLED = object()

#: A query of a tensor's device, no data: the autograd engine and TensorIterator ask it of every
#: fake tensor they touch, over half of a tiled MEMO trace's dispatched ops (35,303 of 61,712,
#: 7B TP=4 CP=2, 16 MLP tiles, 128K tokens). It allocates, frees and computes nothing.
DEVICE_QUERY = torch.ops.prim.device.default


def device_query(args) -> object:
    """``prim.device`` of a fake tensor: its fake device, FakeTensor's own answer outside a
    kernel invocation (inside one, FakeTensorMode answers "meta" itself)."""
    tensor = args[0]
    if type(tensor) is FakeTensor and not tensor.fake_mode.in_kernel_invocation:
        return tensor.fake_device
    return NOT_HANDLED


@functools.cache
def _is_plain_view(func) -> bool:
    return isinstance(func, torch._ops.OpOverload) and func.is_view \
        and not func._schema.is_mutable


def view(func, args, kwargs) -> object:
    """A non-mutating view op of one non-constant fake tensor: the meta kernel's alias of its
    storage, wrapped as the FakeTensor FakeTensorMode would return (same storage, same
    device)."""
    if not _is_plain_view(func) or not args:
        return NOT_HANDLED
    base = args[0]
    if type(base) is not FakeTensor or base.constant is not None:
        return NOT_HANDLED
    mode = base.fake_mode
    if mode.in_kernel_invocation or any(isinstance(arg, torch.Tensor) for arg in args[1:]) \
            or any(isinstance(value, torch.Tensor) for value in kwargs.values()):
        return NOT_HANDLED
    with in_kernel_invocation_manager(mode):
        out = func(*args, **kwargs)
    device = base.fake_device
    if isinstance(out, torch.Tensor):
        return FakeTensor(mode, out, device)
    return type(out)(FakeTensor(mode, tensor, device) for tensor in out)
