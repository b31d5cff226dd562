"""The GPT the trainer trains: megatron.core calls these four with each micro-batch.

- :func:`model_provider`: this pipeline stage's GPTModel (the mechanisms' layers in its spec);
- :func:`get_batch`: this rank's slice of the next micro-batch;
- :func:`loss_func`: the masked token loss of a micro-batch;
- :func:`forward_step`: one micro-batch through the model, with its loss function.

pretrain_gpt.py hands them to megatron.training.training.pretrain; the tools (the tracer, the
HF checkpoint converter, the long-context evaluator) build and run the same model with them.
megatron.core is imported only after the command line validated (see
megatron.training.arguments), hence the local imports.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch


def model_provider(config, args: argparse.Namespace, pre_process: bool = True,
                   post_process: bool = True, memo=None, sppo=None, metp=None):
    """This pipeline stage's GPTModel (with MEMO layers when ``memo`` is given, SPPO's
    subsequence attention when ``sppo`` is, METP's attention and MLP when ``metp`` is; with
    memo_ext.loss's chunked output layer and loss for --cross-entropy-fusion-impl chunked)."""
    from megatron.core.models.gpt import GPTModel

    from megatron.training.layer_specs import gpt_block_spec

    model_class, extra = GPTModel, {}
    if config.cross_entropy_loss_fusion and config.cross_entropy_fusion_impl == "chunked":
        from memo_ext.loss import ChunkedLossGPTModel

        model_class = ChunkedLossGPTModel
        extra = {"cross_entropy_chunk_size": args.cross_entropy_chunk_size}
    model = model_class(
        config=config,
        transformer_layer_spec=gpt_block_spec(args, config, memo, sppo, metp),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        **extra,
    )
    if args.memo_tile_norms:
        from memo_ext.tiled_mlp import with_tile_norms

        with_tile_norms(model)  # before DDP and the optimizer see the parameters
    return model


def get_batch(data_iterator, every_stage: bool = False) -> dict:
    """This rank's slice of the next micro-batch. Only the first and last pipeline stages read
    data, unless ``every_stage`` (packed documents): then the middle stages read the micro-batch
    too and keep its document offsets, which their attention needs (every rank's loader reads
    the micro-batches of its data-parallel rank, the same on every stage of a pipeline)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron.training.packed_documents import OFFSETS_KEY

    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    if not (first or last or every_stage):
        return dict.fromkeys(keys)
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    offsets = batch.get(OFFSETS_KEY)
    if first or last:
        batch = get_batch_on_this_cp_rank({
            key: batch[key].to(device, non_blocking=True) for key in keys
        })
    else:
        batch = dict.fromkeys(keys)
    if offsets is not None:  # offsets of the whole sequence: not split by CP rank
        batch[OFFSETS_KEY] = offsets.to(device, non_blocking=True)
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token loss sum, token count, and the [sum, count] pair reported as 'lm loss'."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, packed_documents: bool = False):
    """One micro-batch forward; megatron.core schedules call this. ``packed_documents``
    (--reset-attention-mask): every pipeline stage reads the micro-batch's document offsets."""
    from megatron.training.packed_documents import packed_seq_params

    batch = get_batch(data_iterator, every_stage=packed_documents)
    output_tensor = model(
        batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"],
        packed_seq_params=packed_seq_params(batch),
    )
    return output_tensor, partial(loss_func, batch["loss_mask"])

