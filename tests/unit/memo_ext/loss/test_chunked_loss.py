"""memo_ext.loss: the chunked output layer + cross-entropy against megatron's unfused path
(``hidden @ W.T`` then ``tensor_parallel.vocab_parallel_cross_entropy``), one process.

Tolerances. fp32: the two paths do the same arithmetic except the order of two sums (the
log-sum-exp is combined from per-chunk row maxima identically, but the weight gradient is summed
chunk by chunk instead of in one GEMM), so they agree to a few fp32 ulps of the largest value:
1e-6 relative to the largest entry. bf16: both paths round the logits and the logit gradients to
bf16 identically, but the chunked weight gradient is rounded to bf16 once per chunk (each chunk's
GEMM output) where the unfused GEMM rounds once. So bf16 is judged against an fp64 ground truth:
the chunked error may not exceed twice megatron's own bf16 error plus one bf16 ulp (2^-8
relative) per chunk boundary, the rounding this design adds.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memo_ext import tile_loop
from memo_ext.loss import chunked_vocab_parallel_cross_entropy

S, B, H, V = 37, 2, 16, 50


def _problem(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=generator, dtype=torch.float64)
    weight = torch.randn(V, H, generator=generator, dtype=torch.float64) * 0.5
    target = torch.randint(0, V, (S, B), generator=generator)
    mask = (torch.rand(S, B, generator=generator) > 0.3).to(torch.float64)
    return hidden.to(dtype), weight.to(dtype), target, mask


def _losses_and_grads(loss_fn, hidden, weight, target, mask):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    loss = loss_fn(hidden, weight, target)
    # The trainer's loss_func: per-token losses times the loss mask, summed.
    (loss.double() * mask).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def _unfused(hidden, weight, target):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(hidden @ weight.t(), target)


def _chunked(chunk_size):
    return lambda h, w, t: chunked_vocab_parallel_cross_entropy(h, w, t, chunk_size=chunk_size)


def _relative_error(value, reference):
    value, reference = value.double(), reference.double()
    return ((value - reference).abs().max() / reference.abs().max()).item()


# 1: every token its own chunk; 10: five positions x two rows, 37 not a multiple; 74: one chunk
# exactly; 1000: the chunk is larger than the sequence.
@pytest.mark.parametrize("chunk_size", [1, 10, 74, 1000])
def test_fp32_matches_unfused(megatron_world, chunk_size):
    problem = _problem(torch.float32)
    reference = _losses_and_grads(_unfused, *problem)
    chunked = _losses_and_grads(_chunked(chunk_size), *problem)
    for name, value, expected in zip(("loss", "grad hidden", "grad weight"), chunked, reference):
        assert value.dtype == expected.dtype, name
        assert _relative_error(value, expected) < 1e-6, name


def test_loss_mask_zeroes_masked_tokens_gradient(megatron_world):
    """A token whose mask is 0 contributes nothing to either gradient (here: all of position 3)."""
    hidden, weight, target, mask = _problem(torch.float32)
    mask[3] = 0
    _, grad_hidden, grad_weight = _losses_and_grads(_chunked(4), hidden, weight, target, mask)
    assert torch.count_nonzero(grad_hidden[3]) == 0
    changed = target.clone()
    changed[3] = (changed[3] + 1) % V  # its target no longer matters
    _, _, grad_weight_changed = _losses_and_grads(_chunked(4), hidden, weight, changed, mask)
    torch.testing.assert_close(grad_weight_changed, grad_weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [10, 1000])
def test_bf16_as_accurate_as_unfused(megatron_world, chunk_size):
    truth = _losses_and_grads(_unfused, *_problem(torch.float64))
    problem = _problem(torch.bfloat16)
    unfused = _losses_and_grads(_unfused, *problem)
    chunked = _losses_and_grads(_chunked(chunk_size), *problem)
    assert chunked[1].dtype == chunked[2].dtype == torch.bfloat16
    boundaries = -(-S * B // chunk_size) - 1
    for name, value, megatron, exact in zip(("loss", "grad hidden", "grad weight"),
                                            chunked, unfused, truth):
        bound = 2 * _relative_error(megatron, exact) + boundaries * 2.0 ** -8
        assert _relative_error(value, exact) <= bound, name
    # Same bf16 logits, same fp32 loss arithmetic: the losses agree to fp32 round-off.
    assert _relative_error(chunked[0], unfused[0]) < 1e-6


class _NewStorages(TorchDispatchMode):
    """Bytes of every storage an aten op creates (not views, in-place or ``out=`` results)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        self.sizes += [t.untyped_storage().nbytes() for t in tree_leaves(out)
                       if isinstance(t, torch.Tensor)
                       and t.untyped_storage().data_ptr() not in inputs]
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allocations_do_not_depend_on_the_chunk_count(megatron_world, dtype):
    """Forward + backward allocate the same number of tensors at 3 and 8 chunks (the chunk loop
    allocates nothing: what keeps allocation traces fittable across lengths), none of them
    [s, V]-sized, while the unfused path allocates the [s, V] logits."""
    hidden, weight, target, mask = _problem(dtype)
    logits_bytes = S * B * V * torch.empty((), dtype=dtype).element_size()
    counts = []
    for loss_fn in (_chunked(37), _chunked(10), _unfused):
        with _NewStorages() as storages:
            _losses_and_grads(loss_fn, hidden, weight, target, mask)
        counts.append(len(storages.sizes))
        assert (max(storages.sizes) >= logits_bytes) == (loss_fn is _unfused)
    assert counts[0] == counts[1]


def test_chunk_loops_are_tile_loops(megatron_world):
    """Forward and backward each loop over their chunks as a tile loop (memo_ext.tile_loop), so
    the tracer may run four chunks and copy the rest (tests/unit/memo_ext/trace/
    test_tile_copies.py checks the copies): 37 positions x 2 rows in chunks of 10 rows are 8
    chunks of 5 positions."""
    hidden, weight, target, mask = _problem(torch.float32)
    asked = []

    def every_tile(count):
        asked.append(count)
        return range(count)

    with tile_loop.repeated_by(every_tile):
        _losses_and_grads(_chunked(10), hidden, weight, target, mask)
    assert asked == [8, 8]


def test_labels_must_match_hidden():
    hidden, weight, target, _ = _problem(torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        chunked_vocab_parallel_cross_entropy(hidden, weight, target[:-1])


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_model_matches_unfused(megatron_world, tied):
    """megatron.training.gpt.model_provider with --cross-entropy-fusion-impl chunked: the same
    parameters (names and checkpoint), losses and every parameter's gradient as the unfused
    GPTModel; tied, the output gradient reaches the shared embedding weight."""
    from megatron.core.models.gpt import GPTModel

    from megatron.training import gpt
    from megatron.training.arguments import core_transformer_config_from_args, parse_args
    from memo_ext.loss import ChunkedLossGPTModel
    from tests.conftest import TINY_GPT_ARGS

    untie = [] if tied else ["--untie-embeddings-and-output-weights"]
    chunked_flags = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "chunked",
                     "--cross-entropy-chunk-size", "48"]  # 64 x 2 tokens: 3 chunks, last short
    models = []
    for flags in ([], chunked_flags):
        args = parse_args(TINY_GPT_ARGS + untie + flags, world_size=1, cuda_available=False)
        args.padded_vocab_size = args.vocab_size
        models.append(gpt.model_provider(core_transformer_config_from_args(args), args))
    unfused, chunked = models
    assert type(unfused) is GPTModel and type(chunked) is ChunkedLossGPTModel
    chunked.load_state_dict(unfused.state_dict())

    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, args.vocab_size, (2, args.seq_length), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(args.seq_length).expand(2, -1)
    mask = (torch.rand(2, args.seq_length, generator=generator) > 0.25).float()
    losses = []
    for model in models:
        loss = model(tokens, positions, attention_mask=None, labels=labels)
        assert loss.shape == (2, args.seq_length)
        (loss * mask).sum().backward()
        losses.append(loss.detach())
    assert _relative_error(losses[1], losses[0]) < 1e-6
    grads = [dict(m.named_parameters()) for m in models]
    assert grads[0].keys() == grads[1].keys()
    for name, param in grads[0].items():
        # The head's ~3e-7 input-gradient round-off, carried back through 4 layers (measured
        # worst 4.5e-7).
        assert _relative_error(grads[1][name].grad, param.grad) < 2e-6, name
    if tied:
        assert chunked.output_layer.weight is None  # the embedding's weight got the gradient
