"""Predict a training job's device memory per rank before launching it, on any machine.

    python tools/estimate.py --model 7b --gpu a800 --tp 4 --cp 2 --seq-length 524288
    python tools/estimate.py --model 7b --gpu a800 --tp 4 --cp 2 --max-seq-length
    python tools/estimate.py --model 7b --gpu a800 --tp 4 --cp 2 --policy memo --memo-alpha 0 \\
        --max-seq-length

Rank 0 of the layout is traced on fake tensors at two sequence lengths (tools/trace.py, about
15-25 s each for 7B); every request size is linear in the sequence length, so the trace at any
length follows, and is replayed (persistent state once, then three iterations) through the
allocator model on the GPU's memory. Prints the predicted peak (reserved by the allocator plus
the memory outside it: CUDA context, NCCL), the live bytes by category at the peak, and FITS or
OOM; ``--max-seq-length`` searches the longest sequence that fits in steps of 128K (16K below
128K) and ends with ``max sequence length: <tokens> tokens, ...``.

Policies: ``megatron`` is Megatron-LM with full recompute (uniform, 1 layer), ``megatron-none``
without recompute, ``memo`` MEMO's offload at ``--memo-alpha``. Everything printed is predicted
(allocator models, no GPU involved). The time side (step time, MFU) is not built yet.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GiB = 1 << 30
POLICIES = {
    "megatron": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"],
    "megatron-none": [],
    "memo": None,  # --memo-offload --memo-alpha A
}
#: The two lengths the line is fitted through (multiples of every TP x CP x 2 used in practice).
FIT_SEQS = (131072, 262144)
SEARCH_STEP, FINE_STEP = 131072, 16384


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=("7b", "13b", "30b", "65b"))
    parser.add_argument("--gpu", required=True, help="a profile of memo_ext/estimate/hardware.json")
    parser.add_argument("--hardware-file", type=Path, default=None,
                        help="extra GPU profiles (JSON, the keys of hardware.json)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs of the job (default TP x CP x PP); DP = GPUs / (TP x CP x PP)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--policy", choices=sorted(POLICIES), default="megatron")
    parser.add_argument("--memo-alpha", default="0", metavar="ALPHA",
                        help="with --policy memo: the offloaded fraction (a number in [0, 1])")
    parser.add_argument("--allocator", choices=("caching", "expandable", "arena"), default=None,
                        help="allocator model: caching (PyTorch's default), expandable "
                             "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or arena "
                             "(MEMO's planned arena, planned from each trace). Default: arena "
                             "with --policy memo, caching otherwise")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--seq-length", type=int, help="tokens per sequence")
    target.add_argument("--max-seq-length", action="store_true",
                        help="search the longest sequence that fits")
    parser.add_argument("--search-max", type=int, default=8 * 1048576,
                        help="longest sequence the search tries (default 8M)")
    return parser


def _fail(message: str) -> int:
    print(f"estimate.py: error: {message}", file=sys.stderr)
    return 2


def trace_argv(opts: argparse.Namespace, dp: int) -> list[str]:
    argv = ["--model", opts.model, "--tp", str(opts.tp), "--cp", str(opts.cp), "--pp",
            str(opts.pp), "--dp", str(dp), "--bf16"]
    if opts.policy == "memo":
        return argv + ["--memo-offload", "--memo-alpha", opts.memo_alpha]
    return argv + POLICIES[opts.policy]


def describe(estimate, device_bytes: int) -> list[str]:
    verdict = "FITS" if estimate.fits else (
        f"OOM (a {estimate.oom_request_bytes / GiB:.2f} GiB request fails)"
        if estimate.oom_request_bytes else "OOM")
    lines = [f"seq {estimate.seq}: peak {estimate.peak_reserved_bytes / GiB:.2f} GiB reserved + "
             f"{estimate.external_bytes / GiB:.2f} GiB outside the allocator = "
             f"{estimate.peak_device_bytes / GiB:.2f} of {device_bytes / GiB:.2f} GiB per rank: "
             f"{verdict}",
             "  live at the peak: " + ", ".join(
                 f"{name} {nbytes / GiB:.2f} GiB"
                 for name, nbytes in sorted(estimate.peak_by_category.items(),
                                            key=lambda kv: -kv[1]) if nbytes),
             f"  fragmentation {estimate.fragmentation:.1%}, reorganisations in 3 iterations "
             f"{estimate.reorganisations}"]
    if estimate.host_bytes:
        lines.append(f"  host memory for offloaded activations: {estimate.host_bytes / GiB:.2f} "
                     "GiB per rank")
    return lines


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    if opts.allocator is None:
        opts.allocator = "arena" if opts.policy == "memo" else "caching"
    from memo_ext.estimate import (
        EstimateError,
        estimate_at,
        linear_trace,
        load_hardware,
        max_sequence_length,
    )

    model_parallel = opts.tp * opts.cp * opts.pp
    gpus = opts.gpus or model_parallel
    if gpus % model_parallel:
        return _fail(f"--gpus {gpus} is not a multiple of TP x CP x PP = {model_parallel}")
    if opts.policy == "memo":
        try:
            alpha = float(opts.memo_alpha)
        except ValueError:
            alpha = -1.0
        if not 0.0 <= alpha <= 1.0:
            return _fail(f"--memo-alpha {opts.memo_alpha}: give a number in [0, 1]")
    started = time.perf_counter()
    try:
        hardware = load_hardware(opts.gpu, opts.hardware_file)
        device = int(hardware["device_memory_bytes"])
        line = linear_trace(trace_argv(opts, gpus // model_parallel), FIT_SEQS)
        print(f"estimate: {opts.model} on {opts.gpu} ({device / GiB:.2f} GiB per GPU), "
              f"{gpus} GPUs: TP={opts.tp} CP={opts.cp} PP={opts.pp} DP={gpus // model_parallel}, "
              f"policy {opts.policy}, {opts.allocator} allocator model, rank 0 (predicted; "
              f"traces at {FIT_SEQS[0]} and {FIT_SEQS[1]} tokens)")

        def estimate(seq: int):
            return estimate_at(line.at(seq), device, opts.allocator)

        if opts.seq_length is not None:
            for text in describe(estimate(opts.seq_length), device):
                print(text)
            return 0
        longest = max_sequence_length(estimate, SEARCH_STEP, opts.search_max, FINE_STEP)
        if longest:
            for text in describe(estimate(longest), device):
                print(text)
        print(f"estimated in {time.perf_counter() - started:.1f} s")
        print(f"max sequence length: {longest} tokens, predicted MFU n/a (the cost model is "
              "not built yet)")
        return 0
    except EstimateError as exc:
        return _fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
