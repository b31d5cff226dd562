"""The distributed optimizer on CPU, in process (world of one, gloo): the shim that lets
DistributedOptimizer's constructor sort CPU parameters (megatron.training.compat.
distrib_optimizer), and the checkpoint round trip of its state (megatron.training.checkpointing:
the load template of a fresh optimizer, Adam's step after a load, the refusal to load one kind
of optimizer's state into the other). Training with it on several ranks:
tests/distributed/test_distributed_optimizer.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.training.arguments import ArgumentValidationError, parse_args
from megatron.training.compat.distrib_optimizer import CUDA_TYPE_NAMES, cuda_type_names
from tests.conftest import TINY_GPT_ARGS


def test_cuda_type_names_only_inside_the_block():
    floats = {dtype: torch.zeros(2, dtype=dtype)
              for dtype in (torch.float32, torch.float16, torch.bfloat16)}
    names = {dtype: tensor.type() for dtype, tensor in floats.items()}
    assert set(names.values()) == set(CUDA_TYPE_NAMES)
    with cuda_type_names():
        for dtype, tensor in floats.items():
            assert tensor.type() == CUDA_TYPE_NAMES[names[dtype]]
        assert torch.nn.Parameter(floats[torch.float32]).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(2, dtype=torch.int64).type() == "torch.LongTensor"
        converted = floats[torch.float32].type(torch.float64)  # conversions are untouched
        assert converted.dtype == torch.float64
        assert floats[torch.float32].type("torch.DoubleTensor").dtype == torch.float64
    assert floats[torch.float32].type() == "torch.FloatTensor"


def test_cuda_type_names_restored_when_the_block_raises():
    with pytest.raises(ValueError), cuda_type_names():
        raise ValueError
    assert torch.zeros(1).type() == "torch.FloatTensor"


def build_args(extra: list[str], directory: Path):
    from megatron.training.tokenizer import padded_vocab_size

    args = parse_args(TINY_GPT_ARGS + ["--save", str(directory), "--load", str(directory)]
                      + extra, world_size=1, cuda_available=False)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 1)
    return args


def build_trainer(args):
    from megatron.core.distributed import finalize_model_grads

    from megatron.training import gpt
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.training import build_model, build_optimizer

    config = core_transformer_config_from_args(args)
    config.finalize_model_grads_func = finalize_model_grads
    model = build_model(args, config, gpt.model_provider)
    return model, *build_optimizer(args, model)


def adam_states(optimizer) -> list[dict]:
    (inner,) = optimizer.chained_optimizers
    return [inner.optimizer.state[param] for group in inner.optimizer.param_groups
            for param in group["params"]]


def train(args, model, optimizer, scheduler, iterations: int) -> None:
    """``iterations`` steps of the trainer's train_step on mock data, from sample 0."""
    from megatron.training import gpt
    from megatron.training.data import build_data_iterator, build_datasets
    from megatron.training.tokenizer import build_tokenizer
    from megatron.training.training import train_step

    dataset = build_datasets(args, build_tokenizer("NullTokenizer", None, args.vocab_size))[0]
    data = build_data_iterator(dataset, 0, args)
    for _ in range(iterations):
        train_step(gpt.forward_step, data, model, optimizer, scheduler, args)


def save_and_reload(args, model, optimizer, scheduler) -> tuple:
    """Save the trainer after its two steps, then load the checkpoint into a fresh model and
    optimizer built from ``args``; assert that Adam's moments are bitwise the saved ones, its
    step 2 in a tensor of each parameter's own, and the weights the saved ones. Returns the
    fresh (model, optimizer)."""
    from megatron.training import checkpointing
    from megatron.training.training import TrainState

    checkpointing.save_checkpoint(args, TrainState(iteration=2, consumed_train_samples=16),
                                  model, optimizer, scheduler)
    fresh_model, fresh_optimizer, fresh_scheduler = build_trainer(args)
    state = checkpointing.load_checkpoint(args, fresh_model, fresh_optimizer, fresh_scheduler)
    assert state.iteration == 2
    saved, loaded = adam_states(optimizer), adam_states(fresh_optimizer)
    assert len(saved) == len(loaded) > 1
    for before, after in zip(saved, loaded):
        assert torch.equal(before["exp_avg"], after["exp_avg"])
        assert torch.equal(before["exp_avg_sq"], after["exp_avg_sq"])
        assert after["step"].item() == 2
    assert len({id(after["step"]) for after in loaded}) == len(loaded)
    for old, new in zip(model[0].parameters(), fresh_model[0].parameters()):
        assert torch.equal(old, new)
    return fresh_model, fresh_optimizer


def test_checkpoint_round_trip_restores_every_adam_state(megatron_world, tmp_path):
    """Two steps, save, then a fresh model and optimizer load: Adam's moments bitwise, and its
    step 2 in a tensor of each parameter's own (megatron-core 0.16.1 would leave one tensor
    shared by all, holding the load template's step)."""
    args = build_args(["--use-distributed-optimizer"], tmp_path)
    model, optimizer, scheduler = build_trainer(args)
    train(args, model, optimizer, scheduler, 2)
    save_and_reload(args, model, optimizer, scheduler)


@pytest.mark.parametrize("saved_distributed", [True, False])
def test_optimizer_state_of_the_other_kind_is_refused(saved_distributed, tmp_path):
    from megatron.training import checkpointing

    flags = ["--use-distributed-optimizer"] if saved_distributed else []
    saved = checkpointing.content_metadata(build_args(flags, tmp_path))
    loading = build_args([] if saved_distributed else ["--use-distributed-optimizer"], tmp_path)
    with pytest.raises(ArgumentValidationError, match="--no-load-optim") as error:
        checkpointing._check_optimizer_state_loads(loading, saved, {}, tmp_path)
    assert "--use-distributed-optimizer" in str(error.value)
    same = build_args(flags, tmp_path)
    checkpointing._check_optimizer_state_loads(same, saved, {}, tmp_path)  # accepted


def test_distributed_optimizer_state_at_another_tp_size_is_refused(tmp_path):
    """Its buckets follow the TP/PP layout (dp_reshardable reshards across DP sizes only):
    refused in one line rather than dist_checkpointing's KeyError on the bucket keys."""
    from megatron.training import checkpointing

    args = build_args(["--use-distributed-optimizer"], tmp_path)
    metadata = checkpointing.content_metadata(args)
    with pytest.raises(ArgumentValidationError, match="--tensor-model-parallel-size 2") as error:
        checkpointing._check_optimizer_state_loads(args, metadata, {"model_parallel": [2, 1]},
                                                   tmp_path)
    assert "--no-load-optim" in str(error.value) and "\n" not in str(error.value)
    checkpointing._check_optimizer_state_loads(args, metadata, {"model_parallel": [1, 1]},
                                               tmp_path)
    plain = build_args([], tmp_path)  # the plain optimizer's state reshards to any layout
    checkpointing._check_optimizer_state_loads(plain, None, {"model_parallel": [2, 1]}, tmp_path)
