"""What a rank holds besides activations, counted one way for every row the recommender ranks:
the traced layouts (memo_ext.estimate.layout: the tracer records these bytes, the candidate
filter assumes them) and SPPO's analytic ones (memo_ext.sppo.solver, through
memo_ext.sppo.layout_model). Rows ranked side by side must not assume different bytes.
"""

from __future__ import annotations

import functools
from typing import Optional

from memo_ext.trace.cuda_rules import CudaKernelRules, CudaTarget
from memo_ext.trace import ProcessConstants, communicators_for_layout

#: Persistent bytes per parameter of a bf16 run as the tracer builds it (megatron's defaults):
#: bf16 weights (2) and fp32 gradient buffer (4) on every rank of the model-parallel shard;
#: fp32 main weights, Adam m and v (12), sharded over DP x CP by the distributed optimizer.
WEIGHT_AND_GRAD_BYTES_PER_PARAM = 6
OPTIMIZER_BYTES_PER_PARAM = 12


def outside_allocator_bytes(tp: int, cp: int, pp: int, dp: int) -> int:
    """Device memory of a rank outside PyTorch's allocator, as a trace records it (pool
    "external"): the CUDA context and one NCCL buffer set per communicator of the layout
    (memo_ext.trace.ProcessConstants' defaults)."""
    entries = ProcessConstants().entries(communicators_for_layout(tp, cp, pp, dp))
    return sum(nbytes for _, nbytes, _ in entries)


def workspace_bytes(hardware: dict) -> int:
    """The cuBLAS workspaces a rank keeps in the allocator on the profile's GPU, one per GEMM
    thread (memo_ext.trace.cuda_rules; a trace records them as persistent)."""
    return _workspace_bytes(hardware["name"], hardware.get("hardware_file"))


@functools.lru_cache(maxsize=None)
def _workspace_bytes(name: str, hardware_file: Optional[str]) -> int:
    # Once per GPU profile: SPPO's solver asks for every layout it evaluates (1,251 times in a
    # 7B recommend), and each CudaTarget reads the profiles' file and the installed versions.
    target = CudaTarget.for_gpu(name, hardware_file)
    return sum(workspace.nbytes for workspace in CudaKernelRules(target).steady_state_workspaces())


__all__ = ["OPTIMIZER_BYTES_PER_PARAM", "WEIGHT_AND_GRAD_BYTES_PER_PARAM",
           "outside_allocator_bytes", "workspace_bytes"]
