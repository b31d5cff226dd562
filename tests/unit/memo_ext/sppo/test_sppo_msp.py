"""MSP's plan (memo_ext.sppo.multiplex): which tasks get helpers, each stage's program, that the
programs cannot deadlock, the simulated bubble and the pieces a task is cut into. Exactness of
training with --memo-sppo-msp is in tests/distributed/test_sppo_exactness.py."""

from __future__ import annotations

import pytest

from memo_ext.config import MemoConfigError, SPPOConfig
from memo_ext.sppo import LayerFlops, pipeline_bubble_ratio, plan_multiplexing
from memo_ext.sppo.msp_plan import (
    BACKWARD,
    FORWARD,
    HELP_BACKWARD,
    HELP_FORWARD,
    split_range,
    stage_program,
)

GPT_7B_FLOPS = LayerFlops.of_gpt_layer(4096, 11008, 32, 32, 128, swiglu=True)


def test_plan_for_four_stages_and_eight_subsequences():
    tasks = plan_multiplexing(4, [1.0] * 8)
    assert {key: task.helpers for key, task in tasks.items()} == {
        (0, 0): (1, 2, 3),  # slot 0: stages 1-3 have not started
        (0, 1): (3,), (1, 0): (2,),  # slot 1: two busy tasks, two idle stages
        (2, 0): (3,),  # slot 2: one idle stage, three equal tasks: the nearest gets it
        (1, 7): (0,), (2, 7): (0,), (3, 6): (1,),  # the forward tail, mirrored
        (3, 7): (0, 1, 2),
    }
    # docs/sppo.md's sets: every multiplexed task is bubble-adjacent (left or right of the steady
    # part) on its stage: S0 {0,1,2} | -, S1 {0,1} | {7}, S2 {0} | {6,7}, S3 - | {5,6,7}.
    adjacent = {0: {0, 1, 2}, 1: {0, 1, 7}, 2: {0, 6, 7}, 3: {5, 6, 7}}
    assert all(index in adjacent[stage] for stage, index in tasks)


def test_plan_gives_helpers_to_the_task_with_most_work_per_member():
    # Slot 1 of two stages ... with three stages: slot 0 has one busy task and two idle stages.
    assert plan_multiplexing(3, [1.0, 1.0, 1.0])[(0, 0)].helpers == (1, 2)
    # Slot 1: tasks (0, 1) and (1, 0), one idle stage (2): the heavier subsequence gets it.
    assert plan_multiplexing(3, [1.0, 3.0, 1.0])[(0, 1)].helpers == (2,)
    assert plan_multiplexing(3, [3.0, 1.0, 1.0])[(1, 0)].helpers == (2,)
    assert plan_multiplexing(1, [1.0] * 4) == {}


@pytest.mark.parametrize("stages, count", [(2, 1), (2, 4), (3, 5), (4, 8), (4, 3), (8, 16)])
def test_programs_run_to_the_end_without_deadlock(stages, count):
    """Play every stage's program: a forward needs the previous stage's forward of the same
    subsequence, a backward the next stage's backward, a multiplexed step all its members at
    that step (a collective). Every step must complete."""
    tasks = plan_multiplexing(stages, [1.0] * count)
    programs = [stage_program(s, stages, count, tasks) for s in range(stages)]
    position = [0] * stages
    done: set = set()

    def step(stage):
        return programs[stage][position[stage]] if position[stage] < len(programs[stage]) \
            else None

    progressed = True
    while progressed:
        progressed = False
        for stage in range(stages):
            current = step(stage)
            if current is None:
                continue
            kind, item = current
            if kind in (FORWARD, BACKWARD):
                owner_task = tasks.get((stage, item))
                neighbour = stage - 1 if kind == FORWARD else stage + 1
                if 0 <= neighbour < stages and (kind, neighbour, item) not in done:
                    continue
                if owner_task is not None:
                    help_kind = HELP_FORWARD if kind == FORWARD else HELP_BACKWARD
                    if any(step(h) != (help_kind, owner_task) for h in owner_task.helpers):
                        continue
                    for helper in owner_task.helpers:
                        position[helper] += 1
                done.add((kind, stage, item))
                position[stage] += 1
                progressed = True
    assert all(step(s) is None for s in range(stages)), [step(s) for s in range(stages)]
    assert len(done) == 2 * stages * count


def test_program_without_tasks_is_fill_drain_order():
    assert stage_program(1, 2, 3, {}) == [(FORWARD, 0), (FORWARD, 1), (FORWARD, 2),
                                          (BACKWARD, 2), (BACKWARD, 1), (BACKWARD, 0)]
    assert stage_program(1, 2, 3, {}, forward_only=True) == [(FORWARD, 0), (FORWARD, 1),
                                                             (FORWARD, 2)]


@pytest.mark.parametrize("stages, count", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_bubble_falls_with_msp(stages, count):
    work = [1.0] * count
    plain = pipeline_bubble_ratio(stages, work, [2.0] * count)
    assert plain == pytest.approx((stages - 1) / count)
    multiplexed = pipeline_bubble_ratio(stages, work, [2.0] * count,
                                        plan_multiplexing(stages, work))
    assert multiplexed < plain / 2


def test_bubble_of_two_stages_by_hand():
    # N=4, forward 1, backward 2: the four helped slots take 1/2, 1/2, (1+2)/2, (1+2)/2 instead
    # of 1, 1, 2, 2 (the backward recomputes the forward): makespan 13 for 12 units of work.
    tasks = plan_multiplexing(2, [1.0] * 4)
    assert pipeline_bubble_ratio(2, [1.0] * 4, [2.0] * 4, tasks) == pytest.approx(1 / 12)


def test_pieces_have_equal_causal_flops():
    begin, end = 1 << 19, (1 << 19) + 40000
    cuts = split_range(begin, end, 4, GPT_7B_FLOPS)
    assert cuts[0] == begin and cuts[-1] == end and cuts == sorted(cuts)
    work = [GPT_7B_FLOPS.of_range(a, b) for a, b in zip(cuts, cuts[1:])]
    assert max(work) / min(work) < 1.001
    assert split_range(0, 3, 3, GPT_7B_FLOPS) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot be cut into 4 pieces"):
        split_range(10, 13, 4, GPT_7B_FLOPS)


def test_pieces_are_whole_multiples_of_the_sequence_parallel_size():
    cuts = split_range(1000, 1400, 3, GPT_7B_FLOPS, multiple_of=8)
    assert all((c - 1000) % 8 == 0 for c in cuts) and cuts[-1] == 1400
    assert split_range(16, 40, 3, GPT_7B_FLOPS, multiple_of=8) == [16, 24, 32, 40]
    with pytest.raises(ValueError, match="whole multiples of 8 tokens"):
        split_range(16, 36, 2, GPT_7B_FLOPS, multiple_of=8)


def test_msp_flag_needs_memo_sppo():
    with pytest.raises(MemoConfigError, match="--memo-sppo-msp True has no effect without"):
        SPPOConfig(sppo_msp=True).validate()
