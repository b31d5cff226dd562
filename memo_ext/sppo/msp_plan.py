"""MSP's plan, no tensors: which idle stages help which task in which pipeline slot, the
order each stage runs its tasks in, the bubble that order leaves, and where a subsequence is
cut among a group's members. :mod:`memo_ext.sppo.multiplex` runs the plan; the solver and the
schedule read it without importing the runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from memo_ext.layer_flops import LayerFlops

FORWARD, BACKWARD, HELP_FORWARD, HELP_BACKWARD = "forward", "backward", "help_forward", \
    "help_backward"


@dataclass(frozen=True)
class MultiplexedTask:
    """Stage ``stage``'s forward and backward of subsequence ``subsequence``, run together with
    the otherwise idle stages ``helpers``."""

    stage: int
    subsequence: int
    helpers: tuple

    @property
    def members(self) -> tuple:
        return tuple(sorted((self.stage, *self.helpers)))


def forward_slot(stage: int, index: int) -> int:
    return stage + index


def backward_slot(stage: int, index: int, stages: int, count: int) -> int:
    return 2 * count + 2 * stages - 3 - stage - index


def plan_multiplexing(stages: int, work: list[float]) -> dict:
    """The tasks that get helpers, keyed by (stage, subsequence); ``work`` is each
    subsequence's compute (its causal FLOPs), the same on every stage."""
    count = len(work)
    tasks = {}
    for slot in range(count + stages - 1):
        busy = [(stage, slot - stage) for stage in range(stages) if 0 <= slot - stage < count]
        busy_stages = {stage for stage, _ in busy}
        helpers: dict = {task: [] for task in busy}
        for idle in (stage for stage in range(stages) if stage not in busy_stages):
            # The task that would finish last gets the helper; ties go to the nearest stage.
            task = max(busy, key=lambda t: (work[t[1]] / (1 + len(helpers[t])),
                                            -abs(t[0] - idle), -t[0]))
            helpers[task].append(idle)
        for (stage, index), chosen in helpers.items():
            if chosen:
                tasks[(stage, index)] = MultiplexedTask(stage, index, tuple(sorted(chosen)))
    return tasks


def stage_program(stage: int, stages: int, count: int, tasks: dict,
                  forward_only: bool = False) -> list:
    """What ``stage`` does for one sequence, in slot order: (FORWARD|BACKWARD, index) and
    (HELP_FORWARD|HELP_BACKWARD, task). Without tasks: forwards 0..N-1, then backwards N-1..0."""
    steps = [(forward_slot(stage, i), (FORWARD, i)) for i in range(count)]
    if not forward_only:
        steps += [(backward_slot(stage, i, stages, count), (BACKWARD, i)) for i in range(count)]
    for task in tasks.values():
        if stage in task.helpers:
            steps.append((forward_slot(task.stage, task.subsequence), (HELP_FORWARD, task)))
            if not forward_only:
                steps.append((backward_slot(task.stage, task.subsequence, stages, count),
                              (HELP_BACKWARD, task)))
    steps.sort(key=lambda step: step[0])
    slots = [slot for slot, _ in steps]
    assert len(set(slots)) == len(slots), f"stage {stage} has two steps in one slot: {steps}"
    return [step for _, step in steps]


def pipeline_bubble_ratio(stages: int, forward_seconds: list[float],
                          backward_seconds: list[float], tasks: Optional[dict] = None) -> float:
    """Mean idle / busy time over the stages for one sequence, in the order every stage's
    :func:`stage_program` runs: a step starts when its inputs exist (forward ``i`` of the
    previous stage, backward ``i`` of the next) and all its group's members are free; a
    multiplexed task takes its time (its backward: forward + backward, for the recomputation)
    over its member count; weight and K/V traffic are not counted. Without tasks and with equal
    times it is (p-1)/N."""
    tasks = tasks or {}
    count = len(forward_seconds)
    free = [0.0] * stages
    forward_end: dict = {}
    backward_end: dict = {}
    events = []
    for stage in range(stages):
        for index in range(count):
            events.append((forward_slot(stage, index), FORWARD, stage, index))
            events.append((backward_slot(stage, index, stages, count), BACKWARD, stage, index))
    for _, kind, stage, index in sorted(events):
        task = tasks.get((stage, index))
        members = task.members if task else (stage,)
        if kind == FORWARD:
            ready = forward_end.get((stage - 1, index), 0.0)
            seconds = forward_seconds[index]
        else:
            ready = backward_end.get((stage + 1, index), 0.0)
            # A multiplexed backward recomputes its forward first.
            seconds = backward_seconds[index] + (forward_seconds[index] if task else 0.0)
        start = max([ready] + [free[m] for m in members])
        end = start + seconds / len(members)
        for m in members:
            free[m] = end
        (forward_end if kind == FORWARD else backward_end)[(stage, index)] = end
    busy = sum(forward_seconds) + sum(backward_seconds)
    return (max(free) - busy) / busy


def split_range(begin: int, end: int, parts: int, flops: LayerFlops,
                multiple_of: int = 1) -> list[int]:
    """``parts + 1`` offsets cutting tokens ``[begin, end)`` into pieces of equal causal FLOPs,
    each a whole multiple of ``multiple_of`` tokens (the TP size under sequence parallelism)
    counted from ``begin``, and at least one multiple long."""
    if (end - begin) % multiple_of or (end - begin) // multiple_of < parts:
        raise ValueError(f"a subsequence of {end - begin} tokens cannot be cut into {parts} "
                         f"pieces of whole multiples of {multiple_of} tokens; use fewer "
                         "--memo-sppo-subsequences")
    low, total = flops.up_to(begin), flops.up_to(end) - flops.up_to(begin)
    cuts = [begin]
    for k in range(1, parts):
        x = flops.token_at(low + total * k / parts)
        rounded = begin + multiple_of * round((x - begin) / multiple_of)
        cuts.append(min(max(rounded, cuts[-1] + multiple_of), end - multiple_of * (parts - k)))
    return cuts + [end]
