"""megatron-core's GPTModel with the chunked output layer and loss (memo_ext.loss.chunked).

GPTModel._postprocess runs ``logits = self.output_layer(hidden, weight=...)`` and then
``compute_language_model_loss(labels, logits)``: overriding only the loss would be too late, the
logits exist by then. So :class:`ChunkedLossGPTModel` overrides ``_postprocess`` for the one
case it changes -- training or evaluation with labels on the last stage -- and hands every other
case (no labels, inference, multi-token prediction, a non-last stage) to megatron-core unchanged.

The loss runs inside the output layer's own ``forward`` (:class:`ChunkedOutputLayer`), so module
hooks see ``output_layer`` running, as they do for the unfused path: allocation traces and
telemetry attribute the head and the loss to ``output_layer``. The layer megatron-core built is
re-classed rather than rebuilt: same parameter (name, initial values, RNG draws), same
checkpoint format, and the tied-embedding machinery (``shared_embedding_or_output_weight``, the
embedding group's gradient all-reduce with pipeline parallelism) works unchanged because the
weight is passed exactly as megatron passes it, ``output_layer(..., weight=...)``, and its
gradient flows back through autograd into ``.grad`` / DDP's ``main_grad`` like any parameter's.
"""

from __future__ import annotations

from typing import Optional

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear

from memo_ext.loss.chunked import chunked_vocab_parallel_cross_entropy

#: The value of ``config.cross_entropy_fusion_impl`` that selects this model.
CHUNKED_IMPL = "chunked"


class ChunkedOutputLayer(ColumnParallelLinear):
    """The output layer; given ``labels`` [b, s] it returns the per-token losses [b, s] (fp32)
    instead of logits, computed chunk by chunk. Without labels it is ColumnParallelLinear."""

    chunk_size: Optional[int] = None  # None: memo_ext.loss.default_chunk_size

    def forward(self, input_, weight=None, runtime_gather_output=None, labels=None):
        if labels is None:
            return super().forward(input_, weight=weight,
                                   runtime_gather_output=runtime_gather_output)
        if weight is None:
            weight = self.weight
        loss = chunked_vocab_parallel_cross_entropy(
            input_, weight, labels.transpose(0, 1).contiguous(), chunk_size=self.chunk_size,
            tp_group=self.tp_group, sequence_parallel=self.sequence_parallel)
        return loss.transpose(0, 1).contiguous(), None


class ChunkedLossGPTModel(GPTModel):
    """GPTModel whose loss is the chunked output layer and cross-entropy.

    Takes GPTModel's arguments plus ``cross_entropy_chunk_size`` (tokens per chunk; None: sized
    by memo_ext.loss.default_chunk_size).
    """

    def __init__(self, *args, cross_entropy_chunk_size: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.mtp_num_layers:
            raise ValueError("the chunked loss does not implement multi-token prediction; "
                             "use the unfused loss with mtp_num_layers")
        if cross_entropy_chunk_size is not None and cross_entropy_chunk_size < 1:
            raise ValueError(f"cross_entropy_chunk_size must be positive, got "
                             f"{cross_entropy_chunk_size}")
        if self.post_process:
            self.output_layer.__class__ = ChunkedOutputLayer
            self.output_layer.chunk_size = cross_entropy_chunk_size

    def _postprocess(self, hidden_states, labels=None, inference_context=None,
                     mtp_in_postprocess=None, **kwargs):
        if (not self.post_process or labels is None or mtp_in_postprocess
                or (inference_context is not None and not self.training)):
            return super()._postprocess(hidden_states=hidden_states, labels=labels,
                                        inference_context=inference_context,
                                        mtp_in_postprocess=mtp_in_postprocess, **kwargs)
        output_weight = None
        if self.share_embeddings_and_output_weights:
            output_weight = self.shared_embedding_or_output_weight()
        loss, _ = self.output_layer(hidden_states, weight=output_weight, labels=labels)
        return loss

    def compute_language_model_loss(self, labels, logits):
        """The paths handed to megatron-core (which has logits anyway) use the unfused loss:
        megatron-core knows only the 'native' and 'te' fusions."""
        if self.config.cross_entropy_fusion_impl == CHUNKED_IMPL:
            loss = tensor_parallel.vocab_parallel_cross_entropy(
                logits, labels.transpose(0, 1).contiguous())
            return loss.transpose(0, 1).contiguous()
        return super().compute_language_model_loss(labels, logits)
