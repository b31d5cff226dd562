"""Position buckets of the perplexity report: which positions of a sequence each bucket holds,
and the loss sums and token counts it collects.

Position p is the index of an input token in its sequence; its loss is that of predicting the
token after it, having seen p + 1 tokens. A model that uses a long context well has lower loss
in the later buckets; one that cannot use positions past its training length has higher.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BUCKET_KINDS = ("linear", "log2")


def default_bucket_size(seq_length: int, kind: str) -> int:
    """Eight equal buckets (linear), or a first bucket of 1/64 of the sequence, then doubling:
    seven buckets (log2)."""
    return max(1, seq_length // (8 if kind == "linear" else 64))


def bucket_edges(seq_length: int, kind: str, size: int) -> list[int]:
    """Edges ``0 = e_0 < e_1 < ... < e_n = seq_length``; bucket i holds positions
    ``[e_i, e_(i+1))``. linear: a bucket every ``size`` positions; log2: ``[0, size)``, then
    each bucket as wide as all before it (``[size, 2 size)``, ``[2 size, 4 size)``, ...). The
    last bucket ends at ``seq_length`` and may be narrower."""
    if kind not in BUCKET_KINDS:
        raise ValueError(f"bucket kind {kind!r} is not one of {', '.join(BUCKET_KINDS)}")
    if size < 1 or seq_length < 1:
        raise ValueError(f"bucket size {size} and sequence length {seq_length} must be positive")
    edges, width = [0], size
    while edges[-1] + width < seq_length:
        edges.append(edges[-1] + width)
        if kind == "log2":
            width = edges[-1]
    return edges + [seq_length]


def position_text(position: int) -> str:
    """``2K`` for a whole multiple of 1024, else the number."""
    return f"{position // 1024}K" if position and position % 1024 == 0 else str(position)


def bucket_label(start: int, end: int) -> str:
    """``[1K, 2K)``, ``[1000, 1500)``."""
    return f"[{position_text(start)}, {position_text(end)})"


@dataclass
class BucketRow:
    """One bucket's share of the evaluated tokens."""

    start: int
    end: int
    tokens: int
    mean_loss: float  # nats per token; nan without tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_loss) if self.tokens else math.nan

    def as_record(self) -> dict:
        return {"start": self.start, "end": self.end, "label": bucket_label(self.start, self.end),
                "tokens": self.tokens, "mean_loss": self.mean_loss, "perplexity": self.perplexity}


class PositionLosses:
    """Loss sums and token counts per bucket over the sequences added."""

    def __init__(self, edges: list[int]):
        self.edges = list(edges)
        boundaries = torch.tensor(self.edges[1:-1], dtype=torch.long)
        self.bucket_of = torch.bucketize(torch.arange(self.edges[-1]), boundaries, right=True)
        # [buckets, 2]: loss sum, token count (float64: exact counts, sums without drift)
        self.totals = torch.zeros(len(self.edges) - 1, 2, dtype=torch.float64)

    def add(self, losses: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """Per-token ``losses`` [b, s] of sequences whose ``loss_mask`` [b, s] is 1 where a
        token counts."""
        mask = loss_mask.to(torch.float64).cpu()
        per_position = torch.stack([(losses.to(torch.float64).cpu() * mask).sum(0), mask.sum(0)],
                                   dim=1)
        self.totals.index_add_(0, self.bucket_of, per_position)

    def rows(self) -> list[BucketRow]:
        return [BucketRow(start, end, int(count),
                          float(total / count) if count else math.nan)
                for start, end, (total, count) in zip(self.edges, self.edges[1:],
                                                      self.totals.tolist())]

    def overall(self) -> BucketRow:
        total, count = self.totals.sum(0).tolist()
        return BucketRow(0, self.edges[-1], int(count), total / count if count else math.nan)
