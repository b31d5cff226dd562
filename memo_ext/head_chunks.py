"""The rule for how many head chunks a rank's attention heads split into
(``--memo-attention-head-chunks``, docs/attention.md "Head chunks").

Its own module, free of torch and megatron, because three places apply it: the attention
(memo_ext.attention.core), the trainer's flag check (memo_ext.config.AttentionConfig) and the
recommender's candidates (memo_ext.estimate.layout.candidates).
"""

from __future__ import annotations


def head_chunks_split(heads: int, groups: int, chunks: int) -> bool:
    """Whether ``chunks`` head chunks split a rank's ``heads`` query heads in ``groups`` query
    groups evenly: whole groups each (``chunks`` divides ``groups``), or equal parts of one
    group's heads each (a multiple of ``groups`` dividing ``heads``)."""
    if chunks < 1:
        return False
    return groups % chunks == 0 or (chunks % groups == 0 and heads % chunks == 0)


def valid_head_chunks(heads: int, groups: int) -> list[int]:
    """Every chunk count that splits ``heads`` query heads in ``groups`` groups, ascending."""
    return [n for n in range(1, heads + 1) if head_chunks_split(heads, groups, n)]
