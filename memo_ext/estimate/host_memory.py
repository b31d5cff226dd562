"""Host memory of one node as MEMO's trainer uses it (docs/estimate.md "Host memory").

A node's host memory holds, as separate named terms (:class:`NodeHostMemory`):

``offload_arena``
    Every local rank's host slots, each rank its own stage's: the slots a trace records in
    pool "host" (memo_ext.trace), i.e. what MEMO's offload allocates at the traced
    alpha, checkpoint-offloaded layers and fp8 choice, one slot per (offloaded layer,
    micro-batch in flight). On CUDA each slot is mapped at its own size and page-locked
    (memo_ext.device, ``CopyEngine.alloc_host``), so it takes its bytes rounded up to whole
    pages (memo_ext.host_pages). On CPU a slot is an ordinary tensor of its bytes. Ranks
    differ by pipeline stage (1F1B keeps ``min(PP - s, m)`` micro-batches in flight on stage
    s; :func:`stage_of_rank` follows megatron's rank order, PP outermost); DP replicas and
    TP/CP ranks of a stage each hold their own slots. Nothing is held beyond the live slots:
    when ``--memo-alpha auto`` raises alpha after its alpha-0 measuring iterations, the pool
    drops those slots (``HostSlotPool.reset``), and a dropped slot is unregistered and
    unmapped, its pages back with the OS, before the larger ones are allocated.
``optimizer_offload``
    Every local rank's host tensors of Megatron-LM's optimizer CPU offload
    (--optimizer-cpu-offload, megatron-core's HybridDeviceOptimizer): for each parameter shard
    it offloads, an fp32 copy, an fp32 gradient copy, Adam's exp_avg and exp_avg_sq and a 4 B
    step counter, as a trace records them in pool "host", category "optimizer"
    (memo_ext.trace.model_state.allocate_offloaded_optimizer_states; which shards, the
    trainer's own optimizer decides: megatron.training.optimizer_offload). Each rank its own:
    the distributed optimizer's shards differ by data-parallel rank (the last holds the
    buckets' padding), so the estimator traces each data-parallel rank of a node
    (memo_ext.estimate.layout.model). On CUDA the tensors megatron-core pins -- the gradient
    copies unless --no-pin-cpu-grads, and an fp32 parameter's host copy -- come from PyTorch's
    pinned ``CachingHostAllocator`` and take a power-of-two block each
    (:func:`pinned_block_bytes`); the others are pageable, their bytes. On CPU every tensor
    is its bytes. Not counted: the page-locked 16-bit copy each offloaded 16-bit shard is
    cloned through when the optimizer is built (``.cpu().pin_memory()`` then ``.float()``),
    freed at once into that allocator's cache, which keeps it (at most one block per size
    class at a time: under twice the largest).
``process_resident``
    Per process: the CUDA context, CUDA libraries and PyTorch. ``CUDA_PROCESS_RESIDENT_BYTES``:
    2,056,600 kB maximum RSS of a process that initialised CUDA and created one tensor
    (pytorch/pytorch#113326: PyTorch 2.2, CUDA 11.8), against 322,040 kB for ``import torch``
    alone. Megatron, NCCL's host buffers and Python objects come on top; not measured here.
``data_loader``
    Per rank: the micro-batch the loader hands over (tokens, labels, position ids int64 and
    the loss mask fp32: ``BATCH_BYTES_PER_TOKEN`` per token), one plus ``prefetch_factor``
    per worker (the trainer's ``--num-workers`` defaults to 0, megatron/training/data.py) and
    each worker process's own resident memory (``worker_bytes``, not measured: 0 unless given).
    The dataset's index is mapped from disk (page cache, reclaimable) and not counted.
``os_reserved``
    The kernel's page map: one 64-byte ``struct page`` per 4 KiB page on x86-64, 1/64 of the
    installed memory, which the kernel takes at boot (it is not in MemTotal); a node's
    "2 TB" is installed memory.

:func:`node_host_memory` sums them for the worst node of a layout; the estimator's
:class:`memo_ext.estimate.layout.Prediction` calls :func:`prediction_host_memory`.
:func:`memo_paper_host_limit` is the arithmetic of docs/estimate.md's out-of-host-memory case.
It alone keeps PyTorch's pinned ``CachingHostAllocator`` (:func:`pinned_block_bytes`): the
published MEMO system is modelled as allocating its slots there, which our trainer no longer
does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from memo_ext.host_pages import page_locked_bytes

GiB = 1 << 30

#: Host RSS of one CUDA process: context, libraries, PyTorch (pytorch/pytorch#113326).
CUDA_PROCESS_RESIDENT_BYTES = 2_056_600 * 1024
#: A micro-batch from the data loader: tokens, labels, position ids (int64), loss mask (fp32).
BATCH_BYTES_PER_TOKEN = 3 * 8 + 4
#: torch.utils.data.DataLoader's default batches prefetched per worker.
DEFAULT_PREFETCH_FACTOR = 2
#: The kernel's page map: sizeof(struct page) / page size on x86-64.
KERNEL_PAGE_MAP_FRACTION = 64 / 4096

TERMS = ("offload_arena", "optimizer_offload", "process_resident", "data_loader", "os_reserved")
SOURCES = {
    "offload_arena": "trace pool 'host' at the traced alpha; CUDA: each slot page-locked at its "
                     "own size, whole 4 KiB pages (memo_ext.device alloc_host)",
    "optimizer_offload": "trace pool 'host', category 'optimizer', each local rank's own: "
                         "--optimizer-cpu-offload's host copies, gradients, Adam states; CUDA: "
                         "pinned ones in power-of-two blocks (PyTorch's CachingHostAllocator)",
    "process_resident": "CUDA context + libraries + PyTorch per process, 2.06 GB max RSS "
                        "(pytorch/pytorch#113326)",
    "data_loader": f"{BATCH_BYTES_PER_TOKEN} B per token per micro-batch held, workers' RSS if "
                   "given",
    "os_reserved": "kernel page map, 64 B struct page per 4 KiB page (1/64 of installed memory)",
}


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes a block of PyTorch's pinned ``CachingHostAllocator`` takes for a request of
    ``nbytes``: the next power of two (aten/src/ATen/core/CachingHostAllocator.h, ``allocate``:
    ``roundSize = c10::llvm::PowerOf2Ceil(size)``; read at pytorch/pytorch
    04456333a3945434205e77ea1e604a5b51684795). For :func:`memo_paper_host_limit` only: the
    published MEMO system's slots; ours are page-locked at their own size."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return 0 if nbytes == 0 else 1 << (int(nbytes) - 1).bit_length()


def host_slot_bytes(trace) -> list[int]:
    """The sizes of MEMO's slots (the host-pool allocations but the optimizer's) live at their
    peak in ``trace`` (a memo_ext.trace.Trace), in allocation order."""
    from memo_ext.trace.format import OPTIMIZER, POOL_HOST

    live: dict = {}
    total = peak = 0
    at_peak: list[int] = []
    for event in trace.events:
        if event["pool"] != POOL_HOST or event.get("category") == OPTIMIZER:
            continue
        if event["action"] == "alloc":
            live[event["id"]] = int(event["bytes"])
            total += int(event["bytes"])
            if total > peak:
                peak, at_peak = total, list(live.values())
        else:
            total -= live.pop(event["id"], 0)
    return at_peak


def host_optimizer_tensors(trace) -> tuple[tuple[int, bool], ...]:
    """(bytes, pinned on CUDA) of each host tensor of --optimizer-cpu-offload in ``trace``
    (pool "host", category "optimizer"; persistent: allocated once, never freed)."""
    from memo_ext.trace.format import OPTIMIZER, POOL_HOST
    from memo_ext.trace.model_state import PINNED_MARK

    return tuple((int(event["bytes"]), (event.get("module") or "").endswith(PINNED_MARK))
                 for event in trace.events
                 if event["action"] == "alloc" and event["pool"] == POOL_HOST
                 and event.get("category") == OPTIMIZER)


def optimizer_host_bytes(tensors: Iterable[tuple[int, bool]], page_locked: bool) -> int:
    """Host bytes of :func:`host_optimizer_tensors`' tensors: a pinned one in its power-of-two
    block when ``page_locked`` (CUDA), else each its bytes."""
    return sum(pinned_block_bytes(nbytes) if pinned and page_locked else nbytes
               for nbytes, pinned in tensors)


@dataclass(frozen=True)
class OptimizerHostTensors:
    """Each rank's :func:`host_optimizer_tensors`, from the traces of some global ranks
    (``by_rank``). A rank not traced takes its tensor-parallel peer's (TP shards are alike),
    else its stage's first rank's."""

    by_rank: dict
    tp: int
    cp: int
    dp: int

    def tensors(self, rank: int) -> tuple[tuple[int, bool], ...]:
        for peer in (rank, rank - rank % self.tp,
                     stage_of_rank(rank, self.tp, self.cp, self.dp) * self.tp * self.cp * self.dp):
            if peer in self.by_rank:
                return self.by_rank[peer]
        raise KeyError(f"no traced rank stands for rank {rank}")


def arena_bytes(slots: Iterable[int], page_locked: bool) -> int:
    """Host bytes of ``slots``: each in whole pages when ``page_locked`` (CUDA)."""
    return sum(page_locked_bytes(int(s)) if page_locked else int(s) for s in slots)


@dataclass(frozen=True)
class StageSlots:
    """A traced pipeline stage's host slots (bytes each) and its micro-batches in flight."""

    index: int
    microbatches_in_flight: int
    slots: tuple[int, ...]


def stage_of_rank(rank: int, tp: int, cp: int, dp: int) -> int:
    """Pipeline stage of global ``rank`` in megatron's order (TP, CP, DP inside PP)."""
    return rank // (tp * cp * dp)


def stage_arena(stage: int, traced: dict[int, StageSlots], pp: int, page_locked: bool) -> int:
    """One rank's slot bytes on ``stage``: its own trace's, else (a middle stage) stage 0's
    slots for ``min(PP - s, k0)`` micro-batches in flight instead of k0 (every offloaded layer
    holds one equal slot per micro-batch in flight; with k0 = 1 all stages hold stage 0's)."""
    if stage in traced:
        return arena_bytes(traced[stage].slots, page_locked)
    first = traced[0]
    k0 = first.microbatches_in_flight
    k = min(pp - stage, k0)
    return arena_bytes(first.slots, page_locked) * k // k0


@dataclass
class NodeHostMemory:
    """The worst node's host bytes, by term (:data:`TERMS`), and each local rank's arena."""

    node: int
    ranks: list[int]
    arena_per_rank: list[int]
    terms: dict[str, int]
    capacity_bytes: Optional[int] = None
    page_locked: bool = True
    sources: dict[str, str] = field(default_factory=lambda: dict(SOURCES))

    @property
    def total_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def arena_bytes(self) -> int:
        return self.terms["offload_arena"]

    @property
    def fits(self) -> bool:
        return self.capacity_bytes is None or self.total_bytes <= self.capacity_bytes

    def describe(self) -> str:
        """One line: each term in GB and the total against the capacity."""
        parts = ", ".join(f"{name} {value / 1e9:.1f}" for name, value in self.terms.items()
                          if value)
        capacity = ("" if self.capacity_bytes is None
                    else f" of {self.capacity_bytes / 1e9:.0f} GB")
        return (f"node {self.node} ({len(self.ranks)} ranks): {self.total_bytes / 1e9:.1f} GB"
                f"{capacity} = {parts or 'nothing'} (GB)")


def node_host_memory(*, tp: int, cp: int, pp: int, dp: int, stages: Sequence[StageSlots],
                     ranks_per_node: int, seq: int, micro_batch: int = 1,
                     page_locked: bool = True,
                     capacity_bytes: Optional[int] = None,
                     process_bytes: Optional[int] = None, num_workers: int = 0,
                     prefetch_factor: int = DEFAULT_PREFETCH_FACTOR, worker_bytes: int = 0,
                     os_reserved_bytes: Optional[int] = None,
                     optimizer_tensors: Optional[Callable[[int], Sequence[tuple[int, bool]]]]
                     = None) -> NodeHostMemory:
    """Host bytes of the worst node of a layout (the node whose terms sum highest).

    ``stages``: the traced stages (stage 0 always; others as traced). ``page_locked``: a CUDA
    node, whose slots are page-locked in whole pages (False on CPU). ``process_bytes``:
    per-process resident memory (default: CUDA_PROCESS_RESIDENT_BYTES on CUDA, else 0: on CPU
    the process is the device too and is not a host term). ``os_reserved_bytes``: default the
    kernel's page map of ``capacity_bytes`` on CUDA (a GPU node's installed memory; 0 on CPU,
    whose capacity is the machine's page count, and without a capacity).
    ``optimizer_tensors(rank)``: a global rank's host tensors of --optimizer-cpu-offload
    (:func:`host_optimizer_tensors`; none without)."""
    traced = {stage.index: stage for stage in stages}
    if 0 not in traced:
        raise ValueError("node_host_memory needs stage 0's slots")
    gpus = tp * cp * pp * dp
    per_node = max(1, min(ranks_per_node, gpus))
    if process_bytes is None:
        process_bytes = CUDA_PROCESS_RESIDENT_BYTES if page_locked else 0
    if os_reserved_bytes is None:  # a GPU node's capacity is its installed memory; the CPU
        # profile's is this machine's page count, the page map already taken
        os_reserved_bytes = 0 if capacity_bytes is None or not page_locked else \
            int(capacity_bytes * KERNEL_PAGE_MAP_FRACTION)
    batch = BATCH_BYTES_PER_TOKEN * micro_batch * seq
    loader = batch * (1 + num_workers * prefetch_factor) + num_workers * worker_bytes
    best: Optional[NodeHostMemory] = None
    for node in range(-(-gpus // per_node)):
        ranks = list(range(node * per_node, min(gpus, (node + 1) * per_node)))
        stages_of = [stage_of_rank(rank, tp, cp, dp) for rank in ranks]
        arenas = [stage_arena(s, traced, pp, page_locked) for s in stages_of]
        optimizer = 0 if optimizer_tensors is None else sum(
            optimizer_host_bytes(optimizer_tensors(rank), page_locked) for rank in ranks)
        terms = {"offload_arena": sum(arenas), "optimizer_offload": optimizer,
                 "process_resident": process_bytes * len(ranks),
                 "data_loader": loader * len(ranks), "os_reserved": os_reserved_bytes}
        candidate = NodeHostMemory(node, ranks, arenas, terms, capacity_bytes, page_locked)
        if best is None or candidate.total_bytes > best.total_bytes:
            best = candidate
    return best


def prediction_host_memory(prediction) -> NodeHostMemory:
    """The host model of a memo_ext.estimate.layout.Prediction: its traced stages' slots
    (StagePrediction.host_slots), page-locked unless the profile is the CPU's."""
    layout = prediction.layout
    stages = [StageSlots(p.stage.index, p.stage.microbatches_in_flight,
                         tuple(getattr(p, "host_slots", ()) or ()))
              for p in prediction.stages]
    if not any(stage.slots for stage in stages):  # no offload: no host term but the others
        stages = [StageSlots(s.index, s.microbatches_in_flight, ()) for s in stages]
    cpu = getattr(prediction, "device_type", "cuda") == "cpu"
    optimizer = getattr(prediction, "host_optimizer", None)
    return node_host_memory(tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=layout.dp,
                            stages=stages, ranks_per_node=prediction.ranks_per_node,
                            seq=prediction.seq, micro_batch=layout.micro_batch,
                            page_locked=not cpu, capacity_bytes=prediction.host_capacity_bytes,
                            optimizer_tensors=optimizer.tensors if optimizer else None)


# --------------------------------------------------------------------------------------------
# The MEMO paper's out-of-host-memory case (docs/estimate.md): 7B, 8x A800, 2048 GB per node.

@dataclass(frozen=True)
class SlotShape:
    """One MEMO slot per rank, bytes per token of the sequence: the tensors offloaded whole at
    alpha 0 (``whole``) and the alpha-split ones at alpha 1 (``other``)."""

    whole: float
    other: float
    name: str = ""

    @classmethod
    def gpt(cls, hidden: int, heads: int, model_parallel: int, attention_copies: int = 1,
            statistics: bool = True, name: str = "") -> "SlotShape":
        """A GPT layer in bf16 split over TP x CP = ``model_parallel`` ranks with sequence
        parallelism: the layer input (h per token), the attention output ``attention_copies``
        times (ours at alpha 0: once, the out-projection's input being the core attention's
        saved output; before commit db32dcc twice) and, with
        ``statistics``, the attention's fp32 log-sum-exp (one value per head and token); the
        alpha-split tensors are docs/memo.md's 14 h per token (LN1 output, q/k/v, residual, LN2
        output, FC1 and activation outputs)."""
        whole = 2 * hidden * (1 + attention_copies) / model_parallel
        if statistics:
            whole += 4 * heads / model_parallel
        return cls(whole, 2 * 14 * hidden / model_parallel, name)

    def at(self, seq: int, alpha: float = 0.0) -> int:
        return int(round(seq * (self.whole + alpha * self.other)))


def memo_paper_host_limit(shape: SlotShape, seq: int, *, layers: int = 32, ranks: int = 8,
                          capacity_bytes: int = 2048 * 10**9, all_layers: bool = False,
                          pinned: bool = True, arena_copies: int = 1,
                          process_bytes: int = 0, os_reserved_bytes: int = 0) -> dict:
    """Node host bytes of MEMO at alpha 0 on ``ranks`` ranks of one stage (the paper's 8 GPUs),
    under the candidate mechanisms of docs/estimate.md: ``all_layers`` (a slot for all n
    layers, not n - 2), ``pinned`` (power-of-two blocks of PyTorch's pinned allocator),
    ``arena_copies`` (2: the alpha-0 arena held twice, measuring slots kept in that
    allocator's cache under the LP's new ones), per-process and OS bytes. Returns the terms
    and whether they fit ``capacity_bytes``. The mechanisms are those of a system that
    allocates its slots with ``torch.empty(pin_memory=True)``, as the published MEMO is taken
    to; our trainer page-locks its slots at their own size (:func:`node_host_memory`)."""
    slots = layers if all_layers else layers - 2
    slot = shape.at(seq)
    block = pinned_block_bytes(slot) if pinned else slot
    arena = ranks * slots * block * arena_copies
    total = arena + ranks * process_bytes + os_reserved_bytes
    return {"seq": seq, "slot_bytes": slot, "block_bytes": block, "arena_bytes": arena,
            "total_bytes": total, "fits": total <= capacity_bytes}


def longest_fitting_seq(fits, step: int = 65536, maximum: int = 8 << 20) -> int:
    """Largest multiple of ``step`` up to ``maximum`` with ``fits(seq)`` (scanned: host bytes
    are not monotone in the length with power-of-two blocks and bucket changes)."""
    best = 0
    for seq in range(step, maximum + 1, step):
        if fits(seq):
            best = seq
    return best


__all__ = ["BATCH_BYTES_PER_TOKEN", "CUDA_PROCESS_RESIDENT_BYTES", "NodeHostMemory",
           "OptimizerHostTensors", "SlotShape", "StageSlots", "TERMS", "arena_bytes", "host_optimizer_tensors",
           "host_slot_bytes", "optimizer_host_bytes", "longest_fitting_seq", "memo_paper_host_limit",
           "node_host_memory", "pinned_block_bytes", "prediction_host_memory", "stage_of_rank"]
