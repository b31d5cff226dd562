"""Offline dynamic storage allocation (DSA): give every request of a known sequence a byte offset
so that requests alive at the same time never overlap, with the smallest arena.

MEMO's formulation (docs/memo.md "Bi-level memory planning"), n requests of S_i bytes, E the pairs
whose lifetimes overlap, A_i offsets, z_ij binary, M the arena::

    min M   s.t.  A_i + S_i <= M
                  A_i + S_i <= A_j + z_ij * M_cap           (i, j) in E
                  A_j + S_j <= A_i + (1 - z_ij) * M_cap     (i, j) in E

Solved with pulp, HiGHS by default (CBC as fallback), warm-started from a greedy placement so a
feasible plan exists whenever the time limit hits. What keeps it small:

* **Time is counted in frees.** Two requests overlap iff one is allocated before the other is
  freed; only the order of allocations relative to frees matters. A request's lifetime is
  therefore [frees before its allocation, frees up to and including its own), and requests
  with equal lifetimes are merged into one block placed contiguously (they are alive together
  and apart from each other nothing distinguishes them).
* **Only overlapping pairs get z variables**; pairs that never overlap have no row.
* **M_cap is the greedy plan's peak** (no optimal plan exceeds it), the tightest valid big-M.
* **M >= the lower bound** max_t(live bytes at t), which no plan beats; when the greedy plan
  already meets it, it is optimal and no MIP is solved.

pulp's HiGHS interface (highspy) ignores initial values, so :class:`_WarmStartedHiGHS` hands
them to highspy's ``setSolution`` before the solve. The greedy (best fit by size, then by
lifetime), the sweep for the bound and the overlap check are hand-written: a few lines over
sorted intervals (numpy arrays, or a sorted list for the check, so that whole iterations of
tens of thousands of requests take well under a second), for which no library is worth the
dependency.
"""

from __future__ import annotations

import bisect
import heapq
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

#: Offsets and sizes are multiples of this many bytes (the CUDA caching allocator's rounding).
ALIGNMENT = 512

#: Default time limit for one MIP, seconds.
DEFAULT_TIME_LIMIT_S = 10.0

#: Above this many blocks (after merging) the MIP is not built: its overlap rows grow
#: quadratically and HiGHS would spend the time limit on the root node; the greedy plan stands
#: (with its gap to the lower bound reported).
MIP_MAX_BLOCKS = 400


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to ALIGNMENT (at least ALIGNMENT)."""
    return max(ALIGNMENT, -(-int(nbytes) // ALIGNMENT) * ALIGNMENT)


@dataclass(frozen=True)
class Request:
    """One tensor to place: ``size`` bytes alive over [start, end) (times in any unit where
    a request allocated at t overlaps every request alive at t)."""

    size: int
    start: int
    end: int


@dataclass
class Placement:
    """Offsets (bytes, one per request, in request order) and how good they are."""

    offsets: list[int]
    peak: int                 # arena bytes: max(offset + size)
    lower_bound: int          # max over time of live bytes: no placement peaks lower
    method: str               # "greedy (optimal)": meets the bound; "mip"; "greedy (...)"
    status: str               # the solver's status, or "skipped"
    seconds: float
    num_blocks: int = 0       # blocks after merging equal lifetimes
    num_pairs: int = 0        # overlapping pairs (z variables)
    notes: list[str] = field(default_factory=list)

    @property
    def gap(self) -> float:
        """(peak - lower bound) / lower bound; 0 for an empty problem."""
        return (self.peak - self.lower_bound) / self.lower_bound if self.lower_bound else 0.0


def requests_from_events(events: Sequence[tuple[str, int, int]]) -> tuple[list[Request], list[int]]:
    """Requests from an ordered (action, block id, bytes) sequence, action "alloc" or "free",
    with times counted in frees (module docstring). A block never freed lives to the end.
    Returns the requests (sizes aligned) and, per request, the index of its alloc event."""
    frees = 0
    open_requests: dict[int, tuple[int, int, int]] = {}  # id -> (request index, start, size)
    requests: list[Optional[Request]] = []
    alloc_rows: list[int] = []
    for row, (action, block, nbytes) in enumerate(events):
        if action == "alloc":
            if block in open_requests:
                raise ValueError(f"event {row}: block {block} allocated twice without a free")
            open_requests[block] = (len(requests), frees, align(nbytes))
            requests.append(None)
            alloc_rows.append(row)
        elif action == "free":
            if block not in open_requests:
                raise ValueError(f"event {row}: free of block {block}, which is not live")
            frees += 1
            index, start, size = open_requests.pop(block)
            requests[index] = Request(size, start, frees)
        else:
            raise ValueError(f"event {row}: unknown action {action!r}")
    for index, start, size in open_requests.values():
        requests[index] = Request(size, start, frees + 1)
    return [r for r in requests if r is not None], alloc_rows


def _int_array(values: list[int], limit: int):
    """``values`` as an int64 array, or as an object array (exact Python ints, slower) when a
    value, or a sum of placed offsets and sizes built from them, could leave int64."""
    import numpy as np

    return np.array(values, dtype=np.int64 if limit < 2 ** 62 else object)


def lower_bound(requests: Sequence[Request]) -> int:
    """max over time of the bytes alive (a sweep over start/end points; ends before starts at
    the same time, since [start, end) intervals that touch do not overlap)."""
    import numpy as np

    if not requests:
        return 0
    # Vectorised (a sort and a running sum in numpy rather than a Python loop over 2n points):
    # points ordered by (time, end before start, change in bytes), as a sort of those tuples.
    times = [r.start for r in requests] + [r.end for r in requests]
    deltas = [r.size for r in requests] + [-r.size for r in requests]
    limit = max(max(map(abs, times)), sum(map(abs, deltas)))
    times, deltas = _int_array(times, limit), _int_array(deltas, limit)
    kinds = np.repeat(np.array([1, 0], dtype=np.int8), len(requests))
    order = np.lexsort((deltas, kinds, times))
    return int(max(0, np.cumsum(deltas[order]).max()))


def _merge_equal_lifetimes(requests: Sequence[Request]) -> tuple[list[Request], list[list[int]]]:
    groups: dict[tuple[int, int], list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault((request.start, request.end), []).append(index)
    blocks, members = [], []
    for (start, end), indices in groups.items():
        blocks.append(Request(sum(requests[i].size for i in indices), start, end))
        members.append(indices)
    return blocks, members


def greedy_offsets(blocks: Sequence[Request]) -> list[int]:
    """Best fit: the largest (then longest-lived, then earliest) block first, each at the lowest
    offset where it overlaps no placed block alive at the same time.

    Offline: it knows every lifetime. The allocator models' stand-in plan,
    memo_ext._C.plan_best_fit (csrc/allocator_models/online_best_fit.cpp), is a different
    algorithm, not a copy: online, in event order, without lifetimes (best fit among freed gaps,
    else the arena's top), as a plan-less allocator would place them. In C++
    (csrc/greedy_offsets.cpp): every block scans the placed ones, tens of thousands of blocks
    for a long-sequence trace."""
    import numpy as np

    from memo_ext import _C

    if not blocks:
        return []
    columns = [[b.size for b in blocks], [b.start for b in blocks], [b.end for b in blocks]]
    if sum(map(abs, columns[0])) >= INT64_LIMIT or \
            max(max(map(abs, column)) for column in columns[1:]) >= INT64_LIMIT:
        raise ValueError(f"blocks of {sum(map(abs, columns[0]))} bytes in all: the placement "
                         "works in 64-bit integers (offsets below 2**62 bytes)")
    return _C.greedy_offsets(*(np.asarray(column, dtype=np.int64) for column in columns)).tolist()


#: Bytes (summed over blocks) and times greedy_offsets places: an offset plus a size stays in
#: int64.
INT64_LIMIT = 1 << 62


def _pairs(blocks: Sequence[Request]) -> list[tuple[int, int]]:
    """Overlapping pairs (i < j), by a sweep over start times."""
    order = sorted(range(len(blocks)), key=lambda i: blocks[i].start)
    pairs, active = [], []
    for i in order:
        active = [j for j in active if blocks[j].end > blocks[i].start]
        pairs.extend((min(i, j), max(i, j)) for j in active)
        active.append(i)
    return pairs


def _peak(blocks: Sequence[Request], offsets: Sequence[int]) -> int:
    return max((o + b.size for o, b in zip(offsets, blocks)), default=0)


def _solve_mip(blocks: Sequence[Request], pairs: list[tuple[int, int]], warm: list[int],
               bound: int, time_limit_s: float) -> tuple[Optional[list[int]], str]:
    import pulp

    cap = _peak(blocks, warm)
    problem = pulp.LpProblem("dsa", pulp.LpMinimize)
    # Offsets in units of ALIGNMENT keep the coefficients small for the solver's tolerances.
    unit = ALIGNMENT
    arena = pulp.LpVariable("arena", lowBound=bound // unit, upBound=cap // unit)
    offsets = [pulp.LpVariable(f"a{i}", lowBound=0, upBound=(cap - b.size) // unit)
               for i, b in enumerate(blocks)]
    problem += arena
    for offset, block in zip(offsets, blocks):
        problem += offset + block.size // unit <= arena
    m_cap = cap // unit
    order = []
    for i, j in pairs:
        below = pulp.LpVariable(f"z{i}_{j}", cat=pulp.LpBinary)  # 0: i below j, 1: j below i
        problem += offsets[i] + blocks[i].size // unit <= offsets[j] + below * m_cap
        problem += offsets[j] + blocks[j].size // unit <= offsets[i] + (1 - below) * m_cap
        order.append((below, i, j))
    arena.setInitialValue(cap // unit)
    for variable, value in zip(offsets, warm):
        variable.setInitialValue(value // unit)
    for below, i, j in order:
        below.setInitialValue(0 if warm[i] + blocks[i].size <= warm[j] else 1)
    solver = _warm_started_highs(time_limit_s)
    if not solver.available():
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=True)
    status = problem.solve(solver)
    values = [v.value() for v in offsets]
    if any(v is None for v in values):
        return None, pulp.LpStatus[status]
    return [int(round(v)) * unit for v in values], pulp.LpStatus[status]


def _warm_started_highs(time_limit_s: float):
    """pulp's highspy interface, plus the variables' initial values as a start solution."""
    import pulp

    class WarmStartedHiGHS(pulp.HiGHS):
        def callSolver(self, lp):
            import highspy

            solution = highspy.HighsSolution()
            solution.col_value = [0.0 if v.varValue is None else float(v.varValue)
                                  for v in lp.variables()]
            solution.value_valid = True
            lp.solverModel.setSolution(solution)
            super().callSolver(lp)

    return WarmStartedHiGHS(msg=False, timeLimit=time_limit_s)


def place(requests: Sequence[Request], time_limit_s: float = DEFAULT_TIME_LIMIT_S,
          use_mip: bool = True) -> Placement:
    """Offsets for ``requests`` (sizes multiples of ALIGNMENT): greedy, then the MIP unless the
    greedy plan already meets the lower bound; the better of the two is returned."""
    started = time.perf_counter()
    for r in requests:
        if r.size % ALIGNMENT or r.size <= 0 or r.end <= r.start:
            raise ValueError(f"request {r}: size must be a positive multiple of {ALIGNMENT} "
                             "bytes and end > start")
    bound = lower_bound(requests)
    blocks, members = _merge_equal_lifetimes(requests)
    block_offsets = greedy_offsets(blocks)
    method, status, pairs = "greedy (optimal)", "skipped", []
    if _peak(blocks, block_offsets) > bound and use_mip and len(blocks) > MIP_MAX_BLOCKS:
        method, status = "greedy", f"mip skipped ({len(blocks)} blocks > {MIP_MAX_BLOCKS})"
    elif _peak(blocks, block_offsets) > bound and use_mip:
        pairs = _pairs(blocks)
        solved, status = _solve_mip(blocks, pairs, block_offsets, bound, time_limit_s)
        if solved is not None and not _valid(blocks, solved):
            # HiGHS accepts a binary within its integrality tolerance of 0/1; times the big-M
            # that slack can let two blocks overlap once offsets are rounded.
            solved, status = None, f"{status}, solution overlaps after rounding: discarded"
        if solved is not None and _peak(blocks, solved) < _peak(blocks, block_offsets):
            block_offsets, method = solved, "mip"
        elif status == "Optimal":
            method = "greedy (proven optimal by the mip)"
        else:
            method = "greedy (mip found nothing better in the time limit)"
    elif _peak(blocks, block_offsets) > bound:
        method, status = "greedy", "mip off"
    offsets = [0] * len(requests)
    for block_offset, indices in zip(block_offsets, members):
        cursor = block_offset
        for index in indices:
            offsets[index] = cursor
            cursor += requests[index].size
    placement = Placement(offsets=offsets, peak=_peak(requests, offsets), lower_bound=bound,
                          method=method, status=status, seconds=time.perf_counter() - started,
                          num_blocks=len(blocks), num_pairs=len(pairs))
    check_placement(requests, placement.offsets, placement.peak)
    return placement


def _valid(blocks: Sequence[Request], offsets: Sequence[int]) -> bool:
    try:
        check_placement(blocks, offsets, _peak(blocks, offsets))
    except ValueError:
        return False
    return True


def check_placement(requests: Sequence[Request], offsets: Sequence[int], arena_bytes: int) -> None:
    """Raise ValueError unless every request lies inside [0, arena_bytes) and no two requests
    alive at the same time overlap in bytes."""
    if len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} offsets for {len(requests)} requests")
    for index, (request, offset) in enumerate(zip(requests, offsets)):
        if offset < 0 or offset + request.size > arena_bytes:
            raise ValueError(f"request {index} at [{offset}, {offset + request.size}) lies outside "
                             f"the arena of {arena_bytes} bytes")
    # A sweep over start times: the requests alive when request i starts are those started
    # before it (in this order) that end after its start; the first pair found (i in this
    # order, then the earliest such request) is the one reported.
    order = sorted(range(len(requests)), key=lambda i: requests[i].start)
    if any(r.size <= 0 for r in requests):
        _check_each_alive_pair(requests, offsets, order)
        return
    # With positive sizes the byte ranges alive at a time are pairwise disjoint until the
    # first overlap, so they are kept sorted by offset and a new one need only be compared
    # with its two neighbours: O(n log n) instead of comparing it with every request alive
    # (O(n * alive), too slow for whole iterations of large models).
    lows: list[int] = []       # byte ranges alive, sorted by low end
    highs: list[int] = []
    positions: list[int] = []  # each range's position in ``order``
    ending: list[tuple[int, int]] = []  # heap of (end, low) of the ranges alive
    for position, i in enumerate(order):
        request = requests[i]
        while ending and ending[0][0] <= request.start:
            k = bisect.bisect_left(lows, heapq.heappop(ending)[1])
            del lows[k], highs[k], positions[k]
        low, high = offsets[i], offsets[i] + request.size
        k = bisect.bisect_right(lows, low)
        if (k and highs[k - 1] > low) or (k < len(lows) and lows[k] < high):
            j = order[min(p for p, l, h in zip(positions, lows, highs) if low < h and l < high)]
            _raise_overlap(requests, offsets, j, i)
        if request.end > request.start:
            lows.insert(k, low)
            highs.insert(k, high)
            positions.insert(k, position)
            heapq.heappush(ending, (request.end, low))


def _check_each_alive_pair(requests: Sequence[Request], offsets: Sequence[int],
                           order: list[int]) -> None:
    """check_placement's sweep for sizes <= 0 (byte ranges that may nest): request i against
    every request alive at its start."""
    active: list[int] = []
    for i in order:
        active = [j for j in active if requests[j].end > requests[i].start]
        low, high = offsets[i], offsets[i] + requests[i].size
        for j in active:
            if low < offsets[j] + requests[j].size and offsets[j] < high:
                _raise_overlap(requests, offsets, j, i)
        active.append(i)


def _raise_overlap(requests: Sequence[Request], offsets: Sequence[int], j: int, i: int):
    low, high = offsets[i], offsets[i] + requests[i].size
    raise ValueError(f"requests {j} and {i} are alive together and overlap at "
                     f"[{max(low, offsets[j])}, {min(high, offsets[j] + requests[j].size)})")
