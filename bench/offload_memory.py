"""MEMO memory benchmark: peak device activation bytes of one training iteration, per method.

    python bench/offload_memory.py                          # full run, ~10 min on 2 cores
    python bench/offload_memory.py --quick -o /tmp/om       # smoke test: tiny model, < 60 s

Everything runs in one process (a gloo world of one, initialised once) on CPU. The "device" is
the CPU: :class:`memo_ext.storage_tracker.DeviceMemoryTracker` (a TorchDispatchMode) counts the
bytes of every storage allocated during one forward + backward, and MEMO's host slots are counted apart as
host bytes (MEMO allocates them inside ``tracker.host_allocations()``). Parameters and their gradients (pre-allocated as zeros) are
registered before the iteration, so

    activation bytes = peak device bytes - static bytes (parameters + gradients).

Rounding buffers, recomputed tensors, logits and every transient of the iteration count as
activations. Bytes are storage bytes (no allocator rounding or fragmentation); time on an
accelerator is NOT measured here (the seconds shown are CPU wall time, tracker overhead included).

Methods (each model built freshly, same weights, fp32, micro-batch 1, dropout 0, RoPE):

- ``none``: no recomputation;
- ``full``: Megatron ``--recompute-granularity full --recompute-method uniform
  --recompute-num-layers 1``;
- ``selective``: Megatron ``--recompute-granularity selective`` (core_attn);
- ``memo-A``: MEMO token-wise swap + recompute at fixed alpha A (0, 0.5, 1).

Sections:

1. sequence sweep at the default depth: measured vs. theory (formulas below, in fp32 bytes);
2. layer-count check at a fixed sequence: MEMO's device activation bytes must not grow with the
   number of layers (a PASS/FAIL line per MEMO alpha), unlike no/full recompute;
3. capacity under a simulated device cap (``capacity_bytes``), at each depth of
   ``Sizes.capacity_depths`` (16 and 32 layers, 32 being the 7B/13B depth): the longest sequence
   (bisection over multiples of ``search_step``) that trains, for Megatron full recompute vs
   MEMO with ``--memo-alpha auto`` (iterations 1 and 2 at alpha 0 measure, ``after_iteration()``
   solves the LP with the tracker's headroom as the device row, iteration 3 runs at the solved
   alpha; all must fit), and the ratio; MEMO at fixed alpha 0 beside them, and MEMO alpha auto
   with the rest of the million-token path (``LONG_PATH_FLAGS``: the chunked output layer and
   loss, the sequence-tiled MLP) against Megatron full recompute as Megatron-LM ships it (goal
   ``LONG_PATH_CAPACITY_GOAL``). The cap is set per depth so that full recompute just fits
   ``capacity_seq`` tokens.

Outputs in ``--output-dir`` (default bench/results): ``offload_memory.md`` (tables, formulas,
command, machine note), ``offload_memory.json`` (all measurements),
``offload_memory.png`` (activation bytes vs. sequence length, measured solid, theory dashed) and
``offload_memory_layers.png`` (vs. number of layers). The exit status is 0 whenever the report is
written, whatever the PASS/FAIL lines say (they are measurements, not errors). One megatron world
per process: call :func:`main` at most once per process (the smoke test runs it in a subprocess).

Theory (elements; x 4 bytes in fp32). u = s*b*h, a = heads, V = vocabulary, n = layers.
Per layer, saved for backward without recomputation (profiled with saved_tensors_hooks on this
layer, megatron.core local spec + SDPA core attention)::

    L = (18 + 4/a) u + (4 + a) s b
      = LN1 input u + LN1 output u + RoPE cos/sin 4 s b h/a + rotated q u + rotated k u
        + QKV projection output 3u (v is a view of it and pins all of it) + attention output u
        (SDPA output, shared with the out-projection input) + LN2 input u + LN2 output u
        + FC1 output 4u + GELU output 4u + LN statistics 4sb + attention log-sum-exp a s b

i.e. docs/memo.md's 16 u plus 2u for the pinned QKV buffer and 4u/a for RoPE. The head (final norm,
logits, cross-entropy) adds about H = 2u + 2 s b V. Then:

- no recompute:        n L + H
- selective core_attn: n (L - a s b) + H   (SDPA never materialises the a s^2 b score tensors
                       that selective recompute exists to drop: it saves only the log-sum-exp)
- full recompute:      n u + L + H          (each layer's input + one layer rebuilt in backward)
- MEMO at alpha:       2 O(alpha) + W(alpha) + H, O(alpha) = 3u + alpha (14 + 4/a) u (one
                       rounding buffer: layer input u + attention output counted twice as
                       ActivationShape does + alpha of the alpha-split tensors),
                       W(alpha) = (1 - alpha)(14 + 4/a) u + 3u (one layer's recompute working
                       set: the dropped tokens' tensors rebuilt + q, k, v merged). No n in it.

These are approximations: transients of the backward (gradient buffers of the widest tensors) are
not modelled; the "measured / theory" column shows how far off they are. MEMO is measured in its
steady state (second iteration; its buffers persist); the first iteration, which also grows the
buffers, is reported apart.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shlex
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from bench.common import longest_fitting  # noqa: E402
from memo_ext.device import CopyEngine  # noqa: E402
from memo_ext.storage_tracker import DeviceMemoryTracker, SimulatedOutOfMemoryError  # noqa: E402

REPORT_MD = "offload_memory.md"
REPORT_JSON = "offload_memory.json"
PLOT_SEQ = "offload_memory.png"
PLOT_LAYERS = "offload_memory_layers.png"
PLOT_CAPACITY = "offload_memory_capacity.png"

F32 = 4
MIB = 2**20

#: A MEMO alpha's device bytes are "flat" in the layer count when they grow by at most this many
#: u = s*b*h*4 bytes per added layer (full recompute grows by 1 u per layer: each layer's input;
#: no recompute by L ~ 19 u).
FLAT_U_PER_LAYER = 0.1
#: Capacity goal: MEMO (alpha auto) trains sequences at least this many times longer than
#: Megatron full recompute under the same simulated device cap.
CAPACITY_GOAL = 1.6
#: The same with the rest of the million-token path (chunked output layer and loss, tiled MLP).
LONG_PATH_CAPACITY_GOAL = 3.0
#: That path's flags: loss chunks and MLP tiles of 1024 tokens.
LONG_PATH_FLAGS = ("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "chunked",
                   "--cross-entropy-chunk-size", "1024", "--memo-mlp-tile-size", "1024")
#: D2H bandwidth handed to MEMO's alpha LP: the effective per-GPU PCIe bandwidth the paper's
#: figures imply (docs/memo.md: ~10-14 GB/s on a 32 GB/s link), bytes/s.
LP_BANDWIDTH_BYTES_PER_S = 12e9
#: Host memory handed to MEMO's alpha LP, bytes (generous: this machine has 24 GiB).
LP_HOST_MEMORY_BYTES = 8 * 10**9


@dataclass(frozen=True)
class Sizes:
    hidden: int
    heads: int
    vocab: int
    layers: int                    # depth of the sequence sweep
    seqs: tuple[int, ...]          # sequence sweep
    layer_counts: tuple[int, ...]  # layer-count check
    layer_seq: int                 # sequence of the layer-count check
    capacity_seq: int              # the cap is set so that full recompute just fits this
    search_step: int               # capacity search granularity (tokens)
    search_max: int                # longest sequence the capacity search tries
    capacity_depths: tuple[int, ...]  # layer counts of the capacity search
    capacity_keys: tuple[str, ...] = ("full", "memo-auto", "memo-0", "memo-auto-long")


FULL = Sizes(hidden=128, heads=4, vocab=256, layers=16, seqs=(1024, 2048, 4096, 8192),
             layer_counts=(8, 16, 24), layer_seq=1024, capacity_seq=3072, search_step=256,
             search_max=16384, capacity_depths=(16, 32))
QUICK = Sizes(hidden=64, heads=4, vocab=128, layers=8, seqs=(128, 256), layer_counts=(4, 12),
              layer_seq=128, capacity_seq=256, search_step=32, search_max=512,
              capacity_depths=(8,), capacity_keys=("full", "memo-auto"))


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    recompute_args: tuple[str, ...] = ()
    alpha: Optional[str] = None  # MEMO alpha ("auto" or a number); None: not MEMO

    @property
    def memo(self) -> bool:
        return self.alpha is not None


METHODS = (
    Method("none", "no recompute"),
    Method("full", "Megatron full recompute",
           ("--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1")),
    Method("selective", "Megatron selective (core_attn)", ("--recompute-granularity", "selective")),
    Method("memo-0", "MEMO alpha 0", alpha="0"),
    Method("memo-0.5", "MEMO alpha 0.5", alpha="0.5"),
    Method("memo-1", "MEMO alpha 1", alpha="1"),
)
METHOD_BY_KEY = {m.key: m for m in METHODS}
MEMO_AUTO = Method("memo-auto", "MEMO alpha auto", alpha="auto")
MEMO_AUTO_LONG = Method("memo-auto-long", "MEMO alpha auto + chunked loss + tiled MLP",
                        LONG_PATH_FLAGS, alpha="auto")
CAPACITY_METHODS = {m.key: m for m in (*METHODS, MEMO_AUTO, MEMO_AUTO_LONG)}
LAYER_CHECK_KEYS = ("none", "full", "memo-0", "memo-0.5", "memo-1")


# ------------------------------------------------------------------------------------ theory

def theory_bytes(method: Method, seq: int, layers: int, sizes: Sizes, micro_batch: int = 1,
                 alpha: Optional[float] = None) -> float:
    """Approximate peak activation bytes (fp32) of one iteration; see the module docstring."""
    s, b, h, a, v, n = seq, micro_batch, sizes.hidden, sizes.heads, sizes.vocab, layers
    u = s * b * h
    layer = (18 + 4 / a) * u + (4 + a) * s * b
    head = 2 * u + 2 * s * b * v
    if method.key == "none":
        elements = n * layer + head
    elif method.key == "selective":
        elements = n * (layer - a * s * b) + head
    elif method.key == "full":
        elements = n * u + layer + head
    elif method.memo:
        if alpha is None:
            alpha = float(method.alpha)
        other = (14 + 4 / a) * u
        offloaded = 3 * u + alpha * other                # one rounding buffer's contents
        working_set = (1 - alpha) * other + 3 * u        # recomputed tokens + merged q, k, v
        elements = 2 * offloaded + working_set + head
    else:
        raise ValueError(method.key)
    return F32 * elements


# ------------------------------------------------------------------------------ measurement

@dataclass
class Measurement:
    method: str
    seq: int
    layers: int
    capacity_bytes: Optional[int] = None
    fits: bool = True
    error: str = ""
    static_bytes: int = 0             # parameters + gradients, registered before the iteration
    peak_device_bytes: int = 0
    activation_bytes: int = 0         # peak device - static, of the last iteration run
    iteration_activation_bytes: list = field(default_factory=list)  # per iteration
    theory_bytes: float = 0.0
    peak_host_bytes: int = 0          # MEMO host slots
    residual_bytes: int = 0           # device bytes still held after backward + gc, - static
    buffer_bytes: int = 0             # MEMO: capacity of the two rounding buffers together
    alpha: Optional[float] = None     # MEMO: alpha of the (last) iteration
    alpha_log: str = ""
    iterations_done: int = 0          # forward+backward passes completed (OOM: the one that failed
                                      # is iterations_done + 1)
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.activation_bytes / self.theory_bytes if self.theory_bytes else math.nan


def _head_elements(sizes: Sizes, seq: int) -> float:
    """H of the theory: final norm input/output + logits and their softmax (micro-batch 1)."""
    return 2 * seq * sizes.hidden + 2 * seq * sizes.vocab


def _is_simulated_oom(error: BaseException) -> bool:
    return isinstance(error, SimulatedOutOfMemoryError) or (
        "simulated device out of memory" in str(error))


class Bench:
    """The megatron world (initialised once per process) and one model run at a time."""

    def __init__(self, sizes: Sizes, log: Callable[[str], None] = print):
        self.sizes = sizes
        self.log = log
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
        from megatron.training.arguments import parse_args
        from megatron.training.initialize import initialize_megatron

        self._parse_args = parse_args
        initialize_megatron(self._args(sizes.layers, sizes.seqs[0], ()))

    def _base_argv(self, layers: int, seq: int) -> list[str]:
        s = self.sizes
        return [
            "--num-layers", str(layers), "--hidden-size", str(s.hidden),
            "--num-attention-heads", str(s.heads), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--mock-data",
            "--vocab-size", str(s.vocab), "--attention-dropout", "0", "--hidden-dropout", "0",
            "--position-embedding-type", "rope",
        ]

    def _args(self, layers: int, seq: int, extra) -> argparse.Namespace:
        args = self._parse_args(self._base_argv(layers, seq) + list(extra), world_size=1,
                                cuda_available=False)
        args.padded_vocab_size = self.sizes.vocab
        return args

    def run(self, method: Method, seq: int, layers: int,
            capacity_bytes: Optional[int] = None) -> Measurement:
        """One fresh model; one forward + backward under the tracker, two for MEMO (whose
        rounding buffers and host slots persist across iterations: the first iteration grows
        them, the second is the steady state; with alpha auto the first two measure for the LP
        and a third runs at the solved alpha).
        The peak is taken per iteration (reset in between), the tracker stays on throughout,
        so MEMO's persistent buffers count in the second iteration too. MEMO's alpha LP reads
        the tracker's headroom (capacity - peak) as its device row, as it reads the CUDA
        allocator's on a GPU."""
        from megatron.core import tensor_parallel

        from megatron.training.arguments import core_transformer_config_from_args
        from memo_ext.config import OffloadConfig
        from memo_ext.offload import (AUTO_ALPHA_MEASURING_ITERATIONS, ActivationShape,
                                      MemoOffload, position_wise_share_of)
        from megatron.training import gpt

        sizes = self.sizes
        result = Measurement(method.key, seq, layers, capacity_bytes)
        args = self._args(layers, seq, method.recompute_args)
        config = core_transformer_config_from_args(args)
        engine = memo = model = None
        alpha_lines: list[str] = []
        start = time.perf_counter()
        tracker = DeviceMemoryTracker(capacity_bytes=capacity_bytes)
        try:
            if method.memo:
                engine = CopyEngine("cpu", copy_delay_s=0.0)
                shape = ActivationShape(sequence_tokens=seq, micro_batch_size=1,
                                        hidden_size=sizes.hidden, tensor_parallel_size=1,
                                        sequence_parallel=False, element_bytes=F32)
                memo = MemoOffload(OffloadConfig(offload=True, alpha=method.alpha), engine,
                                   layers_per_stage=layers, microbatches_in_flight=1, shape=shape,
                                   host_memory_bytes=LP_HOST_MEMORY_BYTES,
                                   bandwidth_bytes_per_s=LP_BANDWIDTH_BYTES_PER_S,
                                   host_allocation_scope=tracker.host_allocations,
                                   log=alpha_lines.append,
                                   device_headroom=tracker.headroom_bytes,
                                   position_wise_share=position_wise_share_of(args))
            torch.manual_seed(0)
            tensor_parallel.model_parallel_cuda_manual_seed(0)
            model = gpt.model_provider(config, args, memo=memo)
            model.train()
            params = list(model.parameters())
            for p in params:
                p.grad = torch.zeros_like(p)
            generator = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, sizes.vocab, (1, seq), generator=generator)
            labels = torch.randint(0, sizes.vocab, (1, seq), generator=generator)
            positions = torch.arange(seq)[None]

            tracker.register_existing(params)
            tracker.register_existing([p.grad for p in params])
            result.static_bytes = tracker.stats()["current_device_bytes"]
            iterations = 1
            if method.memo:
                iterations = 2 if method.alpha != "auto" else AUTO_ALPHA_MEASURING_ITERATIONS + 1
            try:
                for _ in range(iterations):
                    tracker.reset_peak()
                    result.iteration_activation_bytes.append(0)
                    with tracker:
                        loss = model(tokens, positions, None, labels=labels).sum()
                        loss.backward()
                        del loss
                    if engine is not None:
                        engine.synchronize()
                    result.iteration_activation_bytes[-1] = (
                        tracker.stats()["peak_device_bytes"] - result.static_bytes)
                    if memo is not None:
                        with tracker:  # the LP may grow the rounding buffers now
                            memo.after_iteration()
                    result.iterations_done += 1
            except Exception as error:  # noqa: BLE001 - only the simulated OOM is expected
                if not _is_simulated_oom(error):
                    raise
                result.fits = False
                result.error = str(error).splitlines()[0][:200]
            gc.collect()
            stats = tracker.stats()
            if not result.fits:  # the failing iteration's peak so far
                result.iteration_activation_bytes[-1] = (
                    stats["peak_device_bytes"] - result.static_bytes)
            result.activation_bytes = result.iteration_activation_bytes[-1]
            result.peak_device_bytes = result.activation_bytes + result.static_bytes
            result.peak_host_bytes = stats["peak_host_bytes"]
            result.residual_bytes = stats["current_device_bytes"] - result.static_bytes
            if memo is not None:
                result.buffer_bytes = sum(buf.capacity for buf in memo.manager.buffers)
                result.alpha = memo.alpha
                result.alpha_log = " ".join(alpha_lines)
        finally:
            if engine is not None:
                engine.close()
            del model, memo, engine
            gc.collect()
        result.seconds = time.perf_counter() - start
        result.theory_bytes = theory_bytes(method, seq, layers, sizes, alpha=result.alpha)
        return result


# ---------------------------------------------------------------------------------- sections

def sequence_sweep(bench: Bench, log) -> list[Measurement]:
    rows = []
    for seq in bench.sizes.seqs:
        for method in METHODS:
            m = bench.run(method, seq, bench.sizes.layers)
            log(f"  seq {seq:6d} {method.label:32s} activations {m.activation_bytes / MIB:9.2f} MiB"
                f" (theory {m.theory_bytes / MIB:9.2f}), host {m.peak_host_bytes / MIB:8.2f} MiB,"
                f" {m.seconds:5.1f} s")
            rows.append(m)
    return rows


def layer_check(bench: Bench, log) -> list[Measurement]:
    rows = []
    for layers in bench.sizes.layer_counts:
        for key in LAYER_CHECK_KEYS:
            method = METHOD_BY_KEY[key]
            m = bench.run(method, bench.sizes.layer_seq, layers)
            log(f"  layers {layers:3d} {method.label:32s} activations "
                f"{m.activation_bytes / MIB:9.2f} MiB (theory {m.theory_bytes / MIB:9.2f}),"
                f" {m.seconds:5.1f} s")
            rows.append(m)
    return rows


def flatness(rows: list[Measurement], sizes: Sizes) -> dict[str, dict]:
    """Per method: activation bytes per layer count, max/min, growth per added layer in
    u = s*b*h*4 bytes (least-squares slope), and the flat verdict (slope <= FLAT_U_PER_LAYER)."""
    out = {}
    for key in LAYER_CHECK_KEYS:
        values = {m.layers: m.activation_bytes for m in rows if m.method == key}
        if len(values) < 2:
            continue
        u_bytes = F32 * sizes.layer_seq * sizes.hidden
        xs, ys = list(values), list(values.values())
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
                 / sum((x - mean_x) ** 2 for x in xs))
        u_per_layer = slope / u_bytes
        out[key] = {"bytes": values, "growth": max(ys) / max(1, min(ys)),
                    "u_per_layer": u_per_layer, "flat": u_per_layer <= FLAT_U_PER_LAYER}
    return out


def capacity_at_depth(bench: Bench, layers: int, log) -> dict:
    """Longest trainable sequence per method under a cap that full recompute just meets at
    ``capacity_seq`` tokens (static bytes measured on this depth's model)."""
    sizes = bench.sizes
    static = bench.run(METHOD_BY_KEY["full"], sizes.search_step, layers).static_bytes
    cap_activations = theory_bytes(METHOD_BY_KEY["full"], sizes.capacity_seq, layers, sizes)
    cap = int(math.ceil((static + 1.02 * cap_activations) / MIB)) * MIB
    log(f"  {layers} layers: simulated device capacity {cap / MIB:.0f} MiB (static "
        f"{static / MIB:.2f} MiB + ~1.02 x theory full recompute at {sizes.capacity_seq} tokens)")
    results = {"layers": layers, "capacity_bytes": cap, "static_bytes": static, "methods": {}}
    for key in sizes.capacity_keys:
        method = CAPACITY_METHODS[key]
        probes: list[Measurement] = []

        def fits(seq: int) -> bool:
            m = bench.run(method, seq, layers, capacity_bytes=cap)
            probes.append(m)
            where = "" if m.fits else f" in iteration {m.iterations_done + 1}"
            log(f"    {method.label:24s} seq {seq:6d}: {'fits' if m.fits else 'OOM '}{where}"
                f" ({m.seconds:4.1f} s{'' if m.alpha is None else f', alpha {m.alpha:.3f}'})")
            return m.fits

        start = time.perf_counter()
        longest = longest_fitting(fits, sizes.search_step, sizes.search_max)
        best = next((m for m in probes if m.seq == longest and m.fits), None)
        results["methods"][key] = {
            "label": method.label,
            "longest_seq": longest,
            "hit_search_max": longest >= sizes.search_max,
            "alpha": None if best is None else best.alpha,
            "alpha_log": "" if best is None else best.alpha_log,
            "activation_bytes": None if best is None else best.activation_bytes,
            "probes": [(m.seq, m.fits, m.iterations_done) for m in probes],
            "seconds": time.perf_counter() - start,
        }
        log(f"  {layers} layers, {method.label:24s} longest sequence {longest}")
    full = results["methods"]["full"]["longest_seq"]
    memo = results["methods"]["memo-auto"]["longest_seq"]
    results["ratio"] = memo / full if full else math.inf
    results["pass"] = results["ratio"] >= CAPACITY_GOAL
    if "memo-auto-long" in results["methods"]:
        long_path = results["methods"]["memo-auto-long"]["longest_seq"]
        results["long_ratio"] = long_path / full if full else math.inf
        results["long_pass"] = results["long_ratio"] >= LONG_PATH_CAPACITY_GOAL
    return results


def capacity(bench: Bench, log) -> dict:
    """Section 3 at every depth of ``capacity_depths``; the verdict is the deepest one's (the
    depth of the 7B-13B models this targets: MEMO's advantage grows with depth, see
    break_even_lines)."""
    depths = [capacity_at_depth(bench, n, log) for n in bench.sizes.capacity_depths]
    return {"depths": depths, "goal": CAPACITY_GOAL, "ratio": depths[-1]["ratio"],
            "pass": depths[-1]["pass"], "long_goal": LONG_PATH_CAPACITY_GOAL}


# ------------------------------------------------------------------------------------ output

def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.2f}"


def sweep_tables(rows: list[Measurement], sizes: Sizes) -> list[str]:
    keys = [m.key for m in METHODS]
    lines = [f"### Peak device activation MiB, measured (theory), {sizes.layers} layers", "",
             "| seq | " + " | ".join(METHOD_BY_KEY[k].label for k in keys) + " |",
             "|---:|" + "---:|" * len(keys)]
    for seq in sizes.seqs:
        cells = []
        for key in keys:
            m = next(r for r in rows if r.seq == seq and r.method == key)
            cells.append(f"{_mib(m.activation_bytes)} ({_mib(m.theory_bytes)})")
        lines.append(f"| {seq} | " + " | ".join(cells) + " |")
    lines += ["", "### Details", "",
              "| seq | method | activations MiB | theory MiB | measured/theory | per token·h (fp32 "
              "elements) | iteration 1 MiB | MEMO buffers MiB | left on device after backward MiB"
              " | host peak MiB | CPU s |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in rows:
        per = m.activation_bytes / (F32 * m.seq * sizes.hidden)
        lines.append(
            f"| {m.seq} | {METHOD_BY_KEY[m.method].label} | {_mib(m.activation_bytes)} | "
            f"{_mib(m.theory_bytes)} | {m.ratio:.2f} | {per:.1f} | "
            f"{_mib(m.iteration_activation_bytes[0]) if METHOD_BY_KEY[m.method].memo else '-'} | "
            f"{_mib(m.buffer_bytes) if METHOD_BY_KEY[m.method].memo else '-'} | "
            f"{_mib(m.residual_bytes)} | {_mib(m.peak_host_bytes)} | {m.seconds:.1f} |")
    return lines


def layer_tables(rows: list[Measurement], flat: dict, sizes: Sizes) -> list[str]:
    counts = sizes.layer_counts
    lines = [f"### Peak device activation MiB vs number of layers, seq {sizes.layer_seq}, "
             "measured (theory)", "",
             "| method | " + " | ".join(f"{n} layers" for n in counts)
             + " | max/min | growth per added layer (u = s·b·h·4 bytes) |",
             "|---|" + "---:|" * (len(counts) + 2)]
    for key in LAYER_CHECK_KEYS:
        cells = []
        for n in counts:
            m = next(r for r in rows if r.layers == n and r.method == key)
            cells.append(f"{_mib(m.activation_bytes)} ({_mib(m.theory_bytes)})")
        lines.append(f"| {METHOD_BY_KEY[key].label} | " + " | ".join(cells)
                     + f" | {flat[key]['growth']:.2f} | {flat[key]['u_per_layer']:.2f} |")
    lines += ["", "Left on device after backward (MiB; MEMO's two rounding buffers persist by "
              "design, anything above them is memory the iteration did not give back):", "",
              "| method | " + " | ".join(f"{n} layers" for n in counts) + " |",
              "|---|" + "---:|" * len(counts)]
    for key in LAYER_CHECK_KEYS:
        cells = []
        for n in counts:
            m = next(r for r in rows if r.layers == n and r.method == key)
            extra = f" (buffers {_mib(m.buffer_bytes)})" if METHOD_BY_KEY[key].memo else ""
            cells.append(_mib(m.residual_bytes) + extra)
        lines.append(f"| {METHOD_BY_KEY[key].label} | " + " | ".join(cells) + " |")
    lines += ["", *flatness_lines(flat)]
    return lines


def memo_notes(rows: list[Measurement], sizes: Sizes) -> list[str]:
    """Data-driven remarks on the MEMO rows of the layer check: device memory not given back
    after backward (beyond the rounding buffers, which persist by design) and rounding-buffer
    overshoot."""
    notes = []
    for key in LAYER_CHECK_KEYS:
        method = METHOD_BY_KEY[key]
        mine = sorted((m for m in rows if m.method == key), key=lambda m: m.layers)
        if not method.memo or not mine:
            continue
        u_bytes = F32 * mine[0].seq * sizes.hidden
        kept = [m.residual_bytes - m.buffer_bytes for m in mine]
        if any(k > 0.01 * max(1, m.activation_bytes) for k, m in zip(kept, mine)):
            per_layer = kept[-1] / u_bytes / max(1, mine[-1].layers - 2)
            notes.append(
                f"- {method.label}: "
                + " / ".join(f"{k / MIB:.2f}" for k in kept)
                + f" MiB ({' / '.join(str(m.layers) for m in mine)} layers; "
                f"~{per_layer:.2f} u per offloaded layer, u = s·b·h·4 bytes) stay on device "
                "after backward + gc.collect(), beyond the rounding buffers.")
        need = 2 * (3 + float(method.alpha) * (14 + 4 / sizes.heads)) * u_bytes
        if mine[-1].buffer_bytes > 1.2 * need:
            notes.append(
                f"- {method.label}: the two rounding buffers hold {mine[-1].buffer_bytes / MIB:.2f}"
                f" MiB where the theory's 2·O(alpha) is {need / MIB:.2f} MiB.")
    return notes


def flatness_lines(flat: dict) -> list[str]:
    lines = []
    for key in LAYER_CHECK_KEYS:
        if not METHOD_BY_KEY[key].memo:
            continue
        info = flat[key]
        verdict = "PASS" if info["flat"] else "FAIL"
        lines.append(f"- {verdict}: {METHOD_BY_KEY[key].label} device activation bytes flat in "
                     f"the layer count: {info['u_per_layer']:.3f} u per added layer (threshold "
                     f"{FLAT_U_PER_LAYER} u; full recompute {flat['full']['u_per_layer']:.2f} u, "
                     f"no recompute {flat['none']['u_per_layer']:.2f} u)")
    memo_keys = [k for k in LAYER_CHECK_KEYS if METHOD_BY_KEY[k].memo]
    overall = all(flat[k]["flat"] for k in memo_keys)
    lines.append(f"- {'PASS' if overall else 'FAIL'}: MEMO device activation bytes do not grow "
                 "with the number of layers (all alphas)")
    return lines


def capacity_lines(cap: dict, sizes: Sizes) -> list[str]:
    lines = [f"Search over multiples of {sizes.search_step} up to {sizes.search_max} tokens, per "
             f"depth, under a cap set so that Megatron full recompute just fits "
             f"{sizes.capacity_seq} tokens. A sequence trains when one iteration fits (Megatron) "
             "or every iteration MEMO runs does (fixed alpha: two, the first grows the rounding "
             "buffers; alpha auto: three, the first two at alpha 0 measure for the LP, including "
             "the device headroom left at the alpha-0 peak, the third runs at the solved "
             "alpha).", ""]
    for depth in cap["depths"]:
        lines += [f"### {depth['layers']} layers: capacity {depth['capacity_bytes'] / MIB:.0f} MiB"
                  f" (parameters + gradients {depth['static_bytes'] / MIB:.2f} MiB)", "",
                  "| method | longest sequence that trains | alpha used | activations MiB there | "
                  "probes (seq: y fits / n OOM, @k = in iteration k) |", "|---|---:|---:|---:|---|"]
        for key, info in depth["methods"].items():
            alpha = "-" if info["alpha"] is None else f"{info['alpha']:.3f}"
            probes = ", ".join(
                f"{s}:" + ("y" if ok else "n" + (f"@{done + 1}" if key.startswith("memo") else ""))
                for s, ok, done in info["probes"])
            longest = f"{info['longest_seq']}" + (" (search max)" if info["hit_search_max"] else "")
            lines.append(f"| {info['label']} | {longest} | {alpha} | "
                         f"{_mib(info['activation_bytes'])} | {probes} |")
        lines += ["", f"- {'PASS' if depth['pass'] else 'FAIL'}: {depth['layers']} layers, MEMO "
                  f"(alpha auto) / Megatron full recompute longest sequence = "
                  f"{depth['ratio']:.2f}x (goal >= {cap['goal']}x)"]
        if "long_ratio" in depth:
            lines.append(f"- {'PASS' if depth['long_pass'] else 'FAIL'}: {depth['layers']} layers,"
                         f" MEMO + chunked loss + tiled MLP (alpha auto) / Megatron full "
                         f"recompute longest sequence = {depth['long_ratio']:.2f}x (goal >= "
                         f"{cap['long_goal']}x)")
        auto = depth["methods"]["memo-auto"]
        if auto["alpha_log"]:
            lines += ["", f"Alpha LP at MEMO's longest sequence: `{auto['alpha_log']}`"]
        lines.append("")
    deepest = cap["depths"][-1]
    lines += [f"- {'PASS' if cap['pass'] else 'FAIL'} (verdict, at {deepest['layers']} layers): "
              f"MEMO (alpha auto) trains {deepest['ratio']:.2f}x longer sequences than Megatron "
              f"full recompute (goal >= {cap['goal']}x)"]
    if "long_ratio" in deepest:
        lines.append(f"- {'PASS' if deepest['long_pass'] else 'FAIL'} (verdict, at "
                     f"{deepest['layers']} layers): MEMO with the chunked loss and the tiled MLP "
                     f"trains {deepest['long_ratio']:.2f}x longer sequences than Megatron full "
                     f"recompute as Megatron-LM ships it (goal >= {cap['long_goal']}x)")
    lines.append("")
    for depth in cap["depths"]:
        lines += [*break_even_lines(sizes, depth["layers"]), ""]
    return lines[:-1]


def break_even_lines(sizes: Sizes, layers: int, seq: int = 4096) -> list[str]:
    """From the theory: the depth at which MEMO's constant footprint beats full recompute's
    n u + L + H, and the depth at which it reaches the capacity goal (tokens scale ~linearly,
    so the capacity ratio ~ full / MEMO bytes at the same sequence)."""
    full = METHOD_BY_KEY["full"]
    lines = [f"Theory for this width at {layers} layers (at seq {seq}; the capacity ratio is "
             "about the inverse ratio of bytes per token):", ""]
    for key in ("memo-0", "memo-0.5", "memo-1"):
        memo = METHOD_BY_KEY[key]

        def first_depth(factor: float) -> str:
            for n in range(3, 4097):
                if theory_bytes(full, seq, n, sizes) >= factor * theory_bytes(memo, seq, n, sizes):
                    return str(n)
            return "> 4096"

        ratio = theory_bytes(full, seq, layers, sizes) / theory_bytes(memo, seq, layers, sizes)
        lines.append(f"- {memo.label}: at {layers} layers full recompute / MEMO bytes = "
                     f"{ratio:.2f}; MEMO needs fewer device bytes than full recompute from "
                     f"{first_depth(1.0)} layers on, {CAPACITY_GOAL}x fewer from "
                     f"{first_depth(CAPACITY_GOAL)} layers on.")
    return lines


FORMULAS = """\
All figures are fp32 bytes (4 per element); u = s·b·h, a = heads, V = vocabulary, n = layers.

- Per layer saved for backward (profiled on this layer): L = (18 + 4/a)·u + (4 + a)·s·b
  (docs/memo.md's 16·u, plus 2·u because v is a view of the fused QKV output and pins all 3·u of it,
  plus 4·u/a of RoPE cos/sin, plus LayerNorm statistics and the attention log-sum-exp).
- Head (final norm, logits, cross-entropy): H ≈ 2·u + 2·s·b·V.
- No recompute: n·L + H.
- Selective (core_attn): n·(L − a·s·b) + H. SDPA never materialises the a·s²·b score/softmax
  tensors Korthikanti's selective recompute removes, so it saves almost nothing here.
- Full recompute (uniform, 1 layer): n·u + L + H (every layer's input + one layer rebuilt).
- MEMO at alpha: 2·O(alpha) + W(alpha) + H. O(alpha) = 3·u + alpha·(14 + 4/a)·u is one
  rounding buffer's contents (layer input u, attention output counted 2·u as memo_ext's
  ActivationShape does, alpha of the (14 + 4/a)·u alpha-split tensors: LN1 output, q, k, v, LN2
  input and output, FC1 and GELU outputs, RoPE cos/sin); W(alpha) = (1 − alpha)·(14 + 4/a)·u + 3·u
  is one layer's recompute working set in backward (the dropped tokens' saved tensors rebuilt,
  plus q, k, v merged back to full length). No n in it.

Approximations: backward transients (gradients of the widest tensors) are not modelled. MEMO's
figure is its steady state (second iteration); the first iteration also pays for growing the
rounding buffers to size, shown apart ("iteration 1")."""


def provenance() -> str:
    """The commit measured and the memo_ext / megatron files that differ from it."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=30).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    # Porcelain lines are "XY path"; split instead of slicing, since a line may lose its
    # leading blank (X = " ") to stripping.
    dirty = [line.split(maxsplit=1)[1] for line in git(
        "status", "--porcelain", "--", "memo_ext", "megatron", "pretrain_gpt.py").splitlines()
        if line.strip()]
    changed = (f"; uncommitted changes in {', '.join(dirty)}" if dirty
               else "; no uncommitted changes in memo_ext/megatron")
    return f"commit {head}{changed}"


def write_report(out_dir: Path, sizes: Sizes, argv: list[str], sweep, layers, flat, cap,
                 seconds: float, code: str) -> None:
    command = " ".join(["PYTHONPATH=. python bench/offload_memory.py",
                        *(shlex.quote(a) for a in argv)])
    lines = [
        "# MEMO offload memory benchmark", "",
        f"Measured on CPU with DeviceMemoryTracker, {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__}; the 'device' "
        "is the CPU and the tracker counts device-resident storage bytes apart from MEMO's "
        "host-offloaded slots. GPU time is not measured here (CPU seconds are shown only to "
        "size the run).", "",
        f"Command: `{command}` (total {seconds:.0f} s)", "",
        f"Model: GPT, {sizes.layers} layers (sweep), hidden {sizes.hidden}, {sizes.heads} heads, "
        f"FFN {4 * sizes.hidden}, vocabulary {sizes.vocab}, micro-batch 1, fp32, dropout 0, RoPE, "
        "megatron.core local spec with SDPA core attention; one process (gloo world of 1). "
        "Each model built freshly; one forward + backward for Megatron's methods, two for MEMO "
        "(its rounding buffers and host slots persist across iterations: the reported figure is "
        "the second, steady-state iteration's peak, which includes the buffers; the first "
        "iteration's is shown apart).", "",
        "Activation bytes = peak device bytes of the iteration − static bytes (parameters + "
        "their gradients, pre-allocated as zeros and registered with the tracker before the "
        "iteration).", "",
        f"Code measured: {code}", "",
        "## Formulas (theory, approximate)", "", FORMULAS, "",
        "## 1. Sequence sweep", "", *sweep_tables(sweep, sizes), "",
        "## 2. Layer-count check", "", *layer_tables(layers, flat, sizes), "",
        "### Notes on the MEMO rows (computed from the measurements)", "",
        *(memo_notes([m for m in layers if m.seq == sizes.layer_seq], sizes)
          or ["- none: MEMO gave back everything but its rounding buffers"]), "",
        "## 3. Capacity under a simulated device cap", "",
        *(capacity_lines(cap, sizes) if cap else ["Skipped (--skip-capacity)."]), "",
        "Plots: `offload_memory.png` (activation bytes vs sequence length; measured solid, theory "
        "dashed), `offload_memory_layers.png` (vs number of layers)"
        + (", `offload_memory_capacity.png` (section 3)." if cap else "."), "",
    ]
    (out_dir / REPORT_MD).write_text("\n".join(lines))
    payload = {
        "sizes": asdict(sizes), "argv": argv, "seconds": seconds,
        "sweep": [asdict(m) for m in sweep], "layers": [asdict(m) for m in layers],
        "flatness": {k: {**v, "bytes": {str(n): b for n, b in v["bytes"].items()}}
                     for k, v in flat.items()},
        "capacity": cap,
    }
    (out_dir / REPORT_JSON).write_text(json.dumps(payload, indent=1))


def plot(out_dir: Path, sizes: Sizes, sweep, layers) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # Distinct markers and widths: some methods coincide (no recompute / selective).
    markers = ("s", "o", "x", "^", "v", "D")
    widths = (3.5, 2.0, 1.2, 1.6, 1.6, 1.6)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, method in enumerate(METHODS):
        rows = sorted((m for m in sweep if m.method == method.key), key=lambda m: m.seq)
        xs = [m.seq for m in rows]
        ax.plot(xs, [m.activation_bytes / MIB for m in rows], "-", marker=markers[i],
                linewidth=widths[i], color=colors[i % len(colors)],
                label=f"{method.label} (measured)")
        ax.plot(xs, [m.theory_bytes / MIB for m in rows], "--", color=colors[i % len(colors)],
                alpha=0.8, label=f"{method.label} (theory)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(sizes.seqs), [str(s) for s in sizes.seqs])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak device activation MiB (fp32)")
    ax.set_title(f"Peak device activations, {sizes.layers}-layer GPT h={sizes.hidden} "
                 "(CPU, DeviceMemoryTracker)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(out_dir / PLOT_SEQ, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, method in enumerate(METHODS):
        if method.key not in LAYER_CHECK_KEYS:
            continue
        rows = sorted((m for m in layers if m.method == method.key), key=lambda m: m.layers)
        xs = [m.layers for m in rows]
        ax.plot(xs, [m.activation_bytes / MIB for m in rows], "-", marker=markers[i],
                linewidth=widths[i], color=colors[i % len(colors)],
                label=f"{method.label} (measured)")
        ax.plot(xs, [m.theory_bytes / MIB for m in rows], "--", color=colors[i % len(colors)],
                alpha=0.8, label=f"{method.label} (theory)")
    ax.set_xticks(list(sizes.layer_counts))
    ax.set_xlabel("number of layers")
    ax.set_ylabel("peak device activation MiB (fp32)")
    ax.set_title(f"Peak device activations vs depth, seq {sizes.layer_seq}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(out_dir / PLOT_LAYERS, dpi=120)
    plt.close(fig)


def plot_capacity(out_dir: Path, cap: dict) -> None:
    """Longest trainable sequence per method, grouped by depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(cap["depths"][0]["methods"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        xs = [j + i * width for j in range(len(cap["depths"]))]
        ys = [depth["methods"][key]["longest_seq"] for depth in cap["depths"]]
        bars = ax.bar(xs, ys, width, label=CAPACITY_METHODS[key].label)
        ax.bar_label(bars, fontsize=7)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cap["depths"]))],
                  [f"{depth['layers']} layers" for depth in cap["depths"]])
    ax.set_ylabel("longest sequence that trains (tokens)")
    ax.set_title("Under a device cap that Megatron full recompute just meets")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / PLOT_CAPACITY, dpi=120)
    plt.close(fig)


def print_markdown(out_dir: Path) -> None:
    print((out_dir / REPORT_MD).read_text())


# -------------------------------------------------------------------------------------- main

def parse_cli(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny model and sequences (< 60 s), for the smoke test")
    parser.add_argument("-o", "--output-dir", type=Path, default=REPO_ROOT / "bench" / "results",
                        help="where the report, JSON and plots go (default bench/results)")
    parser.add_argument("--seqs", type=int, nargs="+", default=None,
                        help="sequence lengths of the sweep (default 1024 2048 4096 8192)")
    parser.add_argument("--layer-counts", type=int, nargs="+", default=None,
                        help="layer counts of the layer check (default 8 16 24; each > 2)")
    parser.add_argument("--skip-capacity", action="store_true",
                        help="skip the capacity search (section 3)")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    cli = parse_cli(argv)
    sizes = QUICK if cli.quick else FULL
    overrides = {}
    if cli.seqs:
        overrides["seqs"] = tuple(sorted(cli.seqs))
    if cli.layer_counts:
        if min(cli.layer_counts) <= 2:
            raise SystemExit("--layer-counts: MEMO needs more than 2 layers")
        overrides["layer_counts"] = tuple(sorted(cli.layer_counts))
    if overrides:
        sizes = replace(sizes, **overrides)
    out_dir = cli.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    code = provenance()  # before the run: edits made while it runs are not what it measured

    def log(line: str) -> None:
        print(line, flush=True)

    bench = Bench(sizes, log)
    log(f"== 1. sequence sweep ({sizes.layers} layers)")
    sweep = sequence_sweep(bench, log)
    log(f"== 2. layer-count check (seq {sizes.layer_seq})")
    layers = layer_check(bench, log)
    flat = flatness(layers, sizes)
    cap = None
    if not cli.skip_capacity:
        log("== 3. capacity under a simulated device cap")
        cap = capacity(bench, log)
    seconds = time.perf_counter() - started
    write_report(out_dir, sizes, argv, sweep, layers, flat, cap, seconds, code)
    plot(out_dir, sizes, sweep, layers)
    if cap is not None:
        plot_capacity(out_dir, cap)
    print_markdown(out_dir)
    log(f"wrote {out_dir / REPORT_MD}, {out_dir / REPORT_JSON}, {out_dir / PLOT_SEQ}, "
        f"{out_dir / PLOT_LAYERS} in {seconds:.0f} s")
    return json.loads((out_dir / REPORT_JSON).read_text())


if __name__ == "__main__":
    main()
