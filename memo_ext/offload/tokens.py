"""Which tokens of a layer are offloaded and which are recomputed.

A layer on a rank sees ``local_tokens`` tokens (the sequence after CP splitting, and after SP
splitting where a tensor is sequence-parallel). Tensors inside attention (q, k, v and the
attention output) hold ``chunks * local_tokens`` tokens: under sequence parallelism the linear
layers all-gather the ``chunks`` = TP ranks' slices, rank-major. MEMO splits every chunk the
same way: its first ``kept`` tokens are offloaded (the alpha part), the rest are dropped and
recomputed.

Running the position-wise parts of a layer separately on the kept and on the dropped tokens
gives tensors in *split order* -- all chunks' kept tokens, then all chunks' dropped tokens --
while attention needs *natural order* (chunk by chunk). The two index maps here convert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenSplit:
    """The alpha split of one layer's tokens on one rank."""

    local_tokens: int
    kept: int
    chunks: int

    @classmethod
    def from_alpha(cls, alpha: float, local_tokens: int, chunks: int) -> "TokenSplit":
        """``kept = floor(alpha * local_tokens)`` tokens of each chunk are offloaded (floor, so
        the host slots sized by the alpha LP are never exceeded)."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        return cls(local_tokens, math.floor(alpha * local_tokens), chunks)

    @property
    def dropped(self) -> int:
        return self.local_tokens - self.kept

    def natural_indices(self, part: str) -> torch.Tensor:
        """Natural-order token indices (0 .. chunks*local_tokens) of the 'kept' or 'dropped'
        part, in split order. Used to slice rotary embeddings."""
        start, stop = (0, self.kept) if part == "kept" else (self.kept, self.local_tokens)
        offsets = torch.arange(self.chunks) * self.local_tokens
        return (offsets[:, None] + torch.arange(start, stop)[None, :]).reshape(-1)

    def merge(self, kept: torch.Tensor | None, dropped: torch.Tensor | None) -> torch.Tensor:
        """Split-order parts ([chunks*kept, ...], [chunks*dropped, ...]) -> natural order.

        A contiguous tensor with a storage of its own: callers key saved tensors by storage,
        and q/k/v parts may be views of one shared QKV projection output (copied then). A lone
        part that already owns its storage is returned as it is: at alpha 0 or 1 a copy would
        only double the tensor.
        """
        parts = [p for p in (kept, dropped) if p is not None and p.size(0) > 0]
        if len(parts) == 1:
            part = parts[0]
            if part.is_contiguous() and part.untyped_storage().nbytes() == part.nbytes:
                return part
            return part.clone(memory_format=torch.contiguous_format)
        rest = parts[0].shape[1:]
        chunked = [p.reshape(self.chunks, -1, *rest) for p in parts]
        return torch.cat(chunked, dim=1).reshape(self.chunks * self.local_tokens, *rest)

    def split(self, natural: torch.Tensor) -> torch.Tensor:
        """Natural order -> split order (a contiguous tensor of the same shape). When one part
        is empty (alpha 0 or 1) the orders agree and ``natural`` itself is returned: MEMO then
        offloads the core attention's output once, not once as its saved output and once
        more as the layer's attention output."""
        if self.chunks == 1 or self.kept == 0 or self.dropped == 0:
            return natural.contiguous()
        rest = natural.shape[1:]
        chunked = natural.reshape(self.chunks, self.local_tokens, *rest)
        return torch.cat(
            [chunked[:, : self.kept].reshape(-1, *rest), chunked[:, self.kept :].reshape(-1, *rest)]
        )
