"""Which offloaded layers of a stage are checkpoint-offloaded, and MEMO's alpha for the rest.

Two ways to offload a layer (docs/memo_offload_modes.md):

(a) MEMO: the layer input and the attention output go to host whole, the first alpha of the
    tokens of every other saved tensor too; the rest is recomputed before the layer's backward.
    Host bytes per slot ``S_in + S_attn + alpha*S_oth``; recomputation ``(1 - alpha)`` of the
    position-wise part of the layer's forward (core attention is never recomputed).
(b) checkpoint offload: the layer input alone goes to host; the whole layer, attention included,
    is recomputed. Host bytes per slot ``S_in``; recomputation one whole layer forward.

At long sequences a 2 TB node cannot hold (a) for every layer (at alpha 0 a 7B model needs
``3 s h`` bytes per layer, bf16), so some layers take (b). The solver extends MEMO's alpha LP
with ``c``, the number of (b) layers among a stage's ``N`` offloaded layers::

    min  c * 1 + (N - c) * (1 - alpha) * f            # recomputed layer forwards per micro-batch
    s.t. k * (c * cost(S_in) + (N - c) * cost(S_in + S_attn + alpha*S_oth)) <= M_host
         the bandwidth and device rows of the alpha LP for the (a) layers (memo_ext.offload.alpha)

with ``f`` the position-wise share of a layer's forward FLOPs (the part (a) recomputes) and
``cost`` a slot's host bytes (whole pages on CUDA, memo_ext.offload.alpha). For a fixed ``c`` this is the alpha LP with the host budget less
the (b) slots, solved in closed form (:func:`memo_ext.offload.alpha.solve_alpha`); ``c`` has at
most a few dozen values, so every one is solved and the cheapest kept (ties: fewer (b) layers).
Which layers take (b) does not change the cost; they are spread evenly over the stage
(:func:`checkpoint_layer_indices`), so that the D2H queue, which (b) layers load less, catches
up between the (a) layers' copies.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from memo_ext.host_pages import page_locked_bytes
from memo_ext.offload.alpha import (
    AlphaDecision,
    AlphaInputs,
    solve_alpha,
)


@dataclass(frozen=True)
class LayerModes:
    """The solver's answer for one stage.

    Attributes:
        checkpoint_layers: c, offloaded layers in checkpoint mode (b).
        alpha: MEMO's decision for the other ``N - c`` offloaded layers (a).
        recomputed_layer_forwards: the objective, layer forwards recomputed per micro-batch.
        host_bytes_needed: the stage's host arena for this rank, both kinds of slots.
    """

    checkpoint_layers: int
    alpha: AlphaDecision
    recomputed_layer_forwards: float
    host_bytes_needed: int


def checkpoint_layer_indices(offloaded_layers: int, count: int) -> frozenset[int]:
    """The stage-layer indices (of ``0 .. offloaded_layers - 1``) that take mode (b): ``count``
    of them, evenly spread (the middle of each of ``count`` equal runs)."""
    if not 0 <= count <= offloaded_layers:
        raise ValueError(f"count must be in [0, {offloaded_layers}], got {count}")
    return frozenset((2 * j + 1) * offloaded_layers // (2 * count) for j in range(count))


def checkpoint_slot_cost(inputs: AlphaInputs, checkpoint_input_bytes: int) -> int:
    """Host bytes of one (b) slot (the layer input, page-locked as (a) slots are)."""
    return (page_locked_bytes(checkpoint_input_bytes) if inputs.page_locked
            else checkpoint_input_bytes)


def with_checkpoint_layers(inputs: AlphaInputs, count: int,
                           checkpoint_input_bytes: int) -> AlphaInputs:
    """The alpha LP of the (a) layers when ``count`` layers take (b): fewer offloaded layers,
    the host budget less the (b) slots (0 when they alone overdraw it)."""
    if not 0 <= count <= inputs.offloaded_layers:
        raise ValueError(f"checkpoint layers must be in [0, {inputs.offloaded_layers}], "
                         f"got {count}")
    reserved = count * inputs.microbatches_in_flight * checkpoint_slot_cost(
        inputs, checkpoint_input_bytes)
    return dataclasses.replace(inputs, offloaded_layers=inputs.offloaded_layers - count,
                               host_memory_bytes=max(0, inputs.host_memory_bytes - reserved))


def host_bytes_needed(inputs: AlphaInputs, count: int, checkpoint_input_bytes: int,
                      alpha: float) -> int:
    """The rank's host arena with ``count`` (b) layers and the others at ``alpha``."""
    return (count * inputs.microbatches_in_flight
            * checkpoint_slot_cost(inputs, checkpoint_input_bytes)
            + (inputs.offloaded_layers - count) * inputs.microbatches_in_flight
            * inputs.slot_cost_bytes(alpha))


def fewest_checkpoint_layers(inputs: AlphaInputs, checkpoint_input_bytes: int,
                             alpha: float = 0.0) -> Optional[int]:
    """The fewest (b) layers with which the host arena fits at ``alpha`` (None: not even with
    every offloaded layer in (b))."""
    for count in range(inputs.offloaded_layers + 1):
        if host_bytes_needed(inputs, count, checkpoint_input_bytes, alpha) \
                <= inputs.host_memory_bytes:
            return count
    return None


def solve_layer_modes(inputs: AlphaInputs, checkpoint_input_bytes: int,
                      position_wise_share: float, fixed_count: Optional[int] = None,
                      fixed_alpha: Optional[float] = None) -> LayerModes:
    """The (c, alpha) of least recomputation whose host arena fits (module docstring).

    ``inputs``: the alpha LP with every offloaded layer in (a); ``checkpoint_input_bytes``: the
    bytes one (b) slot stores (the layer input, compressed when offloaded in fp8);
    ``position_wise_share``: f in [0, 1]. ``fixed_count`` / ``fixed_alpha`` pin either (the
    other is then chosen). When nothing fits, the answer is the most (b) layers allowed at
    alpha 0 (or ``fixed_alpha``), and :attr:`LayerModes.host_bytes_needed` exceeds the budget.
    """
    if not 0.0 <= position_wise_share <= 1.0:
        raise ValueError(f"position_wise_share must be in [0, 1], got {position_wise_share}")
    layers = inputs.offloaded_layers
    counts = range(layers + 1) if fixed_count is None else [fixed_count]
    best: Optional[LayerModes] = None
    for count in counts:
        decision = solve_alpha(with_checkpoint_layers(inputs, count, checkpoint_input_bytes))
        alpha = decision.alpha if fixed_alpha is None else fixed_alpha
        needed = host_bytes_needed(inputs, count, checkpoint_input_bytes, alpha)
        modes = LayerModes(count, dataclasses.replace(decision, alpha=alpha),
                           count + (layers - count) * (1.0 - alpha) * position_wise_share,
                           needed)
        if needed > inputs.host_memory_bytes:
            best = best or (modes if count == counts[-1] else None)
            continue
        if best is None or best.host_bytes_needed > inputs.host_memory_bytes \
                or modes.recomputed_layer_forwards < best.recomputed_layer_forwards - 1e-12:
            best = modes
    return best


def position_wise_share(linear_flops_per_token: float, attention_flops_per_key: float,
                        tokens: int) -> float:
    """f: the share of a causal layer forward over ``tokens`` tokens that is not core
    attention (``linear*s / (linear*s + attention*s^2/2)``)."""
    linear = linear_flops_per_token * tokens
    total = linear + attention_flops_per_key / 2.0 * tokens * tokens
    return linear / total if total > 0 else 1.0


__all__ = ["LayerModes", "checkpoint_layer_indices", "fewest_checkpoint_layers",
           "position_wise_share", "solve_layer_modes", "with_checkpoint_layers"]
