"""memo_ext.attention: the one attention of Megatron-MEMO.

- :class:`CoreAttention` / :func:`core_attention`: the trainer's core attention (local spec, with
  and without MEMO), causal, flash-style, context parallelism as a zigzag ring, GQA, documents;
- :class:`RingAttention`: the zigzag ring of tiles, also run by METP over its tensor-parallel group;
- :class:`ZigzagLayout`: the one load-balanced sequence split and its tiles;
  :func:`within_documents` cuts a tile along packed documents' bounds (also for SPPO);
- :mod:`memo_ext.attention.kernels`: the tile kernels as custom ops whose fake rules declare the
  CUDA kernels' allocations (what traces record); SPPO's cached blocks call them directly.
"""

from memo_ext.attention import kernels
from memo_ext.attention.core import (CoreAttention, attention_dropout_notice, core_attention,
                                     documents_of, own_storage)
from memo_ext.attention.ring import FlatPack, Ring, Transfer
from memo_ext.attention.ring_attention import RingAttention, pack_key_value
from memo_ext.attention.zigzag import Tile, ZigzagLayout, within_documents

__all__ = ["CoreAttention", "FlatPack", "Ring", "RingAttention", "Tile", "Transfer",
           "ZigzagLayout", "attention_dropout_notice", "core_attention", "documents_of",
           "kernels", "own_storage", "pack_key_value", "within_documents"]
