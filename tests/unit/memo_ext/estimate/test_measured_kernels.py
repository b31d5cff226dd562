"""Measured kernel rows win: the estimator prices a GPU with the rows bench/gpu_evidence.py
measured on it (imported into memo_ext/estimate/measured_kernels.json) when there are some,
the published rows of kernel_tables.json otherwise, and says which."""

from __future__ import annotations

import json
import statistics

import pytest

import megatron.memo_tools.cli.estimate  # noqa: F401  (the CLI test's import, at collection)
from memo_ext.estimate import kernels
from memo_ext.estimate.cost import Efficiency
from memo_ext.estimate.kernels import (
    at_model_shapes,
    gemm_tflops,
    kernel_rows,
    kernel_rows_line,
    priced_rows,
)
from memo_ext.estimate.measured_kernels import (
    MEASURED_FILE,
    MeasuredRowsError,
    entry_from_evidence,
    import_evidence,
    read_table,
)
from memo_ext.hardware import load_hardware
from memo_ext.trace.work import (
    ATTENTION_BACKWARD_FLOPS_PER_PAIR_DIM,
    ATTENTION_FORWARD_FLOPS_PER_PAIR_DIM,
)
from tests.conftest import REPO_ROOT, load_script, run_estimate_cli

H200_EVIDENCE = REPO_ROOT / "bench" / "results" / "gpu_evidence_h200.json"
H200_LINE = ("kernel rows: measured on NVIDIA H200 (bench/results/gpu_evidence_h200.json, "
             "commit 93b2990, 2026-11-27); attention kernel cudnn")
LLAMA3_8B = {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
             "num_attention_heads": 32, "num_query_groups": 8, "vocab_size": 128256,
             "swiglu": True, "seq_length": 1 << 20}


@pytest.fixture(scope="module")
def evidence():
    return load_script(REPO_ROOT / "bench" / "gpu_evidence.py", "gpu_evidence")


def _efficiency(gpu: str, layout=(4, 2)) -> Efficiency:
    hardware = load_hardware(gpu)
    return at_model_shapes(Efficiency.from_profile(hardware), hardware, LLAMA3_8B,
                           {"tp": layout[0], "cp": layout[1], "pp": 1})


def _toy_evidence(gpu: str = "NVIDIA H200", tile_kernel: str = "cuda_cudnn") -> list[dict]:
    """A small evidence file: the tile ops dispatching ``tile_kernel``, SDPA's FA2 and cuDNN,
    one GEMM; the tile ops' rows must win over SDPA's row of the same kernel."""
    env = {"section": "env", "gpu": gpu, "commit": "abc1234", "date": "2026-12-01T00:00:00+00:00",
           "torch": "2.11.0", "cudnn": 91900}
    common = {"section": "attention", "causal": True, "seq": 8192, "heads": 32, "groups": 8,
              "head_dim": 128, "dtype": "bf16", "status": "measured"}
    return [env,
            {**common, "backend": "memo tile ops (as dispatched)", "kernel": tile_kernel,
             "forward_tflops": 400.0, "backward_tflops": 300.0},
            {**common, "backend": "sdpa cudnn", "forward_tflops": 500.0, "backward_tflops": 450.0},
            {**common, "backend": "sdpa flash (FA2)", "forward_tflops": 290.0,
             "backward_tflops": 270.0},
            {**common, "backend": "sdpa efficient", "forward_tflops": 150.0,
             "backward_tflops": 120.0},
            {**common, "backend": "sdpa cudnn", "seq": 16384, "status": "not measured"},
            {"section": "gemm", "m": 16384, "n": 4096, "k": 4096, "status": "measured",
             "tflops": 661.06, "model": "8b", "tp": 1, "layer": "proj", "direction": "forward"}]


def test_tools_estimate_prints_which_rows_priced_the_job():
    """SPPO's analytic path (no tracing) prints the line the traced paths print too
    (tests/unit/memo_ext/estimate/test_symbolic.py checks a traced layout's, published, and --json's)."""
    code, out = run_estimate_cli(["--model", "7b", "--gpu", "h200", "--gpus", "8",
                                  "--tensor-model-parallel-size", "8",
                                  "--pipeline-model-parallel-size", "1", "--policy", "sppo",
                                  "--seq-length", "65536"])
    assert code == 0, out
    assert out.splitlines()[1] == f"  {H200_LINE}", out


def test_measured_rows_win_where_there_are_some_published_otherwise():
    h200 = priced_rows(load_hardware("h200"))
    assert h200.source.startswith("measured on NVIDIA H200")
    assert len(h200.gemm) > 60 and all("source" not in row for row in h200.gemm)
    assert {row["kernel"] for row in h200.attention} == {"cudnn"}  # dispatched on Hopper
    h100 = priced_rows(load_hardware("h100"))  # no H100 evidence: the published rows
    assert h100.source.startswith("published (memo_ext/estimate/kernel_tables.json, "
                                  "table 'h100'")
    assert [row["source"] for row in h100.gemm] == ["mamf_table"]
    assert kernel_rows(load_hardware("h100")) == {"gemm": h100.gemm, "attention": h100.attention}
    # The same GPU under another profile name has no measured rows: published again.
    published = {**load_hardware("h200"), "name": "h200-published"}
    assert priced_rows(published).gemm == h100.gemm
    # The measured GEMMs at the 8B's TP=4 layer shapes (550-660 TFLOP/s) sit below the one
    # published MAMF row (794.5, the best shape of a search).
    assert _efficiency("h200").gemm == pytest.approx(0.624, abs=0.002)
    assert _efficiency("h100").gemm == pytest.approx(794.5 / 989)


def test_the_output_says_which_rows_priced_the_job():
    assert kernel_rows_line(load_hardware("h200")) == H200_LINE
    assert kernel_rows_line(load_hardware("a800")) == (
        "kernel rows: published (memo_ext/estimate/kernel_tables.json, table 'a100-80gb': "
        "fa2_readme_a100, mamf_table); attention kernel flash-attn-2")
    cpu = {"name": "cpu", "device_type": "cpu", "kernels": {"gemm": [], "attention": []}}
    assert kernel_rows_line(cpu) == "kernel rows: the cpu profile's own rows (measured at startup)"


def test_the_table_is_derived_from_its_evidence_files():
    """One source per fact: every entry of measured_kernels.json is what --import-rows derives
    from the evidence file its provenance names."""
    table = read_table(MEASURED_FILE)
    assert table["gpus"], "measured_kernels.json holds no GPU"
    for profile, entry in table["gpus"].items():
        derived = entry_from_evidence(REPO_ROOT / entry["provenance"]["evidence"])
        assert derived == (profile, entry), (
            f"{profile}: measured_kernels.json differs from its evidence file; run python "
            f"bench/gpu_evidence.py --import-rows {entry['provenance']['evidence']}")


def test_import_command_round_trip(evidence, tmp_path, capsys):
    table = tmp_path / "measured_kernels.json"
    assert evidence.import_rows(H200_EVIDENCE, table) == 0
    assert "86 GEMM and 48 attention rows (cudnn, flash-attn-2) measured on NVIDIA H200" \
        in capsys.readouterr().out
    written = table.read_text()
    assert written == MEASURED_FILE.read_text()  # the committed table is this command's output
    assert evidence.import_rows(H200_EVIDENCE, table) == 0
    assert table.read_text() == written  # idempotent
    entry = json.loads(written)["gpus"]["h200"]
    assert entry["provenance"] == {
        "evidence": "bench/results/gpu_evidence_h200.json", "commit": "93b2990",
        "date": "2026-11-27T18:54:44+00:00", "gpu": "NVIDIA H200", "torch": "2.11.0+cu130",
        "cuda": "13.0", "cudnn": 91900, "driver": "580.159.04"}
    # FA2 from the trainer's own tile ops (what it dispatched); cuDNN from SDPA's backend.
    backends = {(row["kernel"], row["backend"]) for row in entry["attention"]}
    assert backends == {("flash-attn-2", "memo tile ops (as dispatched)"),
                        ("cudnn", "sdpa cudnn")}


def test_tile_ops_rows_win_over_sdpa_and_other_gpus_entries_stay(tmp_path):
    path = tmp_path / "gpu_evidence_h200.json"
    path.write_text(json.dumps(_toy_evidence()))
    table = tmp_path / "measured.json"
    kept = {"provenance": {"evidence": "gpu_evidence_a800.json"}, "gemm": [], "attention": []}
    table.write_text(json.dumps({"_comment": "", "gpus": {"a800": kept}}))
    profile, entry = import_evidence(path, table)
    assert profile == "h200"
    rows = {(row["kernel"], row["direction"]): (row["backend"], row["tflops"])
            for row in entry["attention"]}
    assert rows == {("cudnn", "forward"): ("memo tile ops (as dispatched)", 400.0),
                    ("cudnn", "backward"): ("memo tile ops (as dispatched)", 300.0),
                    ("flash-attn-2", "forward"): ("sdpa flash (FA2)", 290.0),
                    ("flash-attn-2", "backward"): ("sdpa flash (FA2)", 270.0)}
    assert entry["gemm"] == [{"m": 16384, "n": 4096, "k": 4096, "dtype": "bf16", "tflops": 661.1,
                              "shapes": ["8b TP1 proj forward"]}]
    assert json.loads(table.read_text())["gpus"]["a800"] == kept


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON"),
    ('{"section": "env"}', "not a GPU evidence file"),
    (json.dumps([{"section": "env", "commit": "abc"}]), "no 'env' record naming the GPU"),
    (json.dumps(_toy_evidence(gpu="NVIDIA H200 NVL")), "matches no profile's device_names"),
    (json.dumps([r if r["section"] == "env" else {**r, "status": "not measured"}
                 for r in _toy_evidence()]), "no measured GEMM or attention record"),
])
def test_a_bad_evidence_file_is_one_line_naming_it(evidence, tmp_path, capsys, content, message):
    path = tmp_path / "gpu_evidence_x.json"
    path.write_text(content)
    with pytest.raises(MeasuredRowsError, match=message):
        entry_from_evidence(path)
    table = tmp_path / "table.json"
    assert evidence.import_rows(path, table) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and message in err, err
    assert not table.exists()
    assert evidence.import_rows(tmp_path / "absent.json", table) == 2
    assert "absent.json: cannot read it" in capsys.readouterr().err


def test_attention_is_priced_at_the_dispatched_kernel(monkeypatch):
    """The estimator prices the kernel the trainer dispatches (cuda_attention_backend: cuDNN on
    Hopper, FlashAttention-2 on Ampere); a GPU with no rows of it falls back to
    FlashAttention-2's and says so."""
    assert [kernels.cuda_attention_backend(c) for c in ("8.0", "9.0")] == ["flash-attn-2",
                                                                           "cudnn"]
    assert kernels.cuda_attention_backend("9.0", "flash") == "flash-attn-2"
    cudnn = priced_rows(load_hardware("h200"))
    assert cudnn.attention_kernel == "cudnn"
    assert {row["backend"] for row in cudnn.attention} == {"sdpa cudnn"}
    h100 = kernel_rows_line(load_hardware("h100"))
    assert h100.endswith("attention kernel flash-attn-2 (the dispatched cudnn has no rows for "
                         "this GPU)")
    with_cudnn = _efficiency("h200")
    monkeypatch.setattr(kernels, "cuda_attention_backend", lambda capability: "flash-attn-2")
    fa2 = _efficiency("h200")
    assert with_cudnn.attention_forward > 1.7 * fa2.attention_forward
    assert with_cudnn.gemm == fa2.gemm


def test_measured_gemm_rows_give_the_layer_shapes_own_rate():
    """~90 rows: each 8B layer's forward GEMM at TP 1-8, at any token count from 16K up (m
    clamped to the table), reads its own measured row, not a neighbour's."""
    rows = kernel_rows(load_hardware("h200"))["gemm"]
    by_shape = {(row["m"], row["n"], row["k"]): row["tflops"] for row in rows}
    for tp in (1, 2, 4, 8):
        for n, k in ((48 * 128 // tp, 4096), (4096, 4096 // tp), (2 * 14336 // tp, 4096),
                     (4096, 14336 // tp), (128256 // tp, 4096)):
            for tokens in (16384, 1 << 17, 1 << 22):
                assert gemm_tflops(rows, tokens, n, k) == by_shape[(16384, n, k)]
    low, high = min(by_shape.values()), max(by_shape.values())
    assert low <= gemm_tflops(rows, 4096, 5120, 5120) <= high


def test_the_evidence_counts_attention_flops_as_the_cost_model_does(evidence):
    """gpu_evidence's TFLOP/s and the cost model's attention FLOPs (memo_ext.trace.work) use
    one convention: 4*d per (query, key) pair and head forward, 10*d backward; causal counts
    the computed half."""
    seq, heads, dim = 8192, 32, 128
    pairs = seq * seq
    assert evidence.attention_flops("forward", False, seq, heads, dim) == \
        ATTENTION_FORWARD_FLOPS_PER_PAIR_DIM * heads * dim * pairs
    assert evidence.attention_flops("backward", False, seq, heads, dim) == \
        ATTENTION_BACKWARD_FLOPS_PER_PAIR_DIM * heads * dim * pairs
    causal_pairs = seq * (seq + 1) // 2  # what the trace counts
    assert evidence.attention_flops("forward", True, seq, heads, dim) == pytest.approx(
        ATTENTION_FORWARD_FLOPS_PER_PAIR_DIM * heads * dim * causal_pairs, rel=1 / seq)


def _leave_one_out(rows: list[dict], kind: str) -> tuple[float, float]:
    """Mean relative error of each row predicted from the others (same kernel and direction
    for attention) by the cost model's lookup, and by the others' mean."""
    lookup, constant = [], []
    for index, row in enumerate(rows):
        others = [o for j, o in enumerate(rows) if j != index and (
            kind == "gemm" or (o["kernel"], o["direction"]) == (row["kernel"], row["direction"]))]
        predicted = gemm_tflops(others, row["m"], row["n"], row["k"]) if kind == "gemm" else \
            kernels.attention_tflops(others, row["direction"], row["causal"], row["head_dim"],
                                     row["seq_len"])
        lookup.append(abs(predicted / row["tflops"] - 1))
        constant.append(abs(statistics.fmean(o["tflops"] for o in others) / row["tflops"] - 1))
    return statistics.fmean(lookup), statistics.fmean(constant)


def test_the_lookup_beats_a_constant_on_the_measured_rows():
    """Each measured row predicted from the others: the lookup must beat their mean. The figures
    are docs/estimate.md's ("Kernel tables: measured rows win over published ones"); a new
    import that moves them must update the page."""
    entry = read_table(MEASURED_FILE)["gpus"]["h200"]
    documented = {"flash-attn-2": (0.221, 0.428), "cudnn": (0.190, 0.308), "gemm": (0.076, 0.083)}
    for name, (lookup, constant) in documented.items():
        if name == "gemm":
            errors = _leave_one_out(entry["gemm"], "gemm")
        else:
            errors = _leave_one_out([row for row in entry["attention"] if row["kernel"] == name],
                                    "attention")
        assert errors[0] < errors[1], f"{name}: the lookup ({errors[0]:.1%}) does not beat a " \
            f"constant ({errors[1]:.1%})"
        assert errors == pytest.approx((lookup, constant), abs=1e-3), \
            f"{name}: {errors}; update docs/estimate.md's figures"
