"""In-process (world of one, gloo) checks of the pieces behind the trainer: the parameter
count used for MFU (memo_ext.estimate.flops) against the built model, the SDPA/CP attention shim against megatron.core's own attention, the
resumable sampler, and checkpoint atomicity when a save dies half way."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from memo_ext.estimate.flops import gpt_shape, model_flops_per_sequence, parameter_count

from megatron.training.arguments import core_transformer_config_from_args, parse_args
from megatron.training.data import MicroBatchSampler
from tests.conftest import TINY_GPT_ARGS

VARIANTS = {
    "learned_gelu_bias": [],
    "rope_swiglu_rmsnorm_gqa": ["--position-embedding-type", "rope", "--swiglu",
                                "--normalization", "RMSNorm", "--group-query-attention",
                                "--num-query-groups", "2"],
    "untied_no_bias": ["--untie-embeddings-and-output-weights", "--disable-bias-linear"],
}


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process megatron world; torn down after the module."""
    from megatron.core import parallel_state

    from megatron.training.initialize import initialize_megatron

    args = parse_args(TINY_GPT_ARGS, world_size=1, cuda_available=False)
    initialize_megatron(args)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def build_args(extra: list[str]):
    from megatron.training.tokenizer import padded_vocab_size

    args = parse_args(TINY_GPT_ARGS + extra, world_size=1, cuda_available=False)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 1)
    return args


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mfu_parameter_count_is_the_built_models_per_token_gemm_weights(megatron_world, variant):
    """P counts every 2-D weight of a layer's GEMMs and the output layer once, with the
    tokenizer's vocabulary rows (not the padding); embeddings (lookups), biases and norms out."""
    from megatron.training import gpt

    args = build_args(VARIANTS[variant])
    model = gpt.model_provider(core_transformer_config_from_args(args), args)
    output_layer = ("output_layer.weight" if args.untie_embeddings_and_output_weights
                    else "embedding.word_embeddings.weight")
    gemm_weights = 0
    for name, parameter in model.named_parameters():
        if name == output_layer:
            assert parameter.shape == (args.padded_vocab_size, args.hidden_size)
            gemm_weights += args.vocab_size * args.hidden_size
        elif parameter.dim() == 2 and not name.startswith("embedding."):
            gemm_weights += parameter.numel()
    assert parameter_count(gpt_shape(args, args.vocab_size)) == gemm_weights


def test_model_flops_formula():
    args = build_args([])
    shape = gpt_shape(args, args.vocab_size)
    assert model_flops_per_sequence(shape, 64) == \
        6 * 64 * parameter_count(shape) + 6 * 4 * 64 * 64**2


@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_core_attention_matches_megatron_dot_product_attention(megatron_world, mask_type):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from memo_ext.attention import CoreAttention

    config = core_transformer_config_from_args(build_args([]))
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType[mask_type],
                  attention_type="self", attention_dropout=0.0)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 2, 4, 16, generator=generator) for _ in range(3))
    reference = DotProductAttention(**kwargs)(q, k, v, attention_mask=None)
    ours = CoreAttention(**kwargs)(q, k, v, attention_mask=None)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_sampler_resumes_where_it_stopped():
    full = list(MicroBatchSampler(64, 0, micro_batch_size=2, dp_rank=1, dp_size=2))
    resumed = list(MicroBatchSampler(64, 24, micro_batch_size=2, dp_rank=1, dp_size=2))
    assert resumed == full[6:]
    assert full[0] == [2, 3]


def test_crash_during_save_keeps_previous_checkpoint(megatron_world, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    from megatron.core.distributed import finalize_model_grads

    from megatron.training import checkpointing
    from megatron.training import gpt
    from megatron.training.data import build_data_iterator, build_datasets
    from megatron.training.tokenizer import build_tokenizer
    from megatron.training.training import TrainState, build_model, build_optimizer, train_step

    args = build_args(["--save", str(tmp_path), "--load", str(tmp_path)])
    config = core_transformer_config_from_args(args)
    model = build_model(args, config, gpt.model_provider)
    optimizer, scheduler = build_optimizer(args, model)
    config.finalize_model_grads_func = finalize_model_grads
    train_dataset = build_datasets(args, build_tokenizer("NullTokenizer", None, args.vocab_size))[0]
    train_step(gpt.forward_step, build_data_iterator(train_dataset, 0, args), model,
               optimizer, scheduler, args)  # gives the optimizer state to save
    checkpointing.save_checkpoint(args, TrainState(iteration=1, consumed_train_samples=8),
                                  model, optimizer, scheduler)

    def die_half_way(state_dict, directory, *args, **kwargs):
        (tmp_path / "iter_0000002.partial" / "shard_written_before_crash").write_text("x")
        raise OSError("disk full")

    monkeypatch.setattr(dist_checkpointing, "save", die_half_way)
    with pytest.raises(OSError):
        checkpointing.save_checkpoint(args, TrainState(iteration=2), model, optimizer, scheduler)
    monkeypatch.undo()
    assert checkpointing.read_latest_iteration(tmp_path) == 1
    assert not (tmp_path / "iter_0000002").exists()
    state = checkpointing.load_checkpoint(args, model, optimizer, scheduler)
    assert (state.iteration, state.consumed_train_samples) == (1, 8)


def test_corrupt_tracker_file_is_a_clear_error(tmp_path):
    from megatron.training import checkpointing

    (tmp_path / checkpointing.TRACKER_FILENAME).write_text("release")
    with pytest.raises(ValueError, match="--load"):
        checkpointing.read_latest_iteration(tmp_path)


LONG_CONTEXT_PATH = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "chunked",
                     "--cross-entropy-chunk-size", "24", "--memo-mlp-tile-size", "20",
                     "--memo-attention-projection-tile-size", "20"]
#: Head chunks per variant: two whole heads (MHA), and four single heads sharing the GQA
#: variant's 2 groups (each group's dK/dV the sum of its chunks').
HEAD_CHUNKS = {"learned_gelu_bias": "2", "rope_swiglu_rmsnorm_gqa": "4"}


@pytest.mark.parametrize("variant", ["learned_gelu_bias", "rope_swiglu_rmsnorm_gqa"])
def test_long_context_path_gradients_equal_megatrons_tensor_by_tensor(megatron_world, variant,
                                                                      monkeypatch):
    """One step of the same weights through the million-token path (memo_ext's attention in
    head chunks, the chunked loss, the tiled MLP and attention projections) and through
    megatron.core's own modules (DotProductAttention, which builds the s x s scores, the
    unfused vocab-parallel loss, the untiled MLP and projections): the losses and every
    parameter's gradient agree to fp32 round-off."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron.training import gpt
    from megatron.training import layer_specs

    class MegatronAttention(DotProductAttention):
        """DotProductAttention in CoreAttention's place (the spec passes head_chunks)."""

        def __init__(self, *args, head_chunks: int, **kwargs):
            super().__init__(*args, **kwargs)

    def model_for(extra):
        args = build_args(VARIANTS[variant] + extra)
        torch.manual_seed(0)
        return gpt.model_provider(core_transformer_config_from_args(args), args)

    ours = model_for(LONG_CONTEXT_PATH + ["--memo-attention-head-chunks", HEAD_CHUNKS[variant]])
    with monkeypatch.context() as patch:
        patch.setattr(layer_specs, "CoreAttention", MegatronAttention)
        reference = model_for([])
    assert type(reference.decoder.layers[0].self_attention.core_attention) is MegatronAttention
    assert type(ours.decoder.layers[0].self_attention.linear_qkv).__name__ == \
        "TiledColumnParallelLinear"
    reference.load_state_dict(ours.state_dict())
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (2, 64), generator=generator)
    labels = torch.randint(0, 512, (2, 64), generator=generator)
    positions = torch.arange(64).expand(2, 64)
    losses = []
    for model in (ours, reference):
        loss = model(tokens, positions, attention_mask=None, labels=labels)
        loss.sum().backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    grads = dict(reference.named_parameters())
    for name, parameter in ours.named_parameters():
        expected = grads[name].grad
        scale = expected.abs().max().item()
        error = (parameter.grad - expected).abs().max().item()
        assert error <= 1e-5 * scale + 1e-7, f"{name}: max abs error {error} (max {scale})"
