"""SPPO in one process: the FLOPs partition, and gradients per parameter of a sequence run as
N subsequences (K/V cache, reverse-order backward, offloading, packed documents) equal to the
full sequence's."""

from __future__ import annotations

import pytest
import torch

from megatron.training.packed_documents import OFFSETS_KEY
from memo_ext.config import MemoConfigError, SPPOConfig
from memo_ext.device import CopyEngine
from memo_ext.layer_flops import LayerFlops
from memo_ext.sppo import SubsequenceOrderError, SubsequencePipeline
from memo_ext.sppo.offload import solve_alphas
from memo_ext.sppo.partition import auto_subsequences, flops_boundaries, length_boundaries
from memo_ext.storage_tracker import DeviceMemoryTracker
from tests.unit.memo_ext.offload.test_memo_offload import (
    BATCH,
    VOCAB,
    model_args,
    worst_relative_gradient_error,
)

SEQ, HIDDEN = 96, 64
MODELS = {
    "gpt_learned_gelu": ["--seq-length", str(SEQ)],
    "llama_like_rope_swiglu_gqa_rmsnorm": [
        "--seq-length", str(SEQ), "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
        "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear"],
}
GPT_7B_FLOPS = LayerFlops.of_gpt_layer(4096, 11008, 32, 32, 128, swiglu=True)


# ---------------------------------------------------------------------------- partition
@pytest.mark.parametrize("subsequences", [2, 4, 8, 16])
def test_flops_partition_equalises_causal_work(subsequences):
    seq = 1 << 20
    boundaries = flops_boundaries(seq, subsequences, GPT_7B_FLOPS, multiple_of=8)
    work = [GPT_7B_FLOPS.of_range(a, b) for a, b in zip(boundaries, boundaries[1:])]
    assert boundaries[0] == 0 and boundaries[-1] == seq
    assert all(b % 8 == 0 for b in boundaries)
    assert max(work) / min(work) < 1.001
    lengths = [b - a for a, b in zip(boundaries, boundaries[1:])]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > 1.5 * lengths[-1]


def test_length_partition_and_rounding():
    assert length_boundaries(100, 4) == [0, 25, 50, 75, 100]
    assert length_boundaries(96, 5, multiple_of=4) == [0, 16, 36, 56, 76, 96]
    tight = flops_boundaries(8, 4, LayerFlops(0.0, 1.0), multiple_of=2)
    assert tight == [0, 2, 4, 6, 8]  # every subsequence keeps at least one multiple
    with pytest.raises(ValueError, match="cannot be cut into 5"):
        length_boundaries(8, 5, multiple_of=2)


def test_auto_subsequences():
    assert auto_subsequences(1 << 20, pipeline_size=4) == 32  # 3/32 <= 10%
    assert auto_subsequences(1 << 20, pipeline_size=1) == 1
    assert auto_subsequences(16384, pipeline_size=4) == 8  # >= 2048 tokens each
    assert auto_subsequences(64, pipeline_size=2) == 1


def test_alphas_follow_bandwidth_times_next_compute():
    assert solve_alphas([100, 100, 100], [1.0, 0.5, 2.0], 100.0) == [0.5, 1.0, 0.0]


@pytest.mark.parametrize("flags, message", [
    ({"sppo_subsequences": "0"}, "must be >= 1"),
    ({"sppo_subsequences": "four"}, "not a whole number"),
    ({"sppo_offload": "1.5"}, "outside"),
    ({"sppo_offload": "some"}, "not none, auto"),
    ({"sppo_pcie_gbps": -1.0}, "positive"),
    ({"sppo_host_memory_gb": 0.0}, "--memo-sppo-host-memory-gb 0 must be a positive"),
])
def test_bad_flags_are_refused(flags, message):
    with pytest.raises(MemoConfigError, match=message):
        SPPOConfig(sppo=True, **flags).validate()


def test_sppo_flags_need_memo_sppo():
    with pytest.raises(MemoConfigError, match="--memo-sppo-subsequences 4 has no effect without"):
        SPPOConfig(sppo_subsequences="4").validate()


# ---------------------------------------------------------------------------- exactness
def build(args, sppo=None):
    from megatron.core import tensor_parallel

    from megatron.training import gpt
    from megatron.training.arguments import core_transformer_config_from_args

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = core_transformer_config_from_args(args)
    model = gpt.model_provider(config, args, sppo=sppo)
    if sppo is not None:
        sppo.attach(model)
    return model, config


def sequence():
    generator = torch.Generator().manual_seed(1)
    return {
        "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        "loss_mask": torch.ones(BATCH, SEQ),
        "position_ids": torch.arange(SEQ)[None].expand(BATCH, -1),
    }


def packed_sequence():
    """sequence()'s first sample with packed documents: bounds inside and across subsequences,
    a one-token document."""
    one = {key: value[:1] for key, value in sequence().items()}
    return {**one, OFFSETS_KEY: torch.tensor([[0, 9, 10, 40, 41, 77, SEQ]], dtype=torch.int32)}


def full_sequence_grads(args, batch=None):
    from megatron.training.packed_documents import packed_seq_params

    model, _ = build(args)
    batch = batch or sequence()
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                 packed_seq_params=packed_seq_params(batch)).sum()
    (loss / batch["loss_mask"].sum()).backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def sppo_run(args, subsequences: int, partition: str = "flops", offload: str = "none",
             engine=None, tracker=None, host_budget_bytes=None, batch=None):
    from megatron.training import gpt

    batch = batch or sequence()
    config = SPPOConfig(sppo=True, sppo_subsequences=str(subsequences), sppo_partition=partition,
                        sppo_offload=offload)
    sppo = SubsequencePipeline(
        config, seq_length=SEQ, pipeline_size=1, micro_batch_size=batch["tokens"].shape[0],
        hidden_size=HIDDEN, whole_keys=(OFFSETS_KEY,),
        layer_flops=LayerFlops.of_gpt_layer(HIDDEN, 4 * HIDDEN, 4, 4, 16, False), engine=engine,
        bandwidth_bytes_per_s=1e9, min_offload_bytes=0, host_budget_bytes=host_budget_bytes,
        **({} if tracker is None else {"host_allocation_scope": tracker.host_allocations}))
    model, config = build(args, sppo)
    # Gradients exist before the step, as in the trainer (megatron's DDP buffers), so the
    # tracker's peak is the activations' and the working set's.
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    if tracker is not None:
        tracker.register_existing([t for p in model.parameters() for t in (p, p.grad)])
    with tracker if tracker is not None else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t):
        reports = sppo.forward_backward(
            forward_step_func=gpt.forward_step, data_iterator=iter([batch]),
            model=[model], num_microbatches=1, forward_only=False, config=config)
    loss = sum(report["lm loss"][0] for report in reports).item()
    return loss, {name: p.grad.clone() for name, p in model.named_parameters()}, sppo


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("subsequences, partition", [(1, "flops"), (2, "flops"), (3, "length"),
                                                     (5, "flops"), (8, "flops")])
def test_gradients_per_parameter_equal_the_full_sequence(megatron_world, model_name,
                                                         subsequences, partition):
    args = model_args(MODELS[model_name])
    reference_loss, reference = full_sequence_grads(args)
    loss, grads, sppo = sppo_run(args, subsequences, partition)
    assert len(sppo.boundaries) == subsequences + 1
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert set(grads) == set(reference)
    assert worst_relative_gradient_error(grads, reference) < 1e-5
    assert sppo.state.kv_cache_bytes() == 0  # dropped after the sequence


@pytest.mark.parametrize("subsequences", [3, 5])
def test_packed_documents_give_the_full_sequences_gradients(megatron_world, subsequences):
    """--reset-attention-mask under SPPO: each subsequence's tiles over the earlier ones are
    cut along the documents of the whole sequence (RoPE and GQA: the rotary table follows the
    subsequence, not the packed batch's length)."""
    args = model_args(MODELS["llama_like_rope_swiglu_gqa_rmsnorm"])
    reference_loss, reference = full_sequence_grads(args, packed_sequence())
    loss, grads, sppo = sppo_run(args, subsequences, batch=packed_sequence())
    assert len(sppo.boundaries) == subsequences + 1
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert worst_relative_gradient_error(grads, reference) < 1e-5
    # the documents change the gradients: the comparison can fail
    _, unpacked = full_sequence_grads(args, {**packed_sequence(), OFFSETS_KEY: None})
    assert worst_relative_gradient_error(unpacked, reference) > 1e-3


@pytest.mark.parametrize("offload", ["1", "0.5"])
def test_offloading_keeps_gradients_and_lowers_the_device_peak(megatron_world, offload):
    args = model_args(MODELS["llama_like_rope_swiglu_gqa_rmsnorm"])
    _, reference = full_sequence_grads(args)
    kept = DeviceMemoryTracker()
    _, _, _ = sppo_run(args, 4, tracker=kept)
    # No artificial copy delay: a link slower than the compute keeps every source alive in
    # the copy queue, and the peak would measure the queue rather than the offloading.
    with CopyEngine("cpu") as engine:
        offloaded = DeviceMemoryTracker()
        _, grads, sppo = sppo_run(args, 4, offload=offload, engine=engine, tracker=offloaded)
    assert worst_relative_gradient_error(grads, reference) < 1e-5
    assert sppo.offload_alphas() == [float(offload)] * 3 + [0.0]
    assert offloaded.stats()["peak_device_bytes"] < kept.stats()["peak_device_bytes"]


def test_host_budget_caps_what_is_offloaded(megatron_world):
    args = model_args(MODELS["gpt_learned_gelu"])
    _, reference = full_sequence_grads(args)
    with CopyEngine("cpu") as engine:
        _, _, unlimited = sppo_run(args, 4, offload="1", engine=engine)
        wanted = sum(r.offloaded_bytes for r in unlimited.offloader.after_iteration())
        budget = wanted // 3
        _, grads, capped = sppo_run(args, 4, offload="1", engine=engine,
                                    host_budget_bytes=budget)
    records = capped.offloader.after_iteration()
    offloaded = sum(r.offloaded_bytes for r in records)
    assert 0 < offloaded <= budget < wanted
    assert offloaded + sum(r.held_back_bytes for r in records) == wanted
    assert capped.offloader.host_bytes_in_use == 0  # every host copy released after backward
    assert worst_relative_gradient_error(grads, reference) < 1e-5


def test_backward_out_of_order_is_refused(megatron_world):
    args = model_args(MODELS["gpt_learned_gelu"])
    config = SPPOConfig(sppo=True, sppo_subsequences="2")
    sppo = SubsequencePipeline(config, seq_length=SEQ, pipeline_size=1, micro_batch_size=BATCH,
                               hidden_size=HIDDEN, layer_flops=LayerFlops(1.0, 0.0))
    model, _ = build(args, sppo)
    batch, losses = sequence(), []
    for index in range(2):
        sppo.state.enter(index)
        a, b = sppo.boundaries[index], sppo.boundaries[index + 1]
        losses.append(model(batch["tokens"][:, a:b], batch["position_ids"][:, a:b], None,
                            labels=batch["labels"][:, a:b]).sum())
    with pytest.raises(SubsequenceOrderError, match="reverse subsequence order"):
        losses[0].backward()
