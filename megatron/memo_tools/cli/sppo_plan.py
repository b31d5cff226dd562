"""SPPO layout planner: the (TP/SP, PP, DP, N subsequences) with the shortest predicted step
time that fits device memory per GPU and host memory per node (memo_ext/sppo/solver.py has the
model). Every number printed is predicted by an analytic model, not measured.

Example: tools/sppo_plan.py --model 7b --gpus 128 --gpu a100-80gb --seq-length 4M --top 5
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from megatron.memo_tools.cli.quiet import (
    add_verbose_argument,
    explain_hidden,
    hide_library_warnings,
)

# memo_ext.sppo's package imports megatron, which warns about Transformer Engine/Apex: noise for
# a planner that runs no kernels.
hide_library_warnings()

from memo_ext.estimate.models import MODELS, ModelError, model_shape  # noqa: E402
from memo_ext.hardware import HardwareProfileError, load_hardware  # noqa: E402
from memo_ext.sppo.solver import (  # noqa: E402
    GB,
    PREDICTED,
    GiB,
    Problem,
    SolverError,
    not_fit_message,
    report_lines,
    solve,
)

#: Binary suffixes of --seq-length (4M = 4 x 2^20 tokens, as the paper's "4M").
SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20}


class UsageError(ValueError):
    """Bad command-line input (one line)."""


def parse_tokens(text: str) -> int:
    """``4M`` -> 4194304, ``896K`` -> 917504, ``131072`` -> 131072."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not match:
        raise UsageError(f"--seq-length {text}: give tokens as a whole number, optionally with "
                         "K or M (896K, 4M)")
    return int(match.group(1)) * SUFFIXES[match.group(2).upper()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help=f"{', '.join(MODELS)} or a JSON file (the form tools/estimate.py "
                             "takes)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    parser.add_argument("--gpu", required=True,
                        help="a profile of memo_ext/hardware.json (a100-80gb, a800, ...)")
    parser.add_argument("--hardware-file", type=Path, default=None,
                        help="extra GPU profiles (JSON, the keys of hardware.json)")
    parser.add_argument("--seq-length", required=True, help="tokens per sequence (896K, 4M, ...)")
    parser.add_argument("--host-memory-gb", type=float, default=None,
                        help="host memory per node for the offload, GB (default: the profile's)")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="shard the fp32 optimizer states over DP (default: not sharded)")
    parser.add_argument("--msp", action="store_true",
                        help="plan with multiplexed sequence partitioning (--memo-sppo-msp)")
    parser.add_argument("--top", type=int, default=0, help="also print the best K candidates")
    add_verbose_argument(parser)
    return parser


def table(candidates, top: int) -> list[str]:
    lines = [f"best {min(top, len(candidates))} of the fitting candidates ({PREDICTED}):",
             f"  {'layout':<22} {'first/last tok':>15} {'GiB/GPU':>8} {'host GB':>8} "
             f"{'step s':>8} {'MFU %':>6}"]
    for c in candidates[:top]:
        lines.append(f"  {c.describe():<22} {f'{c.lengths[0]}/{c.lengths[-1]}':>15} "
                     f"{c.memory.total / GiB:8.1f} {c.host_bytes_per_node / GB:8.0f} "
                     f"{c.step_s:8.2f} {100 * c.mfu:6.1f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    explain_hidden(opts.verbose)
    try:
        if opts.top < 0:
            raise UsageError(f"--top {opts.top}: give a count >= 0")
        problem = Problem(model=model_shape(opts.model), gpus=opts.gpus,
                          hardware=load_hardware(opts.gpu, opts.hardware_file),
                          seq=parse_tokens(opts.seq_length),
                          host_memory_bytes_per_node=(None if opts.host_memory_gb is None
                                                      else opts.host_memory_gb * GB),
                          distributed_optimizer=opts.distributed_optimizer, msp=opts.msp)
        fitting, smallest = solve(problem)
    except (UsageError, ModelError, HardwareProfileError, SolverError) as exc:
        print(f"sppo_plan.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"{opts.model} at {problem.seq} tokens on {problem.gpus} x {opts.gpu}")
    if not fitting:
        print(not_fit_message(smallest[0], problem))
        return 1
    print("\n".join(report_lines(fitting[0], problem)))
    if opts.top:
        print("\n".join(table(fitting, opts.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
