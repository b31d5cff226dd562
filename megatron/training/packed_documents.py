"""Packed documents (``--reset-attention-mask``): each document of a packed training sequence
attends only to itself.

Megatron-LM builds this rule as an explicit [s, s] mask (a token after an end-of-document token
sees nothing up to and including it), which cannot exist at long lengths: 32K tokens make a
2 GiB boolean mask per sample, 1M tokens 1 TiB. Here the data loader gives each sample the
cumulative offsets of its documents instead (:class:`DocumentOffsets`), and the model's core
attention (memo_ext.attention, the trainer's one attention) skips the tiles across documents,
with or without context parallelism, under MEMO's offload, in SPPO's subsequences and METP's
ring, on every pipeline stage. Rotary embeddings need no reset: within a document the scores
depend only on the distance between two positions.
"""

from __future__ import annotations

from typing import Optional

import torch

#: The batch key of a sample's document offsets (int32, [0, ..., sequence length]).
OFFSETS_KEY = "document_offsets"


def document_offsets(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Cumulative offsets (int32) of the documents in one sequence ``tokens`` [s]: a document
    ends after each end-of-document token, as megatron's --reset-attention-mask rule says."""
    length = tokens.numel()
    ends = (torch.nonzero(tokens.view(-1) == eod).view(-1) + 1).tolist()
    bounds = [0, *(end for end in ends if end < length), length]
    return torch.tensor(bounds, dtype=torch.int32)


class DocumentOffsets(torch.utils.data.Dataset):
    """``dataset``'s samples with their document offsets under :data:`OFFSETS_KEY` (computed in
    the data loader, from the sample's input tokens)."""

    def __init__(self, dataset: torch.utils.data.Dataset, eod: int) -> None:
        self.dataset, self.eod = dataset, eod

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index) -> dict:
        sample = self.dataset[index]
        return {**sample, OFFSETS_KEY: document_offsets(torch.as_tensor(sample["tokens"]),
                                                        self.eod)}


def packed_seq_params(batch: dict):
    """megatron-core's PackedSeqParams for the model's forward when ``batch`` (micro-batch 1)
    carries document offsets, else None. The offsets index the whole sequence: under context
    parallelism each rank's ring attention maps them onto the tiles it computes."""
    offsets: Optional[torch.Tensor] = batch.get(OFFSETS_KEY)
    if offsets is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    offsets = offsets.view(-1)
    # The whole sequence's length, not the longest document's: megatron-core sizes the rotary
    # table of a packed batch by max_seqlen (GPTModel's get_rotary_seq_len), and the tokens
    # keep their positions in the sequence.
    length = int(offsets[-1])
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                           max_seqlen_q=length, max_seqlen_kv=length)
