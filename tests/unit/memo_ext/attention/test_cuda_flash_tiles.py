"""The CUDA flash path of memo_ext.attention (``kernels._cuda_flash_forward`` / ``_backward``)
run on CPU through tests/cuda_double.py's FlashKernelDouble, which reads its operands as the
CUDA kernels do: the log-sum-exp by raw pointer as a contiguous [b, heads, s_q]. Every caller
that hands a tile a slice of the rows' log-sum-exp (the zigzag ring's tiles, tiles cut at
document bounds, head chunks at micro-batch > 1, SPPO's blocks) is compared here with the
explicit kernel, which honours strides, at fp32 tolerance. Both CUDA backends: torch's
FlashAttention-2 build and flash-attn. METP's ring is checked in test_metp_attention.py (it
needs its gloo ranks)."""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from memo_ext.attention import ZigzagLayout, core_attention, kernels
from tests.cuda_double import FlashKernelDouble, read_as_kernel

SEQ, HEADS, GROUPS, DIM = 32, 4, 2, 8
SCALE = DIM ** -0.5
#: fp32 tolerance: the CPU flash kernel and the explicit softmax agree to ~1e-6 on these
#: shapes; a log-sum-exp read from the wrong rows moves gradients by ~1e-1.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
BACKENDS = ["torch", "flash-attn"]


def inputs(batch: int, seq: int = SEQ, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(seq, batch, HEADS, DIM), (seq, batch, GROUPS, DIM), (seq, batch, GROUPS, DIM),
              (seq, batch, HEADS, DIM)]
    return [torch.randn(shape, generator=generator) for shape in shapes]


class ThreadRing:
    """memo_ext.attention.Ring's interface (rank, size, exchange) between threads of one
    process: rank i sends to i-1 and receives from i+1, one FIFO per (receiver, tag). Stands in
    for the gloo ring so that a ring's tiles run in one fast process; the tiles, their slices of
    the log-sum-exp and the accumulators travelling with K/V are RingAttention's own."""

    def __init__(self, mailboxes: dict, rank: int, size: int):
        self.mailboxes, self.rank, self.size = mailboxes, rank, size

    @classmethod
    def of(cls, size: int) -> list["ThreadRing"]:
        mailboxes: dict = {}
        return [cls(mailboxes, rank, size) for rank in range(size)]

    def _box(self, rank: int, tag: int) -> queue.Queue:
        return self.mailboxes.setdefault((rank, tag), queue.Queue())

    def exchange(self, send: torch.Tensor, receive: torch.Tensor, tag: int):
        self._box((self.rank - 1) % self.size, tag).put(send.clone())
        box = self._box(self.rank, tag)

        class _Transfer:
            @staticmethod
            def wait() -> None:
                receive.copy_(box.get(timeout=60))

        return _Transfer()


def run_core_attention(kernel: str, data, ring_size: int = 1, **kwargs):
    """Output and q/k/v gradients of core_attention under ``kernel``; with ``ring_size`` > 1
    each rank of a zigzag ring runs in its own thread on its chunks, and the results are put
    back in sequence order."""
    query, key, value, grad = data
    layout = ZigzagLayout(query.shape[0], ring_size)
    rings = ThreadRing.of(ring_size) if ring_size > 1 else [None]

    def rank_main(rank: int):
        positions = layout.positions(rank)
        leaves = [t[positions].clone().requires_grad_() for t in (query, key, value)]
        with kernels.forced_kernel(kernel):  # thread-local: set in the rank's own thread
            out = core_attention(*leaves, SCALE, ring=rings[rank], **kwargs)
            out.backward(grad[positions])
        return positions, [out.detach(), *(t.grad for t in leaves)]

    with ThreadPoolExecutor(ring_size) as pool:
        ranks = list(pool.map(rank_main, range(ring_size)))
    results = [torch.empty_like(t) for t in (query, query, key, value)]
    for positions, tensors in ranks:
        for result, tensor in zip(results, tensors):
            result[positions] = tensor
    return results


def assert_same(got, want, names=("out", "dq", "dk", "dv")):
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


def test_the_double_reads_the_log_sum_exp_by_pointer():
    """The double itself: a contiguous log-sum-exp gives the explicit kernel's gradients, the
    same values behind a strided view (the rows of one tile) do not, as on a GPU."""
    generator = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(2, HEADS, 16, DIM, generator=generator) for _ in range(4))
    with kernels.forced_kernel("explicit"):
        out, lse = torch.ops.memo_attention.tile_forward(q, k, v, SCALE, True, 0.0, 0)
        want = torch.ops.memo_attention.tile_backward(grad, q, k, v, out, lse, SCALE, True,
                                                      0.0, 0)[:3]
    double = FlashKernelDouble()
    whole = torch.zeros(2, HEADS, 48)
    whole[:, :, 16:32] = lse  # the tile's rows inside a longer sequence's log-sum-exp
    sliced = whole[:, :, 16:32]
    assert torch.equal(read_as_kernel(sliced, tuple(sliced.shape)),
                       whole.flatten()[16:16 + sliced.numel()].view(sliced.shape))
    no_rng = torch.empty(0, dtype=torch.int64)
    right = double.sdpa_backward(grad, q, k, v, out, sliced.contiguous(), None, None, 16, 16,
                                 0.0, True, no_rng, no_rng, scale=SCALE)
    wrong = double.sdpa_backward(grad, q, k, v, out, sliced, None, None, 16, 16, 0.0, True,
                                 no_rng, no_rng, scale=SCALE)
    assert_same(right, want, ("dq", "dk", "dv"))
    assert (wrong[0] - want[0]).abs().max() > 1e-2
    assert double.strided_lse == 1
    with pytest.raises(RuntimeError, match="batch size must be positive"):
        double.sdpa_backward(grad, q, k, v, out, lse, no_rng, no_rng, 16, 16, 0.0, True,
                             no_rng, no_rng, scale=SCALE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [
    # A CP ring of 2: zigzag tiles of half the rows each, several heads and GQA.
    dict(batch=2, ring_size=2),
    # Packed documents at CP=1: tiles cut at the documents' bounds (batch 1, as the trainer).
    dict(batch=1, documents=[0, 5, 13, 14, SEQ]),
    # Head chunks at micro-batch 2: each chunk's lse[:, heads] skips the other chunk's rows.
    dict(batch=2, head_chunks=2),
    # All of it at once: ring, documents across the zigzag chunks, head chunks.
    dict(batch=1, ring_size=2, documents=[0, 3, 20, SEQ], head_chunks=2),
], ids=["cp-ring", "documents-cp1", "head-chunks-mb2", "ring-documents-chunks"])
def test_cuda_flash_tiles_match_the_explicit_kernel(monkeypatch, backend, case):
    double = FlashKernelDouble(backend).install(monkeypatch)
    case = dict(case)
    data = inputs(case.pop("batch"))
    want = run_core_attention("explicit", data, **case)
    got = run_core_attention("cuda_flash", data, **case)
    assert_same(got, want)
    calls = double.calls["sdpa_backward" if backend == "torch" else "flash_attn_backward"]
    assert calls > 1, double.calls  # the CUDA path ran, tile by tile


@pytest.mark.parametrize("backend", BACKENDS)
def test_sppo_blocks_with_documents_match_the_explicit_kernel(monkeypatch, backend):
    """SPPO's subsequence attention over its cached K/V blocks, cut along packed documents:
    each tile's rows slice the subsequence's log-sum-exp."""
    from memo_ext.sppo.attention import _BlockAttention, block_tiles

    FlashKernelDouble(backend).install(monkeypatch)
    generator = torch.Generator().manual_seed(2)
    starts, lengths, queries = [0, 12, 20], [12, 8, 12], 12  # blocks 0, 1 cached, 2 the own
    documents = [0, 7, 16, 25, 32]
    query = torch.randn(queries, 1, HEADS, DIM, generator=generator)
    keys_values = [torch.randn(length, 1, GROUPS, DIM, generator=generator)
                   for length in lengths for _ in range(2)]
    grad = torch.randn(queries, 1, HEADS * DIM, generator=generator)
    tiles = block_tiles(queries, lengths, starts, documents)
    assert any(len(block) > 1 for block in tiles)  # cut tiles: row slices of the lse

    def run(kernel):
        leaves = [t.clone().requires_grad_() for t in (query, *keys_values)]
        with kernels.forced_kernel(kernel):
            out = _BlockAttention.apply(SCALE, [], tiles, *leaves)
            out.backward(grad)
        return [out.detach(), *(t.grad for t in leaves)]

    want, got = run("explicit"), run("cuda_flash")
    assert_same(got, want, ["out", "dq"] + [f"d{kv}{j}" for j in range(3) for kv in "kv"])
