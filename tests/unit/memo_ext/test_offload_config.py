"""OffloadConfig: flags generated from the dataclass, parsing, and MemoConfigError messages."""

from __future__ import annotations

import argparse
import ast
import dataclasses

import pytest

from memo_ext.config import (
    MemoConfigError,
    OffloadConfig,
    add_config_arguments,
    arg_dest,
    arg_flag,
    config_from_args,
    memo_field,
)
from tests.conftest import REPO_ROOT


def _parse(argv: list[str]) -> OffloadConfig:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_arguments(parser, OffloadConfig, "MEMO offload")
    return config_from_args(OffloadConfig, parser.parse_args(argv))


def test_one_flag_per_field_with_help():
    parser = argparse.ArgumentParser()
    group = add_config_arguments(parser, OffloadConfig, "MEMO offload")
    assert group.title == "MEMO offload"
    by_flag = {a.option_strings[0]: a for a in group._group_actions}
    assert set(by_flag) == {"--memo-offload", "--memo-alpha", "--memo-host-memory-gb",
                            "--memo-device-memory-gb", "--memo-pcie-gbps",
                            "--memo-checkpoint-layers", "--memo-offload-fp8",
                            "--memo-offload-buffers"}
    for field in dataclasses.fields(OffloadConfig):
        action = by_flag[field.metadata["flag"]]
        assert action.dest == "memo_" + field.name
        assert action.help.replace("%%", "%") == field.metadata["help"]
        assert len(action.help) > 20
        assert action.default == field.default
    assert isinstance(by_flag["--memo-offload"], argparse._StoreTrueAction)
    assert by_flag["--memo-host-memory-gb"].type is float
    assert by_flag["--memo-pcie-gbps"].type is float
    assert by_flag["--memo-alpha"].type is str
    assert by_flag["--memo-offload-buffers"].type is int
    assert by_flag["--memo-offload-buffers"].choices == (1, 2)
    help_text = parser.format_help()
    assert "--memo-host-memory-gb" in help_text and "GB/s" in help_text


def test_naming_rule():
    assert arg_dest("host_memory_gb") == "memo_host_memory_gb"
    assert arg_flag("host_memory_gb") == "--memo-host-memory-gb"


def test_defaults_round_trip():
    config = _parse([])
    assert config == OffloadConfig()
    config.validate()
    assert config.fixed_alpha is None and config.host_memory_bytes is None
    assert config.pcie_bytes_per_s is None


def test_parse_all_flags():
    config = _parse(["--memo-offload", "--memo-alpha", "0.25", "--memo-host-memory-gb", "64",
                     "--memo-pcie-gbps", "12.5"])
    config.validate()
    assert config.offload is True
    assert config.fixed_alpha == 0.25
    assert config.host_memory_bytes == 64 * 10**9
    assert config.pcie_bytes_per_s == pytest.approx(12.5e9)
    assert _parse(["--memo-offload", "--memo-alpha", "auto"]).fixed_alpha is None


def test_missing_namespace_attributes_take_defaults():
    config = config_from_args(OffloadConfig, argparse.Namespace(memo_offload=True))
    assert config == OffloadConfig(offload=True)


def test_host_memory_flag_rejects_non_numbers_at_parse_time():
    with pytest.raises(argparse.ArgumentError, match="--memo-host-memory-gb"):
        _parse(["--memo-offload", "--memo-host-memory-gb", "lots"])


@pytest.mark.parametrize(
    "argv, flag, fragment",
    [
        (["--memo-offload", "--memo-alpha", "abc"], "--memo-alpha",
         "--memo-alpha 'abc' is not a number; use auto or a value in [0, 1]"),
        (["--memo-offload", "--memo-alpha", "1.5"], "--memo-alpha", "outside [0, 1]"),
        (["--memo-offload", "--memo-alpha", "-0.1"], "--memo-alpha", "outside [0, 1]"),
        (["--memo-offload", "--memo-alpha", "nan"], "--memo-alpha", "outside [0, 1]"),
        (["--memo-offload", "--memo-host-memory-gb", "0"], "--memo-host-memory-gb", "positive"),
        (["--memo-offload", "--memo-host-memory-gb", "-3"], "--memo-host-memory-gb", "positive"),
        (["--memo-offload", "--memo-pcie-gbps", "0"], "--memo-pcie-gbps", "positive"),
        (["--memo-offload", "--memo-pcie-gbps", "-1"], "--memo-pcie-gbps", "positive"),
        (["--memo-alpha", "0.5"], "--memo-alpha", "has no effect without --memo-offload"),
        (["--memo-host-memory-gb", "10"], "--memo-host-memory-gb",
         "has no effect without --memo-offload; add --memo-offload or drop it"),
        (["--memo-pcie-gbps", "10"], "--memo-pcie-gbps", "has no effect without --memo-offload"),
        (["--memo-offload", "--memo-checkpoint-layers", "-1"], "--memo-checkpoint-layers",
         "use auto or a whole number of layers >= 0"),
        (["--memo-offload", "--memo-checkpoint-layers", "half"], "--memo-checkpoint-layers",
         "is not a count"),
        (["--memo-checkpoint-layers", "4"], "--memo-checkpoint-layers",
         "has no effect without --memo-offload"),
        (["--memo-offload-fp8"], "--memo-offload-fp8", "has no effect without --memo-offload"),
        (["--memo-offload-buffers", "1"], "--memo-offload-buffers",
         "has no effect without --memo-offload"),
    ],
)
def test_validate_errors_name_the_flag(argv, flag, fragment):
    config = _parse(argv)
    with pytest.raises(MemoConfigError) as info:
        config.validate()
    message = str(info.value)
    assert message.startswith(flag), message
    assert fragment in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_explicit_auto_without_offload_is_fine():
    _parse(["--memo-alpha", "auto"]).validate()


def test_bad_field_declarations_fail_at_generation():
    @dataclasses.dataclass
    class WrongFlag:
        size: int = memo_field(1, flag="--memo-sz", help="bytes")

    @dataclasses.dataclass
    class NoMetadata:
        size: int = 1

    @dataclasses.dataclass
    class TrueBool:
        on: bool = memo_field(True, flag="--memo-on", help="x")

    for cls in (WrongFlag, NoMetadata, TrueBool):
        with pytest.raises(TypeError):
            add_config_arguments(argparse.ArgumentParser(), cls, "x")


def test_memo_ext_modules_do_not_import_megatron_training():
    """Static check (no subprocess): these memo_ext modules never import megatron.training."""
    for relative in ("memo_ext/config.py", "memo_ext/offload/alpha.py",
                     "memo_ext/telemetry/__init__.py", "memo_ext/telemetry/tracker.py"):
        tree = ast.parse((REPO_ROOT / relative).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.startswith("megatron.training") for n in names), (relative, names)
