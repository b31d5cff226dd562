"""memo_ext.estimate.cpu_profile: the ``cpu`` profile's keys and rows, the cost model's terms it
feeds, and ``tools/estimate.py --gpu cpu``'s refusals. Tiny shapes, one repeat: no timing is
asserted (the numbers depend on the machine and its load)."""

from __future__ import annotations

import math

import pytest

from memo_ext.estimate.cost import Efficiency, predict_step
from memo_ext.estimate.cpu_profile import CpuProfileError, measure_cpu_profile
from memo_ext.estimate.kernels import at_model_shapes
from memo_ext.estimate.layout import CPU_TRACE_FIELDS, target_fields
from memo_ext.hardware import load_hardware
from tests.conftest import run_estimate_cli

TINY = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
        "vocab_size": 256, "seq_length": 128}
#: GPU-only keys a measured profile replaces: published kernel rows (it has its own
#: ``kernels``) and the CUDA device names of the trainer's MFU peak table.
GPU_ONLY_KEYS = {"kernel_table", "device_names"}


@pytest.fixture(scope="module")
def one_rank():
    return measure_cpu_profile(TINY, {"tp": 1, "cp": 1}, ranks=1, threads=1, repeats=1)


@pytest.fixture(scope="module")
def two_ranks():
    return measure_cpu_profile(TINY, {"tp": 2, "cp": 1}, ranks=2, threads=1, repeats=1)


def test_the_profile_has_every_key_of_a_gpu_profile(one_rank):
    missing = set(load_hardware("a800")) - GPU_ONLY_KEYS - set(one_rank)
    assert not missing
    assert one_rank["name"] == "cpu" and one_rank["device_type"] == "cpu"
    assert target_fields(one_rank) == CPU_TRACE_FIELDS  # traced as the fp32 CPU trainer runs


def test_kernel_rows_have_the_kernel_table_format(one_rank):
    gemm, attention = one_rank["kernels"]["gemm"], one_rank["kernels"]["attention"]
    assert {(row["m"], row["n"], row["k"]) for row in gemm} == {
        (128, 192, 64), (128, 64, 64), (128, 256, 64), (128, 64, 256)}
    assert all({"m", "n", "k", "tflops"} <= set(row) for row in gemm)
    assert sorted(row["direction"] for row in attention) == ["backward", "forward"]
    for row in attention:
        assert (row["causal"], row["head_dim"], row["seq_len"]) == (True, 16, 128)


def test_measurements_are_positive_and_give_finite_efficiencies(one_rank, two_ranks):
    for profile in (one_rank, two_ranks):
        for key in ("bf16_tflops", "hbm_gbps", "pcie_gbps", "nvlink_gbps", "ib_gbps"):
            assert profile[key] > 0, key
        rows = profile["kernels"]["gemm"] + profile["kernels"]["attention"]
        assert all(row["tflops"] > 0 for row in rows)
        assert profile["host_copy_overlap"] <= 1
    assert one_rank["collective_ops"] == {} and two_ranks["single_rank_ops"] == {}
    assert set(one_rank["single_rank_ops"]) == {"all_gather", "reduce_scatter"}
    assert all(v["latency_s"] > 0 and v["gbps"] > 0
               for v in one_rank["single_rank_ops"].values())
    assert set(two_ranks["collective_ops"]) == {"all_reduce", "all_gather", "reduce_scatter",
                                                "send"}
    assert all(v["latency_s"] > 0 and v["gbps"] > 0
               for v in two_ranks["collective_ops"].values())
    efficiency = at_model_shapes(Efficiency.from_profile(one_rank), one_rank,
                                 {**TINY, "padded_vocab_size": 256},
                                 {"tp": 1, "cp": 1, "micro_batch_size": 1})
    for value in (efficiency.gemm, efficiency.attention_forward, efficiency.attention_backward):
        assert math.isfinite(value) and value > 0


def _step(hardware: dict, work: dict, *, dp: int = 1, options: dict | None = None,
          persistent: dict | None = None):
    header = {"layout": {"tp": 2, "cp": 1, "pp": 1, "dp": dp, "micro_batch_size": 1},
              "model": {**TINY, "params_dtype": "torch.float32"}, "options": options or {}}
    efficiency = Efficiency(memory=1.0, collective=1.0, pcie=1.0, reorganisation_s=0.0,
                            gemm=1.0, attention_forward=1.0, attention_backward=1.0)
    return predict_step(work, header, hardware, efficiency, global_batch=dp,
                        persistent=persistent or {"parameter": 0, "gradient": 0,
                                                  "optimizer": 0})


def test_the_cost_model_reads_the_measured_copy_overlap_and_collectives():
    hardware = {"bf16_tflops": 1.0, "hbm_gbps": 1.0, "pcie_gbps": 1.0, "nvlink_gbps": 1.0,
                "ib_gbps": 1.0, "gpus_per_node": 2}
    work = {"phases": {"forward": {"gemm_flops": 10 ** 12, "d2h_bytes": 10 ** 8}},
            "collectives": [{"phase": "forward", "op": "all_reduce", "ranks": [0, 1],
                             "bytes": 10 ** 9, "calls": 10}]}
    gpu = _step(hardware, work)
    assert gpu.offload_exposed_s == 0  # 0.1 s of copy hides under 1 s of GEMM
    assert gpu.collectives_s == pytest.approx(1.0)  # 2 (g-1)/g of 1 GB at 1 GB/s
    measured = _step({**hardware, "host_copy_overlap": 0.0,
                      "collective_ops": {"all_reduce": {"latency_s": 0.01, "gbps": 2.0}}}, work)
    assert measured.offload_exposed_s == pytest.approx(0.1)  # the copy hides nowhere
    assert measured.collectives_s == pytest.approx(10 * 0.01 + 0.5)


def test_one_rank_distributed_optimizer_pays_gloos_copies_only_where_measured():
    """The distributed optimizer over a data-parallel group of one rank: gloo copies its
    buffers (the CPU profile measures it), NCCL in place does nothing (a GPU profile has no
    single_rank_ops); the gradient reduce-scatter is the data-parallel term, the parameter
    all-gather part of the optimizer's."""
    hardware = {"bf16_tflops": 1.0, "hbm_gbps": 1.0, "pcie_gbps": 1.0, "nvlink_gbps": 1.0,
                "ib_gbps": 1.0, "gpus_per_node": 2}
    measured = {**hardware, "single_rank_ops": {
        "all_gather": {"latency_s": 0.01, "gbps": 2.0},
        "reduce_scatter": {"latency_s": 0.02, "gbps": 4.0}}}
    work = {"phases": {}, "collectives": []}
    state = {"parameter": 10 ** 9, "gradient": 2 * 10 ** 9, "optimizer": 0}
    distributed = {"use_distributed_optimizer": True}
    gpu = _step(hardware, work, options=distributed, persistent=state)
    cpu = _step(measured, work, options=distributed, persistent=state)
    assert cpu.data_parallel_s - gpu.data_parallel_s == pytest.approx(0.02 + 0.5)
    assert cpu.optimizer_s - gpu.optimizer_s == pytest.approx(0.01 + 0.5)
    plain = _step(measured, work, persistent=state)
    assert (plain.data_parallel_s, plain.optimizer_s) == (gpu.data_parallel_s, gpu.optimizer_s)
    two_ranks = _step(measured, work, dp=2, options=distributed, persistent=state)
    assert two_ranks.step_s == pytest.approx(_step(hardware, work, dp=2, options=distributed,
                                                   persistent=state).step_s)


@pytest.mark.parametrize("flags, message", [
    (["--recommend", "--gpus", "2", "--seq-length", "256"],
     "give --tensor-model-parallel-size/--context-parallel-size/--pipeline-model-parallel-size"),
    (["--max-seq-length"], "give --seq-length instead of --max-seq-length"),
    (["--seq-length", "256", "--policy", "sppo"], "--policy sppo"),
    (["--seq-length", "256", "--hardware-file", "x.json"], "--hardware-file does not apply"),
    (["--seq-length", "256", "--tensor-model-parallel-size", "3"],
     "--tensor-model-parallel-size 3: 4 heads (4 groups) do not divide by it"),
    (["--seq-length", "250", "--context-parallel-size", "2"],
     "--seq-length 250: context parallelism 2 needs"),
])
def test_the_cpu_flag_refuses_in_one_line(tmp_path, capsys, flags, message):
    model = tmp_path / "tiny.json"
    model.write_text('{"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, '
                     '"num_attention_heads": 4, "vocab_size": 256}')
    code, _ = run_estimate_cli(["--model", str(model), "--gpu", "cpu", *flags])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and message in errors[0]


def test_bad_repeats_are_refused_before_anything_runs():
    with pytest.raises(CpuProfileError, match="repeats 0"):
        measure_cpu_profile(TINY, {"tp": 1, "cp": 1}, ranks=1, repeats=0)
