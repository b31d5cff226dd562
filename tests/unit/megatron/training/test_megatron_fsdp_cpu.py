"""Megatron-FSDP's flags and CPU shims, in process: each rule of
megatron.training.megatron_fsdp.validate_megatron_fsdp as its one line, and the two answers
megatron.training.compat gives Megatron-FSDP on CPU (``torch.device`` naming CUDA is the CPU;
its device mesh is built on the CPU). Training with it on two and four ranks:
tests/distributed/test_megatron_fsdp.py."""

from __future__ import annotations

import pytest
import torch

from megatron.training.arguments import ArgumentValidationError, parse_args
from tests.conftest import TINY_GPT_ARGS

FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]


def without(flags: list[str], flag: str, takes_value: bool = True) -> list[str]:
    at = flags.index(flag)
    return flags[:at] + flags[at + 1 + takes_value:]


def test_the_full_flag_set_is_accepted():
    args = parse_args(TINY_GPT_ARGS + FSDP + ["--fsdp-double-buffer"], world_size=2,
                      cuda_available=False)
    assert args.use_megatron_fsdp and args.fsdp_double_buffer
    assert args.data_parallel_sharding_strategy == "optim_grads_params"


REFUSALS = {
    "no_shard": (FSDP[:2] + ["no_shard"] + FSDP[3:], "--data-parallel-sharding-strategy "
                 "no_shard (the default) cannot train"),
    "default_strategy": (without(FSDP, "--data-parallel-sharding-strategy"),
                         "--data-parallel-sharding-strategy no_shard (the default)"),
    "plain_optimizer": (without(FSDP, "--use-distributed-optimizer", takes_value=False),
                        "--use-megatron-fsdp needs --use-distributed-optimizer"),
    "torch_dist": (without(FSDP, "--ckpt-format"),
                   "--use-megatron-fsdp saves only --ckpt-format fsdp_dtensor"),
    "pipeline": (FSDP + ["--pipeline-model-parallel-size", "2"],
                 "--use-megatron-fsdp does not run with --pipeline-model-parallel-size > 1"),
    "strategy_alone": (["--data-parallel-sharding-strategy", "optim"],
                       "--data-parallel-sharding-strategy applies to --use-megatron-fsdp"),
    "double_buffer_alone": (["--fsdp-double-buffer"],
                            "--fsdp-double-buffer applies to --use-megatron-fsdp"),
    "fsdp_dtensor_alone": (["--ckpt-format", "fsdp_dtensor"],
                           "--ckpt-format fsdp_dtensor is Megatron-FSDP's format"),
    "nccl_ub": (FSDP + ["--use-nccl-ub"], "--use-nccl-ub: NCCL user-buffer registration"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_one_line_naming_the_flag(case):
    flags, start = REFUSALS[case]
    with pytest.raises(ArgumentValidationError) as raised:
        parse_args(TINY_GPT_ARGS + flags, world_size=2, cuda_available=False)
    assert str(raised.value).startswith(start)
    assert "\n" not in str(raised.value)


def test_one_data_parallel_rank_is_refused():
    """At DP x CP = 1 Megatron-FSDP shards nothing, and megatron-core 0.16.1's gradients come
    out wrong there (docs/training.md): refused in one line; CP=2 alone is a sharding group."""
    with pytest.raises(ArgumentValidationError) as raised:
        parse_args(TINY_GPT_ARGS + FSDP, world_size=1, cuda_available=False)
    assert str(raised.value).startswith("--use-megatron-fsdp shards over the data-parallel x "
                                        "context-parallel ranks, and there is one")
    parse_args(TINY_GPT_ARGS + FSDP + ["--context-parallel-size", "2"], world_size=2,
               cuda_available=False)


def test_torch_device_naming_cuda_is_the_cpu_for_megatron_core():
    from megatron.training.compat.devices import CPU_TORCH

    device = CPU_TORCH.device
    assert device(f"cuda:{CPU_TORCH.cuda.current_device()}") == torch.device("cpu")
    assert device("cuda", 0) == device("cuda:1") == device("cuda") == torch.device("cpu")
    assert device("cpu") == torch.device("cpu") and device("meta").type == "meta"
    assert isinstance(torch.device("cpu"), device) and not isinstance("cpu", device)


def test_the_fsdp_mesh_is_built_on_the_cpu(megatron_world):
    """mcore_fsdp_adapter's ``DeviceMesh.from_group(..., device_type="cuda")``: a CPU mesh over
    the same group, so that DTensor keeps the shards on the CPU."""
    import torch.distributed as dist
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from torch.distributed.tensor import DTensor, Shard

    mesh = mcore_fsdp_adapter.DeviceMesh.from_group(
        [dist.group.WORLD], device_type="cuda", mesh=[0], mesh_dim_names=["dp_cp"])
    assert mesh.device_type == "cpu" and mesh.mesh_dim_names == ("dp_cp",)
    shard = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    assert shard.to_local().device.type == "cpu" and shard.shape == (2, 3)


def test_which_checkpoint_formats_load(tmp_path):
    """Each format loads in its own; a torch_dist checkpoint also into Megatron-FSDP, its
    weights only (test_megatron_fsdp.py loads one); an fsdp_dtensor one only into
    Megatron-FSDP."""
    import argparse

    from megatron.training.checkpointing import _check_checkpoint_format
    from megatron.training.fsdp_checkpointing import COMMON_FILE

    fsdp, dist_ckpt = tmp_path / "fsdp", tmp_path / "torch_dist"
    fsdp.mkdir()
    dist_ckpt.mkdir()
    (fsdp / COMMON_FILE).write_bytes(b"")

    def saved_format(directory, run, load_optimizer=True):
        return _check_checkpoint_format(argparse.Namespace(ckpt_format=run), directory,
                                        load_optimizer)

    assert saved_format(fsdp, "fsdp_dtensor") == "fsdp_dtensor"
    assert saved_format(dist_ckpt, "torch_dist") == "torch_dist"
    assert saved_format(dist_ckpt, "fsdp_dtensor", load_optimizer=False) == "torch_dist"
    with pytest.raises(ArgumentValidationError) as raised:
        saved_format(fsdp, "torch_dist", load_optimizer=False)
    assert str(raised.value) == (
        f"--load {fsdp}: it was saved with --ckpt-format fsdp_dtensor (Megatron-FSDP), this run "
        "has --ckpt-format torch_dist; load it with --use-megatron-fsdp --ckpt-format "
        "fsdp_dtensor")
    with pytest.raises(ArgumentValidationError) as raised:
        saved_format(dist_ckpt, "fsdp_dtensor")
    assert str(raised.value).startswith(
        f"--load {dist_ckpt}: a torch_dist checkpoint's optimizer state does not load into "
        "Megatron-FSDP (--ckpt-format fsdp_dtensor); pass --no-load-optim")
