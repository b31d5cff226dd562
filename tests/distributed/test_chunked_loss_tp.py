"""memo_ext.loss on two gloo ranks, vocabulary split over TP=2, with and without sequence
parallelism, against megatron's own path: the SP all-gather (or the TP copy) of megatron's
mappings, ``hidden @ W_shard.T``, ``vocab_parallel_cross_entropy``. Each rank's local input
gradient and weight-shard gradient must agree to fp32 round-off (1e-6 relative to the largest
entry: the sums are the same, in another order; see tests/unit/memo_ext/loss/test_chunked_loss.py)."""

from __future__ import annotations

import pytest
import torch

from tests.gloo_ranks import run_ranks

pytestmark = pytest.mark.distributed

S, B, H, V = 22, 2, 8, 40  # V/TP = 20 rows per rank; S/TP = 11 positions per rank with SP


def _relative_error(value, reference):
    return ((value - reference).abs().max() / reference.abs().max()).item()


def _check_rank(rank, world_size, cases):
    from megatron.core import parallel_state

    from megatron.training.compat import apply_cpu_shims

    apply_cpu_shims()  # megatron's SP gather allocates on torch.cuda.current_device()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        for sequence_parallel, chunk_size in cases:
            _check_case(rank, world_size, sequence_parallel, chunk_size)
    finally:
        parallel_state.destroy_model_parallel()


def _check_case(rank, world_size, sequence_parallel, chunk_size):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    from memo_ext.loss import chunked_vocab_parallel_cross_entropy

    group = parallel_state.get_tensor_model_parallel_group()
    generator = torch.Generator().manual_seed(0)  # the same full problem on both ranks
    hidden = torch.randn(S, B, H, generator=generator)
    weight = torch.randn(V, H, generator=generator) * 0.5
    target = torch.randint(0, V, (S, B), generator=generator)
    mask = (torch.rand(S, B, generator=generator) > 0.3).float()
    shard = V // world_size
    weight = weight[rank * shard:(rank + 1) * shard]
    if sequence_parallel:
        local = S // world_size
        hidden = hidden[rank * local:(rank + 1) * local]

    results = []
    for chunked in (False, True):
        x = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        if chunked:
            loss = chunked_vocab_parallel_cross_entropy(
                x, w, target, chunk_size=chunk_size, tp_group=group,
                sequence_parallel=sequence_parallel)
        else:
            full = (gather_from_sequence_parallel_region(x, group=group) if sequence_parallel
                    else copy_to_tensor_model_parallel_region(x, group=group))
            loss = vocab_parallel_cross_entropy(full @ w.t(), target)
        (loss * mask).sum().backward()
        results.append((loss.detach(), x.grad, w.grad))
    for name, reference, value in zip(("loss", "grad hidden", "grad weight"), *results):
        error = _relative_error(value, reference)
        assert error < 1e-6, (f"rank {rank} SP {sequence_parallel} chunk {chunk_size} "
                              f"{name}: relative error {error}")


def test_tp2_matches_megatron():
    # chunk 12 with SP: 3 local positions x 2 rows x 2 ranks per chunk, 11 positions -> 4
    # chunks, the last one short; without SP 6 positions per chunk; 1000: one chunk. One spawn
    # for all four cases (starting two ranks costs ~10 s on a loaded CPU).
    cases = [(sp, chunk) for sp in (True, False) for chunk in (12, 1000)]
    run_ranks(2, _check_rank, cases, timeout=120)
