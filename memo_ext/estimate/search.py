"""The recommender's search over layouts: each layout at its longest fitting length, ranked.

Three things keep a search short (docs/estimate.md "The recommender"):

- **Bounds before replays.** A layout's allocated-peak bounds (LayoutModel.bound_fits, closed
  form over the whole grid) give the longest length it could fit without any replay. Layouts
  are solved in the order of their bounds, and with a table of ``top`` rows, a layout whose
  bound is shorter than the table's last row is not solved: it cannot enter the table.
- **Dominance before traces.** Of two variants of one parallel layout, the one that recomputes
  fewer layers (no recompute < block recompute of k layers < full recompute) or offloads a
  larger fraction alpha with MEMO keeps a superset of the other's activations on the device
  and on the host (MEMO's device peak grows by up to 2 x alpha x its alpha-split tensors, its
  host bytes with alpha), so it fits no longer a sequence. :func:`search_longest`
  traces the dominating variants first and a dominated one only when its dominating variant's
  answer (or bound) reaches the table; otherwise it cannot enter it. The dominated ones go
  best first, those whose dominating variant reaches furthest before the others. A data-
  parallel shape's most frugal variant is dominated likewise by the same variant with more
  context parallelism (:func:`wider_context`).
- **Checks ahead of the solving.** A layout answered from symbolic traces is checked against a
  real trace before it is trusted (LayoutModel.trusted); :class:`SearchChecks` runs the checks
  of the next layouts in bound order while the current one is solved, and only for layouts
  that can still enter the table.
"""

from __future__ import annotations

import math
from dataclasses import replace
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

from memo_ext.estimate.layout import Layout, LayoutModel, TraceCache


def rank_at(models: list, seq: int) -> list:
    """Every layout's prediction at ``seq`` tokens, fitting ones first, by MFU. ``models``:
    LayoutModels and SPPOLayoutModels (memo_ext.sppo.layout_model)."""
    predictions = [m.predict(seq - seq % m.multiple) for m in models]
    return sorted(predictions, key=lambda p: (not p.fits, -p.mfu))


def bound_longest(model, step: int, maximum: int, fine_step: Optional[int] = None) -> float:
    """The longest length ``model`` could fit by its allocated-peak bounds (no replay);
    infinite for models without bounds (SPPO's analytic ones, exhaustive layouts)."""
    if not hasattr(model, "bound_fits") or any(s.traced is not None for s in model.stages):
        return math.inf
    for grid in ([*range(step, maximum + 1, step)],
                 [*range(fine_step, step, fine_step)] if fine_step else []):
        rounded = [seq - seq % model.multiple for seq in grid]
        passing = [seq for seq, ok in zip(rounded, model.bound_fits(rounded)) if ok and seq]
        if passing:
            return max(passing)
    return 0


def _recomputed_layers(layout: Layout) -> Optional[int]:
    """Layers per stage recomputed by a Megatron policy (None: not a Megatron policy)."""
    return {"megatron-none": 0, "megatron": math.inf}.get(
        layout.policy, layout.recompute_layers if layout.policy == "megatron-block" else None)


def dominating(layout: Layout, layouts: list[Layout], steps: tuple = ()) -> Optional[Layout]:
    """The layout among ``layouts`` that fits at least as long a sequence as ``layout`` on a
    grid of ``steps`` (tokens): its more frugal variant (:func:`frugal_variant`), else, for a
    family's most frugal variant, the same variant with more context parallelism
    (:func:`wider_context`). None when there is neither."""
    return frugal_variant(layout, layouts) or wider_context(layout, layouts, steps)


def wider_context(layout: Layout, layouts: list[Layout], steps: tuple = ()) -> Optional[Layout]:
    """The same variant of ``layout`` among ``layouts`` with CP k times larger and DP k times
    smaller (k the smallest prime factor of DP), for a layout with CP > 1 and no pipeline
    parallelism; None when there is none.

    At one sequence length its ranks keep no more than ``layout``'s: the same communicators
    (TP, CP and DP x CP), the weights and gradients TP's shards either way, the distributed
    optimizer's states sharded over DP x CP ranks (the same count), and every activation, ring
    block and offloaded slot cut from a rank's CP shard of the sequence, k times shorter (the
    RoPE table, over the whole sequence, is the same). A node holds as many ranks, each with
    fewer host bytes. So it fits no shorter a sequence, and the data-parallel layout is traced
    only when the context-parallel one reaches the table. Not from CP = 1 (no ring, and one
    communicator fewer than any CP layout) nor with PP (more micro-batches, DP being smaller,
    can put more of them in flight on the first stage). Its length multiple (2 x TP x CP) is
    k times larger: on a grid of ``steps`` that it does not divide, its answers would be
    rounded below the grid, so there it dominates nothing."""
    if layout.pp != 1 or layout.dp == 1 or layout.cp == 1:
        return None
    k = next(p for p in range(2, layout.dp + 1) if layout.dp % p == 0)
    wider = replace(layout, cp=layout.cp * k, dp=layout.dp // k)
    if any(step % wider.seq_multiple for step in steps if step):
        return None
    return wider if wider in layouts else None


def frugal_variant(layout: Layout, layouts: list[Layout]) -> Optional[Layout]:
    """The variant of ``layout`` among ``layouts`` (same TP, CP, PP, DP and micro-batch) that
    keeps the least more than ``layout`` spares: an untiled layer's tiled variant (the fewest
    tiles), else, at the same tiles, the next Megatron policy that recomputes more layers, or
    MEMO at the next smaller alpha. None when there is none (a family's most frugal variant,
    MEMO against Megatron: neither keeps a subset of the other's)."""
    # Optimizer offload fractions are not paired: a larger one keeps less on the device but
    # more on the host, so neither variant keeps a subset of the other's. They share their
    # activation traces (LayoutModel.build) and are pruned by their bounds.
    def same_shape(other: Layout) -> bool:
        return (other.tp, other.cp, other.pp, other.dp, other.micro_batch,
                other.optimizer_offload) == (layout.tp, layout.cp, layout.pp, layout.dp,
                                             layout.micro_batch, layout.optimizer_offload)

    candidates = [other for other in layouts if same_shape(other) and other != layout]
    if layout.policy == "memo" and layout.offload_buffers == 2:
        # One buffer holds a subset of two buffers' bytes, the rest of the layer alike, and so
        # does a stage with at least as many layers in (b) (below). One buffer offloads one
        # layer more, so the same fraction of layers in (b) may be one layer more there.
        single = [o for o in candidates if o.offload_buffers == 1
                  and o.checkpoint_layers >= layout.checkpoint_layers
                  and o == replace(layout, offload_buffers=1,
                                   checkpoint_layers=o.checkpoint_layers)]
        if single:
            return min(single, key=lambda o: o.checkpoint_layers)
    if not layout.mlp_tiles:
        # The tiled layer keeps a subset of the untiled one's tensors (the MLP's and the
        # projections' inputs alone, one tile's intermediates and one head chunk's attention
        # buffers at a time; with its norms in the tiles, not even their outputs), so the
        # tiled variant of a policy is the frugal one.
        tiled = [o for o in candidates if o.mlp_tiles and o == replace(
            layout, mlp_tiles=o.mlp_tiles, projection_tiles=o.projection_tiles,
            head_chunks=o.head_chunks, tile_norms=o.tile_norms)]
        if tiled:
            return min(tiled, key=lambda o: o.mlp_tiles)
    candidates = [o for o in candidates if o.mlp_tiles == layout.mlp_tiles]
    if layout.policy == "memo":
        same = [o for o in candidates if o.policy == "memo"
                and (o.offload_fp8, o.offload_buffers)
                == (layout.offload_fp8, layout.offload_buffers)]
        frugal = [o for o in same if o.alpha < layout.alpha
                  and o.checkpoint_layers == layout.checkpoint_layers]
        if frugal:
            return max(frugal, key=lambda o: o.alpha)
        # A stage mixing (a) and (b) layers holds at least what the stage with every layer in
        # (b) holds: its (a) layers keep their attention output in the buffer where a (b)
        # layer recomputes it, and its host slots are larger (7B, TP=4 CP=2, one buffer, at
        # 4.25M tokens: 78.07 against 77.80 GiB per rank, docs/memo_offload_modes.md). The
        # stage with the most (b) layers bounds the mix's longest length. With no layer in (b)
        # there is no such bound: (a) alone can hold less.
        more = [o for o in same if o.checkpoint_layers > layout.checkpoint_layers]
        if layout.checkpoint_layers and more:
            return max(more, key=lambda o: o.checkpoint_layers)
        return None
    recomputed = _recomputed_layers(layout)
    if recomputed is None:
        return None
    frugal = [o for o in candidates
              if _recomputed_layers(o) is not None and _recomputed_layers(o) > recomputed]
    return min(frugal, key=_recomputed_layers, default=None)


class SearchChecks:
    """The checks of a search (:meth:`LayoutModel.trusted`), ``jobs`` at a time, each run
    once; :class:`LongestRanking` asks for those of the next layouts in bound order while it
    solves the current one. (Starting them during the tracing, for the layouts whose bounds
    lead so far, checked three times as many layouts for 7B on 8 GPUs: the early leaders are
    rarely the final ones.)"""

    def __init__(self, cache: TraceCache, jobs: int) -> None:
        self.cache = cache
        self.jobs = max(1, jobs)
        self._pool = ThreadPoolExecutor(max_workers=self.jobs)
        self._futures: dict[int, Future] = {}

    def future(self, model: LayoutModel) -> Future:
        if id(model) not in self._futures:
            self._futures[id(model)] = self._pool.submit(model.trusted, self.cache)
        return self._futures[id(model)]

    def cancel(self, model: LayoutModel) -> None:
        """Drop ``model``'s check if it has not started (it is no longer needed)."""
        future = self._futures.get(id(model))
        if future is not None:
            future.cancel()

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


class LongestRanking:
    """Layouts at their own longest fitting sequences. Models are offered (:meth:`offer`: their
    bounds are computed, they wait unsolved) and solved best bound first (:meth:`solve_best`);
    :meth:`add` offers a batch and solves it. :meth:`ranked` is longest first, then by MFU.
    With ``top``, a layout whose bound is shorter than the table's last row so far is not
    solved. With ``checks``, each layout solved is trusted first. ``upper`` holds, per traced
    layout settled, the longest length it can fit: its answer, or its bound when it was not
    solved (what :func:`search_longest` prunes the variants it dominates with). ``log`` hears
    each answer and the best so far as soon as they are known."""

    def __init__(self, step: int, maximum: int, fine_step: Optional[int] = None,
                 top: Optional[int] = None, log: Callable[[str], None] = lambda line: None,
                 checks: Optional[SearchChecks] = None) -> None:
        self.step, self.maximum, self.fine_step = step, maximum, fine_step
        self.top, self.log, self.checks = top, log, checks
        self.predictions: list = []
        self.upper: dict = {}
        #: (bound, model) offered and not yet settled, best bound first
        self.pending: list = []

    def threshold(self) -> float:
        """The length a layout must reach to enter the table (0 until ``top`` rows exist)."""
        if not self.top or len(self.predictions) < self.top:
            return 0
        return self.ranked()[self.top - 1].seq

    def ranked(self) -> list:
        return sorted(self.predictions, key=lambda p: (-p.seq, -p.mfu))

    def offer(self, models: list) -> None:
        """Bound ``models`` and keep them to be solved (stable: equal bounds keep their
        order)."""
        bounds = [bound_longest(m, self.step, self.maximum, self.fine_step) for m in models]
        self.pending = sorted([*self.pending, *zip(bounds, models)], key=lambda item: -item[0])

    def best_bound(self) -> float:
        """The best bound among the models offered and not settled (-inf when none)."""
        return self.pending[0][0] if self.pending else -math.inf

    def add(self, models: list) -> "LongestRanking":
        self.offer(models)
        while self.pending:
            self.solve_best()
        return self

    def solve_best(self) -> None:
        """Settle the pending model with the best bound: not solved when the bound is below the
        table, else trusted (with ``checks``) and solved."""
        bound, model = self.pending.pop(0)
        if bound < self.threshold():
            self.log(f"not solved: {_name(model)}: its bound, {bound:.0f} tokens, is "
                     "below the table")
            self._remember(model, bound)
            if self.checks is not None:
                self.checks.cancel(model)
            return
        if self.checks is not None and hasattr(model, "trusted"):
            model = self._trusted(model, [(bound, model), *self.pending])
        longest = model.longest(self.step, self.maximum, self.fine_step)
        self._remember(model, longest)
        if not longest:
            self.log(f"{_name(model)}: nothing fits")
            return
        self.predictions.append(model.predict(longest - longest % model.multiple))
        best = self.ranked()[0]
        self.log(f"{_name(model)}: {longest} tokens; best so far {best.describe()} at "
                 f"{best.seq} tokens, MFU {best.mfu:.1%}")

    def _remember(self, model, upper: float) -> None:
        if hasattr(model, "layout"):  # a traced layout (SPPO's analytic ones dominate none)
            self.upper[model.layout] = upper

    def _trusted(self, model: LayoutModel, ahead: list) -> LayoutModel:
        """``model`` once its check passed, starting the checks of the next layouts that can
        still enter the table (``ahead``: this one and those after it, in bound order)."""
        threshold = self.threshold()
        for bound, later in ahead[:self.checks.jobs]:
            if bound >= threshold and hasattr(later, "trusted"):
                self.checks.future(later)
        model, refused = self.checks.future(model).result()
        if refused:
            self.log(f"{_name(model)}: {refused}")
        return model


def _name(model) -> str:
    return model.layout.describe() if hasattr(model, "layout") else \
        f"TP={model.tp} PP={model.pp} SPPO"


def rank_longest(models: list, step: int, maximum: int, fine_step: Optional[int] = None,
                 top: Optional[int] = None, log: Callable[[str], None] = lambda line: None,
                 checks: Optional[SearchChecks] = None) -> list:
    """``models`` at their longest fitting sequences, ranked (:class:`LongestRanking`)."""
    return LongestRanking(step, maximum, fine_step, top, log, checks).add(models).ranked()


def search_longest(layouts: list[Layout], build: Callable[[list[Layout]], list],
                   ranking: LongestRanking, untraced: list = (),
                   log: Callable[[str], None] = lambda line: None, batch: int = 4) -> list:
    """``layouts`` (and the ``untraced`` models, e.g. SPPO's analytic ones) ranked at their
    longest fitting sequences, tracing a layout only when it can enter the table: after the
    variant that dominates it (:func:`dominating`), and not at all when that variant's answer,
    or its bound, is already below the table. ``build(layouts)`` returns their models (layouts
    it could not predict are left out). Returns the ranking's table.

    Best first, a branch and bound over two kinds of work: solving a traced layout (its reach
    is its bound) and tracing layouts that wait (their reach is their dominating variant's
    answer or bound). The undominated layouts are traced first, all at once (nothing bounds
    them before their traces). Then, each time, whichever reaches further goes next, solving
    on a tie: a traced layout is solved, or the ``batch`` waiting layouts that reach furthest
    are traced. So the table fills with the longest rows before a shorter shape's layouts
    are solved or its variants traced, and those are pruned against it. (Solving every traced
    layout as soon as it was traced filled 7B's table on 8 GPUs with three shapes' 2.4M rows,
    each checked by a trace, before the variants of the 4.46M shape came up.)"""
    steps = (ranking.step, ranking.fine_step)
    partner = {layout: dominating(layout, layouts, steps) for layout in layouts}

    def offer_built(traced: list[Layout], models: list) -> None:
        built = {model.layout for model in models}
        for layout in traced:  # not predicted: nothing it dominates can be pruned by it
            if layout not in built:
                ranking.upper[layout] = math.inf
        ranking.offer(models)

    # The undominated layouts are traced whatever the table holds: their tracing starts at
    # once, and the untraced models (SPPO's, ~11 s of solving for 7B on 8 GPUs) are solved
    # meanwhile rather than before it.
    roots = [layout for layout in layouts if partner[layout] is None]
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(build, roots) if roots else None
        ranking.add(list(untraced))
        if first is not None:
            offer_built(roots, first.result())
    waiting = [layout for layout in layouts if partner[layout] is not None]

    def reach(layout: Layout) -> float:
        frugal = partner[layout]
        return math.inf if frugal is None else ranking.upper[frugal]

    while waiting or ranking.pending:
        ready = [layout for layout in waiting
                 if partner[layout] is None or partner[layout] in ranking.upper]
        for layout in ready:
            if reach(layout) < ranking.threshold():
                frugal = partner[layout]
                ranking.upper[layout] = ranking.upper[frugal]
                log(f"not traced: {layout.describe()}: it keeps more than "
                    f"{frugal.describe()}, which fits {ranking.upper[frugal]:.0f} tokens at "
                    "most, below the table")
        pruned = [layout for layout in ready if layout in ranking.upper]
        waiting = [layout for layout in waiting if layout not in pruned]
        ready = sorted((layout for layout in ready if layout not in ranking.upper),
                       key=lambda layout: -reach(layout))  # stable: ties keep their order
        furthest = reach(ready[0]) if ready else -math.inf
        if ranking.pending and (ranking.best_bound() >= furthest
                                or ranking.best_bound() < ranking.threshold()):
            ranking.solve_best()
            continue
        if not ready:
            if not pruned and not ranking.pending:
                # dominating() pairs never cycle; a cycle would loop here forever
                raise ValueError("layouts wait on each other's answers: "
                                 f"{[layout.describe() for layout in waiting]}")
            continue
        traced = ready[:batch]
        waiting = [layout for layout in waiting if layout not in traced]
        offer_built(traced, build(traced))
    return ranking.ranked()
