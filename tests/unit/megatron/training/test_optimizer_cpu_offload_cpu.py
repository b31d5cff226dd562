"""Optimizer CPU offload on CPU, in process: the flags and their validation
(megatron.training.arguments), each shim of megatron.training.compat.hybrid_optimizer and the
stream/event doubles of compat.devices, megatron-core's HybridDeviceOptimizer splitting and
stepping on CPU, and the checkpoint round trip of its state (world of one, gloo). Training with
it on several ranks: tests/distributed/test_optimizer_cpu_offload.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron.training.arguments import ArgumentValidationError, parse_args
from megatron.training.compat.hybrid_optimizer import HostAndDevice
from tests.conftest import TINY_GPT_ARGS
from tests.unit.megatron.training.test_distributed_optimizer_cpu import (
    build_args,
    build_trainer,
    save_and_reload,
    train,
)

OFFLOAD = ["--use-distributed-optimizer", "--use-precision-aware-optimizer",
           "--optimizer-cpu-offload"]


def parse(extra: list[str], cuda_available: bool = False):
    return parse_args(TINY_GPT_ARGS + extra, world_size=1, cuda_available=cuda_available)


# --- flags ---------------------------------------------------------------------------------

def test_flags_default_as_in_megatron_lm():
    args = parse([])
    assert not args.optimizer_cpu_offload and not args.use_precision_aware_optimizer
    assert args.optimizer_offload_fraction == 1.0
    assert not args.use_torch_optimizer_for_cpu_offload
    assert not args.overlap_cpu_optimizer_d2h_h2d
    assert args.pin_cpu_grads and args.pin_cpu_params


def test_flags_reach_the_optimizer_config(megatron_world, tmp_path):
    args = build_args(OFFLOAD + ["--optimizer-offload-fraction", "0.25",
                                 "--overlap-cpu-optimizer-d2h-h2d", "--no-pin-cpu-grads",
                                 "--no-pin-cpu-params"], tmp_path)
    _, optimizer, _ = build_trainer(args)
    config = optimizer.config
    assert config.optimizer_cpu_offload and config.use_precision_aware_optimizer
    assert config.optimizer_offload_fraction == 0.25
    assert config.overlap_cpu_optimizer_d2h_h2d
    assert not config.pin_cpu_grads and not config.pin_cpu_params
    (inner,) = optimizer.chained_optimizers
    hybrid = inner.optimizer
    assert hybrid.offload_fraction == 0.25 and hybrid.overlap_cpu_optimizer_d2h_h2d
    assert not hybrid.pin_cpu_grads and not hybrid.pin_cpu_params


# (case id, argv, text the one-line error must hold)
BAD_FLAGS = [
    ("fraction_above_one", OFFLOAD + ["--optimizer-offload-fraction", "1.5"],
     "--optimizer-offload-fraction must be in [0, 1]"),
    ("fraction_negative", OFFLOAD + ["--optimizer-offload-fraction", "-0.5"],
     "--optimizer-offload-fraction must be in [0, 1]"),
    ("fraction_without_offload", ["--optimizer-offload-fraction", "0.5"],
     "--optimizer-offload-fraction has no effect without --optimizer-cpu-offload"),
    ("overlap_without_offload", ["--overlap-cpu-optimizer-d2h-h2d"],
     "--overlap-cpu-optimizer-d2h-h2d has no effect"),
    ("torch_optimizer_without_offload", ["--use-torch-optimizer-for-cpu-offload"],
     "--use-torch-optimizer-for-cpu-offload has no effect"),
    ("unpinned_grads_without_offload", ["--no-pin-cpu-grads"], "--no-pin-cpu-grads has no effect"),
    ("unpinned_params_without_offload", ["--no-pin-cpu-params"],
     "--no-pin-cpu-params has no effect"),
    ("offload_without_precision_aware", ["--use-distributed-optimizer", "--optimizer-cpu-offload"],
     "--optimizer-cpu-offload needs --use-precision-aware-optimizer"),
    ("offload_without_distributed_optimizer",
     ["--use-precision-aware-optimizer", "--optimizer-cpu-offload"],
     "--use-precision-aware-optimizer needs --use-distributed-optimizer"),
    ("precision_aware_with_sgd", OFFLOAD + ["--optimizer", "sgd"], "--optimizer adam only"),
]


@pytest.mark.parametrize("argv,message", [c[1:] for c in BAD_FLAGS], ids=[c[0] for c in BAD_FLAGS])
def test_bad_combinations_are_refused_in_one_line(argv, message):
    with pytest.raises(ArgumentValidationError) as error:
        parse(argv)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed here")
def test_precision_aware_optimizer_without_te_needs_offload():
    with pytest.raises(ArgumentValidationError, match="FusedAdam"):
        parse(["--use-distributed-optimizer", "--use-precision-aware-optimizer"])
    parse(OFFLOAD)  # accepted on CPU: HybridDeviceOptimizer, no Transformer Engine


def test_on_cuda_offload_needs_te_and_16_bit_parameters(monkeypatch):
    """The CPU fixes (no Transformer Engine, fp32 parameters) do not apply on CUDA, where
    megatron-core 0.16.1 fails without them: refused in one line instead."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "transformer_engine"
                        else find_spec(name, *args))
    with pytest.raises(ArgumentValidationError, match="needs Transformer Engine installed"):
        parse(OFFLOAD, cuda_available=True)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: object() if name == "transformer_engine"
                        else find_spec(name, *args))
    with pytest.raises(ArgumentValidationError, match="16-bit parameters.*--bf16"):
        parse(OFFLOAD, cuda_available=True)
    parse(OFFLOAD + ["--bf16"], cuda_available=True)  # accepted


# --- compat.hybrid_optimizer.HostAndDevice -----------------------------------------------

def test_tensors_live_on_the_device_until_moved_to_the_host():
    device = torch.nn.Parameter(torch.arange(4.0))
    with HostAndDevice() as mode:
        assert device.is_cuda
        host = device.detach().clone().cpu()
        assert host is not device and not host.is_cuda and torch.equal(host, device)
        assert host.cpu() is host  # already on the host
        assert not (host * 2).float().is_cuda  # computed from a host tensor: on the host
        assert (device * 2).is_cuda
        pinned = host.pin_memory()
        assert pinned is not host and not pinned.is_cuda and torch.equal(pinned, host)
        with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
            device.pin_memory()
        assert mode.is_host(pinned) and not mode.is_host(device)
    assert not device.is_cuda and device.cpu() is device  # outside the block: CPU torch
    with pytest.raises(RuntimeError):
        host.pin_memory()


# --- compat.devices: streams and events ----------------------------------------------------

def test_recorded_events_are_complete():
    from megatron.training.compat.devices import CPU_CUDA

    stream = CPU_CUDA.Stream()
    event = stream.record_event()
    assert event is not None and event.query()
    event.wait(CPU_CUDA.current_stream())
    event.synchronize()
    given = CPU_CUDA.Event()
    assert stream.record_event(given) is given


# --- compat.hybrid_optimizer.answer_te_version_without_te ----------------------------------

@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed here")
def test_optimizer_config_for_offload_builds_without_te(megatron_world):
    from megatron.core import utils
    from megatron.core.optimizer import OptimizerConfig

    with pytest.raises(TypeError):  # megatron-core's own answer without Transformer Engine
        utils.is_te_min_version("2.1.0")
    config = OptimizerConfig(use_distributed_optimizer=True, use_precision_aware_optimizer=True,
                             optimizer_cpu_offload=True)
    assert config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    assert not config.store_param_remainders


# --- megatron-core's HybridDeviceOptimizer on CPU -------------------------------------------

def hybrid_optimizer(params, fraction: float, overlap: bool = False):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    return HybridDeviceOptimizer(
        params, offload_fraction=fraction, cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=overlap, lr=1e-2, weight_decay=0.1, fused=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_split_copies_and_steps_as_on_the_gpu_build(megatron_world, overlap):
    """Half of 20 elements offloaded: the first two parameters (6 + 4) get host copies and the
    host optimizer(s), the third stays with the device optimizer; three steps update every
    parameter exactly as torch's fused AdamW does, the host copies' results copied back."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (6, 4, 10)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = hybrid_optimizer(params, 0.5, overlap)
    expected = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)

    copies = optimizer.gpu_params_map_cpu_copy
    assert list(copies) == params[:2]
    assert all(copy is not param and torch.equal(copy, param) for param, copy in copies.items())
    assert len(optimizer.cpu_optimizers) == (2 if overlap else 1)
    (device_group,) = optimizer.gpu_optimizer.param_groups
    assert device_group["params"] == [params[2]]
    for _ in range(3):
        for param, ref in zip(params, reference):
            ref.grad = torch.randn(param.shape)
            param.grad = ref.grad.clone()
        optimizer.step()
        expected.step()
    for param, ref in zip(params, reference):
        assert torch.equal(param, ref)
    for param, copy in copies.items():
        assert torch.equal(copy, param)
        assert optimizer.state[param]["exp_avg"] is not None


@pytest.mark.parametrize("fraction,offloaded", [(0.0, 0), (1.0, 3)])
def test_fraction_bounds(megatron_world, fraction, offloaded):
    params = [torch.nn.Parameter(torch.randn(n)) for n in (6, 4, 10)]
    optimizer = hybrid_optimizer(params, fraction)
    assert len(optimizer.gpu_params_map_cpu_copy) == offloaded
    assert (optimizer.gpu_optimizer is None) == (offloaded == 3)
    assert (not optimizer.cpu_optimizers) == (offloaded == 0)


# --- compat.hybrid_optimizer.offload_fp32_parameters, through the trainer ------------------

def half_offloaded_trainer(tmp_path):
    args = build_args(OFFLOAD + ["--optimizer-offload-fraction", "0.5"], tmp_path)
    return args, *build_trainer(args)


def test_fp32_training_and_checkpoint_round_trip(megatron_world, tmp_path):
    """At fraction 0.5: the distributed optimizer's fp32 shards are leaves sharing the model's
    memory, and two steps update every parameter, the device part's too (megatron-core 0.16.1
    would leave it untrained). Then save, and a fresh model and optimizer load: Adam's moments
    bitwise and step 2 in a tensor of each parameter's own, for the host and the device part
    alike; the host copies hold the restored weights."""
    args, model, optimizer, scheduler = half_offloaded_trainer(tmp_path)
    (inner,) = optimizer.chained_optimizers
    hybrid = inner.optimizer
    shards = [p for group in hybrid.param_groups for p in group["params"]]
    assert all(shard.is_leaf for shard in shards)
    assert hybrid.gpu_params_map_cpu_copy and hybrid.gpu_optimizer is not None
    buffer = inner.buffers[0].param_data
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    assert all(start <= shard.data_ptr() < end for shard in shards)  # views of the weights
    initial = {name: p.detach().clone() for name, p in model[0].named_parameters()}
    train(args, model, optimizer, scheduler, 2)
    assert not [name for name, p in model[0].named_parameters() if torch.equal(p, initial[name])]
    _, fresh_optimizer = save_and_reload(args, model, optimizer, scheduler)
    (inner,) = fresh_optimizer.chained_optimizers
    hybrid = inner.optimizer
    assert hybrid.gpu_params_map_cpu_copy
    for param, copy in hybrid.gpu_params_map_cpu_copy.items():
        assert copy is not param and torch.equal(copy, param)
        (sub,) = [o for o in hybrid.sub_optimizers if copy in o.state]
        assert sub.state[copy] is hybrid.state[param]  # the host optimizer steps the loaded state
