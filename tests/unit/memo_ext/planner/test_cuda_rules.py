"""memo_ext.planner.cuda_rules through the recorder: each CUDA allocation rule changes a fake
recording exactly as the CUDA kernel it encodes allocates (docs/tracing.md "CUDA allocation
rules"; the evidence is bench/trace_fidelity.py against real snapshots)."""

import pytest
import torch

from memo_ext.planner.cuda_rules import CudaKernelRules, CudaTarget, MiB
from memo_ext.planner.trace import AllocationRecorder, fake_tensors

HOPPER = CudaTarget(compute_capability=(9, 0), sm_count=132, torch_version=(2, 13))
AMPERE_TORCH_24 = CudaTarget(compute_capability=(8, 0), sm_count=108, torch_version=(2, 4))
BLAS = "cuBLAS workspace (getCurrentCUDABlasHandle)"


def record(program, target=HOPPER, cuda_semantics=True):
    """Device events of ``program()`` under fake tensors: [(action, bytes, op, module)]."""
    recorder = AllocationRecorder(cuda_semantics=cuda_semantics, target=target)
    with fake_tensors(), recorder:
        program()
    return [(e["action"], e["bytes"], e["op"], e["module"]) for e in recorder.trace().events
            if e["pool"] == "device"]


def allocs(events, nbytes=None, op=None, module=None):
    return [e for e in events if e[0] == "alloc" and (nbytes is None or e[1] == nbytes)
            and (op is None or e[2] == op) and (module is None or e[3] == module)]


def test_profiles_name_the_architecture_and_sms():
    a800, h100 = CudaTarget.for_gpu("a800"), CudaTarget.for_gpu("h100")
    assert (a800.compute_capability, a800.sm_count) == ((8, 0), 108)
    assert a800.blas_workspace_bytes == 8 * MiB + 128 * 1024  # ":4096:2:16:8"
    assert h100.blas_workspace_bytes == 32 * MiB  # ":4096:8" on sm90
    assert CudaTarget.for_gpu("a800", cublas_workspace_bytes=0).blas_workspace_bytes == 0


def test_cublas_workspace_once_per_gemm_thread_and_kept():
    def program():
        weight = torch.randn(64, 32, requires_grad=True)
        x = torch.randn(8, 64)
        (x @ weight).sum().backward()
        (x @ weight).sum()  # a second forward GEMM binds no new workspace

    events = record(program)
    workspaces = allocs(events, module=BLAS)
    # forward thread at the first mm, the autograd engine's thread at its first mm
    assert [e[1] for e in workspaces] == [32 * MiB, 32 * MiB]
    assert not [e for e in events if e[0] == "free" and e[1] == 32 * MiB]
    assert allocs(record(program, AMPERE_TORCH_24), 8 * MiB + 128 * 1024, module=BLAS)
    assert not allocs(record(program, cuda_semantics=False), module=BLAS)


def test_cublaslt_workspace_per_biased_linear_before_torch_2_6_only():
    def program():
        linear = torch.nn.Linear(16, 32)
        with torch.no_grad():
            for _ in range(3):
                linear(torch.randn(4, 16))
            torch.nn.Linear(16, 1)(torch.randn(4, 16))  # n == 1: no cuBLASLt

    old = record(program, AMPERE_TORCH_24)
    lt = allocs(old, MiB)
    assert len(lt) == 3 and len([e for e in old if e[0] == "free" and e[1] == MiB]) == 3
    # first call: the Lt workspace is requested before the handle binds the cuBLAS workspace
    sizes = [e[1] for e in old if e[0] == "alloc"]
    assert sizes.index(MiB) < sizes.index(8 * MiB + 128 * 1024)
    assert not allocs(record(program, HOPPER), MiB)


def test_bmm_operand_with_zero_strides_is_copied_for_cublas():
    def expanded():
        a = torch.randn(4, 8, 16)
        b = torch.randn(16, 1).expand(16, 32)  # inner strides (1, 0)
        torch.bmm(a, b.unsqueeze(0).expand(4, 16, 32))

    def transposed():
        a = torch.randn(4, 16, 8).transpose(1, 2)  # column-major view: read in place
        torch.bmm(a, torch.randn(4, 16, 32))

    events = record(expanded)
    bmm = [e[1] for e in allocs(events, op="aten.bmm.default") if e[3] != BLAS]
    assert bmm == [4 * 8 * 32 * 4, 4 * 16 * 32 * 4]  # the output, then b's contiguous copy
    assert ("free", 4 * 16 * 32 * 4) in [e[:2] for e in events]
    assert len(allocs(record(transposed), op="aten.bmm.default")) == 2  # output + workspace


def test_mm_operand_that_is_neither_major_order_is_copied():
    def program():
        a = torch.randn(8, 32)[:, ::2]  # strides (32, 2): not cuBLAS-readable
        a @ torch.randn(16, 4)

    events = record(program)
    assert [e[1] for e in allocs(events, op="aten.mm.default") if e[3] != BLAS] == [
        8 * 4 * 4, 8 * 16 * 4]


def test_max_backward_scatters_in_place_into_its_zeros():
    def program():
        x = torch.randn(64, 128, requires_grad=True)
        x.max(dim=1).values.sum().backward()

    size = 64 * 128 * 4
    ours = [e for e in record(program) if e[0] == "alloc" and e[1] == size]
    cpu = [e for e in record(program, cuda_semantics=False) if e[0] == "alloc" and e[1] == size]
    # the input, then one gradient block: zeros, scattered into in place, which AccumulateGrad
    # keeps as x.grad (the CPU recording: zeros and scatter's copy of them)
    assert len(ours) == 2 and len(cpu) == 3
    assert ours[1][2] == "aten.new_zeros.default"


def test_mse_loss_reduction_allocates_the_elementwise_loss():
    def program():
        torch.nn.functional.mse_loss(torch.randn(64, 3), torch.randn(64, 3))

    events = record(program)
    loss = allocs(events, op="aten.mse_loss.default")
    assert [e[1] for e in loss] == [4, 64 * 3 * 4]
    assert ("free", 64 * 3 * 4, None, None) in [(a, b, None, None) for a, b, _, _ in events]


def test_rules_are_off_without_cuda_semantics():
    assert AllocationRecorder(cuda_semantics=False).rules is None
    assert isinstance(AllocationRecorder(target=HOPPER).rules, CudaKernelRules)


def test_steady_state_adds_the_workspaces_not_bound_yet():
    rules = CudaKernelRules(HOPPER)
    x = torch.randn(4, 4)
    assert [w.nbytes for w in rules.workspaces(torch.ops.aten.mm.default, (x, x), {}, x,
                                               in_backward=False)] == [32 * MiB]
    # the trace's warm-up ran a forward only: the autograd thread's workspace is still missing
    assert [(w.nbytes, w.persistent) for w in rules.steady_state_workspaces()] == [
        (32 * MiB, True)]
    assert rules.steady_state_workspaces() == []


@pytest.mark.parametrize("name", ["a100-40gb", "a100-80gb", "a800", "h100", "h200"])
def test_every_profile_has_a_target(name):
    target = CudaTarget.for_gpu(name)
    assert target.sm_count > 0 and target.compute_capability >= (8, 0)


def test_estimator_holds_reduction_scratch_at_its_larger_traced_size():
    from memo_ext.estimate.memory import LinearTrace
    from memo_ext.planner.cuda_rules import REDUCTION_SCRATCH
    from memo_ext.planner.trace import Trace

    def trace(seq, activation, scratch):
        base = {"stream": 0, "layer": 0, "phase": "backward", "microbatch": 0, "pool": "device",
                "op": "aten.sum.dim_IntList"}
        events = [{**base, "id": 0, "action": "alloc", "bytes": activation,
                   "category": "activation", "module": "decoder.layers.0"},
                  {**base, "id": 1, "action": "alloc", "bytes": scratch,
                   "category": "workspace", "module": REDUCTION_SCRATCH},
                  {**base, "id": 1, "action": "free", "bytes": scratch,
                   "category": "workspace", "module": REDUCTION_SCRATCH}]
        return Trace(header={"model": {"seq_length": seq}}, events=events)

    line = LinearTrace.from_traces(trace(1000, 4000, 128 * MiB), trace(2000, 8000, 256 * MiB))
    far = line.at(14000).events
    assert [e["bytes"] for e in far] == [56000, 256 * MiB, 256 * MiB]
    # a shorter trace whose reduction still fits one block per output: no scratch at all
    no_scratch = trace(1000, 4000, 0)
    no_scratch.events[1:] = []
    line = LinearTrace.from_traces(no_scratch, trace(2000, 8000, 256 * MiB))
    assert [e["bytes"] for e in line.at(3000).events] == [12000, 256 * MiB, 256 * MiB]


def test_embedding_backward_index_put_takes_the_sort_kernels_temporaries():
    def program():
        table = torch.randn(100, 8, requires_grad=True)
        tokens = torch.randint(0, 100, (4, 16))
        table[tokens].sum().backward()

    events = record(program)
    index = [e[1] for e in allocs(events, op="aten.index_put.default")]
    # zeros folded: the op's own requests are index_put_with_sort_kernel's temporaries only --
    # the linear index twice, the values made contiguous (sum's gradient is expanded: stride
    # 0), sorted indices, original positions, an arange and cub's byte
    assert index == [64 * 8, 64 * 8, 64 * 8 * 4, 64 * 8, 64 * 8, 64 * 8, 1]
    frees = [e[1] for e in events if e[0] == "free"]
    assert frees.count(64 * 8) >= 5 and 1 in frees
    assert not allocs(record(program, cuda_semantics=False), 1)


def test_dropout_keeps_cuda_bool_mask_and_layer_norm_fp32_statistics():
    def program():
        x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
        y = torch.nn.functional.dropout(x, 0.1, training=True)
        torch.nn.functional.layer_norm(y, (128,)).sum().backward()

    ours = record(program)
    cpu = record(program, cuda_semantics=False)
    mask = [e[1] for e in allocs(ours, op="aten.empty_like.default")]
    assert mask == [64 * 128] and [e[1] for e in allocs(cpu, op="aten.empty_like.default")] == [
        64 * 128 * 2]  # bool mask vs bf16 noise
    stats = [e[1] for e in allocs(ours, op="aten.native_layer_norm.default")]
    assert stats == [64 * 128 * 2, 64 * 4, 64 * 4]  # output bf16, mean and rstd fp32


@pytest.mark.parametrize("live", [True, False], ids=["live", "fake"])
def test_rms_norm_records_the_fused_cuda_kernel(live):
    import contextlib

    def program():
        x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(128, dtype=torch.bfloat16, requires_grad=True)
        torch.nn.functional.rms_norm(x, (128,), w, 1e-5).sum().backward()

    def ops(cuda_semantics):
        recorder = AllocationRecorder(cuda_semantics=cuda_semantics, target=HOPPER)
        with (contextlib.nullcontext() if live else fake_tensors()), recorder:
            program()
        return [(e["op"], e["bytes"]) for e in recorder.trace().events if e["action"] == "alloc"]

    fused = [o for o in ops(True) if "rms_norm" in o[0]]
    # output bf16 and rstd fp32 [64, 1]; backward: grad input bf16 and grad weight
    assert fused == [("aten._fused_rms_norm.default", 64 * 128 * 2),
                     ("aten._fused_rms_norm.default", 64 * 4),
                     ("aten._fused_rms_norm_backward.default", 64 * 128 * 2),
                     ("aten._fused_rms_norm_backward.default", 128 * 2)]
    composite = ops(False)
    assert not [o for o in composite if "rms_norm" in o[0]]
    assert not CudaTarget((9, 0), 132, torch_version=(2, 7)).fuses_rms_norm  # CUDA composite
    assert ("aten._to_copy.default", 64 * 128 * 4) in composite  # the CPU path's fp32 upcast
    # the registration lives only while recording
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CPU")


def test_flash_attention_tiles_record_their_kernels_requests():
    """The attention tiles on the CUDA flash kernels (memo_ext.attention.kernels states their
    requests): a 64-row tile against 4,096 keys (a short document's rows) is split 32 ways on
    132 SMs and 16 ways on 108, a long tile not at all; torch's build expands GQA's K/V, flash-
    attn does not; fp32 tiles (the explicit kernel) and undeclared workspaces record nothing."""
    from memo_ext.attention import kernels

    def program(seq_q, seq_k, dtype=torch.bfloat16):
        def run():
            q = torch.empty(seq_q, 1, 8, 128, dtype=dtype).permute(1, 2, 0, 3)
            k = torch.empty(seq_k, 1, 2, 128, dtype=dtype).permute(1, 2, 0, 3)
            with kernels.declared_workspaces():
                torch.ops.memo_attention.tile_forward(q, k, k, 0.1, False, 0.0, 0)
        return run

    def forward_requests(events):
        return [e[1] for e in allocs(events, op="memo_attention.tile_forward.default")][2:]

    expanded = 8 * 4096 * 128 * 2
    ampere = CudaTarget(compute_capability=(8, 0), sm_count=108, flash_attn=None)
    split_bytes = [(splits * 8 * 64 * 4, splits * 8 * 64 * 128 * 4) for splits in (32, 16)]
    assert forward_requests(record(program(64, 4096))) == [expanded, expanded,
                                                           *split_bytes[0], 16, 8]
    assert forward_requests(record(program(64, 4096), ampere)) == [expanded, expanded,
                                                                   *split_bytes[1], 16, 8]
    flash_attn = CudaTarget(compute_capability=(9, 0), sm_count=132, flash_attn=(2, 8))
    assert forward_requests(record(program(64, 4096), flash_attn)) == [*split_bytes[0], 16]
    long_expanded = 8 * 8192 * 128 * 2
    assert forward_requests(record(program(8192, 8192))) == [long_expanded, long_expanded, 16,
                                                             8]
    assert forward_requests(record(program(64, 4096, torch.float32))) == []
    assert forward_requests(record(lambda: torch.ops.memo_attention.tile_forward(
        *(torch.empty(1, 8, 64, 128, dtype=torch.bfloat16) for _ in range(3)), 0.1, False,
        0.0, 0))) == []
