"""megatron.training.mechanisms: the registry runs hooks in registration order and nests the
step and optimizer contexts as ``with`` blocks would (first registered outermost); close runs in
reverse order."""

from __future__ import annotations

import contextlib

import pytest

from megatron.training.mechanisms import (
    Mechanism,
    Mechanisms,
    MemoOffloadMechanism,
    PlannerMechanism,
    TelemetryMechanism,
)


class Recording(Mechanism):
    def __init__(self, name: str, events: list):
        self.name, self.events = name, events

    @contextlib.contextmanager
    def _context(self, what: str):
        self.events.append(f"enter {what} {self.name}")
        try:
            yield
        finally:
            self.events.append(f"exit {what} {self.name}")

    def step(self, iteration):
        self.events.append(f"call step {self.name}")
        return self._context(f"step {iteration}")

    def optimizer_phase(self):
        return self._context("optimizer")

    def attach(self, model):
        self.events.append(f"attach {self.name}")

    def end_step(self, iteration):
        self.events.append(f"end_step {self.name}")

    def report(self, iteration, logger):
        self.events.append(f"report {self.name}")

    def close(self):
        self.events.append(f"close {self.name}")


def test_contexts_nest_in_registration_order_and_hooks_run_in_it():
    events: list[str] = []
    mechanisms = Mechanisms()
    for name in ("a", "b"):
        mechanisms.register(Recording(name, events))
    mechanisms.register(None)  # a feature that is off
    mechanisms.attach([])
    with mechanisms.step(3):
        with mechanisms.optimizer_phase():
            events.append("body")
    mechanisms.end_step(3)
    mechanisms.report(3, logger=None)
    mechanisms.close()
    assert events == [
        "attach a", "attach b",
        "call step a", "enter step 3 a", "call step b", "enter step 3 b",
        "enter optimizer a", "enter optimizer b", "body", "exit optimizer b", "exit optimizer a",
        "exit step 3 b", "exit step 3 a",
        "end_step a", "end_step b", "report a", "report b", "close b", "close a",
    ]


def test_an_error_in_the_step_leaves_every_context_innermost_first():
    events: list[str] = []
    mechanisms = Mechanisms((Recording("outer", events), Recording("inner", events)))
    with pytest.raises(ValueError):
        with mechanisms.step(1):
            raise ValueError("out of memory")
    assert events[-2:] == ["exit step 1 inner", "exit step 1 outer"]


def test_no_mechanisms_is_plain_training():
    mechanisms = Mechanisms()
    forward_step = object()
    assert mechanisms.wrap_forward_step(forward_step) is forward_step
    assert mechanisms.schedule() is None
    assert mechanisms.model_options() == {"memo": None}


def test_memo_solves_alpha_under_telemetry_between_steps_and_the_planner_logs_each_interval():
    events: list[str] = []

    class Memo:
        def after_iteration(self):
            events.append("after_iteration")

    @contextlib.contextmanager
    def between_steps():
        events.append("enter between_steps")
        yield
        events.append("exit between_steps")

    class Planner:
        def stats_line(self):
            return "arena"

    MemoOffloadMechanism(Memo(), between_steps).end_step(1)
    planner = PlannerMechanism(Planner(), log_interval=2, log=events.append)
    planner.report(1, logger=None)
    planner.report(2, logger=None)
    assert events == ["enter between_steps", "after_iteration", "exit between_steps", "> arena"]


def test_telemetry_writes_the_gathered_record_to_the_logger():
    class Gathered:
        def as_record(self):
            return {"iteration": 4}

    class Telemetry:
        def after_step(self, iteration):
            return Gathered() if iteration == 4 else None

    class Logger:
        records: list = []

        def log_memory(self, record):
            self.records.append(record)

    logger = Logger()
    for iteration in (3, 4):
        TelemetryMechanism(Telemetry()).report(iteration, logger)
    assert logger.records == [{"iteration": 4}]


def test_the_trainer_closes_the_arena_when_training_ends():
    """pretrain closes its mechanisms in a finally (megatron/training/training.py): the
    planner's close ends its phase and closes the CUDA arena."""
    from memo_ext.planner.arena import MemoPlanner

    closed = []

    class Arena:
        def close(self):
            closed.append("arena")

    planner = MemoPlanner("auto", [], {"model": {}, "layout": {}}, log=lambda line: None)
    planner.cuda_arena = Arena()
    mechanisms = Mechanisms()
    mechanisms.register(PlannerMechanism(planner, log_interval=1, log=lambda line: None))
    mechanisms.close()
    assert closed == ["arena"]
