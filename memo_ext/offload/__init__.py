"""MEMO token-wise activation swapping + recomputation.

Public entry point: :class:`MemoOffload`. The trainer builds one per process from an
:class:`memo_ext.config.OffloadConfig`, asks it for the layer spec, and calls
:meth:`MemoOffload.after_iteration` after each training iteration (with ``--memo-alpha auto``
the first AUTO_ALPHA_MEASURING_ITERATIONS iterations run at alpha = 0 and measure what the LP
needs).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from memo_ext.config import MemoConfigError, OffloadConfig
from memo_ext.device import CopyEngine
from memo_ext.offload.alpha import (
    AlphaDecision,
    AlphaInputs,
    format_alpha_log,
    host_memory_shortfall,
    offloaded_layers,
    solve_alpha,
)
from memo_ext.offload.layer import LAYERS_KEPT_ON_DEVICE, MemoTransformerLayer
from memo_ext.offload.manager import OffloadManager

__all__ = ["AUTO_ALPHA_MEASURING_ITERATIONS", "ActivationShape", "MemoOffload", "MemoTransformerLayer"]

BYTES_PER_GB = 1e9

#: Iterations --memo-alpha auto runs at alpha 0 before solving the LP. The device headroom is
#: read after the second: the first iteration's peak is not yet the steady state (caches such as
#: the per-layer token indices are built during it, and the rounding buffers grow in place).
AUTO_ALPHA_MEASURING_ITERATIONS = 2


@dataclass(frozen=True)
class ActivationShape:
    """Per-rank shape of one layer's activations for one micro-batch.

    ``sequence_tokens`` is the sequence after context-parallel splitting; the layer input is
    further split over TP under sequence parallelism, the attention output is head-sharded.
    """

    sequence_tokens: int
    micro_batch_size: int
    hidden_size: int
    tensor_parallel_size: int
    sequence_parallel: bool
    element_bytes: int

    @property
    def input_bytes(self) -> int:
        tokens = self.sequence_tokens // (self.tensor_parallel_size if self.sequence_parallel else 1)
        return tokens * self.micro_batch_size * self.hidden_size * self.element_bytes

    @property
    def attention_output_bytes(self) -> int:
        """The out-projection input (offloaded whole) plus the core attention's own saved copy
        of its output, which our layer cannot share (see README, MEMO section)."""
        one = (self.sequence_tokens * self.micro_batch_size * self.hidden_size
               // self.tensor_parallel_size * self.element_bytes)
        return 2 * one


class MemoOffload:
    """MEMO for one model chunk: layer spec, offload manager, alpha."""

    def __init__(self, config: OffloadConfig, engine: CopyEngine, layers_per_stage: int,
                 microbatches_in_flight: int, shape: ActivationShape,
                 host_memory_bytes: int, bandwidth_bytes_per_s: float,
                 host_allocation_scope: Callable[[], ContextManager[None]] = nullcontext,
                 log: Callable[[str], None] = print,
                 agree_on_alpha: Callable[[float], float] = lambda alpha: alpha,
                 device_headroom: Optional[Callable[[], Optional[int]]] = None):
        config.validate()
        if layers_per_stage <= LAYERS_KEPT_ON_DEVICE:
            raise MemoConfigError(
                f"--memo-offload needs more than {LAYERS_KEPT_ON_DEVICE} layers per pipeline stage "
                f"(the last {LAYERS_KEPT_ON_DEVICE} stay on device), this stage has "
                f"{layers_per_stage}; raise --num-layers or lower --pipeline-model-parallel-size"
            )
        self.config = config
        self.layers_per_stage = layers_per_stage
        self.microbatches_in_flight = microbatches_in_flight
        self.shape = shape
        self.host_memory_bytes = host_memory_bytes
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.pinned_rounding = engine.device.type == "cuda"
        self.log = log
        # Ranks measure slightly different layer times; TP/SP collectives in the token-split
        # forward need every rank to use the same alpha (the trainer passes an all-reduce MIN).
        self.agree_on_alpha = agree_on_alpha
        # Reads the device bytes left unused at the peak so far (e.g. cuda_memory_headroom);
        # with --memo-alpha auto it is read once, after the alpha-0 measuring iteration, and
        # caps alpha so the larger rounding buffers still fit. None: no device row in the LP.
        self.device_headroom = device_headroom
        self.decision: Optional[AlphaDecision] = None
        self._check_host_memory_at_alpha_zero()
        fixed = config.fixed_alpha
        self.manager = OffloadManager(engine, 0.0 if fixed is None else fixed,
                                      host_allocation_scope)
        self._forward_seconds: list[float] = []
        self._measured_iterations = 0

    def _inputs(self, other_bytes: int, layer_forward_s: float,
                whole_bytes: Optional[int] = None,
                device_headroom_bytes: Optional[int] = None) -> AlphaInputs:
        """LP inputs; ``whole_bytes`` (measured bytes offloaded per layer at alpha 0) replaces
        the analytic S_in + S_attn when known, since it also counts attention statistics and,
        under CP, the gathered K/V the core attention saves."""
        attention_output_bytes = self.shape.attention_output_bytes
        if whole_bytes is not None:
            attention_output_bytes = max(0, whole_bytes - self.shape.input_bytes)
        return AlphaInputs(
            device_memory_bytes=self.config.device_memory_bytes,
            device_headroom_bytes=device_headroom_bytes,
            input_bytes=self.shape.input_bytes,
            attention_output_bytes=attention_output_bytes,
            other_bytes=other_bytes,
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            layer_forward_s=layer_forward_s,
            host_memory_bytes=self.host_memory_bytes,
            offloaded_layers=(offloaded_layers(self.layers_per_stage)
                              if self.microbatches_in_flight == 1 else self.layers_per_stage),
            microbatches_in_flight=self.microbatches_in_flight,
            pinned_rounding=self.pinned_rounding,
        )

    def _check_host_memory_at_alpha_zero(self) -> None:
        missing = host_memory_shortfall(self._inputs(other_bytes=0, layer_forward_s=0.0))
        if missing:
            raise MemoConfigError(
                f"--memo-offload: host memory is {missing / BYTES_PER_GB:.2f} GB short even at "
                f"alpha=0 ({self.host_memory_bytes / BYTES_PER_GB:.2f} GB per rank available); "
                "raise --memo-host-memory-gb, add nodes, or shorten --seq-length"
            )

    def layer_spec(self, base: ModuleSpec) -> ModuleSpec:
        """``base`` (a megatron.core GPT layer spec) with MEMO's layer class."""
        return ModuleSpec(
            module=MemoTransformerLayer,
            params={**(base.params or {}), "memo": self},
            submodules=base.submodules,
        )

    @property
    def alpha(self) -> float:
        return self.manager.alpha

    @contextmanager
    def layer_timer(self):
        """Times an offloaded layer's forward while --memo-alpha auto is still measuring
        (device-synchronised on CUDA, so the time is compute, not launch)."""
        measuring = self.config.fixed_alpha is None and self.decision is None
        if measuring and torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if measuring:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._forward_seconds.append(time.perf_counter() - start)

    def after_iteration(self) -> None:
        """With --memo-alpha auto, solve the LP once AUTO_ALPHA_MEASURING_ITERATIONS
        iterations have measured it (between iterations: it may resize the rounding buffers)."""
        if self.config.fixed_alpha is not None or self.decision is not None:
            return
        counts = self.manager.layer_forwards
        if not counts or not self._forward_seconds:
            return
        self._measured_iterations += 1
        if self._measured_iterations < AUTO_ALPHA_MEASURING_ITERATIONS:
            return
        other_bytes = self.manager.saved_bytes["recomputed"] // counts
        layer_forward_s = sorted(self._forward_seconds)[len(self._forward_seconds) // 2]
        whole_bytes = self.manager.largest_layer_bytes
        headroom = None
        if self.config.device_memory_bytes is None and self.device_headroom is not None:
            # set_alpha pads each buffer by up to one alignment per stored tensor.
            headroom = self.device_headroom() - 2 * self.manager.buffer_padding_bytes
        inputs = self._inputs(other_bytes, layer_forward_s, whole_bytes, headroom)
        self.decision = solve_alpha(inputs)
        self.manager.set_alpha(self.agree_on_alpha(self.decision.alpha), other_bytes)
        self.log(f"> MEMO alpha: {format_alpha_log(inputs, self.decision)}; "
                 f"alpha used by all ranks: {self.alpha:.4f}")
