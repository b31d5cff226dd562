"""A layout's prediction at one sequence length: each traced stage's memory and iteration time,
the node's host memory, and the verdict (fits, or where it runs out)."""

from __future__ import annotations

from dataclasses import dataclass

from memo_ext.estimate.cost import StepTime
from memo_ext.estimate.layout.spec import Layout, Stage
from memo_ext.estimate.memory import MemoryEstimate

@dataclass
class StagePrediction:
    """One traced stage at one sequence length: its rank's memory and the iteration's time as
    that stage's pace would set it."""

    stage: Stage
    memory: MemoryEstimate
    step: StepTime
    host_slots: tuple = ()  # MEMO's host slots, bytes each (memo_ext.estimate.host_memory)


@dataclass
class Prediction:
    """A layout at one sequence length: memory (per traced stage) and time (per iteration)."""

    layout: Layout
    seq: int
    stages: list[StagePrediction]
    host_capacity_bytes: int
    ranks_per_node: int
    device_type: str = "cuda"  # "cpu": the CPU trainer (no page-locked memory)
    #: Which kernel rows priced the step (memo_ext.estimate.kernels.kernel_rows_line).
    kernel_rows: str = ""
    #: --optimizer-cpu-offload's host tensors by rank (memo_ext.estimate.host_memory)
    host_optimizer: object = None

    @property
    def worst_stage(self) -> StagePrediction:
        """The stage that fails first, else the one with the highest peak."""
        return max(self.stages, key=lambda p: (not p.memory.fits, p.memory.peak_device_bytes))

    @property
    def memory(self) -> MemoryEstimate:
        return self.worst_stage.memory

    @property
    def step(self) -> StepTime:
        """The slowest stage's iteration: 1F1B runs at the pace of its slowest stage."""
        return max((p.step for p in self.stages), key=lambda step: step.step_s)

    @property
    def peak_device_bytes(self) -> int:
        return self.memory.peak_device_bytes

    @property
    def step_s(self) -> float:
        return self.step.step_s

    @property
    def mfu(self) -> float:
        return self.step.mfu

    def describe(self) -> str:
        return self.layout.describe()

    @property
    def host_memory(self):
        """The worst node's host bytes by named term (memo_ext.estimate.host_memory): each
        local rank's own offload slots (page-locked, whole pages, on CUDA), per-process and
        data-loader memory, the kernel's page map."""
        if getattr(self, "_host_memory", None) is None:
            from memo_ext.estimate.host_memory import prediction_host_memory

            self._host_memory = prediction_host_memory(self)
        return self._host_memory

    @property
    def host_bytes_per_node(self) -> int:
        """Host bytes the worst node needs, every term of :attr:`host_memory` (the offload
        arena alone: ``host_memory.arena_bytes``)."""
        return self.host_memory.total_bytes

    @property
    def host_fits(self) -> bool:
        return self.host_bytes_per_node <= self.host_capacity_bytes

    @property
    def fits(self) -> bool:
        return self.memory.fits and self.host_fits

    def verdict(self) -> str:
        """FITS, or OOM and where: device (which rank, the failing request, the largest
        category at the peak) or host."""
        if not self.memory.fits:
            worst = self.worst_stage
            where = f"rank {worst.stage.rank}"
            if self.layout.pp > 1:
                where += f", pipeline stage {worst.stage.index}"
            request = worst.memory.oom_request_bytes
            if request:
                where += f": a {request / (1 << 30):.2f} GiB request fails"
            categories = worst.memory.peak_by_category
            if categories:
                name = max(categories, key=categories.get)
                where += f"; largest at the peak: {name} {categories[name] / (1 << 30):.2f} GiB"
            return f"OOM on device ({where})"
        if not self.host_fits:
            host = self.host_memory
            optimizer = host.terms.get("optimizer_offload", 0)
            rest = host.total_bytes - host.arena_bytes - optimizer
            return (f"OOM on host ({host.total_bytes / 1e9:.0f} GB per node > "
                    f"{self.host_capacity_bytes / 1e9:.0f} GB: offloaded activations "
                    f"{host.arena_bytes / 1e9:.0f} GB, "
                    + (f"offloaded optimizer {optimizer / 1e9:.0f} GB, " if optimizer else "")
                    + f"processes, data loader and kernel {rest / 1e9:.0f} GB)")
        return "FITS"
