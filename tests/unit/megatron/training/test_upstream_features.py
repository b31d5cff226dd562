"""Issue 45: the Megatron-LM features the trainer honours for real, each against what it must
equal, in-process on one rank (CPU, gloo).

- --calculate-per-token-loss: the gradient of a global batch is its token sum over its token
  count (exact, from the gradients of each micro-batch alone);
- --decoupled-lr/--decoupled-min-lr: the embedding and output layer get their own schedule, the
  log line keeps the default one;
- --apply-layernorm-1p: norms apply 1 + weight with the weight at 0, the same function as the
  plain norm at initialisation, recorded in checkpoints;
- --manual-gc, --exit-duration-in-mins, --empty-unused-memory-level, --profile's range,
  --logging-level, --no-mmap-bin-files;
- GPT2BPETokenizer (--vocab-file/--merge-file): transformers' GPT2Tokenizer's ids.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from megatron.training.arguments import core_transformer_config_from_args, parse_args
from tests.conftest import TINY_GPT_ARGS
from tests.hf_models import TOKENIZER_TEXTS, save_gpt2_files

SEQ = 64


def _args(*extra: str):
    from megatron.training.tokenizer import padded_vocab_size

    args = parse_args(TINY_GPT_ARGS + list(extra), world_size=1, cuda_available=False)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 1)
    return args


def _model(args):
    from megatron.core.distributed import finalize_model_grads

    from megatron.training import gpt
    from megatron.training.training import build_model

    torch.manual_seed(0)
    config = core_transformer_config_from_args(args)
    model = build_model(args, config, gpt.model_provider)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model[0].no_sync
    return model, config


def _batch(tokens_in_loss: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 500, (1, SEQ + 1), generator=generator)
    mask = torch.zeros(1, SEQ)
    mask[0, torch.randperm(SEQ, generator=generator)[:tokens_in_loss]] = 1.0
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
            "position_ids": torch.arange(SEQ).unsqueeze(0)}


def _gradients(model, args, batches: list[dict], per_token: bool) -> dict[str, torch.Tensor]:
    """main_grad of every parameter after one global batch of ``batches`` (finalized)."""
    from megatron.training import gpt
    from megatron.training.training import run_schedule

    model[0].config.calculate_per_token_loss = per_token  # read by the schedule (DP=1: DDP's
    args.num_microbatches = len(batches)                   # scaling is 1 either way)
    for chunk in model:
        chunk.zero_grad_buffer()
    run_schedule(gpt.forward_step, iter(batches), model, args, forward_only=False)
    return {name: param.main_grad.clone() for name, param in model[0].module.named_parameters()}


def test_per_token_loss_is_the_global_token_mean(megatron_world):
    """Micro-batches with 10 and 50 tokens in the loss: per-token gradients are
    (10 g1 + 50 g2) / 60, where g_k is micro-batch k's own mean-loss gradient; Megatron's
    default averages the micro-batch means instead, (g1 + g2) / 2."""
    args = _args("--global-batch-size", "4", "--micro-batch-size", "1",
                 "--calculate-per-token-loss")
    model, _ = _model(args)
    first, second = _batch(10, seed=1), _batch(50, seed=2)
    g1 = _gradients(model, args, [first], per_token=False)
    g2 = _gradients(model, args, [second], per_token=False)
    per_token = _gradients(model, args, [first, second], per_token=True)
    default = _gradients(model, args, [first, second], per_token=False)
    for name in g1:  # fp32 round-off: the sums run in another order
        expected = (10 * g1[name] + 50 * g2[name]) / 60
        scale = float(expected.abs().max())
        torch.testing.assert_close(per_token[name], expected, rtol=1e-5, atol=1e-6 * scale)
        mean_of_means = (g1[name] + g2[name]) / 2
        torch.testing.assert_close(default[name], mean_of_means, rtol=1e-5,
                                   atol=1e-6 * float(mean_of_means.abs().max()))
    embedding = "embedding.word_embeddings.weight"
    assert not torch.allclose(per_token[embedding], default[embedding], rtol=1e-3)


def test_decoupled_lr_schedules_embedding_and_output_apart(megatron_world):
    from megatron.training.training import build_optimizer, logged_lr

    args = _args("--untie-embeddings-and-output-weights", "--decoupled-lr", "5e-3",
                 "--decoupled-min-lr", "1e-4", "--lr-decay-style", "constant")
    model, _ = _model(args)
    optimizer, scheduler = build_optimizer(args, model)
    embedding = model[0].module.embedding.word_embeddings.weight
    output = model[0].module.output_layer.weight
    decoupled = [group for group in optimizer.param_groups
                 if any(p is embedding or p is output for p in group["params"])]
    assert decoupled and all(g["max_lr"] == 5e-3 and g["min_lr"] == 1e-4 for g in decoupled)
    assert sum(len(g["params"]) for g in decoupled) == 2
    others = [group for group in optimizer.param_groups if group not in decoupled]
    assert others and all(g["max_lr"] == args.lr for g in others)
    scheduler.step(increment=args.global_batch_size)
    assert all(g["lr"] == 5e-3 for g in decoupled)
    assert logged_lr(optimizer, scheduler) == args.lr


def test_zero_centred_norms_apply_one_plus_weight(megatron_world):
    from megatron.training import gpt
    from megatron.training.norms import ZeroCenteredLayerNorm, ZeroCenteredRMSNorm

    for normalization, plain in (("RMSNorm", torch.nn.RMSNorm), ("LayerNorm", torch.nn.LayerNorm)):
        args = _args("--normalization", normalization, "--apply-layernorm-1p")
        config = core_transformer_config_from_args(args)
        assert config.layernorm_zero_centered_gamma
        model = gpt.model_provider(config, args)
        norms = [m for m in model.modules() if isinstance(m, (ZeroCenteredLayerNorm,
                                                               ZeroCenteredRMSNorm))]
        assert len(norms) == 2 * args.num_layers + 1  # two per layer and the final norm
        norm = norms[0]
        assert torch.count_nonzero(norm.weight) == 0
        reference = plain(args.hidden_size, eps=args.norm_epsilon)
        x = torch.randn(3, args.hidden_size)
        torch.testing.assert_close(norm(x), reference(x))  # identity scale at initialisation
        with torch.no_grad():
            norm.weight.normal_()
            reference.weight.copy_(norm.weight + 1)
            if normalization == "LayerNorm":
                norm.bias.normal_()
                reference.bias.copy_(norm.bias)
        torch.testing.assert_close(norm(x), reference(x))


def test_checkpoints_record_zero_centred_norms(tmp_path):
    from megatron.training.arguments import ArgumentValidationError
    from megatron.training.checkpointing import (
        check_model_args,
        model_args_record,
        recorded_model_flags,
    )

    recorded = model_args_record(_args("--apply-layernorm-1p"))
    assert recorded["apply_layernorm_1p"] is True
    assert "--apply-layernorm-1p" in recorded_model_flags(recorded)
    with pytest.raises(ArgumentValidationError, match="--apply-layernorm-1p"):
        check_model_args(recorded, _args(), tmp_path)


def test_manual_gc_collects_at_megatrons_points(monkeypatch):
    from megatron.training.run_controls import ManualGC

    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    was_enabled = gc.isenabled()
    control = ManualGC(_args("--manual-gc", "--manual-gc-interval", "2"))
    try:
        control.start()
        assert not gc.isenabled() and calls == [2]
        for iteration in (1, 2, 3, 4):
            control.after_step(iteration)
        assert calls == [2, 2, 2]
        with control.evaluation():
            assert calls == [2, 2, 2, 2]
        assert calls == [2, 2, 2, 2, 0]
    finally:
        control.stop()
    assert gc.isenabled() == was_enabled
    calls.clear()
    off = ManualGC(_args())
    off.start(), off.after_step(2), off.stop()
    assert calls == []


def test_exit_duration_and_empty_cache(monkeypatch):
    from megatron.training import run_controls

    args = _args("--exit-duration-in-mins", "2", "--empty-unused-memory-level", "1")
    start = run_controls.PROCESS_START
    assert not run_controls.duration_exceeded(args, now=start + 119)
    assert run_controls.duration_exceeded(args, now=start + 121)
    assert not run_controls.duration_exceeded(_args(), now=start + 10**6)
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    run_controls.empty_unused_memory(args, level=1)
    run_controls.empty_unused_memory(args, level=2)
    assert emptied == [True]


class _FakeCudart:
    def __init__(self):
        self.calls = []

    def cudaProfilerStart(self):
        self.calls.append("start")

    def cudaProfilerStop(self):
        self.calls.append("stop")


def test_profile_range_opens_and_closes_at_megatrons_iterations():
    from megatron.training.profiling import ProfilerRange, profile_problem

    args = parse_args(TINY_GPT_ARGS + ["--profile", "--profile-step-start", "2",
                                       "--profile-step-end", "4", "--profile-ranks", "0"],
                      world_size=1, cuda_available=True)
    cudart = _FakeCudart()
    profiler = ProfilerRange(args, rank=0, cudart=cudart)
    for done in range(6):
        profiler.before_step(done)
        assert cudart.calls == (["start"] if 2 <= done < 4 else [] if done < 2
                                else ["start", "stop"])
        profiler.after_step(done + 1)
    assert cudart.calls == ["start", "stop"]
    other = _FakeCudart()
    ProfilerRange(args, rank=1, cudart=other).before_step(2)
    assert other.calls == []
    defaults = parse_args(TINY_GPT_ARGS + ["--profile"], world_size=1, cuda_available=True)
    assert (defaults.profile_step_start, defaults.profile_step_end, defaults.profile_ranks) == \
        (10, 12, [])
    assert profile_problem(defaults, cuda_available=False).startswith("--profile ")


def test_logging_level_sets_the_root_logger(monkeypatch):
    from megatron.training.initialize import set_logging_level

    root = logging.getLogger()
    before = root.level
    try:
        set_logging_level(_args("--logging-level", "20"))
        assert root.level == 20
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "30")
        set_logging_level(_args())
        assert root.level == 30
    finally:
        root.setLevel(before)


def test_gpt2_bpe_tokenizer_is_gpt2s_encoder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Tokenizer

    from megatron.training.tokenizer import build_tokenizer

    vocab, merges = save_gpt2_files(tmp_path / "gpt2")
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab),
                                merge_file=str(merges))
    reference = GPT2Tokenizer(str(vocab), str(merges))
    for text in (*TOKENIZER_TEXTS[:3], "Zürich  spaces\n\n tabs\t!", "it's 12345 don't"):
        assert tokenizer.tokenize(text) == reference.encode(text)
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert tokenizer.eod == reference.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.vocab_size == len(reference)
    before = tokenizer.unique_identifiers
    merges.write_text("\n".join(merges.read_text().splitlines()[:-1]) + "\n")  # one merge less
    after = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    assert after.unique_identifiers != before  # another file, another dataset cache
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab),
                        merge_file=str(tmp_path / "missing.txt"))


@pytest.mark.parametrize("mmap", [True, False])
def test_no_mmap_bin_files_reaches_the_dataset(megatron_world, tmp_path, mmap, monkeypatch):
    from megatron.core.datasets import gpt_dataset

    from megatron.training import data
    from megatron.training.tokenizer import NullTokenizer

    seen = []
    monkeypatch.setattr(data, "BlendedMegatronDatasetBuilder",
                        lambda cls, sizes, ready, config: seen.append(config) or
                        type("B", (), {"build": lambda self: [None, None, None]})())
    args = _args(*([] if mmap else ["--no-mmap-bin-files"]))
    data.build_datasets(args, NullTokenizer(512))
    assert isinstance(seen[0], gpt_dataset.GPTDatasetConfig)
    assert seen[0].mmap_bin_files is mmap
    assert seen[0].split_matrix[2] is None  # the test split, read by no one, is not built
