"""The GEMM and attention efficiencies of the cost model at a model's own shapes, read from
kernel throughput tables rather than fitted to end-to-end runs.

A table row is one kernel measured at one shape: a GEMM (m, n, k) or a causal or full
attention (direction, head dimension, sequence length), in TFLOP/s. A GPU profile names its
table with ``kernel_table`` (rows in kernel_tables.json, each citing the publication it was read
from; docs/estimate.md); the ``cpu`` profile carries rows it measured at startup under
``kernels`` (memo_ext.estimate.cpu_profile). The efficiency of a kernel is its row's TFLOP/s
over the profile's ``bf16_tflops``.

Lookup rules, chosen to need no fitted parameter:
* attention: rows of the direction (forward; backward; the forward_backward rows where a
  direction has none of its own, as for the A100, whose published FlashAttention-2 figures give
  only the sum), the causal flag and the head dimension nearest the model's (in log2),
  interpolated linearly in log2 of the sequence length and held flat beyond the table's ends
  (flash attention's throughput saturates with length);
* GEMM: the row nearest the shape in log2 distance over (m, n, k), with m clamped to the
  table's range (throughput saturates with the token count too). A model's efficiency is the
  FLOP-weighted harmonic mean over the GEMMs of a layer and the output layer, so that
  FLOPs / (peak · efficiency) is the sum of their times.

Why here rather than a library: no maintained package maps published kernel tables onto a
transformer's shapes; the lookup is a few lines.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from memo_ext.estimate.cost import CostModelError, Efficiency

TABLES_FILE = Path(__file__).with_name("kernel_tables.json")
DIRECTIONS = ("forward", "backward")


@lru_cache(maxsize=1)
def _published_tables() -> dict:
    return json.loads(TABLES_FILE.read_text())


def kernel_rows(hardware: dict) -> dict:
    """``{"gemm": [...], "attention": [...]}`` for the profile: its own ``kernels`` (measured),
    else the rows of kernel_tables.json for its ``kernel_table``."""
    if "kernels" in hardware:
        return hardware["kernels"]
    table = hardware.get("kernel_table")
    if table is None:
        raise CostModelError(f"the GPU profile {hardware.get('name', '?')!r} names no kernel "
                             "table: add \"kernel_table\": one of "
                             f"{', '.join(sorted(published_gpus()))}, or \"kernels\" rows")
    published = _published_tables()
    rows = {kind: [row for row in published[kind] if row["gpu"] == table]
            for kind in ("gemm", "attention")}
    if not rows["gemm"] or not rows["attention"]:
        raise CostModelError(f"kernel_table {table!r}: kernel_tables.json has no "
                             f"{'GEMM' if not rows['gemm'] else 'attention'} rows for it; use "
                             f"one of {', '.join(sorted(published_gpus()))}")
    return rows


def published_gpus() -> set[str]:
    """GPUs with both GEMM and attention rows in kernel_tables.json."""
    published = _published_tables()
    return {row["gpu"] for row in published["gemm"]} & \
        {row["gpu"] for row in published["attention"]}


def _log2_distance(a: float, b: float) -> float:
    return abs(math.log2(a) - math.log2(b))


def attention_tflops(rows: list[dict], direction: str, causal: bool, head_dim: int,
                     seq: int) -> float:
    """TFLOP/s of the attention kernel at ``seq`` tokens (see the module docstring)."""
    candidates = ([row for row in rows if row["direction"] == direction]
                  or [row for row in rows if row["direction"] == "forward_backward"])
    if not candidates:
        raise CostModelError(f"the kernel table has no {direction} (or forward_backward) "
                             "attention rows")
    if any(row["causal"] == causal for row in candidates):
        candidates = [row for row in candidates if row["causal"] == causal]
    nearest = min(_log2_distance(row["head_dim"], head_dim) for row in candidates)
    candidates = sorted((row for row in candidates
                         if _log2_distance(row["head_dim"], head_dim) == nearest),
                        key=lambda row: row["seq_len"])
    if seq <= candidates[0]["seq_len"]:
        return float(candidates[0]["tflops"])
    for low, high in zip(candidates, candidates[1:]):
        if seq <= high["seq_len"]:
            if high["seq_len"] == low["seq_len"]:
                return (low["tflops"] + high["tflops"]) / 2
            weight = math.log2(seq / low["seq_len"]) / math.log2(high["seq_len"] / low["seq_len"])
            return float(low["tflops"] + weight * (high["tflops"] - low["tflops"]))
    return float(candidates[-1]["tflops"])


def gemm_tflops(rows: list[dict], m: int, n: int, k: int) -> float:
    """TFLOP/s of the table's GEMM nearest (m, n, k) (see the module docstring)."""
    if not rows:
        raise CostModelError("the kernel table has no GEMM rows")
    low, high = min(row["m"] for row in rows), max(row["m"] for row in rows)
    m = min(max(m, low), high)

    def distance(row):
        return sum(_log2_distance(row[axis], value)
                   for axis, value in (("m", m), ("n", n), ("k", k)))

    nearest = min(distance(row) for row in rows)
    tied = [row["tflops"] for row in rows if distance(row) == nearest]
    return float(sum(tied) / len(tied))


def model_gemms(model: dict, layout: dict) -> list[tuple[int, int, int, int]]:
    """(m, n, k, count) of the forward GEMMs one rank runs per micro-batch: the four of each
    layer (QKV, attention projection, the two MLP matrices) and the output layer, split over
    TP; m is the rank's tokens (the sequence over CP; sequence parallelism gathers it back
    before each GEMM)."""
    hidden, heads = model["hidden_size"], model["num_attention_heads"]
    head_dim = model.get("kv_channels") or hidden // heads
    groups = model.get("num_query_groups") or heads
    tp = layout["tp"]
    tokens = model["seq_length"] // layout["cp"] * layout.get("micro_batch_size", 1)
    ffn = model["ffn_hidden_size"]
    vocab = model.get("padded_vocab_size") or model["vocab_size"]
    layers = model["num_layers"] // layout.get("pp", 1)
    return [(tokens, (heads + 2 * groups) * head_dim // tp, hidden, layers),
            (tokens, hidden, heads * head_dim // tp, layers),
            (tokens, ffn * (2 if model.get("swiglu") else 1) // tp, hidden, layers),
            (tokens, hidden, ffn // tp, layers),
            (tokens, vocab // tp, hidden, 1)]


def at_model_shapes(base: Efficiency, hardware: dict, model: dict, layout: dict) -> Efficiency:
    """``base`` with its GEMM and attention efficiencies read from the profile's kernel table
    at this model's shapes and the rank's sequence length (``model["seq_length"]`` over CP)."""
    rows = kernel_rows(hardware)
    peak = float(hardware["bf16_tflops"])
    flops = seconds = 0.0
    for m, n, k, count in model_gemms(model, layout):
        work = 2.0 * m * n * k * count
        flops += work
        seconds += work / gemm_tflops(rows["gemm"], m, n, k)
    hidden, heads = model["hidden_size"], model["num_attention_heads"]
    head_dim = model.get("kv_channels") or hidden // heads
    seq = max(1, model["seq_length"] // layout["cp"])
    causal = model.get("attn_mask_type", "causal") == "causal"
    forward, backward = (attention_tflops(rows["attention"], direction, causal, head_dim, seq)
                         / peak for direction in DIRECTIONS)
    return replace(base, gemm=flops / seconds / peak, attention_forward=forward,
                   attention_backward=backward)


__all__ = ["TABLES_FILE", "at_model_shapes", "attention_tflops", "gemm_tflops", "kernel_rows",
           "model_gemms", "published_gpus"]
