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


@pytest.mark.parametrize("kernel", ["cpu_flash", "explicit"])
def test_head_chunks_within_a_query_group(kernel):
    """More chunks than groups (one head each here): the output and dQ are the whole
    attention's bit for bit, dK/dV the sum of a group's chunks, as the reference has them."""
    data = inputs()
    with kernels.forced_kernel(kernel):
        whole = run(*data)
        chunked = run(*data, head_chunks=HEADS)
    assert_close(chunked, reference(*data))
    for name, a, b in zip(("out", "dq"), whole, chunked):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("chunks", [3, 8])
def test_head_chunks_must_split_the_heads(chunks):
    with pytest.raises(ValueError, match=f"{chunks} head chunks neither divide the 2 query "
                                         "groups nor split them into equal parts of the 4"):
        run(*inputs(), head_chunks=chunks)


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
                                      (None, "explicit", 1), ([0, 7, 30, SEQ], "cpu_flash", 2),
                                      (None, "cpu_flash", HEADS)):
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


def test_fake_tiles_allocate_their_outputs_and_state_the_cuda_kernels_requests():
    """Under FakeTensorMode the ops allocate only their outputs (out and the fp32 lse; dq, dk,
    dv), never a [s_q, s_k] tensor. What the CUDA kernels allocate besides is stated next to
    the dispatch, per backend (flash_api.cpp's mha_fwd/mha_bwd, torch's wrappers, this
    dispatch), and recorded by the trace's CUDA rules (test_cuda_rules.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seq, heads, groups, dim = 1000, 4, 2, 80
    with FakeTensorMode():
        # The trainer's layout: [b, heads, s, d] views of [s, b, heads, d], batch 1.
        q = torch.empty(seq, 1, heads, dim, dtype=torch.bfloat16).permute(1, 2, 0, 3)
        k = torch.empty(seq, 1, groups, dim, dtype=torch.bfloat16).permute(1, 2, 0, 3)
        out, lse = torch.ops.memo_attention.tile_forward(q, k, k, 0.1, True, 0.0, 0)
        grads = torch.ops.memo_attention.tile_backward(out, q, k, k, out, lse, 0.1, True,
                                                       0.0, 0)
        rows = slice(0, 500)  # a ring tile's rows: a strided slice of the rows' lse
        backward = {backend: kernels.backward_workspaces(
            q[:, :, rows], q[:, :, rows], k, q[:, :, rows], lse[:, :, rows], backend)
            for backend in (None, (2, 8))}
        forward = {backend: kernels.forward_workspaces(q, k, 132, backend)
                   for backend in (None, (2, 8))}
    assert (tuple(out.shape), tuple(lse.shape), lse.dtype) == ((1, heads, seq, dim),
                                                               (1, heads, seq), torch.float32)
    assert [tuple(g.shape) for g in grads] == [(1, heads, seq, dim), (1, groups, seq, dim),
                                               (1, groups, seq, dim)]

    def listed(requests):
        return [(r.what.split(": ")[1], r.shape, r.dtype) for r in requests]

    bf16, fp32, expanded = torch.bfloat16, torch.float32, (1, heads, seq, dim)
    lse_copy = ("log-sum-exp made contiguous", (1, heads, 500), fp32)
    mha_bwd = [("softmax_d", (1, heads, 512), fp32), ("dq_accum", (1, 512, heads, 96), fp32)]
    # torch's build: GQA expanded K/V in, dK/dV per query head out (summed after the call);
    # grad_out and out are already contiguous as [b, s, heads, d] at batch 1.
    assert listed(backward[None]) == [
        lse_copy, ("K expanded to the heads", expanded, bf16),
        ("V expanded to the heads", expanded, bf16),
        ("dK of every query head", expanded, bf16), ("dV of every query head", expanded, bf16),
        *mha_bwd]
    assert listed(backward[(2, 8)]) == [lse_copy, *mha_bwd,
                                        ("dk_expanded (GQA)", expanded, bf16),
                                        ("dv_expanded (GQA)", expanded, bf16)]
    # A 1000-token tile of 4 heads is too short to fill 132 SMs: mha_fwd splits it in 4.
    split = [("split-KV softmax_lse_accum", (4, 1, heads, seq), fp32),
             ("split-KV out_accum", (4, 1, heads, seq, 96), fp32)]
    assert listed(forward[None]) == [
        ("K expanded to the heads", expanded, bf16), ("V expanded to the heads", expanded, bf16),
        *split, ("rng_state", (2,), torch.uint64), ("unused RNG offset", (), torch.uint64)]
    assert listed(forward[(2, 8)]) == [*split, ("rng_state", (2,), torch.int64)]
    # dq_accum / out_accum's head dim: 32-multiples up to 128, 64-multiples above (flash-attn
    # >= 2.8 and torch's copy); flash-attn 2.7 took 32-multiples up to 192, then 256.
    assert [kernels.padded_head_dim(d) for d in (64, 80, 128, 136, 160, 200, 256)] == [
        64, 96, 128, 192, 192, 256, 256]
    assert [kernels.padded_head_dim(d, (2, 7)) for d in (128, 136, 160, 200)] == [
        128, 160, 160, 256]
    assert kernels.flash_backward_workspace_shapes(2, 8, 129, 160) == ((2, 8, 256),
                                                                       (2, 256, 8, 192))


@pytest.mark.parametrize("sm_count, batch_heads, seq_q, seq_k, dim, splits", [
    (132, 8, 8192, 8192, 128, 1),    # a long tile fills the GPU: never split
    (132, 8, 64, 4096, 128, 32),     # 64 query rows against 4096 keys (a short document)
    (108, 4, 200, 2000, 128, 8),
    (132, 4, 1000, 1000, 80, 4),
    (132, 1, 64, 256, 64, 1),        # one key block: nothing to split
])
def test_split_kv_follows_flash_attentions_heuristic(sm_count, batch_heads, seq_q, seq_k, dim,
                                                     splits):
    """num_splits_heuristic of flash_api.cpp (torch's copy and flash-attn 2.8 alike), in its
    float arithmetic; the port agreed with the C++ function compiled from flash-attn v2.8.3 on
    all 2,352 cases of a grid of SMs (108, 132), head dims, batch x heads and lengths."""
    assert kernels.split_kv_splits(1, batch_heads, seq_q, seq_k, dim, sm_count) == splits


def test_attention_dropout_is_one_line_with_its_cost(megatron_world):
    """With --attention-dropout > 0 the trainer prints one line after building the model (the
    explicit kernel instead of flash, and the fp32 scores of this layout's largest tile); at 0
    nothing. The tiny model: micro-batch 2, 4 heads, 64 tokens."""
    from megatron.training import gpt
    from megatron.training.arguments import core_transformer_config_from_args, parse_args
    from memo_ext.attention import attention_dropout_notice
    from memo_ext.attention.core import _largest_tile
    from tests.conftest import TINY_GPT_ARGS

    lines = []
    for dropout in ("0.1", "0"):
        args = parse_args(TINY_GPT_ARGS + ["--attention-dropout", dropout], world_size=1,
                          cuda_available=False)
        args.padded_vocab_size = args.vocab_size  # the trainer sets it from its tokenizer
        model = gpt.model_provider(core_transformer_config_from_args(args), args)
        lines.append(attention_dropout_notice([model], args.seq_length, args.micro_batch_size))
    assert lines == [
        "> --attention-dropout 0.1: attention tiles with dropout run the explicit kernel, not "
        "flash: it materialises each tile's fp32 scores (0.1 MiB per copy for this layout's "
        "largest tile, 2 x 4 heads x 64 x 64, several copies live at once) and is much slower "
        "on a GPU; long-context runs use --attention-dropout 0", None]
    # Under CP=2 a rank's largest tile is its two chunks against one chunk of the other rank.
    assert _largest_tile(8192, 1) == (8192, 8192)
    assert sorted(_largest_tile(8192, 2)) == [2048, 4096]
