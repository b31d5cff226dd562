"""memo_ext.attention_tiles: attention split into key tiles, merged by log-sum-exp in forward
and differentiated tile by tile against the row's output and log-sum-exp in backward, equals
attention over all keys at once (a float64 autograd reference), for every kernel this machine
can run (torch's CPU flash kernel and the explicit softmax)."""

from __future__ import annotations

import pytest
import torch

from memo_ext.attention_tiles import kernel_for, merge_tile, tile_backward, tile_forward

BATCH, HEADS, BLOCK, HEAD_DIM, BLOCKS = 2, 3, 16, 8, 3


def reference(query, key, value, grad_out, scale):
    """Queries = the last block, keys = every block, causal bottom-right aligned."""
    q, k, v = (t.double().requires_grad_() for t in (query, key, value))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    lq, lk = scores.shape[-2:]
    positions = torch.arange(lk, device=scores.device)
    masked = positions[None, :] > positions[-lq:, None]
    scores = scores.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    out.backward(grad_out.double())
    return out, lse, q.grad, k.grad, v.grad


def tiled(query, key, value, grad_out, scale, kernel, dtype=torch.float32):
    query, key, value, grad_out = (t.to(dtype) for t in (query, key, value, grad_out))
    tiles = [(key[..., j * BLOCK:(j + 1) * BLOCK, :], value[..., j * BLOCK:(j + 1) * BLOCK, :],
              j == BLOCKS - 1) for j in range(BLOCKS)]
    out = lse = None
    for k, v, causal in tiles:
        out, lse = merge_tile(out, lse, *tile_forward(query, k, v, causal, scale, kernel))
    out = out.to(dtype)
    grads = [tile_backward(grad_out, query, k, v, out, lse, causal, scale, kernel)
             for k, v, causal in tiles]
    grad_q = sum(g[0].double() for g in grads)
    grad_k = torch.cat([g[1].double() for g in grads], dim=-2)
    grad_v = torch.cat([g[2].double() for g in grads], dim=-2)
    return out.double(), lse.double(), grad_q, grad_k, grad_v


def random_inputs(device="cpu"):
    generator = torch.Generator().manual_seed(0)
    shape = (BATCH, HEADS, BLOCK, HEAD_DIM)
    query = torch.randn(shape, generator=generator)
    key = torch.randn(BATCH, HEADS, BLOCK * BLOCKS, HEAD_DIM, generator=generator)
    value = torch.randn(BATCH, HEADS, BLOCK * BLOCKS, HEAD_DIM, generator=generator)
    grad_out = torch.randn(shape, generator=generator)
    return [t.to(device) for t in (query, key, value, grad_out)]


@pytest.mark.parametrize("kernel", ["cpu_flash", "explicit"])
def test_tiles_equal_attention_over_all_keys(kernel):
    inputs = random_inputs()
    scale = HEAD_DIM ** -0.5
    expected = reference(*inputs, scale)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), tiled(*inputs, scale, kernel),
                               expected):
        assert (got - want.detach()).abs().max().item() < 1e-5, name


def test_kernel_choice():
    assert kernel_for(torch.empty(1, 1, 4, 8)) == "cpu_flash"
    assert kernel_for(torch.empty(1, 1, 4, 8, device="meta")) == "explicit"
