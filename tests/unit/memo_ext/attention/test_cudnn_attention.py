"""cuDNN's fused attention on the "cuda_cudnn" path of memo_ext.attention.kernels, on CPU: the
dispatch choice by compute capability and --attention-backend, the tiles run through
tests/cuda_double.py's CudnnAttentionDouble (the ops' real schemas, the [b, heads, s_q, 1]
log-sum-exp, operands read as cuDNN's cached graphs read them) against the explicit kernel and
in every composition the trainer runs, the double's own teeth, the backward workspaces a trace
declares, and the trainer flag. The arithmetic of the real kernel is for tests/gpu/."""

from __future__ import annotations

import pytest
import torch

from memo_ext.attention import kernels

SEQ, BATCH, HEADS, GROUPS, DIM = 24, 2, 4, 2, 8
SCALE = DIM ** -0.5
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def megatron_views(seq=SEQ, batch=BATCH, seed=0):
    """q, k, v, grad as the trainer passes them: [b, heads, s, d] views of [s, b, heads, d]."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(seq, batch, HEADS, DIM), (seq, batch, GROUPS, DIM), (seq, batch, GROUPS, DIM),
              (seq, batch, HEADS, DIM)]
    return [torch.randn(shape, generator=generator).permute(1, 2, 0, 3) for shape in shapes]


def tile(kernel, q, k, v, grad, causal=True):
    """(out, lse, dq, dk, dv) of one tile run by ``kernel``; out handed back to the backward
    in Megatron's layout, as core_attention saves it."""
    with kernels.forced_kernel(kernel):
        out, lse = torch.ops.memo_attention.tile_forward(q, k, v, SCALE, causal, 0.0, 0)
        saved = out.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
        grads = torch.ops.memo_attention.tile_backward(grad, q, k, v, saved, lse, SCALE, causal,
                                                       0.0, 0)[:3]
    return [out, lse, *grads]


# ------------------------------------------------------------------------- the choice

@pytest.mark.parametrize("capability, available, backend, want", [
    ((9, 0), True, "auto", "cuda_cudnn"), ((10, 0), True, "auto", "cuda_cudnn"),
    ((12, 1), True, "auto", "cuda_cudnn"), ((12, 2), True, "auto", "cuda_flash"),
    ((8, 0), True, "auto", "cuda_flash"), ((8, 9), True, "auto", "cuda_flash"),
    ((9, 0), False, "auto", "cuda_flash"), ((8, 0), True, "fused", "cuda_cudnn"),
    ((9, 0), True, "flash", "cuda_flash"), ((9, 0), True, "unfused", "explicit"),
])
def test_the_cuda_backend_by_compute_capability(capability, available, backend, want):
    assert kernels.cuda_backend(capability, available, backend) == want


def test_fused_is_refused_where_cudnn_cannot_run_and_local_always():
    with pytest.raises(ValueError, match=r"^--attention-backend fused .* 8\.0 to 12\.1, this "
                                         r"is 7\.5; use --attention-backend auto or flash$"):
        kernels.cuda_backend((7, 5), True, "fused")
    with pytest.raises(ValueError, match="not deterministic; drop --deterministic-mode"):
        kernels.cuda_backend((9, 0), True, "fused", deterministic=True)
    assert kernels.cuda_backend((9, 0), True, "auto", deterministic=True) == "cuda_flash"
    with pytest.raises(ValueError, match="^--attention-backend local selects megatron.core"):
        kernels.cuda_backend((9, 0), True, "local")


def test_kernel_for_a_cuda_tile(cuda_double, cudnn_attention_double, monkeypatch):
    """On a (double) sm90 device with cuDNN: bf16 tiles go to cuDNN, except those it does not
    take; the switch and the device's capability change the choice."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        bf16 = torch.empty(1, 4, 64, 128, device="cuda", dtype=torch.bfloat16)
        wide = torch.empty(1, 4, 64, 256, device="cuda", dtype=torch.bfloat16)
        fp32 = torch.empty(1, 4, 64, 128, device="cuda")
    assert kernels.kernel_for(bf16, key_length=64) == "cuda_cudnn"
    assert kernels.kernel_for(wide, key_length=64) == "cuda_cudnn"  # sm90, cuDNN 9.19
    assert kernels.kernel_for(bf16, key_length=1) == "cuda_flash"  # cuDNN refuses s_kv 1
    assert kernels.kernel_for(bf16, dropout_p=0.1) == "explicit"
    assert kernels.kernel_for(fp32) == "explicit"
    kernels.set_attention_backend("flash")
    assert kernels.kernel_for(bf16) == "cuda_flash"
    kernels.set_attention_backend("unfused")
    assert kernels.kernel_for(bf16) == "explicit"
    kernels.set_attention_backend("auto")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert kernels.kernel_for(bf16) == "cuda_flash"
    assert kernels.kernel_for(wide) == "cuda_flash"
    kernels.set_attention_backend("fused")
    assert kernels.kernel_for(bf16) == "cuda_cudnn"
    assert kernels.kernel_for(wide) == "cuda_flash"  # head dim 256 is sm90's only
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8907)
    with pytest.raises(ValueError, match="without cuDNN attention"):
        kernels.kernel_for(bf16)


# ---------------------------------------------------------- the tiles through the double

@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_tiles_equal_the_explicit_kernel(cudnn_attention_double, causal):
    data = megatron_views()
    got = tile("cuda_cudnn", *data, causal=causal)
    want = tile("explicit", *data, causal=causal)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=name)
    assert got[1].shape == (BATCH, HEADS, SEQ) and got[1].is_contiguous()
    assert got[3].shape == (BATCH, GROUPS, SEQ, DIM)  # dK/dV in the group count
    forward, backward = cudnn_attention_double.log
    assert forward["attn_bias"] is None
    assert backward["attn_bias"] is None and backward["cum_seq_q"] is None \
        and backward["cum_seq_k"] is None
    assert backward["logsumexp"] == ((BATCH, HEADS, SEQ, 1), (HEADS * SEQ, SEQ, 1, 1))
    q_layout = backward["query"][1]
    assert backward["out"][1] == backward["grad_out"][1] == q_layout  # no copy needed


def test_every_composition_through_the_double(cudnn_attention_double, monkeypatch):
    """The ring CP=2/4, packed documents, head chunks at micro-batch 2: each tile's slice of
    the rows' out and log-sum-exp reaches cuDNN as its cached graph reads it. The ring's ranks
    are threads (each with its own graph cache, as cuDNN's is per thread)."""
    from megatron.memo_tools.gpu_check import ring_composition

    monkeypatch.setattr(kernels, "kernel_for",
                        lambda q, dropout_p=0.0, key_length=None: "cuda_cudnn")
    for case in ring_composition.cases(64):
        result = ring_composition.check(case, 64, heads=4, groups=2, head_dim=8, device="cpu",
                                        dtype=torch.float32)
        assert result.passed, (case.name, result.errors)
    backward = [call for call in cudnn_attention_double.log if call["op"] == "backward"]
    assert len(backward) > 20
    # out and grad_out reach cuDNN as the trainer's paths hold them: no copy on any of them.
    assert all(call["out"][1] == call["grad_out"][1] == call["query"][1] for call in backward)


def test_layouts_that_vary_under_one_graph_are_normalised(cudnn_attention_double):
    """cuDNN's backward graph is cached under q/k/v's sizes and strides only: out (and
    grad_out, and the log-sum-exp) in another layout than the call that built it are read
    wrong. The double does that; the dispatch passes them in q's layout every time."""
    q, k, v, grad = megatron_views()
    out, lse = tile("explicit", q, k, v, grad)[:2]
    want = tile("explicit", q, k, v, grad)[2:]
    aten = torch.ops.aten._scaled_dot_product_cudnn_attention_backward

    megatron_out = out.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    # The rows' lse as one slice of a wider one (a ring tile's): strided, and unit last stride.
    strided_lse = torch.cat([lse, lse], dim=-1)[..., :SEQ]

    def direct(out_layout, stats):
        rng = torch.zeros((), dtype=torch.int64)
        return aten(grad, q, k, v, out_layout, stats.unsqueeze(-1), rng, rng, None, None, None,
                    SEQ, SEQ, 0.0, True, scale=SCALE)

    torch.testing.assert_close(direct(megatron_out, lse)[0], want[0], **TOLERANCE)
    with pytest.raises(AssertionError):  # same graph, out contiguous: read with q's strides
        torch.testing.assert_close(direct(out.contiguous(), lse)[0], want[0], **TOLERANCE)
    with pytest.raises(AssertionError):  # same graph, lse strided: read as contiguous
        torch.testing.assert_close(direct(megatron_out, strided_lse)[0], want[0], **TOLERANCE)
    for layout, rows_lse in ((out.contiguous(), strided_lse), (megatron_out, lse)):
        got = kernels._cuda_cudnn_backward(grad, q, k, v, layout, rows_lse, SCALE, True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOLERANCE)


def test_what_the_real_op_refuses(cudnn_attention_double):
    """A 3-D log-sum-exp (FA2's layout), and empty tensors where the backward wants undefined
    ones (empty means a bias, and the nested-tensor kernel)."""
    q, k, v, grad = megatron_views()
    out, lse = tile("explicit", q, k, v, grad)[:2]
    aten = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
    rng, empty = torch.zeros((), dtype=torch.int64), torch.empty(0)
    stats = lse.unsqueeze(-1).contiguous()
    with pytest.raises(RuntimeError, match="Stats"):
        aten(grad, q, k, v, out, lse, rng, rng, None, None, None, SEQ, SEQ, 0.0, True)
    with pytest.raises(RuntimeError, match="2D, 3D, or 4D attn_bias but got 1D"):
        aten(grad, q, k, v, out, stats, rng, rng, empty, None, None, SEQ, SEQ, 0.0, True)
    with pytest.raises(RuntimeError, match="nested-tensor"):
        aten(grad, q, k, v, out, stats, rng, rng, None, empty, empty, SEQ, SEQ, 0.0, True)
    with pytest.raises(ValueError, match="causal tile must be square"):
        kernels._cuda_cudnn_forward(q, k[:, :, :SEQ // 2], v[:, :, :SEQ // 2], SCALE, True)


# ------------------------------------------------------------------ what a trace declares

def test_a_trace_declares_cudnns_backward_workspace():
    """Through the trace's CUDA rules: cuDNN's backward requests the sliced log-sum-exp's copy,
    the 8-byte no_rng of our dispatch and its one workspace block [b, heads, s_q, d + 1] fp32,
    and nothing else: no per-head dK/dV (GQA is reduced inside its graph); its forward none. A
    tile cuDNN does not take (one key) records FlashAttention-2's; the explicit kernel none."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memo_ext.trace.cuda_rules import CudaKernelRules, CudaTarget

    b, heads, groups, s, d = 2, 8, 2, 1024, 128
    fake = FakeTensorMode()
    with fake:
        q = torch.empty(s, b, heads, d, dtype=torch.bfloat16).permute(1, 2, 0, 3)
        k = torch.empty(s, b, groups, d, dtype=torch.bfloat16).permute(1, 2, 0, 3)
        lse = torch.empty(b, heads, 2 * s)[:, :, :s]
    rules = CudaKernelRules(CudaTarget(compute_capability=(9, 0), sm_count=132, flash_attn=None))
    forward = torch.ops.memo_attention.tile_forward.default
    backward = torch.ops.memo_attention.tile_backward.default

    def requests(kernel, func, args):
        with kernels.declared_workspaces(kernel=kernel, capability=(9, 0)):
            return [(w.nbytes, w.what)
                    for w in rules.workspaces(func, args, {}, None, func is backward)]

    tile = (q, q, k, k, q, lse, 0.1, True, 0.0, 0)
    one_key = (q, q, k[:, :, :1], k[:, :, :1], q, lse, 0.1, False, 0.0, 0)
    assert requests("cuda_cudnn", backward, tile) == [
        (b * heads * s * 4, "cuDNN backward: log-sum-exp made contiguous"),
        (8, "cuDNN backward: no_rng (seed and offset)"),
        (b * heads * s * (d + 1) * 4, kernels.CUDNN_BACKWARD_WORKSPACE)]
    assert requests("cuda_cudnn", forward, (q, k, k, 0.1, True, 0.0, 0)) == []
    assert requests("cuda_cudnn", backward, one_key) == requests("cuda_flash", backward, one_key)
    flash = requests("cuda_flash", backward, tile)
    assert (b * heads * s * d * 2, "flash backward: dV of every query head") in flash
    assert requests("explicit", backward, tile) == []
    assert rules.workspaces(backward, tile, {}, None, True) == []  # nothing declared
    with fake:
        assert len(torch.ops.memo_attention.tile_backward(*tile)) == 3  # only dq, dk, dv


def test_the_trace_declares_the_kernel_of_its_target_gpu():
    from megatron.training.tracing import traced_attention_kernel
    from memo_ext.trace.cuda_rules import CudaTarget
    from types import SimpleNamespace

    opts = SimpleNamespace(cuda_semantics=True)
    args = SimpleNamespace(attention_backend="auto", deterministic_mode=False)
    assert traced_attention_kernel(opts, args, CudaTarget.for_gpu("h100")) == "cuda_cudnn"
    assert traced_attention_kernel(opts, args, CudaTarget.for_gpu("a800")) == "cuda_flash"
    args.attention_backend = "flash"
    assert traced_attention_kernel(opts, args, CudaTarget.for_gpu("h200")) == "cuda_flash"
    opts.cuda_semantics, args.attention_backend = False, "auto"
    assert traced_attention_kernel(opts, args, CudaTarget.for_gpu("h100")) == "cuda_flash"


# ---------------------------------------------------------------------------- the flag

def _parse(*flags, cuda_available=False):
    from megatron.training.arguments import parse_args
    from tests.conftest import TINY_GPT_ARGS

    return parse_args([*TINY_GPT_ARGS, *flags], world_size=1, cuda_available=cuda_available)


def test_the_attention_backend_flag(capsys):
    from megatron.training.arguments import ArgumentValidationError

    assert _parse().attention_backend == "auto"
    assert _parse("--attention-backend", "unfused").attention_backend == "unfused"
    with pytest.raises(ArgumentValidationError, match="^--attention-backend local selects") \
            as error:
        _parse("--attention-backend", "local")
    assert "\n" not in str(error.value)
    with pytest.raises(SystemExit):
        _parse("--attention-backend", "cudnn")
    assert "argument --attention-backend: invalid choice: 'cudnn'" in capsys.readouterr().err


def test_fused_is_checked_against_this_machines_gpu(cuda_double, cudnn_attention_double,
                                                    monkeypatch):
    from megatron.training.arguments import ArgumentValidationError

    assert _parse("--attention-backend", "fused", cuda_available=True).attention_backend \
        == "fused"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    with pytest.raises(ArgumentValidationError, match="this is 7.0"):
        _parse("--attention-backend", "fused", cuda_available=True)


def test_the_trainer_applies_the_flag_to_every_thread():
    """initialize_megatron sets the process-wide backend the tile ops read (autograd runs a
    CUDA backward on another thread than the forward)."""
    import threading

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.training.initialize import initialize_megatron

    saved = kernels.attention_backend()
    try:
        initialize_megatron(_parse("--attention-backend", "unfused"))
        seen = []
        thread = threading.Thread(target=lambda: seen.append(kernels.kernel_for(torch.empty(1))))
        thread.start()
        thread.join()
        assert seen == ["explicit"]
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        kernels.set_attention_backend(saved)
