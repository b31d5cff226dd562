"""Multiplexed sequence partitioning (MSP, docs/sppo.md "Pipeline and solver"): pipeline stages that
would idle during a sequence's warm-up and cool-down help the stages that are busy then.

Where the idle slots are. SPPO's fill-drain order (schedule.py) runs forward ``i`` on stage
``s`` in slot ``s + i`` and its backward in the mirrored slot ``T - 1 - s - i`` (``T = 2N + 2p -
2`` slots). In the warm-up slots ``t < p - 1`` stages ``> t`` have not started; in the forward
tail ``t >= N`` stages ``< t - N + 1`` are done and wait for backward; backward mirrors both, with
the same busy tasks and the same idle stages.
:func:`memo_ext.sppo.msp_plan.plan_multiplexing` hands the idle stages of every such slot out to its busy tasks, one at a time to the task with the most work per member,
and a task keeps its group for its forward and its backward. For p=4, N=8 all 8 tasks with
helpers lie in docs/sppo.md's left and right sets; forward 0 of stage 0 runs on all four stages
(tests/unit/memo_ext/sppo/test_sppo_msp.py lists them).

How a group runs a task (the gaps docs/sppo.md leaves are filled as in docs/sppo.md "Multiplexed sequence partitioning"):

- **Layers only.** The owner stage keeps its embedding, final norm, output layer and loss; only
  its transformer layers are multiplexed. Every stage of a pipeline has the same layers (same
  spec, same count: checked at startup), so a helper runs the owner's layers through its *own*
  layer modules with the owner's weights swapped in (``torch.func.functional_call``).
- **Weights.** The owner broadcasts its layers' parameters to the group into a transient buffer
  (forward and again for backward); in backward the helpers' weight gradients are reduced to
  the owner, where they reach megatron's gradient buffers through the owner's ordinary
  parameter gradients. Traffic is twice the stage's parameter bytes per multiplexed task,
  whatever the sequence length.
- **Tokens.** The subsequence is cut into one FLOPs-balanced piece per member (partition.py's
  formula over the subsequence's token range); the owner scatters the pieces and gathers the
  outputs, then sends the whole output on as usual.
- **K/V.** Per layer the group all-gathers the pieces' K/V; a member attends to the earlier
  subsequences' cached K/V (broadcast by the owner, which keeps the cache), the earlier pieces
  and, causally, its own piece. The owner keeps the whole subsequence's K/V in its cache, so
  later subsequences run as without MSP. dK/dV that helpers compute for cached blocks are
  reduced into the owner's accumulators; what later subsequences accumulated for this
  subsequence's own K/V is broadcast back and added to each piece's gradient.
- **Recomputation.** The forward runs without autograd: in backward the group recomputes its
  pieces (same weights, same K/V) and back-propagates them. A helper therefore holds nothing of
  the owner's between the two; the owner holds only the layers' input, as a stage does for a
  checkpointed layer block.

Collectives run inside autograd (one node per layer), so every member's backward issues them in
the same order.

With tensor parallelism (sequence parallel) every TP rank of a stage has its own group with the
same TP rank of the other stages (weights are TP shards, K/V are the rank's heads). The owner's
TP ranks all-gather the subsequence's sequence shards, and each scatters its shard of every
piece; the outputs come back the same way, so the owner ends with its own sequence shard again.

No library does this: Seq1F1B and megatron's schedules have no cross-stage helpers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model, make_viewless_tensor

from memo_ext.attention import own_storage
from memo_ext.sppo.attention import (SubsequenceOrderError, _BlockAttention, _CachedBlock,
                                     block_tiles)
from memo_ext.sppo.msp_plan import MultiplexedTask, plan_multiplexing, split_range
from memo_ext.sppo.partition import LayerFlops

#: Dtypes a rotary table may have (megatron keeps it in fp32; Float16Module casts buffers).
_ROTARY_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

class _Pass:
    """One member's part of one multiplexed task (forward or the backward's recomputation),
    read by :class:`memo_ext.sppo.attention.SubsequenceCoreAttention` while it is set."""

    def __init__(self, runtime: "SequenceMultiplexer", task: MultiplexedTask, recompute: bool):
        self.runtime = runtime
        self.task = task
        self.recompute = recompute
        self.group = runtime.groups[task]
        self.owner = runtime.rank_of(task.stage)
        self.is_owner = task.stage == runtime.stage
        self.piece = dist.get_group_rank(self.group, dist.get_rank())
        self.cuts = runtime.piece_cuts(task)

    @property
    def piece_lengths(self) -> list[int]:
        """Tokens of every member's piece (what the attention sees)."""
        return [b - a for a, b in zip(self.cuts, self.cuts[1:])]

    @property
    def shard_lengths(self) -> list[int]:
        """Tokens of every member's piece on one TP rank (the layers' sequence shards)."""
        return [n // self.runtime.tensor_parallel for n in self.piece_lengths]

    def attention(self, module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor) -> torch.Tensor:
        """``module``'s core attention for this member's piece (see the module docstring)."""
        index = self.task.subsequence
        earlier: list = []
        own_block = None
        if self.is_owner:
            if index == 0 and not self.recompute:
                module.cache.clear()
            blocks = module.cache.blocks
            if (len(blocks) <= index) if self.recompute else (len(blocks) != index):
                raise SubsequenceOrderError(
                    f"SPPO MSP: subsequence {index} found {len(blocks)} cached blocks; "
                    "subsequences must run forward in order 0, 1, ...")
            earlier = blocks[:index]
            if self.recompute:
                own_block = blocks[index]
        key, value = own_storage(key), own_storage(value)
        gathered = _GroupKeysValues.apply(self, own_block, key, value,
                                          *[t for b in earlier for t in (b.key, b.value)])
        members = len(self.cuts) - 1
        pieces = [(gathered[j], gathered[members + j]) for j in range(members)]
        if self.is_owner:
            kv_earlier = [(b.key, b.value) for b in earlier]
            if not self.recompute:
                block = _CachedBlock(index, torch.cat([k for k, _ in pieces]),
                                     torch.cat([v for _, v in pieces]))
                block.key.requires_grad_(self.runtime.training)
                block.value.requires_grad_(self.runtime.training)
                blocks.append(block)
                self.runtime.state.mark_kv(block.key, block.value)
        else:
            received = gathered[2 * members:]
            kv_earlier = [(received[2 * j], received[2 * j + 1]) for j in range(index)]
        # The forward counts one pending backward on the owner's earlier blocks; the task's
        # backward takes it back once its recomputation has back-propagated.
        counted = earlier if self.is_owner and not self.recompute else []
        keys_values = [t for pair in kv_earlier + pieces[:self.piece + 1] for t in pair]
        tiles = block_tiles(query.shape[0], [t.shape[0] for t in keys_values[::2]])
        return _BlockAttention.apply(module.softmax_scale, counted, tiles, query, *keys_values)


class _GroupKeysValues(torch.autograd.Function):
    """One layer's K/V exchange in a multiplexed task. Forward: all-gather the pieces' K/V and
    broadcast the owner's cached earlier blocks (outputs: keys of every piece, values of every
    piece, then on helpers the earlier blocks' K, V); in recomputation also broadcast what later
    subsequences accumulated for the subsequence's own K/V. Backward: sum the pieces' gradients
    over the group (each member keeps its own piece's, plus its slice of the later
    subsequences' share) and reduce the helpers' gradients of the earlier blocks to the owner,
    where they accumulate in the cache's leaves."""

    @staticmethod
    def forward(ctx, task_pass: _Pass, own_block, key: torch.Tensor, value: torch.Tensor,
                *earlier_leaves: torch.Tensor):
        group, owner, lengths = task_pass.group, task_pass.owner, task_pass.piece_lengths
        longest = max(lengths)
        stacked = _pad(torch.stack([key.detach(), value.detach()]), longest, dim=1)
        gathered = [torch.empty_like(stacked) for _ in lengths]
        dist.all_gather(gathered, stacked, group=group)
        keys = [g[0, :n] for g, n in zip(gathered, lengths)]
        values = [g[1, :n] for g, n in zip(gathered, lengths)]
        received = []
        if task_pass.is_owner:
            for leaf in earlier_leaves:
                dist.broadcast(leaf.detach(), src=owner, group=group)
        else:
            boundaries = task_pass.runtime.state.boundaries
            for j in range(task_pass.task.subsequence):
                shape = (boundaries[j + 1] - boundaries[j], *key.shape[1:])
                for _ in range(2):
                    tensor = key.new_empty(shape)
                    dist.broadcast(tensor, src=owner, group=group)
                    received.append(tensor)
        ctx.later = None
        if task_pass.recompute:
            ctx.later = _later_gradients(task_pass, own_block, key, value)
        ctx.task_pass, ctx.longest = task_pass, longest
        return (*keys, *values, *received)

    @staticmethod
    def backward(ctx, *grads):
        task_pass = ctx.task_pass
        group, lengths = task_pass.group, task_pass.piece_lengths
        members = len(lengths)
        like = next(g for g in grads[:2 * members] if g is not None)
        pieces = [_pad(torch.stack([_or_zeros(grads[j], n, like),
                                    _or_zeros(grads[members + j], n, like)]), ctx.longest, dim=1)
                  for j, n in enumerate(lengths)]
        summed = torch.stack(pieces)
        dist.all_reduce(summed, group=group)
        mine = summed[task_pass.piece, :, :lengths[task_pass.piece]]
        key_grad, value_grad = mine[0], mine[1]
        if ctx.later is not None:
            key_grad, value_grad = key_grad + ctx.later[0], value_grad + ctx.later[1]
        # The owner attends to its cache leaves directly (their gradients accumulate there); it
        # adds zeros to the reduction and receives the helpers' share as its inputs' gradient.
        boundaries = task_pass.runtime.state.boundaries
        received_grads = grads[2 * members:]
        earlier_grads = []
        for j in range(2 * task_pass.task.subsequence):
            block = j // 2
            grad = None if task_pass.is_owner else received_grads[j]
            contribution = (_or_zeros(grad, boundaries[block + 1] - boundaries[block], like)
                            .contiguous())
            dist.reduce(contribution, dst=task_pass.owner, group=group)
            earlier_grads.append(contribution)
        if not task_pass.is_owner:
            earlier_grads = []
        return (None, None, key_grad, value_grad, *earlier_grads)


def _or_zeros(grad: Optional[torch.Tensor], length: int, like: torch.Tensor) -> torch.Tensor:
    return grad if grad is not None else like.new_zeros((length, *like.shape[1:]))


def _later_gradients(task_pass: _Pass, own_block, key: torch.Tensor, value: torch.Tensor):
    """This member's slice of what later subsequences accumulated for the task's K/V (the
    owner's cache leaves, emptied here)."""
    begin = task_pass.runtime.state.boundaries[task_pass.task.subsequence]
    length = task_pass.cuts[-1] - task_pass.cuts[0]
    full = key.new_zeros((2, length, *key.shape[1:]))
    if task_pass.is_owner:
        if own_block.pending_backwards:
            raise SubsequenceOrderError(
                f"SPPO MSP: the backward of subsequence {own_block.index} ran while "
                f"{own_block.pending_backwards} later subsequence(s) had not run theirs")
        for slot, leaf in enumerate((own_block.key, own_block.value)):
            if leaf.grad is not None:
                full[slot].copy_(leaf.grad)
                leaf.grad = None
    dist.broadcast(full, src=task_pass.owner, group=task_pass.group)
    a = task_pass.cuts[task_pass.piece] - begin
    b = task_pass.cuts[task_pass.piece + 1] - begin
    return full[0, a:b], full[1, a:b]


def _pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor.contiguous()
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


class _MultiplexedLayers(torch.autograd.Function):
    """The owner's view of a multiplexed task: its layers' output for the whole subsequence,
    computed by the group; backward recomputes and back-propagates with the group."""

    @staticmethod
    def forward(ctx, runtime: "SequenceMultiplexer", task: MultiplexedTask,
                rotary: Optional[torch.Tensor], hidden: torch.Tensor, *params: torch.Tensor):
        output = runtime.run_forward(task, hidden, rotary)
        ctx.runtime, ctx.task = runtime, task
        ctx.save_for_backward(hidden, rotary)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        hidden, rotary = ctx.saved_tensors
        grad_hidden, grad_params = ctx.runtime.run_backward(ctx.task, hidden, rotary,
                                                            grad_output)
        return (None, None, None, grad_hidden, *grad_params)


class SequenceMultiplexer:
    """MSP's runtime on one rank: its process groups, the owner's hook into its transformer
    block, and the helper's side of every task (see the module docstring)."""

    def __init__(self, state, stages: int, flops: LayerFlops, micro_batch_size: int,
                 hidden_size: int):
        self.state = state
        self.micro_batch_size = micro_batch_size
        self.hidden_size = hidden_size
        self.flops = flops
        work = [flops.of_range(a, b) for a, b in zip(state.boundaries, state.boundaries[1:])]
        self.tasks = plan_multiplexing(stages, work)
        self.groups: dict = {}
        self.pipeline: list[int] = []
        self.stage = -1
        self.layers = None
        self.training = True
        self.tensor_parallel = 1
        self.tensor_parallel_rank = 0
        self.tensor_parallel_group = None

    def setup(self, chunk: torch.nn.Module) -> None:
        """Create every pipeline's groups (collective over all ranks, in one order) and hook the
        chunk's transformer block."""
        self.tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
        self.tensor_parallel_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tensor_parallel_group = parallel_state.get_tensor_model_parallel_group()
        block = get_attr_wrapped_model(chunk, "decoder")
        if self.tensor_parallel > 1 and not block.config.sequence_parallel:
            raise ValueError("--memo-sppo-msp with --tensor-model-parallel-size > 1 needs "
                             "--sequence-parallel")
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        pipeline_group = parallel_state.get_pipeline_model_parallel_group()
        self.pipeline = dist.get_process_group_ranks(pipeline_group)
        self.layers = list(block.layers)
        device = next(block.parameters()).device
        shapes = torch.tensor([len(self.layers), sum(p.numel() for p in block.layers.parameters())],
                              device=device)
        everyone = [torch.empty_like(shapes) for _ in self.pipeline]
        dist.all_gather(everyone, shapes, group=pipeline_group)
        if any(not torch.equal(other, shapes) for other in everyone):
            raise ValueError("--memo-sppo-msp needs the same transformer layers on every pipeline "
                             "stage (layers, parameters per stage: "
                             f"{[tuple(t.tolist()) for t in everyone]}); drop uneven pipeline "
                             "splits or --memo-sppo-msp")
        world = dist.get_world_size()
        mine = torch.tensor(self.pipeline, device=device)
        pipelines = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(pipelines, mine)
        for ranks in sorted({tuple(p.tolist()) for p in pipelines}):
            for key in sorted(self.tasks):
                task = self.tasks[key]
                group = dist.new_group([ranks[s] for s in task.members])
                if ranks == tuple(self.pipeline):
                    self.groups[task] = group
        self._hook(block)

    def rank_of(self, stage: int) -> int:
        return self.pipeline[stage]

    def piece_cuts(self, task: MultiplexedTask) -> list[int]:
        begin, end = self.state.boundaries[task.subsequence], \
            self.state.boundaries[task.subsequence + 1]
        return split_range(begin, end, len(task.members), self.flops, self.tensor_parallel)

    def help(self, task: MultiplexedTask, backward: bool) -> None:
        """This rank's part of another stage's task (a helper's step of the program)."""
        if backward:
            self.run_backward(task, None, None, None)
        else:
            self.run_forward(task, None, None)

    # -- the passes, shared by owner and helpers -------------------------------------------

    def run_forward(self, task: MultiplexedTask, hidden: Optional[torch.Tensor],
                    rotary: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        task_pass = _Pass(self, task, recompute=False)
        weights = self._broadcast_weights(task_pass)
        rotary = self._broadcast_rotary(task_pass, rotary)
        piece = self._scatter(task_pass, hidden)
        with torch.no_grad():
            output = self._run_layers(task_pass, weights, piece, rotary)
        return self._gather(task_pass, output)

    def run_backward(self, task: MultiplexedTask, hidden: Optional[torch.Tensor],
                     rotary: Optional[torch.Tensor], grad_output: Optional[torch.Tensor]):
        task_pass = _Pass(self, task, recompute=True)
        weights = [w.requires_grad_() for w in self._broadcast_weights(task_pass)]
        rotary = self._broadcast_rotary(task_pass, rotary)
        piece = self._scatter(task_pass, hidden).requires_grad_()
        piece_grad = self._scatter(task_pass, grad_output)
        with torch.enable_grad():
            output = self._run_layers(task_pass, weights, piece, rotary)
            # No ``inputs=``: the owner's cache leaves of earlier subsequences collect their
            # dK/dV here as well (the layers' real parameters are not in this graph).
            torch.autograd.backward(output, piece_grad)
        grad_hidden = self._gather(task_pass, piece.grad)
        grad_weights = self._reduce_weight_grads(task_pass, weights)
        if task_pass.is_owner:
            for cache in self.state.caches:
                for block in cache.blocks[:task.subsequence]:
                    block.pending_backwards -= 1
        return grad_hidden, grad_weights

    def _run_layers(self, task_pass: _Pass, weights: list, piece: torch.Tensor,
                    rotary: Optional[torch.Tensor]) -> torch.Tensor:
        begin = self.state.boundaries[task_pass.task.subsequence]
        a, b = (task_pass.cuts[task_pass.piece] - begin, task_pass.cuts[task_pass.piece + 1]
                - begin)
        rotary_piece = None if rotary is None else rotary[a:b]
        self.state.multiplexed = task_pass
        try:
            position = 0
            for layer in self.layers:
                names = [name for name, _ in layer.named_parameters()]
                swapped = dict(zip(names, weights[position:position + len(names)]))
                position += len(names)
                piece, _ = torch.func.functional_call(
                    layer, swapped, args=(),
                    kwargs={"hidden_states": piece, "attention_mask": None,
                            "rotary_pos_emb": rotary_piece})
        finally:
            self.state.multiplexed = None
        return piece

    def _parameters(self) -> list[torch.Tensor]:
        return [p for layer in self.layers for p in layer.parameters()]

    def _broadcast_weights(self, task_pass: _Pass) -> list[torch.Tensor]:
        """The owner's layer parameters on every member: the owner's own (detached), received
        copies on helpers, in the helpers' own parameter shapes (the same layers)."""
        own = self._parameters()
        if task_pass.is_owner:
            weights = [p.detach() for p in own]
        else:
            weights = [torch.empty_like(p) for p in own]
        for dtype in dict.fromkeys(p.dtype for p in own):
            members = [w for w in weights if w.dtype == dtype]
            flat = (_flatten_dense_tensors(members) if task_pass.is_owner
                    else torch.empty(sum(w.numel() for w in members), dtype=dtype,
                                     device=members[0].device))
            dist.broadcast(flat, src=task_pass.owner, group=task_pass.group)
            if not task_pass.is_owner:
                for w, received in zip(members, _unflatten_dense_tensors(flat, members)):
                    w.copy_(received)
        return weights

    def _reduce_weight_grads(self, task_pass: _Pass, weights: list) -> list:
        grads = [w.grad if w.grad is not None else torch.zeros_like(w) for w in weights]
        for dtype in dict.fromkeys(g.dtype for g in grads):
            members = [g for g in grads if g.dtype == dtype]
            flat = _flatten_dense_tensors(members)
            dist.reduce(flat, dst=task_pass.owner, group=task_pass.group)
            if task_pass.is_owner:
                for g, summed in zip(members, _unflatten_dense_tensors(flat, members)):
                    g.copy_(summed)
        return grads if task_pass.is_owner else []

    def _broadcast_rotary(self, task_pass: _Pass,
                          rotary: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The owner's rotary table of the subsequence (None without RoPE) on every member."""
        # On CUDA the groups are NCCL's: every exchanged tensor lives on the device.
        header = torch.tensor([*rotary.shape, _ROTARY_DTYPES.index(rotary.dtype)]
                              if rotary is not None else [0] * 5, dtype=torch.long,
                              device=self._parameters()[0].device)
        dist.broadcast(header, src=task_pass.owner, group=task_pass.group)
        if header[0] == 0:
            return None
        if not task_pass.is_owner:
            *shape, dtype = header.tolist()
            rotary = torch.empty(shape, dtype=_ROTARY_DTYPES[dtype],
                                 device=self._parameters()[0].device)
        rotary = rotary.contiguous()
        dist.broadcast(rotary, src=task_pass.owner, group=task_pass.group)
        return rotary

    def _scatter(self, task_pass: _Pass, whole: Optional[torch.Tensor]) -> torch.Tensor:
        """This member's part of the owner's ``whole`` (its sequence shard of the subsequence):
        this TP rank's sequence shard of the member's piece."""
        lengths = task_pass.shard_lengths
        longest = max(lengths)
        like = self._parameters()[0]
        received = torch.empty((longest, self.micro_batch_size, self.hidden_size),
                               dtype=like.dtype, device=like.device)
        pieces = None
        if task_pass.is_owner:
            full = torch.cat(self._tensor_parallel_all_gather(whole.detach()))
            rank = self.tensor_parallel_rank
            offsets = [c - task_pass.cuts[0] for c in task_pass.cuts]
            pieces = [_pad(full[a + rank * n:a + (rank + 1) * n], longest, dim=0)
                      for a, n in zip(offsets, lengths)]
        dist.scatter(received, pieces, src=task_pass.owner, group=task_pass.group)
        return received[:lengths[task_pass.piece]].clone()

    def _gather(self, task_pass: _Pass, piece: torch.Tensor) -> Optional[torch.Tensor]:
        """Inverse of :meth:`_scatter`: the owner's sequence shard of the pieces' outputs."""
        lengths = task_pass.shard_lengths
        longest = max(lengths)
        padded = _pad(piece.detach(), longest, dim=0)
        gathered = [torch.empty_like(padded) for _ in lengths] if task_pass.is_owner else None
        dist.gather(padded, gathered, dst=task_pass.owner, group=task_pass.group)
        if not task_pass.is_owner:
            return None
        # This TP rank's shard of every piece, then every rank's: the whole subsequence.
        shards = self._tensor_parallel_all_gather(
            torch.cat([g[:n] for g, n in zip(gathered, lengths)]))
        starts = [sum(lengths[:j]) for j in range(len(lengths))]
        full = torch.cat([shard[start:start + n] for start, n in zip(starts, lengths)
                          for shard in shards])
        size = full.shape[0] // self.tensor_parallel
        return full[self.tensor_parallel_rank * size:(self.tensor_parallel_rank + 1) * size]

    def _tensor_parallel_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.tensor_parallel == 1:
            return [tensor]
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(self.tensor_parallel)]
        dist.all_gather(gathered, tensor, group=self.tensor_parallel_group)
        return gathered

    # -- the owner's hook ------------------------------------------------------------------

    def _hook(self, block: torch.nn.Module) -> None:
        original = block.forward
        runtime = self

        def forward(hidden_states, attention_mask=None, **kwargs):
            task = runtime.tasks.get((runtime.stage, runtime.state.index))
            if task is None:
                return original(hidden_states, attention_mask, **kwargs)
            rotary = kwargs.pop("rotary_pos_emb", None)
            unsupported = sorted(k for k, v in kwargs.items() if v is not None)
            if unsupported:
                raise ValueError(f"--memo-sppo-msp: the transformer block got {unsupported}, "
                                 "which a multiplexed task cannot split; drop --memo-sppo-msp")
            if not block.pre_process:
                hidden_states = block.input_tensor
            params = runtime._parameters()
            output = _MultiplexedLayers.apply(runtime, task, rotary, hidden_states, *params)
            if block.final_layernorm is not None:
                output = block.final_layernorm(output)
            return make_viewless_tensor(inp=output, requires_grad=True, keep_graph=True)

        block.forward = forward
