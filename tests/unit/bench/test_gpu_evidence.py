"""bench/gpu_evidence.py end to end on CPU (--dry-run), and the tile-composition check it and
make gpu-check run (megatron.memo_tools.gpu_check.ring_composition)."""

import json

import pytest
import torch

from megatron.memo_tools.gpu_check import ring_composition
from tests.conftest import REPO_ROOT, load_script


@pytest.fixture(scope="module")
def evidence():
    return load_script(REPO_ROOT / "bench" / "gpu_evidence.py", "gpu_evidence")


@pytest.fixture(scope="module")
def dry_run(evidence, tmp_path_factory):
    out = tmp_path_factory.mktemp("evidence")
    assert evidence.main(["--dry-run", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "gpu_evidence_dry_run.jsonl").read_text()
               .splitlines()]
    return out, records


def test_dry_run_checks_every_composition_and_plans_every_measurement(evidence, dry_run):
    out, records = dry_run
    by_section = {}
    for record in records:
        by_section.setdefault(record["section"], []).append(record)
    correctness = by_section["correctness"]
    assert [r["case"] for r in correctness] == [c.name for c in ring_composition.cases(128)]
    assert all(r["status"] == "PASS" and r["kernel"] == "cpu_flash" for r in correctness)
    assert len(by_section["attention"]) == (len(evidence.ATTENTION_BACKENDS) * 2
                                          * len(evidence.ATTENTION_LENGTHS))
    assert len(by_section["gemm"]) == len(evidence.gemm_shapes())
    assert len(by_section["long"]) == len(evidence.LONG_POLICIES) * len(evidence.LONG_LENGTHS)
    for section in ("attention", "gemm", "bandwidth", "long"):
        assert all(r["status"] == evidence.NOT_MEASURED for r in by_section[section]), section
    # The report is whole JSON and markdown with a row per record.
    assert json.loads((out / "gpu_evidence_dry_run.json").read_text()) == records
    markdown = (out / "gpu_evidence_dry_run.md").read_text()
    assert markdown.count("| not measured") >= len(by_section["gemm"])
    assert "| zigzag ring CP=4 | cpu_flash |" in markdown


def test_long_runs_use_the_recommenders_flags_with_alpha_auto(evidence, tmp_path):
    memo = evidence.long_argv("memo", 65536, tmp_path / "m.jsonl")
    assert memo[memo.index("--memo-alpha") + 1] == "auto"
    assert memo[memo.index("--seq-length") + 1] == "65536"
    assert "--memo-mlp-tile-size" in memo and "--cross-entropy-fusion-impl" in memo
    peer = evidence.long_argv("megatron", 65536, tmp_path / "p.jsonl")
    assert peer[peer.index("--recompute-granularity") + 1] == "full"
    assert "--memo-offload" not in peer


def test_bad_sections_and_no_gpu_are_one_line(evidence, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        evidence.main(["--dry-run", "--out", str(tmp_path), "--sections", "gemm,kernels"])
    assert stop.value.code == 2
    assert "--sections: unknown kernels" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert evidence.main(["--out", str(tmp_path)]) == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_the_check_catches_a_wrong_composition(monkeypatch):
    """Merging tiles without rescaling the running output (a plausible composition bug) must
    fail the ring cases and leave the one-tile control passing."""
    from memo_ext.attention import kernels

    def merge_without_rescale(output, lse, tile_output, tile_lse):
        output.add_(tile_output.float())
        lse.copy_(torch.logaddexp(lse, tile_lse))

    monkeypatch.setattr(kernels, "merge_into", merge_without_rescale)
    shape = dict(heads=4, groups=2, head_dim=16, device="cpu", dtype=torch.float32)
    control, ring = (ring_composition.check(ring_composition.Case(name, ranks=ranks), 64, **shape)
                     for name, ranks in (("control", 1), ("ring", 2)))
    assert control.passed
    assert not ring.passed and ring.errors["dq"] > 100 * ring.tolerance
