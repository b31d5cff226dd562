"""SPPO's sequence-aware offloading (docs/sppo.md "Sequence-aware offloading").

While subsequence ``i`` runs forward, the tensors autograd saves for its backward are packed by
:class:`SubsequenceOffloader` (a ``saved_tensors_hooks`` pair): a share ``alpha_i`` of their
bytes is copied to host memory asynchronously and the device copy dropped; the rest stays. K/V
(the cache every later subsequence reads) and parameters always stay. Before subsequence ``i``'s
backward its offloaded tensors are prefetched back, so the copy overlaps the backward of
``i+1``.

Two levels, as in the paper: the unit level decides *which* tensors may go (activations owning
their storage; not K/V, not parameters, not views of something bigger), the sequence level
decides *how much* (``alpha_i``). With ``auto``, iteration 1 runs with nothing offloaded and
measures, per subsequence, the offloadable bytes ``A_i`` and the forward time ``T_i``; from
then on ``alpha_i = min(1, BW * T_{i+1} / A_i)``: what the link moves while the next
subsequence computes. The last subsequence's backward comes first, so ``alpha_{N-1} = 0``.
Host memory is a hard budget: a tensor whose copy would take the host bytes in use beyond it
stays on device (counted as held back), so the offloader never fills the node's RAM.

Why hand-written: MEMO's offload manager (memo_ext.offload) splits tensors token-wise and
recomputes the rest inside one layer; SPPO keeps the rest on device and decides per
subsequence across the whole stage, which neither it nor torch's ``save_on_cpu`` (all or
nothing, synchronous) does.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import torch

from memo_ext.device import CopyEngine, CopyEvent

#: Saved tensors smaller than this stay on device: a copy's fixed cost (launch, event, thread
#: hand-off) outweighs what it frees (norm statistics, softmax log-sum-exp rows, scalars).
MIN_OFFLOAD_BYTES = 64 * 1024

#: Iterations ``auto`` runs without offloading to measure A_i and T_i.
AUTO_MEASURING_ITERATIONS = 1


@dataclass
class _Offloaded:
    """A saved tensor living in host memory (and, once prefetched, back on device)."""

    host: torch.Tensor
    offload_event: CopyEvent
    shape: torch.Size
    stride: tuple
    dtype: torch.dtype
    device_copy: Optional[torch.Tensor] = None
    prefetch_event: Optional[CopyEvent] = None


@dataclass
class SubsequenceRecord:
    """What one subsequence's forward saved and offloaded (bytes) and how long it took (s)."""

    offloadable_bytes: int = 0
    offloaded_bytes: int = 0
    held_back_bytes: int = 0  # kept on device because the host budget was full
    forward_seconds: float = 0.0
    handles: list = field(default_factory=list)


class SubsequenceOffloader:
    """Packs the saved tensors of each subsequence's forward (see the module docstring).

    ``alpha``: a fixed share in [0, 1] for every subsequence but the last, or None for auto.
    ``is_kept(tensor)``: True for tensors that must stay on device (K/V, parameters).
    ``host_allocation_scope``: entered around host buffer allocations (telemetry counts them as
    host memory on CPU). ``host_budget_bytes``: the most host bytes in use at once (None: no
    limit).
    """

    def __init__(self, engine: CopyEngine, alpha: Optional[float], bandwidth_bytes_per_s: float,
                 is_kept: Callable[[torch.Tensor], bool],
                 host_allocation_scope: Callable[[], ContextManager] = contextlib.nullcontext,
                 min_offload_bytes: int = MIN_OFFLOAD_BYTES,
                 host_budget_bytes: Optional[int] = None):
        self.engine = engine
        self.host_budget_bytes = host_budget_bytes
        self.host_bytes_in_use = 0
        self.min_offload_bytes = min_offload_bytes
        self.fixed_alpha = alpha
        self.bandwidth = bandwidth_bytes_per_s
        self.is_kept = is_kept
        self.host_allocation_scope = host_allocation_scope
        self.alphas: Optional[list[float]] = None if alpha is None else []
        self.records: list[SubsequenceRecord] = []
        self.iterations = 0

    # ------------------------------------------------------------------ per subsequence
    def alpha_for(self, index: int, count: int) -> float:
        """The offload share of subsequence ``index`` of ``count`` (0 while auto measures)."""
        if index == count - 1:
            return 0.0
        if self.fixed_alpha is not None:
            return self.fixed_alpha
        if self.alphas is None or len(self.alphas) != count:
            return 0.0
        return self.alphas[index]

    @contextlib.contextmanager
    def forward(self, index: int, count: int):
        """Around subsequence ``index``'s forward: pack its saved tensors."""
        if index == 0:
            self.records = []
        record = SubsequenceRecord()
        self.records.append(record)
        alpha = self.alpha_for(index, count)
        # Storage key -> (what pack returned, the tensor). Holding the tensor until the
        # subsequence's forward ends keeps its storage key from being reused by a new tensor
        # (which would alias the old handle); the spec's peak counts A_i whole during its
        # forward anyway.
        by_storage: dict[int, tuple] = {}

        def pack(tensor: torch.Tensor):
            if not self._offloadable(tensor):
                return tensor
            key = tensor.untyped_storage()._cdata
            if key in by_storage:  # saved twice (e.g. by two ops): one copy
                return by_storage[key][0]
            nbytes = tensor.untyped_storage().nbytes()
            record.offloadable_bytes += nbytes
            if alpha <= 0 or record.offloaded_bytes + nbytes > alpha * record.offloadable_bytes:
                by_storage[key] = (tensor, tensor)
                return tensor
            if (self.host_budget_bytes is not None
                    and self.host_bytes_in_use + nbytes > self.host_budget_bytes):
                record.held_back_bytes += nbytes
                by_storage[key] = (tensor, tensor)
                return tensor
            with self.host_allocation_scope():
                host = self.engine.alloc_host_cached(nbytes)
            source = tensor.detach().reshape(-1).view(torch.uint8)
            handle = _Offloaded(host, self.engine.offload(host, source), tensor.shape,
                                tensor.stride(), tensor.dtype)
            record.offloaded_bytes += nbytes
            self.host_bytes_in_use += nbytes
            record.handles.append(handle)
            by_storage[key] = (handle, tensor)
            return handle

        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield
        record.forward_seconds = time.perf_counter() - start
        # Every saved tensor's hook object keeps ``pack`` (and this dict) alive until backward.
        by_storage.clear()

    def prefetch(self, index: int) -> None:
        """Before subsequence ``index``'s backward: bring its offloaded tensors back (async)."""
        if index >= len(self.records):
            return
        for handle in self.records[index].handles:
            self._prefetch(handle)

    def release(self, index: int) -> None:
        """After subsequence ``index``'s backward: drop its prefetched device copies."""
        if index < len(self.records):
            record = self.records[index]
            self.host_bytes_in_use -= sum(handle.host.numel() for handle in record.handles)
            record.handles = []

    def after_iteration(self) -> list[SubsequenceRecord]:
        """Solve auto's alpha_i once the measuring iterations are done; returns the last
        sequence's records (bytes and times per subsequence)."""
        self.iterations += 1
        records, self.records = self.records, []
        if self.fixed_alpha is None and self.iterations == AUTO_MEASURING_ITERATIONS:
            self.alphas = solve_alphas([r.offloadable_bytes for r in records],
                                       [r.forward_seconds for r in records], self.bandwidth)
        return records

    # ------------------------------------------------------------------ internals
    def _offloadable(self, tensor: torch.Tensor) -> bool:
        if tensor.device != self.engine.device or not tensor.is_contiguous():
            return False
        storage = tensor.untyped_storage()
        # A view of a bigger storage frees nothing when offloaded.
        if storage.nbytes() < self.min_offload_bytes or storage.nbytes() != tensor.nbytes:
            return False
        return not self.is_kept(tensor)

    def _prefetch(self, handle: _Offloaded) -> None:
        if handle.device_copy is None:
            handle.device_copy = self.engine.alloc_device(handle.host.numel())
            handle.prefetch_event = self.engine.prefetch(handle.device_copy, handle.host,
                                                         after=handle.offload_event)

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        self._prefetch(packed)
        self.engine.wait(packed.prefetch_event)
        return packed.device_copy.view(packed.dtype).as_strided(packed.shape, packed.stride)


def solve_alphas(offloadable_bytes: list[int], forward_seconds: list[float],
                 bandwidth_bytes_per_s: float) -> list[float]:
    """alpha_i = min(1, BW * T_{i+1} / A_i); 0 for the last subsequence (docs/sppo.md)."""
    count = len(offloadable_bytes)
    alphas = []
    for i in range(count):
        if i == count - 1 or offloadable_bytes[i] == 0:
            alphas.append(0.0)
        else:
            alphas.append(min(1.0, bandwidth_bytes_per_s * forward_seconds[i + 1]
                              / offloadable_bytes[i]))
    return alphas
