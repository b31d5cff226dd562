"""The optional MEMO mechanisms as the training loop sees them: each one adapted once at setup
into a :class:`Mechanism`, all of them held in a :class:`Mechanisms` registry, so that
``pretrain`` runs one loop with no per-feature branch.

A mechanism may, each hook a no-op unless it says otherwise:

- ``model_options()``: keyword arguments for the model provider (its layer spec: MEMO's,
  SPPO's, METP's runtime objects);
- ``attach(model)``: hook the built model (the DDP-wrapped chunks);
- ``wrap_forward_step(forward_step)``: the training forward step (not evaluation's);
- ``schedule()``: a replacement for megatron.core's forward/backward schedule (SPPO's);
- ``step(iteration)``: a context around one training step (forward, backward, optimizer);
- ``optimizer_phase()``: a context around ``optimizer.step()``;
- ``end_step(iteration)``: work between steps, right after one (before its log line);
- ``report(iteration, logger)``: after the step's log line (collective where it gathers);
- ``close()``: training is over (``pretrain`` returns or raises); runs in reverse order.

Order. Mechanisms are registered, and every hook runs, in this order:

    MEMO offload, SPPO, METP, telemetry, planner (--memo-plan)

Contexts are entered in that order and exited in reverse, as nested ``with`` blocks. What
depends on the order:

- attach: SPPO's and METP's hooks on the model come before telemetry registers the model's
  parameters and gradient buffers (they were attached last in the model's construction);
- step: telemetry's step encloses the planner's iteration (an out-of-memory error inside the
  planner's recording still becomes telemetry's report and MemoryBudgetExceeded), and the
  planner's ``iteration()`` is called after telemetry's step has begun;
- end_step: MEMO's ``after_iteration`` (which may resize its device buffers, under
  telemetry's ``between_steps`` so that telemetry sees them) before SPPO's;
- report: telemetry's memory line (and its fail-fast check) before the planner's arena line.

Telemetry is built first (MEMO and SPPO label their buffers for it), then MEMO, SPPO, METP,
all before the model; the planner is built after the model and optimizer
(:func:`build_planner_mechanism`) and appended last.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable, ContextManager, Iterator, Optional

from megatron.training.memo import (
    attach_memo_telemetry,
    build_memo_metp,
    build_memo_offload,
    build_memo_planner,
    build_memo_sppo,
    build_memo_telemetry,
)

Log = Callable[[str], None]


class Mechanism:
    """One optional mechanism's hooks into the training loop; every hook is a no-op here."""

    def model_options(self) -> dict:
        return {}

    def attach(self, model: list) -> None:
        pass

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        return forward_step

    def schedule(self) -> Optional[Callable]:
        return None

    def step(self, iteration: int) -> ContextManager:
        return contextlib.nullcontext()

    def optimizer_phase(self) -> ContextManager:
        return contextlib.nullcontext()

    def end_step(self, iteration: int) -> None:
        pass

    def report(self, iteration: int, logger) -> None:
        pass

    def close(self) -> None:
        pass


class MemoOffloadMechanism(Mechanism):
    """--memo-offload (memo_ext.offload.MemoOffload): MEMO's layer spec; after each step,
    ``after_iteration`` (--memo-alpha auto's solve) inside telemetry's ``between_steps``."""

    def __init__(self, memo, between_steps: Callable[[], ContextManager]):
        self.memo = memo
        self.between_steps = between_steps

    def model_options(self) -> dict:
        return {"memo": self.memo}

    def end_step(self, iteration: int) -> None:
        with self.between_steps():  # may resize MEMO's device buffers: telemetry must see them
            self.memo.after_iteration()


class _AttachedRuntime(Mechanism):
    """A runtime the model provider takes by the keyword ``option`` (for its layer spec) and
    that hooks each model chunk."""

    option: str

    def __init__(self, runtime):
        self.runtime = runtime

    def model_options(self) -> dict:
        return {self.option: self.runtime}

    def attach(self, model: list) -> None:
        for chunk in model:
            self.runtime.attach(chunk)


class SubsequencePipelineMechanism(_AttachedRuntime):
    """--memo-sppo (memo_ext.sppo.SubsequencePipeline): its layer spec and chunk hooks, its
    schedule for every global batch (training and evaluation), ``after_iteration`` after each
    step."""

    option = "sppo"

    def schedule(self) -> Callable:
        return self.runtime.forward_backward

    def end_step(self, iteration: int) -> None:
        self.runtime.after_iteration()


class MemoryEfficientTPMechanism(_AttachedRuntime):
    """--memo-metp (memo_ext.metp.MemoryEfficientTP): its layer spec and zigzag hooks."""

    option = "metp"


class TelemetryMechanism(Mechanism):
    """--memo-telemetry (memo_ext.telemetry.MemoryTelemetry): tracks each step (an
    out-of-memory error becomes a report), marks micro-batch forwards and the optimizer phase,
    and after each step's log line gathers, prints and fail-fast checks (collective)."""

    def __init__(self, telemetry):
        self.telemetry = telemetry

    def attach(self, model: list) -> None:
        attach_memo_telemetry(self.telemetry, model)

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        return self.telemetry.wrap_forward_step(forward_step)

    def step(self, iteration: int) -> ContextManager:
        return self.telemetry.step(iteration)

    def optimizer_phase(self) -> ContextManager:
        return self.telemetry.phase("optimizer")

    def report(self, iteration: int, logger) -> None:
        gathered = self.telemetry.after_step(iteration)  # raises MemoryBudgetExceeded on fail-fast
        if gathered is not None:
            logger.log_memory(gathered.as_record())


class PlannerMechanism(Mechanism):
    """--memo-plan (memo_ext.planner.MemoPlanner): each step is one planner iteration (warm-up,
    trace, then the arena); its statistics line every log interval."""

    def __init__(self, planner, log_interval: int, log: Log):
        self.planner = planner
        self.log_interval = log_interval
        self.log = log

    def step(self, iteration: int) -> ContextManager:
        return self.planner.iteration()

    def report(self, iteration: int, logger) -> None:
        if iteration % self.log_interval == 0:
            self.log(f"> {self.planner.stats_line()}")

    def close(self) -> None:
        """The CUDA arena stops serving (memo_ext.planner.CudaArena.close)."""
        self.planner.close()


class Mechanisms:
    """The registered mechanisms, in hook order (see the module docstring); empty: plain
    megatron.core training."""

    def __init__(self, mechanisms: tuple[Mechanism, ...] = ()):
        self._mechanisms = list(mechanisms)

    def register(self, mechanism: Optional[Mechanism]) -> None:
        """Append ``mechanism`` (nothing for None: the feature is off)."""
        if mechanism is not None:
            self._mechanisms.append(mechanism)

    def __iter__(self) -> Iterator[Mechanism]:
        return iter(self._mechanisms)

    def model_options(self) -> dict:
        """The model provider's keyword arguments: ``memo`` always (None when off), ``sppo`` and
        ``metp`` only when on."""
        options = {"memo": None}
        for mechanism in self:
            options.update(mechanism.model_options())
        return options

    def attach(self, model: list) -> None:
        for mechanism in self:
            mechanism.attach(model)

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        for mechanism in self:
            forward_step = mechanism.wrap_forward_step(forward_step)
        return forward_step

    def schedule(self) -> Optional[Callable]:
        """The schedule replacing megatron.core's, or None (at most one mechanism has one)."""
        schedules = [s for s in (m.schedule() for m in self) if s is not None]
        return schedules[0] if schedules else None

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for mechanism in self:
                stack.enter_context(mechanism.step(iteration))
            yield

    @contextlib.contextmanager
    def optimizer_phase(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for mechanism in self:
                stack.enter_context(mechanism.optimizer_phase())
            yield

    def end_step(self, iteration: int) -> None:
        for mechanism in self:
            mechanism.end_step(iteration)

    def report(self, iteration: int, logger) -> None:
        for mechanism in self:
            mechanism.report(iteration, logger)

    def close(self) -> None:
        """Every mechanism's ``close``, last registered first (the planner, registered last,
        was set up last); each runs even if one before it raised (the first error is
        raised after)."""
        with contextlib.ExitStack() as stack:
            for mechanism in self:
                stack.callback(mechanism.close)


def build_mechanisms(args: argparse.Namespace, log: Log) -> Mechanisms:
    """The mechanisms the --memo-* flags turn on that the model is built with (collective:
    MEMO and SPPO may measure the D2H bandwidth with every rank at once). Built in the order
    telemetry, MEMO, SPPO, METP (each prints its startup line); registered in hook order."""
    telemetry = build_memo_telemetry(args, log=log)
    memo = build_memo_offload(args, log=log, telemetry=telemetry)
    sppo = build_memo_sppo(args, log=log, telemetry=telemetry)
    metp = build_memo_metp(args, log=log)
    between_steps = contextlib.nullcontext if telemetry is None else telemetry.between_steps
    mechanisms = Mechanisms()
    mechanisms.register(None if memo is None else MemoOffloadMechanism(memo, between_steps))
    mechanisms.register(None if sppo is None else SubsequencePipelineMechanism(sppo))
    mechanisms.register(None if metp is None else MemoryEfficientTPMechanism(metp))
    mechanisms.register(None if telemetry is None else TelemetryMechanism(telemetry))
    return mechanisms


def build_planner_mechanism(args: argparse.Namespace, model: list,
                            log: Log) -> Optional[PlannerMechanism]:
    """--memo-plan's mechanism for the built ``model``, or None when off. Built after the
    optimizer (a plan file is read, checked and logged then)."""
    planner = build_memo_planner(args, model, log=log)
    return None if planner is None else PlannerMechanism(planner, args.log_interval, log)
