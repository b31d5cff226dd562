"""METP's ring MLP on 2 and 4 gloo ranks against a single-process reference (docs/metp.md): output
and gradients (input, fc1 weight and bias, fc2 weight) within 1e-5 mean absolute error in fp32,
for GeLU and SwiGLU (gated halves interleaved per shard as Megatron shards them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gloo_ranks import run_ranks

SEQ, BATCH, HIDDEN, FFN = 16, 2, 8, 24
MEAN_ABS_TOLERANCE = 1e-5


def _gelu(x):
    return F.gelu(x)


def _swiglu(x):
    gate, linear = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * linear


def _full_problem(gated: bool, bias: bool):
    generator = torch.Generator().manual_seed(7)
    width = 2 * FFN if gated else FFN
    return (torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
            torch.randn(width, HIDDEN, generator=generator) / HIDDEN ** 0.5,
            torch.randn(width, generator=generator) if bias else None,
            torch.randn(HIDDEN, FFN, generator=generator) / FFN ** 0.5,
            torch.randn(SEQ, BATCH, HIDDEN, generator=generator))


def _column_shard(weight, rank, size, gated):
    """Megatron's ColumnParallelLinear shard; gated: this rank's gate rows then its linear rows."""
    if weight is None:
        return None
    if not gated:
        return weight.chunk(size, dim=0)[rank]
    gate, linear = weight.chunk(2, dim=0)
    return torch.cat([gate.chunk(size, dim=0)[rank], linear.chunk(size, dim=0)[rank]])


def _check_ring_mlp(rank, size, gated, bias):
    from memo_ext.metp.mlp import ring_mlp
    from memo_ext.attention.ring import Ring

    activation = _swiglu if gated else _gelu
    x, w1, b1, w2, grad = _full_problem(gated, bias)
    reference_inputs = [t.clone().requires_grad_() for t in (x, w1, w2)]
    reference_bias = None if b1 is None else b1.clone().requires_grad_()
    reference = F.linear(activation(F.linear(reference_inputs[0], reference_inputs[1],
                                             reference_bias)), reference_inputs[2])
    reference.backward(grad)

    local = SEQ // size
    rows = slice(rank * local, (rank + 1) * local)
    x_i = x[rows].clone().requires_grad_()
    w1_i = _column_shard(w1, rank, size, gated).clone().requires_grad_()
    b1_i = None if b1 is None else _column_shard(b1, rank, size, gated).clone().requires_grad_()
    w2_i = w2.chunk(size, dim=1)[rank].clone().requires_grad_()
    out = ring_mlp(x_i, w1_i, b1_i, w2_i, activation, Ring())
    out.backward(grad[rows])

    def close(name, actual, expected):
        error = (actual - expected).abs().mean().item()
        assert error < MEAN_ABS_TOLERANCE, f"rank {rank}: {name} mean abs error {error}"

    close("output", out, reference[rows])
    close("grad input", x_i.grad, reference_inputs[0].grad[rows])
    close("grad fc1 weight", w1_i.grad, _column_shard(reference_inputs[1].grad, rank, size, gated))
    close("grad fc2 weight", w2_i.grad, reference_inputs[2].grad.chunk(size, dim=1)[rank])
    if bias:
        close("grad fc1 bias", b1_i.grad, _column_shard(reference_bias.grad, rank, size, gated))
    # Exactness is not just averaged: no element may be far off either.
    assert torch.allclose(out, reference[rows], atol=1e-5, rtol=1e-4)


def _check_all_cases(rank, size):
    for gated, bias in ((False, True), (True, False)):
        _check_ring_mlp(rank, size, gated, bias)


# p=2 is slow: at p=4 each rank's two ring neighbours differ (at p=2 they are one rank), so p=4
# is the stricter case; p=2 is in the default suite through the trainer
# (tests/distributed/test_metp_exactness.py, TP=2).
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_ring_mlp_matches_single_process(world_size):
    run_ranks(world_size, _check_all_cases)


def _check_transfer_progresses_during_compute(rank, size):
    """The ring's transfer is not deferred to wait(): 16 MiB arrive in the receive buffer while
    this rank only computes (gloo moves them on its own threads; its Work reports completion
    only inside wait(), so the buffer itself is watched), which is what lets the next shard's
    transfer overlap the current shard's matmuls."""
    import time

    from memo_ext.attention.ring import WEIGHTS_TAG, Ring

    ring = Ring()
    send = torch.full((4 << 20,), float(rank))
    receive = torch.full_like(send, float("nan"))
    transfer = ring.exchange(send, receive, WEIGHTS_TAG)
    left = torch.randn(256, 256)
    deadline = time.monotonic() + 20
    while torch.isnan(receive[-1]):
        assert time.monotonic() < deadline, "the transfer made no progress during compute"
        left = torch.tanh(left @ left)  # compute only: no call into torch.distributed
    transfer.wait()
    assert torch.equal(receive, torch.full_like(send, float((rank + 1) % size)))


def test_ring_transfer_progresses_during_compute():
    run_ranks(2, _check_transfer_progresses_during_compute)
