"""One parallel layout of a job, predicted end to end (memory and time), and the search over
layouts the recommender runs.

A :class:`LayoutModel` traces each distinct pipeline stage of the layout at two sequence lengths
(memo-trace on fake tensors, cached on disk by :class:`TraceCache`; a deep stage symbolically,
memo_ext.estimate.symbolic), then answers at any length: the allocation trace through the allocator model (memory.py: fit or OOM,
reorganisations) and the work through the cost model (cost.py: step time, MFU). The prediction
is the worst stage's memory and the slowest stage's time. Host memory is checked too: MEMO's
offload slots of every rank of a node must fit the node's host memory.

Which ranks are traced (:meth:`Layout.stages`): the ranks of one stage are alike (TP shards
split evenly, CP's load-balanced chunks carry equal work, DP replicas are copies), so one rank
per stage is enough. Of the stages, the first and the last suffice: 1F1B keeps min(PP - s, m)
micro-batches in flight on stage s, so a middle stage holds no more than stage 0 (same layers,
no embedding) and the last stage alone carries the output layer and the loss.

:func:`candidate_layouts` enumerates (TP, CP, PP, DP, policy, alpha, micro-batch) for a number
of GPUs and drops, before any tracing, what cannot run: shapes that do not divide, and layouts
whose parameters, gradients and optimizer state alone exceed the device (bytes per parameter:
memo_ext.estimate.rank_constants). :func:`build_models` traces candidates in parallel;
memo_ext.estimate.search ranks them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from memo_ext.config import TiledMLPConfig
from memo_ext.estimate.cost import (
    CostModelError,
    Efficiency,
    StepTime,
    WorkLine,
    persistent_bytes,
    predict_step,
)
from memo_ext.estimate.host_memory import host_slot_bytes
from memo_ext.estimate.kernels import at_model_shapes
from memo_ext.estimate.memory import (
    EstimateError,
    LinearTrace,
    MemoryEstimate,
    estimate_at,
    max_sequence_length,
)
from memo_ext.estimate.rank_constants import (  # shared with SPPO's rows
    OPTIMIZER_BYTES_PER_PARAM,
    WEIGHT_AND_GRAD_BYTES_PER_PARAM,
)
from memo_ext.estimate.symbolic import (
    COPIED_LAYER,
    TRACED_LAYERS,
    SymbolicError,
    SymbolicTrace,
    live_lines,
)
from memo_ext.estimate.symbolic_shape import SymbolicShape, mixed_symbolic_shape
from memo_ext.estimate.trace_key import tracer_digest
from memo_ext.offload.alpha import offloaded_layers
from memo_ext.planner.trace import POOL_DEVICE, POOL_EXTERNAL, POOL_HOST, Trace, read_trace

#: The two lengths every layout is traced at (multiples of TP x CP x 2 for any TP, CP <= 64).
FIT_SEQS = (131072, 262144)
#: Allocator iterations replayed per estimate (persistent state once, then these).
REPLAY_ITERATIONS = 3

#: The trainer flags of memo_ext.loss's chunked output layer and loss (docs/loss.md).
CHUNKED_LOSS_TRAINER_FLAGS = "--cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked"
#: Megatron-LM policies as trainer flags; MEMO's is --memo-offload --memo-alpha A with the
#: chunked loss (the Megatron policies keep the unfused loss Megatron-LM ships, whose
#: [s/CP, V/TP] logits are the largest item of a long run).
POLICY_FLAGS = {
    "megatron": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"],
    "megatron-none": [],
    "megatron-block": ["--recompute-granularity", "full", "--recompute-method", "block"],
    "memo": ["--memo-offload", f"--trainer-args={CHUNKED_LOSS_TRAINER_FLAGS}"],
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

def model_layers(model_argv: list[str]) -> Optional[int]:
    """The model's layers from the tracer's model flags (``--num-layers N``, else a
    ``--model`` preset); None when they name neither."""
    from memo_ext.estimate.models import MODELS

    layers = None
    for flag, value in zip(model_argv, model_argv[1:]):
        if flag == "--num-layers":
            layers = int(value)
        elif flag == "--model" and value in MODELS and layers is None:
            layers = MODELS[value][0]
    return layers


#: The tracer flags of the CPU trainer (a profile with ``"device_type": "cpu"``,
#: memo_ext.estimate.cpu_profile): the CPU program's own allocations (no CUDA kernel rules),
#: fp32 and megatron's plain optimizer, which is what pretrain_gpt.py runs without CUDA.
CPU_TRACE_FLAGS = ["--no-cuda-semantics", "--no-bf16", "--no-distributed-optimizer"]


def gpu_argv(hardware: dict) -> list[str]:
    """The tracer flags naming the GPU whose kernels' workspaces a trace records (they follow
    the layout's flags, so a CPU profile's --no-bf16 wins)."""
    if hardware.get("device_type") == "cpu":
        return list(CPU_TRACE_FLAGS)
    if "name" not in hardware:
        return []
    argv = ["--gpu", hardware["name"]]
    if hardware.get("hardware_file"):
        argv += ["--hardware-file", hardware["hardware_file"]]
    return argv


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
    head_chunks: int = 1  # the core attention over this many chunks of query groups
    offload_buffers: int = 2  # memo: device buffers offloaded data passes through (1 or 2)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def stages(self, microbatches: int) -> list[Stage]:
        """The stages whose ranks are traced (module docstring: first and last), for
        ``microbatches`` micro-batches per iteration."""
        if self.pp == 1:
            return [Stage(0, 0, 1)]
        return [Stage(0, 0, min(self.pp, microbatches)),
                Stage(self.pp - 1, (self.pp - 1) * self.tp * self.cp * self.dp, 1)]

    def trace_argv(self, model_argv: list[str], stage: Optional[Stage] = None) -> list[str]:
        argv = [*model_argv, "--tp", str(self.tp), "--cp", str(self.cp), "--pp", str(self.pp),
                "--dp", str(self.dp), "--micro-batch-size", str(self.micro_batch), "--bf16",
                *POLICY_FLAGS[self.policy]]
        if self.policy == "memo":
            argv += ["--memo-alpha", f"{self.alpha:g}",
                     "--memo-checkpoint-layers", str(self.checkpoint_layers)]
            if self.offload_fp8:
                argv.append("--memo-offload-fp8")
            if self.offload_buffers != 2:
                argv += ["--memo-offload-buffers", str(self.offload_buffers)]
        if self.policy == "megatron-block":
            argv += ["--recompute-num-layers", str(self.recompute_layers)]
        if self.mlp_tiles:
            argv += ["--memo-mlp-tiles", str(self.mlp_tiles)]
        if self.projection_tiles:
            argv += ["--memo-attention-projection-tiles", str(self.projection_tiles)]
        if self.head_chunks > 1:
            argv += ["--memo-attention-head-chunks", str(self.head_chunks)]
        if stage is not None and self.pp > 1:
            argv += ["--rank", str(stage.rank),
                     "--microbatches-in-flight", str(stage.microbatches_in_flight)]
        return argv

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

    def traced_layers_argv(self, model_argv: list[str], stage: Stage, layers: int,
                           checkpoint_layers: Optional[int] = None) -> list[str]:
        """The tracer flags of ``stage`` cut to ``layers`` layers per stage (a symbolic trace's
        few layers, or its check's), with ``checkpoint_layers`` of them in (b) when given."""
        argv = [*self.trace_argv(model_argv, stage), "--num-layers", str(layers * self.pp)]
        if checkpoint_layers is not None:
            argv += ["--memo-checkpoint-layers", str(checkpoint_layers)]
        return argv

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
        flags = ["--tensor-model-parallel-size", str(self.tp)]
        if self.tp > 1:
            flags.append("--sequence-parallel")
        flags += ["--context-parallel-size", str(self.cp),
                  "--pipeline-model-parallel-size", str(self.pp),
                  "--use-distributed-optimizer",
                  "--seq-length", str(seq), "--max-position-embeddings", str(seq),
                  "--micro-batch-size", str(self.micro_batch),
                  "--global-batch-size", str(global_batch)]
        if self.policy == "memo":
            flags += ["--memo-offload", "--memo-alpha", f"{self.alpha:g}",
                      "--memo-checkpoint-layers", str(self.checkpoint_layers),
                      *CHUNKED_LOSS_TRAINER_FLAGS.split()]
            if self.offload_fp8:
                flags.append("--memo-offload-fp8")
            if self.offload_buffers != 2:
                flags += ["--memo-offload-buffers", str(self.offload_buffers)]
        else:
            flags += POLICY_FLAGS[self.policy]
        if self.policy == "megatron-block":
            flags += ["--recompute-num-layers", str(self.recompute_layers)]
        if self.mlp_tiles:
            flags += ["--memo-mlp-tile-size",
                      str(TiledMLPConfig.tile_size_for(seq // self.cp, self.mlp_tiles, self.tp))]
        if self.projection_tiles:
            flags += ["--memo-attention-projection-tile-size", str(
                TiledMLPConfig.tile_size_for(seq // self.cp, self.projection_tiles, self.tp))]
        if self.head_chunks > 1:
            flags += ["--memo-attention-head-chunks", str(self.head_chunks)]
        return flags

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
        if self.policy == "megatron-block":
            policy += f" {self.recompute_layers} layers per stage"
        return (f"TP={self.tp} CP={self.cp} PP={self.pp} DP={self.dp} mbs={self.micro_batch} "
                f"{policy}")


class TraceCache:
    """Traces on disk, keyed by the tracer's argv, the length and the tracer's sources, so a
    repeated estimate or search costs no tracing. ``directory`` None: no cache. Misses are
    traced by a :class:`memo_ext.estimate.tracer.TracerPool` of ``workers`` long-lived tracer
    processes (started on the first miss; :meth:`close` ends them)."""

    def __init__(self, directory: Optional[Path], workers: int = 2) -> None:
        self.directory = None if directory is None else Path(directory)
        self.workers = workers
        self._pool = None
        self._pool_lock = threading.Lock()
        self._pending: dict[str, Future] = {}
        # Every project module the tracer imports, wherever installed, and the versions of
        # Python, torch and megatron-core (memo_ext.estimate.trace_key).
        self._sources_digest = tracer_digest()

    def __enter__(self) -> "TraceCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the tracer processes (a later miss starts them again)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _traced(self, argv: list[str], seq: int, output: Path) -> Trace:
        from memo_ext.estimate.tracer import TracerPool

        with self._pool_lock:
            if self._pool is None:
                self._pool = TracerPool(self.workers)
            pool = self._pool
        return pool.trace(argv, seq, output)

    def trace(self, argv: list[str], seq: int) -> Trace:
        """The trace of ``argv`` at ``seq`` tokens, from the cache or traced now; a request
        made while the same one is being traced waits for it rather than tracing it again
        (a search's layouts share traces, e.g. the persistent state of every policy)."""
        key = json.dumps([argv, seq])
        with self._pool_lock:
            pending = self._pending.get(key)
            mine = pending is None
            if mine:
                pending = self._pending[key] = Future()
        if not mine:
            return pending.result()
        try:
            trace = self._trace_once(argv, seq)
            pending.set_result(trace)
            return trace
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            with self._pool_lock:
                del self._pending[key]

    def _trace_once(self, argv: list[str], seq: int) -> Trace:
        if self.directory is None:
            with tempfile.TemporaryDirectory(prefix="memo_estimate_") as workdir:
                return self._traced(argv, seq, Path(workdir) / "trace.jsonl.gz")
        key = hashlib.sha256(json.dumps([argv, seq, self._sources_digest]).encode()).hexdigest()
        path = self.directory / f"{key[:32]}.jsonl.gz"
        if path.exists():
            try:
                return read_trace(path)
            except Exception:  # a damaged cache entry is traced again, never trusted
                path.unlink(missing_ok=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.directory) as workdir:  # parallel-safe
            partial = Path(workdir) / "trace.jsonl.gz"
            trace = self._traced(argv, seq, partial)
            os.replace(partial, path)
        return trace


def default_cache_dir() -> Path:
    """$MEMO_ESTIMATE_CACHE, else ~/.cache/megatron-memo/traces."""
    configured = os.environ.get("MEMO_ESTIMATE_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron-memo" \
        / "traces"


@dataclass
class StagePrediction:
    """One traced stage at one sequence length: its rank's memory and the iteration's time as
    that stage's pace would set it."""

    stage: Stage
    memory: MemoryEstimate
    step: StepTime
    host_slots: tuple = ()  # MEMO's host slots, bytes each (memo_ext.estimate.host_memory)


@dataclass
class Prediction:
    """A layout at one sequence length: memory (per traced stage) and time (per iteration)."""

    layout: Layout
    seq: int
    stages: list[StagePrediction]
    host_capacity_bytes: int
    ranks_per_node: int
    device_type: str = "cuda"  # "cpu": the CPU trainer (no page-locked memory)

    @property
    def worst_stage(self) -> StagePrediction:
        """The stage that fails first, else the one with the highest peak."""
        return max(self.stages, key=lambda p: (not p.memory.fits, p.memory.peak_device_bytes))

    @property
    def memory(self) -> MemoryEstimate:
        return self.worst_stage.memory

    @property
    def step(self) -> StepTime:
        """The slowest stage's iteration: 1F1B runs at the pace of its slowest stage."""
        return max((p.step for p in self.stages), key=lambda step: step.step_s)

    @property
    def peak_device_bytes(self) -> int:
        return self.memory.peak_device_bytes

    @property
    def step_s(self) -> float:
        return self.step.step_s

    @property
    def mfu(self) -> float:
        return self.step.mfu

    def describe(self) -> str:
        return self.layout.describe()

    @property
    def host_memory(self):
        """The worst node's host bytes by named term (memo_ext.estimate.host_memory): each
        local rank's own offload slots (page-locked, whole pages, on CUDA), per-process and
        data-loader memory, the kernel's page map."""
        if getattr(self, "_host_memory", None) is None:
            from memo_ext.estimate.host_memory import prediction_host_memory

            self._host_memory = prediction_host_memory(self)
        return self._host_memory

    @property
    def host_bytes_per_node(self) -> int:
        """Host bytes the worst node needs, every term of :attr:`host_memory` (the offload
        arena alone: ``host_memory.arena_bytes``)."""
        return self.host_memory.total_bytes

    @property
    def host_fits(self) -> bool:
        return self.host_bytes_per_node <= self.host_capacity_bytes

    @property
    def fits(self) -> bool:
        return self.memory.fits and self.host_fits

    def verdict(self) -> str:
        """FITS, or OOM and where: device (which rank, the failing request, the largest
        category at the peak) or host."""
        if not self.memory.fits:
            worst = self.worst_stage
            where = f"rank {worst.stage.rank}"
            if self.layout.pp > 1:
                where += f", pipeline stage {worst.stage.index}"
            request = worst.memory.oom_request_bytes
            if request:
                where += f": a {request / (1 << 30):.2f} GiB request fails"
            categories = worst.memory.peak_by_category
            if categories:
                name = max(categories, key=categories.get)
                where += f"; largest at the peak: {name} {categories[name] / (1 << 30):.2f} GiB"
            return f"OOM on device ({where})"
        if not self.host_fits:
            host = self.host_memory
            return (f"OOM on host ({host.total_bytes / 1e9:.0f} GB per node > "
                    f"{self.host_capacity_bytes / 1e9:.0f} GB: offloaded activations "
                    f"{host.arena_bytes / 1e9:.0f} GB, processes, data loader and kernel "
                    f"{(host.total_bytes - host.arena_bytes) / 1e9:.0f} GB)")
        return "FITS"


@dataclass
class StageModel:
    """A traced stage at any sequence length: its allocation trace (a LinearTrace of the whole
    stage, or a SymbolicTrace of a few layers with the stage's persistent ``state``) and its
    work line."""

    stage: Stage
    work: Optional[WorkLine]
    line: Optional[LinearTrace] = None
    symbolic: Optional[SymbolicTrace] = None
    state: Optional[Trace] = None
    layers: int = 0
    shape: Optional[SymbolicShape] = None  # how the symbolic trace was cut and is checked
    checked: bool = False  # the symbolic trace matched a real trace (SymbolicTrace.check)
    traced: Optional[tuple[TraceCache, list[str]]] = None  # exhaustive: traced at each length
    _lines: Optional[list] = field(default=None, repr=False)

    def at(self, seq: int) -> Trace:
        if self.traced is not None:
            cache, argv = self.traced
            return cache.trace(argv, seq)
        if self.symbolic is None:
            return self.line.at(seq)
        return self.symbolic.at(seq, self.layers, self.state)

    def work_at(self, seq: int, trace: Trace) -> dict:
        """``header["work"]`` at ``seq`` (``trace``: this stage's trace at it)."""
        return trace.header["work"] if self.traced is not None else self.work.at(seq)

    def peak_bounds(self, seqs: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(device, host, outside the allocator) allocated peaks at each of ``seqs`` (bytes):
        the first two are lower bounds of what any allocator model reserves."""
        if self._lines is None:  # the live-bytes lines of the three pools, made once
            if self.symbolic is None:
                events = self.line.base.events
                intercepts, slopes = self.line.intercepts, self.line.slopes
            else:
                events, intercepts, slopes = self.symbolic.coefficients(self.layers, self.state)
            self._lines = [live_lines(events, intercepts, slopes, pool)
                           for pool in (POOL_DEVICE, POOL_HOST, POOL_EXTERNAL)]
        return tuple(_max_of_lines(a, b, seqs) for a, b in self._lines)


def _max_of_lines(a: np.ndarray, b: np.ndarray, seqs: list[int]) -> np.ndarray:
    if not len(a):
        return np.zeros(len(seqs))
    s = np.asarray(seqs, dtype=float)
    return (a[None, :] + b[None, :] * s[:, None]).max(axis=1)


#: The length (tokens) a symbolic trace is checked at before it is trusted: twice the longer
#: fitted length, with two layers more than traced (the chunked loss's ops grow with the length:
#: a MEMO check at 1M costs 6 s, at 512K 3.5 s).
CHECK_SEQ = 2 * FIT_SEQS[1]


@dataclass
class LayoutModel:
    """Predictions for one layout at any sequence length (two traces per traced stage)."""

    layout: Layout
    hardware: dict
    global_batch: int
    allocator: str
    host_capacity_bytes: int
    stages: list[StageModel]
    efficiency: Efficiency
    model_argv: list[str] = field(default_factory=list)
    _cache: dict = field(default_factory=dict)

    @classmethod
    def build(cls, model_argv: list[str], layout: Layout, hardware: dict, *, global_batch: int,
              cache: TraceCache, allocator: Optional[str] = None,
              host_memory_gb_per_node: Optional[float] = None,
              fit_seqs: tuple[int, int] = FIT_SEQS, num_layers: Optional[int] = None,
              symbolic: bool = True, exhaustive: bool = False) -> "LayoutModel":
        """``fit_seqs``: the two lengths traced (tokens). The line through them is exact at any
        length where every request grows linearly, and only there: a buffer capped by a chunk
        size (the chunked loss's logits, memo_ext.loss) is flat between two lengths above the
        cap and smaller below it, so predict below FIT_SEQS[0] from traces at or around the
        length asked for.

        ``symbolic`` (a policy of SYMBOLIC_LAYERS, and a stage deeper than its traced layers
        + 2; ``num_layers`` is the model's): each stage is traced with the policy's few layers
        at the two lengths plus its own persistent state (memo_ext.estimate.symbolic), else
        whole at the two lengths. A
        symbolic stage is not trusted before :meth:`check`. ``exhaustive``: no line at all,
        the whole stage traced at every length asked (the reference the others are compared
        with; slow)."""
        microbatches = max(1, global_batch // (layout.dp * layout.micro_batch))
        num_layers = num_layers or model_layers(model_argv)
        stage_layers = None if num_layers is None else num_layers // layout.pp
        stages = []
        for stage in layout.stages(microbatches):
            argv = layout.trace_argv(model_argv, stage) + gpu_argv(hardware)
            if exhaustive:
                stages.append(StageModel(stage, None, checked=True, traced=(cache, argv)))
                continue
            shape = None if stage_layers is None else layout.symbolic_shape(stage_layers, stage)
            if symbolic and shape is not None and stage_layers > shape.check_layers:
                few = layout.traced_layers_argv(model_argv, stage, shape.layers,
                                                shape.checkpoint_layers) + gpu_argv(hardware)
                first, second = (cache.trace(few, seq) for seq in fit_seqs)
                # The persistent state does not depend on the policy (weights, gradients and
                # optimizer state are the model's): one trace serves every policy of a layout.
                plain = Layout(layout.tp, layout.cp, layout.pp, layout.dp, "megatron-none",
                               micro_batch=layout.micro_batch)
                state = cache.trace([*plain.trace_argv(model_argv, stage), *gpu_argv(hardware),
                                     "--persistent-only"], fit_seqs[0])
                trace = SymbolicTrace.from_traces(first, second, shape.copied, shape.period)
                trace.coefficients(stage_layers, state)  # an expansion that fails, fails here
                stages.append(StageModel(
                    stage, WorkLine.from_headers(*trace.work_headers(stage_layers, state)),
                    symbolic=trace, state=state, layers=stage_layers, shape=shape))
                continue
            first, second = (cache.trace(argv, seq) for seq in fit_seqs)
            stages.append(StageModel(stage, WorkLine.from_headers(first.header, second.header),
                                     line=LinearTrace.from_traces(first, second),
                                     checked=True))
        host = host_memory_gb_per_node or hardware["host_memory_gb_per_node"]
        return cls(layout=layout, hardware=hardware, global_batch=global_batch,
                   allocator=allocator or ("arena" if layout.policy == "memo" else "caching"),
                   host_capacity_bytes=int(float(host) * 1e9), stages=stages,
                   efficiency=Efficiency.from_profile(hardware), model_argv=list(model_argv))

    @property
    def checked(self) -> bool:
        return all(stage.checked for stage in self.stages)

    def check(self, cache: TraceCache) -> None:
        """Compare each symbolic stage with a real trace of two layers (or a period) more than
        traced at CHECK_SEQ tokens (SymbolicTrace.check); raises SymbolicError on a
        mismatch."""
        for model in self.stages:
            if model.checked:
                continue
            deeper = self.layout.traced_layers_argv(
                self.model_argv, model.stage, model.shape.check_layers,
                model.shape.check_checkpoint_layers) + gpu_argv(self.hardware)
            model.symbolic.check(cache.trace(deeper, CHECK_SEQ - CHECK_SEQ % self.multiple))
            model.checked = True

    def trusted(self, cache: TraceCache) -> tuple["LayoutModel", Optional[str]]:
        """This model once :meth:`check` passes, else the layout built again with its stages
        traced whole; and why the symbolic trace was refused (None if it was not)."""
        try:
            self.check(cache)
            return self, None
        except SymbolicError as exc:
            whole = LayoutModel.build(
                self.model_argv, self.layout, self.hardware, global_batch=self.global_batch,
                cache=cache, allocator=self.allocator,
                host_memory_gb_per_node=self.host_capacity_bytes / 1e9, symbolic=False)
            return whole, f"symbolic trace refused ({exc}); traced whole"

    def predict(self, seq: int) -> Prediction:
        """Memory and time at ``seq`` tokens (the memory side is memoised per length). The
        kernels' efficiencies are read at the stage's shapes (memo_ext.estimate.kernels)."""
        per_stage = []
        for model in self.stages:
            key = (model.stage.index, seq)
            if key not in self._cache:
                trace = model.at(seq)
                memory = estimate_at(trace, int(self.hardware["device_memory_bytes"]),
                                     self.allocator, REPLAY_ITERATIONS)
                self._cache[key] = (trace.header, persistent_bytes(trace),
                                    model.work_at(seq, trace), memory,
                                    tuple(host_slot_bytes(trace)))
            header, persistent, work, memory, slots = self._cache[key]
            efficiency = at_model_shapes(self.efficiency, self.hardware, header["model"],
                                         header["layout"])
            step = predict_step(
                work, header, self.hardware, efficiency,
                global_batch=self.global_batch, persistent=persistent,
                reorganisations_per_iteration=memory.reorganisations / REPLAY_ITERATIONS)
            per_stage.append(StagePrediction(model.stage, memory, step, slots))
        ranks_per_node = min(int(self.hardware["gpus_per_node"]), self.layout.gpus)
        return Prediction(self.layout, seq, per_stage, self.host_capacity_bytes, ranks_per_node,
                          self.hardware.get("device_type", "cuda"))

    @property
    def multiple(self) -> int:
        """Lengths are rounded down to a multiple of this (CP's load-balanced chunks, TP's
        sequence-parallel shards)."""
        return 2 * self.layout.tp * self.layout.cp

    def bound_fits(self, seqs: list[int]) -> np.ndarray:
        """Whether each of ``seqs`` passes the allocated-peak bounds (device, with the memory
        outside the allocator, and host, every rank of a node): a length that fails cannot
        fit in any allocator model, with no replay."""
        capacity = int(self.hardware["device_memory_bytes"])
        ranks_per_node = min(int(self.hardware["gpus_per_node"]), self.layout.gpus)
        fits = np.ones(len(seqs), dtype=bool)
        least_host = None
        for model in self.stages:
            device, host, external = model.peak_bounds(seqs)
            fits &= device + external <= capacity
            least_host = host if least_host is None else np.minimum(least_host, host)
        # Every rank of a node holds at least the smallest stage's slots, unrounded (the host
        # model, memo_ext.estimate.host_memory, sums each rank's own stage and adds more).
        if least_host is not None:
            fits &= least_host * ranks_per_node <= self.host_capacity_bytes
        return fits

    def longest(self, step: int, maximum: int, fine_step: Optional[int] = None) -> int:
        """Longest sequence that fits (device and host), in ``step`` tokens (0 if none); below
        ``step``, in ``fine_step`` tokens. Solved, not searched: the lengths whose allocated
        peak fits (:meth:`bound_fits`, no replay) are replayed longest first until one fits; the
        step above the answer failed its bound or its replay. Records the replays made in
        ``self.replays``. An exhaustive model searches (:meth:`longest_by_search`)."""
        if any(model.traced is not None for model in self.stages):
            return self.longest_by_search(step, maximum, fine_step)
        grids = [list(range(step, maximum + 1, step))]
        if fine_step:
            grids.append(list(range(fine_step, step, fine_step)))
        self.replays = []
        for grid in grids:
            rounded = [seq - seq % self.multiple for seq in grid]
            candidates = [seq for seq, ok in zip(rounded, self.bound_fits(rounded)) if ok and seq]
            for seq in reversed(candidates):
                fits = self.predict(seq).fits
                self.replays.append((seq, fits))
                if fits:
                    return seq
        return 0

    def longest_by_search(self, step: int, maximum: int,
                          fine_step: Optional[int] = None) -> int:
        """:meth:`longest` by bisection, a replay per probe (the answer before the solver, and
        the reference it is compared with in bench/estimator_speed.py)."""
        def estimate(seq: int):
            seq -= seq % self.multiple
            return _FitOnly(self.predict(seq).fits if seq else True)

        return max_sequence_length(estimate, step, maximum, fine_step)


@dataclass
class _FitOnly:
    fits: bool


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
                      offload_buffers: tuple[int, ...] = (2,)
                      ) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """(layouts worth tracing, [(layout, why it was dropped)]) for ``gpus`` GPUs.

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
                    for (alpha, recompute_layers, count, fp8, buffers), tiles, micro_batch in \
                            itertools.product(variants, mlp_tiles, micro_batches):
                        # A tiled layout tiles the whole layer: the MLP, the attention's
                        # projections, and the core attention by chunks of query groups.
                        chunks = math.gcd(groups // tp, MAX_HEAD_CHUNKS) if tiles else 1
                        layout = Layout(tp, cp, pp, dp, policy, alpha, micro_batch,
                                        recompute_layers, count, fp8, tiles,
                                        projection_tiles=tiles, head_chunks=chunks,
                                        offload_buffers=buffers)
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
        / (layout.dp * layout.cp)
    if persistent >= device:
        return (f"weights, gradients and optimizer state alone need {persistent / 2**30:.0f} "
                f"GiB per rank")
    return None


def build_layout_model(model_argv: list[str], layout: Layout, hardware: dict, *,
                       cache: TraceCache, **options) -> tuple[LayoutModel, Optional[str]]:
    """A trusted LayoutModel (:meth:`LayoutModel.trusted`) and why its symbolic trace was
    refused (None if it was not). ``options``: the keywords of :meth:`LayoutModel.build`."""
    try:
        model = LayoutModel.build(model_argv, layout, hardware, cache=cache, **options)
    except SymbolicError as exc:  # the traces are not a pass over the layers
        options["symbolic"] = False
        return (LayoutModel.build(model_argv, layout, hardware, cache=cache, **options),
                f"symbolic trace refused ({exc}); traced whole")
    return model.trusted(cache)


class Progress:
    """``[done/total]`` lines over a search's layouts, from several threads (layouts a search
    decides not to trace count as done too)."""

    def __init__(self, total: int, log: Callable[[str], None]) -> None:
        self.total, self.done, self.log = total, 0, log
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self.done += 1
            self.log(f"[{self.done}/{self.total}] {line}")


def build_models(model_argv: list[str], layouts: list[Layout], hardware: dict, *,
                 global_batch: int, cache: TraceCache, jobs: int = 2,
                 host_memory_gb_per_node: Optional[float] = None,
                 log: Callable[[str], None] = lambda line: None,
                 num_layers: Optional[int] = None, exhaustive: bool = False,
                 trust: bool = True, progress: Optional[Progress] = None
                 ) -> tuple[list[LayoutModel], list[tuple[Layout, str]]]:
    """A LayoutModel per layout, ``jobs`` at a time, trusted (:func:`build_layout_model`)
    unless ``trust`` is False: then a symbolic one is checked only when it is used (a search
    checks the layouts it answers with: memo_ext.estimate.search); layouts whose tracing fails
    are returned with the reason. ``progress`` (default: a :class:`Progress` over ``layouts``
    into ``log``) hears each layout as it is done."""
    progress = progress or Progress(len(layouts), log)

    def build(layout: Layout):
        try:
            options = dict(exhaustive=exhaustive, global_batch=global_batch,
                           num_layers=num_layers, host_memory_gb_per_node=host_memory_gb_per_node)
            if trust:
                model, refused = build_layout_model(model_argv, layout, hardware, cache=cache,
                                                    **options)
            else:
                try:
                    model, refused = LayoutModel.build(model_argv, layout, hardware,
                                                       cache=cache, **options), None
                except SymbolicError as exc:
                    model = LayoutModel.build(model_argv, layout, hardware, cache=cache,
                                              **{**options, "symbolic": False})
                    refused = f"symbolic trace refused ({exc}); traced whole"
            result, line = (model, None), f"traced {layout.describe()}" + (
                f": {refused}" if refused else "")
        except (EstimateError, CostModelError) as exc:
            result, line = (None, (layout, str(exc))), f"not predicted: {layout.describe()}"
        progress(line)
        return result

    # Twice as many builders as tracers: a builder's own work between its traces (reading,
    # fitting) would otherwise leave its tracer idle.
    with ThreadPoolExecutor(max_workers=2 * max(1, jobs)) as pool:
        results = list(pool.map(build, layouts))
    return ([m for m, _ in results if m is not None],
            [failure for _, failure in results if failure is not None])
