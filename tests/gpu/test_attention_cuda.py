"""memo_ext.attention on CUDA (skipped without a GPU): the CUDA tile kernels -- cuDNN's fused
attention, the flash kernels (flash-attn when installed, torch's FlashAttention-2 build
otherwise) -- in bf16 against the explicit fp32 kernel, for one causal tile, GQA and an unmasked
tile, with q/k/v/out/grad as the trainer passes them ([b, heads, s, d] views of Megatron's
[s, b, heads, d]); the dispatch on this GPU; cuDNN's log-sum-exp layout; and every tile
composition (ring, documents, head chunks) on cuDNN against a dense reference."""

from __future__ import annotations

import pytest
import torch

from memo_ext.attention import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _has_cudnn_attention() -> bool:
    capability = torch.cuda.get_device_capability()
    return (kernels.cudnn_attention_available()
            and kernels.CUDNN_MIN_CAPABILITY <= capability <= kernels.CUDNN_MAX_CAPABILITY)


needs_cudnn = pytest.mark.skipif(not torch.cuda.is_available() or not _has_cudnn_attention(),
                                 reason="needs cuDNN's fused attention (cuDNN >= 9, sm80-sm121)")


def _megatron_inputs(groups: int, seq: int = 256, batch: int = 2, heads: int = 4,
                     dim: int = 64):
    """q, grad [b, heads, s, d] and k, v [b, groups, s, d], each a view of a contiguous
    [s, b, heads|groups, d] tensor, as core_attention and the ring pass them."""
    generator = torch.Generator(device="cuda").manual_seed(0)

    def draw(n):
        return torch.randn(seq, batch, n, dim, device="cuda", generator=generator,
                           dtype=torch.bfloat16).permute(1, 2, 0, 3)

    return draw(heads), draw(groups), draw(groups), draw(heads)


def _tile(kernel, q, k, v, grad, causal, out_layout="megatron"):
    with kernels.forced_kernel(kernel):
        out, lse = torch.ops.memo_attention.tile_forward(q, k, v, 0.125, causal, 0.0, 0)
        saved = (out.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
                 if out_layout == "megatron" else out.contiguous())
        grads = torch.ops.memo_attention.tile_backward(grad, q, k, v, saved, lse, 0.125,
                                                       causal, 0.0, 0)[:3]
    return [out, lse, *grads]


def _compare(kernel, groups, causal, out_layout="megatron"):
    q, k, v, grad = _megatron_inputs(groups)
    got = _tile(kernel, q, k, v, grad, causal, out_layout)
    want = _tile("explicit", q, k, v, grad, causal)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        assert (a.float() - b.float()).abs().max().item() < 5e-2, name


@pytest.mark.parametrize("groups, causal", [(4, True), (2, True), (2, False)])
def test_flash_tiles_match_the_explicit_kernel(groups, causal):
    _compare("cuda_flash", groups, causal)


@needs_cudnn
@pytest.mark.parametrize("groups, causal", [(4, True), (2, True), (1, True), (2, False)])
def test_cudnn_tiles_match_the_explicit_kernel(groups, causal):
    _compare("cuda_cudnn", groups, causal)


@needs_cudnn
def test_cudnn_backward_takes_out_in_another_layout_under_the_same_graph():
    """The same q/k/v (one cached cuDNN graph per thread): out handed back contiguous instead
    of as Megatron's view still gives the right gradients (the dispatch lays it out as q)."""
    _compare("cuda_cudnn", 2, True, out_layout="megatron")
    _compare("cuda_cudnn", 2, True, out_layout="contiguous")


@needs_cudnn
def test_cudnns_log_sum_exp_is_fa2s_in_b_h_s_1():
    q, k, v, _ = _megatron_inputs(2)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=0.125)
    assert lse.shape == (*q.shape[:3], 1) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.stride() == q.stride()  # alloc_with_matching_layout
    with kernels.forced_kernel("explicit"):
        _, reference = torch.ops.memo_attention.tile_forward(q, k, v, 0.125, True, 0.0, 0)
    assert (lse.squeeze(-1) - reference).abs().max().item() < 1e-2


def test_this_gpu_dispatches_the_backend_auto_chooses():
    bf16 = torch.empty(1, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    want = kernels.cuda_backend(torch.cuda.get_device_capability(),
                                kernels.cudnn_attention_available())
    assert kernels.kernel_for(bf16, key_length=4) == want
    assert kernels.kernel_for(torch.empty(1, 1, 4, 64, device="cuda")) == "explicit"


@needs_cudnn
def test_every_tile_composition_on_cudnn():
    """The ring CP=2/4 (ranks as threads), packed documents, head chunks at micro-batch 2,
    all tiles on cuDNN (--attention-backend fused), against a dense fp32 reference."""
    from megatron.memo_tools.gpu_check import ring_composition

    saved = kernels.attention_backend()
    kernels.set_attention_backend("fused")
    try:
        for case in ring_composition.cases(1024):
            result = ring_composition.check(case, 1024, heads=8, groups=2, head_dim=128)
            assert result.passed, (case.name, result.errors)
    finally:
        kernels.set_attention_backend(saved)
