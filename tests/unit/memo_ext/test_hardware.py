"""memo_ext.hardware: the GPU profiles of memo_ext/hardware.json, as the estimator, the tracer's
CUDA rules and the trainer's MFU peak read them."""

from __future__ import annotations

import pytest

from memo_ext.hardware import HardwareProfileError, load_hardware, profile_for_device
from memo_ext.trace.cuda_rules import CudaTarget


def test_hardware_profiles():
    a800 = load_hardware("A800")
    assert a800["device_memory_bytes"] > 79 * (1 << 30) and a800["bf16_tflops"] == 312
    with pytest.raises(HardwareProfileError, match="--gpu nope: unknown"):
        load_hardware("nope")


def test_hardware_file_adds_and_overrides_profiles(tmp_path):
    extra = tmp_path / "gpus.json"
    extra.write_text('{"mi300x": {"device_memory_bytes": 206158430208, "bf16_tflops": 1307}, '
                     '"a800": {"device_memory_bytes": 1, "bf16_tflops": 1}}')
    assert load_hardware("mi300x", extra)["bf16_tflops"] == 1307
    assert load_hardware("a800", extra)["device_memory_bytes"] == 1
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(HardwareProfileError, match="--hardware-file"):
        load_hardware("a800", broken)


def test_a_profile_without_the_cuda_rules_fields_is_refused_in_one_line(tmp_path):
    extra = tmp_path / "gpus.json"
    extra.write_text('{"mi300x": {"device_memory_bytes": 206158430208, "bf16_tflops": 1307}}')
    with pytest.raises(HardwareProfileError, match=r"^GPU profile 'mi300x' in .* needs "
                       r'"compute_capability" \("8.0"\) and "sm_count" \(108\)'):
        CudaTarget.for_gpu("mi300x", extra)


def test_device_names_find_their_profile():
    assert profile_for_device("NVIDIA H100 80GB HBM3")["name"] == "h100"
    assert profile_for_device("a GPU no pattern matches") is None
