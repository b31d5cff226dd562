"""MEMO token-wise swap + recompute in one process: gradients equal the plain layer's for
every alpha (fp32, 1e-6), also when copies are slow -- and are wrong when the protocol's
waits are skipped, which proves the waits are what makes them right."""

from __future__ import annotations

import pytest
import torch

from memo_ext.config import MemoConfigError, OffloadConfig
from memo_ext.device import CopyEngine
from memo_ext.offload import ActivationShape, MemoOffload
from memo_ext.offload.tokens import TokenSplit
from tests.conftest import TINY_GPT_ARGS

NUM_LAYERS = 6  # 4 offloaded: layers 0 and 2 share a rounding buffer, so prefetch really runs
SEQ, BATCH, VOCAB = 64, 2, 512
SHAPE = ActivationShape(SEQ, BATCH, 64, 1, False, 4, num_attention_heads=4)
HOST_BYTES, BANDWIDTH = 10**10, 1e9
SHARE = 0.5  # position_wise_share: half of a layer's forward is core attention


def model_args(extra):
    from megatron.training.arguments import parse_args

    args = parse_args(TINY_GPT_ARGS + ["--num-layers", str(NUM_LAYERS)] + extra, world_size=1,
                      cuda_available=False)
    args.padded_vocab_size = VOCAB
    return args


def build_model(args, memo=None):
    from megatron.core import tensor_parallel

    from megatron.training import gpt
    from megatron.training.arguments import core_transformer_config_from_args

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return gpt.model_provider(core_transformer_config_from_args(args), args, memo=memo)


def loss_and_grads(model):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ)[None].expand(BATCH, -1)
    loss = model(tokens, positions, None, labels=labels).sum()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def worst_relative_gradient_error(grads, reference):
    return max(
        ((grads[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()
        for name, ref in reference.items()
    )


def memo_run(args, alpha: str, copy_delay_s: float = 0.0, host_bytes: int = HOST_BYTES,
             shape: ActivationShape = SHAPE, **config):
    with CopyEngine("cpu", copy_delay_s=copy_delay_s) as engine:
        memo = MemoOffload(OffloadConfig(offload=True, alpha=alpha, **config), engine, NUM_LAYERS,
                           1, shape, host_bytes, BANDWIDTH, log=lambda message: None,
                           position_wise_share=SHARE)
        return (*loss_and_grads(build_model(args, memo)), memo)


MODELS = {
    "gpt_learned_gelu": [],
    "llama_like_rope_swiglu_gqa_rmsnorm": [
        "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
        "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear"],
}


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("alpha", ["0", "0.125", "0.25", "0.5", "1"])
def test_gradients_match_plain_layer(megatron_world, model_name, alpha):
    args = model_args(MODELS[model_name])
    reference_loss, reference = loss_and_grads(build_model(args))
    loss, grads, memo = memo_run(args, alpha)
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert worst_relative_gradient_error(grads, reference) < 1e-6
    offloaded, recomputed = memo.manager.saved_bytes["offloaded"], memo.manager.saved_bytes["recomputed"]
    assert offloaded > 0
    assert (recomputed == 0) == (alpha == "1")
    if alpha == "0":
        # A layer stores its input, its attention output once (also saved by the core
        # attention as its output) and the attention's fp32 log-sum-exp, nothing else.
        hidden = SEQ * BATCH * 64 * 4
        assert memo.manager.largest_layer_bytes == 2 * hidden + BATCH * 4 * SEQ * 4


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("checkpoint_layers", ["1", "4"])
def test_checkpoint_layers_keep_gradients_exact(megatron_world, model_name, checkpoint_layers):
    """Mode (b) (only the layer input on host, the whole layer recomputed), mixed with MEMO's
    alpha layers or alone, gives the plain layer's gradients; its layers drop every saved
    tensor and store only their input."""
    args = model_args(MODELS[model_name])
    reference_loss, reference = loss_and_grads(build_model(args))
    _, _, pure = memo_run(args, "0.25")
    loss, grads, memo = memo_run(args, "0.25", checkpoint_layers=checkpoint_layers)
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert worst_relative_gradient_error(grads, reference) < 1e-6
    assert memo.checkpoint_layers == int(checkpoint_layers)
    assert memo.manager.saved_bytes["checkpointed"] > 0
    assert memo.manager.saved_bytes["offloaded"] < pure.manager.saved_bytes["offloaded"]
    assert memo.manager.host_slots.allocated_bytes < pure.manager.host_slots.allocated_bytes
    if checkpoint_layers == "4":
        # Every offloaded layer in (b): the kept layers too, so each buffer holds one input.
        assert memo.checkpoint_layer_indices == frozenset(range(NUM_LAYERS))
        assert memo.manager.largest_layer_bytes == SEQ * BATCH * 64 * 4


def test_auto_checkpoint_layers_take_the_fewest_that_fit_host(megatron_world):
    """A host budget one slot short of MEMO's alpha-0 arena: auto takes one checkpoint layer,
    the arena fits, and gradients stay exact."""
    args = model_args([])
    _, reference = loss_and_grads(build_model(args))
    _, _, pure = memo_run(args, "0")
    full = pure.manager.host_slots.allocated_bytes
    _, grads, memo = memo_run(args, "0", host_bytes=full - 1)
    assert memo.checkpoint_layers == 1
    assert memo.manager.host_slots.allocated_bytes <= full - 1
    assert worst_relative_gradient_error(grads, reference) < 1e-6


def test_offload_fp8_halves_host_bytes_and_is_close_not_exact(megatron_world):
    """--memo-offload-fp8 stores the whole-offloaded tensors in e4m3 (fp32 model here: a
    quarter of their bytes plus scales); gradients move, by a few percent at most."""
    args = model_args([])
    _, reference = loss_and_grads(build_model(args))
    _, _, plain = memo_run(args, "0", checkpoint_layers="4")
    fp8_shape = ActivationShape(SEQ, BATCH, 64, 1, False, 4, offload_fp8=True,
                                num_attention_heads=4)
    loss, grads, memo = memo_run(args, "0", checkpoint_layers="4", shape=fp8_shape,
                                 offload_fp8=True)
    ratio = memo.manager.host_slots.allocated_bytes / plain.manager.host_slots.allocated_bytes
    assert 0.25 < ratio < 0.3, ratio
    error = worst_relative_gradient_error(grads, reference)
    assert 1e-6 < error < 0.1, error


class _BufferBytes:
    """Device bytes of MEMO's rounding buffers alive at once (CopyEngine.alloc_device serves
    only them), and their peak since :meth:`reset`."""

    def __init__(self, monkeypatch):
        import weakref

        self.live = self.peak = 0
        original = CopyEngine.alloc_device

        def counted(engine, nbytes):
            tensor = original(engine, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor.untyped_storage(), self._freed, nbytes)
            return tensor

        monkeypatch.setattr(CopyEngine, "alloc_device", counted)

    def _freed(self, nbytes):
        self.live -= nbytes

    def reset(self):
        self.peak = self.live


def _second_iteration_buffer_peak(args, monkeypatch, **config) -> tuple[int, MemoOffload]:
    """Peak rounding-buffer bytes of a second iteration (the first sizes the buffers)."""
    buffers = _BufferBytes(monkeypatch)
    with CopyEngine("cpu") as engine:
        memo = MemoOffload(OffloadConfig(offload=True, alpha="0.25", **config), engine,
                           NUM_LAYERS, 1, SHAPE, HOST_BYTES, BANDWIDTH,
                           log=lambda message: None, position_wise_share=SHARE)
        model = build_model(args, memo)
        loss_and_grads(model)
        buffers.reset()
        loss_and_grads(model)
        return buffers.peak, memo


@pytest.mark.parametrize("checkpoint_layers", ["0", "2"])
def test_one_buffer_is_exact_and_holds_one_layer_at_a_time(megatron_world, monkeypatch,
                                                             checkpoint_layers):
    """--memo-offload-buffers 1: with slow copies gradients stay exact (each copy is waited
    for); all but the last layer are offloaded; the device holds one layer's data at a time,
    sized to that layer, where two buffers hold two of the largest layer's, and nothing after
    the backward."""
    args = model_args([])
    _, reference = loss_and_grads(build_model(args))
    _, grads, memo = memo_run(args, "0.25", copy_delay_s=0.02, offload_buffers=1,
                              checkpoint_layers=checkpoint_layers)
    assert worst_relative_gradient_error(grads, reference) < 1e-6
    assert len(memo.manager.buffers) == 1 and memo.offloaded_layer_count == NUM_LAYERS - 1
    one, memo = _second_iteration_buffer_peak(args, monkeypatch, offload_buffers=1,
                                              checkpoint_layers=checkpoint_layers)
    two, memo_two = _second_iteration_buffer_peak(args, monkeypatch,
                                                  checkpoint_layers=checkpoint_layers)
    assert one == memo.manager.largest_layer_bytes
    assert two >= 2 * memo_two.manager.largest_layer_bytes
    # Freed once the first layer's backward is done: nothing is held between iterations.
    assert memo.manager.buffers[0].capacity == 0 and memo_two.manager.buffers[0].capacity > 0
    if checkpoint_layers != "0":  # (a) and (b) layers: the buffer follows each layer's size
        assert len(set(memo.manager.layer_bytes.values())) > 1


def test_slow_copies_still_exact(megatron_world):
    args = model_args([])
    _, reference = loss_and_grads(build_model(args))
    _, grads, _ = memo_run(args, "0.5", copy_delay_s=0.02)
    assert worst_relative_gradient_error(grads, reference) < 1e-6


def test_skipping_the_waits_corrupts_gradients(megatron_world, monkeypatch):
    """Negative control: the same slow copies without the protocol's waits read stale
    buffers (a D2H overtaken by the next layer's writes, a prefetch not yet landed)."""
    args = model_args([])
    _, reference = loss_and_grads(build_model(args))
    monkeypatch.setattr(CopyEngine, "wait", lambda self, event: None)
    _, grads, _ = memo_run(args, "0.5", copy_delay_s=0.2)
    monkeypatch.undo()
    error = worst_relative_gradient_error(grads, reference)
    assert not error <= 1e-2, error  # stale reads of an uninitialised buffer may also be NaN


def test_auto_alpha_is_solved_after_the_measuring_iterations(megatron_world):
    from memo_ext.offload import AUTO_ALPHA_MEASURING_ITERATIONS

    args = model_args([])
    with CopyEngine("cpu") as engine:
        memo = MemoOffload(OffloadConfig(offload=True), engine, NUM_LAYERS, 1, SHAPE, HOST_BYTES,
                           BANDWIDTH, log=lambda message: None,
                           position_wise_share=SHARE)
        model = build_model(args, memo)
        for _ in range(AUTO_ALPHA_MEASURING_ITERATIONS):
            assert memo.alpha == 0.0 and memo.decision is None
            loss_and_grads(model)
            memo.after_iteration()
        assert memo.decision is not None and memo.alpha == memo.decision.alpha
        assert 0.0 <= memo.alpha <= 1.0


def _tracked_iteration(model, tracker):
    tracker.reset_peak()
    with tracker:
        loss_and_grads(model)
    return tracker.stats()["peak_device_bytes"]


def test_auto_alpha_fits_the_device_headroom_left_at_alpha_zero(megatron_world):
    """With a device whose capacity leaves 0.6 S_oth free above the alpha-0 peak, alpha auto
    picks ~0.3 (not the paper's alpha 1: both buffers grow by alpha S_oth) and its second
    iteration fits; alpha 1 does not."""
    from memo_ext.storage_tracker import DeviceMemoryTracker, SimulatedOutOfMemoryError

    args = model_args([])

    def run(alpha, capacity, iterations):
        tracker = DeviceMemoryTracker(capacity_bytes=capacity)
        with CopyEngine("cpu") as engine:
            memo = MemoOffload(OffloadConfig(offload=True, alpha=alpha), engine, NUM_LAYERS, 1,
                               SHAPE, HOST_BYTES, 1e15, tracker.host_allocations,
                               log=lambda message: None, device_headroom=tracker.headroom_bytes,
                               position_wise_share=SHARE)
            model = build_model(args, memo)
            tracker.register_existing(model.parameters())
            peaks = []
            for _ in range(iterations):
                model.zero_grad(set_to_none=True)
                peaks.append(_tracked_iteration(model, tracker))
                with tracker:  # solving alpha sizes the rounding buffers for it
                    memo.after_iteration()
            per_layer_other = memo.manager.saved_bytes["recomputed"] // max(
                1, memo.manager.layer_forwards)
            return memo, peaks, per_layer_other

    _, peaks_at_zero, other = run("0", None, 3)
    capacity = max(peaks_at_zero) + int(0.6 * other)
    memo, peaks, _ = run("auto", capacity, 3)
    assert memo.decision.limited_by == "device_memory"
    assert 0.2 < memo.alpha < 0.35, memo.alpha
    assert max(peaks) <= capacity
    with pytest.raises(SimulatedOutOfMemoryError):
        run("1", capacity, 3)


def test_host_memory_too_small_even_at_alpha_zero_is_refused():
    with CopyEngine("cpu") as engine:
        with pytest.raises(MemoConfigError, match="--memo-host-memory-gb") as error:
            MemoOffload(OffloadConfig(offload=True, alpha="0.5", host_memory_gb=1e-6), engine,
                        NUM_LAYERS, 1, SHAPE, 1000, BANDWIDTH, position_wise_share=SHARE)
    assert "GB short" in str(error.value)


def test_host_memory_too_small_even_with_every_layer_checkpointed_is_refused():
    with CopyEngine("cpu") as engine, pytest.raises(MemoConfigError, match="even with all 4"):
        MemoOffload(OffloadConfig(offload=True, alpha="0"), engine, NUM_LAYERS, 1, SHAPE,
                    4 * SHAPE.input_bytes - 1, BANDWIDTH, position_wise_share=SHARE)


def test_more_checkpoint_layers_than_offloaded_is_refused():
    with CopyEngine("cpu") as engine, pytest.raises(MemoConfigError, match="exceeds the 4"):
        MemoOffload(OffloadConfig(offload=True, checkpoint_layers="5"), engine, NUM_LAYERS, 1,
                    SHAPE, HOST_BYTES, BANDWIDTH, position_wise_share=SHARE)


def test_two_layers_per_stage_is_refused():
    with CopyEngine("cpu") as engine, pytest.raises(MemoConfigError, match="layers per pipeline"):
        MemoOffload(OffloadConfig(offload=True), engine, 2, 1, SHAPE, HOST_BYTES, BANDWIDTH, position_wise_share=SHARE)


@pytest.mark.parametrize("chunks,local_tokens,alpha", [(1, 16, 0.25), (2, 8, 0.5), (4, 6, 0.34)])
def test_token_split_round_trip(chunks, local_tokens, alpha):
    split = TokenSplit.from_alpha(alpha, local_tokens, chunks)
    natural = torch.arange(chunks * local_tokens * 3).reshape(chunks * local_tokens, 3)
    split_order = split.split(natural)
    kept_rows = chunks * split.kept
    assert torch.equal(split.merge(split_order[:kept_rows], split_order[kept_rows:]), natural)
    indices = torch.cat([split.natural_indices("kept"), split.natural_indices("dropped")])
    assert torch.equal(natural[indices], split_order)


def test_unsupported_layer_is_refused(megatron_world):
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import build_module

    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.layer_specs import local_layer_spec

    args = model_args([])
    with CopyEngine("cpu") as engine:
        memo = MemoOffload(OffloadConfig(offload=True), engine, NUM_LAYERS, 1, SHAPE, HOST_BYTES,
                           BANDWIDTH, log=lambda message: None,
                           position_wise_share=SHARE)
        base = local_layer_spec(args)  # a private copy of megatron.core's spec
        base.submodules.mlp = IdentityOp
        spec = memo.layer_spec(base)
        with pytest.raises(MemoConfigError, match="--memo-offload supports dense GPT layers"):
            build_module(spec, config=core_transformer_config_from_args(args), layer_number=1)



@pytest.mark.parametrize("buffers", [1, 2])
def test_an_abandoned_forward_is_ended_as_its_backward_would_end_it(megatron_world, buffers):
    """MemoOffload.abandon_forward after a forward whose backward never runs: its host slots
    are back in the pool (the next iteration takes them, allocating none), one buffer is freed
    as a backward frees it, and the next iteration's gradients are exact."""
    args = model_args([])
    _, reference = loss_and_grads(build_model(args))
    with CopyEngine("cpu") as engine:
        memo = MemoOffload(OffloadConfig(offload=True, alpha="0.5", offload_buffers=buffers),
                           engine, NUM_LAYERS, 1, SHAPE, HOST_BYTES, BANDWIDTH,
                           log=lambda message: None, position_wise_share=SHARE)
        model = build_model(args, memo)
        tokens = torch.zeros(BATCH, SEQ, dtype=torch.int64)
        positions = torch.arange(SEQ)[None].expand(BATCH, -1)
        model(tokens, positions, None, labels=tokens).sum()  # dropped: no backward
        memo.abandon_forward()
        pool = memo.manager.host_slots
        slots = pool.allocated_bytes
        assert slots and sum(map(len, pool.free.values())) == memo.offloaded_layer_count
        assert (memo.manager.buffers[0].capacity == 0) == (buffers == 1)
        _, grads = loss_and_grads(model)
        assert pool.allocated_bytes == slots
        assert worst_relative_gradient_error(grads, reference) < 1e-6
