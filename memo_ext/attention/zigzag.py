"""The one context-parallel split: zigzag (load-balanced) sharding of a causal sequence, and the
attention tiles between two shards.

A sequence of ``s`` tokens is cut into ``2p`` equal chunks and rank ``r`` of ``p`` holds chunks
``r`` and ``2p-1-r`` in that order, so every rank has the same causal work. This is the split
megatron.core's ``get_batch_on_this_cp_rank`` applies to the batch (context parallelism) and the
one METP applies over its tensor-parallel ring; with ``p == 1`` the rank holds the whole
sequence as one chunk.

:meth:`ZigzagLayout.tiles` lists the (query rows, key columns, causal) blocks a query shard
computes against a key shard, merged where the rows or columns are contiguous in local order so
each ring step is one to three kernel calls: every key chunk at or before a query chunk is
attended, a chunk against itself with the causal (diagonal) mask, and no mask tensor is built.
With document offsets (packed sequences) each block is cut further along the documents' bounds
(:func:`within_documents`, which SPPO's subsequence attention uses too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch


@dataclass(frozen=True)
class Tile:
    """Local query rows ``rows`` of a shard against local key columns ``cols`` of another;
    ``causal`` when both start at the same global token (top-left aligned diagonal block)."""
    rows: slice
    cols: slice
    causal: bool

    @property
    def pairs(self) -> int:
        """(query, key) pairs the kernel computes."""
        queries, keys = self.rows.stop - self.rows.start, self.cols.stop - self.cols.start
        return queries * (queries + 1) // 2 if self.causal else queries * keys


class ZigzagLayout:
    """Zigzag sharding of ``seq_length`` tokens over ``size`` ranks (module docstring)."""

    def __init__(self, seq_length: int, size: int):
        chunks = 2 * size if size > 1 else 1
        if seq_length % chunks:
            raise ValueError(f"the zigzag split of {size} ranks needs a sequence length divisible "
                             f"by 2 x {size} = {chunks}, got {seq_length}")
        self.seq_length = seq_length
        self.size = size
        self.chunk = seq_length // chunks

    def chunks(self, rank: int) -> tuple[int, ...]:
        """Global chunk indices held by ``rank``, in local order."""
        return (0,) if self.size == 1 else (rank, 2 * self.size - 1 - rank)

    def positions(self, rank: int) -> torch.Tensor:
        """Global token positions (int64) held by ``rank``, in local order."""
        return torch.cat([torch.arange(c * self.chunk, (c + 1) * self.chunk)
                          for c in self.chunks(rank)])

    def permutation(self) -> torch.Tensor:
        """Global positions in the order a contiguous split into ``size`` shards (Megatron's
        sequence-parallel scatter) hands out the zigzag shards."""
        return torch.cat([self.positions(rank) for rank in range(self.size)])

    def tiles(self, query_rank: int, key_rank: int,
              documents: Optional[Sequence[int]] = None) -> Iterator[Tile]:
        """The non-empty attention blocks of ``query_rank``'s tokens against ``key_rank``'s.
        ``documents``: cumulative document offsets of the whole sequence ([0, ..., s]) for packed
        sequences, where no token attends across a document boundary."""
        for tile in self._chunk_tiles(query_rank, key_rank):
            if documents is None:
                yield tile
            else:
                yield from self._within_documents(tile, query_rank, key_rank, documents)

    def causal_pairs(self, rank: int) -> int:
        """(query, key) pairs ``rank``'s queries attend over the whole ring."""
        return sum(tile.pairs for key_rank in range(self.size)
                   for tile in self.tiles(rank, key_rank))

    def _chunk_tiles(self, query_rank: int, key_rank: int) -> Iterator[Tile]:
        c = self.chunk
        first, second, both = slice(0, c), slice(c, 2 * c), slice(0, 2 * c)
        if self.size == 1:
            yield Tile(slice(0, c), slice(0, c), True)
        elif key_rank == query_rank:
            yield Tile(first, first, True)
            yield Tile(second, first, False)
            yield Tile(second, second, True)
        elif key_rank < query_rank:  # its first chunk precedes both of ours, its second follows
            yield Tile(both, first, False)
        else:  # both its chunks precede our second chunk and follow our first
            yield Tile(second, both, False)

    def _global_start(self, rank: int, local: int) -> int:
        """Global position of local token ``local`` of ``rank`` (within one chunk run)."""
        chunk = self.chunks(rank)[local // self.chunk]
        return chunk * self.chunk + local % self.chunk

    def _within_documents(self, tile: Tile, query_rank: int, key_rank: int,
                          documents: Sequence[int]) -> Iterator[Tile]:
        # A tile's rows (and columns) span at most two chunks; split them per chunk so each piece
        # is a run of consecutive global positions.
        for rows in self._runs(tile.rows):
            for cols in self._runs(tile.cols):
                yield from within_documents(Tile(rows, cols, tile.causal),
                                            self._global_start(query_rank, rows.start),
                                            self._global_start(key_rank, cols.start), documents)

    def _runs(self, local: slice) -> list[slice]:
        cuts = range((local.start // self.chunk + 1) * self.chunk, local.stop, self.chunk)
        bounds = [local.start, *cuts, local.stop]
        return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def within_documents(tile: Tile, row0: int, col0: int,
                     documents: Sequence[int]) -> Iterator[Tile]:
    """The pieces of ``tile`` inside each document: its rows are the consecutive global
    positions from ``row0`` on, its columns those from ``col0`` on, and ``documents`` the
    cumulative offsets of the whole sequence. A causal tile starts its rows and columns at the
    same token; any other lies wholly before its rows (zigzag ring steps, SPPO's earlier
    subsequences)."""
    for begin, end in zip(documents[:-1], documents[1:]):
        r0, r1 = max(begin, row0), min(end, row0 + tile.rows.stop - tile.rows.start)
        k0, k1 = max(begin, col0), min(end, col0 + tile.cols.stop - tile.cols.start)
        if tile.causal:
            k1 = min(k1, r1)
        if r0 >= r1 or k0 >= k1:
            continue
        rows = slice(tile.rows.start + r0 - row0, tile.rows.start + r1 - row0)
        cols = slice(tile.cols.start + k0 - col0, tile.cols.start + k1 - col0)
        if tile.causal and r0 == k0:
            yield Tile(rows, cols, True)
        elif k1 <= r0:  # every key precedes every query
            yield Tile(rows, cols, False)
        else:
            raise AssertionError("a tile is either diagonal or wholly earlier than its rows")
