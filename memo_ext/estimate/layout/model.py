"""Layout models: a layout predicted at any sequence length from two traces per traced stage
(whole, or symbolically from a few layers), and many of them built in parallel."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from memo_ext.estimate.cost import (
    CostModelError,
    Efficiency,
    WorkLine,
    persistent_bytes,
    predict_step,
)
from memo_ext.estimate.host_memory import (
    OptimizerHostTensors,
    host_optimizer_tensors,
    host_slot_bytes,
    stage_of_rank,
)
from memo_ext.estimate.kernels import at_model_shapes, kernel_rows_line
from memo_ext.estimate.layout.prediction import Prediction, StagePrediction
from memo_ext.estimate.layout.spec import (
    FIT_SEQS,
    REPLAY_ITERATIONS,
    Layout,
    Stage,
)
from memo_ext.estimate.layout.trace_cache import TraceCache
from memo_ext.estimate.memory import (
    EstimateError,
    LinearTrace,
    estimate_at,
    max_sequence_length,
)
from memo_ext.estimate.symbolic import SymbolicError, SymbolicTrace, live_lines
from memo_ext.estimate.symbolic_shape import SymbolicShape
from memo_ext.trace import POOL_DEVICE, POOL_EXTERNAL, POOL_HOST, Trace
from memo_ext.trace.request import TracedModel, TraceRequest

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
    traced: Optional[tuple[TraceCache, TraceRequest]] = None  # exhaustive: each length
    _lines: Optional[list] = field(default=None, repr=False)

    def at(self, seq: int) -> Trace:
        if self.traced is not None:
            cache, request = self.traced
            return cache.trace(request.replace(seq_length=seq))
        if self.symbolic is None:
            return self.line.at(seq)
        return self.symbolic.at(seq, self.layers, self.state)

    def work_at(self, seq: int, trace: Trace) -> dict:
        """``header["work"]`` at ``seq`` (``trace``: this stage's trace at it)."""
        return trace.header["work"] if self.traced is not None else self.work.at(seq)

    def peak_bounds(self, seqs: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(device, host, outside the allocator) allocated peaks at each of ``seqs`` (bytes):
        the first two are lower bounds of what any allocator model reserves."""
        if self._lines is None:
            if self.symbolic is None:
                self.set_lines(self.line.base.events, self.line.intercepts, self.line.slopes)
            else:
                self.set_lines(*self.symbolic.coefficients(self.layers, self.state))
        return tuple(_max_of_lines(a, b, seqs) for a, b in self._lines)

    def set_lines(self, events: list[dict], intercepts: list, slopes: list) -> None:
        """The live-bytes lines of the three pools, from the stage's events and their sizes'
        lines (made once: an expansion of a deep stage costs 0.4 s)."""
        self._lines = [_undominated(*live_lines(events, intercepts, slopes, pool))
                       for pool in (POOL_DEVICE, POOL_HOST, POOL_EXTERNAL)]


def optimizer_host_tensors(model: TracedModel, layout: Layout, hardware: dict,
                           cache: TraceCache, microbatches: int,
                           seq: int) -> Optional[OptimizerHostTensors]:
    """With --optimizer-cpu-offload, the host tensors of each rank of the first node but its
    tensor-parallel peers, and of each traced stage's first rank, from their persistent state
    (the policy-free trace a symbolic stage shares). The distributed optimizer's shards differ
    by data-parallel rank (bucket padding lands on the last), and so does the offloaded split;
    ranks of later nodes take their stage's first rank's. None without offload."""
    if layout.optimizer_offload is None:
        return None
    plain = layout.persistent_state()
    stages = {stage.index: stage for stage in layout.stages(microbatches)}
    per_node = min(int(hardware["gpus_per_node"]), layout.gpus)
    ranks = {rank for rank in range(per_node) if rank % layout.tp == 0}
    ranks |= {stage.rank for stage in stages.values()}
    by_rank = {}
    for rank in sorted(ranks):
        index = stage_of_rank(rank, layout.tp, layout.cp, layout.dp)
        stage = stages.get(index, stages[0])
        request = plain.trace_request(model, seq, hardware, stage).replace(
            rank=rank, persistent_only=True)
        by_rank[rank] = host_optimizer_tensors(cache.trace(request))
    return OptimizerHostTensors(by_rank, layout.tp, layout.cp, layout.dp)


def _undominated(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lines A + B·s of (``a``, ``b``) that no other line is at or above in both A and B:
    at any length s >= 0 their maximum is the maximum of all (float sums and products are
    monotone, so to the bit). A deep stage's ~100,000 lines shrink to a few, and a search
    bounds each stage at ~100 lengths many times."""
    if not len(a):
        return a, b
    order = np.lexsort((-b, -a))  # A descending, then B descending
    a, b = a[order], b[order]
    keep = np.empty(len(b), dtype=bool)
    keep[0] = True
    keep[1:] = b[1:] > np.maximum.accumulate(b)[:-1]
    return a[keep], b[keep]


def _max_of_lines(a: np.ndarray, b: np.ndarray, seqs: list[int]) -> np.ndarray:
    if not len(a):
        return np.zeros(len(seqs))
    s = np.asarray(seqs, dtype=float)
    return (a[None, :] + b[None, :] * s[:, None]).max(axis=1)


#: The length (tokens) a symbolic trace is checked at before it is trusted: twice the longer
#: fitted length, with two layers more than traced (a length the fits did not see; with the
#: chunked loss's chunks copied by the tracer, a longer one would cost about the same).
CHECK_SEQ = 2 * FIT_SEQS[1]


def _check_request(model: TracedModel, layout: Layout, hardware: dict, stage: Stage,
                   shape: SymbolicShape) -> TraceRequest:
    """The real trace a symbolic stage is checked against (:meth:`LayoutModel.check`): two
    layers (or a period) more than traced, at CHECK_SEQ tokens, without the optimizer's offload
    (its activations are the layout's without it)."""
    return layout.without_optimizer_offload().traced_layers_request(
        model, CHECK_SEQ - CHECK_SEQ % layout.seq_multiple, hardware, stage,
        shape.check_layers, shape.check_checkpoint_layers)


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
    model: Optional[TracedModel] = None
    #: --optimizer-cpu-offload's host tensors of the ranks that stand for a node's
    #: (:func:`optimizer_host_tensors`)
    host_optimizer: Optional[OptimizerHostTensors] = None
    _cache: dict = field(default_factory=dict)

    @classmethod
    def build(cls, model: TracedModel, layout: Layout, hardware: dict, *, global_batch: int,
              cache: TraceCache, allocator: Optional[str] = None,
              host_memory_gb_per_node: Optional[float] = None,
              fit_seqs: tuple[int, int] = FIT_SEQS, num_layers: Optional[int] = None,
              symbolic: bool = True, exhaustive: bool = False,
              prefetch_checks: bool = False) -> "LayoutModel":
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
        with; slow). ``prefetch_checks``: start each symbolic stage's check trace
        (:meth:`check`) with its fit traces, for a caller that checks the model at once."""
        microbatches = max(1, global_batch // (layout.dp * layout.micro_batch))
        num_layers = num_layers or model.num_layers
        stage_layers = None if num_layers is None else num_layers // layout.pp
        # The optimizer's offload moves persistent state only (memo_ext.trace.model_state: its
        # states are allocated at init, its step is not traced), so a symbolic stage's few-layer
        # traces and its check are the layout's without it, shared by every fraction; only the
        # persistent state below is the fraction's own.
        activations = layout.without_optimizer_offload()
        stages = []
        for stage in layout.stages(microbatches):
            request = layout.trace_request(model, fit_seqs[0], hardware, stage)
            if exhaustive:
                stages.append(StageModel(stage, None, checked=True, traced=(cache, request)))
                continue
            shape = None if stage_layers is None else layout.symbolic_shape(stage_layers, stage)
            if symbolic and shape is not None and stage_layers > shape.check_layers:
                few = activations.traced_layers_request(model, fit_seqs[0], hardware, stage,
                                                        shape.layers, shape.checkpoint_layers)
                fits = [few.replace(seq_length=seq) for seq in fit_seqs]
                persistent = layout.persistent_state().trace_request(
                    model, fit_seqs[0], hardware, stage).replace(persistent_only=True)
                checks = ([_check_request(model, layout, hardware, stage, shape)]
                          if prefetch_checks else [])
                # The check first: the longest trace, it would otherwise start last and end last.
                cache.prefetch([*checks, *fits, persistent])
                first, second = (cache.trace(request) for request in fits)
                state = cache.trace(persistent)
                trace = SymbolicTrace.from_traces(first, second, shape.copied, shape.period)
                # An expansion that fails, fails here; the bounds' lines come from it.
                expanded = trace.coefficients(stage_layers, state)
                stages.append(StageModel(
                    stage, WorkLine.from_headers(*trace.work_headers(stage_layers, state)),
                    symbolic=trace, state=state, layers=stage_layers, shape=shape))
                stages[-1].set_lines(*expanded)
                continue
            first, second = (cache.trace(request.replace(seq_length=seq)) for seq in fit_seqs)
            stages.append(StageModel(stage, WorkLine.from_headers(first.header, second.header),
                                     line=LinearTrace.from_traces(first, second),
                                     checked=True))
        host = host_memory_gb_per_node or hardware["host_memory_gb_per_node"]
        return cls(layout=layout, hardware=hardware, global_batch=global_batch,
                   allocator=allocator or ("arena" if layout.policy == "memo" else "caching"),
                   host_capacity_bytes=int(float(host) * 1e9), stages=stages,
                   efficiency=Efficiency.from_profile(hardware), model=model,
                   host_optimizer=optimizer_host_tensors(model, layout, hardware, cache,
                                                         microbatches, fit_seqs[0]))

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
            model.symbolic.check(cache.trace(_check_request(
                self.model, self.layout, self.hardware, model.stage, model.shape)))
            model.checked = True

    def trusted(self, cache: TraceCache) -> tuple["LayoutModel", Optional[str]]:
        """This model once :meth:`check` passes, else the layout built again with its stages
        traced whole; and why the symbolic trace was refused (None if it was not)."""
        try:
            self.check(cache)
            return self, None
        except SymbolicError as exc:
            whole = LayoutModel.build(
                self.model, self.layout, self.hardware, global_batch=self.global_batch,
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
                          self.hardware.get("device_type", "cuda"),
                          kernel_rows_line(self.hardware), self.host_optimizer)

    @property
    def multiple(self) -> int:
        """Lengths are rounded down to a multiple of this (Layout.seq_multiple)."""
        return self.layout.seq_multiple

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



def build_layout_model(model: TracedModel, layout: Layout, hardware: dict, *,
                       cache: TraceCache, **options) -> tuple[LayoutModel, Optional[str]]:
    """A trusted LayoutModel (:meth:`LayoutModel.trusted`) and why its symbolic trace was
    refused (None if it was not). ``options``: the keywords of :meth:`LayoutModel.build`."""
    try:
        layout_model = LayoutModel.build(model, layout, hardware, cache=cache,
                                         prefetch_checks=True, **options)
    except SymbolicError as exc:  # the traces are not a pass over the layers
        options["symbolic"] = False
        return (LayoutModel.build(model, layout, hardware, cache=cache, **options),
                f"symbolic trace refused ({exc}); traced whole")
    return layout_model.trusted(cache)


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


def build_models(model: TracedModel, layouts: list[Layout], hardware: dict, *,
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
                built, refused = build_layout_model(model, layout, hardware, cache=cache,
                                                    **options)
            else:
                try:
                    built, refused = LayoutModel.build(model, layout, hardware,
                                                       cache=cache, **options), None
                except SymbolicError as exc:
                    built = LayoutModel.build(model, layout, hardware, cache=cache,
                                              **{**options, "symbolic": False})
                    refused = f"symbolic trace refused ({exc}); traced whole"
            result, line = (built, None), f"traced {layout.describe()}" + (
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
