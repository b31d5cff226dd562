"""Causal attention of one subsequence over the K/V of itself and every earlier subsequence.

SPPO runs a sequence as N subsequences, forward 0..N-1 and backward N-1..0 (docs/sppo.md). Each
layer keeps the K/V of the subsequences already run (:class:`KVCache`, on device for the whole
pass), and subsequence ``i``'s queries attend to blocks ``0..i``: earlier blocks fully, its own
block with the causal (bottom-right aligned) mask. Each block is one attention tile of
memo_ext.attention's kernels (the trainer's own attention kernels and their declared CUDA
allocations) and the tiles merge by log-sum-exp: :class:`_BlockAttention` saves only Q,
the output and the log-sum-exp and runs each block's flash backward against them, so
per-subsequence memory does not grow with the number of earlier blocks.

Packed documents (--reset-attention-mask): the offsets of the whole sequence reach every
subsequence; each block's tile is cut along the documents' bounds (memo_ext.attention's
``within_documents``, the cut the trainer's ring applies), so a query sees an earlier
subsequence's keys only where they are in its own document.

Gradient flow across subsequences: earlier blocks enter subsequence ``i``'s attention as
detached leaves, so their dK/dV *accumulate* in the leaves' ``.grad`` (the spec's on-device
accumulators) while later subsequences run backward. Subsequence ``j``'s own K/V pass through
:class:`_AddLaterGradients`, whose backward adds the accumulated dK_j/dV_j to the gradient of
``j``'s own attention before it flows on into ``j``'s projections. That requires every later
subsequence's backward to have run first; it is checked, never assumed.

No library offers this: torch's SDPA returns no log-sum-exp and its causal mask is top-left
aligned for q_len != kv_len; flash-attn's kv-cache kernels are inference-only. The tiles make
it blocks of ordinary square-causal or unmasked attention.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.attention import Tile, documents_of, kernels, own_storage, within_documents


class SubsequenceOrderError(RuntimeError):
    """A subsequence's backward ran before the backward of a later subsequence that used its K/V."""


class _CachedBlock:
    """One subsequence's K/V in a layer's cache: detached leaves that later subsequences read
    and accumulate dK/dV into, and the count of later backwards still to come."""

    def __init__(self, index: int, key: torch.Tensor, value: torch.Tensor):
        self.index = index
        self.key = key.detach().requires_grad_(key.requires_grad)
        self.value = value.detach().requires_grad_(value.requires_grad)
        self.pending_backwards = 0


class KVCache:
    """The K/V blocks of one layer's subsequences run so far in the current sequence."""

    def __init__(self) -> None:
        self.blocks: list[_CachedBlock] = []

    def clear(self) -> None:
        self.blocks = []

    def nbytes(self) -> int:
        """Device bytes of the cached K/V (not counting gradient accumulators)."""
        return sum(b.key.nbytes + b.value.nbytes for b in self.blocks)


class _AddLaterGradients(torch.autograd.Function):
    """Identity on (K, V) whose backward adds what later subsequences accumulated in the
    block's leaves."""

    @staticmethod
    def forward(ctx, block: _CachedBlock, key: torch.Tensor, value: torch.Tensor):
        ctx.block = block
        return key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, grad_key: torch.Tensor, grad_value: torch.Tensor):
        block: _CachedBlock = ctx.block
        if block.pending_backwards:
            raise SubsequenceOrderError(
                f"SPPO: the backward of subsequence {block.index} ran while {block.pending_backwards} "
                "later subsequence(s) that attend to its K/V had not run theirs; run backward in "
                "reverse subsequence order")
        return None, _with_later(block.key, grad_key), _with_later(block.value, grad_value)


def _with_later(leaf: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` plus what later subsequences accumulated in ``leaf`` (which is then emptied)."""
    if leaf.grad is None:
        return grad
    later, leaf.grad = leaf.grad, None
    return grad + later


def _heads_first(tensor: torch.Tensor) -> torch.Tensor:
    """[s, b, heads|groups, d] -> a [b, heads|groups, s, d] view."""
    return tensor.permute(1, 2, 0, 3)


def block_tiles(queries: int, key_lengths: list[int], starts: Optional[list[int]] = None,
                documents: Optional[list[int]] = None) -> list[list[Tile]]:
    """Per K/V block, the tiles ``queries`` query rows compute against it: the last block is the
    queries' own (causal), every earlier one is attended whole. With packed ``documents``
    (cumulative offsets of the whole sequence) and the blocks' global first tokens ``starts``
    (the last is the queries' own), each tile is cut along the documents' bounds; a block in
    other documents than every query gets no tile."""
    last = len(key_lengths) - 1
    tiles = [[Tile(slice(0, queries), slice(0, length), j == last)]
             for j, length in enumerate(key_lengths)]
    if documents is None:
        return tiles
    return [list(within_documents(tile, starts[-1], start, documents))
            for (tile,), start in zip(tiles, starts)]


def _block_gradient(pieces: list, like: torch.Tensor) -> torch.Tensor:
    """A block's dK (or dV) [b, groups, s_k, d] from its tiles' (columns, gradient) pieces: a
    tile over the whole block gives it as it is (no packed documents)."""
    if len(pieces) == 1 and pieces[0][0] == slice(0, like.shape[2]):
        return pieces[0][1]
    grad = torch.zeros_like(like)
    for cols, piece in pieces:
        grad[:, :, cols] += piece
    return grad


class _BlockAttention(torch.autograd.Function):
    """softmax(Q·[K_0..K_i]^T·scale, causal in the last block)·[V_0..V_i], the tiles of
    :func:`block_tiles` per block.

    Inputs in Megatron's [s, b, heads|groups, d] layout; output [s_q, b, heads*d].
    """

    @staticmethod
    def forward(ctx, scale: float, cached: list, tiles: list, query: torch.Tensor,
                *keys_values: torch.Tensor):
        q = _heads_first(query)
        b, heads, sq, d = q.shape
        output = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        log_sum_exp = torch.full((b, heads, sq), float("-inf"), device=q.device)
        for j, block in enumerate(tiles):
            key, value = _heads_first(keys_values[2 * j]), _heads_first(keys_values[2 * j + 1])
            for tile in block:
                tile_output, tile_lse = torch.ops.memo_attention.tile_forward(
                    q[:, :, tile.rows], key[:, :, tile.cols], value[:, :, tile.cols], scale,
                    tile.causal, 0.0, 0)
                kernels.merge_into(output[:, :, tile.rows], log_sum_exp[:, :, tile.rows],
                                   tile_output, tile_lse)
        output = output.to(query.dtype)
        ctx.scale, ctx.cached, ctx.tiles = scale, cached, tiles
        for block in cached:
            block.pending_backwards += 1
        ctx.save_for_backward(query, output, log_sum_exp, *keys_values)
        return output.permute(2, 0, 1, 3).reshape(sq, b, heads * d)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        query, output, log_sum_exp, *keys_values = ctx.saved_tensors
        q = _heads_first(query)
        b, heads, sq, d = q.shape
        grad_out = grad_output.reshape(sq, b, heads, d).permute(1, 2, 0, 3).to(query.dtype)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grads = []
        for j, block in enumerate(ctx.tiles):
            key, value = _heads_first(keys_values[2 * j]), _heads_first(keys_values[2 * j + 1])
            key_pieces, value_pieces = [], []
            for tile in block:
                tile_grad_q, grad_k, grad_v = torch.ops.memo_attention.tile_backward(
                    grad_out[:, :, tile.rows], q[:, :, tile.rows], key[:, :, tile.cols],
                    value[:, :, tile.cols], output[:, :, tile.rows],
                    log_sum_exp[:, :, tile.rows], ctx.scale, tile.causal, 0.0, 0)
                grad_q[:, :, tile.rows] += tile_grad_q
                key_pieces.append((tile.cols, grad_k))
                value_pieces.append((tile.cols, grad_v))
            grads += [_block_gradient(key_pieces, key).permute(2, 0, 1, 3),
                      _block_gradient(value_pieces, value).permute(2, 0, 1, 3)]
        for block in ctx.cached:
            block.pending_backwards -= 1
        return (None, None, None, grad_q.permute(2, 0, 1, 3).to(query.dtype), *grads)


class SubsequenceCoreAttention(MegatronModule):
    """Core attention for SPPO: [s, b, heads, d] q and [s, b, groups, d] k/v of the current
    subsequence -> [s, b, heads*d], attending to this layer's cached K/V of earlier
    subsequences. Replaces the local spec's core attention under ``--memo-sppo``.

    ``subsequences`` (a :class:`memo_ext.sppo.SubsequenceState`) says which subsequence runs;
    every instance registers its cache there so the schedule can drop all of them at once.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, subsequences=None):
        super().__init__(config=config)
        if subsequences is None:
            raise ValueError("SubsequenceCoreAttention needs the SPPO SubsequenceState "
                             "(build the layer spec with memo_ext.sppo.SubsequencePipeline)")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"--memo-sppo needs causal attention, got {attn_mask_type.name}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("--memo-sppo needs --attention-dropout 0 (the subsequence kernel has "
                             "no dropout)")
        if config.context_parallel_size > 1:
            raise ValueError("--memo-sppo does not combine with --context-parallel-size > 1")
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))
        self.subsequences = subsequences
        self.cache = KVCache()
        subsequences.register_cache(self.cache)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("--memo-sppo supports no attention bias")
        if self.subsequences.multiplexed is not None:  # a task of --memo-sppo-msp
            return self.subsequences.multiplexed.attention(self, query, key, value)
        index = self.subsequences.index
        if index == 0:
            self.cache.clear()
        if len(self.cache.blocks) != index:
            raise SubsequenceOrderError(
                f"SPPO: subsequence {index} forward found {len(self.cache.blocks)} cached blocks; "
                "subsequences must run forward in order 0, 1, ...")
        key, value = own_storage(key), own_storage(value)
        block = _CachedBlock(index, key, value)
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            key, value = _AddLaterGradients.apply(block, key, value)
        earlier = list(self.cache.blocks)
        self.cache.blocks.append(block)
        self.subsequences.mark_kv(key, value)
        keys_values = [t for cached in earlier for t in (cached.key, cached.value)]
        # Packed documents: offsets of the whole sequence, each block at its first token.
        lengths = [cached.key.shape[0] for cached in earlier] + [key.shape[0]]
        tiles = block_tiles(query.shape[0], lengths, self.subsequences.boundaries[:index + 1],
                            documents_of(packed_seq_params, query))
        return _BlockAttention.apply(self.softmax_scale, earlier, tiles, query,
                                     *keys_values, key, value)
