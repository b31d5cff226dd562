"""Kernel rows measured on a GPU, imported from a GPU evidence file into the estimator's data.

The source of every measured row is an evidence file that ``bench/gpu_evidence.py`` wrote on a
GPU (``bench/results/gpu_evidence_<gpu>.json``: one record per measurement). The installed
package never reads ``bench/``: ``python bench/gpu_evidence.py --import-rows FILE`` runs
:func:`import_evidence`, which derives the rows with :func:`entry_from_evidence` and writes them
into ``measured_kernels.json`` next to this module, under the hardware.json profile whose
``device_names`` match the GPU the evidence names. The table is derived, never edited by hand:
tests/unit/memo_ext/estimate/test_measured_kernels.py derives every entry again from its evidence file and checks
they agree.

An entry, in the kernel tables' own format (memo_ext/estimate/kernels.py), TFLOP/s:

* ``gemm``: one row per distinct bf16 (m, n, k) measured (C(m x n) = A(m x k) B(k x n),
  2*m*n*k FLOPs), with the layer shapes it stands for;
* ``attention``: one row per kernel, direction (forward, backward), causal flag, head dim and
  sequence length, FLOPs as the tables count them (forward 4*b*s^2*h*d over the query heads,
  halved when causal; backward 2.5x), the convention bench/gpu_evidence.py's
  ``attention_flops`` uses. ``kernel`` is the tables' name of the algorithm
  (:data:`KERNEL_NAMES`): the trainer's own tile ops as they dispatched (``memo tile ops``,
  their wrapper's cost included) give a kernel's rows where they ran it, torch's
  scaled_dot_product_attention backend of the same kernel otherwise; the ``backend`` field
  says which;
* ``provenance``: the evidence file (repository path), the commit and date of the run, the GPU
  as torch named it, torch, CUDA, cuDNN and driver versions.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

MEASURED_FILE = Path(__file__).with_name("measured_kernels.json")
REPO = Path(__file__).resolve().parents[2]

#: The evidence's trainer kernels (memo_ext.attention.kernels.kernel_for) and torch SDPA
#: backends, by the kernel tables' name of the algorithm they run. Backends not listed (sdpa
#: efficient) are kernels the trainer never dispatches: not imported.
KERNEL_NAMES = {"cuda_flash": "flash-attn-2", "sdpa flash (FA2)": "flash-attn-2",
                "cuda_cudnn": "cudnn", "cudnn": "cudnn", "sdpa cudnn": "cudnn"}
#: The evidence's backend names for the trainer's own tile ops, as dispatched and with their
#: FlashAttention-2 path forced (each record's ``kernel`` field says which kernel ran).
TILE_OPS = "memo tile ops (as dispatched)"
TILE_OPS_BACKENDS = (TILE_OPS, "memo tile ops (FA2 path)")

_COMMENT = ("Kernel rows measured on GPUs, derived from GPU evidence files by `python "
            "bench/gpu_evidence.py --import-rows bench/results/gpu_evidence_<gpu>.json` "
            "(memo_ext/estimate/measured_kernels.py). Do not edit: the evidence file named in "
            "each entry's provenance is the source, and tests/unit/memo_ext/estimate/test_measured_kernels.py "
            "checks this table against it. Keyed by hardware.json profile; the estimator "
            "prefers these rows to the published ones of kernel_tables.json "
            "(memo_ext/estimate/kernels.py, docs/estimate.md).")


class MeasuredRowsError(ValueError):
    """An evidence file that gives no rows; one line naming the file and what is wrong."""


def _records(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise MeasuredRowsError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MeasuredRowsError(f"{path}: not JSON ({exc.msg}, line {exc.lineno}); give the "
                                "gpu_evidence_<gpu>.json bench/gpu_evidence.py wrote") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) and "section" in r
                                                for r in records):
        raise MeasuredRowsError(f"{path}: not a GPU evidence file (a JSON list of records, "
                                "each with a 'section'); give the gpu_evidence_<gpu>.json "
                                "bench/gpu_evidence.py wrote")
    return records


def repo_path(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it (as provenance names
    it), else as given."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


def _measured(record: dict, *keys: str) -> bool:
    return record.get("status") == "measured" and all(
        isinstance(record.get(key), (int, float)) and record[key] > 0 for key in keys)


def _gemm_rows(records: list[dict]) -> list[dict]:
    shapes: dict[tuple, dict] = {}
    for r in records:
        if r["section"] != "gemm" or not _measured(r, "m", "n", "k", "tflops"):
            continue
        row = shapes.setdefault((r["m"], r["n"], r["k"]), {"tflops": [], "shapes": []})
        row["tflops"].append(r["tflops"])
        row["shapes"].append(f"{r.get('model', '?')} TP{r.get('tp', '?')} {r.get('layer', '?')} "
                             f"{r.get('direction', '?')}")
    return [{"m": m, "n": n, "k": k, "dtype": "bf16",
             "tflops": round(sorted(row["tflops"])[len(row["tflops"]) // 2], 1),
             "shapes": row["shapes"]}
            for (m, n, k), row in sorted(shapes.items())]


def _attention_rows(records: list[dict]) -> list[dict]:
    """One row per (kernel, direction, causal, head dim, length): the trainer's tile ops where
    they ran the kernel, else torch's SDPA backend of it."""
    chosen: dict[tuple, dict] = {}
    for r in records:
        if r["section"] != "attention" or not _measured(r, "seq", "head_dim", "forward_tflops",
                                                        "backward_tflops"):
            continue
        tile_ops = r["backend"] in TILE_OPS_BACKENDS
        kernel = KERNEL_NAMES.get(r.get("kernel") if tile_ops else r["backend"])
        if kernel is None:
            continue
        key = (kernel, bool(r["causal"]), r["head_dim"], r["seq"])
        if key in chosen and not tile_ops:
            continue
        chosen[key] = r
    rows = []
    for (kernel, causal, head_dim, seq), r in sorted(chosen.items()):
        for direction in ("forward", "backward"):
            rows.append({"kernel": kernel, "backend": r["backend"], "direction": direction,
                         "causal": causal, "head_dim": head_dim, "seq_len": seq,
                         "heads": r.get("heads"), "groups": r.get("groups"),
                         "dtype": r.get("dtype", "bf16"),
                         "tflops": round(r[f"{direction}_tflops"], 1)})
    return rows


def entry_from_evidence(path: Path) -> tuple[str, dict]:
    """(hardware.json profile, entry) of the rows the evidence file at ``path`` measured, or a
    MeasuredRowsError naming the file."""
    from memo_ext.estimate.memory import profile_for_device

    path = Path(path)
    records = _records(path)
    env = next((r for r in records if r["section"] == "env"), None)
    if env is None or not env.get("gpu"):
        raise MeasuredRowsError(f"{path}: no 'env' record naming the GPU (a dry run, or cut "
                                "off before it started?); nothing to import")
    profile = profile_for_device(env["gpu"])
    if profile is None:
        raise MeasuredRowsError(f"{path}: GPU {env['gpu']!r} matches no profile's device_names "
                                "in memo_ext/estimate/hardware.json; add a profile for it first")
    gemm, attention = _gemm_rows(records), _attention_rows(records)
    if not gemm and not attention:
        raise MeasuredRowsError(f"{path}: no measured GEMM or attention record (every one "
                                "'not measured' or an error); nothing to import")
    provenance = {"evidence": repo_path(path), "commit": env.get("commit", "?"),
                  "date": env.get("date", "?"), "gpu": env["gpu"]}
    provenance.update({key: env[key] for key in ("torch", "cuda", "cudnn", "driver")
                       if key in env})
    return profile["name"], {"provenance": provenance, "gemm": gemm, "attention": attention}


def read_table(path: Path = MEASURED_FILE) -> dict:
    """The measured table (``{"gpus": {profile: entry}}``); empty when there is none."""
    if not Path(path).exists():
        return {"_comment": _COMMENT, "gpus": {}}
    return json.loads(Path(path).read_text())


def import_evidence(evidence: Path, table: Path = MEASURED_FILE) -> tuple[str, dict]:
    """Derive the evidence file's rows and write them into ``table`` under their profile
    (replacing that profile's previous entry). Returns (profile, entry)."""
    profile, entry = entry_from_evidence(evidence)
    data = read_table(table)
    data["_comment"] = _COMMENT
    data.setdefault("gpus", {})[profile] = entry
    data["gpus"] = dict(sorted(data["gpus"].items()))
    tmp = Path(str(table) + ".tmp")
    tmp.write_text(_dumps(data))
    os.replace(tmp, table)
    measured_table.cache_clear()
    return profile, entry


def _dumps(data: dict) -> str:
    """The table as kernel_tables.json lays rows out: one row a line."""
    lines = ["{", f' "_comment": {json.dumps(data["_comment"])},', ' "gpus": {']
    gpus = list(data["gpus"].items())
    for index, (profile, entry) in enumerate(gpus):
        lines.append(f"  {json.dumps(profile)}: {{")
        lines.append(f'   "provenance": {json.dumps(entry["provenance"])},')
        for kind, comma in (("gemm", ","), ("attention", "")):
            rows = [f"    {json.dumps(row)}" for row in entry[kind]]
            lines += [f'   "{kind}": [', ",\n".join(rows), f"   ]{comma}"] if rows else \
                [f'   "{kind}": []{comma}']
        lines.append("  }" + ("," if index < len(gpus) - 1 else ""))
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=4)
def measured_table(path: Path = MEASURED_FILE) -> dict:
    return read_table(path)


def measured_entry(profile: str, path: Path = MEASURED_FILE) -> Optional[dict]:
    """The measured rows of the hardware.json profile ``profile``, or None."""
    return measured_table(path).get("gpus", {}).get(profile)


__all__ = ["KERNEL_NAMES", "MEASURED_FILE", "MeasuredRowsError", "entry_from_evidence",
           "import_evidence", "measured_entry", "measured_table", "read_table"]
