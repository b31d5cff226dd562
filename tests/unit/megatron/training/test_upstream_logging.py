"""Issue 45: Megatron-LM's logging and run-control flags in one tiny training run on CPU:
--timing-log-level 2 prints megatron-core's timers, --log-timers-to-tensorboard writes them
(and the iteration time) to TensorBoard, --wandb-project logs loss, throughput and memory to an
offline W&B run (WANDB_MODE=offline; skipped where wandb is not installed),
--exit-duration-in-mins stops after the first iteration with a checkpoint, --manual-gc runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, TINY_GPT_ARGS, run_trainer

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
#: Keys a W&B history record carries (protobuf: 0x12, length, the key).
WANDB_KEYS = ("lm_loss", "tokens_per_s", "tflops_per_device", "mem_peak_rss_mib",
              "forward-backward-time", "iteration-time")


def _argv(tmp_path: Path) -> list[str]:
    argv = [word if word != "20" else "5" for word in TINY_GPT_ARGS]  # --train-iters 5
    argv += ["--num-layers", "2", "--timing-log-level", "2", "--log-timers-to-tensorboard",
             "--tensorboard-dir", str(tmp_path / "tb"), "--save", str(tmp_path / "ckpt"),
             "--exit-duration-in-mins", "1e-9", "--manual-gc", "--manual-gc-interval", "1",
             "--logging-level", "20"]
    if HAVE_WANDB:
        argv += ["--wandb-project", "memo-test", "--wandb-exp-name", "upstream-logging",
                 "--wandb-save-dir", str(tmp_path / "wandb")]
    return argv


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("upstream_logging")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")  # the run inherits it: nothing leaves the machine
        result = run_trainer(1, _argv(tmp_path), timeout=300)
    return tmp_path, result


def test_exit_duration_stops_after_the_first_iteration_with_a_checkpoint(run):
    tmp_path, result = run
    assert "> exiting at iteration 1: the run passed --exit-duration-in-mins 1e-09" in result.stdout
    assert (tmp_path / "ckpt" / "iter_0000001").is_dir()
    assert " iteration        2/" not in result.stdout


def test_timers_are_printed_and_written_to_tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp_path, result = run
    assert "(min, max) time across ranks (ms):" in result.stdout
    for name in ("forward-backward", "forward-compute", "backward-compute", "optimizer "):
        assert f"    {name}" in result.stdout, name
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"forward-backward-time", "forward-compute-time", "optimizer-time",
            "iteration-time", "lm_loss", "tflops_per_device"} <= tags, tags


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (the optional 'wandb' "
                    "extra: pip install 'megatron-memo[wandb]'); the run above went without it")
def test_wandb_gets_loss_throughput_memory_and_timers_offline(run):
    tmp_path, _ = run
    files = list((tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    data = files[0].read_bytes()
    for key in WANDB_KEYS:
        assert b"\x12" + bytes([len(key)]) + key.encode() in data, key
    assert b"upstream-logging" in data and b"memo-test" in data


def test_the_refusal_without_wandb_names_the_extra(monkeypatch):
    from megatron.training import wandb_logging
    from megatron.training.arguments import ArgumentValidationError, parse_args

    monkeypatch.setattr(wandb_logging.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ArgumentValidationError, match=r"megatron-memo\[wandb\]"):
        parse_args(TINY_GPT_ARGS + ["--wandb-project", "p", "--save", str(REPO_ROOT)],
                   world_size=1, cuda_available=False)
