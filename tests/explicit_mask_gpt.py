"""pretrain_gpt.py with megatron.core's own attention under an explicit [s, s] mask: the reference
that the packed-document trainings are compared with (tests/distributed/
test_packed_documents_training.py).

The trainer keeps packed documents apart by their offsets, in memo_ext.attention's tiles. This
script trains the same model on the same data with none of that: every layer's core attention
is megatron.core's local ``DotProductAttention`` (the [s, s] scores, megatron's masked softmax),
and the mask is megatron.core's own --reset-attention-mask rule
(``gpt_dataset._get_ltor_masks_and_position_ids``) applied to each micro-batch's tokens. Every
pipeline stage reads the micro-batch and builds the mask itself. Small s only, and no context
parallelism (DotProductAttention refuses it).

    torchrun --nproc-per-node 1 tests/explicit_mask_gpt.py <pretrain_gpt.py flags>
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.training import gpt  # noqa: E402
from megatron.training.arguments import parse_args, run_main  # noqa: E402


def model_provider(config, args, pre_process: bool = True, post_process: bool = True, **_):
    """The trainer's GPT (megatron.training.gpt.model_provider) with megatron.core's
    DotProductAttention as every layer's core attention (which holds no parameters)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    model = gpt.model_provider(config, args, pre_process, post_process)
    for layer in model.decoder.layers:
        layer.self_attention.core_attention = DotProductAttention(
            config, layer.layer_number, AttnMaskType.causal, "self")
    return model


def forward_step(eod: int, data_iterator, model):
    """One micro-batch with megatron's explicit mask (True where attention is blocked)."""
    from megatron.core import parallel_state
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    batch = next(data_iterator)
    mask = torch.stack([_get_ltor_masks_and_position_ids(tokens, eod, False, True, False, True)[0]
                        for tokens in batch["tokens"]])
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    output = model(batch["tokens"] if first else None, batch["position_ids"] if first else None,
                   attention_mask=mask, labels=batch["labels"] if last else None)
    return output, partial(gpt.loss_func, batch["loss_mask"])


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    from megatron.training.tokenizer import build_tokenizer
    from megatron.training.training import pretrain

    eod = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size).eod
    pretrain(args, model_provider, partial(forward_step, eod))


if __name__ == "__main__":
    run_main(main)
