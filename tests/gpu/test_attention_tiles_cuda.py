"""memo_ext.attention_tiles on CUDA (skipped without a GPU): torch's FlashAttention-2 kernel in
bf16 and the explicit fp32 softmax, tile by tile, against attention over all keys at once."""

from __future__ import annotations

import pytest
import torch

from memo_ext.attention_tiles import kernel_for
from tests.unit.test_attention_tiles import HEAD_DIM, random_inputs, reference, tiled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("kernel, dtype, tolerance", [("cuda_flash", torch.bfloat16, 5e-2),
                                                      ("explicit", torch.float32, 1e-5)])
def test_tiles_equal_attention_over_all_keys_on_cuda(kernel, dtype, tolerance):
    inputs = random_inputs("cuda")
    scale = HEAD_DIM ** -0.5
    expected = reference(*(t.to(dtype).float() for t in inputs), scale)
    got = tiled(*inputs, scale, kernel, dtype=dtype)
    for name, value, want in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert (value - want.detach()).abs().max().item() < tolerance, name


def test_bf16_uses_the_flash_kernel():
    assert kernel_for(torch.empty(1, 1, 4, 64, device="cuda", dtype=torch.bfloat16)) == \
        "cuda_flash"
    assert kernel_for(torch.empty(1, 1, 4, 64, device="cuda")) == "explicit"
