"""tools/trace.py and tools/estimate.py take the trainer's flags from the trainer's definitions
(memo_ext.flags, megatron.training.arguments.MODEL_SHAPE_FLAGS): same spelling, dest, type,
choices and help, the differences named by a ToolVariant. CPU only, parsers only (fast)."""

from __future__ import annotations

import pytest

from megatron.training.arguments import MODEL_SHAPE_FLAGS, build_parser
from megatron.memo_tools.cli import estimate, quiet, trace
from memo_ext.config import MemoConfigError


def _by_flag(parser) -> dict:
    return {action.option_strings[-1]: action for action in parser._actions
            if action.option_strings}


@pytest.mark.parametrize("tool", [trace, estimate], ids=["trace", "estimate"])
def test_tools_share_the_trainers_flag_definitions(tool):
    trainer, ours = _by_flag(build_parser()), _by_flag(tool.build_parser())
    shared = [flag for flag in ours if flag in trainer and (
        flag.startswith("--memo-") or flag in MODEL_SHAPE_FLAGS)]
    assert "--memo-alpha" in shared and "--memo-offload-buffers" in shared
    for flag in shared:
        mine, theirs = ours[flag], trainer[flag]
        assert mine.dest == theirs.dest, flag
        assert (mine.help or "").startswith(theirs.help or ""), flag  # a variant appends a note
        assert mine.choices == theirs.choices, flag
        variant = trace.TRACED_OFFLOAD_VARIANTS.get(theirs.dest.removeprefix("memo_"))
        if variant is None or variant.type is None:
            assert mine.type is theirs.type, flag


def test_a_refused_value_is_one_line_naming_the_flag():
    opts = trace.build_parser().parse_args(["--model", "7b", "--seq-length", "1024",
                                            "--memo-offload", "--memo-alpha", "auto"])
    with pytest.raises(MemoConfigError, match=r"^--memo-alpha auto solves the LP"):
        trace.traced_offload_config(opts)
    opts.memo_alpha = "2"
    with pytest.raises(MemoConfigError, match=r"outside \[0, 1\]; use a value in \[0, 1\]$"):
        trace.traced_offload_config(opts)
    opts.memo_alpha = None
    assert trace.traced_offload_config(opts).fixed_alpha == 0.0


def test_verbose_says_what_is_hidden(capsys):
    quiet.explain_hidden(False)
    assert capsys.readouterr().err == ""
    quiet.explain_hidden(True)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Transformer Engine" in err and "HiGHS" in err
