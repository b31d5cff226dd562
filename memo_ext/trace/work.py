"""The work one traced iteration does, counted op by op while it is traced: the input of the
estimator's cost model (memo_ext.estimate.cost).

Per phase (forward, recompute, backward, optimizer):

* ``gemm_flops``: matrix multiplications, by ``torch.utils.flop_counter``'s formulas (the same
  registry ``FlopCounterMode`` uses; it works on fake tensors since it needs shapes only).
* ``attention_flops``: the attention tile ops (memo_ext.attention.kernels), which the registry
  does not know. Counted exactly for the (query, key) pairs each tile computes (a causal tile
  s_q(s_q+1)/2, another s_q·s_k); 4·d FLOPs per pair and head forward, 10·d backward (flash
  attention's backward recomputes the scores: five GEMMs).
* ``memory_bytes``: bytes read and written by every other op that computes something (not
  views, not factories that only allocate): input plus output bytes. On a GPU these ops are
  bandwidth-bound, so their time is bytes over HBM bandwidth.
* ``d2h_bytes``/``h2d_bytes``: copies into/out of host storages (MEMO's offload and prefetch).
* ``collectives``: bytes per (collective, group ranks) as the fake process group sees them:
  all-gather output bytes, reduce-scatter input bytes, all-reduce bytes.

Hand-written because FlopCounterMode is a dispatch mode of its own: stacking it under the
allocation recorder would dispatch every op twice (the trace's cost is dispatch), and it has no
notion of phases, custom attention ops, memory traffic or collectives. The FLOP formulas
themselves are torch's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.flop_counter import flop_registry

from memo_ext.attention.kernels import TILE_BACKWARD_OP, TILE_FORWARD_OP

#: Ops that allocate without reading or writing data (or touch no data at all).
#: ``_unsafe_view`` is a view that autograd does not track (matmul of a 3-D input folds and
#: unfolds its batch with it): it moves nothing, though ``is_view`` says no.
_NO_TRAFFIC = frozenset({
    "aten._unsafe_view.default",
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
    "aten.new_empty.default", "aten.new_empty_strided.default", "aten._local_scalar_dense.default",
    "prim.device.default", "aten.lift_fresh.default", "aten.detach.default",
    "aten.alias.default", "aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset",
    "aten.resize_.default", "aten.record_stream.default",
})

#: c10d op -> (collective name, index of the tensor whose bytes define the transfer).
_COLLECTIVES = {
    "c10d._allgather_base_.default": ("all_gather", 0),        # output
    "c10d.allgather_.default": ("all_gather", 0),
    "c10d.allgather_into_tensor_coalesced_.default": ("all_gather", 0),
    "c10d._reduce_scatter_base_.default": ("reduce_scatter", 1),  # input
    "c10d.reduce_scatter_.default": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_.default": ("reduce_scatter", 1),
    "c10d.allreduce_.default": ("all_reduce", 0),
    "c10d.allreduce_coalesced_.default": ("all_reduce", 0),
    "c10d.broadcast_.default": ("broadcast", 0),
    "c10d.send.default": ("send", 0),
    "c10d.recv_.default": ("recv", 0),
}

#: FLOPs per (query, key) pair per head per head-dimension unit: QK^T and PV forward; the
#: backward recomputes QK^T and does dV, dP, dQ, dK.
ATTENTION_FORWARD_FLOPS_PER_PAIR_DIM = 4
ATTENTION_BACKWARD_FLOPS_PER_PAIR_DIM = 10

PHASE_FIELDS = ("gemm_flops", "attention_flops", "memory_bytes", "d2h_bytes", "h2d_bytes")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def attention_flops(name: str, args: tuple) -> int:
    """FLOPs of one attention tile op call ([b, heads, s, d] q, [b, groups, s, d] k)."""
    if name == TILE_BACKWARD_OP:  # (dout, q, k, v, out, lse, scale, causal, ...)
        q, k, causal = args[1], args[2], args[7]
        per_pair = ATTENTION_BACKWARD_FLOPS_PER_PAIR_DIM
    else:  # (q, k, v, scale, causal, ...)
        q, k, causal = args[0], args[1], args[4]
        per_pair = ATTENTION_FORWARD_FLOPS_PER_PAIR_DIM
    batch, heads, seq_q, dim = q.shape
    pairs = seq_q * (seq_q + 1) // 2 if causal else seq_q * k.shape[2]
    return per_pair * batch * heads * dim * pairs


def _group_ranks(args: tuple) -> Optional[list[int]]:
    from torch._C._distributed_c10d import ProcessGroup

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                group = ProcessGroup.unbox(arg)
            except RuntimeError:  # a ReduceOp or another c10d class
                continue
            return dist.get_process_group_ranks(group)
    return None


class WorkCounter:
    """Accumulates the work of ops by phase (see the module docstring), in total and per
    transformer layer (the symbolic traces of memo_ext.estimate.symbolic repeat one layer's
    work). Plain data out: :meth:`as_dict`."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, int]] = {}
        self.collectives: dict[tuple[str, str, tuple], list[int]] = {}
        self.layers: dict[int, "WorkCounter"] = {}

    def reset(self) -> None:
        self.phases.clear()
        self.collectives.clear()
        self.layers.clear()

    def _add(self, phase: str, layer: Optional[int], field: str, amount: int) -> None:
        for counter in self._counters(layer):
            totals = counter.phases.get(phase)
            if totals is None:
                totals = counter.phases[phase] = dict.fromkeys(PHASE_FIELDS, 0)
            totals[field] += amount

    def _counters(self, layer: Optional[int]) -> tuple["WorkCounter", ...]:
        if layer is None:
            return (self,)
        if layer not in self.layers:
            self.layers[layer] = WorkCounter()
        return self, self.layers[layer]

    def count(self, phase: str, func, args: tuple, kwargs: dict, out,
              is_host: callable, layer: Optional[int] = None) -> None:
        """Add one op, run by transformer layer ``layer`` (None: outside the layers).
        ``is_host(tensor)`` tells whether a tensor lives in host memory."""
        name = str(func)
        if name in _NO_TRAFFIC:
            return
        collective = _COLLECTIVES.get(name)
        if collective is not None:
            kind, index = collective
            tensors = list(_tensors(args[index]))
            ranks = _group_ranks(args)
            if tensors and ranks is not None:
                key = (phase, kind, tuple(ranks))
                for counter in self._counters(layer):
                    entry = counter.collectives.setdefault(key, [0, 0])
                    entry[0] += sum(_nbytes(t) for t in tensors)
                    entry[1] += 1
            return
        if name in (TILE_FORWARD_OP, TILE_BACKWARD_OP):
            self._add(phase, layer, "attention_flops", attention_flops(name, args))
            return
        packet = func.overloadpacket
        if packet in flop_registry:
            self._add(phase, layer, "gemm_flops",
                      int(flop_registry[packet](*args, **kwargs, out_val=out)))
            return
        if func.is_view:
            return
        if packet is torch.ops.aten.copy_:
            dst, src = args[0], args[1]
            if is_host(dst) and not is_host(src):
                self._add(phase, layer, "d2h_bytes", _nbytes(dst))
                return
            if is_host(src) and not is_host(dst):
                self._add(phase, layer, "h2d_bytes", _nbytes(dst))
                return
        seen = set()
        moved = 0
        for tensor in (*_tensors((args, kwargs)), *_tensors(out)):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                moved += _nbytes(tensor)
        self._add(phase, layer, "memory_bytes", moved)

    def snapshot(self) -> "WorkCounter":
        """A copy of the counts so far (for :meth:`add_since`)."""
        copy = WorkCounter()
        copy.phases = {phase: dict(totals) for phase, totals in self.phases.items()}
        copy.collectives = {key: list(entry) for key, entry in self.collectives.items()}
        copy.layers = {layer: counter.snapshot() for layer, counter in self.layers.items()}
        return copy

    def add_since(self, before: "WorkCounter", times: int) -> None:
        """Count what was counted since ``before`` (a :meth:`snapshot`) ``times`` more times
        (memo_ext.trace.tile_copies: the copied tiles' work)."""
        for phase, totals in self.phases.items():
            earlier = before.phases.get(phase, {})
            for field, value in totals.items():
                totals[field] += times * (value - earlier.get(field, 0))
        for key, entry in self.collectives.items():
            earlier = before.collectives.get(key, [0, 0])
            entry[0] += times * (entry[0] - earlier[0])
            entry[1] += times * (entry[1] - earlier[1])
        for layer, counter in self.layers.items():
            counter.add_since(before.layers.get(layer, WorkCounter()), times)

    def as_dict(self) -> dict:
        """{"phases": {phase: {field: int}}, "collectives": [{phase, op, ranks, bytes, calls}],
        "layers": {layer: {"phases": ..., "collectives": ...}}} (layers only in the total)."""
        totals = {
            "phases": {phase: dict(totals) for phase, totals in self.phases.items()},
            "collectives": [
                {"phase": phase, "op": kind, "ranks": list(ranks), "bytes": nbytes,
                 "calls": calls}
                for (phase, kind, ranks), (nbytes, calls) in sorted(self.collectives.items())],
        }
        if self.layers:
            totals["layers"] = {str(layer): counter.as_dict()
                                for layer, counter in sorted(self.layers.items())}
        return totals
