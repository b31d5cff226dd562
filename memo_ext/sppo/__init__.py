"""SPPO: subsequence pipeline parallelism with sequence-aware offloading (docs/sppo.md).

Public entry point: :class:`SubsequencePipeline`; with ``--memo-sppo-msp`` it runs the
multiplexed sequence partitioning of :mod:`memo_ext.sppo.multiplex`. The trainer builds one per
process from an :class:`memo_ext.config.SPPOConfig`, builds the model from
:meth:`SubsequencePipeline.layer_spec`, calls :meth:`SubsequencePipeline.attach` on each model
chunk, runs every global batch through :meth:`SubsequencePipeline.forward_backward` instead of
megatron.core's schedule, and calls
:meth:`SubsequencePipeline.after_iteration` after each step.
"""

from __future__ import annotations

import copy
import contextlib
from typing import Callable, Collection, ContextManager, Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import ModuleSpec

from memo_ext.config import MemoConfigError, SPPOConfig
from memo_ext.device import CopyEngine
from memo_ext.layer_flops import LayerFlops
from memo_ext.sppo.attention import KVCache, SubsequenceCoreAttention, SubsequenceOrderError
from memo_ext.sppo.offload import SubsequenceOffloader
from memo_ext.sppo.partition import auto_subsequences, partition
from memo_ext.sppo.msp_plan import pipeline_bubble_ratio, plan_multiplexing
from memo_ext.sppo.multiplex import SequenceMultiplexer
from memo_ext.sppo.schedule import StageTimeline, run_subsequence_pipeline

__all__ = ["SubsequencePipeline", "SubsequenceState", "SubsequenceCoreAttention",
           "SubsequenceOrderError", "partition", "StageTimeline",
           "pipeline_bubble_ratio", "plan_multiplexing"]

#: Iteration whose schedule timeline is logged: the first two include one-time costs (the
#: bandwidth probe, auto offload's measuring pass, allocator warm-up).
BUBBLE_LOG_ITERATION = 3


class SubsequenceState:
    """Which subsequence of the current sequence runs, and every layer's K/V cache."""

    def __init__(self, boundaries: list[int]):
        self.boundaries = boundaries
        self.index = 0
        self.caches: list[KVCache] = []
        self._kv_storages: set[int] = set()
        #: The running --memo-sppo-msp task's pass (memo_ext.sppo.multiplex), else None.
        self.multiplexed = None

    @property
    def count(self) -> int:
        return len(self.boundaries) - 1

    @property
    def start(self) -> int:
        """First token of the running subsequence (its offset in the sequence)."""
        return self.boundaries[self.index]

    @property
    def length(self) -> int:
        """Tokens of the running subsequence."""
        return self.boundaries[self.index + 1] - self.start

    def enter(self, index: int) -> None:
        self.index = index

    def register_cache(self, cache: KVCache) -> None:
        self.caches.append(cache)

    def mark_kv(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Remember K/V storages: the offloader keeps them on device."""
        self._kv_storages.update(t.untyped_storage()._cdata for t in (key, value))

    def is_kv(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage()._cdata in self._kv_storages

    def kv_cache_bytes(self) -> int:
        return sum(cache.nbytes() for cache in self.caches)

    def end_sequence(self) -> None:
        """Drop every layer's K/V (and their gradient accumulators) after the sequence."""
        for cache in self.caches:
            cache.clear()
        self._kv_storages.clear()
        self.index = 0


class SubsequencePipeline:
    """SPPO's runtime for one rank (see the module docstring).

    ``layer_flops`` gives the FLOPs partition its weights; ``multiple_of`` is the granularity of
    the cuts (the TP size under sequence parallelism). ``engine`` and ``bandwidth_bytes_per_s``
    are needed only with --memo-sppo-offload other than none. Batch entries under
    ``whole_keys`` reach every subsequence whole (packed documents' offsets).
    """

    def __init__(self, config: SPPOConfig, *, seq_length: int, pipeline_size: int,
                 micro_batch_size: int, hidden_size: int, layer_flops: LayerFlops,
                 multiple_of: int = 1, engine: Optional[CopyEngine] = None,
                 bandwidth_bytes_per_s: Optional[float] = None,
                 host_allocation_scope: Callable[[], ContextManager] = contextlib.nullcontext,
                 log: Callable[[str], None] = lambda message: None,
                 whole_keys: Collection[str] = (), **offloader_options):
        config.validate()
        count = config.subsequences or auto_subsequences(seq_length, pipeline_size, multiple_of)
        try:
            boundaries = partition(seq_length, count, config.sppo_partition, layer_flops,
                                   multiple_of)
        except ValueError as error:
            raise MemoConfigError(f"--memo-sppo-subsequences {count}: {error}; use fewer "
                                  "subsequences or a longer --seq-length") from None
        self.config = config
        self.state = SubsequenceState(boundaries)
        self.micro_batch_size = micro_batch_size
        self.pipeline_size = pipeline_size
        self.hidden_size = hidden_size
        self.timeline = StageTimeline()
        self.log = log
        self.iterations = 0
        self.whole_keys = whole_keys
        self.offloader = None
        alpha = config.offload_alpha
        if alpha != 0.0:
            if engine is None or bandwidth_bytes_per_s is None:
                raise ValueError("--memo-sppo-offload needs a CopyEngine and the D2H bandwidth")
            self.offloader = SubsequenceOffloader(
                engine, alpha, bandwidth_bytes_per_s, is_kept=self.kept_on_device,
                host_allocation_scope=host_allocation_scope, **offloader_options)
        self._parameter_storages: set[int] = set()
        self.multiplexer = (SequenceMultiplexer(self.state, pipeline_size, layer_flops,
                                                micro_batch_size, hidden_size)
                            if config.sppo_msp else None)

    @property
    def boundaries(self) -> list[int]:
        return self.state.boundaries

    def describe(self) -> str:
        lengths = [b - a for a, b in zip(self.boundaries, self.boundaries[1:])]
        offload = self.config.sppo_offload
        described = (f"SPPO: {len(lengths)} subsequences ({self.config.sppo_partition} partition) "
                     f"of {', '.join(map(str, lengths))} tokens | offload {offload}")
        if self.multiplexer is not None:
            tasks = self.multiplexer.tasks.values()
            described += (f" | MSP: {len(tasks)} multiplexed tasks per stage pass: " + ", ".join(
                f"s{t.stage}/{t.subsequence}+{'.'.join(map(str, t.helpers))}" for t in tasks))
        return described

    def layer_spec(self, spec: ModuleSpec) -> ModuleSpec:
        """``spec`` (a TransformerLayer ModuleSpec) with SPPO's subsequence core attention."""
        spec = copy.copy(spec)
        spec.submodules = copy.copy(spec.submodules)
        attention = copy.copy(spec.submodules.self_attention)
        attention.submodules = copy.copy(attention.submodules)
        attention.submodules.core_attention = ModuleSpec(
            module=SubsequenceCoreAttention, params={"subsequences": self.state})
        spec.submodules.self_attention = attention
        return spec

    def attach(self, model_chunk: torch.nn.Module) -> None:
        """Offset rotary embeddings by the running subsequence's first token, note the
        chunk's parameters (never offloaded) and, with MSP, create its process groups and hook
        the chunk's transformer block (collective)."""
        for module in model_chunk.modules():
            if isinstance(module, RotaryEmbedding):
                module.register_forward_pre_hook(self._rotary_offset, with_kwargs=True)
        self._parameter_storages.update(p.untyped_storage()._cdata
                                        for p in model_chunk.parameters())
        if self.multiplexer is not None:
            self.multiplexer.setup(model_chunk)

    def forward_backward(self, *, forward_step_func, data_iterator, model: list,
                         num_microbatches: int, forward_only: bool, config) -> list:
        """One global batch through SPPO's schedule; the last stage's loss reports."""
        return run_subsequence_pipeline(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, micro_batch_size=self.micro_batch_size,
            hidden_size=self.hidden_size, forward_only=forward_only, subsequences=self.state,
            config=config, offloader=self.offloader, timeline=self.timeline,
            multiplexer=self.multiplexer, whole_keys=self.whole_keys)

    def after_iteration(self) -> None:
        """Solve auto's offload shares after the measuring iteration; log what the offloader
        did in the first iterations (bytes of the last sequence, per subsequence)."""
        self.iterations += 1
        if self.iterations == BUBBLE_LOG_ITERATION:
            stages = self.pipeline_size
            line = (f"> SPPO stage bubble ratio (iteration {self.iterations}, measured on this "
                    f"rank's clock): {self.timeline.bubble_ratio():.3f} | fill-drain formula "
                    f"(p-1)/N = {(stages - 1) / self.state.count:.3f}")
            if self.multiplexer is not None:
                work = [1.0] * self.state.count
                predicted = pipeline_bubble_ratio(stages, work, [2.0] * len(work),
                                                  self.multiplexer.tasks)
                line += f" | with MSP, equal work: {predicted:.3f}"
            self.log(line)
        if self.offloader is None:
            return
        records = self.offloader.after_iteration()
        if self.iterations <= 2 and records:
            mib = 2 ** 20
            alphas = self.offload_alphas()
            self.log(f"> SPPO offload after iteration {self.iterations}: offloaded "
                     f"{sum(r.offloaded_bytes for r in records) / mib:.2f} of "
                     f"{sum(r.offloadable_bytes for r in records) / mib:.2f} MiB of the last "
                     f"sequence, held back {sum(r.held_back_bytes for r in records) / mib:.2f} "
                     "MiB for the host budget | next alphas "
                     + ("measuring" if alphas is None else ", ".join(f"{a:.2f}" for a in alphas)))

    def offload_alphas(self) -> Optional[list[float]]:
        """The per-subsequence offload shares in use (None until auto has measured)."""
        if self.offloader is None:
            return [0.0] * self.state.count
        count = self.state.count
        if self.offloader.fixed_alpha is None and not self.offloader.alphas:
            return None
        return [self.offloader.alpha_for(i, count) for i in range(count)]

    def kept_on_device(self, tensor: torch.Tensor) -> bool:
        """True for tensors SPPO never offloads: K/V of the running sequence, parameters."""
        return (self.state.is_kv(tensor)
                or tensor.untyped_storage()._cdata in self._parameter_storages)

    def _rotary_offset(self, module, args, kwargs):
        # The running subsequence's table: from its first token, its length (megatron sizes a
        # packed batch's table by the whole sequence, PackedSeqParams' max_seqlen).
        kwargs["offset"] = self.state.start
        return (self.state.length, *args[1:]), kwargs
