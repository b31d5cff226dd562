"""The tracer's stand-in for the middle iterations of a loop over equal tiles
(memo_ext.tile_loop): :func:`repeat_tiles` runs tiles 0, 1, 2 and the last, and records tiles
3 .. count-2 as copies of tile 2's block of events.

A tile's block is the events from the start of its iteration to the start of the next (so it
holds the frees its predecessor's leftovers get when the loop rebinds its variables). Before it
copies, it checks on the events that the copy is what running the tiles would record:

- blocks 1 and 2 are alike event by event (action, bytes, stream, layer, phase, category,
  micro-batch, pool, module, op), and so is every free's reference: to the block's own
  allocation at the same position, or to a leftover of the block before, alike in its fields;
- block 2 frees nothing older than block 1, and every allocation block 1 left alive at its end.

Then copy k (3 <= k <= count - 2) allocates afresh where block 2 allocated and frees block
k-1's leftovers where block 2 freed block 1's; block 2's leftovers, still alive, become the last
copy's, so the real last tile frees those; the work counts (FLOPs, bytes, collectives) of block
2 are added once per copy. Anything else (fewer than five tiles, blocks that differ, a leftover
that outlives the next block) runs every tile. The result is the trace running every tile
records, event for event (tests/unit/memo_ext/trace/test_tile_copies.py): the middle tiles run
the same code on tensors of the same shapes.

Hand-written: no library records a loop's allocations by copying an iteration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:
    from memo_ext.trace.recorder import AllocationRecorder

#: Tiles a loop needs before any is copied: three run (0 differs from the rest; 1 and 2 are
#: compared), at least one copied, and the last, which may be shorter, runs.
MIN_TILES_TO_COPY = 5

_ID, _ACTION = 0, 1


def _references(block: list[list], previous_allocs: dict[int, int]
                ) -> Optional[list[tuple[str, int]]]:
    """Per event of ``block``: ("alloc", k) for its k-th allocation, ("own", k) for a free of
    it, ("prev", k) for a free of the k-th allocation of the block before (``previous_allocs``:
    id -> position); None when a free refers to anything older."""
    own: dict[int, int] = {}
    references = []
    for event in block:
        if event[_ACTION] == "alloc":
            own[event[_ID]] = len(own)
            references.append(("alloc", own[event[_ID]]))
        elif event[_ID] in own:
            references.append(("own", own[event[_ID]]))
        elif event[_ID] in previous_allocs:
            references.append(("prev", previous_allocs[event[_ID]]))
        else:
            return None
    return references


def _alloc_positions(block: list[list]) -> dict[int, int]:
    positions: dict[int, int] = {}
    for event in block:
        if event[_ACTION] == "alloc":
            positions[event[_ID]] = len(positions)
    return positions


def _leftovers(block: list[list], references: list[tuple[str, int]]) -> set[int]:
    """Positions of the allocations ``block`` leaves alive at its end."""
    allocated = {k for kind, k in references if kind == "alloc"}
    return allocated - {k for kind, k in references if kind == "own"}


def copy_plan(blocks: list[list[list]]) -> Optional[list[tuple[str, int]]]:
    """Block 2's references when blocks 0, 1, 2 (event lists) allow copying block 2 (module
    docstring), else None."""
    first, second, third = blocks
    first_allocs = [e for e in first if e[_ACTION] == "alloc"]
    second_refs = _references(second, _alloc_positions(first))
    third_refs = _references(third, _alloc_positions(second))
    if second_refs is None or third_refs is None or len(second) != len(third):
        return None
    second_allocs = [e for e in second if e[_ACTION] == "alloc"]
    for a, b, ref_a, ref_b in zip(second, third, second_refs, third_refs):
        if a[_ACTION:] != b[_ACTION:] or ref_a[0] != ref_b[0]:
            return None
        if ref_a[0] == "prev":  # a leftover of the block before, alike in its fields
            if first_allocs[ref_a[1]][_ACTION:] != second_allocs[ref_b[1]][_ACTION:]:
                return None
        elif ref_a != ref_b:
            return None
    freed_late = {k for kind, k in third_refs if kind == "prev"}
    if freed_late != _leftovers(second, second_refs):
        return None  # something of block 1 outlives block 2: copies would keep piling up
    return third_refs


def repeat_tiles(recorder: "AllocationRecorder", count: int) -> Iterator[int]:
    """The iterations a loop over ``count`` equal tiles runs under ``recorder`` (module
    docstring); a generator: each index is asked for at the start of its iteration."""
    if count < MIN_TILES_TO_COPY:
        yield from range(count)
        return
    starts, work = [], []
    for index in range(3):
        starts.append(len(recorder.events))
        work.append(recorder.work.snapshot())
        yield index
    with recorder._lock:
        events = recorder.events
        blocks = [events[starts[0]:starts[1]], events[starts[1]:starts[2]], events[starts[2]:]]
        plan = copy_plan(blocks)
        if plan is not None:
            copies = count - 4
            _emit_copies(recorder, blocks[2], plan, copies)
            recorder.work.add_since(work[2], times=copies)
    if plan is None:
        yield from range(3, count)
    else:
        yield count - 1


def _emit_copies(recorder: "AllocationRecorder", template: list[list],
                 plan: list[tuple[str, int]], copies: int) -> None:
    """``copies`` copies of ``template`` (block 2) after it, and block 2's live leftovers
    handed to the last copy."""
    template_allocs = [e for e in template if e[_ACTION] == "alloc"]
    previous = template_allocs
    for _ in range(copies):
        allocs: list[list] = []
        for event, (kind, k) in zip(template, plan):
            if kind == "alloc":
                copy = [next(recorder._ids), *event[_ACTION:]]
                allocs.append(copy)
            else:
                source = allocs[k] if kind == "own" else previous[k]
                copy = [source[_ID], *event[_ACTION:]]
            recorder.events.append(copy)
        previous = allocs
    positions = {id(event): k for k, event in enumerate(template_allocs)}
    for token, event in list(recorder._live.items()):
        k = positions.get(id(event))
        if k is not None:
            recorder._live[token] = previous[k]
