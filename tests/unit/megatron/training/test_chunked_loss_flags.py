"""--cross-entropy-loss-fusion / --cross-entropy-fusion-impl / --cross-entropy-chunk-size:
Megatron-LM's spellings plus 'chunked', validated before anything is built, one line naming the
flag and the fix (exit status 2 from pretrain_gpt.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron.training.arguments import (
    ArgumentValidationError,
    core_transformer_config_from_args,
    parse_args,
)
from tests.conftest import REPO_ROOT, subprocess_env
from tests.unit.megatron.training.test_bad_arguments import BASE

FUSION = ["--cross-entropy-loss-fusion"]

BAD = [
    ("te_on_cpu", FUSION + ["--cross-entropy-fusion-impl", "te"],
     "--cross-entropy-fusion-impl te needs Transformer Engine on CUDA"),
    ("impl_without_fusion", ["--cross-entropy-fusion-impl", "chunked"],
     "add --cross-entropy-loss-fusion"),
    ("chunk_size_without_chunked", FUSION + ["--cross-entropy-chunk-size", "4096"],
     "--cross-entropy-chunk-size applies to"),
    ("chunk_size_not_positive",
     FUSION + ["--cross-entropy-fusion-impl", "chunked", "--cross-entropy-chunk-size", "0"],
     "--cross-entropy-chunk-size must be positive"),
]


@pytest.mark.parametrize("case,flags,message", BAD, ids=[c[0] for c in BAD])
def test_bad_combinations_name_the_flag(case, flags, message):
    with pytest.raises(ArgumentValidationError, match=message) as error:
        parse_args(BASE + flags, world_size=1, cuda_available=False)
    assert "\n" not in str(error.value)


TE_ON_CPU_LINE = ("error: --cross-entropy-fusion-impl te needs Transformer Engine on CUDA; "
                  "use native or chunked")


def test_te_refused_on_cpu_by_the_trainers_entry_point(monkeypatch, capsys):
    """pretrain_gpt.main under run_main in this process, as ``python pretrain_gpt.py`` runs it."""
    import pretrain_gpt
    from megatron.training.arguments import run_main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exited:
        run_main(pretrain_gpt.main, [*BASE, *FUSION, "--cross-entropy-fusion-impl", "te"])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [TE_ON_CPU_LINE] and out == ""


# ~15 s (a fresh process importing torch); the default suite keeps the in-process entry point
# above, and test_bad_arguments.py's fresh-process cases for this exit path.
@pytest.mark.slow
def test_te_refused_on_cpu_with_one_line_and_status_2():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *BASE, *FUSION,
         "--cross-entropy-fusion-impl", "te"],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [TE_ON_CPU_LINE]


def test_defaults_and_config():
    args = parse_args(BASE, world_size=1, cuda_available=False)
    config = core_transformer_config_from_args(args)
    assert (config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl) == (False, "native")
    assert args.cross_entropy_chunk_size is None  # memo_ext.loss.default_chunk_size decides
    args = parse_args(BASE + FUSION + ["--cross-entropy-fusion-impl", "chunked",
                                       "--cross-entropy-chunk-size", "4096"],
                      world_size=1, cuda_available=False)
    config = core_transformer_config_from_args(args)
    assert (config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl) == (True, "chunked")
    assert args.cross_entropy_chunk_size == 4096
