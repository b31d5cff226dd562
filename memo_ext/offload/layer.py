"""MemoTransformerLayer: megatron.core's TransformerLayer with MEMO's token-wise swap and
recompute in training forward.

The layer is built from the same submodules as megatron.core's GPT layer spec (norms, QKV and
output projections, core attention, MLP, bias-dropout-add); only the forward is reorganised.
A layer the solver puts in checkpoint mode (memo_ext.offload.modes, mode (b)) runs
megatron-core's forward unchanged inside one drop region instead; when every offloaded layer
does, so do the two layers kept on device (their input stays in its rounding buffer).
Every operation before and after core attention is position-wise, so the layer runs them
separately on the *kept* tokens (their saved activations go to host memory through the
rounding buffer) and on the *dropped* tokens (a drop region: what it saves is discarded and
recomputed from the offloaded layer input and attention output before backward). Core
attention runs once over all tokens and is never recomputed. See memo_ext/offload/manager.py
for where each saved tensor goes.

Under sequence parallelism each part's column-parallel projections all-gather only that part's
tokens, so the token-wise recompute gathers exactly the tokens it needs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)

from memo_ext.config import MemoConfigError
from memo_ext.offload.tokens import TokenSplit

if TYPE_CHECKING:
    from memo_ext.offload import MemoOffload


class MemoTransformerLayer(TransformerLayer):
    """TransformerLayer whose training forward routes saved activations through MEMO."""

    def __init__(self, config, submodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, pg_collection=None,
                 vp_stage: Optional[int] = None, memo: Optional["MemoOffload"] = None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection,
                         vp_stage=vp_stage)
        if memo is None:
            raise ValueError("MemoTransformerLayer needs the MemoOffload runtime (spec params)")
        self._check_supported()
        self.memo = memo
        stage_offset = get_transformer_layer_offset(config, vp_stage)
        self.stage_layer_index = self.layer_number - 1 - stage_offset
        # The last layers of a stage start their backward right after their forward: nothing
        # to gain from moving their activations, so one per rounding buffer stays in it. With
        # several micro-batches in flight (1F1B), the next micro-batch's forward reuses the
        # buffers before this one's backward, so every layer goes to host.
        self.offloaded = (
            self.stage_layer_index < memo.layers_per_stage - memo.config.layers_kept_on_device
            or memo.microbatches_in_flight > 1
        )

    def _check_supported(self) -> None:
        problems = []
        if not isinstance(self.self_attention, SelfAttention):
            problems.append(f"self-attention {type(self.self_attention).__name__}")
        if not isinstance(self.cross_attention, IdentityOp):
            problems.append("cross-attention")
        if not isinstance(self.mlp, MLP):
            problems.append(f"MLP {type(self.mlp).__name__} (MoE is not supported)")
        if self.config.recompute_granularity is not None:
            problems.append(f"--recompute-granularity {self.config.recompute_granularity}")
        if problems:
            raise MemoConfigError(
                "--memo-offload supports dense GPT layers (SelfAttention + MLP) without Megatron "
                f"recompute; this model has {', '.join(problems)}: drop --memo-offload or those "
                "options"
            )

    def forward(self, *args, **kwargs):
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        use_memo = (
            self.training
            and torch.is_grad_enabled()
            and kwargs.get("inference_context") is None
        )
        if not use_memo:
            return super().forward(*args, **kwargs)
        is_first = self.stage_layer_index == 0
        attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        # Packed documents (megatron.training.packed_documents) reach the core attention only.
        documents = kwargs.get("packed_seq_params")
        if self.stage_layer_index in self.memo.checkpoint_layer_indices:
            output = self._checkpoint_forward(hidden_states, attention_mask,
                                              kwargs.get("rotary_pos_emb"), is_first, documents)
        else:
            output = self._memo_forward(hidden_states, attention_mask,
                                        kwargs.get("rotary_pos_emb"), is_first, documents)
        return output, None

    def _whole_layer(self, hidden_states, attention_mask, rotary_pos_emb, documents=None):
        # megatron-core's own forward: a checkpoint-offloaded layer recomputes exactly it.
        return super().forward(hidden_states, attention_mask=attention_mask,
                               rotary_pos_emb=rotary_pos_emb, packed_seq_params=documents)[0]

    def _checkpoint_forward(self, hidden_states, attention_mask, rotary_pos_emb, is_first,
                            documents):
        """Mode (b): only the layer input goes to host; the whole layer, core attention
        included, is one drop region recomputed from it before the layer's backward."""
        manager = self.memo.manager
        record = manager.begin_layer(self.stage_layer_index, is_first, list(self.parameters()),
                                     to_host=self.offloaded, checkpoint=True)
        with self.memo.layer_timer(), manager.hooks(record):
            manager.register_whole(record, hidden_states)
            _, output = manager.run_drop_region(
                record, functools.partial(self._whole_layer, documents=documents),
                [hidden_states, attention_mask, rotary_pos_emb],
                small_inputs=[False, True, True], keep_outputs=False)
        manager.end_layer(record, hidden_states, output)
        return output

    # The two position-wise halves of the layer, run on a subset of tokens.
    def _attention_inputs(self, hidden_states, rotary_pos_emb, token_indices):
        normed = self.input_layernorm(hidden_states)
        query, key, value = self.self_attention.get_query_key_value_tensors(normed, None)
        if rotary_pos_emb is not None:
            # Sliced here, not by the caller: a drop region then keeps only the shared table
            # and an index vector, not a per-layer copy of its tokens' frequencies.
            rotary_freqs = rotary_pos_emb[token_indices]
            # YaRN's attention temperature, on q and k as megatron's SelfAttention applies it.
            mscale = _yarn_get_concentration_factor_from_config(self.config)
            query = apply_rotary_pos_emb(query, rotary_freqs, config=self.config, mscale=mscale)
            key = apply_rotary_pos_emb(key, rotary_freqs, config=self.config, mscale=mscale)
        return query, key, value

    def _attention_output_and_mlp(self, attention_output, residual):
        projected = self.self_attention.linear_proj(attention_output)
        with self.bias_dropout_add_exec_handler():
            hidden = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                projected, residual, self.hidden_dropout
            )
        mlp_output = self.mlp(self.pre_mlp_layernorm(hidden))
        with self.bias_dropout_add_exec_handler():
            return self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
                mlp_output, hidden, self.hidden_dropout
            )

    def _memo_forward(self, hidden_states, attention_mask, rotary_pos_emb, is_first, documents):
        manager = self.memo.manager
        chunks = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        split = TokenSplit.from_alpha(manager.alpha, hidden_states.size(0), chunks)
        record = manager.begin_layer(self.stage_layer_index, is_first, list(self.parameters()),
                                     to_host=self.offloaded)
        kept_rows = chunks * split.kept
        with self.memo.layer_timer(), manager.hooks(record):
            manager.register_whole(record, hidden_states)
            input_kept, input_dropped = _token_parts(hidden_states, split.kept)
            device = hidden_states.device
            indices = {part: split.natural_indices(part).to(device) for part in ("kept", "dropped")}
            qkv_kept = (self._attention_inputs(input_kept, rotary_pos_emb, indices["kept"])
                        if split.kept else None)
            region_a, qkv_dropped = None, None
            if split.dropped:
                region_a, qkv_dropped = manager.run_drop_region(
                    record, self._attention_inputs,
                    [input_dropped, rotary_pos_emb, indices["dropped"]],
                    small_inputs=[False, True, True],
                )
            merged = []
            for index in range(3):
                kept = qkv_kept[index] if qkv_kept else None
                dropped = qkv_dropped[index] if qkv_dropped else None
                tensor = split.merge(kept, dropped)
                manager.register_merged(record, tensor, split, kept, region_a, index)
                merged.append(tensor)
            # The parts may be views of the fused QKV output (v always is): holding them would
            # keep that whole output alive through the rest of the layer.
            del qkv_kept, qkv_dropped, kept, dropped

            core_output = self.self_attention.core_attention(
                *merged, attention_mask, attn_mask_type=self.self_attention.attn_mask_type,
                packed_seq_params=documents,
            )
            # q, k and v are saved by now (offloaded or to be recomputed): held here, they
            # would stay on device through the MLP.
            manager.forget(record, merged)
            del merged, tensor
            attention_output = split.split(core_output)
            del core_output
            manager.register_whole(record, attention_output)
            output_kept, output_dropped = _token_parts(attention_output, kept_rows)

            outputs = []
            if split.kept:
                outputs.append(self._attention_output_and_mlp(output_kept, input_kept))
            if split.dropped:
                # Its output is the layer's (part of it), which backward never reads.
                _, output_dropped = manager.run_drop_region(
                    record, self._attention_output_and_mlp,
                    [output_dropped, input_dropped], small_inputs=[False, False],
                    keep_outputs=False,
                )
                outputs.append(output_dropped)
            output = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        manager.end_layer(record, hidden_states, output)
        return output


def _token_parts(tensor: torch.Tensor, kept_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first ``kept_rows`` rows, the rest). A part that is the whole tensor is the tensor, not
    a slice of it: a slice's backward would allocate a zero gradient of the whole tensor and
    copy into it (one more layer input on device at the backward's peak)."""
    rows = tensor.size(0)
    if kept_rows == 0:
        return tensor[:0], tensor
    if kept_rows == rows:
        return tensor, tensor[rows:]
    return tensor[:kept_rows], tensor[kept_rows:]
