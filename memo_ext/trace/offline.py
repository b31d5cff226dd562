"""Offline tracing without devices: a fake process group (:func:`fake_distributed`), fake tensors
(:func:`fake_tensors`), and host-side blocks that run with real tensors and record nothing
(megatron's RNG-tracker forks)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from memo_ext.trace.tagging import _TLS

@contextlib.contextmanager
def fake_distributed(world_size: int, rank: int, tensor_parallel_size: int = 1,
                     pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1,
                     seed: int = 1234) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks seen from ``rank`` (collectives are no-ops)
    with megatron's parallel state (no gloo groups, which the fake backend cannot create) and
    its model-parallel RNG tracker seeded. Everything is torn down on exit."""
    from megatron.core import parallel_state, tensor_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_distributed: torch.distributed is already initialised in this "
                           "process; trace in a fresh process")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            context_parallel_size=context_parallel_size,
            create_gloo_process_groups=False,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def _host_side() -> Iterator[None]:
    """Host-side bookkeeping: real tensors even under FakeTensorMode, and no events."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    depth = getattr(_TLS, "untraced", 0)
    _TLS.untraced = depth + 1
    try:
        with unset_fake_temporarily():
            yield
    finally:
        _TLS.untraced = depth


@contextlib.contextmanager
def untraced_rng_forks() -> Iterator[None]:
    """Run the bookkeeping of megatron's RNG tracker ``fork()`` (saving, swapping and comparing
    generator states: CPU tensors, on GPU too) host-side: not recorded, and with real tensors
    under FakeTensorMode, where its ``.item()`` on a state comparison could not be answered.
    The forked region's own ops are recorded as usual."""
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = megatron_random.get_cuda_rng_tracker()
    original = tracker.fork

    @contextlib.contextmanager
    def fork(*args, **kwargs):
        manager = original(*args, **kwargs)
        with _host_side():
            manager.__enter__()
        try:
            yield
        except BaseException:
            with _host_side():
                if not manager.__exit__(*sys.exc_info()):
                    raise
        else:
            with _host_side():
                manager.__exit__(None, None, None)

    had_own = "fork" in vars(tracker)
    saved = vars(tracker).get("fork")
    tracker.fork = fork
    try:
        yield
    finally:
        if had_own:
            tracker.fork = saved
        else:
            del tracker.fork


@contextlib.contextmanager
def fake_tensors() -> Iterator[Any]:
    """``FakeTensorMode`` on the CPU device for offline traces (mode (c)), entered, with
    megatron's RNG forks made host-side (:func:`untraced_rng_forks`). Enter it inside
    :func:`fake_distributed` (the RNG tracker must exist)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with untraced_rng_forks(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode
