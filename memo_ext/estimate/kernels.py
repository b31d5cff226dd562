"""The GEMM and attention efficiencies of the cost model at a model's own shapes, read from
kernel throughput tables rather than fitted to end-to-end runs.

A table row is one kernel measured at one shape: a GEMM (m, n, k) or an attention kernel
(``kernel``: 'flash-attn-2', 'cudnn') in one direction, causal or full, at one head dimension
and sequence length, in TFLOP/s. Where the rows of a profile come from, first found wins:

1. the profile's own ``kernels`` (the ``cpu`` profile measures them at startup,
   memo_ext.estimate.cpu_profile);
2. rows measured on that GPU (measured_kernels.json, imported from a GPU evidence file by
   ``bench/gpu_evidence.py --import-rows``; memo_ext.estimate.measured_kernels), each kind
   (GEMM, attention) on its own: measured GEMMs replace the published GEMM row;
3. the published rows of kernel_tables.json the profile names with ``kernel_table``, each
   citing the publication it was read from (docs/estimate.md).

Attention is priced at the kernel the trainer dispatches on the profile's GPU
(:func:`dispatched_attention_kernel`, the one place that choice is made), measured rows before
published ones; where neither has rows of that kernel, at FlashAttention-2's, and the source
line says so. :func:`priced_rows` returns the rows with that one-line ``source``, which the
estimate prints (:func:`kernel_rows_line`). The efficiency of a kernel is its row's TFLOP/s
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
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Optional

from memo_ext.estimate.cost import CostModelError, Efficiency
from memo_ext.estimate.measured_kernels import measured_entry

TABLES_FILE = Path(__file__).with_name("kernel_tables.json")
DIRECTIONS = ("forward", "backward")


@lru_cache(maxsize=1)
def _published_tables() -> dict:
    return json.loads(TABLES_FILE.read_text())


#: The attention kernel priced where the dispatched one has no rows for a GPU.
FALLBACK_ATTENTION_KERNEL = "flash-attn-2"


#: memo_ext.attention.kernels' CUDA kernels by the kernel tables' name of their algorithm.
TABLE_KERNELS = {"cuda_cudnn": "cudnn", "cuda_flash": "flash-attn-2"}


def cuda_attention_backend(compute_capability: str, backend: str = "auto") -> str:
    """The attention kernel the trainer dispatches on a CUDA GPU of ``compute_capability``
    ("9.0") for ``--attention-backend backend``, by its kernel-table name: the trainer's own
    choice (memo_ext.attention.kernels.cuda_backend), cuDNN's fused attention from compute
    capability 9.0 with ``auto`` and FlashAttention-2 before, for the CUDA build of this torch
    release (which bundles cuDNN 9). The explicit kernel (``unfused``) has no rows: priced at
    FlashAttention-2's."""
    from memo_ext.attention import kernels  # the trainer's dispatch (imports megatron.core)

    major, minor = (int(part) for part in str(compute_capability).split(".")[:2])
    kernel = kernels.cuda_backend((major, minor), kernels.cudnn_attention_op_exists(), backend)
    return TABLE_KERNELS.get(kernel, FALLBACK_ATTENTION_KERNEL)


def dispatched_attention_kernel(hardware: dict) -> Optional[str]:
    """The attention kernel the trainer will dispatch on the profile's GPU: the one place the
    estimator chooses it. None for the cpu profile (it measures the trainer's own kernels);
    FlashAttention-2 for a GPU profile that gives no compute capability."""
    if hardware.get("device_type") == "cpu":
        return None
    capability = hardware.get("compute_capability")
    return FALLBACK_ATTENTION_KERNEL if capability is None \
        else cuda_attention_backend(str(capability))


def _of_kernel(rows: list[dict], kernel: Optional[str]) -> list[dict]:
    """``rows`` of ``kernel`` (a row without a ``kernel`` field is any kernel's)."""
    return [row for row in rows if kernel is None or row.get("kernel", kernel) == kernel]


def _published_source(table: str, rows: list[dict]) -> str:
    return f"published (memo_ext/estimate/kernel_tables.json, table {table!r}: " \
        f"{', '.join(sorted({row['source'] for row in rows}))})"


def _measured_source(entry: dict) -> str:
    p = entry["provenance"]
    return f"measured on {p['gpu']} ({p['evidence']}, commit {p['commit']}, " \
        f"{str(p['date'])[:10]})"


@dataclass(frozen=True)
class PricedRows:
    """The rows that price a profile's kernels and where they come from."""

    gemm: list
    attention: list  # of ``attention_kernel`` only (any, for a profile's own rows)
    attention_kernel: Optional[str]  # None: the profile's own rows (the cpu profile)
    source: str  # one line: "measured on <GPU> (<evidence>, commit <c>, <date>); ..."


def kernel_rows(hardware: dict) -> dict:
    """``{"gemm": [...], "attention": [...]}`` that price the profile (:func:`priced_rows`)."""
    rows = priced_rows(hardware)
    return {"gemm": rows.gemm, "attention": rows.attention}


def priced_rows(hardware: dict) -> PricedRows:
    """The profile's GEMM rows and the rows of the attention kernel it is priced at, and one
    line saying where they come from (see the module docstring)."""
    if "kernels" in hardware:
        own = hardware["kernels"]
        return PricedRows(own["gemm"], own["attention"], None,
                          f"the {hardware.get('name', '?')} profile's own rows"
                          + (" (measured at startup)" if hardware.get("device_type") == "cpu"
                             else ""))
    measured = measured_entry(hardware.get("name", ""))
    table = hardware.get("kernel_table")
    published = None
    if table is not None:
        tables = _published_tables()
        published = {kind: [row for row in tables[kind] if row["gpu"] == table]
                     for kind in ("gemm", "attention")}
    elif measured is None:
        raise CostModelError(f"the GPU profile {hardware.get('name', '?')!r} names no kernel "
                             "table: add \"kernel_table\": one of "
                             f"{', '.join(sorted(published_gpus()))}, or \"kernels\" rows")

    def pick(kind: str, kernel: Optional[str] = None):
        """(rows, "measured" or "published") of ``kind``: measured before published; None
        when neither has any."""
        for origin, rows in (("measured", measured), ("published", published)):
            if rows is not None and _of_kernel(rows[kind], kernel):
                return _of_kernel(rows[kind], kernel), origin
        return None

    gemm = pick("gemm")
    dispatched = dispatched_attention_kernel(hardware)
    kernel, attention = dispatched, pick("attention", dispatched)
    if attention is None and dispatched != FALLBACK_ATTENTION_KERNEL:
        kernel, attention = FALLBACK_ATTENTION_KERNEL, pick("attention", FALLBACK_ATTENTION_KERNEL)
    if gemm is None or attention is None:
        missing = "GEMM" if gemm is None else "attention"
        raise CostModelError(f"the GPU profile {hardware.get('name', '?')!r}: no {missing} rows "
                             f"(kernel_table {table!r} in kernel_tables.json, nor measured in "
                             "measured_kernels.json); use a kernel_table of "
                             f"{', '.join(sorted(published_gpus()))}")
    if gemm[1] == attention[1] == "measured":
        source = _measured_source(measured)
    elif gemm[1] == attention[1]:
        source = _published_source(table, gemm[0] + attention[0])
    else:
        source = "; ".join(f"{kind} " + (_measured_source(measured) if origin == "measured"
                                          else _published_source(table, rows))
                           for kind, (rows, origin) in (("GEMM", gemm), ("attention", attention)))
    source += f"; attention kernel {kernel}"
    if kernel != dispatched:
        source += f" (the dispatched {dispatched} has no rows for this GPU)"
    return PricedRows(gemm[0], attention[0], kernel, source)


def kernel_rows_line(hardware: dict) -> str:
    """One line for the estimate's output: which kernel rows price the job."""
    return f"kernel rows: {priced_rows(hardware).source}"


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
    """TFLOP/s of the table's GEMM nearest (m, n, k) (see the module docstring); rows at the
    same distance are averaged."""
    if not rows:
        raise CostModelError("the kernel table has no GEMM rows")
    low, high = min(row["m"] for row in rows), max(row["m"] for row in rows)
    log2 = math.log2
    lm, ln, lk = log2(min(max(m, low), high)), log2(n), log2(k)
    distances = [abs(log2(row["m"]) - lm) + abs(log2(row["n"]) - ln) + abs(log2(row["k"]) - lk)
                 for row in rows]
    nearest = min(distances)
    tied = [row["tflops"] for row, distance in zip(rows, distances) if distance == nearest]
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


def at_model_shapes(base: Efficiency, hardware: dict, model: dict, layout: dict,
                    tables_key: Optional[str] = None) -> Efficiency:
    """``base`` with its GEMM and attention efficiencies read from the profile's kernel table
    at this model's shapes and the rank's sequence length (``model["seq_length"]`` over CP).
    ``tables_key``: :func:`profile_key` of ``hardware``, for a caller that reads the tables
    many times over one profile (SPPO's solver: once per subsequence)."""
    hidden, heads = model["hidden_size"], model["num_attention_heads"]
    head_dim = model.get("kv_channels") or hidden // heads
    seq = max(1, model["seq_length"] // layout["cp"])
    causal = model.get("attn_mask_type", "causal") == "causal"
    gemm, forward, backward = _efficiencies(tables_key or profile_key(hardware),
                                            dispatched_attention_kernel(hardware),
                                            tuple(model_gemms(model, layout)), head_dim, seq,
                                            causal)
    return replace(base, gemm=gemm, attention_forward=forward, attention_backward=backward)


def profile_key(hardware: dict) -> str:
    """The profile as a key of :func:`_efficiencies` (its contents: a profile is a plain dict
    that may be copied or edited between calls)."""
    return json.dumps(hardware, sort_keys=True, default=str)


@lru_cache(maxsize=None)
def _priced_from_key(key: str, dispatched: Optional[str]) -> PricedRows:
    """priced_rows of the profile ``key`` whose dispatched attention kernel is ``dispatched``
    (part of the key: it depends on the installed kernels, not on the profile alone)."""
    return priced_rows(json.loads(key))


@lru_cache(maxsize=1 << 16)
def _efficiencies(key: str, dispatched: Optional[str], gemms: tuple, head_dim: int, seq: int,
                  causal: bool) -> tuple[float, float, float]:
    """(GEMM, attention forward, attention backward) efficiencies of the profile ``key`` at
    these shapes: a search reads the tables at the same shapes hundreds of thousands of times
    (SPPO's subsequences, each layout's predictions), each lookup a scan of the rows."""
    rows = _priced_from_key(key, dispatched)
    peak = float(json.loads(key)["bf16_tflops"])
    flops = seconds = 0.0
    for m, n, k, count in gemms:
        work = 2.0 * m * n * k * count
        flops += work
        seconds += work / gemm_tflops(rows.gemm, m, n, k)
    forward, backward = (attention_tflops(rows.attention, direction, causal, head_dim, seq)
                         / peak for direction in DIRECTIONS)
    return flops / seconds / peak, forward, backward


__all__ = ["FALLBACK_ATTENTION_KERNEL", "TABLES_FILE", "at_model_shapes", "attention_tflops",
           "PricedRows", "cuda_attention_backend", "dispatched_attention_kernel", "gemm_tflops",
           "kernel_rows", "kernel_rows_line", "model_gemms", "priced_rows", "profile_key",
           "published_gpus"]
