"""Output layer and vocabulary-parallel cross-entropy fused and computed in sequence chunks.

The unfused path (megatron's ``ColumnParallelLinear`` followed by
``tensor_parallel.vocab_parallel_cross_entropy``) materialises the logits ``[s, b, V/TP]`` in the
parameter dtype, an fp32 copy of them, and keeps the fp32 softmax for backward: at 7B, 1152K
tokens, TP4 CP2 that is 44 GiB per rank. Here the logits of at most ``chunk_size`` tokens exist
at any time, and backward keeps only the hidden states, the weight, the local target indices and
one fp32 log-sum-exp per token.

Why the logits are recomputed in backward instead of computing the gradients in forward (as
Liger-Kernel and Cut Cross-Entropy do): the trainer's ``loss_func`` multiplies the per-token
losses by the loss mask and megatron's schedule scales them, so the gradient arriving per token
is an arbitrary vector known only in backward. The input gradient could be rescaled row by row
afterwards, but the weight gradient ``sum_t g_t (softmax_t - onehot_t) x_t^T`` cannot be
factored when ``g_t`` varies per token, so a forward-side gradient would be wrong for masked
losses (or would have to return a scalar loss, changing the trainer's ``[b, s]`` contract).
The price is one extra ``[s, h] x [h, V/TP]`` GEMM per step (four head GEMMs instead of three,
about 1-2 % of a 7B step's FLOPs), and saving ``hidden`` for backward costs nothing new: the
unfused output layer saves the same tensor.

Every working buffer is allocated once, before the chunk loop, and the loop body writes into
views of them with ``out=`` and in-place ops. So the allocation sequence does not depend on the
number of chunks: an allocation trace (memo_ext.trace) has the same structure at every sequence
length, which the estimator's two-length interpolation requires, and a GPU run does not churn its
caching allocator once per chunk. The chunks are equal (the last may be shorter), so their loops
are tile loops (memo_ext.tile_loop): the tracer runs four chunks and copies the rest, and a trace
at 4M tokens costs what one at 256K does.

Tensor parallelism: each rank holds ``V/TP`` rows of the weight. A chunk needs no communication
in forward: each rank keeps its own log-sum-exp per token, and after the loop the per-token
global log-sum-exp is combined with one MAX and one SUM all-reduce of ``[s, b]`` fp32 (plus one
SUM for the target logit), instead of megatron's three all-reduces of the same size. Sequence
parallelism: the input is this rank's ``s/TP`` slice; each chunk all-gathers ``chunk/TP`` local
positions from every rank (so the gathered ``[s, b, h]`` never exists either) and
reduce-scatters its input gradient back. The gathered rows are rank-major, so the targets are
permuted once into that order and the losses permuted back. Context parallelism needs nothing:
each rank's tokens and labels are its own.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from memo_ext.tile_loop import tile_indices

#: Default bound on one chunk's logits (compute dtype plus the fp32 copy), from which the chunk's
#: tokens follow: 256 MiB is 3328 tokens at 7B TP4 (V/TP = 12,672 rows, bf16) and 256 tokens at
#: a 128K vocabulary without TP -- still GEMMs of [>=256, h] x [h, >=12K] that run near full speed
#: on a GPU -- while a fixed token count would be 375 MiB at V/TP = 8K but 6 GiB at V/TP = 128K.
#: The head's peak is then dominated by what any implementation returns (the [s/TP, b, h] input
#: gradient) and the weight gradient; docs/loss.md has the breakdown at 7B/1M.
DEFAULT_CHUNK_BYTES = 256 << 20
#: Auto chunk sizes are multiples of this (GEMM-friendly) and at least this.
CHUNK_TOKENS_MULTIPLE = 256


def default_chunk_size(vocab_per_rank: int, dtype: torch.dtype) -> int:
    """Tokens per chunk whose logits (``dtype`` plus an fp32 copy unless fp32) fit
    :data:`DEFAULT_CHUNK_BYTES`, rounded down to a multiple of :data:`CHUNK_TOKENS_MULTIPLE`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = vocab_per_rank * (itemsize + (0 if dtype == torch.float32 else 4))
    tokens = DEFAULT_CHUNK_BYTES // per_token
    return max(CHUNK_TOKENS_MULTIPLE, tokens // CHUNK_TOKENS_MULTIPLE * CHUNK_TOKENS_MULTIPLE)


def _tp(group) -> tuple[int, int]:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class _Layout:
    """Where chunk ``k``'s rows come from: ``gather`` ranks (TP with SP, else 1) each contribute
    ``step`` consecutive local positions (fewer in the last chunk) of ``batch`` rows."""

    def __init__(self, local_positions: int, batch: int, gather: int, chunk_size: int):
        self.local_positions, self.batch, self.gather = local_positions, batch, gather
        self.step = max(1, min(local_positions, chunk_size // (batch * gather)))
        self.chunks = -(-local_positions // self.step)
        self.max_rows = self.step * gather * batch

    def chunk(self, k: int) -> tuple[int, int, int, int]:
        """(first local position, local positions, first row, rows) of chunk ``k``; rows index
        the flattened, permuted ``[s * b]`` token order."""
        first = k * self.step
        length = min(self.step, self.local_positions - first)
        return first, length, first * self.gather * self.batch, length * self.gather * self.batch

    def permutation(self, device) -> Optional[torch.Tensor]:
        """Sequence positions in the order the chunks' gathers produce them (None: identity)."""
        if self.gather == 1 or self.chunks == 1:
            return None
        pos = torch.arange(self.local_positions * self.gather, device=device)
        rank, local = pos // self.local_positions, pos % self.local_positions
        chunk, offset = local // self.step, local % self.step
        key = chunk * (self.gather * self.step) + rank * self.step + offset
        return torch.argsort(key)


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, target, chunk_size, tp_group, sequence_parallel):
        tp, tp_rank = _tp(tp_group)
        gather = tp if sequence_parallel else 1
        hidden = hidden.contiguous()
        local_positions, batch, _ = hidden.shape
        seq = target.shape[0]
        if seq != local_positions * gather or target.shape[1] != batch:
            raise ValueError(f"labels {tuple(target.shape)} do not match hidden states "
                             f"{tuple(hidden.shape)} (x{gather} positions gathered)")
        layout = _Layout(local_positions, batch, gather, chunk_size)
        vocab = weight.shape[0]
        perm = layout.permutation(hidden.device)

        # Targets in the chunks' row order, as indices into this rank's vocabulary shard.
        rows_target = (target if perm is None else target.index_select(0, perm)).reshape(-1)
        local_target = rows_target - tp_rank * vocab
        in_shard = (local_target >= 0) & (local_target < vocab)
        local_target.masked_fill_(~in_shard, 0)
        in_shard = in_shard.to(torch.float32)

        logits, logits32, gathered = _workspaces(hidden, vocab, layout)
        lse = torch.empty(seq * batch, dtype=torch.float32, device=hidden.device)
        target_logit = torch.empty_like(lse)
        row_max = torch.empty(layout.max_rows, dtype=torch.float32, device=hidden.device)
        for k in tile_indices(layout.chunks):
            x, start, rows = _chunk_input(hidden, gathered, layout, k, tp_group)
            chunk32 = _chunk_logits(x, weight, logits, logits32, rows)
            end = start + rows
            torch.gather(chunk32, 1, local_target[start:end].unsqueeze(1),
                         out=target_logit[start:end].unsqueeze(1))
            m = row_max[:rows]
            torch.amax(chunk32, dim=1, out=m)
            chunk32.sub_(m.unsqueeze(1)).exp_()
            chunk_lse = lse[start:end]
            torch.sum(chunk32, dim=1, out=chunk_lse)
            chunk_lse.log_().add_(m)
        del logits, logits32, gathered, row_max

        target_logit.mul_(in_shard)
        if tp > 1:
            # Combine the ranks' log-sum-exps: lse = M + log(sum_r exp(lse_r - M)), M = max_r.
            global_max = lse.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
            lse.sub_(global_max).exp_()
            dist.all_reduce(lse, op=dist.ReduceOp.SUM, group=tp_group)
            lse.log_().add_(global_max)
            del global_max
            dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=tp_group)
        loss = target_logit.neg_().add_(lse).view(seq, batch)
        if perm is not None:
            loss = torch.empty_like(loss).index_copy_(0, perm, loss)

        ctx.save_for_backward(hidden, weight, local_target, in_shard, lse, perm)
        ctx.layout, ctx.tp, ctx.tp_group = layout, tp, tp_group
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local_target, in_shard, lse, perm = ctx.saved_tensors
        layout, tp, tp_group = ctx.layout, ctx.tp, ctx.tp_group
        vocab = weight.shape[0]
        # Per-row scale of (softmax - onehot): the loss gradient, in the chunks' row order.
        grad_rows = grad_loss if perm is None else grad_loss.index_select(0, perm)
        grad_rows = grad_rows.reshape(-1).to(torch.float32)
        neg_onehot = in_shard.neg()

        logits, logits32, gathered = _workspaces(hidden, vocab, layout)
        grad_hidden = torch.empty_like(hidden)
        grad_hidden_rows = grad_hidden.view(-1, hidden.shape[-1])
        dgrad = None if layout.gather == 1 else torch.empty(
            layout.max_rows, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
        if weight.dtype == torch.float32:
            grad_weight, wgrad_chunk = torch.zeros_like(weight), None
        else:
            # Accumulate over chunks in fp32 and round once, as the unfused single GEMM does.
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
            wgrad_chunk = torch.empty_like(weight)
        for k in tile_indices(layout.chunks):
            x, start, rows = _chunk_input(hidden, gathered, layout, k, tp_group)
            chunk32 = _chunk_logits(x, weight, logits, logits32, rows)
            end = start + rows
            chunk32.sub_(lse[start:end].unsqueeze(1)).exp_()  # softmax
            chunk32.scatter_add_(1, local_target[start:end].unsqueeze(1),
                                 neg_onehot[start:end].unsqueeze(1))
            chunk32.mul_(grad_rows[start:end].unsqueeze(1))
            grad_logits = chunk32
            if logits32 is not None:  # the GEMMs run in the compute dtype, as unfused
                grad_logits = logits[:rows]
                grad_logits.copy_(chunk32)
            if dgrad is None:
                torch.mm(grad_logits, weight, out=grad_hidden_rows[start:end])
            else:
                first, length, _, _ = layout.chunk(k)
                torch.mm(grad_logits, weight, out=dgrad[:rows])
                dist.reduce_scatter_tensor(grad_hidden[first:first + length],
                                           dgrad[:rows].view(-1, *hidden.shape[1:]),
                                           group=tp_group)
            if wgrad_chunk is None:
                grad_weight.addmm_(grad_logits.t(), x)
            else:
                torch.mm(grad_logits.t(), x, out=wgrad_chunk)
                grad_weight.add_(wgrad_chunk)
        del logits, logits32, gathered, dgrad, wgrad_chunk
        if tp > 1 and layout.gather == 1:
            # Replicated input (TP without SP): every rank holds a partial sum over its shard.
            dist.all_reduce(grad_hidden, group=tp_group)
        if grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _workspaces(hidden, vocab, layout):
    """(logits in the compute dtype, their fp32 copy or None when the compute dtype is fp32,
    the gather buffer or None without SP): one chunk's worth each."""
    logits = torch.empty(layout.max_rows, vocab, dtype=hidden.dtype, device=hidden.device)
    logits32 = None if hidden.dtype == torch.float32 else torch.empty(
        layout.max_rows, vocab, dtype=torch.float32, device=hidden.device)
    gathered = None if layout.gather == 1 else torch.empty(
        layout.step * layout.gather, layout.batch, hidden.shape[-1], dtype=hidden.dtype,
        device=hidden.device)
    return logits, logits32, gathered


def _chunk_input(hidden, gathered, layout, k, tp_group):
    """Chunk ``k``'s input rows [rows, h] (gathered over TP with SP), first row, rows."""
    first, length, start, rows = layout.chunk(k)
    local = hidden[first:first + length]
    if gathered is None:
        return local.view(rows, -1), start, rows
    out = gathered[:length * layout.gather]
    dist.all_gather_into_tensor(out, local, group=tp_group)
    return out.view(rows, -1), start, rows


def _chunk_logits(x, weight, logits, logits32, rows):
    """The chunk's logits [rows, V/TP] in fp32 (a view of the preallocated buffers)."""
    out = logits[:rows]
    torch.mm(x, weight.t(), out=out)
    if logits32 is None:
        return out
    out32 = logits32[:rows]
    out32.copy_(out)
    return out32


def chunked_vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                         target: torch.Tensor, *,
                                         chunk_size: Optional[int] = None,
                                         tp_group=None,
                                         sequence_parallel: bool = False) -> torch.Tensor:
    """Per-token cross-entropy of the output layer ``hidden @ weight.T``, vocabulary-parallel,
    without materialising the logits.

    Args:
        hidden: the output layer's input ``[s_local, b, h]``; with ``sequence_parallel`` this
            rank's ``s / TP`` slice (as megatron's SP layout has it).
        weight: this rank's vocabulary shard ``[V/TP, h]`` (the output layer's, or the shared
            embedding's when tied).
        target: token ids ``[s, b]`` (full sequence of this CP rank, not split by SP).
        chunk_size: tokens (positions x batch rows) whose logits exist at once; None:
            :func:`default_chunk_size` (256 MiB of logits).
        tp_group: the tensor-parallel group the vocabulary is split over (None: no TP).
        sequence_parallel: whether ``hidden`` is the SP slice to gather over ``tp_group``.

    Returns:
        fp32 losses ``[s, b]``, equal on every TP rank; exactly what
        ``vocab_parallel_cross_entropy(output_layer(hidden), target)`` returns, to round-off.
    """
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], hidden.dtype)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedVocabParallelCrossEntropy.apply(hidden, weight, target, chunk_size, tp_group,
                                                   sequence_parallel)
