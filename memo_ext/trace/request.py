"""What the tracer traces, as typed data: :class:`TracedModel` (the network) and
:class:`TraceRequest` (one rank of one layout at one length, the target GPU, how to record).

The estimator builds requests from its layouts and hands them to the tracer (in a worker pool,
memo_ext.estimate.tracer) as plain JSON; ``tools/trace.py`` builds one from its command line.
The tracer engine (megatron.training.tracing) renders a request into the trainer's own flags
with the one renderer (memo_ext.flags.render_flags) and builds the trainer's model from them,
so no component writes or parses another's command line. A request is also the trace cache's
key (:meth:`TraceRequest.key`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Optional

from memo_ext.trace.cuda_rules import DEFAULT_GPU

#: The chunked output layer and loss (memo_ext.loss; docs/loss.md) as trainer flags.
CHUNKED_LOSS_FLAGS = {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "chunked"}


@dataclass(frozen=True)
class TracedModel:
    """The network a trace builds: the trainer's model-shape flags as fields. ``name`` is a
    preset's (memo_ext.estimate.models.traced_model), kept for the trace header only."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    position_embedding_type: str = "rope"
    normalization: str = "LayerNorm"
    swiglu: bool = False
    disable_bias_linear: bool = False
    tie_embeddings: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    name: Optional[str] = None

    @classmethod
    def from_shape(cls, shape: dict) -> "TracedModel":
        """From a model-shape dict (memo_ext.estimate.models.model_shape: a preset's, a JSON
        file's or a flag file's keys); keys that are no field are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in shape.items()
                      if key in names and value is not None})

    def with_layers(self, num_layers: int) -> "TracedModel":
        return dataclasses.replace(self, num_layers=num_layers)


@dataclass(frozen=True)
class TraceRequest:
    """One rank of one layout at one length, traced on one GPU's CUDA rules.

    Layout: ``tp``, ``cp``, ``pp``, ``dp`` and the global ``rank`` recorded (megatron's rank
    order), ``microbatches_in_flight`` forwards recorded before the backwards (1F1B keeps
    PP - stage of them on a stage). Memory policy: Megatron's recompute flags, or MEMO offload
    when ``memo_alpha`` is given (a fixed alpha: 'auto' needs measured layer times), the layer
    tiling as tile counts of the rank's CP shard (``mlp_tiles``, ``projection_tiles``: the
    trainer's tile sizes follow the length, so traces at two lengths are alike) or as a fixed
    ``mlp_tile_size``, ``head_chunks``, the norms in the tiles (``tile_norms``), the chunked
    loss. ``extra_trainer_argv``: more trainer flags as typed on a command line, after the
    others (tools/trace.py's --trainer-args; the estimator gives none). Target: the GPU profile whose kernels' workspaces are recorded, or none
    (``cuda_semantics`` False: the CPU program as it allocates here). Recording: fake or
    ``live`` tensors, the warm-up, the persistent state alone. Optimizer: the distributed
    optimizer and Megatron-LM's optimizer CPU offload (``optimizer_cpu_offload`` with
    ``optimizer_offload_fraction``, ``overlap_cpu_optimizer_d2h_h2d``, ``pin_cpu_grads``,
    ``pin_cpu_params``: the trainer's flags, --use-precision-aware-optimizer implied), and
    Megatron-FSDP's sharding strategy (``megatron_fsdp``, with ``fsdp_double_buffer``)."""

    model: TracedModel
    seq_length: int
    micro_batch_size: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    sequence_parallel: bool = True
    microbatches_in_flight: int = 1
    bf16: bool = False
    fp16: bool = False
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    memo_alpha: Optional[float] = None  # MEMO offload on when given
    memo_checkpoint_layers: int = 0
    memo_offload_fp8: bool = False
    memo_offload_buffers: int = 2
    mlp_tiles: int = 0
    mlp_tile_size: int = 0
    projection_tiles: int = 0
    head_chunks: int = 1
    tile_norms: bool = False  # --memo-tile-norms: the norms run in the MLP/projection tiles
    chunked_loss: bool = False
    distributed_optimizer: bool = True
    optimizer: str = "adam"
    # Megatron-LM's optimizer CPU offload (megatron-core's HybridDeviceOptimizer), its flags.
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    grad_buffer_fp32: bool = True
    # Megatron-FSDP (--use-megatron-fsdp) with this --data-parallel-sharding-strategy, or None
    # (megatron-core's DDP); --fsdp-double-buffer; --suggested-communication-unit-size.
    megatron_fsdp: Optional[str] = None
    fsdp_double_buffer: bool = False
    fsdp_unit_size: Optional[int] = None
    extra_trainer_argv: tuple = ()
    gpu: str = DEFAULT_GPU
    hardware_file: Optional[str] = None
    cuda_semantics: bool = True
    flash_workspace: bool = True
    cuda_context_mib: Optional[float] = None
    cublas_workspace_mib: Optional[float] = None
    nccl_mib_per_communicator: Optional[float] = None
    live: bool = False
    warmup: str = "auto"
    persistent_only: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def memo_offload(self) -> bool:
        return self.memo_alpha is not None

    def replace(self, **changes) -> "TraceRequest":
        return dataclasses.replace(self, **changes)

    def with_layers(self, num_layers: int) -> "TraceRequest":
        return self.replace(model=self.model.with_layers(num_layers))

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["extra_trainer_argv"] = list(self.extra_trainer_argv)
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "TraceRequest":
        values = dict(values)
        values["model"] = TracedModel(**values["model"])
        values["extra_trainer_argv"] = tuple(values.get("extra_trainer_argv", ()))
        return cls(**values)

    def key(self) -> str:
        """The request as canonical JSON: equal requests, equal traces (the trace cache's key,
        with the tracer's sources)."""
        return json.dumps(self.to_dict(), sort_keys=True)


#: Host memory given to MEMO's offload while tracing: large enough never to refuse an alpha
#: (the trace does not model host capacity; memo_ext.offload.alpha does), and the copy
#: bandwidth it is told (no copy is timed).
TRACE_HOST_MEMORY_GB = 1e6
TRACE_PCIE_GBPS = 25.0
