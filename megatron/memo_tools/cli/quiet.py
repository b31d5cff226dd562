"""What the command-line tools hide of their libraries' start-up noise, in one place; each tool's
``--verbose`` prints :data:`HIDDEN` (one line) so that nothing is hidden without a trace.

- megatron-core warns four times at import that "Transformer Engine and Apex are not installed"
  (optimizer, clip_grads, FSDP mixed precision): the tools trace and plan on the CPU with torch's
  kernels, where that is the expected state. Only these messages are filtered, by text, with the
  trainer's filter (megatron.training.library_warnings, which run_main applies on CPU too).
- HiGHS (highspy, the arena planner's MIP solver through pulp) prints a copyright banner to file
  descriptor 1 from C when the first ``highspy.Highs()`` of a process is created, before pulp can
  turn its output off (memo_ext.planner.dsa already solves with ``msg=False``). It is printed
  once per process, so :func:`hide_highs_banner` creates that first instance with descriptor 1
  pointed at /dev/null.

Light on purpose (stdlib only): the tool modules call :func:`hide_library_warnings` before their
first import of megatron.core.
"""

from __future__ import annotations

import os
import sys

from megatron.training.library_warnings import hide_library_warnings

__all__ = ["HIDDEN", "add_verbose_argument", "explain_hidden", "hide_highs_banner",
           "hide_library_warnings"]

HIDDEN = ("note: hiding megatron-core's 'Transformer Engine and Apex are not installed' import "
          "warnings (these tools run torch's kernels on the CPU, where neither is needed) and "
          "HiGHS's start-up banner (the arena planner's MIP solver, run with its output off)")


def hide_highs_banner() -> None:
    """Create this process's first ``highspy.Highs()`` with file descriptor 1 on /dev/null, so
    that the banner HiGHS prints then goes nowhere (it prints it once per process). No-op
    without highspy."""
    try:
        import highspy
    except ImportError:
        return
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def add_verbose_argument(parser) -> None:
    """``--verbose``: say (one line on stderr) what the tool hides of its libraries' output."""
    parser.add_argument("--verbose", action="store_true",
                        help="say what this tool hides of its libraries' start-up output "
                             "(megatron-core's Transformer Engine/Apex warnings, HiGHS's "
                             "banner) and why")


def explain_hidden(verbose: bool) -> None:
    """With ``--verbose``, print :data:`HIDDEN` on stderr."""
    if verbose:
        print(HIDDEN, file=sys.stderr, flush=True)
