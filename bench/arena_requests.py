"""The planned arena under the requests a CUDA run makes, on CPU, through the real allocator hook
(bench/planning.py --cuda-requests; tests/unit/memo_ext/planner/test_arena_cuda_requests.py on a small trace).

A trace (tools/trace.py) records what the trainer's ops return. On a GPU the arena's allocator
hook, ``memo_arena_malloc`` (memo_ext._C), is what PyTorch's CUDAPluggableAllocator calls for
every tensor, so it also sees what the attention kernels allocate inside the tile ops and drop
before the op returns (:data:`UNTRACED`, from memo_ext/attention/kernels.py and the kernels'
sources): zero-byte tensors, which PyTorch's pluggable allocator passes to the hook where its
caching allocator would not. The plan never saw them; on one H100 they, and the kernels'
few-byte RNG state (untraced then, recorded by the tracer's CUDA rules since), pushed the rest
of each layer phase off its plan (bench/results/gpu_check_h100.md).

:func:`cuda_requests` is that CUDA-faithful sequence: the trace's device requests with the
untraced ones put where the kernels make them. :func:`replay_through_hooks` sends it through
``memo_arena_malloc`` / ``memo_arena_free`` (called with ctypes, as the CPU test double of
PyTorch's pluggable allocator calls them: every size, frees for non-null pointers only), with
each request's layer phase opened first as the trainer's ArenaPhaseTagger opens it before each
op, and the CUDA runtime calls answered by csrc/standalone/fake_cuda_runtime.c. It reports the
share of the plan's layer requests (the traced ones the plan places in the arena) that the hook
served at their planned address. The arena's addresses are never touched (its base is a fake
device address); pool requests are host malloc'ed by the fake runtime.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from memo_ext import _C
from memo_ext.attention.kernels import TILE_BACKWARD_OP, TILE_FORWARD_OP
from memo_ext.planner.arena import ArenaRuntime
from memo_ext.planner.plan import PHASE_GROUPS, MemoryPlan
from memo_ext.planner.trace import INIT, POOL_DEVICE, Trace
from memo_ext.planner.trace.format import WORKSPACE

REPO = Path(__file__).resolve().parents[1]
FAKE_RUNTIME_SOURCE = REPO / "csrc" / "standalone" / "fake_cuda_runtime.c"

#: The compute stream's cudaStream_t in the replay, and the arena's (fake) device base address.
COMPUTE_STREAM, ARENA_BASE = 0x10, 1 << 40

#: What each tile op allocates on CUDA that no trace records, by kernel path: (requests before
#: the op's outputs, requests after them), each (what, bytes), all freed when the op returns.
#: torch: aten._scaled_dot_product_flash_attention's forward makes the debug mask p, empty
#: without dropout, and its backward gets the empty ``no_rng`` memo_ext passes for the RNG
#: arguments before the call; flash-attn: mha_fwd's p (empty). Everything else the kernels
#: allocate is in the trace: the tracer's CUDA rules record it after the op's outputs
#: (memo_ext.attention.kernels.forward_workspaces / backward_workspaces: rng_state, torch's
#: _unused, softmax_d, dq_accum, ...), and tile_backward returns only dq, dk, dv (until the
#: attention tiles' requests moved to the CUDA rules it also returned four zero-byte
#: workspace outputs in training). cuDNN's path (the trainer's on Hopper) is not modelled here:
#: its forward's two 0-d seed/offset tensors are not declared by the tracer either.
UNTRACED = {
    "torch": {
        TILE_FORWARD_OP: ((), (("p", 0),)),
        TILE_BACKWARD_OP: ((("no_rng", 0),), ()),
    },
    "flash-attn": {
        TILE_FORWARD_OP: ((), (("p", 0),)),
        TILE_BACKWARD_OP: ((), ()),
    },
}
KERNELS = tuple(UNTRACED)


@dataclass
class Request:
    """One call of the alloc or free hook (action "end": the iteration is over)."""

    action: str
    key: object = None           # names the block: (iteration, trace id) or ("untraced", n)
    nbytes: int = 0
    layer: Optional[int] = None
    phase: Optional[str] = None
    traced: bool = True


def _op_groups(events: list[dict]) -> list[tuple[int, int, str]]:
    """(first row, last row, op) of each run of consecutive allocations of one tile op."""
    groups, row = [], 0
    while row < len(events):
        op = events[row]["op"]
        if events[row]["action"] == "alloc" and op in (TILE_FORWARD_OP, TILE_BACKWARD_OP):
            last = row
            while (last + 1 < len(events) and events[last + 1]["action"] == "alloc"
                   and events[last + 1]["op"] == op):
                last += 1
            groups.append((row, last, op))
            row = last + 1
        else:
            row += 1
    return groups


def cuda_requests(trace: Trace, kernels: str = "torch", iterations: int = 1) -> list[Request]:
    """The device requests of ``trace`` as the CUDA hook sees them with ``kernels``' attention:
    the persistent state once, then the iteration ``iterations`` times, each op's untraced
    requests (:data:`UNTRACED`) around its traced outputs. A tile op's extras are freed when
    it returns: after its outputs and after the frees of its declared workspaces (which on CUDA
    the kernel frees before returning)."""
    untraced = UNTRACED[kernels]
    events = [e for e in trace.events if e["pool"] == POOL_DEVICE]
    init = [e for e in events if e["phase"] == INIT]
    body = [e for e in events if e["phase"] != INIT]
    groups = {first: (last, op) for first, last, op in _op_groups(body)}
    extra = iter(range(1 << 62))
    out = [Request(e["action"], (0, e["id"]), e["bytes"], e["layer"], e["phase"]) for e in init]
    for iteration in range(iterations):
        pending_frees: list[Request] = []
        close_after: Optional[int] = None
        for row, e in enumerate(body):
            if row in groups:
                last, op = groups[row]
                before, after = untraced[op]
                made = [Request("alloc", ("untraced", next(extra)), n, e["layer"], e["phase"],
                                traced=False) for _, n in before]
                out += made
                pending_frees = [Request("free", r.key) for r in made]
                workspaces = {x["id"] for x in body[row:last + 1] if x["category"] == WORKSPACE}
                close_after = last
                after_requests = after
            out.append(Request(e["action"], (iteration, e["id"]), e["bytes"], e["layer"],
                               e["phase"]))
            if close_after is None:
                continue
            following = body[row + 1] if row + 1 < len(body) else None
            done = row >= close_after and not (
                following is not None and following["action"] == "free"
                and following["id"] in workspaces)
            if done:
                made = [Request("alloc", ("untraced", next(extra)), n, e["layer"], e["phase"],
                                traced=False) for _, n in after_requests]
                out += made + pending_frees + [Request("free", r.key) for r in made]
                close_after, pending_frees = None, []
        out.append(Request("end"))
    return out


@dataclass
class HookReplay:
    """What the hook did with a request sequence."""

    kernels: str
    planned: int = 0              # traced layer requests the plan places in the arena
    at_plan: int = 0              # ... that the hook served at base + their planned offset
    untraced_zero: int = 0        # zero-byte requests the hook saw
    untraced_small: int = 0       # untraced requests of a few bytes
    zero_byte_non_null: int = 0   # zero-byte requests the hook answered with an address
    stats: dict = field(default_factory=dict)   # the arena's counters (PlannedArena.stats)

    @property
    def share(self) -> float:
        return self.at_plan / self.planned if self.planned else 1.0


def build_fake_runtime(out_dir: Path) -> Path:
    """csrc/standalone/fake_cuda_runtime.c as ``out_dir``/libcudart.so.13 (gcc or cc)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc/cc) to build the fake CUDA runtime")
    library = Path(out_dir) / "libcudart.so.13"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library),
                    str(FAKE_RUNTIME_SOURCE)], check=True, capture_output=True, timeout=120)
    return library


def load_fake_runtime(library: Path) -> ctypes.CDLL:
    """Load it as PyTorch loads its CUDA runtime (RTLD_LOCAL), before the hooks' first call
    (they look its symbols up once per process)."""
    return ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)


def replay_through_hooks(plan: MemoryPlan, requests: list[Request],
                         kernels: str = "torch") -> HookReplay:
    """Send ``requests`` through memo_arena_malloc / memo_arena_free with ``plan``'s arena set
    for the compute stream (a fake CUDA runtime must be loaded: :func:`load_fake_runtime`)."""
    hooks = ctypes.CDLL(_C.__file__)
    malloc, free = hooks.memo_arena_malloc, hooks.memo_arena_free
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    runtime = ArenaRuntime(plan)
    tables = [level["table"] for level in plan.level1]
    result = HookReplay(kernels)
    live: dict[object, tuple[int, int]] = {}
    phase_key, position = None, 0
    _C.set_cuda_arena(runtime.arena, ARENA_BASE, COMPUTE_STREAM)
    try:
        for r in requests:
            if r.action == "end":
                runtime.close()
                phase_key = None
                continue
            if r.action == "free":
                held = live.pop(r.key, None)
                if held is not None:
                    free(held[0], held[1], 0, COMPUTE_STREAM)
                continue
            runtime.enter(r.layer, r.phase)  # what ArenaPhaseTagger does before each op
            expected = None
            group = PHASE_GROUPS.get(r.phase)
            if r.traced and r.layer is not None and group is not None:
                if (r.layer, group) != phase_key:
                    phase_key, position = (r.layer, group), 0
                kind = runtime.kind_of.get(phase_key)
                if kind is not None and position < len(tables[kind]):
                    offset = tables[kind][position][1]
                    expected = ARENA_BASE + offset if offset >= 0 else None
                position += 1
            if not r.traced:
                if r.nbytes == 0:
                    result.untraced_zero += 1
                else:
                    result.untraced_small += 1
            address = malloc(r.nbytes, 0, COMPUTE_STREAM)
            if address:  # PyTorch calls the free hook for what is not null
                live[r.key] = (address, r.nbytes)
                if r.nbytes == 0:
                    result.zero_byte_non_null += 1
            if expected is not None:
                result.planned += 1
                result.at_plan += address == expected
    finally:
        for address, nbytes in live.values():
            free(address, nbytes, 0, COMPUTE_STREAM)
        _C.set_cuda_arena(None, 0, 0)
    result.stats = dict(runtime.stats())
    return result
