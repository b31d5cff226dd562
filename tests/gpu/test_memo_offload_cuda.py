"""MEMO on CUDA: three streams, pinned host slots, events. Same check as the CPU unit test:
gradients of the MEMO layer equal the plain layer's. Skipped without CUDA (never run on the
project's CPU machines: not verified here)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def cuda_world():
    from tests.conftest import initialized_megatron

    yield from initialized_megatron(cuda_available=True)


@pytest.mark.parametrize("alpha,buffers,checkpoint_layers",
                         [("0", 2, "0"), ("0.5", 2, "0"), ("1", 2, "0"), ("0.25", 1, "2")])
def test_memo_gradients_match_on_cuda(cuda_world, alpha, buffers, checkpoint_layers):
    from memo_ext.config import OffloadConfig
    from memo_ext.device import CopyEngine
    from memo_ext.offload import MemoOffload
    from tests.unit.memo_ext.offload import test_memo_offload as cpu_test

    args = cpu_test.model_args([])
    reference_model = cpu_test.build_model(args).cuda()
    with CopyEngine(torch.device("cuda", torch.cuda.current_device())) as engine:
        config = OffloadConfig(offload=True, alpha=alpha, offload_buffers=buffers,
                               checkpoint_layers=checkpoint_layers)
        memo = MemoOffload(config, engine, cpu_test.NUM_LAYERS,
                           1, cpu_test.SHAPE, cpu_test.HOST_BYTES, cpu_test.BANDWIDTH,
                           position_wise_share=cpu_test.SHARE)
        assert engine.alloc_host(16).is_pinned()
        memo_model = cpu_test.build_model(args, memo).cuda()
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cpu_test.VOCAB, (cpu_test.BATCH, cpu_test.SEQ), generator=generator).cuda()
        labels = torch.randint(0, cpu_test.VOCAB, (cpu_test.BATCH, cpu_test.SEQ), generator=generator).cuda()
        positions = torch.arange(cpu_test.SEQ, device="cuda")[None].expand(cpu_test.BATCH, -1)
        grads = []
        for model in (reference_model, memo_model):
            model(tokens, positions, None, labels=labels).sum().backward()
            grads.append({n: p.grad.float() for n, p in model.named_parameters()})
        torch.cuda.synchronize()
        assert cpu_test.worst_relative_gradient_error(grads[1], grads[0]) < 1e-5
