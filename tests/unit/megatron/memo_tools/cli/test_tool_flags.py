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


# ---------------------------------------------- one spelling per flag: the trainer's (issue 46)

#: Flags of the tools' "layout" groups that pretrain_gpt.py has no flag for: the job's GPU
#: count, the traced rank and its 1F1B depth, the tracer's way of turning SP off.
TOOL_ONLY_LAYOUT_FLAGS = {"--gpus", "--rank", "--microbatches-in-flight", "--no-sequence-parallel"}
#: The trainer's flags the tracer takes beyond its layout group, with the trainer's meaning.
TRACE_TRAINER_FLAGS = ("--use-distributed-optimizer", "--untie-embeddings-and-output-weights")
#: The tools' spellings before they took the trainer's.
OLD_SPELLINGS = {trace: ("--tp", "--cp", "--pp", "--dp", "--tie-embeddings",
                         "--no-distributed-optimizer"),
                 estimate: ("--tp", "--cp", "--pp")}
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128"]


def _layout_flags(parser) -> dict:
    (group,) = [g for g in parser._action_groups if g.title == "layout"]
    return {action.option_strings[-1]: action for action in group._group_actions}


@pytest.mark.parametrize("tool", [trace, estimate], ids=["trace", "estimate"])
def test_layout_flags_are_the_trainers(tool):
    trainer, ours = _by_flag(build_parser()), _layout_flags(tool.build_parser())
    assert {"--tensor-model-parallel-size", "--context-parallel-size",
            "--pipeline-model-parallel-size", "--gpus"} <= set(ours)
    assert set(ours) - TOOL_ONLY_LAYOUT_FLAGS <= set(trainer)
    assert not TOOL_ONLY_LAYOUT_FLAGS & set(trainer)
    for flag in set(ours) - TOOL_ONLY_LAYOUT_FLAGS:
        assert ours[flag].dest == trainer[flag].dest, flag
    if tool is trace:
        tools = _by_flag(tool.build_parser())
        for flag in TRACE_TRAINER_FLAGS:
            assert (tools[flag].dest, tools[flag].const) == (trainer[flag].dest,
                                                             trainer[flag].const), flag


@pytest.mark.parametrize("tool", [trace, estimate], ids=["trace", "estimate"])
def test_old_spellings_are_refused(tool, capsys):
    for flag in OLD_SPELLINGS[tool]:
        with pytest.raises(SystemExit):
            tool.build_parser().parse_args(["--model", "7b", "--gpu", "a800", "--seq-length",
                                            "1024", flag, "2"])
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err, flag


def test_gpus_is_the_world_size_in_both_tools(capsys):
    helps = {tool: _layout_flags(tool.build_parser())["--gpus"].help for tool in (trace, estimate)}
    assert helps[trace] == helps[estimate]
    layout = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
    assert trace.request_from_argv(SHAPE + layout).dp == 1
    assert trace.request_from_argv(SHAPE + layout + ["--gpus", "8"]).dp == 2
    with pytest.raises(SystemExit):
        trace.request_from_argv(SHAPE + layout + ["--gpus", "6"])
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "--gpus 6 is not a multiple of TP x CP x PP = 4; give a multiple of 4" in line


def test_tying_and_the_optimizer_default_as_the_trainer():
    explicit = trace.request_from_argv(SHAPE)
    assert explicit.model.tie_embeddings and not explicit.distributed_optimizer
    untied = trace.request_from_argv(SHAPE + ["--untie-embeddings-and-output-weights",
                                              "--use-distributed-optimizer"])
    assert not untied.model.tie_embeddings and untied.distributed_optimizer
    # examples/configs untie: a preset does, flag or not.
    preset = trace.request_from_argv(["--model", "7b", "--seq-length", "128"])
    assert not preset.model.tie_embeddings


@pytest.mark.parametrize("tool", [trace, estimate], ids=["trace", "estimate"])
def test_grad_reduce_in_bf16_is_the_trainers_flag(tool):
    """Both tools take the trainer's --grad-reduce-in-bf16 from its one definition (the tracer's
    own --param-dtype-grad-buffer is gone)."""
    trainer, ours = _by_flag(build_parser()), _by_flag(tool.build_parser())
    mine, theirs = ours["--grad-reduce-in-bf16"], trainer["--grad-reduce-in-bf16"]
    assert (mine.dest, mine.help, mine.const) == (theirs.dest, theirs.help, theirs.const)
    assert "--param-dtype-grad-buffer" not in ours
