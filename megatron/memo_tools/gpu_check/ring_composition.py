"""Gradients of the one attention's tile compositions on one device, against a dense reference.

Every attention the trainer runs is a composition of tiles (memo_ext.attention): the zigzag ring
of context parallelism, the document-cut tiles of packed sequences, head chunks. Each tile's
backward gets a slice of the rows' log-sum-exp. On a GPU the flash kernels read their inputs by
raw pointer, and cuDNN's fused attention (dispatched on Hopper) reads out, grad_out and the
log-sum-exp with the strides of the call that built its cached graph, so how a slice is laid
out in memory matters there and nowhere else: a composition can be exact on CPU and wrong on
CUDA. This check runs the compositions the
trainer runs, with the kernels the device dispatches, and compares dQ/dK/dV with a dense fp32
attention (every score materialised, causal and document masks as boolean masks) through
autograd.

One device, one process: the ring's ranks run as threads over :class:`ThreadRing`, which
delivers each exchange as :class:`memo_ext.attention.ring.Ring` does (rank i sends to i-1,
receives from i+1, per tag in posting order), so :class:`RingAttention`'s own forward and
backward run unchanged with the real kernels. The threads call the ring's forward and backward
directly rather than through autograd: autograd runs every CUDA backward on one engine thread
per device, where a rank waiting for its neighbour would block the neighbour too.

Used by ``make gpu-check`` (a correctness row) and bench/gpu_evidence.py; on CPU it runs the
CPU kernels (tests/unit/bench/test_gpu_evidence.py).
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from memo_ext.attention import RingAttention, ZigzagLayout, core_attention, pack_key_value

#: Largest |error| / max |reference| a bf16 flash composition may show. bf16 inputs and outputs
#: round to 2^-8 relative; summing a row's tiles adds a few of those. A wrong log-sum-exp
#: (another row's, or another head's) gives errors of order one.
BF16_TOLERANCE = 3e-2
#: The same for fp32 CPU kernels.
FP32_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Case:
    """One composition: ``ranks`` zigzag shards (1: no ring), packed ``documents`` (cumulative
    offsets, or None), ``head_chunks`` and ``batch`` (micro-batch size)."""
    name: str
    ranks: int = 1
    documents: Optional[tuple[int, ...]] = None
    head_chunks: int = 1
    batch: int = 1


def cases(seq: int) -> list[Case]:
    """The compositions the trainer runs, for a sequence of ``seq`` tokens (a multiple of 64)."""
    # Documents of unequal lengths whose bounds fall inside zigzag chunks, not on them.
    documents = (0, seq * 3 // 16, seq * 9 // 16, seq * 10 // 16, seq)
    return [
        Case("one tile (control)"),
        Case("head chunks 2, micro-batch 2", head_chunks=2, batch=2),
        Case("head chunks 4: parts of the 2 groups", head_chunks=4),
        Case("packed documents, CP=1", documents=documents),
        Case("zigzag ring CP=2", ranks=2),
        Case("zigzag ring CP=4", ranks=4),
        Case("zigzag ring CP=2, packed documents", ranks=2, documents=documents),
        Case("zigzag ring CP=2, head chunks 4: parts of the 2 groups", ranks=2, head_chunks=4),
    ]


class _Transfer:
    def __init__(self, inbox: "queue.Queue[torch.Tensor]", receive: torch.Tensor):
        self._inbox, self._receive = inbox, receive

    def wait(self) -> None:
        if self._inbox is not None:
            self._receive.copy_(self._inbox.get(timeout=120))
            self._inbox = None


class ThreadRing:
    """The ring of ``size`` ranks running as threads of one process (module docstring)."""

    def __init__(self, rank: int, size: int, inboxes: dict):
        self.rank, self.size, self._inboxes = rank, size, inboxes

    def _inbox(self, rank: int, tag: int) -> "queue.Queue[torch.Tensor]":
        return self._inboxes.setdefault((rank, tag), queue.Queue())

    def shard_at(self, step: int) -> int:
        return (self.rank + step) % self.size

    def exchange(self, send: torch.Tensor, receive: torch.Tensor, tag: int) -> _Transfer:
        # A copy: the sender may overwrite its buffer once its own wait() returns.
        self._inbox((self.rank - 1) % self.size, tag).put(send.clone())
        return _Transfer(self._inbox(self.rank, tag), receive)


def _dense_reference(q, k, v, grad, scale, documents):
    """dQ, dK, dV of causal (and document-masked) attention in fp32, scores materialised.
    q [b, heads, s, d], k/v [b, groups, s, d]."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    heads, groups, seq = q.shape[1], k.shape[1], q.shape[2]
    keys = k.repeat_interleave(heads // groups, dim=1)
    values = v.repeat_interleave(heads // groups, dim=1)
    positions = torch.arange(seq, device=q.device)
    allowed = positions[None, :] <= positions[:, None]
    if documents is not None:
        document = torch.bucketize(positions, torch.tensor(documents[1:-1], device=q.device),
                                   right=True)
        allowed &= document[None, :] == document[:, None]
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values)
    out.backward(grad.float())
    return q.grad, k.grad, v.grad


def _ring_gradients(case: Case, q, k, v, grad, scale):
    """dQ, dK, dV [b, heads|groups, s, d] of ``case`` run as ``case.ranks`` threads."""
    seq = q.shape[2]
    layout = ZigzagLayout(seq, case.ranks)
    inboxes: dict = {}
    results: dict = {}
    errors: list = []
    # Megatron's layout [s, b, heads, d] on every rank, each holding its zigzag shard.
    q_s, k_s, v_s, g_s = (t.permute(2, 0, 1, 3) for t in (q, k, v, grad))

    def run(rank: int) -> None:
        try:
            positions = layout.positions(rank).to(q.device)
            query, key, value, grad_out = (t[positions].contiguous()
                                           for t in (q_s, k_s, v_s, g_s))
            attention = RingAttention(layout, scale, ThreadRing(rank, case.ranks, inboxes),
                                      case.documents)
            seeds = [0] * attention.tile_count()
            with torch.no_grad():
                out, lse = attention.forward(query, pack_key_value(key, value), seeds)
                dq, dkv = attention.backward(grad_out, query, pack_key_value(key, value), out,
                                             lse, seeds)
            results[rank] = (positions, dq, dkv[:, :, 0], dkv[:, :, 1])
        except BaseException as error:  # reported by the caller's thread
            errors.append(error)

    if q.is_cuda:
        device = q.device
        threads = [threading.Thread(target=lambda r=r: (torch.cuda.set_device(device), run(r)))
                   for r in range(case.ranks)]
    else:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(case.ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    grads = [torch.empty_like(t) for t in (q_s, k_s, v_s)]
    for positions, *rank_grads in results.values():
        for whole, part in zip(grads, rank_grads):
            whole[positions] = part
    return tuple(g.permute(1, 2, 0, 3) for g in grads)


def _core_gradients(case: Case, q, k, v, grad, scale):
    """dQ, dK, dV through the trainer's core_attention (autograd), one rank."""
    q_s, k_s, v_s = (t.permute(2, 0, 1, 3).detach().contiguous().requires_grad_()
                     for t in (q, k, v))
    out = core_attention(q_s, k_s, v_s, scale, True, None, case.documents, 0.0, case.head_chunks)
    out.backward(grad.permute(2, 0, 1, 3))
    return tuple(t.grad.permute(1, 2, 0, 3) for t in (q_s, k_s, v_s))


@dataclass
class Result:
    case: Case
    errors: dict  # "dq"/"dk"/"dv" -> max |error| / max |reference|
    tolerance: float

    @property
    def passed(self) -> bool:
        return all(math.isfinite(e) and e <= self.tolerance for e in self.errors.values())


def check(case: Case, seq: int, heads: int = 8, groups: int = 2, head_dim: int = 128,
          device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Result:
    """Run ``case`` on ``seq`` tokens and compare its gradients with the dense reference."""
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q = draw(case.batch, heads, seq, head_dim)
    k, v = draw(case.batch, groups, seq, head_dim), draw(case.batch, groups, seq, head_dim)
    grad = draw(case.batch, heads, seq, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    if case.ranks > 1:
        got = _ring_gradients(case, q, k, v, grad, scale)
    else:
        got = _core_gradients(case, q, k, v, grad, scale)
    reference = _dense_reference(q, k, v, grad, scale, case.documents)
    errors = {name: float((g.float() - r).abs().max() / r.abs().max())
              for name, g, r in zip(("dq", "dk", "dv"), got, reference)}
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    return Result(case, errors, tolerance)


def run_all(seq: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
            only: Optional[Sequence[str]] = None) -> list[Result]:
    return [check(case, seq, device=device, dtype=dtype) for case in cases(seq)
            if only is None or case.name in only]
