"""The core attention of every Megatron-MEMO layer: [s, b, heads, d] q and [s, b, groups, d]
k/v (RoPE already applied) -> [s, b, heads * d].

Built into megatron.core's local layer spec in place of ``DotProductAttention`` (which refuses
context parallelism and materialises the s x s scores), so the trainer with or without MEMO and
the tracer run this module. Flash-style: no s x s (or s_local x s_global) score, softmax or mask
tensor exists; forward keeps the output and the fp32 log-sum-exp, backward recomputes per tile.

* Without context parallelism (and without documents): one causal tile, one kernel call.
* With ``--context-parallel-size`` p > 1: megatron.core's batch split gives this rank the zigzag
  chunks r and 2p-1-r; K/V travel a ring over the context-parallel group
  (:class:`memo_ext.attention.ring_attention.RingAttention`), as Transformer Engine's P2P context
  parallelism does on GPUs.
* GQA: K/V stay in their query groups; the kernels take them so.
* Packed sequences: ``packed_seq_params.cu_seqlens_q`` (batch 1, offsets over the whole
  sequence) keeps every token inside its document (the trainer's --reset-attention-mask,
  megatron.training.packed_documents).
* Head chunks (``--memo-attention-head-chunks``, UPipe's idea): the query heads run in chunks,
  one after another, each through the whole ring, so the ring's buffers, dQ/dK/dV and the
  kernels' workspaces are one chunk's; the saved q/k/v/out are the layer's as before. A chunk
  is whole query groups, or, with more chunks than a rank has groups (GQA at high TP: Llama-3-8B
  at TP=4 has 2 groups of 4 heads a rank), a part of one group's query heads: its group's K/V
  then travel the ring once per chunk, and its dK/dV are the sum of its chunks'.
* Attention dropout: per-tile masks from seeds drawn in Megatron's model-parallel RNG fork; such
  tiles run the explicit kernel, which materialises each tile's scores (long-context runs use
  ``--attention-dropout 0``). The trainer says so in one line (:func:`attention_dropout_notice`).
  The flash kernels' own dropout is not used: a tile's mask must be the same in forward and
  backward and on every backend, and the CPU kernel, torch's FlashAttention-2 and flash-attn
  each draw theirs from their own generator (the CPU flash kernel takes no dropout at all).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.attention.ring import Ring
from memo_ext.attention.ring_attention import (RingAttention, dropout_seeds, pack_key_value,
                                               _heads_first)
from memo_ext.attention.zigzag import ZigzagLayout
from memo_ext.head_chunks import head_chunks_split
from memo_ext.tile_loop import tile_indices


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if it is its storage's only tenant, else a contiguous copy. K and V (and Q
    without RoPE) are slices of the fused QKV projection's output: saved as they are they would
    keep the whole output alive until backward (Transformer Engine copies them too)."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _head_chunks(heads: int, groups: int, chunks: int) -> list[tuple[slice, slice]]:
    """(query heads, K/V groups) of each of ``chunks`` chunks, in order (megatron lays a group's
    query heads out next to each other): whole query groups when ``chunks`` divides ``groups``,
    else, when it is a multiple of ``groups`` that divides ``heads``, an equal part of one
    group's heads each (that group's K/V shared by its chunks)."""
    if not head_chunks_split(heads, groups, chunks):
        raise ValueError(f"{chunks} head chunks neither divide the {groups} query groups nor "
                         f"split them into equal parts of the {heads} query heads")
    if groups % chunks == 0:
        heads_per, groups_per = heads // chunks, groups // chunks
        return [(slice(i * heads_per, (i + 1) * heads_per),
                 slice(i * groups_per, (i + 1) * groups_per)) for i in range(chunks)]
    heads_per, per_group = heads // chunks, chunks // groups
    return [(slice(i * heads_per, (i + 1) * heads_per), slice(i // per_group, i // per_group + 1))
            for i in range(chunks)]


def _attend(query, key, value, attention: RingAttention, causal: bool, seeds):
    """(out [s, b, heads, d], lse [b, heads, s]) of one chunk of heads."""
    if attention.ring is None and attention.documents is None:
        out, lse = torch.ops.memo_attention.tile_forward(
            _heads_first(query), _heads_first(key), _heads_first(value), attention.scale,
            causal, attention.dropout_p, seeds[0])
        # Contiguous in Megatron's layout, so that the layer's [s, b, h] output is a view of
        # the tensor saved here (one copy alive, and one for MEMO to offload).
        return out.permute(2, 0, 1, 3).contiguous(), lse
    return attention.forward(query, pack_key_value(key, value), seeds)


def _attend_backward(grad_out, query, key, value, out, lse, attention: RingAttention,
                     causal: bool, seeds):
    """(dq, dk, dv) of one chunk of heads, in Megatron's [s, b, heads, d] layout."""
    if attention.ring is None and attention.documents is None:
        dq, dk, dv = torch.ops.memo_attention.tile_backward(
            _heads_first(grad_out), _heads_first(query), _heads_first(key),
            _heads_first(value), _heads_first(out), lse, attention.scale, causal,
            attention.dropout_p, seeds[0])
        return tuple(g.permute(2, 0, 1, 3) for g in (dq, dk, dv))
    dq, dkv = attention.backward(grad_out, query, pack_key_value(key, value), out, lse, seeds)
    return dq, dkv[:, :, 0], dkv[:, :, 1]


class _CoreAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, the output and the log-sum-exp; backward reruns the tiles. With several
    head chunks each chunk runs whole (forward, or backward) before the next starts, writing
    its slice of the layer's output (gradients): only one chunk's working set is live."""

    @staticmethod
    def forward(ctx, query, key, value, attention: RingAttention, causal: bool, seeds: list,
                chunks: int):
        if chunks == 1:
            out, lse = _attend(query, key, value, attention, causal, seeds)
        else:
            out = torch.empty_like(query)
            lse = query.new_empty((query.shape[1], query.shape[2], query.shape[0]),
                                  dtype=torch.float32)
            per_chunk = len(seeds) // chunks
            slices = _head_chunks(query.shape[2], key.shape[2], chunks)
            for index in tile_indices(chunks):
                heads, groups = slices[index]
                chunk_out, chunk_lse = _attend(
                    query[:, :, heads], key[:, :, groups], value[:, :, groups], attention,
                    causal, seeds[index * per_chunk:(index + 1) * per_chunk])
                out[:, :, heads] = chunk_out
                lse[:, heads] = chunk_lse
                del chunk_out, chunk_lse
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.attention, ctx.causal, ctx.seeds, ctx.chunks = attention, causal, seeds, chunks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        attention, causal, seeds, chunks = ctx.attention, ctx.causal, ctx.seeds, ctx.chunks
        grad_out = grad_out.contiguous()
        if chunks == 1:
            dq, dk, dv = _attend_backward(grad_out, query, key, value, out, lse, attention,
                                          causal, seeds)
            return dq, dk, dv, None, None, None, None
        # Chunks within a group add their parts of its dK/dV (every chunk alike, so that the
        # tracer may copy the middle ones: memo_ext.tile_loop); whole groups write theirs.
        shared = chunks > key.shape[2]
        make = torch.zeros_like if shared else torch.empty_like
        dq, dk, dv = torch.empty_like(query), make(key), make(value)
        per_chunk = len(seeds) // chunks
        slices = _head_chunks(query.shape[2], key.shape[2], chunks)
        for index in tile_indices(chunks):
            heads, groups = slices[index]
            chunk_dq, chunk_dk, chunk_dv = _attend_backward(
                grad_out[:, :, heads], query[:, :, heads], key[:, :, groups],
                value[:, :, groups], out[:, :, heads], lse[:, heads], attention, causal,
                seeds[index * per_chunk:(index + 1) * per_chunk])
            dq[:, :, heads] = chunk_dq
            if shared:
                dk[:, :, groups] += chunk_dk
                dv[:, :, groups] += chunk_dv
            else:
                dk[:, :, groups], dv[:, :, groups] = chunk_dk, chunk_dv
            del chunk_dq, chunk_dk, chunk_dv
        return dq, dk, dv, None, None, None, None


def core_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                   causal: bool = True, ring: Optional[Ring] = None,
                   documents: Optional[Sequence[int]] = None,
                   dropout_p: float = 0.0, head_chunks: int = 1) -> torch.Tensor:
    """Attention of this rank's tokens, [s, b, heads, d] / [s, b, groups, d] -> [s, b, heads, d].
    ``ring``: the context-parallel ring (this rank holds the zigzag chunks of its ring rank);
    ``documents``: cumulative offsets of the packed documents of the whole sequence;
    ``head_chunks``: run the query heads in this many chunks, one after another (whole groups,
    or equal parts of one group: :func:`_head_chunks`)."""
    if not causal and (ring is not None or documents is not None):
        raise ValueError("context parallelism and packed documents need the causal mask")
    _head_chunks(query.shape[2], key.shape[2], head_chunks)  # raises unless it divides
    size = 1 if ring is None else ring.size
    layout = ZigzagLayout(query.shape[0] * size, size)
    attention = RingAttention(layout, scale, ring, documents, dropout_p)
    count = 1 if ring is None and documents is None else attention.tile_count()
    seeds = dropout_seeds(count * head_chunks, dropout_p, query)
    return _CoreAttentionFunction.apply(query, key, value, attention, causal, seeds, head_chunks)


class CoreAttention(MegatronModule):
    """megatron.core's core-attention interface over :func:`core_attention` (module docstring);
    built from a ModuleSpec with DotProductAttention's constructor signature."""

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, head_chunks: int = 1):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"CoreAttention supports the causal and no_mask masks, got "
                             f"{attn_mask_type.name}")
        if attn_mask_type != AttnMaskType.causal and config.context_parallel_size > 1:
            raise ValueError("context parallelism needs the causal mask")
        self.causal = attn_mask_type == AttnMaskType.causal
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_size = config.context_parallel_size
        tp = config.tensor_model_parallel_size
        groups = (config.num_query_groups or config.num_attention_heads) // tp
        if not head_chunks_split(config.num_attention_heads // tp, groups, head_chunks):
            raise ValueError(f"--memo-attention-head-chunks {head_chunks} must divide the "
                             f"{groups} query groups of a tensor-parallel rank, or be a "
                             f"multiple of them dividing its "
                             f"{config.num_attention_heads // tp} query heads")
        self.head_chunks = head_chunks
        self._ring: Optional[Ring] = None

    def dropout_notice(self, seq_length: int, micro_batch: int) -> Optional[str]:
        """One line saying what this attention's dropout costs in training (None without
        dropout): the tiles run the explicit kernel, whose fp32 score tensor for the largest
        tile of this layout (documents only make tiles smaller) is given in bytes."""
        if self.dropout_p == 0:
            return None
        heads = self.config.num_attention_heads // self.config.tensor_model_parallel_size
        heads //= self.head_chunks
        rows, cols = _largest_tile(seq_length, self.cp_size)
        nbytes = micro_batch * heads * rows * cols * 4
        size = (f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB")
        return (f"> --attention-dropout {self.dropout_p:g}: attention tiles with dropout run the "
                f"explicit kernel, not flash: it materialises each tile's fp32 scores ({size} per "
                f"copy for this layout's largest tile, {micro_batch} x {heads} heads x {rows} x "
                f"{cols}, several copies live at once) and is much slower on a GPU; "
                "long-context runs use --attention-dropout 0")

    def ring(self) -> Optional[Ring]:
        """The context-parallel ring (built on first use: the groups exist only then)."""
        if self.cp_size > 1 and self._ring is None:
            self._ring = Ring(parallel_state.get_context_parallel_group())
        return self._ring

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("CoreAttention takes no attention bias")
        documents = documents_of(packed_seq_params, query)
        dropout_p = self.dropout_p if self.training else 0.0
        query, key, value = (own_storage(t) for t in (query, key, value))
        with tensor_parallel.get_cuda_rng_tracker().fork():
            out = core_attention(query, key, value, self.softmax_scale, self.causal,
                                 self.ring(), documents, dropout_p, self.head_chunks)
        return out.reshape(out.size(0), out.size(1), -1)


def _largest_tile(seq_length: int, cp_size: int) -> tuple[int, int]:
    """(rows, columns) of the largest tile a rank computes for a sequence of ``seq_length``
    tokens over a ring of ``cp_size`` (every rank's tiles have the same sizes)."""
    layout = ZigzagLayout(seq_length, cp_size)
    sizes = [(t.rows.stop - t.rows.start, t.cols.stop - t.cols.start)
             for key_rank in range(cp_size) for t in layout.tiles(0, key_rank)]
    return max(sizes, key=lambda size: size[0] * size[1])


def attention_dropout_notice(model, seq_length: int, micro_batch: int) -> Optional[str]:
    """The trainer's one line on what ``--attention-dropout`` costs (None when no
    CoreAttention of the ``model`` chunks has dropout): every layer's is the same, the first
    one found speaks."""
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, CoreAttention):
                return module.dropout_notice(seq_length, micro_batch)
    return None


def documents_of(packed_seq_params, query: torch.Tensor) -> Optional[list[int]]:
    """Cumulative document offsets over the whole sequence from megatron's PackedSeqParams
    (None without them), for ``query`` [s, b, ...] (the trainer's, SPPO's and METP's
    attention read them so)."""
    if packed_seq_params is None:
        return None
    offsets = packed_seq_params.cu_seqlens_q
    if query.size(1) != 1 or not torch.equal(offsets, packed_seq_params.cu_seqlens_kv):
        raise ValueError("packed documents need one sequence per micro-batch (batch 1) with "
                         "equal query and key offsets")
    return [int(x) for x in offsets.tolist()]
