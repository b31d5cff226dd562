"""Plan MEMO's memory arena for one training iteration from an allocation trace.

    python tools/memo_plan.py --trace trace.jsonl.gz -o plan.json [--time-limit 10] [--no-mip]
    python tools/memo_plan.py --trace trace.jsonl.gz --check plan.json

The trace comes from tools/trace.py (phase- and layer-tagged). Prints one line per level-1
problem (each kind of layer forward/backward), one for level 2 (the iteration with each layer
phase as a pseudo block), one for the single-level placement, and last the plan that was kept:

    plan peak <bytes> lower bound <bytes> gap <pct>%

where the lower bound is the most bytes the planned requests ever have alive at once (no
placement can do better). ``--check`` validates an existing plan against the trace instead. Exit
status 2 with a one-line error for an unreadable trace or plan, or a plan of another trace.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatron.memo_tools.cli.quiet import (
    add_verbose_argument,
    explain_hidden,
    hide_highs_banner,
    hide_library_warnings,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, type=Path,
                        help="allocation trace of one iteration (tools/trace.py -o)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="plan file to write")
    parser.add_argument("--check", type=Path, default=None, metavar="PLAN",
                        help="validate PLAN against the trace instead of planning")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="seconds per MIP (default 10)")
    parser.add_argument("--no-mip", action="store_true",
                        help="greedy placement only (no MIP even where it is above the bound)")
    add_verbose_argument(parser)
    return parser


def _fail(message: str) -> int:
    print(f"memo_plan.py: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    explain_hidden(opts.verbose)
    hide_library_warnings()
    hide_highs_banner()
    if opts.check is None and opts.output is None:
        return _fail("give -o PLAN.json to write a plan, or --check PLAN.json to validate one")
    if opts.time_limit is not None and not opts.time_limit > 0:
        return _fail(f"--time-limit {opts.time_limit} must be > 0 seconds")
    from memo_ext.planner.dsa import DEFAULT_TIME_LIMIT_S
    from memo_ext.planner.plan import PlanFileError, plan_for_trace, plan_trace, write_plan
    from memo_ext.trace import read_trace

    started = time.perf_counter()
    try:
        trace = read_trace(opts.trace)
    except FileNotFoundError:
        return _fail(f"--trace {opts.trace}: no such file")
    except (OSError, EOFError, ValueError) as exc:
        return _fail(f"--trace {opts.trace}: {str(exc).splitlines()[0]}")
    if opts.check is not None:
        try:
            plan = plan_for_trace(opts.check, trace)
        except PlanFileError as exc:
            return _fail(str(exc))
        print(f"{opts.check}: valid for {opts.trace} ({len(plan.offsets)} planned requests in "
              f"an arena of {plan.arena_bytes} bytes, {plan.chosen})")
        return 0
    plan = plan_trace(trace, opts.time_limit or DEFAULT_TIME_LIMIT_S, use_mip=not opts.no_mip)
    write_plan(plan, opts.output)
    for level in plan.level1:
        print(f"{level['name']}: plan peak {level['peak']} lower bound {level['lower_bound']} "
              f"gap {100 * level['gap']:.2f}% [{level['method']}, {level['requests']} requests]")
    for level in (plan.level2, plan.single_level):
        print(f"{level.name}: {level.line()} [{level.method}, {level.requests} requests]")
    print(f"kept: {plan.chosen} ({plan.arena_bytes} bytes; bi-level {plan.bi_level_arena_bytes}),"
          f" {len(plan.offsets)} planned requests, validated, -> {opts.output} in "
          f"{time.perf_counter() - started:.1f} s")
    print(f"plan peak {plan.arena_bytes} lower bound {plan.iteration_lower_bound} "
          f"gap {100 * plan.iteration_gap:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
