"""The tracer's --use-megatron-fsdp (megatron.training.megatron_fsdp.wrap_fake,
memo_ext.trace.model_state's Megatron-FSDP branch): a tiny model's persistent state traced at
DP=2, per rank, against what the CPU trainer's Megatron-FSDP holds after one training step
(torchrun, 2 gloo ranks, this file run as the trainer's script): its parameter groups' buffers
(weights or their shard, fp32 main weights, main gradients), the parameters' storages and
module buffers, and Adam's exp_avg and exp_avg_sq -- one per storage (deduplicated by
data_ptr), byte for byte, for each --data-parallel-sharding-strategy.

Not compared: Adam's step counters (4 B each, not modelled, as without Megatron-FSDP) and,
with optim_grads_params, the parameters' storages the trainer holds after a step outside the
buffers (the all-gathered weights: :data:`GATHERED`), which the persistent trace leaves out.
The iteration's all-gathered weight buckets are checked to be traced per FSDP unit
(test_gathered_weights_are_traced_per_unit), not against the trainer: the CPU trainer's
allocations in an iteration are not recorded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from memo_ext.trace.request import TracedModel, TraceRequest
from tests.conftest import REPO_ROOT, run_trainer, subprocess_env

#: The real state's kinds that are not persistent state of the trace (module docstring).
STEP, GATHERED = "opt_step", "param"


def request(strategy: str, rank: int) -> TraceRequest:
    return TraceRequest(model=TracedModel(num_layers=2, hidden_size=64, num_attention_heads=4,
                                          vocab_size=512), seq_length=128, dp=2, rank=rank,
                        cuda_semantics=False, persistent_only=True, megatron_fsdp=strategy)


TRACE_SCRIPT = """
import json, sys
from megatron.training import tracing
from memo_ext.trace.request import TraceRequest
out = []
for line in sys.stdin:
    trace, _ = tracing.record(TraceRequest.from_dict(json.loads(line)))
    by = {}
    for e in trace.events:
        if e["action"] == "alloc" and e["category"] in ("parameter", "gradient", "optimizer"):
            by[e["category"]] = by.get(e["category"], 0) + e["bytes"]
    out.append(by)
print(json.dumps(out))
"""


def traced(strategy: str) -> list[dict]:
    """Ranks 0 and 1's traced persistent bytes by category, in a fresh process (the tracer
    needs a process without torch.distributed)."""
    import subprocess

    lines = "".join(json.dumps(request(strategy, rank).to_dict()) + "\n" for rank in (0, 1))
    done = subprocess.run([sys.executable, "-c", TRACE_SCRIPT], input=lines, text=True,
                          capture_output=True, cwd=REPO_ROOT, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def real(strategy: str, directory: Path) -> list[dict]:
    """Ranks 0 and 1's real bytes by kind (:func:`measure_this_rank`), from the trainer; each
    rank writes its own file (two ranks' stdout lines can interleave)."""
    run_trainer(2, [strategy, str(directory)], script=Path(__file__))
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def as_traced(real_rank: dict) -> dict:
    """The real bytes in the trace's categories (buffers and storages of parameters;
    gradients; Adam's moments), less what the trace leaves out (module docstring)."""
    return {
        "parameter": sum(real_rank.get(kind, 0) for kind in (
            "model_weight_buffer", "transpose_weight_buffer", "main_weight_buffer", "hsdp_wbuf",
            "module_buffer")),
        "gradient": sum(real_rank.get(kind, 0) for kind in ("main_grad_buffer", "hsdp_gbuf")),
        "optimizer": real_rank.get("opt_exp_avg", 0) + real_rank.get("opt_exp_avg_sq", 0),
    }


def check(strategy: str, directory: Path) -> None:
    real_ranks = real(strategy, directory)
    for rank, (trace_rank, real_rank) in enumerate(zip(traced(strategy), real_ranks)):
        assert trace_rank == as_traced(real_rank), (strategy, rank, real_rank)
        unexplained = set(real_rank) - {STEP, GATHERED, "model_weight_buffer",
                                        "transpose_weight_buffer", "main_weight_buffer",
                                        "hsdp_wbuf", "module_buffer", "main_grad_buffer",
                                        "hsdp_gbuf", "opt_exp_avg", "opt_exp_avg_sq"}
        assert not unexplained, unexplained
        if strategy != "optim_grads_params":
            assert GATHERED not in real_rank  # the parameters live in the buffers


# Slow (~20-25 s each on 2 cores: a 2-rank training and two traces); the default suite keeps
# the tracer's Megatron-FSDP case test_gathered_weights_are_traced_per_unit and the trainer's
# tests/distributed/test_megatron_fsdp.py.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_traced_state_is_the_trainers(strategy, tmp_path):
    check(strategy, tmp_path)


ITERATION_SCRIPT = """
import json, sys
from megatron.training import tracing
from memo_ext.trace.request import TraceRequest
with tracing.traced_rank(TraceRequest.from_dict(json.loads(sys.stdin.read()))) as rank:
    groups = rank.model.param_and_grad_buffer.parameter_groups
    units = [g.model_weight_buffer for g in groups if g.fsdp_unit_id is not None]
    sizes = [b.bucket_index.size * b.data.element_size() for b in units]
    trace = rank.record()
events = [[e["action"], e["bytes"], e["phase"], e["id"]] for e in trace.events]
print(json.dumps({"sizes": sizes, "events": events}))
"""


def test_gathered_weights_are_traced_per_unit():
    """optim_grads_params's ZeRO-3 all-gather: each FSDP unit's (transformer layer's) weight
    bucket, a storage megatron-core resizes to the bucket and back to 0, is an allocation of
    the bucket's bytes allocated and freed in the recorded forward, and every allocation of
    that size in the iteration (the buckets gathered ahead for the backward, the gradients'
    reduce-scatter buckets: fp32 here, the same bytes) is freed within it. The warm-up is a
    whole iteration, which leaves none behind; a forward warm-up left the backward's buckets
    allocated, counted as persistent and freed by the next iteration (3 layers, rank 0)."""
    import subprocess

    payload = request("optim_grads_params", 0).replace(persistent_only=False).with_layers(3)
    done = subprocess.run([sys.executable, "-c", ITERATION_SCRIPT],
                          input=json.dumps(payload.to_dict()), text=True, capture_output=True,
                          cwd=REPO_ROOT, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found["sizes"]) == 3
    gathered = {}
    for action, nbytes, phase, event_id in found["events"]:
        if phase != "init" and nbytes in found["sizes"]:
            gathered.setdefault(event_id, []).append((action, phase))
    assert all(len(ev) == 2 and ev[0][0] == "alloc" and ev[1][0] == "free"
               for ev in gathered.values()), gathered
    in_forward = [ev for ev in gathered.values() if ev == [("alloc", "forward"),
                                                           ("free", "forward")]]
    assert len(in_forward) == 3, gathered


def measure_this_rank(strategy: str) -> dict:
    """Build the trainer for ``request(strategy, rank)``'s flags on this gloo rank, train one
    step, and sum its Megatron-FSDP state by kind, one entry per storage (by data_ptr)."""
    import torch

    from megatron.training import tracing
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.tokenizer import padded_vocab_size
    from tests.unit.megatron.training.test_distributed_optimizer_cpu import build_trainer, train

    args = parse_args(tracing.trainer_argv(request(strategy, 0)), world_size=2,
                      cuda_available=False)
    initialize_megatron(args)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                               1)
    model, optimizer, scheduler = build_trainer(args)
    train(args, model, optimizer, scheduler, 1)
    (chunk,) = model
    seen: dict[int, tuple[str, int]] = {}

    def add(kind: str, tensor) -> None:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = tensor.untyped_storage()
        if storage.nbytes():
            seen.setdefault(storage.data_ptr(), (kind, storage.nbytes()))

    for group in chunk.param_and_grad_buffer.parameter_groups:
        for kind in ("model_weight_buffer", "transpose_weight_buffer", "main_weight_buffer",
                     "hsdp_wbuf", "main_grad_buffer", "hsdp_gbuf"):
            buffer = getattr(group, kind, None)
            if buffer is not None and getattr(buffer, "data", None) is not None:
                add(kind, buffer.data)
    for _, param in chunk.named_parameters():
        add(GATHERED, param)
    for _, buffer in chunk.named_buffers():
        add("module_buffer", buffer)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    add(f"opt_{key}", value)
    by_kind: dict[str, int] = {}
    for kind, nbytes in seen.values():
        by_kind[kind] = by_kind.get(kind, 0) + nbytes
    return by_kind


if __name__ == "__main__":  # one rank of real() under torchrun
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
    measured = measure_this_rank(sys.argv[1])
    (Path(sys.argv[2]) / f"rank{dist.get_rank()}.json").write_text(json.dumps(measured))
