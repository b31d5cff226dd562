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
from memo_ext.layer_flops import LayerFlops
from memo_ext.offload.alpha import (
    AlphaDecision,
    AlphaInputs,
    format_alpha_log,
    offloaded_layers,
    solve_alpha,
)
from memo_ext.offload import fp8
from memo_ext.offload.layer import MemoTransformerLayer
from memo_ext.offload.manager import BUFFER_ALIGNMENT_BYTES, OffloadManager
from memo_ext.offload.modes import (
    LayerModes,
    checkpoint_layer_indices,
    fewest_checkpoint_layers,
    host_bytes_needed,
    position_wise_share,
    solve_layer_modes,
    with_checkpoint_layers,
)

__all__ = ["AUTO_ALPHA_MEASURING_ITERATIONS", "ActivationShape", "LayerModes", "MemoOffload",
           "MemoTransformerLayer"]

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
    offload_fp8: bool = False  # --memo-offload-fp8: tensors offloaded whole stored as fp8
    num_attention_heads: int = 0  # 0: leave the attention statistics out of S_attn

    #: Bytes per value of the core attention's log-sum-exp (fp32 whatever the model's dtype).
    STATISTICS_BYTES = 4

    @classmethod
    def of_trainer(cls, args) -> "ActivationShape":
        """The shape of a validated trainer argument namespace (pretrain_gpt.py's flags)."""
        return cls(sequence_tokens=args.seq_length // args.context_parallel_size,
                   micro_batch_size=args.micro_batch_size, hidden_size=args.hidden_size,
                   tensor_parallel_size=args.tensor_model_parallel_size,
                   sequence_parallel=bool(args.sequence_parallel),
                   element_bytes=torch.tensor([], dtype=args.params_dtype).element_size(),
                   offload_fp8=bool(getattr(args, "memo_offload_fp8", False)),
                   num_attention_heads=args.num_attention_heads)

    def _stored(self, values: int, whole: bool = True, element_bytes: Optional[int] = None) -> int:
        """Rounding-buffer bytes of a tensor of ``values`` values (aligned as stored)."""
        nbytes = (fp8.stored_bytes(values) if whole and self.offload_fp8
                  else values * (element_bytes or self.element_bytes))
        return -(-nbytes // BUFFER_ALIGNMENT_BYTES) * BUFFER_ALIGNMENT_BYTES

    @property
    def input_bytes(self) -> int:
        tokens = self.sequence_tokens // (self.tensor_parallel_size if self.sequence_parallel else 1)
        return self._stored(tokens * self.micro_batch_size * self.hidden_size)

    @property
    def _attention_output_values(self) -> int:
        return self.sequence_tokens * self.micro_batch_size * self.hidden_size \
            // self.tensor_parallel_size

    @property
    def attention_output_bytes(self) -> int:
        """S_attn: the core attention's output as it saves it (stored as saved, never fp8),
        which is also the out-projection input the layer offloads whole (one copy: see
        :attr:`interior_extra_bytes`), and its log-sum-exp per head and token (fp32)."""
        statistics = (self.micro_batch_size * self.num_attention_heads
                      // self.tensor_parallel_size * self.sequence_tokens)
        return (self._stored(self._attention_output_values, whole=False)
                + (self._stored(statistics, whole=False, element_bytes=self.STATISTICS_BYTES)
                   if statistics else 0))

    @property
    def interior_extra_bytes(self) -> int:
        """Bytes a layer stores on top at 0 < alpha < 1 under sequence parallelism with TP > 1:
        the attention output again, in the kept/dropped order its two parts run in
        (memo_ext.offload.tokens.TokenSplit.split), offloaded whole."""
        if self.tensor_parallel_size == 1 or not self.sequence_parallel:
            return 0
        return self._stored(self._attention_output_values)


def position_wise_share_of(args) -> float:
    """f of memo_ext.offload.modes for a trainer argument namespace: the share of one layer's
    forward FLOPs over the whole sequence that is not core attention."""
    flops = LayerFlops.of_gpt_layer(args.hidden_size, args.ffn_hidden_size,
                                    args.num_attention_heads, args.num_query_groups,
                                    args.kv_channels, args.swiglu)
    return position_wise_share(flops.linear, flops.attention_per_key, args.seq_length)


class MemoOffload:
    """MEMO for one model chunk: layer spec, offload manager, alpha, and which offloaded layers
    are checkpoint-offloaded (memo_ext.offload.modes)."""

    def __init__(self, config: OffloadConfig, engine: CopyEngine, layers_per_stage: int,
                 microbatches_in_flight: int, shape: ActivationShape,
                 host_memory_bytes: int, bandwidth_bytes_per_s: float,
                 host_allocation_scope: Callable[[], ContextManager[None]] = nullcontext,
                 log: Callable[[str], None] = print,
                 agree_on_alpha: Callable[[float], float] = lambda alpha: alpha,
                 device_headroom: Optional[Callable[[], Optional[int]]] = None, *,
                 position_wise_share: float):
        config.validate()
        kept = config.layers_kept_on_device
        if layers_per_stage <= kept:
            raise MemoConfigError(
                f"--memo-offload needs more than {kept} layers per pipeline stage "
                f"(the last {kept} stay on device), this stage has "
                f"{layers_per_stage}; raise --num-layers or lower --pipeline-model-parallel-size"
            )
        self.config = config
        self.layers_per_stage = layers_per_stage
        self.microbatches_in_flight = microbatches_in_flight
        self.shape = shape
        self.host_memory_bytes = host_memory_bytes
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.page_locked = engine.device.type == "cuda"  # CopyEngine.alloc_host's slots
        self.log = log
        # Ranks measure slightly different layer times; TP/SP collectives in the token-split
        # forward need every rank to use the same alpha (the trainer passes an all-reduce MIN),
        # and the same checkpoint layers (their recomputation runs the layer's collectives).
        self.agree_on_alpha = agree_on_alpha
        # Reads the device bytes left unused at the peak so far (e.g. cuda_memory_headroom);
        # with --memo-alpha auto it is read once, after the alpha-0 measuring iteration, and
        # caps alpha so the larger rounding buffers still fit. None: no device row in the LP.
        self.device_headroom = device_headroom
        # f of memo_ext.offload.modes: the share of a layer's forward MEMO's alpha part
        # recomputes (position_wise_share_of(args) for the trainer's model).
        self.position_wise_share = position_wise_share
        self.decision: Optional[AlphaDecision] = None
        self.modes: Optional[LayerModes] = None
        self.checkpoint_layers = self._initial_checkpoint_layers()
        fixed = config.fixed_alpha
        self.manager = OffloadManager(engine, 0.0 if fixed is None else fixed,
                                      host_allocation_scope, compress_whole=shape.offload_fp8,
                                      buffers=config.offload_buffers)
        self._forward_seconds: list[float] = []
        self._measured_iterations = 0

    @property
    def offloaded_layer_count(self) -> int:
        """N: layers of this stage whose activations go to host."""
        return (offloaded_layers(self.layers_per_stage, self.config.layers_kept_on_device)
                if self.microbatches_in_flight == 1
                else self.layers_per_stage)

    @property
    def checkpoint_layer_indices(self) -> frozenset[int]:
        """Stage-layer indices in checkpoint mode (b): the chosen offloaded layers and, when
        every offloaded layer takes (b), the layers kept on device too: then no layer needs
        MEMO's larger (a) buffers, and the two rounding buffers shrink to one layer input."""
        offloaded = self.offloaded_layer_count
        if offloaded and self.checkpoint_layers == offloaded:
            return frozenset(range(self.layers_per_stage))
        return checkpoint_layer_indices(offloaded, self.checkpoint_layers)

    def _inputs(self, other_bytes: int, layer_forward_s: float,
                whole_bytes: Optional[int] = None,
                device_headroom_bytes: Optional[int] = None) -> AlphaInputs:
        """LP inputs; ``whole_bytes`` (measured bytes offloaded per layer at alpha 0) replaces
        the analytic S_in + S_attn when known (the same tensors, as the layer stored them)."""
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
            offloaded_layers=self.offloaded_layer_count,
            microbatches_in_flight=self.microbatches_in_flight,
            page_locked=self.page_locked,
            interior_extra_bytes=self.shape.interior_extra_bytes,
            rounding_buffers=self.config.offload_buffers,
        )

    def _initial_checkpoint_layers(self) -> int:
        """--memo-checkpoint-layers N, or with auto the fewest that let alpha 0's arena (the
        measuring iterations', or a fixed alpha's before S_oth is known) fit host memory."""
        inputs = self._inputs(other_bytes=0, layer_forward_s=0.0)
        layers = inputs.offloaded_layers
        fixed = self.config.fixed_checkpoint_layers
        if fixed is not None and fixed > layers:
            raise MemoConfigError(
                f"--memo-checkpoint-layers {fixed} exceeds the {layers} offloaded layers of this "
                "pipeline stage; give at most that many, or auto")
        count = fixed if fixed is not None else fewest_checkpoint_layers(
            inputs, self.shape.input_bytes)
        needed = host_bytes_needed(inputs, layers if count is None else count,
                                   self.shape.input_bytes, 0.0)
        if needed > self.host_memory_bytes:
            what = (f"with {count} checkpoint layers" if fixed is not None
                    else f"even with all {layers} offloaded layers checkpointed")
            raise MemoConfigError(
                f"--memo-offload: host memory is {(needed - self.host_memory_bytes) / BYTES_PER_GB:.2f} "
                f"GB short {what} at alpha=0 ({self.host_memory_bytes / BYTES_PER_GB:.2f} GB per rank "
                "available); raise --memo-host-memory-gb, add nodes, use --memo-offload-fp8, or "
                "shorten --seq-length")
        return count

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

    def describe_modes(self) -> str:
        """The offloaded layers' modes, for the startup log."""
        count, layers = self.checkpoint_layers, self.offloaded_layer_count
        indices = ",".join(str(i) for i in sorted(self.checkpoint_layer_indices)) or "none"
        if layers and count == layers:
            indices += ", with the layers kept on device"
        return (f"{layers - count} of {layers} offloaded layers MEMO, {count} checkpoint-offloaded "
                f"(stage layers {indices}){' | offload in fp8 (lossy)' if self.shape.offload_fp8 else ''}")

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

    def abandon_forward(self) -> None:
        """End a micro-batch whose forward ran and whose backward will not: its host slots go
        back to the pool and its buffers are left as a whole iteration leaves them
        (OffloadManager.abandon_forward)."""
        self.manager.abandon_forward()

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
            headroom = (self.device_headroom()
                        - len(self.manager.buffers) * self.manager.buffer_padding_bytes)
        inputs = self._inputs(other_bytes, layer_forward_s, whole_bytes, headroom)
        modes = solve_layer_modes(inputs, self.shape.input_bytes, self.position_wise_share,
                                  fixed_count=self.config.fixed_checkpoint_layers)
        # The most checkpoint layers any rank wants (fewer could overflow its host memory),
        # then alpha solved again for that count and the smallest any rank can take.
        agreed = int(round(-self.agree_on_alpha(-float(modes.checkpoint_layers))))
        self.checkpoint_layers = min(agreed, inputs.offloaded_layers)
        reduced = with_checkpoint_layers(inputs, self.checkpoint_layers, self.shape.input_bytes)
        self.decision = solve_alpha(reduced)
        self.modes = modes
        self.manager.set_alpha(self.agree_on_alpha(self.decision.alpha), other_bytes)
        self.log(f"> MEMO alpha: {format_alpha_log(reduced, self.decision)}; "
                 f"alpha used by all ranks: {self.alpha:.4f} | {self.describe_modes()}")
