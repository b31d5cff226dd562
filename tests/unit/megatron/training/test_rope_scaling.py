"""RoPE scaling (docs/rope_scaling.md) against transformers: for each rule, the rotary
frequencies and cos/sin (with YaRN's attention temperature) of the model megatron.training.gpt
builds equal those of transformers' Llama rotary embedding at positions up to 131072; the flags
reach the model and the attention; parse_args accepts and refuses the combinations."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

# transformers is in the dev extra (pyproject.toml): a missing reference is a failure, not a skip.
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from megatron.training.arguments import (
    ArgumentValidationError,
    core_transformer_config_from_args,
    parse_args,
)
from tests.conftest import TINY_GPT_ARGS

# One layer, two heads of 64 channels: 32 frequencies, enough to cover Llama 3.1's three bands
# and YaRN's ramp.
MODEL = TINY_GPT_ARGS + ["--num-layers", "1", "--hidden-size", "128", "--num-attention-heads", "2"]
# Sampled, not materialised: forward(1, offset=p) computes one position.
POSITIONS = (0, 1, 4095, 4096, 8191, 8192, 65535, 131071, 131072)
TOLERANCE = 1e-6

# (case, our flags, transformers' rope_theta and rope_scaling)
RULES = [
    ("none_larger_base", ["--position-embedding-type", "rope", "--rotary-base", "1000000"],
     1e6, None),
    ("linear", ["--position-embedding-type", "rope",
                "--rotary-seq-len-interpolation-factor", "4"],
     10000.0, {"rope_type": "linear", "factor": 4.0}),
    ("llama3", ["--position-embedding-type", "rope", "--rotary-base", "500000",
                "--use-rope-scaling", "--rope-scaling-factor", "8"],
     500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    ("yarn", ["--position-embedding-type", "yarn", "--rotary-base", "150000",
              "--rotary-scaling-factor", "32", "--yarn-original-max-position-embeddings", "4096"],
     150000.0, {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}),
    ("yarn_mscale_fractional_range",
     ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "16",
      "--yarn-original-max-position-embeddings", "8192", "--yarn-beta-fast", "16",
      "--yarn-beta-slow", "2", "--mscale", "0.8", "--mscale-all-dim", "0.4",
      "--no-yarn-correction-range-round-to-int"],
     10000.0, {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8192,
               "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.4,
               "truncate": False}),
]


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process megatron world (CPU shims applied); torn down after the module."""
    from megatron.core import parallel_state

    from megatron.training.initialize import initialize_megatron

    initialize_megatron(parse_args(MODEL, world_size=1, cuda_available=False))
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def build_model(flags: list[str]):
    from megatron.training import gpt
    from megatron.training.tokenizer import padded_vocab_size

    args = parse_args(MODEL + flags, world_size=1, cuda_available=False)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size,
                                               args.make_vocab_size_divisible_by, 1)
    return gpt.model_provider(core_transformer_config_from_args(args), args)


def reference_rotary(theta: float, rope_scaling) -> LlamaRotaryEmbedding:
    """transformers' Llama rotary embedding (ROPE_INIT_FUNCTIONS[rope_type] inside) for our head
    size; max_position_embeddings = factor x original, as a consistent YaRN config has it."""
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64,
                         max_position_embeddings=131072, rope_theta=theta,
                         rope_scaling=dict(rope_scaling) if rope_scaling else None)
    return LlamaRotaryEmbedding(config)


def our_angles(model, position: int) -> torch.Tensor:
    """The [64] rotary angles (freqs, freqs) our model applies at ``position``, float32."""
    emb = model.rotary_pos_emb(1, offset=position)
    emb = emb[0] if isinstance(emb, tuple) else emb  # YaRN also returns its own mscale
    return emb.reshape(-1)


def our_temperature(model) -> float:
    """The factor SelfAttention multiplies cos/sin by (1.0 unless YaRN), read as it reads it."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    return _yarn_get_concentration_factor_from_config(model.config)


@pytest.mark.parametrize("case,flags,theta,rope_scaling", RULES, ids=[r[0] for r in RULES])
def test_cos_sin_equal_transformers_up_to_131072(megatron_world, case, flags, theta,
                                                 rope_scaling):
    model = build_model(flags)
    reference = reference_rotary(theta, rope_scaling)
    mscale, reference_mscale = our_temperature(model), reference.attention_scaling
    assert abs(mscale - reference_mscale) < 1e-12, (mscale, reference_mscale)
    if case.startswith("yarn"):
        assert mscale > 1.0  # the temperature is on, not silently 1

    # The frequency table each side applies (ours: the angles at position 1, which carry any
    # position scaling), turned into angles in float64 so that p x table is exact to 1e-16
    # relative and the comparison at p = 131072 measures the tables, not float32 rounding.
    table = our_angles(model, 1)[:32].double()
    reference_table = reference.inv_freq.double()
    assert torch.allclose(table, reference_table, rtol=1e-6, atol=0), (table, reference_table)
    errors64, errors32 = [], []
    for position in POSITIONS:
        angles = torch.cat([table, table]) * position
        reference_angles = torch.cat([reference_table, reference_table]) * position
        errors64.append(max((angles.cos() * mscale - reference_angles.cos() * reference_mscale)
                            .abs().max().item(),
                            (angles.sin() * mscale - reference_angles.sin() * reference_mscale)
                            .abs().max().item()))
        # The float32 cos/sin each implementation really computes at this position.
        angles32 = our_angles(model, position)
        cos32, sin32 = angles32.cos() * mscale, angles32.sin() * mscale
        ref_cos, ref_sin = reference(torch.zeros(1), torch.tensor([[position]]))
        errors32.append(max((cos32 - ref_cos.reshape(-1)).abs().max().item(),
                            (sin32 - ref_sin.reshape(-1)).abs().max().item()))
    print(f"{case}: max |cos/sin error| float64 {max(errors64):.3g}, float32 "
          f"{max(errors32):.3g}, temperature {mscale:.6f}")
    assert max(errors64) <= TOLERANCE and max(errors32) <= TOLERANCE, (errors64, errors32)


def test_llama3_case_covers_all_three_bands():
    """Llama 3.1's rule keeps short wavelengths, divides long ones by the factor and blends
    between 8192/4 and 8192: the llama3 case's 32 frequencies have all three."""
    wavelengths = 2 * torch.pi / reference_rotary(500000.0, None).inv_freq.double()
    assert (wavelengths < 2048).any() and (wavelengths > 8192).any()
    assert ((wavelengths >= 2048) & (wavelengths <= 8192)).any()


def test_yarn_temperature_reaches_the_attention(megatron_world):
    """The q and k our core attention receives equal transformers' apply_rotary_pos_emb of the
    same projections with its YaRN cos/sin (attention_scaling folded in), so q.k and the
    logits carry the temperature squared as in transformers."""
    _, flags, theta, rope_scaling = RULES[3]
    model = build_model(flags)
    attention = model.decoder.layers[0].self_attention
    captured = {}
    projections = attention.get_query_key_value_tensors

    def capture_projections(*args, **kwargs):
        captured["projected"] = projections(*args, **kwargs)
        return captured["projected"]

    attention.get_query_key_value_tensors = capture_projections
    attention.core_attention.register_forward_pre_hook(
        lambda module, args: captured.update(rotated=args[:2]))
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens, torch.arange(64).expand(2, 64), attention_mask=None)

    query, key, _ = captured["projected"]  # [s, b, heads, d]
    cos, sin = reference_rotary(theta, rope_scaling)(query, torch.arange(64)[None])
    reference = apply_rotary_pos_emb(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3),
                                     cos, sin)
    for ours, expected in zip(captured["rotated"], reference):
        torch.testing.assert_close(ours.permute(1, 2, 0, 3), expected, rtol=0, atol=1e-6)


def test_use_rope_scaling_reaches_the_model(megatron_world):
    """Same weights, same tokens: --use-rope-scaling --rope-scaling-factor 8 changes the
    logits (base 500000 puts most of the 32 frequencies in the scaled bands)."""
    plain = build_model(["--position-embedding-type", "rope", "--rotary-base", "500000"])
    scaled = build_model(["--position-embedding-type", "rope", "--rotary-base", "500000",
                          "--use-rope-scaling", "--rope-scaling-factor", "8"])
    scaled.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64).expand(2, 64)
    with torch.no_grad():
        logits_plain = plain(tokens, positions, attention_mask=None)
        logits_scaled = scaled(tokens, positions, attention_mask=None)
        logits_again = plain(tokens, positions, attention_mask=None)
    assert torch.equal(logits_plain, logits_again)
    assert (logits_plain - logits_scaled).abs().max() > 1e-4


ACCEPTED = [
    (["--position-embedding-type", "rope", "--use-rope-scaling"],
     {"rope_scaling_factor": 8.0}),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "32"],
     {"rope_scaling_factor": 32.0}),
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "2.5"],
     {"rotary_seq_len_interpolation_factor": 2.5}),
    (["--position-embedding-type", "yarn", "--rotary-scaling-factor", "32"],
     {"yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0,
      "yarn_beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
      "yarn_correction_range_round_to_int": True}),
    (["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
      "--no-yarn-correction-range-round-to-int", "--mscale", "0.707", "--mscale-all-dim", "0.707"],
     {"yarn_correction_range_round_to_int": False, "mscale": 0.707}),
]


@pytest.mark.parametrize("flags,expected", ACCEPTED)
def test_accepted_combinations(flags, expected):
    args = parse_args(MODEL + flags, world_size=1, cuda_available=False)
    assert {name: getattr(args, name) for name in expected} == expected


ROPE, YARN = ["--position-embedding-type", "rope"], ["--position-embedding-type", "yarn"]
# (case, flags, the flag the one-line error must name)
REFUSED = [
    ("llama3_without_rope", ["--use-rope-scaling"], "--use-rope-scaling"),
    ("llama3_with_yarn", YARN + ["--rotary-scaling-factor", "4", "--use-rope-scaling"],
     "--use-rope-scaling"),
    ("interpolation_without_rope", ["--rotary-seq-len-interpolation-factor", "4"],
     "--rotary-seq-len-interpolation-factor"),
    ("llama3_factor_alone", ROPE + ["--rope-scaling-factor", "8"], "--rope-scaling-factor"),
    ("two_rules", ROPE + ["--use-rope-scaling", "--rotary-seq-len-interpolation-factor", "4"],
     "--rotary-seq-len-interpolation-factor"),
    ("llama3_factor_below_one", ROPE + ["--use-rope-scaling", "--rope-scaling-factor", "0.5"],
     "--rope-scaling-factor"),
    ("interpolation_below_one", ROPE + ["--rotary-seq-len-interpolation-factor", "0.5"],
     "--rotary-seq-len-interpolation-factor"),
    ("yarn_without_factor", YARN, "--rotary-scaling-factor"),
    ("yarn_factor_below_one", YARN + ["--rotary-scaling-factor", "0.5"],
     "--rotary-scaling-factor"),
    ("yarn_partial_rotary", YARN + ["--rotary-scaling-factor", "4", "--rotary-percent", "0.5"],
     "--rotary-percent"),
    ("yarn_original_not_positive",
     YARN + ["--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "0"],
     "--yarn-original-max-position-embeddings"),
    ("mscale_without_yarn", ROPE + ["--mscale", "0.7"], "--mscale"),
    ("yarn_beta_without_yarn", ROPE + ["--yarn-beta-fast", "16"], "--yarn-beta-fast"),
    ("yarn_factor_without_yarn", ["--rotary-scaling-factor", "4"], "--rotary-scaling-factor"),
]


@pytest.mark.parametrize("case,flags,flag", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_combinations_name_the_flag(case, flags, flag):
    with pytest.raises(ArgumentValidationError) as error:
        parse_args(MODEL + flags, world_size=1, cuda_available=False)
    assert flag in str(error.value) and "\n" not in str(error.value)


def test_memo_offload_layers_apply_the_yarn_temperature(megatron_world):
    """MEMO's layers rotate q and k themselves (memo_ext/offload/layer.py); with YaRN their loss
    and gradients equal the plain layers', so the temperature is applied there too."""
    from tests.unit.memo_ext.offload.test_memo_offload import (
        build_model as build_plain, loss_and_grads, memo_run, model_args,
        worst_relative_gradient_error)

    args = model_args(["--position-embedding-type", "yarn", "--rotary-scaling-factor", "32"])
    reference_loss, reference = loss_and_grads(build_plain(args))
    loss, grads, _ = memo_run(args, "0.5")
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert worst_relative_gradient_error(grads, reference) < 1e-6
