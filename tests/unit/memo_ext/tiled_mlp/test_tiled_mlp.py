"""Sequence-tiled MLP (memo_ext.tiled_mlp, --memo-mlp-tile-size): the same outputs and
gradients as megatron.core's untiled MLP (fp32; alone, under TP=2+SP on gloo, inside MEMO's
token-split layer), tiles that do not divide the sequence, a working set bounded by the tile,
and the flag's validation (the tracer: test_tiled_mlp_trace.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memo_ext.config import MemoConfigError, TiledMLPConfig
from memo_ext.tiled_mlp import tile_bounds, tiled_recompute
from tests.conftest import TINY_GPT_ARGS
from tests.gloo_ranks import run_ranks

HIDDEN, FFN, BATCH = 16, 64, 2
# Tiled and untiled differ only in summation order: a weight gradient is a sum over tokens,
# tiled it is a sum of per-tile partial GEMMs. fp32 rounding then differs by a few ulp of the
# largest entry; 1e-6 of the largest magnitude is ~8 ulp and far below any real error.
# (Measured: 2.7e-7.) Through a 6-layer model and its loss these differences compound; there
# 4e-6 (measured: 5.9e-7); a tile's gradient lost or misplaced would be off by the order of
# the gradients themselves.
RELATIVE_TOLERANCE = 1e-6
MODEL_RELATIVE_TOLERANCE = 4e-6


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str,
                 tolerance: float = RELATIVE_TOLERANCE) -> None:
    scale = expected.abs().max().clamp(min=1e-30)
    error = ((actual - expected).abs().max() / scale).item()
    assert error <= tolerance, f"{what}: max error {error:.2e} of the largest entry"


# ----------------------------------------------------------------------- the mechanism

def test_tile_bounds_cover_rows_with_a_short_last_tile():
    assert tile_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert tile_bounds(8, 4) == [(0, 4), (4, 8)]
    assert tile_bounds(3, 8) == [(0, 3)]
    assert tile_bounds(0, 8) == [(0, 0)]  # the function (and its collectives) still runs once
    with pytest.raises(ValueError, match="tile_rows"):
        tile_bounds(4, 0)


@pytest.mark.parametrize("tile_rows", [1, 4, 5, 23, 64])
def test_tiled_recompute_saves_only_its_input_and_runs_per_tile(tile_rows):
    """A position-wise function (23 rows: 4 and 5 leave a short last tile): same output and
    gradients as calling it once; it runs ceil(23/tile) times in forward and again in
    backward, and autograd saves one tensor for it (the input), not its intermediates."""
    generator = torch.Generator().manual_seed(0)
    w1 = torch.randn(FFN, HIDDEN, generator=generator).requires_grad_()
    w2 = torch.randn(HIDDEN, FFN, generator=generator).requires_grad_()
    x = torch.randn(23, BATCH, HIDDEN, generator=generator)
    grad = torch.randn(23, BATCH, HIDDEN, generator=generator)
    calls = []

    def mlp(rows):
        calls.append(rows.size(0))
        return F.linear(F.gelu(F.linear(rows, w1)), w2)

    reference_x = x.clone().requires_grad_()
    mlp(reference_x).backward(grad)
    reference = [reference_x.grad, w1.grad.clone(), w2.grad.clone()]
    w1.grad = w2.grad = None
    calls.clear()

    tiled_x = x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        output = tiled_recompute(mlp, tiled_x, tile_rows, [w1, w2])
    tiles = -(-23 // tile_rows)
    assert len(calls) == tiles and sum(calls) == 23
    assert len(saved) == 1 and saved[0] is tiled_x
    output.backward(grad)
    assert len(calls) == 2 * tiles
    assert_close(output.detach(), mlp(x).detach(), "output")
    for actual, expected, name in zip([tiled_x.grad, w1.grad, w2.grad], reference,
                                      ["input grad", "w1 grad", "w2 grad"]):
        assert_close(actual, expected, name)


def test_parameter_gradients_flow_when_the_input_needs_none():
    weight = torch.randn(HIDDEN, HIDDEN, requires_grad=True)
    x, grad = torch.randn(7, HIDDEN), torch.randn(7, HIDDEN)
    tiled_recompute(lambda rows: F.linear(rows, weight), x, 3, [weight]).backward(grad)
    assert_close(weight.grad, grad.t() @ x, "weight grad")


@pytest.mark.parametrize("side", ["input", "output"])
def test_tiles_take_the_same_rows_of_every_block(side):
    """A projection with one side holding every TP rank's rows (2 blocks here), stood in for
    by two linear maps: input side, [2n] rows -> A(first block) + B(second block), [n] rows;
    output side, [n] rows -> [A(x); B(x)], [2n] rows. Tiles of 3 rows per block give the
    untiled output and gradients."""
    a, b = (torch.randn(HIDDEN, HIDDEN, requires_grad=True) for _ in range(2))
    rows = 7
    if side == "input":
        def projection(x):
            half = x.size(0) // 2
            return F.linear(x[:half], a) + F.linear(x[half:], b)
        x, blocks = torch.randn(2 * rows, HIDDEN, requires_grad=True), {"input_blocks": 2}
        grad = torch.randn(rows, HIDDEN)
    else:
        def projection(x):
            return torch.cat([F.linear(x, a), F.linear(x, b)])
        x, blocks = torch.randn(rows, HIDDEN, requires_grad=True), {"output_blocks": 2}
        grad = torch.randn(2 * rows, HIDDEN)
    expected = projection(x)
    expected.backward(grad)
    reference = [t.grad.clone() for t in (x, a, b)]
    for t in (x, a, b):
        t.grad = None
    actual = tiled_recompute(projection, x, 3, [a, b], **blocks)
    actual.backward(grad)
    assert_close(actual, expected, "output")
    for name, got, want in zip(("input grad", "A grad", "B grad"), (x.grad, a.grad, b.grad),
                               reference):
        assert_close(got, want, name)


# ------------------------------------------------------------- megatron.core's MLP, TP=1

def _mlp_config(swiglu: bool, tensor_parallel_size: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
        use_cpu_initialization=True, gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu, add_bias_linear=not swiglu,
        bias_activation_fusion=False, tensor_model_parallel_size=tensor_parallel_size,
        sequence_parallel=tensor_parallel_size > 1)


def _mlp_pair(config, tile_tokens: int):
    """(megatron MLP, TiledMLP) with identical weights."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from memo_ext.tiled_mlp import TiledMLP

    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    reference = MLP(config, submodules, ffn_hidden_size=FFN)
    tiled = TiledMLP(config, submodules, tile_tokens=tile_tokens, ffn_hidden_size=FFN)
    tiled.load_state_dict(reference.state_dict())
    return reference, tiled


def _run_mlp(mlp, x, grad):
    x = x.clone().requires_grad_()
    output, bias = mlp(x)
    output.backward(grad)
    grads = {name: p.grad for name, p in mlp.named_parameters() if p.grad is not None}
    return output.detach(), bias, x.grad, grads


def _compare_mlps(reference, tiled, x, grad, where=""):
    out_ref, bias_ref, grad_x_ref, grads_ref = _run_mlp(reference, x, grad)
    out, bias, grad_x, grads = _run_mlp(tiled, x, grad)
    assert_close(out, out_ref, f"{where}output")
    assert_close(grad_x, grad_x_ref, f"{where}input grad")
    assert sorted(grads) == sorted(grads_ref) and grads  # fc2's bias is added by the layer
    for name, expected in grads_ref.items():
        assert_close(grads[name], expected, f"{where}{name} grad")
    assert (bias is None) == (bias_ref is None)
    if bias is not None:
        assert bias is tiled.linear_fc2.bias


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu_bias", "swiglu_no_bias"])
@pytest.mark.parametrize("tile_tokens", [1, 5, 8, 64])
def test_tiled_mlp_matches_megatron_mlp(megatron_world, swiglu, tile_tokens):
    config = _mlp_config(swiglu)
    torch.manual_seed(0)
    reference, tiled = _mlp_pair(config, tile_tokens)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(23, BATCH, HIDDEN, generator=generator)  # 23: no tile size divides it
    grad = torch.randn(23, BATCH, HIDDEN, generator=generator)
    _compare_mlps(reference, tiled, x, grad)


# --------------------------------------------------------------- TP=2 + SP on gloo ranks

def _check_tp2_sequence_parallel(rank, world_size):
    from megatron.core import parallel_state

    from megatron.training.compat import apply_cpu_shims

    apply_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        for swiglu in (False, True):
            torch.manual_seed(0)
            # tile 4 tokens = 2 rows per rank over 11 local rows: five tiles and a 1-row tile.
            reference, tiled = _mlp_pair(_mlp_config(swiglu, world_size), tile_tokens=4)
            generator = torch.Generator().manual_seed(2)
            x = torch.randn(22, BATCH, HIDDEN, generator=generator)
            grad = torch.randn(22, BATCH, HIDDEN, generator=generator)
            local = slice(rank * 11, (rank + 1) * 11)
            _compare_mlps(reference, tiled, x[local], grad[local],
                          f"rank {rank} swiglu={swiglu}: ")
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.distributed
def test_tiled_mlp_matches_megatron_mlp_under_tp2_sequence_parallel():
    run_ranks(2, _check_tp2_sequence_parallel, timeout=180)


# ------------------------------------------------------------------------- working set

def _mlp_peak_bytes(mlp, tokens: int) -> int:
    """Peak bytes allocated during one forward + backward of ``mlp`` on [tokens, 1, HIDDEN]
    (the input, the output gradient and the parameters existed before and are not counted)."""
    from memo_ext.storage_tracker import DeviceMemoryTracker

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, 1, HIDDEN, generator=generator).requires_grad_()
    grad = torch.randn(tokens, 1, HIDDEN, generator=generator)
    mlp.zero_grad(set_to_none=True)
    tracker = DeviceMemoryTracker()
    with tracker:
        output, _ = mlp(x)
        output.backward(grad)
    return tracker.stats()["peak_device_bytes"]


def test_working_set_is_bounded_by_the_tile(megatron_world):
    """Quadrupling the sequence (256 -> 1024 tokens) grows the untiled MLP's peak by its
    ffn-wide activations (>= 2 x 768 tokens x ffn x 4 bytes: fc1's output and the activation's,
    both saved for backward) but the tiled MLP's only by hidden-wide tensors (its output and the
    input gradient, <= 4 x 768 x HIDDEN x 4 bytes); what remains of the tiled peak is a few tile
    intermediates [64, ffn] plus the parameter gradients, whatever the length."""
    torch.manual_seed(0)
    reference, tiled = _mlp_pair(_mlp_config(swiglu=False), tile_tokens=64)
    short, long = 256, 1024
    grown = long - short
    element = 4
    untiled_growth = _mlp_peak_bytes(reference, long) - _mlp_peak_bytes(reference, short)
    tiled_short, tiled_long = _mlp_peak_bytes(tiled, short), _mlp_peak_bytes(tiled, long)
    assert untiled_growth >= 2 * grown * FFN * element, untiled_growth
    assert tiled_long - tiled_short <= 4 * grown * HIDDEN * element, (tiled_short, tiled_long)
    parameter_grads = sum(p.numel() for p in tiled.parameters()) * element
    tile_intermediate = 64 * FFN * element
    assert tiled_long - 4 * long * HIDDEN * element <= 4 * tile_intermediate + parameter_grads


# ------------------------------------------------------------------ inside MEMO's layer

def _model_args(extra):
    from megatron.training.arguments import parse_args

    args = parse_args(TINY_GPT_ARGS + ["--num-layers", "6"] + extra, world_size=1,
                      cuda_available=False)
    args.padded_vocab_size = 512
    return args


def _loss_and_grads(args, memo=None):
    from megatron.core import tensor_parallel

    from megatron.training import gpt
    from megatron.training.arguments import core_transformer_config_from_args

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = gpt.model_provider(core_transformer_config_from_args(args), args, memo=memo)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (2, 64), generator=generator)
    labels = torch.randint(0, 512, (2, 64), generator=generator)
    positions = torch.arange(64)[None].expand(2, -1)
    loss = model(tokens, positions, None, labels=labels).sum()
    loss.backward()
    return model, loss.item(), {name: p.grad for name, p in model.named_parameters()}


def _memo_saved_bytes(args, alpha, checkpoint_layers=0):
    from memo_ext.device import CopyEngine
    from memo_ext.offload import ActivationShape, MemoOffload
    from memo_ext.config import OffloadConfig

    config = OffloadConfig(offload=True, alpha=alpha, checkpoint_layers=str(checkpoint_layers))
    with CopyEngine("cpu") as engine:
        memo = MemoOffload(config, engine, 6, 1,
                           ActivationShape(64, 2, 64, 1, False, 4), 10**10, 1e9,
                           log=lambda message: None, position_wise_share=0.5)
        model, loss, grads = _loss_and_grads(args, memo)
        return model, loss, grads, dict(memo.manager.saved_bytes)


def test_memo_offload_with_tiled_mlp_matches_the_plain_model(megatron_world):
    """MEMO runs the MLP separately on its kept and dropped tokens (alpha 0.5: 32 of 64 each);
    each part is tiled (tile 12: two full tiles and one of 8). Loss and every gradient equal the
    plain untiled model's; MEMO now saves only the MLP input where it saved fc1's and the
    activation's outputs too, so it offloads and recomputes fewer bytes."""
    from memo_ext.tiled_mlp import TiledMLP

    _, reference_loss, reference = _loss_and_grads(_model_args([]))
    tiled_args = _model_args(["--memo-mlp-tile-size", "12"])
    model, loss, grads, tiled_saved = _memo_saved_bytes(tiled_args, "0.5")
    assert sum(isinstance(m, TiledMLP) for m in model.modules()) == 6
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    for name, expected in reference.items():
        assert_close(grads[name], expected, name, MODEL_RELATIVE_TOLERANCE)
    _, _, _, untiled_saved = _memo_saved_bytes(_model_args([]), "0.5")
    # Per layer and part the MLP saved [t, b, ffn] twice (fc1 out, GeLU out) besides its input.
    ffn_bytes = 6 * 64 * 2 * 256 * 4
    for kind in ("offloaded", "recomputed"):
        saved_less = untiled_saved[kind] - tiled_saved[kind]
        assert saved_less == ffn_bytes, (kind, untiled_saved, tiled_saved)


# ------------------------------------------------------------------------------- flags

def test_flag_validation():
    from megatron.training.arguments import ArgumentValidationError, parse_args

    def parse(extra, world_size=1):
        return parse_args(TINY_GPT_ARGS + extra, world_size=world_size, cuda_available=False)

    assert parse([]).memo_mlp_tile_size == 0  # off by default
    assert parse(["--memo-mlp-tile-size", "6", "--tensor-model-parallel-size", "2"],
                 2).memo_mlp_tile_size == 6  # without SP any tile size works
    for extra, world_size, message in [
        (["--memo-mlp-tile-size", "-1"], 1, "--memo-mlp-tile-size -1 is negative"),
        (["--memo-mlp-tile-size", "7", "--tensor-model-parallel-size", "2",
          "--sequence-parallel"], 2, "not a multiple of --tensor-model-parallel-size 2"),
        (["--memo-mlp-tile-size", "8", "--memo-metp", "--tensor-model-parallel-size", "2"], 2,
         "--memo-metp replaces by its ring MLP; drop one"),
    ]:
        with pytest.raises(ArgumentValidationError, match=message) as error:
            parse(extra, world_size)
        assert "\n" not in str(error.value)
    with pytest.raises(MemoConfigError, match="must be >= 1"):
        TiledMLPConfig(mlp_tile_size=0).tile_rows(1, False)
    assert TiledMLPConfig(mlp_tile_size=8).tile_rows(4, True) == 2


def test_layer_spec_swaps_only_the_mlp():
    from megatron.core.transformer.mlp import MLP

    from megatron.training.layer_specs import local_layer_spec
    from memo_ext.tiled_mlp import TiledMLP

    plain = local_layer_spec(_model_args([]))
    tiled = local_layer_spec(_model_args(["--memo-mlp-tile-size", "16"]))
    assert plain.submodules.mlp.module is MLP
    assert tiled.submodules.mlp.module is TiledMLP
    assert tiled.submodules.mlp.params == {"tile_tokens": 16}
    assert tiled.submodules.mlp.submodules == plain.submodules.mlp.submodules
    assert tiled.submodules.self_attention == plain.submodules.self_attention
