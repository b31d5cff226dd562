"""Chunked output layer and vocabulary-parallel cross-entropy (issue 18, part 3; docs/loss.md).

One entry point, :func:`chunked_vocab_parallel_cross_entropy` (memo_ext.loss.chunked); the
trainer reaches it through :class:`ChunkedLossGPTModel` (memo_ext.loss.model), which
megatron.training.gpt.model_provider builds for ``--cross-entropy-loss-fusion
--cross-entropy-fusion-impl chunked``. Imports megatron.core only when the model is asked for.
"""

from memo_ext.loss.chunked import (
    DEFAULT_CHUNK_BYTES,
    chunked_vocab_parallel_cross_entropy,
    default_chunk_size,
)

__all__ = ["DEFAULT_CHUNK_BYTES", "chunked_vocab_parallel_cross_entropy", "default_chunk_size",
           "ChunkedLossGPTModel"]


def __getattr__(name):
    # The model subclass imports megatron.core (seconds); the function and constant do not.
    if name == "ChunkedLossGPTModel":
        from memo_ext.loss.model import ChunkedLossGPTModel

        return ChunkedLossGPTModel
    raise AttributeError(name)
