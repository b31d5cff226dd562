"""The estimator's time side: the work a trace counts (exact FLOPs against the model's shapes,
exact at any length from two lengths), the cost model's arithmetic, the layout search and the
recommender's command line."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from memo_ext.estimate.cost import (
    CostModelError,
    Efficiency,
    WorkLine,
    persistent_bytes,
    predict_step,
)
from memo_ext.estimate.flops import model_flops_per_sequence, parameter_count
from memo_ext.estimate.kernels import at_model_shapes, kernel_rows
from memo_ext.estimate.layout import Layout, TraceCache, candidate_layouts
from memo_ext.estimate.models import traced_model
from memo_ext.hardware import load_hardware
from memo_ext.attention import ZigzagLayout
from tests.conftest import run_estimate_cli, trace_request

LAYERS, HIDDEN, FFN, HEADS, VOCAB = 2, 64, 256, 4, 512
SMALL = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--ffn-hidden-size",
         str(FFN), "--num-attention-heads", str(HEADS), "--vocab-size", str(VOCAB),
         "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2",
         "--context-parallel-size", "2", "--bf16", "--use-distributed-optimizer",
         "--cuda-context-mib", "1", "--nccl-mib-per-communicator", "1"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    # One tracer server for the three traces (one process start instead of three): its traces
    # are the engine's (tests/unit/memo_ext/estimate/test_tracer_pool.py).
    from memo_ext.estimate.tracer import TracerPool

    workdir = tmp_path_factory.mktemp("cost")
    with TracerPool(workers=1) as pool:
        return {seq: pool.trace(trace_request(SMALL + FULL_RECOMPUTE, seq),
                                workdir / f"cost_{seq}.jsonl.gz")
                for seq in (1024, 2048, 8192)}


def test_gemm_and_attention_flops_are_the_models(traces):
    """Rank 0 of TP=2 CP=2 at 2048 tokens: every forward GEMM of the model, by hand."""
    work = traces[2048].header["work"]["phases"]
    tokens = 2048 // 2  # this CP rank's tokens; SP gathers them over TP for the GEMMs
    per_layer = 2 * tokens * (HIDDEN * 3 * HIDDEN + HIDDEN * HIDDEN + 2 * HIDDEN * FFN) // 2
    padded_vocab = 512  # a multiple of 128 x TP already
    logits = 2 * tokens * HIDDEN * padded_vocab // 2
    assert work["forward"]["gemm_flops"] == LAYERS * per_layer + logits
    # Full recompute runs each layer's forward again; backward is twice the forward.
    assert work["recompute"]["gemm_flops"] == LAYERS * per_layer
    assert work["backward"]["gemm_flops"] == 2 * (LAYERS * per_layer + logits)
    heads_here = HEADS // 2
    head_dim = HIDDEN // HEADS
    pairs = ZigzagLayout(2 * tokens, 2).causal_pairs(0)
    assert work["forward"]["attention_flops"] == LAYERS * 4 * heads_here * head_dim * pairs
    assert work["backward"]["attention_flops"] == LAYERS * 10 * heads_here * head_dim * pairs
    assert work["forward"]["memory_bytes"] > 0


def test_work_at_any_length_from_two_lengths_is_exact(traces):
    line = WorkLine.from_headers(traces[1024].header, traces[2048].header)
    work = traces[8192].header["work"]
    assert line.at(8192) == {key: work[key] for key in ("phases", "collectives")}
    # The per-layer counts (symbolic traces repeat a layer's): the layers are alike and
    # part of the total.
    layers = work["layers"]
    assert len(layers) == LAYERS and len({json.dumps(v, sort_keys=True)
                                          for v in layers.values()}) == 1
    one = layers["0"]["phases"]["forward"]["gemm_flops"]
    assert 0 < LAYERS * one < work["phases"]["forward"]["gemm_flops"]


def test_collectives_are_counted_per_group(traces):
    collectives = traces[2048].header["work"]["collectives"]
    groups = {tuple(c["ranks"]) for c in collectives}
    assert (0, 1) in groups and (0, 2) in groups  # TP and CP groups of rank 0
    forward = {(c["op"], tuple(c["ranks"])): c for c in collectives if c["phase"] == "forward"}
    # Sequence parallelism: one all-gather before each of QKV and FC1 per layer, plus one
    # before the output layer; the CP ring sends and receives one packed K/V block per layer
    # (CP - 1 steps), [s/CP, b, 2, groups/TP, d] in bf16, and gathers nothing.
    assert forward[("all_gather", (0, 1))]["calls"] == 2 * LAYERS + 1
    assert ("all_gather", (0, 2)) not in forward
    kv_block = 2048 // 2 * 2 * (HEADS // 2) * (HIDDEN // HEADS) * 2
    for op in ("send", "recv"):
        assert forward[(op, (0, 2))]["calls"] == LAYERS
        assert forward[(op, (0, 2))]["bytes"] == LAYERS * kv_block


def test_work_line_refuses_traces_without_work(traces):
    bare = {key: value for key, value in traces[1024].header.items() if key != "work"}
    with pytest.raises(CostModelError, match="no work counts"):
        WorkLine.from_headers(bare, traces[2048].header)


def _efficiency(trace, hardware, **changes):
    return dataclasses.replace(at_model_shapes(Efficiency.from_profile(hardware), hardware,
                                               trace.header["model"], trace.header["layout"]),
                               **changes)


def _step(trace, hardware, **changes):
    efficiency = _efficiency(trace, hardware, **changes)
    return predict_step(trace.header["work"], trace.header, hardware, efficiency,
                        global_batch=8, persistent=persistent_bytes(trace))


def test_step_time_follows_the_hardware_and_efficiencies(traces):
    a800 = load_hardware("a800")
    trace = traces[8192]
    base = _step(trace, a800)
    assert base.step_s > 0 and 0 < base.mfu < 1
    assert base.microbatches == 8  # DP 1, micro-batch 1
    rows = kernel_rows(a800)
    faster_kernels = {kind: [{**row, "tflops": 2 * row["tflops"]} for row in rows[kind]]
                      for kind in rows}
    faster = _step(trace, {**a800, "kernels": faster_kernels})
    assert faster.forward_s < base.forward_s
    # The peak only scales MFU: kernel time comes from the kernels' measured throughput.
    higher_peak = _step(trace, {**a800, "bf16_tflops": 2 * a800["bf16_tflops"]})
    assert higher_peak.step_s == pytest.approx(base.step_s)
    assert higher_peak.mfu == pytest.approx(base.mfu / 2)
    slower_links = _step(trace, a800, collective=a800["efficiency"]["collective"] / 2)
    assert slower_links.collectives_s == pytest.approx(2 * base.collectives_s)
    reorganising = predict_step(trace.header["work"], trace.header, a800,
                                _efficiency(trace, a800), global_batch=8,
                                persistent=persistent_bytes(trace),
                                reorganisations_per_iteration=3)
    assert reorganising.step_s == pytest.approx(
        base.step_s + 3 * a800["efficiency"]["reorganisation_s"])
    two_replicas = {**trace.header, "layout": {**trace.header["layout"], "dp": 2}}
    with pytest.raises(CostModelError, match="--global-batch-size 7"):
        predict_step(trace.header["work"], two_replicas, a800, _efficiency(trace, a800),
                     global_batch=7, persistent=persistent_bytes(trace))


def test_mfu_uses_memo_papers_definition():
    model = {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 16384,
             "num_attention_heads": 32, "vocab_size": 50257}
    assert parameter_count(model) == 32 * (4 * 4096**2 + 2 * 4096 * 16384) + 50257 * 4096
    s = 1 << 20
    assert model_flops_per_sequence(model, s) == 6 * s * parameter_count(model) + \
        6 * 32 * 4096 * s * s


def test_candidate_layouts_rule_out_what_cannot_run():
    a800 = load_hardware("a800")
    model = {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 16384,
             "num_attention_heads": 32, "vocab_size": 50257}
    kept, dropped = candidate_layouts(model, 8, a800, policies=["megatron", "memo"],
                                      alphas=[0.0, 1.0], micro_batches=[1], global_batch=16,
                                      pipeline_sizes=[1, 2])
    assert all(layout.gpus == 8 for layout in kept) and not any(
        "alone need" in reason for _, reason in dropped)
    # 7B without TP: 6.65e9 parameters x 6 bytes of weights and fp32 gradients = 37 GiB, and
    # Adam's 12 bytes sharded over DP x CP = 8 ranks, 9 GiB: traced, whether DP or CP.
    assert Layout(1, 1, 1, 8, "megatron") in kept and Layout(1, 8, 1, 1, "megatron") in kept
    # 65B on TP=8: 8.1e9 parameters per rank x 18 bytes, nothing to shard Adam over.
    big, big_dropped = candidate_layouts({**model, "num_layers": 80, "hidden_size": 8192,
                                          "ffn_hidden_size": 32768, "num_attention_heads": 64},
                                         8, a800, policies=["megatron"], alphas=[],
                                         micro_batches=[1], global_batch=16)
    assert not big
    assert "alone need 136 GiB" in dict(big_dropped)[Layout(8, 1, 1, 1, "megatron")]
    assert Layout(4, 2, 1, 1, "memo", 0.0) in kept and Layout(8, 1, 1, 1, "megatron") in kept
    # With every layer in checkpoint mode (b), alpha (the (a) layers' split) changes nothing:
    # one alpha is traced. With half of them in (b), each alpha is.
    assert Layout(4, 2, 1, 1, "memo", 0.0, checkpoint_layers=30) in kept
    assert Layout(4, 2, 1, 1, "memo", 1.0, checkpoint_layers=30) not in kept
    assert {Layout(4, 2, 1, 1, "memo", a, checkpoint_layers=15) for a in (0.0, 1.0)} <= set(kept)
    assert len({(l.tp, l.cp, l.pp, l.dp) for l in kept}) >= 8


def test_block_recompute_layouts():
    from memo_ext.estimate.layout import block_recompute_layers

    assert block_recompute_layers(32) == [8, 16, 24]
    assert block_recompute_layers(4) == [1, 2, 3]
    assert block_recompute_layers(2) == [1] and block_recompute_layers(1) == []
    a800 = load_hardware("a800")
    model = {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 16384,
             "num_attention_heads": 32, "vocab_size": 50257}
    kept, _ = candidate_layouts(model, 8, a800, policies=["megatron-block"], alphas=[],
                                micro_batches=[1], global_batch=16, pipeline_sizes=[1, 2])
    assert {(l.pp, l.recompute_layers) for l in kept} == {(1, 8), (1, 16), (1, 24), (2, 4),
                                                          (2, 8), (2, 12)}
    layout = Layout(8, 1, 1, 1, "megatron-block", recompute_layers=16)
    request = layout.trace_request(traced_model("7b"), 131072, a800)
    assert (request.recompute_granularity, request.recompute_method,
            request.recompute_num_layers) == ("full", "block", 16)
    assert layout.describe().endswith("Megatron block recompute 16 layers per stage")
    base = ["--model", "7b", "--gpu", "a800", "--tensor-model-parallel-size", "8",
            "--seq-length", "131072", "--policy", "megatron-block"]
    assert run_estimate_cli(base)[0] == 2  # no --recompute-num-layers
    assert run_estimate_cli([*base, "--recompute-num-layers", "33"])[0] == 2
    assert run_estimate_cli([*base[:-1], "megatron", "--recompute-num-layers", "8"])[0] == 2
    assert run_estimate_cli(["--model", "7b", "--gpu", "a800", "--gpus", "8", "--recommend",
                             "--seq-length", "1024", "--block-recompute-fractions", "1"])[0] == 2


# ~70 s on 2 loaded cores (six layouts traced, the CLI run twice); the default suite keeps the
# recommender (test_estimate.py's SPPO rows, test_symbolic.py's rank_longest) and the cache
# (test_trace_cache_never_trusts_a_damaged_entry).
@pytest.mark.slow
def test_recommend_ranks_layouts_and_reuses_its_trace_cache(tmp_path):
    model_file = tmp_path / "small.json"
    model_file.write_text(json.dumps({"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 256,
                                      "num_attention_heads": 4, "vocab_size": 512}))
    cache = tmp_path / "cache"
    argv = ["--model", str(model_file), "--gpu", "a100-40gb", "--gpus", "2", "--recommend",
            "--seq-length", "262144", "--policies", "megatron,megatron-none",
            "--cache-dir", str(cache), "--global-batch-size", "4", "--mlp-tiles", "0"]
    code, out = run_estimate_cli(argv)
    assert code == 0, out
    rows = re.findall(r"^\| (\d+) \| (TP=\d+ CP=\d+ PP=\d+ DP=\d+.*?) \|.*\| ([\d.]+)% \| FITS \|$",
                      out, re.M)
    assert len(rows) == 6, out  # (TP, CP, DP) in (1, 1, 2), (1, 2, 1), (2, 1, 1) x 2 policies
    mfus = [float(mfu) for _, _, mfu in rows]
    assert mfus == sorted(mfus, reverse=True)
    assert re.search(r"^best: TP=", out, re.M) and "predicted MFU" in out
    cached = sorted(cache.glob("*.jsonl.gz"))
    assert len(cached) == 2 * len(re.findall(r"^  \[\d+/6\] traced ", out, re.M))
    code, again = run_estimate_cli(argv)
    assert code == 0 and sorted(cache.glob("*.jsonl.gz")) == cached
    assert again.split("estimated in")[0].count("|") == out.split("estimated in")[0].count("|")


def test_cli_refuses_bad_recommender_input(tmp_path):
    base = ["--model", "7b", "--gpu", "a800", "--seq-length", "1024"]
    assert run_estimate_cli(base + ["--recommend"])[0] == 2  # no --gpus
    assert run_estimate_cli(base + ["--recommend", "--gpus", "8", "--policies",
                                    "deepspeed"])[0] == 2
    assert run_estimate_cli(base + ["--recommend", "--gpus", "8", "--alphas", "2"])[0] == 2
    bad_model = tmp_path / "model.json"
    bad_model.write_text('{"hidden_size": 64}')
    assert run_estimate_cli(["--model", str(bad_model), "--gpu", "a800", "--seq-length",
                             "1024"])[0] == 2


def test_trace_cache_never_trusts_a_damaged_entry(tmp_path):
    request = trace_request(SMALL, 1024)
    with TraceCache(tmp_path) as cache:  # ends its tracer worker with the test
        first = cache.trace(request)
        (entry,) = tmp_path.glob("*.jsonl.gz")
        entry.write_bytes(b"not gzip")
        again = cache.trace(request)
    assert [e["bytes"] for e in again.events] == [e["bytes"] for e in first.events]
