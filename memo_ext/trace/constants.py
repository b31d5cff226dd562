"""Process constants: device memory a rank holds that no traced op allocates (the CUDA context,
NCCL's buffers per communicator), and which communicators a layout initialises."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memo_ext.trace.format import POOL_EXTERNAL, MiB

#: CUDA context of one process (driver state, kernel images, cuDNN/cuBLAS handles). Not an
#: allocation of PyTorch's caching allocator; typical of CUDA 12 with lazy module loading
#: (CUDA_MODULE_LOADING=LAZY, PyTorch's default since 1.13) on A100/H100: `nvidia-smi` minus
#: `torch.cuda.memory_reserved()` right after `torch.cuda.init()` reads 500-600 MiB. An
#: assumption: measure it on the target and override.
CUDA_CONTEXT_BYTES = 512 * MiB

#: NCCL's per-connection buffer for the Simple protocol (NCCL_BUFFSIZE, default 4 MiB per the
#: NCCL environment-variable documentation).
NCCL_BUFFSIZE_BYTES = 4 * MiB
#: Channels per communicator on an NVLink/NVSwitch node (NCCL picks 16-32 on H100; an assumption,
#: see NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS) and ring peers per channel (one send, one recv).
NCCL_ASSUMED_CHANNELS = 16
NCCL_RING_PEERS = 2
#: NCCL device memory per communicator this rank uses: channels x peers x NCCL_BUFFSIZE
#: (= 128 MiB). LL/LL128 buffers and proxy FIFOs are ignored. Allocated by NCCL with cudaMalloc
#: (outside PyTorch's allocator) at the communicator's first collective. An estimate: calibrate on
#: the cluster (device memory used after the first collective minus reserved bytes).
NCCL_BYTES_PER_COMMUNICATOR = NCCL_ASSUMED_CHANNELS * NCCL_RING_PEERS * NCCL_BUFFSIZE_BYTES


@dataclass(frozen=True)
class ProcessConstants:
    """Device memory a rank holds that no traced op allocates (bytes). See the module-level
    constants for each default's source and assumption. (The cuBLAS workspaces are allocated
    by the first GEMM of each thread: memo_ext.trace.cuda_rules.)"""

    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    nccl_bytes_per_communicator: int = NCCL_BYTES_PER_COMMUNICATOR

    def entries(self, communicators: Sequence[str]) -> list[tuple[str, int, str]]:
        """(name, bytes, pool) of each constant for a rank that uses ``communicators``."""
        entries = [("constant:cuda_context", self.cuda_context_bytes, POOL_EXTERNAL)]
        entries += [(f"constant:nccl:{name}", self.nccl_bytes_per_communicator, POOL_EXTERNAL)
                    for name in communicators]
        return [e for e in entries if e[1] > 0]


def communicators_for_layout(tp: int, cp: int, pp: int, dp: int) -> list[str]:
    """NCCL communicators one training step of megatron-core initialises on a rank: TP
    (sequence-parallel gathers / reduce-scatters), CP (K/V all-gather), DPxCP (gradient
    reduce-scatter or all-reduce, distributed-optimizer parameter all-gather, loss average) and
    PP (point-to-point activations). Groups of size 1 need none."""
    names = []
    if tp > 1:
        names.append("tp")
    if cp > 1:
        names.append("cp")
    if dp * cp > 1:
        names.append("dp_cp")
    if pp > 1:
        names.append("pp")
    return names
