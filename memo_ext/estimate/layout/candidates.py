"""Candidate layouts: every (TP, CP, PP, DP, policy, alpha, micro-batch, ...) for a number of
GPUs, less those that cannot run (shapes that do not divide, persistent state over the device)
before any tracing."""

from __future__ import annotations

import itertools
import math
from typing import Optional

from memo_ext.head_chunks import head_chunks_split
from memo_ext.estimate.layout.spec import (
    BLOCK_RECOMPUTE_FRACTIONS,
    CHECKPOINT_FRACTIONS,
    Layout,
    Stage,
)
from memo_ext.estimate.rank_constants import (  # shared with SPPO's rows
    OPTIMIZER_BYTES_PER_PARAM,
    WEIGHT_AND_GRAD_BYTES_PER_PARAM,
)
from memo_ext.offload.alpha import offloaded_layers

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def block_recompute_layers(layers_per_stage: int,
                           fractions=BLOCK_RECOMPUTE_FRACTIONS) -> list[int]:
    """Layers per stage block recompute tries: each fraction of the stage's layers, rounded,
    between 1 and all but one (all is full recompute, none is no recompute)."""
    return sorted({min(layers_per_stage - 1, max(1, round(f * layers_per_stage)))
                   for f in fractions}) if layers_per_stage > 1 else []


#: Head chunks of a tiled layout: at most this many (with the ring's messages 1/8 of a layer's
#: K/V, the ring buffers stop mattering beside the saved q, k, v and output).
MAX_HEAD_CHUNKS = 8


def head_chunks_of(heads: int, groups: int, cp: int) -> int:
    """The head chunks a tiled layout runs a rank's ``heads`` query heads in ``groups`` groups
    in: at most MAX_HEAD_CHUNKS whole groups, or, without a ring (CP = 1), parts of groups
    when that makes more chunks (GQA at high TP: Llama-3-8B at TP=4 has 2 groups of 4 heads).
    Not parts of groups over a ring: a shared group's K/V would travel it once per chunk."""
    whole = math.gcd(groups, MAX_HEAD_CHUNKS)
    parts = math.gcd(heads, MAX_HEAD_CHUNKS)
    if cp == 1 and parts > whole and head_chunks_split(heads, groups, parts):
        return parts
    return whole


def checkpoint_layer_counts(layers_per_stage: int, fractions=CHECKPOINT_FRACTIONS,
                            offload_buffers: int = 2) -> list[int]:
    """Checkpoint-offloaded layers per stage the recommender tries: each fraction of the
    stage's offloaded layers (all but the one kept on device per buffer), rounded."""
    offloaded = offloaded_layers(layers_per_stage, offload_buffers)
    return sorted({round(f * offloaded) for f in fractions})


def candidate_layouts(model: dict, gpus: int, hardware: dict, *, policies: list[str],
                      alphas: list[float], micro_batches: list[int], global_batch: int,
                      pipeline_sizes: Optional[list[int]] = None,
                      block_fractions=BLOCK_RECOMPUTE_FRACTIONS,
                      checkpoint_fractions=CHECKPOINT_FRACTIONS,
                      offload_fp8: tuple[bool, ...] = (False,),
                      mlp_tiles: tuple[int, ...] = (0,),
                      offload_buffers: tuple[int, ...] = (2,),
                      optimizer_offloads: tuple[Optional[float], ...] = (None,),
                      tile_norms: bool = False
                      ) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """(layouts worth tracing, [(layout, why it was dropped)]) for ``gpus`` GPUs.
    ``optimizer_offloads``: the --optimizer-offload-fraction of each variant (None: the
    optimizer on the device, no --optimizer-cpu-offload). ``tile_norms``: every tiled layout
    runs its norms in the tiles (--memo-tile-norms, the user's choice for the whole search).

    ``model``: num_layers, hidden_size, num_attention_heads, num_query_groups (optional),
    parameters. TP stays within a node (megatron's advice: its collectives sit on the critical
    path)."""
    from memo_ext.estimate.flops import parameter_count

    per_node = int(hardware["gpus_per_node"])
    device = int(hardware["device_memory_bytes"])
    params = parameter_count(model)
    heads = model["num_attention_heads"]
    groups = model.get("num_query_groups") or heads
    kept, dropped = [], []
    for tp in _divisors(gpus):
        for cp in _divisors(gpus // tp):
            for pp in _divisors(gpus // (tp * cp)):
                if pipeline_sizes is not None and pp not in pipeline_sizes:
                    continue
                dp = gpus // (tp * cp * pp)
                blocks = block_recompute_layers(model["num_layers"] // pp, block_fractions)
                for policy in policies:
                    variants = ([(alpha, None, count, fp8, buffers) for alpha in alphas
                                 for buffers in offload_buffers
                                 for count in checkpoint_layer_counts(
                                     model["num_layers"] // pp, checkpoint_fractions, buffers)
                                 for fp8 in offload_fp8]
                                if policy == "memo" else
                                [(None, k, 0, False, 2) for k in blocks]
                                if policy == "megatron-block" else [(None, None, 0, False, 2)])
                    for (alpha, recompute_layers, count, fp8, buffers), tiles, micro_batch, \
                            optimizer_offload in itertools.product(
                                variants, mlp_tiles, micro_batches, optimizer_offloads):
                        # A tiled layout tiles the whole layer: the MLP, the attention's
                        # projections, and the core attention by head chunks.
                        chunks = head_chunks_of(heads // tp, groups // tp, cp) if tiles else 1
                        layout = Layout(tp, cp, pp, dp, policy, alpha, micro_batch,
                                        recompute_layers, count, fp8, tiles,
                                        projection_tiles=tiles, head_chunks=chunks,
                                        offload_buffers=buffers,
                                        optimizer_offload=optimizer_offload,
                                        tile_norms=tile_norms and tiles > 0)
                        # alpha splits the (a) layers' tensors: with none, one alpha is traced
                        if policy == "memo" and pp == 1 and alpha != alphas[0] and \
                                layout.every_layer_checkpointed(model["num_layers"],
                                                                Stage(0, 0, 1)):
                            continue
                        reason = _infeasible(layout, model, heads, groups, per_node,
                                             params, device, global_batch)
                        (dropped.append((layout, reason)) if reason else kept.append(layout))
    return kept, dropped


def _infeasible(layout: Layout, model: dict, heads: int, groups: int, per_node: int,
                params: int, device: int, global_batch: int) -> Optional[str]:
    if layout.tp > per_node:
        return f"TP {layout.tp} spans nodes of {per_node} GPUs"
    if heads % layout.tp or groups % layout.tp:
        return f"{heads} heads ({groups} groups) do not divide by TP {layout.tp}"
    layers_per_stage, remainder = divmod(model["num_layers"], layout.pp)
    if remainder:
        return f"{model['num_layers']} layers do not divide by PP {layout.pp}"
    if layout.policy == "memo" and layers_per_stage <= layout.offload_buffers:
        return f"MEMO offload needs more than {layout.offload_buffers} layers per stage"
    if global_batch % (layout.dp * layout.micro_batch):
        return f"global batch {global_batch} does not divide by DP x micro-batch"
    shard = params / (layout.tp * layout.pp)
    # megatron's distributed optimizer shards over the data-parallel group with the context-
    # parallel ranks in it (CP ranks hold the same weights)
    persistent = shard * WEIGHT_AND_GRAD_BYTES_PER_PARAM + shard * OPTIMIZER_BYTES_PER_PARAM \
        * (1 - (layout.optimizer_offload or 0)) / (layout.dp * layout.cp)
    if persistent >= device:
        return (f"weights, gradients and optimizer state alone need {persistent / 2**30:.0f} "
                f"GiB per rank")
    return None
