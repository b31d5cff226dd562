"""Hugging Face Llama/Mistral/Qwen2 tensors to the trainer's GPTModel (one tensor-parallel
rank, the whole model) and back.

Names and layouts that differ:

- q_proj, k_proj and v_proj (weights, and Qwen2's biases) are one ``linear_qkv``, grouped by
  key/value head: for each group its query heads, then its key head, then its value head
  (the layout megatron-core's SelfAttention splits).
- gate_proj and up_proj are one ``linear_fc1``, gate first (megatron's SwiGLU applies silu to
  the first half).
- The embedding and output layer have the trainer's padded vocabulary: zero rows are added on
  the way in and dropped on the way out.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from megatron.memo_tools.hf_checkpoint.errors import ConversionError
from megatron.memo_tools.hf_checkpoint.hf_config import Architecture

Getter = Callable[[str], torch.Tensor]

# One-to-one per layer: Hugging Face name -> ours (under model.layers.i / decoder.layers.i).
LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
GLOBAL_RENAMES = {"model.norm.weight": "decoder.final_layernorm.weight"}
EMBEDDING = ("model.embed_tokens.weight", "embedding.word_embeddings.weight")
OUTPUT = ("lm_head.weight", "output_layer.weight")
# Tensors some checkpoints carry that no model uses.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _qkv_suffixes(arch: Architecture) -> list[str]:
    return ["weight", "bias"] if arch.qkv_bias else ["weight"]


def hf_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a Hugging Face checkpoint of ``arch`` holds (lm_head only
    when untied)."""
    hidden, vocab, ffn = arch.hidden_size, arch.vocab_size, arch.ffn_hidden_size
    rows = {"q": arch.num_heads * arch.head_dim, "k": arch.num_kv_heads * arch.head_dim,
            "v": arch.num_kv_heads * arch.head_dim}
    shapes = {EMBEDDING[0]: (vocab, hidden), "model.norm.weight": (hidden,)}
    if not arch.tie_embeddings:
        shapes[OUTPUT[0]] = (vocab, hidden)
    for i in range(arch.num_layers):
        prefix = f"model.layers.{i}."
        for p, count in rows.items():
            shapes[f"{prefix}self_attn.{p}_proj.weight"] = (count, hidden)
            if arch.qkv_bias:
                shapes[f"{prefix}self_attn.{p}_proj.bias"] = (count,)
        shapes.update({
            prefix + "self_attn.o_proj.weight": (hidden, rows["q"]),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "mlp.gate_proj.weight": (ffn, hidden),
            prefix + "mlp.up_proj.weight": (ffn, hidden),
            prefix + "mlp.down_proj.weight": (hidden, ffn),
        })
    return shapes


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] rows regrouped per key/value head (weights or biases)."""
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, arch: Architecture) -> list[torch.Tensor]:
    """The inverse of :func:`fuse_qkv`: q, k and v."""
    per_group = arch.num_heads // arch.num_kv_heads * arch.head_dim
    grouped = qkv.reshape(arch.num_kv_heads, per_group + 2 * arch.head_dim, *qkv.shape[1:])
    return [t.reshape(-1, *qkv.shape[1:]).clone()
            for t in grouped.split([per_group, arch.head_dim, arch.head_dim], dim=1)]


def pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < table.shape[0]:
        raise ConversionError(f"the padded vocabulary ({rows}) is smaller than the model's "
                              f"{table.shape[0]} rows; lower --make-vocab-size-divisible-by")
    return torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])])


def to_megatron(get: Getter, arch: Architecture,
                padded_vocab_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every parameter of our model, from Hugging Face tensors."""
    yield EMBEDDING[1], pad_rows(get(EMBEDDING[0]), padded_vocab_size)
    for i in range(arch.num_layers):
        hf, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, our_name in LAYER_RENAMES.items():
            yield ours + our_name, get(hf + hf_name)
        for suffix in _qkv_suffixes(arch):
            q, k, v = (get(f"{hf}self_attn.{p}_proj.{suffix}") for p in "qkv")
            yield f"{ours}self_attention.linear_qkv.{suffix}", fuse_qkv(q, k, v,
                                                                       arch.num_kv_heads)
        yield f"{ours}mlp.linear_fc1.weight", torch.cat(
            [get(f"{hf}mlp.gate_proj.weight"), get(f"{hf}mlp.up_proj.weight")])
    for hf_name, our_name in GLOBAL_RENAMES.items():
        yield our_name, get(hf_name)
    if not arch.tie_embeddings:
        yield OUTPUT[1], pad_rows(get(OUTPUT[0]), padded_vocab_size)


def to_hf(get: Getter, arch: Architecture) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every tensor of the Hugging Face checkpoint, from our
    parameters (transformers' order: embedding, layers, norm, lm_head)."""
    yield EMBEDDING[0], get(EMBEDDING[1])[:arch.vocab_size]
    for i in range(arch.num_layers):
        hf, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        for suffix in _qkv_suffixes(arch):
            q, k, v = split_qkv(get(f"{ours}self_attention.linear_qkv.{suffix}"), arch)
            yield from ((f"{hf}self_attn.{p}_proj.{suffix}", t) for p, t in zip("qkv", (q, k, v)))
        for hf_name, our_name in LAYER_RENAMES.items():
            yield hf + hf_name, get(ours + our_name)
        gate, up = get(f"{ours}mlp.linear_fc1.weight").chunk(2)
        yield f"{hf}mlp.gate_proj.weight", gate.clone()  # own storage: safetensors refuses
        yield f"{hf}mlp.up_proj.weight", up.clone()      # tensors that share one
    for hf_name, our_name in GLOBAL_RENAMES.items():
        yield hf_name, get(our_name)
    if not arch.tie_embeddings:
        yield OUTPUT[0], get(OUTPUT[1])[:arch.vocab_size]


def check_hf_tensors(reader, arch: Architecture, where: str) -> None:
    """Refuse a checkpoint whose tensor names or shapes differ from what config.json describes
    (a tied model's redundant lm_head is accepted when it equals the embedding). ``reader``:
    keys(), shape_of(name), get(name)."""
    expected = hf_shapes(arch)
    available = reader.keys()
    extra = [n for n in available if n not in expected and not n.endswith(IGNORED_SUFFIXES)]
    if arch.tie_embeddings and OUTPUT[0] in extra:
        if not torch.equal(reader.get(OUTPUT[0]), reader.get(EMBEDDING[0])):
            raise ConversionError(f"{where}: tie_word_embeddings is true but lm_head.weight "
                                  "differs from the embedding; fix config.json")
        extra.remove(OUTPUT[0])
    missing = sorted(set(expected) - set(available))
    if missing:
        raise ConversionError(f"{where}: {len(missing)} tensors config.json needs are missing, "
                              f"e.g. {missing[0]}; the weights do not match config.json")
    if extra:
        raise ConversionError(f"{where}: {len(extra)} tensors config.json does not describe, "
                              f"e.g. {sorted(extra)[0]}; the weights do not match config.json")
    for name, shape in expected.items():
        if tuple(reader.shape_of(name)) != shape:
            raise ConversionError(
                f"{reader.file_of(name)}: {name} has shape {list(reader.shape_of(name))}, "
                f"config.json implies {list(shape)}; the weights do not match config.json")
