"""Verdict rows and the markdown report of ``make gpu-check``.

A mechanism PASSes when its training exited 0 and logged every iteration with a finite loss
and the memory figure; the prediction is shown beside the measurement, it does not decide the
verdict (the estimator is what the check calibrates). SKIP rows (a mechanism needing more GPUs
than present, a flag this checkout lacks) do not count; the exit status is 0 when no row FAILed.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron.memo_tools.gpu_check.measure import Measurement
from megatron.memo_tools.gpu_check.predict import Predicted

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Row:
    """One line of the report: a mechanism (or the GPU tests) and its verdict."""

    name: str
    verdict: str
    layout: str = ""
    measured: Optional[Measurement] = None
    predicted: Optional[Predicted] = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Header:
    """Where and when the figures were measured."""

    device_name: str
    gpu_count: int
    torch_version: str
    cuda_version: str
    commit: str
    date: str
    model: str
    hardware_profile: Optional[str]
    memory_metric: str  # the trainer's metric the measured peak is (mem_peak_allocated_mib)


def _cell(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(header: Header, rows: list[Row]) -> str:
    """The report as markdown: the header, then one table row per mechanism."""
    profile = (f"GPU profile `{header.hardware_profile}` of memo_ext/hardware.json"
               if header.hardware_profile else "no GPU profile matches, so no predictions")
    lines = [
        "# gpu-check report", "",
        f"Measured on {header.gpu_count} x {header.device_name} (torch {header.torch_version}, "
        f"CUDA {header.cuda_version}), commit {header.commit}, {header.date}. Predicted figures "
        f"are the estimator's (memo_ext.estimate, {profile}), not measurements.", "",
        f"Model: {header.model}.", "",
        f"Peak: the trainer's `{header.memory_metric}` per rank (max over ranks and the steady "
        "iterations) against the estimator's peak of allocated memory. Time: median iteration "
        "time of the steady iterations against the cost model's.", "",
        "| mechanism | verdict | layout | peak MiB | predicted peak MiB | measured / predicted "
        "| iteration s | predicted iteration s | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m, p = row.measured, row.predicted
        ratio = m.peak_mib / p.peak_mib if m and p and p.peak_mib > 0 else None
        notes = "; ".join(row.notes + ([p.basis] if p else [])).replace("|", "\\|")
        lines.append(
            f"| {row.name} | {row.verdict} | {row.layout or '-'} "
            f"| {_cell(m and m.peak_mib, 1)} | {_cell(p and p.peak_mib, 1)} | {_cell(ratio, 2)} "
            f"| {_cell(m and m.iteration_s, 4)} | {_cell(p and p.iteration_s, 4)} | {notes} |")
    counts = {v: sum(r.verdict == v for r in rows) for v in (PASS, FAIL, SKIP)}
    lines += ["", f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped.", ""]
    return "\n".join(lines)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` (or bytes) to ``path`` through a temporary file beside it and os.replace,
    so a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb" if isinstance(text, bytes) else "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def exit_status(rows: list[Row]) -> int:
    """0 when every row that was not skipped passed, else 1."""
    return 1 if any(row.verdict == FAIL for row in rows) else 0
