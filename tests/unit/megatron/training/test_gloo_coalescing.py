"""megatron.training.compat.gloo_coalescing: megatron-core's asynchronous coalesced all-gathers
issued one by one on gloo, because torch's own coalesced ones corrupt the heap. The crash is a
race (a rank dies in some tries of thousands of steps), so no quick test can show it reliably:
bench/gloo_coalescing.py counts the deaths of each way of issuing them. These tests pin what
the shim does: one work per all-gather, the coalesced answer, other collectives left to torch,
and the trainer using it."""

from __future__ import annotations

from tests.gloo_ranks import run_ranks


def _one_work_per_all_gather(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from megatron.training.compat.gloo_coalescing import coalescing_manager

    group = dist.new_group(list(range(world_size)), backend="gloo")
    shards = [torch.full((3 + k,), float(10 * rank + k)) for k in range(3)]
    outs = [torch.empty(2 * (3 + k)) for k in range(3)]
    with coalescing_manager(group, async_ops=True) as handle:
        for out, shard in zip(outs, shards):
            dist.all_gather_into_tensor(out, shard, group=group)
    # one work per all-gather, none left for torch's coalesced exit
    assert len(handle.works) == 3 and group not in c10d._world.pg_coalesce_state
    handle.wait()
    for k, out in enumerate(outs):
        assert out.tolist() == [float(k)] * (3 + k) + [float(10 + k)] * (3 + k)
    # a reduce-scatter is left to torch's own path: one coalesced work
    full, reduced = torch.ones(4), torch.empty(2)
    with coalescing_manager(group, async_ops=True) as handle:
        dist.reduce_scatter_tensor(reduced, full, group=group)
    assert len(handle.works) == 1
    handle.wait()
    assert reduced.tolist() == [2.0, 2.0]


def test_all_gathers_are_issued_one_by_one_with_the_coalesced_answer():
    run_ranks(2, _one_work_per_all_gather)


def test_the_trainer_applies_it_to_both_bucket_modules():
    from megatron.core.distributed import param_and_grad_buffer as ddp_buffers
    from megatron.core.distributed.fsdp.src.megatron_fsdp import (
        param_and_grad_buffer as fsdp_buffers,
    )
    from megatron.training.compat import apply_cpu_shims
    from megatron.training.compat.gloo_coalescing import coalescing_manager

    apply_cpu_shims()
    assert ddp_buffers._coalescing_manager is coalescing_manager
    assert fsdp_buffers._coalescing_manager is coalescing_manager
