"""Causal self-attention of a zigzag shard against every shard of a ring, tile by tile.

Forward: at ring step ``j`` this rank holds the packed K/V of shard ``rank + j`` and posts the
transfer of the next one before it computes (double buffering, memo_ext.attention.ring); each
tile of :meth:`ZigzagLayout.tiles` runs one kernel call and is merged into the rows' running
output and log-sum-exp. Only the output and the log-sum-exp are kept.

Backward: the ring runs again with the same tiles; each tile's flash backward uses the rows'
final output and log-sum-exp, dQ accumulates locally and the dK/dV accumulator travels with its
K/V, reaching the shard's owner with one extra hop.

The callers: the trainer's core attention over the context-parallel group (:mod:`.core`, where a
ring of one rank is plain causal attention, one tile) and METP's head groups over the
tensor-parallel group (memo_ext.metp.attention). Ring attention with zigzag load balance is what
Transformer Engine's P2P context parallelism does on GPUs; it is written here because TE does not
run on CPU/gloo and METP needs the ring inside its own autograd function.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from memo_ext.attention import kernels
from memo_ext.attention.ring import KEY_VALUE_GRADIENTS_TAG, KEY_VALUE_TAG, Ring, Transfer
from memo_ext.attention.zigzag import ZigzagLayout
from memo_ext.tile_loop import tile_indices


def _heads_first(tensor: torch.Tensor) -> torch.Tensor:
    """[s, b, heads, d] -> a [b, heads, s, d] view."""
    return tensor.permute(1, 2, 0, 3)


def pack_key_value(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """K and V [s, b, groups, d] in one contiguous [s, b, 2, groups, d] buffer (the message a
    ring step sends)."""
    packed = key.new_empty(key.shape[0], key.shape[1], 2, *key.shape[2:])
    packed[:, :, 0] = key
    packed[:, :, 1] = value
    return packed


def _split(key_value: torch.Tensor):
    return _heads_first(key_value[:, :, 0]), _heads_first(key_value[:, :, 1])


def dropout_seeds(count: int, dropout_p: float, like: torch.Tensor) -> list[int]:
    """One seed per tile from the current (forked) RNG, so backward regenerates each tile's
    dropout mask; none without dropout."""
    if dropout_p == 0:
        return [0] * count
    return torch.randint(2 ** 62, (count,), device=like.device).tolist()


class RingAttention:
    """One rank's causal attention over ``ring`` (None: this rank alone) with the zigzag
    ``layout``; ``documents`` are cumulative document offsets of the whole sequence (packed
    sequences) or None."""

    def __init__(self, layout: ZigzagLayout, scale: float, ring: Optional[Ring] = None,
                 documents: Optional[Sequence[int]] = None, dropout_p: float = 0.0):
        self.layout, self.scale, self.ring = layout, scale, ring
        self.documents = None if documents is None else list(documents)
        self.dropout_p = dropout_p
        self.rank = 0 if ring is None else ring.rank
        self.size = 1 if ring is None else ring.size

    def _tiles(self, step: int):
        return list(self.layout.tiles(self.rank, (self.rank + step) % self.size, self.documents))

    def _steps(self) -> Iterable[int]:
        """The ring steps a loop runs: through memo_ext.tile_loop when steps 1 .. size-1 attend
        alike tiles (rank 0 of a zigzag ring without documents: every other rank's chunks
        follow its first), so that the tracer may record the middle ones as copies; otherwise
        every step from here."""
        later = [self._tiles(step) for step in range(1, self.size)]
        if all(tiles == later[0] for tiles in later):
            return tile_indices(self.size)
        return range(self.size)

    def tile_count(self) -> int:
        return sum(len(self._tiles(step)) for step in range(self.size))

    def _exchange(self, buffers: list, step: int, tag: int) -> Optional[Transfer]:
        if step == self.size - 1:
            return None
        return self.ring.exchange(buffers[step % 2], buffers[(step + 1) % 2], tag)

    def forward(self, query: torch.Tensor, key_value: torch.Tensor,
                seeds: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """query [s, b, heads, d] and packed ``key_value`` [s, b, 2, groups, d] (sent as it is
        when the ring has more than one rank) -> output [s, b, heads, d] in query's dtype and
        lse [b, heads, s] fp32."""
        q = _heads_first(query)
        seeds = iter(seeds)
        output = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        lse = torch.full(q.shape[:3], float("-inf"), device=query.device)
        out_view = _heads_first(output)
        buffers = [key_value, torch.empty_like(key_value)] if self.size > 1 else [key_value]
        for step in self._steps():
            transfer = self._exchange(buffers, step, KEY_VALUE_TAG)
            key, value = _split(buffers[step % 2])
            for tile in self._tiles(step):
                tile_out, tile_lse = torch.ops.memo_attention.tile_forward(
                    q[:, :, tile.rows], key[:, :, tile.cols], value[:, :, tile.cols], self.scale,
                    tile.causal, self.dropout_p, next(seeds))
                kernels.merge_into(out_view[:, :, tile.rows], lse[:, :, tile.rows], tile_out,
                                   tile_lse)
            if transfer is not None:
                transfer.wait()
        return output.to(query.dtype), lse

    def backward(self, grad_out: torch.Tensor, query: torch.Tensor, key_value: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, seeds: Sequence[int]):
        """(dq [s, b, heads, d], d key_value [s, b, 2, groups, d]) in the inputs' dtypes. From
        step 2 on (3 or more ranks) the ring receives into ``key_value`` itself: the caller
        must not need it afterwards."""
        q, grad, o = _heads_first(query), _heads_first(grad_out), _heads_first(out)
        seeds = iter(seeds)
        grad_query = torch.zeros_like(query)
        grad_q = _heads_first(grad_query)
        buffers = [key_value, torch.empty_like(key_value)] if self.size > 1 else [key_value]
        incoming: Optional[torch.Tensor] = None
        accumulator_transfer: Optional[Transfer] = None
        for step in self._steps():
            transfer = self._exchange(buffers, step, KEY_VALUE_TAG)
            key, value = _split(buffers[step % 2])
            contribution = torch.zeros_like(key_value)
            grad_key, grad_value = _split(contribution)
            for tile in self._tiles(step):
                dq, dk, dv = torch.ops.memo_attention.tile_backward(
                    grad[:, :, tile.rows], q[:, :, tile.rows], key[:, :, tile.cols],
                    value[:, :, tile.cols], o[:, :, tile.rows], lse[:, :, tile.rows],
                    self.scale, tile.causal, self.dropout_p, next(seeds))
                grad_q[:, :, tile.rows] += dq
                grad_key[:, :, tile.cols] += dk
                grad_value[:, :, tile.cols] += dv
                del dq, dk, dv
            if self.size == 1:
                return grad_query, contribution
            if accumulator_transfer is not None:
                accumulator_transfer.wait()
                contribution.add_(incoming)
            incoming = torch.empty_like(key_value)
            accumulator_transfer = self.ring.exchange(contribution, incoming,
                                                      KEY_VALUE_GRADIENTS_TAG)
            if transfer is not None:
                transfer.wait()
        accumulator_transfer.wait()  # the extra hop: this rank's own dK/dV come home
        return grad_query, incoming
