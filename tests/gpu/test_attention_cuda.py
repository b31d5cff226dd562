"""memo_ext.attention on CUDA (skipped without a GPU): the flash kernels (flash-attn when
installed, torch's FlashAttention-2 build otherwise) in bf16 against the explicit fp32 kernel,
for one causal tile, GQA and an unmasked tile."""

from __future__ import annotations

import pytest
import torch

from memo_ext.attention import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("groups, causal", [(4, True), (2, True), (2, False)])
def test_flash_tiles_match_the_explicit_kernel(groups, causal):
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, grad = (torch.randn(2, 4, 256, 64, device="cuda", generator=generator,
                           dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, groups, 256, 64, device="cuda", generator=generator,
                        dtype=torch.bfloat16) for _ in range(2))
    results = {}
    for kernel in ("cuda_flash", "explicit"):
        with kernels.forced_kernel(kernel):
            out, lse = torch.ops.memo_attention.tile_forward(q, k, v, 0.125, causal, 0.0, 0)
            grads = torch.ops.memo_attention.tile_backward(grad, q, k, v, out, lse, 0.125,
                                                           causal, 0.0, 0)[:3]
        results[kernel] = [out, lse, *grads]
    for name, flash, explicit in zip(("out", "lse", "dq", "dk", "dv"), *results.values()):
        assert (flash.float() - explicit.float()).abs().max().item() < 5e-2, name


def test_bf16_uses_the_flash_kernel():
    assert kernels.kernel_for(torch.empty(1, 1, 4, 64, device="cuda", dtype=torch.bfloat16)) \
        == "cuda_flash"
    assert kernels.kernel_for(torch.empty(1, 1, 4, 64, device="cuda")) == "explicit"
