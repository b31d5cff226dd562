"""The memory estimator: traces at two lengths give the trace at any length exactly; the
estimate replays it through the allocator models; tools/estimate.py answers FITS/OOM and the
longest sequence. The 7B checks against the MEMO paper are marked slow (two 7B traces each)."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout

import pytest

from memo_ext.estimate import (
    EstimateError,
    LinearTrace,
    estimate_at,
    load_hardware,
    max_sequence_length,
    trace_rank,
)
from tests.conftest import REPO_ROOT

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--vocab-size", "512", "--tp", "2", "--cp", "2", "--bf16",
         "--cuda-context-mib", "1", "--nccl-mib-per-communicator", "1"]
MiB = 1 << 20


@pytest.fixture(scope="module")
def small_traces(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("estimate")
    return {seq: trace_rank(SMALL, seq, workdir) for seq in (1024, 2048, 8192)}


def test_two_traces_give_the_trace_at_any_length_exactly(small_traces):
    line = LinearTrace.from_traces(small_traces[1024], small_traces[2048])
    predicted = line.at(8192)
    actual = small_traces[8192]
    assert [e["bytes"] for e in predicted.events] == [e["bytes"] for e in actual.events]
    assert predicted.header["model"]["seq_length"] == 8192


def test_traces_of_different_structure_are_refused(small_traces):
    other = small_traces[2048]
    shorter = type(other)(other.header, other.events[:-1])
    with pytest.raises(EstimateError, match="differs between"):
        LinearTrace.from_traces(small_traces[1024], shorter)
    with pytest.raises(EstimateError, match="same sequence length"):
        LinearTrace.from_traces(small_traces[1024], small_traces[1024])


def test_estimate_fits_and_the_search_finds_the_boundary(small_traces):
    line = LinearTrace.from_traces(small_traces[1024], small_traces[2048])
    big = estimate_at(line.at(8192), 1 << 40)
    assert big.fits and big.peak_reserved_bytes >= big.peak_allocated_bytes > 0
    assert big.peak_by_category["activation"] > 0
    capacity = estimate_at(line.at(4096), 1 << 40).peak_device_bytes + MiB
    assert estimate_at(line.at(4096), capacity).fits
    assert not estimate_at(line.at(16384), capacity).fits
    longest = max_sequence_length(lambda s: estimate_at(line.at(s), capacity), 1024, 65536)
    assert 4096 <= longest < 16384
    assert estimate_at(line.at(longest), capacity).fits
    assert not estimate_at(line.at(longest + 1024), capacity).fits


def test_hardware_profiles():
    a800 = load_hardware("A800")
    assert a800["device_memory_bytes"] > 79 * (1 << 30) and a800["bf16_tflops"] == 312
    with pytest.raises(EstimateError, match="--gpu nope: unknown"):
        load_hardware("nope")


def test_hardware_file_adds_and_overrides_profiles(tmp_path):
    extra = tmp_path / "gpus.json"
    extra.write_text('{"mi300x": {"device_memory_bytes": 206158430208, "bf16_tflops": 1307}, '
                     '"a800": {"device_memory_bytes": 1, "bf16_tflops": 1}}')
    assert load_hardware("mi300x", extra)["bf16_tflops"] == 1307
    assert load_hardware("a800", extra)["device_memory_bytes"] == 1
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(EstimateError, match="--hardware-file"):
        load_hardware("a800", broken)


def _estimate(argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location("estimate_cli",
                                                  REPO_ROOT / "tools" / "estimate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with redirect_stdout(out):
        code = module.main(argv)
    return code, out.getvalue()


def test_cli_refuses_bad_input():
    assert _estimate(["--model", "7b", "--gpu", "a800", "--tp", "4", "--gpus", "6",
                      "--seq-length", "1024"])[0] == 2
    assert _estimate(["--model", "7b", "--gpu", "a800", "--policy", "memo", "--memo-alpha",
                      "2", "--seq-length", "1024"])[0] == 2


def _max_seq(out: str) -> int:
    match = re.search(r"^max sequence length: (\d+) tokens", out, re.M)
    assert match, out
    return int(match.group(1))


@pytest.mark.slow
def test_7b_megatron_full_recompute_longest_sequence_is_the_papers_640k():
    """MEMO paper, 7B on 8 A800-80GB: Megatron-LM trains 640K and fails at 768K."""
    code, out = _estimate(["--model", "7b", "--gpu", "a800", "--tp", "4", "--cp", "2",
                           "--max-seq-length"])
    assert code == 0
    assert abs(_max_seq(out) - 640 * 1024) <= 128 * 1024


@pytest.mark.slow
def test_7b_memo_longest_sequence_reaches_the_papers_1024k():
    code, out = _estimate(["--model", "7b", "--gpu", "a800", "--tp", "4", "--cp", "2",
                           "--policy", "memo", "--memo-alpha", "0", "--max-seq-length"])
    assert code == 0
    assert _max_seq(out) >= 1024 * 1024
    assert "host memory for offloaded activations" in out
