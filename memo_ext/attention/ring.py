"""Point-to-point ring over a tensor-parallel group, and flat packing of several tensors.

METP (docs/metp.md) moves weight shards and their gradient accumulators around the TP group: rank i
sends to rank i-1 and receives from rank i+1, so at ring step j rank i holds the shard of rank
(i+j) % p. Each step posts its transfer with ``torch.distributed.batch_isend_irecv`` *before*
computing, into the second of two buffers (double buffering), and waits for it after computing:
the next shard travels while the current one is used. With gloo the transfers run on gloo's I/O
threads, so they overlap the matmuls on CPU too; with NCCL they run on NCCL's internal stream,
which is already the side stream the overlap needs (no extra stream is created here).

Hand-written because torch.distributed has the primitives (isend/irecv/batch_isend_irecv) but no
ring with per-step double buffers and distinct tags for the traffic that is in flight at once
(weights and gradient accumulators travel to the same neighbour in the same step).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

#: P2P tags keep concurrent messages to the same neighbour apart (gloo matches by tag; NCCL
#: ignores tags and matches in posting order, which is the same on every rank).
WEIGHTS_TAG = 11
GRADIENTS_TAG = 12
KEY_VALUE_TAG = 13
KEY_VALUE_GRADIENTS_TAG = 14


class Transfer:
    """Handles of one posted exchange; :meth:`wait` blocks until both directions finished."""

    def __init__(self, works: list):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


class Ring:
    """The ring of one process group: rank i sends to i-1 and receives from i+1."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._send_to = self.global_rank((self.rank - 1) % self.size)
        self._receive_from = self.global_rank((self.rank + 1) % self.size)

    def shard_at(self, step: int) -> int:
        """Group rank whose shard this rank holds at ring ``step``."""
        return (self.rank + step) % self.size

    def exchange(self, send: torch.Tensor, receive: torch.Tensor, tag: int) -> Transfer:
        """Post: ``send`` to the previous rank, ``receive`` filled from the next one."""
        ops = [dist.P2POp(dist.isend, send, self._send_to, self.group, tag),
               dist.P2POp(dist.irecv, receive, self._receive_from, self.group, tag)]
        return Transfer(dist.batch_isend_irecv(ops))

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)


class FlatPack:
    """Several tensors (some may be None) laid out back to back in one 1-D buffer, so that a
    shard travels as one message. ``None`` entries stay None when unpacked."""

    def __init__(self, tensors: Sequence[Optional[torch.Tensor]]):
        present = [t for t in tensors if t is not None]
        self.dtype = present[0].dtype
        self.device = present[0].device
        self.shapes = [None if t is None else tuple(t.shape) for t in tensors]
        self.numel = sum(math.prod(shape) for shape in self.shapes if shape is not None)

    def empty(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def pack(self, tensors: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        buffer = self.empty()
        for view, tensor in zip(self.unpack(buffer), tensors):
            if view is not None:
                view.copy_(tensor)
        return buffer

    def unpack(self, buffer: torch.Tensor) -> list[Optional[torch.Tensor]]:
        views, offset = [], 0
        for shape in self.shapes:
            if shape is None:
                views.append(None)
                continue
            size = math.prod(shape)
            views.append(buffer[offset:offset + size].view(shape))
            offset += size
        return views
