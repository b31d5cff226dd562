"""memo_ext.estimate.search: which variant dominates which, and that a search traces, checks
and solves only the layouts that can still enter its table. The layout models here are stand-ins
with given answers and bounds (the solver itself is tested on traced models in
test_symbolic.py); what is tested is the search's bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field

from memo_ext.estimate.layout import Layout, Progress
from memo_ext.estimate.search import (
    LongestRanking,
    SearchChecks,
    dominating,
    search_longest,
)

STEP, MAXIMUM = 65536, 2 << 20


@dataclass
class Answer:
    layout: object
    seq: int
    mfu: float

    def describe(self) -> str:
        return getattr(self.layout, "describe", lambda: "untraced")()


@dataclass
class StandIn:
    """A layout model answering ``answer`` with allocated-peak bound ``bound`` (tokens)."""

    layout: Layout
    answer: int
    bound: int
    mfu: float = 0.5
    checked: list = field(default_factory=list)
    multiple = 1
    stages = ()

    def bound_fits(self, seqs):
        return [seq <= self.bound for seq in seqs]

    def longest(self, step, maximum, fine_step=None):
        return self.answer

    def predict(self, seq):
        return Answer(self.layout, seq, self.mfu)

    def trusted(self, cache):
        self.checked.append(self.layout)
        return self, None


@dataclass
class Untraced:
    """An SPPO-like model: no layout, no bound."""

    answer: int
    mfu: float = 0.3
    multiple = 1
    tp = pp = 1

    def longest(self, step, maximum, fine_step=None):
        return self.answer

    def predict(self, seq):
        return Answer(None, seq, self.mfu)


def _variants(tp=1, cp=1, dp=8):
    return {name: Layout(tp, cp, 1, dp, policy, alpha, 1, k) for name, policy, alpha, k in [
        ("none", "megatron-none", None, None), ("block2", "megatron-block", None, 2),
        ("block4", "megatron-block", None, 4), ("full", "megatron", None, None),
        ("memo0", "memo", 0.0, None), ("memo.5", "memo", 0.5, None), ("memo1", "memo", 1.0, None)]}


def test_dominating_pairs_variants_of_one_shape():
    """Each variant's partner is the next more frugal one of its family and shape; from CP=1
    none crosses to another shape (one communicator fewer than any CP layout)."""
    mine, other = _variants(), _variants(dp=4, cp=2)
    layouts = [*mine.values(), *other.values()]
    partners = {name: dominating(layout, layouts) for name, layout in mine.items()}
    assert partners == {"none": mine["block2"], "block2": mine["block4"],
                        "block4": mine["full"], "full": None, "memo0": None,
                        "memo.5": mine["memo0"], "memo1": mine["memo.5"]}
    # without block recompute, no recompute's partner is full recompute; MEMO never pairs
    # with Megatron
    plain = [mine["none"], mine["full"], mine["memo1"]]
    assert dominating(mine["none"], plain) == mine["full"]
    assert dominating(mine["memo1"], plain) is None


def test_a_data_parallel_shape_is_dominated_by_more_context_parallelism():
    """A family's most frugal variant at CP > 1 and DP > 1 pairs with the same variant at CP
    times the smallest prime factor of DP (DP divided by it); its other variants keep pairing
    within the shape. Not with PP, not from CP=1, not when the wider shape's length multiple
    does not divide the search's grid, and not when that shape is not a candidate."""
    from dataclasses import replace

    cp2, cp4, cp8 = _variants(cp=2, dp=4), _variants(cp=4, dp=2), _variants(cp=8, dp=1)
    layouts = [*cp2.values(), *cp4.values(), *cp8.values()]
    for name in ("full", "memo0"):
        assert dominating(cp2[name], layouts) == cp4[name]
        assert dominating(cp4[name], layouts) == cp8[name]
        assert dominating(cp8[name], layouts) is None  # DP=1
    assert dominating(cp2["memo1"], layouts) == cp2["memo.5"]
    assert dominating(cp2["none"], layouts) == cp2["block2"]
    # DP=3 (a prime): CP x 3
    cp2dp3, cp6 = replace(cp2["full"], dp=3), replace(cp2["full"], cp=6, dp=1)
    assert dominating(cp2dp3, [cp2dp3, cp6]) == cp6
    # the wider shape's multiple, 2 x TP x CP = 16, divides 65536 but not 65536 + 8
    assert dominating(cp4["full"], layouts, steps=(65536, 4096)) == cp8["full"]
    assert dominating(cp4["full"], layouts, steps=(65536 + 8,)) is None
    assert dominating(cp4["full"], [cp4["full"]]) is None
    piped = {name: replace(layout, pp=2) for name, layout in cp2.items()}
    wider = replace(piped["full"], cp=4, dp=2)
    assert dominating(piped["full"], [*piped.values(), wider]) is None
    cp1 = _variants(cp=1, dp=8)
    assert dominating(cp1["full"], [cp1["full"], replace(cp1["full"], cp=2, dp=4)]) is None


def test_untiled_variant_is_dominated_by_its_tiled_one():
    """An untiled MLP's partner is the same variant tiled (the fewest tiles); tiled variants
    pair among themselves at the same tile count, as untiled ones do."""
    from dataclasses import replace

    mine = _variants()
    tiled = {name: replace(layout, mlp_tiles=16) for name, layout in mine.items()}
    more = replace(mine["memo.5"], mlp_tiles=64)
    layouts = [*mine.values(), *tiled.values(), more]
    assert all(dominating(layout, layouts) == tiled[name] for name, layout in mine.items())
    assert dominating(tiled["memo1"], layouts) == tiled["memo.5"]
    assert dominating(tiled["none"], layouts) == tiled["block2"]
    assert dominating(tiled["full"], layouts) is None and dominating(more, layouts) is None
    # --memo-tile-norms in a search: the tiled layouts carry it, and still dominate
    normed = {name: replace(layout, tile_norms=True) for name, layout in tiled.items()}
    layouts = [*mine.values(), *normed.values()]
    assert all(dominating(layout, layouts) == normed[name] for name, layout in mine.items())
    assert dominating(normed["memo1"], layouts) == normed["memo.5"]


def test_candidates_with_tile_norms_carry_them_on_tiled_layouts_only():
    """candidate_layouts(tile_norms=True) (tools/estimate.py --recommend --memo-tile-norms) gives
    every tiled layout its norms in the tiles and leaves the untiled ones as they are: the same
    layouts otherwise."""
    from dataclasses import replace

    from memo_ext.estimate.layout import candidate_layouts

    shape = {"num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 4096,
             "num_attention_heads": 8, "vocab_size": 32000}
    hardware = {"gpus_per_node": 8, "device_memory_bytes": 80 * 2**30}
    common = dict(policies=["megatron", "memo"], alphas=[0.0], micro_batches=[1],
                  global_batch=16, mlp_tiles=(0, 16))
    plain, _ = candidate_layouts(shape, 2, hardware, **common)
    normed, _ = candidate_layouts(shape, 2, hardware, tile_norms=True, **common)
    assert any(layout.mlp_tiles for layout in plain) and any(not l.mlp_tiles for l in plain)
    assert normed == [replace(layout, tile_norms=bool(layout.mlp_tiles)) for layout in plain]


def test_two_buffer_variant_is_dominated_by_its_one_buffer_variant():
    """MEMO with two offload buffers holds a superset of one buffer's bytes: its partner is the
    same layout with one buffer; the one-buffer variants pair among themselves as before."""
    from dataclasses import replace

    mine = _variants()
    single = {name: replace(layout, offload_buffers=1) for name, layout in mine.items()
              if layout.policy == "memo"}
    layouts = [*mine.values(), *single.values()]
    for name in single:
        assert dominating(mine[name], layouts) == single[name]
    assert dominating(single["memo1"], layouts) == single["memo.5"]
    assert dominating(single["memo0"], layouts) is None
    assert dominating(mine["block2"], layouts) == mine["block4"]


def test_mixed_stage_is_bounded_by_the_stage_with_more_layers_in_b():
    """A stage mixing (a) and (b) layers pairs with the variant holding the most (b) layers
    (at its alpha chain's end); two buffers pair with one buffer at the next count up (one
    buffer offloads one layer more, so its fractions round one layer higher)."""
    from dataclasses import replace

    base = Layout(4, 2, 1, 1, "memo", 0.0, 1, None, mlp_tiles=16, projection_tiles=16,
                  head_chunks=8)
    one = {c: replace(base, checkpoint_layers=c, offload_buffers=1) for c in (0, 8, 16, 31)}
    two = {c: replace(base, checkpoint_layers=c) for c in (0, 8, 15, 30)}
    mixed_alpha1 = replace(one[16], alpha=1.0)
    layouts = [*one.values(), *two.values(), mixed_alpha1]
    assert dominating(mixed_alpha1, layouts) == one[16]
    assert dominating(one[8], layouts) == one[31] and dominating(one[16], layouts) == one[31]
    assert dominating(one[31], layouts) is None and dominating(one[0], layouts) is None
    assert [dominating(two[c], layouts) for c in (0, 8, 15, 30)] == \
        [one[0], one[8], one[16], one[31]]


def test_search_traces_a_dominated_variant_only_if_it_can_enter_the_table():
    a, b = _variants(tp=2, dp=4), _variants(tp=4, dp=2)
    layouts = [a["full"], a["none"], b["full"], b["none"]]
    models = {a["full"]: StandIn(a["full"], 589824, 655360),
              a["none"]: StandIn(a["none"], 65536, 131072),
              b["full"]: StandIn(b["full"], 196608, 262144),
              b["none"]: StandIn(b["none"], 65536, 65536)}
    built, heard, counted = [], [], []

    def build(wanted):
        built.append(list(wanted))
        return [models[layout] for layout in wanted]

    ranking = LongestRanking(STEP, MAXIMUM, top=2, log=heard.append)
    ranked = search_longest(layouts, build, ranking, untraced=[Untraced(1 << 20)],
                            log=Progress(len(layouts), counted.append))
    # round 1 the frugal variants; b's full recompute is bounded below the table (1M, 576K),
    # so b's no recompute is never traced; a's no recompute is traced and bounded out
    assert built == [[a["full"], b["full"]], [a["none"]]]
    assert [(p.seq, p.layout) for p in ranked] == [(1 << 20, None), (589824, a["full"])]
    assert counted == [f"[1/4] not traced: {b['none'].describe()}: it keeps more than "
                       f"{b['full'].describe()}, which fits 262144 tokens at most, below the "
                       "table"]
    assert f"not solved: {b['full'].describe()}: its bound, 262144 tokens, is below the " \
           "table" in heard
    assert ranking.upper == {a["full"]: 589824, b["full"]: 262144, a["none"]: 131072,
                             b["none"]: 262144}
    # without a table size every layout is traced and solved
    built.clear()
    ranked = search_longest(layouts, build, LongestRanking(STEP, MAXIMUM))
    assert sorted(map(str, (layout for batch in built for layout in batch))) == \
        sorted(map(str, layouts))
    assert len(ranked) == 5 - 1  # the untraced model was not given


def test_dominated_variants_go_best_first_and_are_pruned_by_the_rows_before_them():
    """Traced one at a time, the variant of the shape that reaches furthest comes first; its
    answer fills the table before the other shape's frugal variant is solved, so that one is
    not solved (its bound is below the table) and its own variant, which a round-by-round
    search would have traced, is pruned."""
    a, b = _variants(tp=2, dp=4), _variants(tp=4, dp=2)
    models = {a["full"]: StandIn(a["full"], 524288, 524288),
              b["full"]: StandIn(b["full"], 1 << 20, 1 << 20),
              a["none"]: StandIn(a["none"], 262144, 262144),
              b["none"]: StandIn(b["none"], 786432, 786432)}
    built, counted = [], []

    def build(wanted):
        built.append(list(wanted))
        return [models[layout] for layout in wanted]

    heard = []
    ranked = search_longest([a["full"], a["none"], b["full"], b["none"]], build,
                            LongestRanking(STEP, MAXIMUM, top=2, log=heard.append), batch=1,
                            log=Progress(4, counted.append))
    assert built == [[a["full"], b["full"]], [b["none"]]]
    assert [p.seq for p in ranked] == [1 << 20, 786432]  # no row for a["full"] nor a["none"]
    assert [line.split(": ")[:2] for line in heard][:2] == [
        [b["full"].describe(), "1048576 tokens; best so far TP=4 CP=1 PP=1 DP=2 mbs=1 Megatron "
         "full recompute at 1048576 tokens, MFU 50.0%"],
        [b["none"].describe(), "786432 tokens; best so far TP=4 CP=1 PP=1 DP=2 mbs=1 Megatron "
         "full recompute at 1048576 tokens, MFU 50.0%"]]
    assert heard[2:] == [f"not solved: {a['full'].describe()}: its bound, 524288 tokens, is "
                         "below the table"]
    assert counted == [f"[1/4] not traced: {a['none'].describe()}: it keeps more than "
                       f"{a['full'].describe()}, which fits 524288 tokens at most, below the "
                       "table"]


def test_a_layout_that_fails_to_build_leaves_its_dominated_variants_traced():
    a = _variants()
    built = []

    def build(wanted):
        built.append(list(wanted))
        return [StandIn(layout, 65536, 65536) for layout in wanted if layout != a["full"]]

    search_longest([a["full"], a["none"]], build,
                   LongestRanking(STEP, MAXIMUM, top=1), untraced=[Untraced(1 << 20)])
    assert built == [[a["full"]], [a["none"]]]


def test_checks_run_only_for_layouts_that_can_enter_the_table():
    """A check is started for at most ``jobs`` layouts ahead, and never for one bounded below
    the table when its turn to be started comes."""
    layouts = [Layout(tp, 8 // tp, 1, 1, "megatron") for tp in (1, 2, 4, 8)]
    checked = []
    models = [StandIn(layout, answer, bound, checked=checked) for layout, answer, bound in
              zip(layouts, (917504, 393216, 327680, 262144), (983040, 458752, 393216, 327680))]
    checks = SearchChecks(cache=None, jobs=1)
    try:
        ranked = LongestRanking(STEP, MAXIMUM, top=1, checks=checks).add(models).ranked()
    finally:
        checks.close()
    assert [p.layout for p in ranked] == [layouts[0]]
    assert checked == [layouts[0]]


def test_optimizer_offload_fractions_are_separate_families():
    """Each --optimizer-offload-fraction is its own family of variants: a larger fraction keeps
    less on the device but more on the host, so no variant pairs across fractions (they are
    pruned by their bounds instead); within a fraction the families pair as without it."""
    from dataclasses import replace

    mine = _variants()
    offloaded = {name: replace(layout, optimizer_offload=1.0) for name, layout in mine.items()}
    layouts = [*mine.values(), *offloaded.values()]
    for name, layout in mine.items():
        assert dominating(layout, layouts) == dominating(layout, list(mine.values())), name
        assert dominating(offloaded[name], layouts) == (
            None if dominating(layout, layouts) is None
            else replace(dominating(layout, layouts), optimizer_offload=1.0)), name


def test_candidates_carry_each_offload_fraction():
    """candidate_layouts gives every layout once per fraction (None: the optimizer on the
    device), and only the fraction's device share of Adam's states counts against the device
    before tracing: a model whose states overflow one GPU fits with them on the host."""
    from memo_ext.estimate.flops import parameter_count
    from memo_ext.estimate.layout import candidate_layouts

    shape = {"num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 4096,
             "num_attention_heads": 8, "vocab_size": 32000}
    params = parameter_count(shape)
    # 6 B of weights and gradients per parameter fit, 12 B more of Adam's states do not
    hardware = {"gpus_per_node": 8, "device_memory_bytes": 12 * params}
    common = dict(policies=["megatron", "megatron-none"], alphas=[0.0], micro_batches=[1],
                  global_batch=16)
    plain, plain_dropped = candidate_layouts(shape, 1, hardware, **common)
    both, dropped = candidate_layouts(shape, 1, hardware, optimizer_offloads=(None, 1.0),
                                      **common)
    assert not plain and len(plain_dropped) == 2
    assert [(layout.policy, layout.optimizer_offload) for layout in both] == [
        ("megatron", 1.0), ("megatron-none", 1.0)]
    assert dropped == plain_dropped
    hardware["device_memory_bytes"] = 20 * params  # everything fits: each layout twice
    both, _ = candidate_layouts(shape, 1, hardware, optimizer_offloads=(None, 1.0), **common)
    assert [layout.optimizer_offload for layout in both] == [None, 1.0, None, 1.0]


def test_tiled_layouts_chunk_heads_within_groups_only_without_a_ring():
    """A tiled layout's head chunks: whole query groups (up to 8), and parts of groups when a
    rank has fewer groups than heads, but only at CP = 1 (over a ring a shared group's K/V
    would travel once per chunk). Every count is one the trainer accepts."""
    from memo_ext.head_chunks import head_chunks_split
    from memo_ext.estimate.layout.candidates import head_chunks_of

    # (heads, groups) per rank, CP -> chunks: MHA 7B at TP=4; Llama-3-8B at TP=4 and TP=8;
    # 12 heads in 6 groups, where 4 parts would not split 6 groups evenly.
    cases = {(8, 8, 2): 8, (8, 2, 1): 8, (8, 2, 2): 2, (4, 1, 1): 4, (4, 1, 4): 1,
             (12, 6, 1): 2, (32, 32, 1): 8}
    for (heads, groups, cp), chunks in cases.items():
        assert head_chunks_of(heads, groups, cp) == chunks, (heads, groups, cp)
        assert head_chunks_split(heads, groups, chunks)


def test_bounds_keep_only_the_undominated_live_lines():
    """A stage's live-bytes lines (memo_ext.estimate.layout.model) are cut to those no other
    line is at or above in both intercept and slope; the maximum at every length >= 0 is the
    same to the bit, ties and flat stretches included."""
    import numpy as np

    from memo_ext.estimate.layout.model import _max_of_lines, _undominated

    rng = np.random.default_rng(0)
    for trial in range(50):
        n = int(rng.integers(1, 3000))
        a = np.cumsum(rng.integers(-10**9, 10**9, n).astype(float))
        b = np.cumsum(rng.integers(-10**4, 10**4, n).astype(float))
        if trial % 3 == 0:
            b[:] = b[0]
        seqs = [0, *sorted(rng.integers(1, 10**7, 40).tolist())]
        kept_a, kept_b = _undominated(a, b)
        assert len(kept_a) < n or n < 3
        assert np.array_equal(_max_of_lines(kept_a, kept_b, seqs), _max_of_lines(a, b, seqs))


def test_untraced_models_are_solved_while_the_first_batch_is_traced():
    """The undominated layouts' tracing starts before the untraced models (SPPO's) are solved:
    here the untraced model's solving waits for the tracing to have started, which a search
    solving it first would never see."""
    import threading

    tracing_started = threading.Event()
    a = _variants(tp=2, dp=4)
    models = {a["full"]: StandIn(a["full"], 589824, 655360)}

    class WaitsForTracing(Untraced):
        def longest(self, step, maximum, fine_step=None):
            assert tracing_started.wait(timeout=30), "solved before any tracing started"
            return self.answer

    def build(wanted):
        tracing_started.set()
        return [models[layout] for layout in wanted]

    ranked = search_longest([a["full"]], build, LongestRanking(STEP, MAXIMUM, top=2),
                            untraced=[WaitsForTracing(1 << 20)])
    assert [p.seq for p in ranked] == [1 << 20, 589824]
