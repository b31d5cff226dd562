"""memo_ext.trace.fake_fast_path: the recorder answers fake tensors' device queries and plain
views itself, with what FakeTensorMode would return (same metadata, same storage, same fake
device), and a trace is the same event for event with and without it."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.training import tracing
from memo_ext.trace import fake_fast_path
from tests.conftest import trace_request


class _BothWays(TorchDispatchMode):
    """Runs each op through FakeTensorMode (below) and asks the fast path too."""

    def __init__(self):
        super().__init__()
        self.pairs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fast = fake_fast_path.view(func, args, kwargs)
        out = func(*args, **kwargs)
        self.pairs.append((func, fast, out))
        return out


VIEWS = {
    "slice": lambda x: x[:, 2:6],
    "select": lambda x: x[1],
    "permute": lambda x: x.permute(2, 0, 1),
    "transpose": lambda x: x.transpose(0, 2),
    "unsqueeze": lambda x: x.unsqueeze(-1),
    "view": lambda x: x.view(4, -1),
    "expand": lambda x: x[:, :1].expand(4, 8, 16),
    "as_strided": lambda x: x.as_strided((2, 3), (16, 1), 5),
    "split": lambda x: x.split(3, dim=1),
    "unbind": lambda x: x.unbind(0),
    "detach": lambda x: x.detach(),
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_views_are_what_fake_tensor_mode_returns(name):
    with FakeTensorMode() as mode:
        base = torch.empty(4, 8, 16, dtype=torch.bfloat16)
        both = _BothWays()
        with both:
            VIEWS[name](base)
    handled = [(fast, out) for _func, fast, out in both.pairs
               if fast is not fake_fast_path.NOT_HANDLED]
    assert handled, f"{name}: no op took the fast path"
    for fast, out in handled:
        fast_list = list(fast) if isinstance(fast, (tuple, list)) else [fast]
        out_list = list(out) if isinstance(out, (tuple, list)) else [out]
        assert len(fast_list) == len(out_list)
        for mine, theirs in zip(fast_list, out_list):
            assert type(mine) is FakeTensor and mine.fake_mode is mode
            assert (mine.shape, mine.stride(), mine.storage_offset(), mine.dtype) == (
                theirs.shape, theirs.stride(), theirs.storage_offset(), theirs.dtype)
            assert mine.device == theirs.device == torch.device("cpu")
            assert mine.untyped_storage()._cdata == base.untyped_storage()._cdata


def test_what_is_not_a_plain_view_of_a_fake_tensor_goes_through_fake_tensor_mode():
    aten = torch.ops.aten
    real = torch.empty(4, 4)
    with FakeTensorMode() as mode:
        fake = torch.empty(4, 4)
        constant = mode.from_tensor(torch.tensor([1.0, 2.0]), static_shapes=True)
        constant.constant = torch.tensor([1.0, 2.0])
        for func, args in ((aten.add.Tensor, (fake, fake)),  # computes
                           (aten.t_.default, (fake,)),  # mutates the metadata in place
                           (aten.slice.Tensor, (real, 0, 0, 2)),  # not fake
                           (aten.slice.Tensor, (constant, 0, 0, 1))):  # a tracked constant
            assert fake_fast_path.view(func, args, {}) is fake_fast_path.NOT_HANDLED, func
        assert fake_fast_path.device_query((fake,)) == torch.device("cpu")
        assert fake_fast_path.device_query((real,)) is fake_fast_path.NOT_HANDLED


@pytest.mark.slow  # 8 s; test_tile_copies.py's default cases compare against this path too
def test_a_trace_is_the_same_without_the_fast_path(monkeypatch):
    """A MEMO stage over a CP=2 ring with tiled MLP and projections: views and device queries
    make most of its ops."""
    request = trace_request(
        ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
         "--vocab-size", "256", "--bf16", "--context-parallel-size", "2", "--memo-offload",
         "--memo-alpha", "1", "--memo-mlp-tiles", "4", "--memo-attention-projection-tiles", "4",
         "--memo-attention-head-chunks", "2"], 1024)
    fast, _ = tracing.record(request)
    with monkeypatch.context() as patch:
        patch.setattr(fake_fast_path, "view", lambda *args: fake_fast_path.NOT_HANDLED)
        patch.setattr(fake_fast_path, "device_query", lambda *args: fake_fast_path.NOT_HANDLED)
        slow, _ = tracing.record(request)
    assert fast.events == slow.events
    assert fast.header == slow.header
