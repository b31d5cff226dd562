"""Configuration dataclasses for the MEMO mechanisms; the ``--memo-*`` flags are generated from them.

One definition per flag: each dataclass field carries its flag name and help text (declared with
:func:`memo_field`; the generator, its naming rule and the tools' variants are in
memo_ext.flags, re-exported here). Each config's ``validate()`` raises :class:`MemoConfigError`
with a one-line message naming the flag at fault and the fix; megatron.training.arguments calls
them all from ``_validate_memo`` and adds the checks that need the trainer's other flags.

Units: ``GB`` here is 10**9 bytes and ``GB/s`` is 10**9 bytes per second (the PCIe convention).

Nothing here imports megatron.training (the trainer imports memo_ext, never the reverse).

Why one file: the configs are the ``--memo-*`` flags' one definition, read together as one list
(CONFIG_GROUPS) by the trainer's parser, its validation, the tools and the flag renderer; each
is a few dozen lines of fields and help text, no mechanism.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

# Re-exported: the configs' flag API (importers keep ``from memo_ext.config import ...``).
from memo_ext.flags import (ARG_PREFIX, ToolVariant, add_config_arguments,  # noqa: F401
                            add_config_flags, arg_dest, arg_flag, config_from_args, memo_field)
from memo_ext.head_chunks import head_chunks_split, valid_head_chunks

#: Bytes in one GB as used by the ``--memo-*-gb`` / ``--memo-*-gbps`` flags.
BYTES_PER_GB = 10**9


class MemoConfigError(ValueError):
    """A ``--memo-*`` flag value or combination that cannot run; one line: the flag, the fix."""


def _fmt(value: Any) -> str:
    """A flag value as the user typed it (strings as given, numbers in ``%g`` form)."""
    return value if isinstance(value, str) else f"{value:g}"


def _require_positive(name: str, value: Optional[float], unit: str, fix: str = "") -> None:
    """Raise MemoConfigError unless the optional field ``name`` is None or a positive finite
    number of ``unit`` (also rejects nan); ``fix`` ends the message."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise MemoConfigError(f"{arg_flag(name)} {_fmt(value)} must be a positive number of "
                              f"{unit}" + (f"; {fix}" if fix else ""))


def _reject_without(config: Any, switch: str, given: Optional[dict[str, bool]] = None,
                    fmt=_fmt) -> None:
    """Raise MemoConfigError for the first field given without the bool field ``switch``
    (given: ``given[name]``, by default "differs from the field default")."""
    if getattr(config, switch):
        return
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name != switch and (given[field.name] if given is not None
                                     else value != field.default):
            raise MemoConfigError(f"{arg_flag(field.name)} {fmt(value)} has no effect without "
                                  f"{arg_flag(switch)}; add {arg_flag(switch)} or drop it")


@dataclass
class OffloadConfig:
    """MEMO token-wise activation swapping + recomputation of skeletal activations.

    Field help texts are the flag documentation; see docs/memo.md "Choosing alpha (LP)".
    """

    offload: bool = memo_field(
        False, flag="--memo-offload",
        help="Route every TransformerLayer's skeletal activations through MEMO's token-wise "
             "swap + recompute: the layer input and attention output are offloaded whole, the "
             "first alpha*s tokens of the other saved tensors go to host memory and the rest "
             "are recomputed before the layer's backward. The last two layers of each pipeline "
             "stage are never offloaded.")
    alpha: str = memo_field(
        "auto", flag="--memo-alpha", metavar="{auto,ALPHA}",
        help="'auto' or a float in [0, 1]: fraction of tokens of the alpha-split tensors that is "
             "offloaded to host memory; the rest is recomputed. 'auto' solves MEMO's LP (largest "
             "alpha whose copies hide under one layer's forward and whose slots fit host "
             "memory).")
    host_memory_gb: Optional[float] = memo_field(
        None, flag="--memo-host-memory-gb", metavar="GB",
        help="Host memory for offloaded activations per rank, in GB (1e9 bytes). Default: "
             "available host memory at startup / ranks on this node.")
    device_memory_gb: Optional[float] = memo_field(
        None, flag="--memo-device-memory-gb", metavar="GB",
        help="Device memory MEMO's activations may use per rank, in GB (1e9 bytes): the two "
             "rounding buffers plus one layer's recompute working set. Adds a device constraint "
             "to the alpha LP (offloaded tokens need buffer space twice, recomputed ones once, so "
             "a tight budget lowers alpha). Default: with --memo-alpha auto, the device memory "
             "left free at the peak of the first (alpha=0) iteration caps alpha (on CUDA: free "
             "memory above the caching allocator's peak, less 5% for fragmentation); where the "
             "device's capacity cannot be read (CPU), no device constraint (the paper's LP).")
    pcie_gbps: Optional[float] = memo_field(
        None, flag="--memo-pcie-gbps", metavar="GB/S",
        help="Device->host copy bandwidth per rank, in GB/s (1e9 bytes/s). Default: measured "
             "at startup with all ranks of the node copying at once.")
    checkpoint_layers: str = memo_field(
        "auto", flag="--memo-checkpoint-layers", metavar="{auto,N}",
        help="Layers per pipeline stage offloaded as checkpoints: only the layer input goes to "
             "host memory and the whole layer, attention included, is recomputed before its "
             "backward (half or less of MEMO's host bytes per layer, for the attention's "
             "recomputation). 'auto' takes the fewest such layers that let the host budget hold "
             "(0 when MEMO's own offload fits) and, with --memo-alpha auto, trades them against "
             "alpha for the least recomputation; N fixes the count (spread evenly over the "
             "stage's offloaded layers).")
    offload_fp8: bool = memo_field(
        False, flag="--memo-offload-fp8",
        help="Lossy: store the tensors offloaded whole (layer inputs, attention outputs) in "
             "host memory as fp8 e4m3 with one fp32 scale per block of 128 values, about half "
             "the host bytes of bf16. Backward then recomputes from rounded inputs, so gradients "
             "are no longer exact; see docs/memo_offload_modes.md for the measured loss gap.")

    offload_buffers: int = memo_field(
        2, flag="--memo-offload-buffers", choices=(1, 2), metavar="{1,2}",
        help="Device buffers an offloaded layer's data passes through (docs/memo_offload_modes.md). "
             "2 (default): double-buffered, each layer's device->host copy and its prefetch back "
             "overlap the neighbouring layer's compute; the last two layers of a stage stay on "
             "device. 1: one layer's data on device at a time, in a buffer sized to that layer; "
             "each copy waits (a layer's forward starts after the previous layer's copy to host "
             "ends, its backward after its own copy back ends) and only the last layer stays on "
             "device. The least device memory, for the longest sequences, where a copy takes a "
             "fraction of a second against minutes of attention.")

    @property
    def layers_kept_on_device(self) -> int:
        """The last layers of a stage never offloaded: one per buffer (with one micro-batch in
        flight their data stays in a buffer until their backward, which follows at once)."""
        return self.offload_buffers

    @property
    def fixed_alpha(self) -> float | None:
        """The user-given alpha as a float in [0, 1], or None for ``auto`` (solve the LP).

        Raises MemoConfigError if alpha is neither ``auto`` nor a number (call validate()).
        """
        if isinstance(self.alpha, str) and self.alpha.strip().lower() == "auto":
            return None
        try:
            return float(self.alpha)
        except (TypeError, ValueError):
            raise MemoConfigError(f"--memo-alpha {self.alpha!r} is not a number; use auto "
                                  "or a value in [0, 1]") from None

    @property
    def fixed_checkpoint_layers(self) -> int | None:
        """``--memo-checkpoint-layers`` as a count, or None for ``auto`` (the solver's choice).

        Raises MemoConfigError if it is neither ``auto`` nor a non-negative integer."""
        text = str(self.checkpoint_layers).strip().lower()
        if text == "auto":
            return None
        if not text.isdigit():
            raise MemoConfigError(f"--memo-checkpoint-layers {self.checkpoint_layers!r} is not "
                                  "a count; use auto or a whole number of layers >= 0")
        return int(text)

    @property
    def host_memory_bytes(self) -> int | None:
        """``--memo-host-memory-gb`` in bytes, or None when not given (use the default)."""
        return None if self.host_memory_gb is None else int(self.host_memory_gb * BYTES_PER_GB)

    @property
    def device_memory_bytes(self) -> int | None:
        """``--memo-device-memory-gb`` in bytes, or None when not given (no device constraint)."""
        return None if self.device_memory_gb is None else int(self.device_memory_gb * BYTES_PER_GB)

    @property
    def pcie_bytes_per_s(self) -> float | None:
        """``--memo-pcie-gbps`` in bytes/s, or None when not given (measure at startup)."""
        return None if self.pcie_gbps is None else self.pcie_gbps * BYTES_PER_GB

    def validate(self) -> None:
        """Raise MemoConfigError (one line: the flag and the fix) on any unusable value.

        Value checks come first; then flags that only matter with ``--memo-offload`` are
        rejected without it. "Given" means "differs from the field default" (alpha: not
        ``auto``; the others: not None), so an explicit ``--memo-alpha auto`` without
        ``--memo-offload`` is accepted.
        """
        alpha = self.fixed_alpha  # raises for a non-number
        if alpha is not None and not 0.0 <= alpha <= 1.0:  # also rejects nan
            raise MemoConfigError(f"--memo-alpha {_fmt(self.alpha)} is outside [0, 1]; use auto "
                                  "or a value in [0, 1]")
        _require_positive("host_memory_gb", self.host_memory_gb, "GB", "give the host memory per "
                          "rank or drop the flag to use available memory / local ranks")
        _require_positive("device_memory_gb", self.device_memory_gb, "GB", "give the device "
                          "budget per rank or drop the flag")
        _require_positive("pcie_gbps", self.pcie_gbps, "GB/s", "give the device->host bandwidth "
                          "per rank or drop the flag to measure it at startup")
        checkpoint_layers = self.fixed_checkpoint_layers  # raises for a non-count
        if self.offload_buffers not in (1, 2):
            raise MemoConfigError(f"--memo-offload-buffers {_fmt(self.offload_buffers)} must be 1 "
                                  "or 2")
        _reject_without(self, "offload", given={
            "alpha": alpha is not None, "host_memory_gb": self.host_memory_gb is not None,
            "device_memory_gb": self.device_memory_gb is not None,
            "pcie_gbps": self.pcie_gbps is not None,
            "checkpoint_layers": checkpoint_layers is not None, "offload_fp8": self.offload_fp8,
            "offload_buffers": self.offload_buffers != 2})


PLAN_OFF, PLAN_AUTO = "off", "auto"


@dataclass
class PlanConfig:
    """MEMO's bi-level memory plan and planned arena (docs/memo.md "Bi-level memory planning")."""

    plan: str = memo_field(
        PLAN_OFF, flag="--memo-plan", metavar="{off,auto,PATH}",
        help="Serve the transformer layers' transient tensors from a planned arena. 'auto' warms "
             "up one iteration, traces and plans the second, and uses the plan from iteration 3; "
             "PATH reads a plan "
             "made by tools/memo_plan.py for this model, layout and sequence length. On CPU the "
             "arena runs as a shadow: every request of the layers is matched against the plan "
             "and counted, the tensors stay where PyTorch put them.")

    @property
    def mode(self) -> str:
        """'off', 'auto' or 'file'."""
        if self.plan in (PLAN_OFF, PLAN_AUTO):
            return self.plan
        return "file"

    def validate(self) -> None:
        """Raise MemoConfigError (one line) unless --memo-plan is off, auto or a readable file."""
        if self.mode == "file" and not os.path.isfile(self.plan):
            raise MemoConfigError(f"--memo-plan {self.plan}: no such plan file; use off, auto, "
                                  "or a plan from tools/memo_plan.py")


#: Bytes in one MiB, the unit of ``--memo-stitching-frag-limit-mib``.
BYTES_PER_MIB = 2**20


@dataclass
class StitchingConfig:
    """GMLake's virtual memory stitching allocator as the process's CUDA allocator, in place of
    PyTorch's caching allocator (memo_ext.alloc.stitching_cuda; docs/stitching.md)."""

    stitching_allocator: bool = memo_field(
        False, flag="--memo-stitching-allocator",
        help="Replace PyTorch's CUDA caching allocator by GMLake's stitching allocator "
             "(csrc/cuda/stitching_cuda.cpp over the CUDA virtual memory API, built with g++ "
             "against the CUDA toolkit's cuda.h at startup): a request with no free block large "
             "enough is served by mapping several free blocks into one contiguous virtual range "
             "instead of new memory. Installed before the first CUDA allocation; from then on "
             "memory statistics come from memo_ext.device_memory. Needs a GPU; not with "
             "--memo-plan (both replace the allocator). Exercised against a fake CUDA driver "
             "only, never on a GPU in this project.")
    stitching_frag_limit_mib: int = memo_field(
        128, flag="--memo-stitching-frag-limit-mib", metavar="MiB",
        help="Requests below this many MiB (2**20 bytes) take the stitching allocator's "
             "embedded caching path (PyTorch's rules); larger ones are stitched. GMLake's "
             "default, 128 (kDefaultFragLimit in csrc/stitching_rules.h).")

    @property
    def frag_limit_bytes(self) -> int:
        """``--memo-stitching-frag-limit-mib`` in bytes."""
        return self.stitching_frag_limit_mib * BYTES_PER_MIB

    def validate(self) -> None:
        """Raise MemoConfigError (one line: the flag and the fix) on a negative limit, or a
        limit given without --memo-stitching-allocator (given = differs from the default)."""
        if self.stitching_frag_limit_mib < 0:
            raise MemoConfigError(f"--memo-stitching-frag-limit-mib "
                                  f"{self.stitching_frag_limit_mib} is negative; give MiB >= 0 "
                                  "or drop the flag for GMLake's 128")
        _reject_without(self, "stitching_allocator", fmt=str)

    def validate_with(self, plan: str, cuda_available: bool) -> None:
        """Raise MemoConfigError (one line) when --memo-stitching-allocator cannot run beside
        ``plan`` (the --memo-plan value) or without CUDA."""
        if not self.stitching_allocator:
            return
        if plan != PLAN_OFF:
            raise MemoConfigError(f"--memo-stitching-allocator and --memo-plan {plan} both "
                                  "replace PyTorch's CUDA allocator; drop one (or use "
                                  "--memo-plan off)")
        if not cuda_available:
            raise MemoConfigError("--memo-stitching-allocator replaces the CUDA allocator and "
                                  "needs a GPU; this machine has none (CPU runs keep PyTorch's "
                                  "allocator): drop the flag")


@dataclass
class TelemetryConfig:
    """Training-time memory telemetry: per-step, per-rank device memory by category, gathered
    to rank 0 every --log-interval, fail-fast near capacity, OOM reports (docs/telemetry.md)."""

    telemetry: bool = memo_field(
        False, flag="--memo-telemetry",
        help="Measure every training step's device memory on every rank (CUDA: the caching "
             "allocator's allocated/reserved/peak; CPU: memo_ext.telemetry's tracker, which "
             "counts tensor storages), by category where known (params, grads, optimizer, "
             "activations, backward, offload, comm); every --log-interval steps rank 0 prints "
             "the max/mean over ranks, the skew and the worst rank. An out-of-memory error "
             "writes a report (rank, phase, layer, micro-batch, categories) and a snapshot.")
    device_capacity_gb: Optional[float] = memo_field(
        None, flag="--memo-device-capacity-gb", metavar="GB",
        help="Device memory per rank, in GB (1e9 bytes), for the fail-fast check and the OOM "
             "report. On CPU it is the simulated device's capacity: a step that would hold more "
             "tracked bytes fails with an out-of-memory report. On CUDA it caps the caching "
             "allocator (torch.cuda.set_per_process_memory_fraction). Default: the GPU's total "
             "memory on CUDA; unlimited (no fail-fast) on CPU. Not MEMO's --memo-device-memory-gb, "
             "which only budgets MEMO's own buffers.")
    telemetry_warmup_steps: int = memo_field(
        3, flag="--memo-telemetry-warmup-steps", metavar="STEPS",
        help="Steps after which the fail-fast check starts (peaks are reached in the first "
             "iterations: optimizer state appears at the first step, MEMO sizes its buffers "
             "after its measuring iterations). The check then runs at that step and at every "
             "--log-interval.")
    telemetry_fail_fast_margin: float = memo_field(
        0.05, flag="--memo-telemetry-fail-fast-margin", metavar="FRACTION",
        help="Stop training (exit status 3, with a report) once the worst rank's peak reaches "
             "(1 - FRACTION) x capacity after the warm-up, instead of running on into an OOM "
             "hours later. 0 turns the check off. Needs a known capacity (CUDA, or "
             "--memo-device-capacity-gb).")
    oom_report_dir: str = memo_field(
        "memo_oom_reports", flag="--memo-oom-report-dir", metavar="DIR",
        help="Where out-of-memory and fail-fast reports go: oom_rank<R>_iter<I>.json (+ the "
             "allocation trace .jsonl.gz and a PyTorch-snapshot .pickle for memory_viz on CPU; "
             "torch.cuda.memory._dump_snapshot's pickle on CUDA). Created on demand.")
    estimated_peak_gb: Optional[float] = memo_field(
        None, flag="--memo-estimated-peak-gb", metavar="GB",
        help="The per-rank peak tools/estimate.py predicted for this run, in GB (1e9 bytes); "
             "the telemetry lines and the OOM report show it beside the measured peak.")

    @property
    def device_capacity_bytes(self) -> int | None:
        """``--memo-device-capacity-gb`` in bytes, or None when not given."""
        return None if self.device_capacity_gb is None else int(self.device_capacity_gb * BYTES_PER_GB)

    @property
    def estimated_peak_bytes(self) -> int | None:
        """``--memo-estimated-peak-gb`` in bytes, or None when not given."""
        return None if self.estimated_peak_gb is None else int(self.estimated_peak_gb * BYTES_PER_GB)

    def validate(self) -> None:
        """Raise MemoConfigError (one line: the flag and the fix) on any unusable value; the
        other flags need --memo-telemetry (given = differs from the default)."""
        for name in ("device_capacity_gb", "estimated_peak_gb"):
            _require_positive(name, getattr(self, name), "GB",
                              "give the bytes per rank in GB or drop the flag")
        if self.telemetry_warmup_steps < 0:
            raise MemoConfigError(f"--memo-telemetry-warmup-steps {self.telemetry_warmup_steps} "
                                  "must be >= 0")
        if not 0.0 <= self.telemetry_fail_fast_margin < 1.0:  # also rejects nan
            raise MemoConfigError(f"--memo-telemetry-fail-fast-margin "
                                  f"{_fmt(self.telemetry_fail_fast_margin)} is outside [0, 1); "
                                  "use e.g. 0.05 (stop at 95% of capacity) or 0 (no check)")
        if not self.oom_report_dir:
            raise MemoConfigError("--memo-oom-report-dir is empty; give a directory")
        _reject_without(self, "telemetry")


SPPO_AUTO = "auto"
SPPO_OFFLOAD_NONE = "none"


@dataclass
class SPPOConfig:
    """SPPO: a sequence cut into subsequences that flow through the pipeline as micro-batches,
    with per-subsequence offload ratios (docs/sppo.md)."""

    sppo: bool = memo_field(
        False, flag="--memo-sppo",
        help="Run each sequence as subsequences through the pipeline stages (SPPO): forward on "
             "subsequences 0..N-1, backward on N-1..0, each layer keeping the K/V of earlier "
             "subsequences on device. Bubble (p-1)/N instead of (p-1)/micro-batches, so long "
             "sequences with one micro-batch per step still fill the pipeline. Needs causal "
             "attention without dropout, no context parallelism and no --memo-offload.")
    sppo_subsequences: str = memo_field(
        SPPO_AUTO, flag="--memo-sppo-subsequences", metavar="{auto,N}",
        help="Subsequences per sequence. 'auto': the smallest power of two whose bubble ratio "
             "(p-1)/N is at most 10%%, as long as subsequences keep >= 2048 tokens (shorter ones "
             "lose GPU efficiency; docs/sppo.md 'Pipeline and solver').")
    sppo_partition: str = memo_field(
        "flops", flag="--memo-sppo-partition", choices=("flops", "length"),
        help="Where to cut: 'flops' gives every subsequence the same causal attention + linear "
             "FLOPs (later subsequences are shorter), 'length' cuts equal lengths.")
    sppo_offload: str = memo_field(
        SPPO_OFFLOAD_NONE, flag="--memo-sppo-offload", metavar="{none,auto,ALPHA}",
        help="Share of each subsequence's saved activations (not K/V, not parameters) copied to "
             "host memory during forward and prefetched before its backward. 'auto': iteration 1 "
             "measures each subsequence's bytes A_i and forward time T_i, then alpha_i = "
             "min(1, BW*T_{i+1}/A_i); the last subsequence is never offloaded.")
    sppo_pcie_gbps: Optional[float] = memo_field(
        None, flag="--memo-sppo-pcie-gbps", metavar="GB/S",
        help="Device->host bandwidth per rank for --memo-sppo-offload auto, in GB/s. Default: "
             "measured at startup with all ranks copying at once.")

    sppo_msp: bool = memo_field(
        False, flag="--memo-sppo-msp",
        help="Multiplexed sequence partitioning: during a sequence's warm-up and cool-down the "
             "stages that would idle run part of the busy stages' transformer layers (the "
             "owner broadcasts its layer weights, the group splits the subsequence into "
             "FLOPs-balanced pieces and recomputes them in backward). Needs "
             "--pipeline-model-parallel-size > 1, --tensor-model-parallel-size 1 and "
             "--hidden-dropout 0.")
    sppo_host_memory_gb: Optional[float] = memo_field(
        None, flag="--memo-sppo-host-memory-gb", metavar="GB",
        help="Host memory per rank that --memo-sppo-offload may fill, in GB. A saved tensor that "
             "would go beyond it stays on device (counted in the offload log line). Default: "
             "the host memory available at startup divided by the ranks on the node.")

    @property
    def subsequences(self) -> Optional[int]:
        """The fixed subsequence count, or None for auto."""
        if self.sppo_subsequences.strip().lower() == SPPO_AUTO:
            return None
        try:
            return int(self.sppo_subsequences)
        except ValueError:
            raise MemoConfigError(f"--memo-sppo-subsequences {self.sppo_subsequences!r} is not a "
                                  "whole number; use auto or N >= 1") from None

    @property
    def offload_alpha(self) -> Optional[float]:
        """The fixed offload share (0 for none), or None for auto."""
        value = self.sppo_offload.strip().lower()
        if value == SPPO_AUTO:
            return None
        if value == SPPO_OFFLOAD_NONE:
            return 0.0
        try:
            return float(value)
        except ValueError:
            raise MemoConfigError(f"--memo-sppo-offload {self.sppo_offload!r} is not none, auto "
                                  "or a number in [0, 1]") from None

    @property
    def pcie_bytes_per_s(self) -> Optional[float]:
        return None if self.sppo_pcie_gbps is None else self.sppo_pcie_gbps * BYTES_PER_GB

    @property
    def host_memory_bytes(self) -> Optional[int]:
        return (None if self.sppo_host_memory_gb is None
                else int(self.sppo_host_memory_gb * BYTES_PER_GB))

    def validate(self) -> None:
        """Raise MemoConfigError (one line: the flag and the fix) on any unusable value."""
        count = self.subsequences
        if count is not None and count < 1:
            raise MemoConfigError(f"--memo-sppo-subsequences {count} must be >= 1 (or auto)")
        alpha = self.offload_alpha
        if alpha is not None and not 0.0 <= alpha <= 1.0:
            raise MemoConfigError(f"--memo-sppo-offload {self.sppo_offload} is outside [0, 1]; "
                                  "use none, auto or a share in [0, 1]")
        _require_positive("sppo_pcie_gbps", self.sppo_pcie_gbps, "GB/s")
        _require_positive("sppo_host_memory_gb", self.sppo_host_memory_gb, "GB")
        _reject_without(self, "sppo", fmt=str)


@dataclass
class METPConfig:
    """METP: tensor parallelism whose weight shards travel a P2P ring while activations stay
    sequence-sharded, so no rank holds a full-sequence activation (docs/metp.md)."""

    metp: bool = memo_field(
        False, flag="--memo-metp",
        help="Run attention and MLP with memory-efficient tensor parallelism (METP): each TP rank "
             "keeps its sequence shard and the weight shards travel a ring (MLP) or are "
             "broadcast per head group with K/V on a sequence ring (attention), instead of "
             "all-gathering the sequence. Same weights and checkpoints as TP+SP; implies "
             "--sequence-parallel. Needs --tensor-model-parallel-size > 1, causal attention "
             "without dropout, --seq-length divisible by 2 x TP, no context parallelism, no "
             "recompute, no --memo-offload and no --memo-sppo (checked with the trainer's "
             "flags in megatron.training.arguments).")


@dataclass
class AttentionConfig:
    """The core attention's device working set for the longest sequences
    (memo_ext.attention; docs/memo_offload_modes.md, "The device wall")."""

    attention_head_chunks: int = memo_field(
        1, flag="--memo-attention-head-chunks", metavar="N",
        help="Run the core attention, its context-parallel ring included, over N chunks of "
             "this rank's query heads one after another (UPipe's head chunking, arXiv "
             "2602.21196): the ring's buffers, dQ/dK/dV and the kernel workspaces are one "
             "chunk's. N divides the rank's query groups (--num-query-groups / TP), or is a "
             "multiple of them dividing its heads (chunks inside a group: its K/V travel the "
             "ring once per chunk, its dK/dV sum theirs). 1 (the default): all at once.")
    attention_projection_tile_size: int = memo_field(
        0, flag="--memo-attention-projection-tile-size", metavar="TOKENS",
        help="Run the attention's QKV and output projections over tiles of this many tokens "
             "(counted as --memo-mlp-tile-size counts them: after sequence parallelism's "
             "all-gather), saving only their inputs and recomputing each tile in backward: "
             "the all-gathered input, the output projection's partial sums and their "
             "gradients become one tile's instead of [s/CP, micro-batch, hidden] each, for one "
             "extra projection forward per layer. 0 (the default): off. Under "
             "--sequence-parallel a multiple of --tensor-model-parallel-size.")

    def validate(self) -> None:
        """Raise MemoConfigError (one line: the flag and the fix) on a count below 1 or a
        negative tile."""
        if self.attention_head_chunks < 1:
            raise MemoConfigError(f"--memo-attention-head-chunks {self.attention_head_chunks} "
                                  "must be >= 1 (1: all heads at once)")
        if self.attention_projection_tile_size < 0:
            raise MemoConfigError(
                f"--memo-attention-projection-tile-size {self.attention_projection_tile_size} "
                "is negative; give a tile of TOKENS > 0, or 0 to turn tiling off")

    def validate_with(self, heads_per_rank: int, groups_per_rank: int) -> None:
        """Raise MemoConfigError unless the chunks split this rank's heads (head_chunks_split)."""
        if not head_chunks_split(heads_per_rank, groups_per_rank, self.attention_head_chunks):
            raise MemoConfigError(
                f"--memo-attention-head-chunks {self.attention_head_chunks} does not split the "
                f"{heads_per_rank} query heads in {groups_per_rank} query groups of a tensor-"
                "parallel rank (--num-attention-heads, --num-query-groups / --tensor-model-"
                "parallel-size); pick one of " + ", ".join(
                    str(n) for n in valid_head_chunks(heads_per_rank, groups_per_rank)))


@dataclass
class TiledMLPConfig:
    """Sequence-tiled MLP: each layer's MLP runs tile by tile and recomputes each tile in
    backward, so its working set is one tile's intermediate, not the sequence's
    (docs/tiled_mlp.md)."""

    mlp_tile_size: int = memo_field(
        0, flag="--memo-mlp-tile-size", metavar="TOKENS",
        help="Run every transformer layer's MLP over tiles of this many tokens of the "
             "sequence as the MLP's fc1 sees it (after sequence parallelism's all-gather: each "
             "TP rank contributes TOKENS/TP of its own), saving only the MLP input for "
             "backward and recomputing each tile there. The MLP's intermediate "
             "[TOKENS, micro-batch, ffn/TP] then replaces [s/CP, micro-batch, ffn/TP] at the "
             "peak, and fc1/activation outputs are no longer saved, for one extra MLP forward "
             "per layer. Use it when the sequence is long enough that the MLP intermediate "
             "matters (s/CP several times TOKENS); keep tiles large enough for efficient GEMMs, "
             "e.g. 4096-16384 on GPUs (a starting point, not tuned). "
             "0 (the default): off, Megatron's MLP as is. Under --sequence-parallel a multiple "
             "of --tensor-model-parallel-size.")
    tile_norms: bool = memo_field(
        False, flag="--memo-tile-norms",
        help="Normalise inside the tiles: each layer's pre-MLP norm runs on every MLP tile "
             "(--memo-mlp-tile-size) and its input norm on every QKV projection tile "
             "(--memo-attention-projection-tile-size), recomputed with the tile in backward, "
             "instead of once over the sequence. The norms' outputs, [s/CP/TP, micro-batch, "
             "hidden] each (a whole layer input), are then never saved nor materialised, and "
             "their gradients are one tile's. The norms' parameters and checkpoints are "
             "unchanged; the results are the same but for the order in which the norms' weight "
             "gradients sum over tiles (docs/tiled_mlp.md, \"Norms in the tiles\"). Off by "
             "default.")

    @property
    def enabled(self) -> bool:
        return self.mlp_tile_size > 0

    @staticmethod
    def tile_size_for(local_tokens: int, tiles: int, tensor_parallel_size: int) -> int:
        """The ``--memo-mlp-tile-size`` that cuts ``local_tokens`` (the sequence after CP)
        into ``tiles`` tiles, rounded up to a multiple of the TP size (what SP needs). The
        estimator traces a tile count, so that the traces at two lengths are alike."""
        if tiles < 1:
            raise MemoConfigError(f"MLP tiles {tiles} must be >= 1")
        tile = -(-local_tokens // tiles)
        return -(-tile // tensor_parallel_size) * tensor_parallel_size

    def tile_rows(self, tensor_parallel_size: int, sequence_parallel: bool,
                  flag: str = "--memo-mlp-tile-size") -> int:
        """One rank's rows per tile: the tile counts tokens as fc1 sees them (after SP's
        all-gather), so the intermediate [tile, b, ffn/TP] does not depend on the TP size.
        Raises MemoConfigError naming ``flag`` when tiling is off or SP cannot split the tile
        evenly."""
        tile = self.mlp_tile_size
        if tile < 1:
            raise MemoConfigError(f"{flag} {tile} must be >= 1 to tile")
        if not sequence_parallel:
            return tile
        if tile % tensor_parallel_size:
            raise MemoConfigError(
                f"{flag} {tile} is not a multiple of --tensor-model-parallel-size "
                f"{tensor_parallel_size}: under --sequence-parallel each TP rank contributes "
                f"tile/TP tokens; use a multiple of {tensor_parallel_size}")
        return tile // tensor_parallel_size

    def validate(self) -> None:
        """Raise MemoConfigError (one line: the flag and the fix) on a negative tile size."""
        if self.mlp_tile_size < 0:
            raise MemoConfigError(f"--memo-mlp-tile-size {self.mlp_tile_size} is negative; give "
                                  "a tile of TOKENS > 0, or 0 to turn tiling off")


#: Every MEMO config with its argparse group title, in the trainer's --help order
#: (megatron.training.arguments adds and validates them from this one list).
CONFIG_GROUPS = (
    (OffloadConfig, "MEMO activation offloading"),
    (PlanConfig, "MEMO memory planning"),
    (StitchingConfig, "GMLake stitching allocator"),
    (TelemetryConfig, "MEMO memory telemetry"),
    (SPPOConfig, "SPPO subsequence pipeline"),
    (METPConfig, "METP memory-efficient tensor parallelism"),
    (TiledMLPConfig, "Sequence-tiled MLP"),
    (AttentionConfig, "Core attention"),
)


def validated_configs(args: Any) -> dict[type, Any]:
    """Each config of :data:`CONFIG_GROUPS` built from ``args`` and checked on its own
    (``validate()`` where it has one), by class. Raises MemoConfigError (one line)."""
    configs = {}
    for config_cls, _title in CONFIG_GROUPS:
        config = configs[config_cls] = config_from_args(config_cls, args)
        if hasattr(config, "validate"):
            config.validate()
    return configs
