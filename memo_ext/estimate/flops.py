"""Model FLOPs of a GPT, for MFU: one definition for the trainer's log (megatron.training.training)
and the estimator (memo_ext.estimate.cost, memo_ext.sppo.solver).

MFU follows docs/memo.md: 6·s·P + 6·n·h·s² FLOPs per sequence of s tokens (n layers, hidden size h).
The first term is the GEMMs with weights (forward 2·s·P, backward 4·s·P), the second causal
attention's score and context GEMMs. Model FLOPs, not hardware FLOPs: recomputation is not
counted.

P is the parameters whose GEMMs run for every token:

* per layer, the query/key/value and output projections and the MLP's weights (two matrices,
  three with SwiGLU);
* the output layer, vocabulary x hidden, once, whether or not it is tied to the embedding: the
  input embedding (and a learned position table) is a lookup, not a GEMM;
* the vocabulary as the tokenizer has it, not padded: padding to a multiple of 128 x TP is an
  implementation detail that changes with TP, and the recommender compares the same model's
  MFU across TP sizes, so the numerator must not move with them;
* no biases and no norm weights: they are element-wise (a few FLOPs per element, not 2 per
  weight and token), under 0.1 % of a 7B model's P.

:func:`gpt_shape` picks the fields P depends on from a trainer argument namespace; a trace
header's ``header["model"]`` holds the same fields (megatron/memo_tools/cli/trace.py builds them
with it), and memo_ext.estimate.models' presets hold them too (those without ``kv_channels``,
``num_query_groups``, ``swiglu`` are plain multi-head GELU models).
"""

from __future__ import annotations

#: The shape fields :func:`parameter_count` reads.
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "kv_channels", "swiglu", "vocab_size")


def gpt_shape(args, vocab_size: int) -> dict:
    """The shape fields of a validated trainer argument namespace (megatron.training.arguments
    fills in ffn_hidden_size, kv_channels and num_query_groups); ``vocab_size``: the tokenizer's,
    unpadded."""
    shape = {name: getattr(args, name) for name in SHAPE_FIELDS if name != "vocab_size"}
    shape["swiglu"] = bool(shape["swiglu"])
    shape["vocab_size"] = vocab_size
    return shape


def parameter_count(model: dict) -> int:
    """P of the MFU formula (see the module docstring) of a shape dict."""
    hidden, ffn, layers = model["hidden_size"], model["ffn_hidden_size"], model["num_layers"]
    heads = model["num_attention_heads"]
    head_dim = model.get("kv_channels") or hidden // heads
    groups = model.get("num_query_groups") or heads
    attention = hidden * heads * head_dim * 2 + hidden * groups * head_dim * 2
    mlp = (3 if model.get("swiglu") else 2) * hidden * ffn
    return layers * (attention + mlp) + model["vocab_size"] * hidden


def model_flops_per_sequence(model: dict, seq: int) -> float:
    """docs/memo.md's MFU numerator: 6·s·P + 6·n·h·s² (causal attention, forward and backward)."""
    return 6.0 * seq * parameter_count(model) + 6.0 * model["num_layers"] * \
        model["hidden_size"] * seq * seq


__all__ = ["SHAPE_FIELDS", "gpt_shape", "model_flops_per_sequence", "parameter_count"]
