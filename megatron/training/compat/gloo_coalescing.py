"""megatron-core's asynchronous coalesced all-gathers on gloo, issued one by one.

torch 2.13's gloo corrupts the heap when an asynchronous coalesced all-gather
(``all_gather_into_tensor`` inside ``_coalescing_manager(group, async_ops=True)``, which gloo
runs as ``all_gather_single_coalesced``) is in flight while the rank's main thread goes on
allocating: a rank dies with ``malloc(): unaligned tcache chunk detected`` (SIGABRT) or
SIGSEGV, detected on a gloo thread, and its peer then loses the connection. It is torch's, not
megatron-core's: ``python bench/gloo_coalescing.py`` shows it with no megatron code (two gloo
ranks keeping six such all-gathers in flight while allocating; bench/results/gloo_coalescing.md),
and shows that the same all-gathers coalesced but synchronous, or issued one by one
asynchronously, and asynchronous coalesced reduce-scatters and all-reduces, do not die.

Two megatron-core paths issue exactly that on CPU: Megatron-FSDP's parameter all-gathers,
prefetched a layer or more ahead (megatron_fsdp/param_and_grad_buffer.py
``AllGatherPipeline.all_gather_params``), and the DDP buffers' with ``--overlap-param-gather``
(distributed/param_and_grad_buffer.py ``start_param_sync``). This was docs/training.md's rare
Megatron-FSDP crash (a DP=2 run died in 2 of 13 tries beside a busy core; 0 of 40 with this).

:func:`coalescing_manager` is torch's ``_coalescing_manager`` for those two modules, except that
on a gloo group with ``async_ops`` the all-gathers it collected are issued one by one, each
asynchronous, in the order given, and the handle waits for all of them. An all-gather copies
shards, so the gathered bytes are the coalesced ones; the order of issue is the same on every
rank, which is what gloo pairs collectives by. Everything else (synchronous blocks, other
collectives, other backends) is torch's own path, unchanged. On CUDA nothing here applies
(compat.apply_cpu_shims).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_torch_coalescing_manager = c10d._coalescing_manager

# The megatron-core modules that bind ``_coalescing_manager`` at import and issue asynchronous
# coalesced all-gathers with it.
_PATCHED_MODULES = (
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
)


@contextlib.contextmanager
def coalescing_manager(group=None, device=None, async_ops: bool = False):
    """torch's ``_coalescing_manager(group, device, async_ops)``; on gloo with ``async_ops``,
    the all-gathers of the block issued one by one (module docstring)."""
    with _torch_coalescing_manager(group, device=device, async_ops=async_ops) as handle:
        yield handle
        process_group = group or c10d._get_default_group()
        if async_ops and dist.get_backend(process_group) == "gloo":
            _issue_all_gathers_one_by_one(process_group, handle)


def _issue_all_gathers_one_by_one(process_group, handle) -> None:
    """Take the all-gathers torch collected for ``process_group`` out of its coalescing list
    and issue each now, adding its work to ``handle``; torch's exit then finds an empty list
    and issues nothing (other collectives are left for it)."""
    collected = c10d._world.pg_coalesce_state[process_group]
    if not collected or any(op.op is not c10d.all_gather_single for op in collected):
        return
    gathers = list(collected)
    collected.clear()
    for gather in gathers:
        options = c10d.AllgatherOptions()
        options.asyncOp = True
        handle.append(process_group.all_gather_single(gather.dst_tensor, gather.tensor,
                                                      options))


def issue_gloo_all_gathers_one_by_one() -> None:
    """Give megatron-core's two bucket modules :func:`coalescing_manager`."""
    import importlib

    for name in _PATCHED_MODULES:
        importlib.import_module(name)._coalescing_manager = coalescing_manager
