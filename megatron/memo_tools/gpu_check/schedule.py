"""The check's expected wall time on G GPUs, computed (not timed) from measured durations:
the GPU tests, then the tile compositions, then the waves of trainings of :func:`.plan.waves`
(each wave as long as its longest launch), then the predictions. It follows check.main's
order; tests/unit/megatron/memo_tools/gpu_check/test_gpu_check.py asserts that the 1-8 GPU plans fit the budget with it.

Sources of the durations (bench/results/gpu_check_h100.md and docs/gpu_check.md, one H100,
torch 2.11): :data:`GPU_TESTS_S` and :data:`LAUNCH_S` are measured there; the others are
stated assumptions, as no multi-GPU run of the check exists yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.memo_tools.gpu_check.plan import (
    MECHANISMS,
    Mechanism,
    ModelSettings,
    PlannedRun,
    plan,
    waves,
)

#: "pytest -m gpu tests/gpu: 19 passed in 111.25s" (third H100 run).
GPU_TESTS_S = 111.25
#: One single-GPU 10-iteration training, launch to exit: "about 35 s each there, start-up
#: most of it" (H100 runs; the iterations are 0.10-0.36 s each).
LAUNCH_S = 35.0
#: Assumed, not measured: what a launch of several ranks adds (NCCL communicators, the ranks
#: importing at once on the node's CPUs).
MULTI_RANK_EXTRA_S = 5.0
#: Assumed: the tile-composition row (4096 tokens, a few kernels on one GPU: "seconds").
COMPOSITION_S = 10.0
#: Assumed from docs/gpu_check.md ("a few seconds each, on CPU"): one row's prediction traces.
PREDICTION_S = 5.0


@dataclass(frozen=True)
class Durations:
    """The durations a schedule is computed from (seconds); ``launch_scale`` multiplies every
    launch (a pessimistic schedule sets it above 1)."""

    gpu_tests_s: float = GPU_TESTS_S
    composition_s: float = COMPOSITION_S
    launch_s: float = LAUNCH_S
    multi_rank_extra_s: float = MULTI_RANK_EXTRA_S
    prediction_s: float = PREDICTION_S
    launch_scale: float = 1.0

    def launch(self, run: PlannedRun) -> float:
        extra = self.multi_rank_extra_s if run.nproc > 1 else 0.0
        return (self.launch_s + extra) * self.launch_scale


@dataclass(frozen=True)
class Schedule:
    """When the trainings end (``trainings_end_s``, to compare with check.TOTAL_BUDGET_S: no
    wave may still need to start after it) and the check ends (``end_s``, predictions
    included), seconds from the start; ``waves_s``: each wave's length."""

    waves_s: tuple[float, ...]
    trainings_start_s: float
    trainings_end_s: float
    end_s: float


def schedule(gpus: int, durations: Durations = Durations(), gpu_tests: bool = True,
             model: ModelSettings = ModelSettings(),
             mechanisms: tuple[Mechanism, ...] = MECHANISMS) -> Schedule:
    """The expected schedule of ``make gpu-check`` on ``gpus`` GPUs."""
    runs = plan(gpus, model, mechanisms)
    start = (durations.gpu_tests_s if gpu_tests else 0.0) + durations.composition_s
    lengths = tuple(max(durations.launch(run) for run, _ in wave)
                    for wave in waves(runs, gpus))
    predicted_rows = sum(1 for run in runs
                         if run.skip_reason is None and run.mechanism.estimator is not None)
    end = start + sum(lengths)
    return Schedule(lengths, start, end, end + predicted_rows * durations.prediction_s)


def serial_trainings_end_s(gpus: int, durations: Durations = Durations()) -> float:
    """When the trainings would end launched one after another at the old layout (every GPU
    to each one-GPU mechanism, no CP row): the plan finding 6 of issue 42 found over budget."""
    usable = min(gpus, 8)
    launches = [m for m in MECHANISMS if m.cp == 1 and m.min_gpus <= usable]
    one_rank = usable == 1
    per = durations.launch_s + (0.0 if one_rank else durations.multi_rank_extra_s)
    return (durations.gpu_tests_s + durations.composition_s
            + len(launches) * per * durations.launch_scale)
