"""The trainer's model in evaluation, at the layout the flags give (TP with or without SP, CP,
PP; data-parallel replicas split the samples).

Each rank builds its pipeline stage with megatron.training.gpt.model_provider (no DDP, no
optimizer: the weights alone), loads --load through megatron.training.checkpointing
(dist_checkpointing reshards it to this layout), and runs micro-batches through megatron-core's
forward-only schedule with megatron.training.gpt.get_batch, as the trainer's validation does.
Two readouts give whole sequences whatever the layout:

- :meth:`EvalModel.token_losses`: every position's loss as training computes it (the CP ranks'
  zigzag chunks gathered back into sequence order);
- :meth:`EvalModel.next_tokens`: the greedy next token after one position. The output layer's
  input is narrowed to that position's row first, so the logits of the other positions never
  exist (at 64K tokens and a 128K vocabulary they would take 32 GiB in fp32); the row is read on
  the CP rank, and under SP the TP rank, that holds it.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.utils import get_attr_wrapped_model

from megatron.training import checkpointing
from megatron.training.arguments import ArgumentValidationError, core_transformer_config_from_args
from megatron.training.packed_documents import packed_seq_params
from megatron.training.training import build_stage_module


def device() -> torch.device:
    return torch.device(torch.cuda.current_device() if torch.cuda.is_available() else "cpu")


def locate(position: int, seq_length: int, cp_size: int, sp_size: int) -> tuple[int, int, int]:
    """(CP rank, TP rank, row) that holds ``position`` of a sequence that
    megatron.core.utils.get_batch_on_this_cp_rank splits into 2 x CP chunks (rank r: chunks r
    and 2 CP - 1 - r), and sequence parallelism then into ``sp_size`` equal shards (1: none)."""
    local, cp_rank = position, 0
    if cp_size > 1:
        chunk = seq_length // (2 * cp_size)
        index, offset = divmod(position, chunk)
        cp_rank = index if index < cp_size else 2 * cp_size - 1 - index
        local = offset + (0 if index < cp_size else chunk)
    tp_rank, row = divmod(local, seq_length // cp_size // sp_size)
    return cp_rank, tp_rank, row


def unzigzag(parts: list[torch.Tensor]) -> torch.Tensor:
    """The whole sequence (dim 1) from each CP rank's [b, s / CP] part, in CP rank order."""
    cp_size = len(parts)
    half = parts[0].shape[1] // 2
    chunks: list = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * cp_size - 1 - rank] = part[:, :half], part[:, half:]
    return torch.cat(chunks, dim=1)


def _gather_sequence(local: torch.Tensor) -> torch.Tensor:
    """[b, s / CP] on each CP rank -> [b, s] in sequence order on every one."""
    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=parallel_state.get_context_parallel_group())
    return unzigzag(parts)


class EvalModel:
    """This rank's pipeline stage of the checkpoint under ``args.load``, in eval mode."""

    def __init__(self, args: argparse.Namespace, model_provider: Callable, vocab_size: int):
        self.args = args
        self.vocab_size = vocab_size  # the tokenizer's: padding rows are never predicted
        self.module = build_stage_module(args, core_transformer_config_from_args(args),
                                         model_provider)
        try:
            self.common = checkpointing.load_weights(args.load, self.module, args)
        except ValueError as error:  # the checkpoint module's one-line errors
            raise ArgumentValidationError(str(error)) from None
        self.module.eval()
        self.last_stage = parallel_state.is_pipeline_last_stage()

    def _schedule(self, batches: list[dict], seq_length: int, labels: bool,
                  readout: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """``readout`` of each micro-batch's output on the last stage (empty elsewhere): the
        per-token losses with ``labels``, else the logits."""
        from megatron.training import gpt

        def forward_step(data_iterator: Iterator[dict], model):
            batch = gpt.get_batch(data_iterator)
            output = model(batch["tokens"], batch["position_ids"], attention_mask=None,
                           labels=batch["labels"] if labels else None,
                           packed_seq_params=packed_seq_params(batch))
            return output, lambda out, non_loss_data=True: readout(out)

        with torch.no_grad():
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(batches), model=[self.module],
                num_microbatches=len(batches),
                seq_length=seq_length // self.args.context_parallel_size,
                micro_batch_size=self.args.micro_batch_size, forward_only=True,
                collect_non_loss_data=True)

    def token_losses(self, batches: list[dict]) -> list[torch.Tensor]:
        """Each micro-batch's per-token losses [b, s] on the last stage (empty elsewhere)."""
        seq_length = batches[0]["tokens"].shape[1]
        return self._schedule(batches, seq_length, labels=True, readout=_gather_sequence)

    def next_tokens(self, batches: list[dict], position: int) -> torch.Tensor:
        """The greedy token after ``position`` of each sequence, [micro-batches, b], on every
        rank of the pipeline."""
        seq_length = batches[0]["tokens"].shape[1]
        sp_size = (self.args.tensor_model_parallel_size if self.args.sequence_parallel else 1)
        cp_owner, tp_owner, row = locate(position, seq_length,
                                         self.args.context_parallel_size, sp_size)
        holds = (parallel_state.get_context_parallel_rank() == cp_owner
                 and (sp_size == 1 or parallel_state.get_tensor_model_parallel_rank() == tp_owner))

        def readout(logits: torch.Tensor) -> torch.Tensor:
            # [b, rows, V / TP]: one row per TP rank under SP (its shard's row), else one
            vocabulary = gather_from_tensor_model_parallel_region(
                logits[:, tp_owner if sp_size > 1 else 0].contiguous()).float()
            vocabulary[:, self.vocab_size:] = -torch.inf
            ids = vocabulary.argmax(dim=-1)
            if self.args.context_parallel_size > 1:
                group = parallel_state.get_context_parallel_group()
                dist.broadcast(ids, src=dist.get_global_rank(group, cp_owner), group=group)
            return ids

        with self._output_row(row if holds else 0):
            outputs = self._schedule(batches, seq_length, labels=False, readout=readout)
        ids = (torch.stack(outputs) if self.last_stage else
               torch.empty(len(batches), self.args.micro_batch_size, dtype=torch.long,
                           device=device()))
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(ids, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        return ids

    @contextlib.contextmanager
    def _output_row(self, row: int):
        """The output layer sees row ``row`` of this rank's hidden states alone."""
        if not self.last_stage:
            yield
            return

        def narrow(_module, inputs, kwargs):
            return (inputs[0][row:row + 1], *inputs[1:]), kwargs

        layer = get_attr_wrapped_model(self.module, "output_layer")
        handle = layer.register_forward_pre_hook(narrow, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()
