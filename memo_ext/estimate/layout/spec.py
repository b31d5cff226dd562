"""What a parallel layout is: :class:`Layout` (TP, CP, PP, DP and the memory policy) and its
traced :class:`Stage` s, the policies' flags, and the flags a layout gives the tracer and the
trainer.

Which ranks are traced (:meth:`Layout.stages`): the ranks of one stage are alike (TP shards
split evenly, CP's load-balanced chunks carry equal work, DP replicas are copies), so one rank
per stage is enough. Of the stages, the first and the last suffice: 1F1B keeps min(PP - s, m)
micro-batches in flight on stage s, so a middle stage holds no more than stage 0 (same layers,
no embedding) and the last stage alone carries the output layer and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from memo_ext.config import TiledMLPConfig
from memo_ext.estimate.symbolic import COPIED_LAYER, TRACED_LAYERS
from memo_ext.estimate.symbolic_shape import SymbolicShape, mixed_symbolic_shape
from memo_ext.flags import render_flags
from memo_ext.offload.alpha import offloaded_layers
from memo_ext.trace.request import CHUNKED_LOSS_FLAGS, TracedModel, TraceRequest

#: The two lengths every layout is traced at (multiples of TP x CP x 2 for any TP, CP <= 64).
FIT_SEQS = (131072, 262144)
#: Allocator iterations replayed per estimate (persistent state once, then these).
REPLAY_ITERATIONS = 3

#: Megatron-LM's policies as trainer flags (each is also a TraceRequest field of that name);
#: MEMO's is --memo-offload --memo-alpha A with the chunked loss (the Megatron policies keep
#: the unfused loss Megatron-LM ships, whose [s/CP, V/TP] logits are the largest item of a long
#: run).
POLICY_FLAGS = {
    "megatron": {"recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1},
    "megatron-none": {},
    "megatron-block": {"recompute_granularity": "full", "recompute_method": "block"},
    "memo": {},
}
POLICY_NAMES = {"megatron": "Megatron full recompute", "megatron-none": "Megatron no recompute",
                "megatron-block": "Megatron block recompute", "memo": "MEMO offload"}
#: Block recompute's layers per stage the recommender tries, as fractions of a stage's layers.
BLOCK_RECOMPUTE_FRACTIONS = (0.25, 0.5, 0.75)
#: MEMO's checkpoint-offloaded layers per stage the recommender tries, as fractions of the
#: stage's offloaded layers (0: MEMO alone; 1: every offloaded layer checkpointed).
CHECKPOINT_FRACTIONS = (0.0, 0.25, 0.5, 1.0)

#: (layers traced, layer copied) of a policy's symbolic traces (memo_ext.estimate.symbolic).
#: Megatron's layers differ only at the two ends of a section: three layers, the middle one
#: copied, match 7-layer traces event by event (TP, CP and PP stages alike). MEMO's need five:
#: with three or four layers the check against a 7-layer trace fails (its warm-up leaves
#: per-layer buffers that a shorter trace does not repeat). Block recompute has none: its first
#: K layers of a stage recompute and the others do not, so no one layer stands for the rest,
#: and it is traced whole.
SYMBOLIC_LAYERS = {"megatron": (3, 1), "megatron-none": (3, 1),
                   "memo": (TRACED_LAYERS, COPIED_LAYER)}

#: How the CPU trainer is traced (a profile with ``"device_type": "cpu"``,
#: memo_ext.estimate.cpu_profile): the CPU program's own allocations (no CUDA kernel rules),
#: fp32 and megatron's plain optimizer, which is what pretrain_gpt.py runs without CUDA.
CPU_TRACE_FIELDS = {"cuda_semantics": False, "bf16": False, "distributed_optimizer": False}


def target_fields(hardware: dict) -> dict:
    """The TraceRequest fields naming the GPU whose kernels' workspaces a trace records (they
    override the layout's, so a CPU profile's fp32 wins)."""
    if hardware.get("device_type") == "cpu":
        return dict(CPU_TRACE_FIELDS)
    if "name" not in hardware:
        return {}
    return {"gpu": hardware["name"], "hardware_file": hardware.get("hardware_file") or None}


@dataclass(frozen=True)
class Stage:
    """A traced pipeline stage: its first global rank (megatron's order puts PP outermost) and
    the micro-batches 1F1B keeps in flight on it."""

    index: int
    rank: int
    microbatches_in_flight: int


@dataclass(frozen=True)
class Layout:
    """A parallel layout and memory policy (what a job's flags choose)."""

    tp: int
    cp: int
    pp: int
    dp: int
    policy: str = "megatron"
    alpha: Optional[float] = None  # MEMO's offloaded fraction
    micro_batch: int = 1
    recompute_layers: Optional[int] = None  # megatron-block: layers recomputed per stage
    checkpoint_layers: int = 0  # memo: offloaded layers per stage in checkpoint mode (b)
    offload_fp8: bool = False  # memo: whole-offloaded tensors stored as fp8 (lossy)
    mlp_tiles: int = 0  # the MLP run in this many sequence tiles (memo_ext.tiled_mlp); 0: not
    projection_tiles: int = 0  # the attention's QKV and output projections, likewise
    head_chunks: int = 1  # the core attention over this many chunks of its heads
    tile_norms: bool = False  # the norms run in the MLP and projection tiles (--memo-tile-norms)
    offload_buffers: int = 2  # memo: device buffers offloaded data passes through (1 or 2)
    # --optimizer-cpu-offload's --optimizer-offload-fraction (None: off; with the distributed
    # optimizer and --use-precision-aware-optimizer, Megatron-LM's requirements)
    optimizer_offload: Optional[float] = None
    # --use-megatron-fsdp's --data-parallel-sharding-strategy (None: megatron-core's DDP) and
    # --fsdp-double-buffer
    megatron_fsdp: Optional[str] = None
    fsdp_double_buffer: bool = False
    # --suggested-communication-unit-size (None: megatron-core's default)
    fsdp_unit_size: Optional[int] = None
    # --grad-reduce-in-bf16: the gradient buffer in bf16, not fp32 (a numerics choice the user
    # makes; estimated for one layout, not searched)
    grad_reduce_in_bf16: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def seq_multiple(self) -> int:
        """Sequence lengths are multiples of this (CP's load-balanced chunks, TP's
        sequence-parallel shards)."""
        return 2 * self.tp * self.cp

    def stages(self, microbatches: int) -> list[Stage]:
        """The stages whose ranks are traced (module docstring: first and last), for
        ``microbatches`` micro-batches per iteration."""
        if self.pp == 1:
            return [Stage(0, 0, 1)]
        return [Stage(0, 0, min(self.pp, microbatches)),
                Stage(self.pp - 1, (self.pp - 1) * self.tp * self.cp * self.dp, 1)]

    def trace_request(self, model: TracedModel, seq: int, hardware: dict,
                      stage: Optional[Stage] = None) -> TraceRequest:
        """The tracer's request for ``stage`` (its first rank; stage 0 without one) at ``seq``
        tokens on ``hardware``."""
        fields = dict(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp,
                      micro_batch_size=self.micro_batch, bf16=True, **POLICY_FLAGS[self.policy])
        if self.policy == "memo":
            fields.update(memo_alpha=self.alpha, memo_checkpoint_layers=self.checkpoint_layers,
                          memo_offload_fp8=self.offload_fp8,
                          memo_offload_buffers=self.offload_buffers, chunked_loss=True)
        if self.policy == "megatron-block":
            fields["recompute_num_layers"] = self.recompute_layers
        fields.update(mlp_tiles=self.mlp_tiles, projection_tiles=self.projection_tiles,
                      head_chunks=self.head_chunks, tile_norms=self.tile_norms)
        if stage is not None and self.pp > 1:
            fields.update(rank=stage.rank, microbatches_in_flight=stage.microbatches_in_flight)
        fields.update(target_fields(hardware))
        if self.optimizer_offload is not None:  # the CPU trainer too: offload needs the
            # distributed optimizer
            fields.update(distributed_optimizer=True, optimizer_cpu_offload=True,
                          optimizer_offload_fraction=self.optimizer_offload)
        if self.megatron_fsdp is not None:
            fields.update(megatron_fsdp=self.megatron_fsdp,
                          fsdp_double_buffer=self.fsdp_double_buffer,
                          fsdp_unit_size=self.fsdp_unit_size)
        if self.grad_reduce_in_bf16:
            fields["grad_buffer_fp32"] = False
        return TraceRequest(model=model, seq_length=seq, **fields)

    def persistent_state(self) -> "Layout":
        """The layout whose persistent-only trace this one's persistent state is: the
        parallel sizes, micro-batch and model-state options, none of the policy's (weights,
        gradients and optimizer state do not depend on it: one trace serves every policy)."""
        return Layout(self.tp, self.cp, self.pp, self.dp, "megatron-none",
                      micro_batch=self.micro_batch, optimizer_offload=self.optimizer_offload,
                      megatron_fsdp=self.megatron_fsdp,
                      fsdp_double_buffer=self.fsdp_double_buffer,
                      fsdp_unit_size=self.fsdp_unit_size,
                      grad_reduce_in_bf16=self.grad_reduce_in_bf16)

    def without_optimizer_offload(self) -> "Layout":
        """This layout with its optimizer on the device: the one whose activation traces it
        shares (LayoutModel.build)."""
        return replace(self, optimizer_offload=None)

    def offloaded_per_stage(self, layers: int, stage: Stage) -> int:
        """MEMO's offloaded layers of a ``layers``-layer ``stage`` (the trainer's
        memo_ext.offload rule: all of them with micro-batches in flight, else all but one per
        rounding buffer)."""
        return layers if stage.microbatches_in_flight > 1 else \
            offloaded_layers(layers, self.offload_buffers)

    def every_layer_checkpointed(self, layers: int, stage: Stage) -> bool:
        """Every offloaded layer of the stage in checkpoint mode (b). The kept layers then take
        (b) too (memo_ext.offload), so every layer is alike and one stands for the rest."""
        return (self.policy == "memo" and self.checkpoint_layers > 0
                and self.checkpoint_layers == self.offloaded_per_stage(layers, stage))

    def traced_layers_request(self, model: TracedModel, seq: int, hardware: dict,
                              stage: Stage, layers: int,
                              checkpoint_layers: Optional[int] = None) -> TraceRequest:
        """The tracer's request for ``stage`` cut to ``layers`` layers per stage (a symbolic
        trace's few layers, or its check's), with ``checkpoint_layers`` of them in (b) when
        given."""
        request = self.trace_request(model, seq, hardware, stage).with_layers(layers * self.pp)
        if checkpoint_layers is not None:
            request = request.replace(memo_checkpoint_layers=checkpoint_layers)
        return request

    def symbolic_shape(self, stage_layers: int, stage: Stage) -> Optional[SymbolicShape]:
        """How a stage of ``stage_layers`` is traced symbolically, or None (traced whole): the
        policy's few layers (SYMBOLIC_LAYERS); with every layer in (b), the cut stages' own
        offloaded layers all in (b); a stage mixing (a) and (b) layers by one period of its
        pattern (memo_ext.estimate.symbolic_shape)."""
        if self.policy not in SYMBOLIC_LAYERS:
            return None
        layers, copied = SYMBOLIC_LAYERS[self.policy]
        if self.every_layer_checkpointed(stage_layers, stage):
            return SymbolicShape(layers, copied,
                                 checkpoint_layers=self.offloaded_per_stage(layers, stage),
                                 check_checkpoint_layers=self.offloaded_per_stage(layers + 2,
                                                                                  stage))
        if self.policy == "memo" and self.checkpoint_layers:
            offloaded = self.offloaded_per_stage(stage_layers, stage)
            return mixed_symbolic_shape(offloaded, self.checkpoint_layers,
                                        stage_layers - offloaded)
        return SymbolicShape(layers, copied)

    def trainer_flags(self, seq: int, global_batch: int) -> list[str]:
        """The layout's pretrain_gpt.py flags at ``seq`` tokens (the model's own flags, data and
        tokenizer come from its config script): parallel sizes, the policy's flags and the
        batch. What the recommender prints for each row, ready to append to a launch line."""
        flags = {"tensor_model_parallel_size": self.tp, "sequence_parallel": self.tp > 1,
                 "context_parallel_size": self.cp, "pipeline_model_parallel_size": self.pp,
                 "use_distributed_optimizer": True, "seq_length": seq,
                 "max_position_embeddings": seq, "micro_batch_size": self.micro_batch,
                 "global_batch_size": global_batch}
        if self.policy == "memo":
            flags.update(memo_offload=True, memo_alpha=f"{self.alpha:g}",
                         memo_checkpoint_layers=self.checkpoint_layers, **CHUNKED_LOSS_FLAGS,
                         memo_offload_fp8=self.offload_fp8,
                         memo_offload_buffers=(None if self.offload_buffers == 2
                                               else self.offload_buffers))
        else:
            flags.update(POLICY_FLAGS[self.policy])
        if self.policy == "megatron-block":
            flags["recompute_num_layers"] = self.recompute_layers
        if self.mlp_tiles:
            flags["memo_mlp_tile_size"] = TiledMLPConfig.tile_size_for(
                seq // self.cp, self.mlp_tiles, self.tp)
        if self.projection_tiles:
            flags["memo_attention_projection_tile_size"] = TiledMLPConfig.tile_size_for(
                seq // self.cp, self.projection_tiles, self.tp)
        if self.head_chunks > 1:
            flags["memo_attention_head_chunks"] = self.head_chunks
        flags["memo_tile_norms"] = self.tile_norms
        if self.optimizer_offload is not None:
            flags.update(use_precision_aware_optimizer=True, optimizer_cpu_offload=True,
                         optimizer_offload_fraction=f"{self.optimizer_offload:g}")
        if self.megatron_fsdp is not None:
            flags.update(use_megatron_fsdp=True,
                         data_parallel_sharding_strategy=self.megatron_fsdp,
                         fsdp_double_buffer=self.fsdp_double_buffer,
                         suggested_communication_unit_size=self.fsdp_unit_size,
                         ckpt_format="fsdp_dtensor")
        if self.grad_reduce_in_bf16:
            flags["grad_reduce_in_bf16"] = True
        return render_flags(flags)

    def describe(self) -> str:
        policy = POLICY_NAMES[self.policy]
        if self.policy == "memo":
            policy += f" alpha {self.alpha:g}"
            if self.checkpoint_layers:
                policy += f" + {self.checkpoint_layers} checkpoint layers"
            if self.offload_fp8:
                policy += " fp8"
            if self.offload_buffers == 1:
                policy += ", 1 offload buffer"
        if self.mlp_tiles:
            policy += f", MLP in {self.mlp_tiles} tiles"
        if self.projection_tiles:
            policy += f", attention projections in {self.projection_tiles} tiles"
        if self.head_chunks > 1:
            policy += f", heads in {self.head_chunks} chunks"
        if self.tile_norms:
            policy += ", norms in the tiles"
        if self.policy == "megatron-block":
            policy += f" {self.recompute_layers} layers per stage"
        if self.optimizer_offload is not None:
            policy += f", optimizer {self.optimizer_offload:g} on the host"
        if self.grad_reduce_in_bf16:
            policy += ", gradients in bf16"
        return (f"TP={self.tp} CP={self.cp} PP={self.pp} DP={self.dp} mbs={self.micro_batch} "
                f"{policy}")
