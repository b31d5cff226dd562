"""The plan at run time: layer-phase request tables served by the C++ ``PlannedArena``.

Only requests a layer makes inside its own phase and frees there (transient tensors) are
planned; everything else (skeletal activations, the head, parameters, optimizer state) stays on
the normal allocator. Layer phases run one after another on a rank, so all of them share one
region of the arena, as large as the biggest level-1 plan.

:class:`ArenaRuntime` maps (layer, forward|backward) to its phase kind, opens the kind's table
when a request comes from a different layer phase than the previous one, and asks the arena for
the request's offset (-1: the normal allocator). It is driven

* on CUDA by torch.cuda.memory.CUDAPluggableAllocator through ``memo_arena_malloc`` /
  ``memo_arena_free`` (csrc/planned_arena.cpp), installed as the process's CUDA allocator by
  :func:`install_cuda_allocator` before the first CUDA allocation; :class:`ArenaPhaseTagger`
  opens each op's layer phase in the arena before the op allocates (one H100 run so far);
* on CPU by :class:`ArenaShadow` during training: a storage-tracking dispatch mode that sends
  every allocation of the layers to the arena as the CUDA hooks would. The tensors stay where
  PyTorch put them (no CPU allocator can be swapped in), so the shadow proves the plan matches
  the run and counts what the arena would serve;
* from a trace by :meth:`ArenaRuntime.replay` (tests, the bench).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np

from memo_ext import _C
from memo_ext.planner.plan import PHASE_GROUPS, MemoryPlan
from memo_ext.trace import POOL_DEVICE, AllocationRecorder, Trace


class ArenaRuntime:
    """The plan's layer-phase tables in one C++ arena."""

    def __init__(self, plan: MemoryPlan):
        self.arena_bytes = max((level["peak"] for level in plan.level1), default=0)
        self.arena = _C.PlannedArena(self.arena_bytes)
        self.kind_of: dict[tuple[int, str], int] = {}
        for kind, level in enumerate(plan.level1):
            table = np.array(level["table"], np.int64).reshape(-1, 2)
            requested = level.get("requested")  # absent in plans written before it was kept
            self.arena.add_kind(kind, table[:, 0].copy(), table[:, 1].copy(),
                                None if requested is None else np.array(requested, np.int64))
            for layer, group, *_ in level["phases"]:
                self.kind_of.setdefault((layer, group), kind)
        self._current: Optional[tuple[int, str]] = None
        self._paused = False
        self.outside_layers = 0

    def enter(self, layer: Optional[int], phase: Optional[str]) -> None:
        """Open the arena table of ``phase`` (a trace phase name) of ``layer`` unless it is the
        open one. Outside the layers' phases (layer or phase None) the open table is paused:
        the requests made there do not use up its positions, as in the trace the plan came
        from, where they belong to no layer phase."""
        group = PHASE_GROUPS.get(phase)
        if layer is None or group is None:
            if not self._paused:
                self.arena.pause_phase()
                self._paused = True
            return
        key = (layer, group)
        if key != self._current:
            kind = self.kind_of.get(key)
            if kind is None:
                self.arena.end_phase()
            else:
                self.arena.begin_phase(kind)
            self._current = key
        elif self._paused:
            self.arena.resume_phase()
        self._paused = False

    def close(self) -> None:
        """End the open layer phase (the iteration is over)."""
        self.arena.end_phase()
        self._current, self._paused = None, False

    def request(self, layer: Optional[int], phase: Optional[str], nbytes: int) -> int:
        """Offset for a request made in ``phase`` of ``layer`` (a trace phase name), or -1."""
        if layer is None or PHASE_GROUPS.get(phase) is None:
            self.outside_layers += 1
            return -1
        self.enter(layer, phase)
        return self.arena.allocate(int(nbytes))

    def release(self, offset: int) -> bool:
        return self.arena.release(offset)

    def stats(self) -> dict:
        return {**self.arena.stats(), "outside_layers": self.outside_layers}

    def replay(self, trace: Trace) -> dict:
        """Serve a trace's device requests as a run would; returns :meth:`stats`."""
        offsets: dict[int, int] = {}
        for event in trace.events:
            if event["pool"] != POOL_DEVICE:
                continue
            if event["action"] == "alloc":
                offset = self.request(event["layer"], event["phase"], event["bytes"])
                if offset >= 0:
                    offsets[event["id"]] = offset
            elif event["id"] in offsets:
                self.release(offsets.pop(event["id"]))
        return self.stats()


class ArenaShadow(AllocationRecorder):
    """CPU training with a plan: every device allocation asks the arena for its planned place,
    tagged by the same module hooks and autograd-node tags as the trace the plan came from
    (call :meth:`attach` on the model). No events are kept."""

    def __init__(self, runtime: ArenaRuntime, cuda_semantics: bool = False):
        super().__init__(cuda_semantics=cuda_semantics)
        self.runtime = runtime
        self._offsets: dict[int, int] = {}

    def _emit_alloc(self, token: int, nbytes: int, pool: str) -> None:
        if pool != POOL_DEVICE or nbytes == 0:  # zero bytes: no request (the recorder's rule)
            return
        phase, _module, layer = self._context()
        offset = self.runtime.request(layer, phase, nbytes)
        if offset >= 0:
            self._offsets[token] = offset

    def _emit_free(self, token: int) -> None:
        offset = self._offsets.pop(token, None)
        if offset is not None:
            self.runtime.release(offset)



class ArenaPhaseTagger(AllocationRecorder):
    """CUDA training with a plan: before each op runs, open its layer phase in the arena, so
    that the op's allocations, which reach ``memo_arena_malloc`` without passing through
    Python, find their table. Phases come from the same module hooks and autograd-node tags as
    the trace the plan came from (call :meth:`attach` on the model); nothing is recorded."""

    def __init__(self, runtime: ArenaRuntime):
        super().__init__(cuda_semantics=False)
        self.runtime = runtime

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase, _module, layer = self._context()
        self.runtime.enter(layer, phase)
        return func(*args, **(kwargs or {}))

#: Bytes of the CUDA arena's buffer before its first planned offset (one alignment unit of
#: csrc/planned_arena.cpp, so the planned tensors keep their 512-byte alignment).
ARENA_HEAD_BYTES = 512

#: Iterations --memo-plan auto runs before it traces the one it plans (see MemoPlanner).
AUTO_WARMUP_ITERATIONS = 1

#: Fields of a plan's trace header that must equal the run's for the plan to apply.
MATCHING_FIELDS = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "seq_length", "padded_vocab_size", "params_dtype"),
    "layout": ("tp", "cp", "pp", "micro_batch_size", "sequence_parallel"),
}


class MemoPlanner:
    """``--memo-plan`` for the trainer (the planner's entry point): wrap each training
    iteration in :meth:`iteration`.

    auto: the first iteration warms up (it creates buffers that later iterations reuse:
    megatron's global all-gather buffer under sequence parallelism, the optimizer's state, RoPE
    caches, so its request sequence is not the steady state's); the second runs under an
    :class:`AllocationRecorder` (the sizes of the device it runs on) and is planned (bi-level +
    single level); the plan's layer-phase tables serve every iteration from the third on.
    ``device``: on a CUDA device the tables serve the layers' real allocations (a
    :class:`CudaArena`; :func:`install_cuda_allocator` must have run before the first CUDA
    allocation), elsewhere an :class:`ArenaShadow` checks and counts them.
    PATH: a plan from tools/memo_plan.py, refused at startup (PlanFileError) when it is not a
    readable plan or was made for another model, layout or sequence length.
    """

    def __init__(self, mode: str, model_chunks: list, run_header: dict, log,
                 path: Optional[str] = None, device=None):
        from memo_ext.planner.plan import PlanFileError, read_plan

        self.mode = mode
        self.model_chunks = model_chunks
        self.run_header = run_header
        self.log = log
        self.runtime: Optional[ArenaRuntime] = None
        self.plan: Optional[MemoryPlan] = None
        self.device = device
        self.cuda_arena: Optional[CudaArena] = None
        self.iterations = 0
        if mode == "file":
            plan = read_plan(path)
            for section, names in MATCHING_FIELDS.items():
                for name in names:
                    planned = (plan.header.get(section) or {}).get(name)
                    ours = run_header[section].get(name)
                    if planned != ours:
                        raise PlanFileError(
                            f"{path}: planned for {section}.{name}={planned!r}, this run has "
                            f"{ours!r}; re-plan with tools/memo_plan.py for this run")
            self._use(plan)

    def _use(self, plan: MemoryPlan) -> None:
        self.plan = plan
        self.runtime = ArenaRuntime(plan)
        if self.device is not None and self.device.type == "cuda":
            self.cuda_arena = CudaArena(self.runtime, self.device)
        self.log(f"> MEMO plan ({plan.chosen}): iteration arena {plan.arena_bytes / 2**20:.1f} MiB"
                 f" (lower bound {plan.iteration_lower_bound / 2**20:.1f} MiB, gap "
                 f"{100 * plan.iteration_gap:.2f}%); layer arena "
                 f"{self.runtime.arena_bytes / 2**20:.1f} MiB for {len(plan.level1)} layer-phase "
                 "kinds")

    def iteration(self):
        """Context manager for one training iteration (forward, backward, optimizer step)."""
        from memo_ext.trace import FORWARD

        self.iterations += 1
        if self.runtime is None and self.iterations <= AUTO_WARMUP_ITERATIONS:
            return contextlib.nullcontext()
        if self.runtime is None:
            return _Recording(self, AllocationRecorder(cuda_semantics=False), FORWARD)
        if self.cuda_arena is not None:
            return _Recording(self, ArenaPhaseTagger(self.runtime), FORWARD)
        return _Recording(self, ArenaShadow(self.runtime), FORWARD)

    def _recorded(self, recorder: AllocationRecorder) -> None:
        from memo_ext.planner.plan import plan_trace

        if isinstance(recorder, (ArenaShadow, ArenaPhaseTagger)):
            return
        self._use(plan_trace(recorder.trace(header=dict(self.run_header))))

    def close(self) -> None:
        """Training is over: end the open layer phase and close the CUDA arena (requests go to
        the normal allocator from now on). Idempotent."""
        if self.runtime is not None:
            self.runtime.close()
        if self.cuda_arena is not None:
            self.cuda_arena.close()

    def stats_line(self) -> str:
        """What the arena served so far (empty before a plan exists)."""
        if self.runtime is None:
            return ("MEMO plan: warming up" if self.iterations <= AUTO_WARMUP_ITERATIONS
                    else "MEMO plan: tracing")
        s = self.runtime.stats()
        refused = {k: s[k] for k in ("size_mismatches", "overlaps", "beyond_plan", "unplanned",
                                     "other_stream")}
        return (f"MEMO arena: served {s['served']} layer requests ({s['resyncs']} after a "
                f"resync), peak {s['peak_live_bytes'] / 2**20:.1f} of "
                f"{s['arena_bytes'] / 2**20:.1f} MiB; normal allocator: "
                + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in refused.items()))


class _Recording:
    def __init__(self, planner: MemoPlanner, recorder: AllocationRecorder, phase: str):
        self.planner, self.recorder, self.phase = planner, recorder, phase

    def __enter__(self):
        for chunk in self.planner.model_chunks:
            self.recorder.attach(chunk)
        self._scope = self.recorder.phase_scope(self.phase)
        self._scope.__enter__()
        self.recorder.__enter__()
        return self.recorder

    def __exit__(self, *exc_info):
        self.recorder.__exit__(*exc_info)
        self._scope.__exit__(*exc_info)
        self.recorder.detach()
        if self.planner.runtime is not None:
            self.planner.runtime.close()
        if exc_info[0] is None:
            self.planner._recorded(self.recorder)
        return False


class ArenaHooksMemory:
    """What ``memo_arena_malloc`` / ``memo_arena_free`` hand out, for memo_ext.device_memory
    (PyTorch's own statistics raise once they replace its allocator), and the record-stream
    call PyTorch does not forward to them."""

    name = "MEMO planned arena (--memo-plan)"

    def __init__(self):
        import ctypes

        self._record = ctypes.CDLL(_C.__file__).memo_arena_record_stream
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._record.restype = None

    def memory(self, device: int):
        from memo_ext.device_memory import DeviceMemory

        return DeviceMemory(**_C.cuda_arena_memory(device))

    def reset_peak(self, device: int) -> None:
        _C.cuda_arena_reset_peak(device)

    def record_stream(self, data_ptr: int, stream_handle: int) -> None:
        self._record(data_ptr, stream_handle)


def install_cuda_allocator() -> None:
    """Make ``memo_arena_malloc`` / ``memo_arena_free`` (memo_ext._C) the process's CUDA
    allocator and the source of its memory statistics (memo_ext.device_memory). They must see
    every tensor request, not the caching allocator's segment requests, so they replace it;
    PyTorch allows that only before the first CUDA allocation. Until a :class:`CudaArena`
    exists they serve everything from the CUDA runtime's stream-ordered pool
    (cudaMallocAsync)."""
    import torch

    from memo_ext.config import MemoConfigError
    from memo_ext.device_memory import register_allocator

    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        _C.__file__, "memo_arena_malloc", "memo_arena_free")
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as error:
        raise MemoConfigError(
            f"--memo-plan: cannot install the arena's CUDA allocator ({error}); it must be "
            "installed before the first CUDA tensor exists: do not allocate on the GPU before "
            "initialize_megatron, or use --memo-plan off") from None
    register_allocator(ArenaHooksMemory())


#: Closed arenas whose buffers still hold live planned tensors (see CudaArena.close).
_DRAINING: list = []
#: The CudaArena memo_arena_malloc serves from, if any.
_SERVING: Optional["CudaArena"] = None


class CudaArena:
    """The runtime arena on a GPU (trained 10 iterations on one H100: make gpu-check).

    One uint8 tensor, allocated from the stream-ordered pool before the arena is set, holds the
    arena's bytes; from then on ``memo_arena_malloc`` serves the planned requests made on the
    current (compute) stream inside it and sends every other request to the pool. Needs
    :func:`install_cuda_allocator` first. Layer phases are opened by an
    :class:`ArenaPhaseTagger`.

    :meth:`close` when training is over: the trainer closes it at the end of ``pretrain``
    (megatron.training.mechanisms, ``close``), and an ``atexit`` handler closes it if nothing
    else did (a run that died), before the interpreter starts tearing down modules.
    """

    def __init__(self, runtime: ArenaRuntime, device):
        import atexit

        import torch

        global _SERVING
        self.runtime = runtime
        # PyTorch's pluggable allocator keys what it hands out by address, so no planned tensor
        # may start at the buffer's own address: the planned offsets begin ARENA_HEAD_BYTES in
        # (at offset 0, the first planned tensor's free dropped the buffer's entry, and the
        # buffer's own free then aborted the process on an H100).
        self.buffer = torch.empty(ARENA_HEAD_BYTES + runtime.arena_bytes, dtype=torch.uint8,
                                  device=device)
        self.base = self.buffer.data_ptr() + ARENA_HEAD_BYTES  # address of planned offset 0
        self.stream = torch.cuda.current_stream(device)
        self.closed = False
        _C.set_cuda_arena(runtime.arena, self.base, self.stream.cuda_stream)
        _SERVING = self
        atexit.register(self.close)

    def close(self) -> None:
        """Stop serving: requests go to the stream-ordered pool from now on. Idempotent.

        Planned tensors may outlive this (a traceback holding an iteration's frames, tensors
        freed while the interpreter tears down modules, in no set order). Their frees still
        come back to this arena: memo_ext._C's hooks keep the C++ arena, whatever becomes of
        the Python objects, until its last block is freed (a destroyed arena, or a free passed
        to cudaFreeAsync for an address inside the buffer, was what a late free met before).
        The buffer those tensors live in is given back now only if none is alive; otherwise
        it is kept to the end of the process, so that the pool never hands out memory a live
        planned tensor still uses."""
        import atexit

        global _SERVING
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if _SERVING is self:
            _C.set_cuda_arena(None, 0, 0)
            _SERVING = None
        if self.runtime.arena.stats()["live_blocks"]:
            _DRAINING.append(self)
        else:
            self.buffer = None
