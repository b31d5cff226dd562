"""The tracer's --optimizer-cpu-offload (megatron.training.optimizer_offload, memo_ext.trace's
allocate_offloaded_optimizer_states): a tiny model traced at --optimizer-offload-fraction 0,
0.5 and 1, the last two against megatron-core's own HybridDeviceOptimizer built and stepped
by the trainer on CPU (world of one, gloo). The traced host bytes are the host tensors the real optimizer
holds after a step, byte for byte, and the traced device states its device optimizer's; the
device bytes fall as the fraction grows. The two-rank layouts (DP=2, CP=2, TP=2+SP) are
bench/host_memory.py's rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memo_ext.trace.request import TracedModel, TraceRequest
from tests.conftest import REPO_ROOT, subprocess_env

FRACTIONS = (0.0, 0.5, 1.0)


def request(fraction: float) -> TraceRequest:
    return TraceRequest(model=TracedModel(num_layers=2, hidden_size=64, num_attention_heads=4,
                                          vocab_size=512), seq_length=128,
                        cuda_semantics=False, distributed_optimizer=True,
                        optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
                        persistent_only=True)


TRACE_SCRIPT = """
import json, sys
from megatron.training import tracing
from memo_ext.trace import POOL_HOST
from memo_ext.trace.request import TraceRequest
out = []
for line in sys.stdin:
    trace, _ = tracing.record(TraceRequest.from_dict(json.loads(line)))
    allocs = [e for e in trace.events if e["action"] == "alloc" and e["category"] == "optimizer"]
    out.append({"device": sum(e["bytes"] for e in allocs if e["pool"] != POOL_HOST),
                "host": sum(e["bytes"] for e in allocs if e["pool"] == POOL_HOST)})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def traced() -> dict[float, dict]:
    """Each fraction's traced optimizer bytes (device, host), in a fresh process: the tracer
    needs a process without torch.distributed."""
    lines = "".join(json.dumps(request(f).to_dict()) + "\n" for f in FRACTIONS)
    done = subprocess.run([sys.executable, "-c", TRACE_SCRIPT], input=lines, text=True,
                          capture_output=True, cwd=REPO_ROOT, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(FRACTIONS, json.loads(done.stdout.strip().splitlines()[-1])))


def real_optimizer_bytes(fraction: float) -> dict:
    """The trainer's optimizer for the traced configuration after one step: its host tensors
    (optimizer_offload.host_tensors, one per storage) and its device optimizer's Adam moments
    (its states also hold the step counter, 4 B, not modelled, and -- after
    HybridDeviceOptimizer's step syncs them -- ``master_param``, the parameter itself)."""
    from megatron.training import tracing
    from megatron.training.arguments import parse_args
    from megatron.training.optimizer_offload import host_tensors, hybrid_optimizer_of
    from megatron.training.tokenizer import padded_vocab_size
    from tests.unit.megatron.training.test_distributed_optimizer_cpu import build_trainer, train

    args = parse_args(tracing.trainer_argv(request(fraction)), world_size=1,
                      cuda_available=False)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                               1)
    model, optimizer, scheduler = build_trainer(args)
    train(args, model, optimizer, scheduler, 1)
    hybrid = hybrid_optimizer_of(optimizer)
    device = 0 if hybrid.gpu_optimizer is None else sum(
        value.untyped_storage().nbytes() for state in hybrid.gpu_optimizer.state.values()
        for key, value in state.items() if key in ("exp_avg", "exp_avg_sq"))
    return {"device": device,
            "host": sum(t.untyped_storage().nbytes() for t in host_tensors(hybrid))}


def test_traced_optimizer_bytes_are_the_real_optimizers(megatron_world, traced):
    # 0.5 and 1 against the real optimizer; 0 (nothing offloaded) by the ordering below
    for fraction in FRACTIONS[1:]:
        assert traced[fraction] == real_optimizer_bytes(fraction), fraction
    devices = [traced[f]["device"] for f in FRACTIONS]
    hosts = [traced[f]["host"] for f in FRACTIONS]
    assert devices[0] > devices[1] > devices[2] == 0
    assert hosts[0] == 0 < hosts[1] < hosts[2]
