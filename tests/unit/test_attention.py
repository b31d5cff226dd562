"""memo_ext.attention: the one core attention (tile kernels, zigzag split, ring) against attention
computed at once in float64 by autograd, on one process and over gloo rings of 2 and 4 ranks."""

from __future__ import annotations

import itertools

import pytest
import torch

from memo_ext.attention import ZigzagLayout, core_attention, kernels
from tests.gloo_ranks import run_ranks

SEQ, BATCH, HEADS, GROUPS, DIM = 48, 2, 4, 2, 8
SCALE = DIM ** -0.5


def reference(query, key, value, grad, causal=True, documents=None):
    """Output and input gradients of attention over [s, b, n, d] tensors, float64, with the
    causal mask (and document boundaries) built explicitly."""
    q, k, v = (t.double().detach().requires_grad_() for t in (query, key, value))
    repeat = q.shape[2] // k.shape[2]
    scores = torch.einsum("sbnd,tbnd->bnst", q, k.repeat_interleave(repeat, 2)) * SCALE
    length = q.shape[0]
    allowed = torch.ones(length, length, dtype=torch.bool)
    if causal:
        allowed = torch.ones(length, length).tril().bool()
    if documents is not None:
        owner = torch.zeros(length, dtype=torch.long)
        for index, start in enumerate(documents[1:-1]):
            owner[start:] = index + 1
        allowed &= owner[:, None] == owner[None, :]
    probabilities = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.einsum("bnst,tbnd->sbnd", probabilities, v.repeat_interleave(repeat, 2))
    out.backward(grad.double())
    return out, q.grad, k.grad, v.grad


def inputs(seq=SEQ, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(seq, BATCH, HEADS, DIM), (seq, BATCH, GROUPS, DIM), (seq, BATCH, GROUPS, DIM),
              (seq, BATCH, HEADS, DIM)]
    return [torch.randn(shape, generator=generator) for shape in shapes]


def run(query, key, value, grad, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    out = core_attention(*leaves, SCALE, **kwargs)
    out.backward(grad)
    return out, *(t.grad for t in leaves)


def assert_close(got, want, tolerance=2e-5):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        error = (a.double() - b).abs().max().item()
        assert error < tolerance, f"{name}: max abs error {error}"


@pytest.mark.parametrize("kernel", ["cpu_flash", "explicit"])
@pytest.mark.parametrize("causal", [True, False])
def test_one_rank_equals_attention_at_once(kernel, causal):
    data = inputs()
    with kernels.forced_kernel(kernel):
        got = run(*data, causal=causal)
        chunked = run(*data, causal=causal, head_chunks=GROUPS)
    assert_close(got, reference(*data, causal=causal))
    # Heads are independent: each chunk runs the same kernels on its heads' slices.
    for whole, by_chunk in zip(got, chunked):
        assert torch.equal(whole, by_chunk)


def test_head_chunks_must_divide_the_query_groups():
    with pytest.raises(ValueError, match="3 head chunks do not divide 2 query groups"):
        run(*inputs(), head_chunks=3)


@pytest.mark.parametrize("kernel", ["cpu_flash", "explicit"])
def test_documents_never_attend_across_boundaries(kernel):
    documents = [0, 5, 21, 22, SEQ]
    data = inputs()
    with kernels.forced_kernel(kernel):
        got = run(*data, documents=documents)
    assert_close(got, reference(*data, documents=documents))


def test_dropout_masks_are_regenerated_in_backward():
    """Output and gradients with dropout equal autograd through the same tile mask."""
    query, key, value, grad = inputs()
    p, seed = 0.3, 1234
    leaves = [t.clone().double().requires_grad_() for t in (query, key, value)]
    q, k, v = (t.permute(1, 2, 0, 3) for t in leaves)
    out, lse = torch.ops.memo_attention.tile_forward(q, k, v, SCALE, True, p, seed)
    dq, dk, dv, *_ = torch.ops.memo_attention.tile_backward(
        grad.double().permute(1, 2, 0, 3), q, k, v, out, lse, SCALE, True, p, seed)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * SCALE
    scores = scores.masked_fill(torch.ones(SEQ, SEQ).triu(1).bool(), float("-inf"))
    keep = kernels._dropout_keep(scores.shape, p, seed, "cpu").double()
    expected = (torch.softmax(scores, -1) * keep) @ v.repeat_interleave(2, 1)
    expected.backward(grad.double().permute(1, 2, 0, 3))
    assert 0.2 < (keep == 0).double().mean().item() < 0.4
    # The explicit kernel computes in fp32 whatever the input dtype.
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-5)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad.permute(1, 2, 0, 3), rtol=1e-5, atol=1e-5)


def _check_ring(rank, size):
    from memo_ext.attention import Ring

    layout = ZigzagLayout(SEQ, size)
    positions = layout.positions(rank)
    for documents, kernel, chunks in ((None, "cpu_flash", 1), ([0, 7, 30, SEQ], "cpu_flash", 1),
                                      (None, "explicit", 1), ([0, 7, 30, SEQ], "cpu_flash", 2)):
        data = inputs()
        want = reference(*data, documents=documents)
        with kernels.forced_kernel(kernel):
            got = run(*(t[positions] for t in data), ring=Ring(), documents=documents,
                      head_chunks=chunks)
        assert_close(got, [t[positions] for t in want])


# A ring of 4 (each rank's neighbours distinct) with -m slow: four processes take about a
# minute on a busy 2-core machine; the default suite has the ring of 2 and the trainer at CP=2.
@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_ring_equals_attention_at_once(size):
    run_ranks(size, _check_ring)


@pytest.mark.parametrize("size, documents", [(1, None), (2, None), (4, None),
                                             (3, [0, 1, 9, 10, 11, 23, 24])])
def test_tiles_cover_exactly_the_causal_pairs(size, documents):
    """Over all ring steps every rank's tiles cover each allowed (query, key) pair once."""
    seq = 24
    layout = ZigzagLayout(seq, size)
    owner = [max(i for i, start in enumerate(documents or [0]) if start <= t) for t in range(seq)]
    work = []
    for rank in range(size):
        rows, seen = layout.positions(rank), []
        for key_rank in range(size):
            cols = layout.positions(key_rank)
            for tile in layout.tiles(rank, key_rank, documents):
                for i, j in itertools.product(range(tile.rows.start, tile.rows.stop),
                                              range(tile.cols.start, tile.cols.stop)):
                    if not tile.causal or j - tile.cols.start <= i - tile.rows.start:
                        seen.append((int(rows[i]), int(cols[j])))
        assert len(seen) == len(set(seen))
        assert set(seen) == {(i, j) for i in rows.tolist() for j in range(i + 1)
                             if owner[i] == owner[j]}
        work.append(len(seen))
        if documents is None:
            assert layout.causal_pairs(rank) == len(seen)
    if documents is None:
        assert len(set(work)) == 1, work  # zigzag: the same causal work on every rank
    with pytest.raises(ValueError, match="divisible by 2 x 4"):
        ZigzagLayout(30, 4)


def test_fake_tiles_allocate_what_the_cuda_kernel_does():
    """Under FakeTensorMode the ops allocate out, the fp32 lse and, in backward with declared
    workspaces, dq/dk/dv plus flash-attention 2's softmax_d, dq_accum and GQA's expanded dK/dV;
    never a [s_q, s_k] tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seq, heads, groups, dim = 1000, 4, 2, 80
    with FakeTensorMode():
        q = torch.empty(1, heads, seq, dim, dtype=torch.bfloat16)
        k = torch.empty(1, groups, seq, dim, dtype=torch.bfloat16)
        out, lse = torch.ops.memo_attention.tile_forward(q, k, k, 0.1, True, 0.0, 0)
        with kernels.declared_workspaces():
            grads = torch.ops.memo_attention.tile_backward(out, q, k, k, out, lse, 0.1, True,
                                                           0.0, 0)
        bare = torch.ops.memo_attention.tile_backward(out, q, k, k, out, lse, 0.1, True, 0.0, 0)
    assert (tuple(out.shape), tuple(lse.shape), lse.dtype) == ((1, heads, seq, dim),
                                                               (1, heads, seq), torch.float32)
    assert [tuple(g.shape) for g in grads] == [
        (1, heads, seq, dim), (1, groups, seq, dim), (1, groups, seq, dim),
        (1, heads, 1024), (1, 1024, heads, 96), (1, heads, seq, dim), (1, heads, seq, dim)]
    assert [g.numel() for g in bare[3:]] == [0, 0, 0, 0]
    assert kernels.flash_backward_workspace_shapes(1, 1, 128, 256) == ((1, 1, 128),
                                                                       (1, 128, 1, 256))


def test_attention_dropout_is_one_line_with_its_cost(megatron_world):
    """With --attention-dropout > 0 the trainer prints one line after building the model (the
    explicit kernel instead of flash, and the fp32 scores of this layout's largest tile); at 0
    nothing. The tiny model: micro-batch 2, 4 heads, 64 tokens."""
    import pretrain_gpt
    from megatron.training.arguments import core_transformer_config_from_args, parse_args
    from memo_ext.attention import attention_dropout_notice
    from memo_ext.attention.core import _largest_tile
    from tests.conftest import TINY_GPT_ARGS

    lines = []
    for dropout in ("0.1", "0"):
        args = parse_args(TINY_GPT_ARGS + ["--attention-dropout", dropout], world_size=1,
                          cuda_available=False)
        args.padded_vocab_size = args.vocab_size  # the trainer sets it from its tokenizer
        model = pretrain_gpt.model_provider(core_transformer_config_from_args(args), args)
        lines.append(attention_dropout_notice([model], args.seq_length, args.micro_batch_size))
    assert lines == [
        "> --attention-dropout 0.1: attention tiles with dropout run the explicit kernel, not "
        "flash: it materialises each tile's fp32 scores (0.1 MiB per copy for this layout's "
        "largest tile, 2 x 4 heads x 64 x 64, several copies live at once) and is much slower "
        "on a GPU; long-context runs use --attention-dropout 0", None]
    # Under CP=2 a rank's largest tile is its two chunks against one chunk of the other rank.
    assert _largest_tile(8192, 1) == (8192, 8192)
    assert sorted(_largest_tile(8192, 2)) == [2048, 4096]
