"""The real GMLake stitching allocator on host memory, replaying every real snapshot.

    python bench/stitching.py                 # all snapshots, 3 fragmentation limits: ~20 s
    python bench/stitching.py --quick -o DIR  # one small snapshot, a short fuzz: seconds

For each device trace of each snapshot in ../shared/data/snapshots (blocks live before the
recording allocated first, unlimited capacity): the caching model's and the stitching model's
peaks (memo_ext.alloc.replay), beside a replay through the real allocator
(memo_ext.alloc.replay_host: memfd physical chunks, stitched blocks as mmap views, every block
filled with a pattern and verified when freed, torn down at the end and checked for leaks).
Then the real allocator at lower fragmentation limits (more requests stitched), and the
randomized fuzzer against its oracle. Measured on this machine's host memory (no GPU): the
peaks are the allocator's decisions, which the model predicts exactly; the times are host
mmap/memfd costs, not cuMemMap's.

Outputs in ``--output-dir`` (default bench/results): ``stitching.md``, ``stitching.json`` and
``stitching.png`` (peak reserved per trace: caching model, stitching model, real allocator).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from memo_ext import _C  # noqa: E402
from memo_ext.alloc import load_snapshot, replay, replay_host, snapshot_trace  # noqa: E402

# bench.common has these too, but importing it loads torch and megatron (~8 s on 2 cores) for
# what this bench does not need.
MiB, GiB = 1 << 20, 1 << 30


def gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / GiB:.2f}"


SNAPSHOTS = REPO_ROOT.parent / "shared" / "data" / "snapshots"
REPORT_MD = "stitching.md"
REPORT_JSON = "stitching.json"
PLOT = "stitching.png"
DEFAULT_FRAG_LIMIT = _C.STITCHING_CONSTANTS["kDefaultFragLimit"]
SWEEP_FRAG_LIMITS = (32 * MiB, 4 * MiB)
QUICK_SNAPSHOT = "transformer_small_from_empty.pickle"
# GMLake's reported mapping cost on an A100 (spec: ~80 us per 2 MiB page, cuMemMap+SetAccess).
PAPER_MAP_US_PER_2MIB = 80


def traces(names: list[str]):
    """(snapshot name, AllocatorTrace) for every device with events."""
    for name in names:
        snapshot = load_snapshot(SNAPSHOTS / name)
        for device in range(len(snapshot.get("device_traces", []))):
            t = snapshot_trace(snapshot, device, name=name)
            if len(t):
                yield name, t


def same_decisions(real, model) -> bool:
    return (np.array_equal(real.decision_events, model.decision_events)
            and np.array_equal(real.decision_kinds, model.decision_kinds)
            and np.array_equal(real.decision_sizes, model.decision_sizes))


def measure(name: str, t, frag_limit: int) -> dict:
    caching = replay(t, "caching", timelines=False)
    model = replay(t, "stitching", frag_limit=frag_limit, timelines=False)
    real = replay_host(t, frag_limit=frag_limit, log=True, timelines=False)
    s = real.stats
    return {
        "snapshot": name, "device": t.device, "events": len(t), "frag_limit": frag_limit,
        "peak_allocated": real.peak_allocated_bytes,
        "caching_peak_reserved": caching.peak_reserved_bytes,
        "model_peak_reserved": model.peak_reserved_bytes,
        "real_peak_reserved": real.peak_reserved_bytes,
        "real_peak_mapped": real.peak_mapped_bytes,
        "same_decisions": same_decisions(real, model),
        "physical_creates": real.physical_creates, "physical_releases": real.physical_releases,
        "stitches": s["stitches"], "splits": s["splits"], "exact_hits": s["exact_hits"],
        "stitched_bytes": s["stitched_bytes"], "map_calls": s["map_calls"],
        "map_seconds": s["map_seconds"], "reserve_seconds": s["reserve_seconds"],
        "create_seconds": s["create_seconds"],
        "checked_blocks": real.checked_blocks, "stitched_checked": real.stitched_checked,
        "checked_bytes": real.checked_bytes, "data_errors": real.data_errors,
        "invariant_error": real.invariant_error, "leaked": real.leaked,
        "ooms": real.oom.count if real.oom else 0,
        "peak_resident_bytes": real.peak_resident_bytes, "replay_seconds": real.seconds,
    }


# ------------------------------------------------------------------------------------ report

def _frag(allocated: int, reserved: int) -> str:
    return f"{1 - allocated / reserved:.1%}" if reserved else "-"


def report_lines(rows: list[dict], sweep: list[dict], fuzz: dict, argv: list[str],
                 seconds: float, load: tuple) -> list[str]:
    command = " ".join(["python bench/stitching.py", *(shlex.quote(a) for a in argv)])
    lines = [
        "# GMLake stitching, the real allocator on host memory", "",
        "Measured on the CPU dev machine (no GPU): "
        f"{os.cpu_count()} cores ({platform.machine()}), Linux {platform.release()}, "
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the start, shared "
        "with other jobs. Each trace is replayed through the real allocator of "
        "csrc/stitching_allocator.h over memfd/mmap (memo_ext.alloc.replay_host): physical "
        "chunks are memfd files, a stitched block one contiguous mmap range whose pieces map "
        "several chunks. The caching and stitching columns are the allocator models "
        "(memo_ext.alloc.replay), predictions.", "",
        f"Command: `{command}` (total {seconds:.0f} s).", "",
        "Data check (csrc/stitching_check.h): each block gets a 64-bit pattern of its request "
        "and offset in its first and last 4 KiB and 4 KiB at every 2 MiB (the whole block when "
        "it is at most 8 KiB); when freed (or at the end) every word is read back through the "
        "block's address and through each physical piece's own view. Leaks: after the "
        "teardown the backend holds no memfd, no reserved range, no mapping.", "",
        f"## Every snapshot, default fragmentation limit ({DEFAULT_FRAG_LIMIT // MiB} MiB)", "",
        "| snapshot | device | events | peak allocated GiB | caching model peak reserved GiB "
        "| stitching model peak reserved GiB | real peak reserved GiB | real fragmentation "
        "| real = model decisions | peak mapped GiB | physical create/release | stitches "
        "| splits | exact hits | blocks verified (stitched) | data errors | leaked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        leaked = "none" if not any(r["leaked"].values()) else json.dumps(r["leaked"])
        lines.append(
            f"| {r['snapshot']} | {r['device']} | {r['events']} | {gib(r['peak_allocated'])} "
            f"| {gib(r['caching_peak_reserved'])} | {gib(r['model_peak_reserved'])} "
            f"| {gib(r['real_peak_reserved'])} "
            f"| {_frag(r['peak_allocated'], r['real_peak_reserved'])} "
            f"| {'yes' if r['same_decisions'] else 'NO'} | {gib(r['real_peak_mapped'])} "
            f"| {r['physical_creates']}/{r['physical_releases']} | {r['stitches']} "
            f"| {r['splits']} | {r['exact_hits']} | {r['checked_blocks']} "
            f"({r['stitched_checked']}) | {r['data_errors']} | {leaked} |")
    saved = [(r["caching_peak_reserved"] - r["real_peak_reserved"]) for r in rows]
    not_above = sum(r["real_peak_reserved"] <= r["caching_peak_reserved"] for r in rows)
    lines += [
        "",
        f"Real peak reserved <= the caching model's on {not_above}/{len(rows)} traces; it saves "
        f"{gib(sum(saved))} GiB over all of them (largest saving "
        f"{gib(max(saved, default=0))} GiB). Real and stitching-model decision logs (every "
        "physical create and release, with its event and size) are identical on "
        f"{sum(r['same_decisions'] for r in rows)}/{len(rows)} traces.", "",
        "## Cost of the host system calls", "",
        "| snapshot | device | map+unmap calls | map ms | reserve ms | memfd create/release ms "
        "| stitched GiB | us per map call | replay s (checks included) "
        "| process peak RSS MiB (Python and torch included) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        per_call = r["map_seconds"] / r["map_calls"] * 1e6 if r["map_calls"] else 0.0
        lines.append(
            f"| {r['snapshot']} | {r['device']} | {r['map_calls']} "
            f"| {r['map_seconds'] * 1e3:.1f} | {r['reserve_seconds'] * 1e3:.1f} "
            f"| {r['create_seconds'] * 1e3:.1f} | {gib(r['stitched_bytes'])} | {per_call:.1f} "
            f"| {r['replay_seconds']:.2f} | {r['peak_resident_bytes'] / MiB:.0f} |")
    lines += [
        "",
        "A host mmap maps a whole range in one call without touching its pages, so its cost "
        "is per call, not per byte; GMLake reports ~"
        f"{PAPER_MAP_US_PER_2MIB} us per 2 MiB page for cuMemMap + cuMemSetAccess on an A100 "
        "(not measured here: the CUDA backend has not run on a GPU in this project).", "",
    ]
    if sweep:
        lines += [
            "## Lower fragmentation limits (real allocator)", "",
            "More requests go to the stitching pools. Whether that helps depends on the trace: "
            "the pools never merge freed pieces back and stitched blocks serve exact sizes only.",
            "",
            "| snapshot | device | frag limit MiB | caching model peak reserved GiB "
            "| real peak reserved GiB | real fragmentation | real = model decisions "
            "| stitches | data errors | leaked |",
            "|---|---:|---:|---:|---:|---:|---|---:|---:|---|",
        ]
        for r in sweep:
            leaked = "none" if not any(r["leaked"].values()) else json.dumps(r["leaked"])
            lines.append(
                f"| {r['snapshot']} | {r['device']} | {r['frag_limit'] // MiB} "
                f"| {gib(r['caching_peak_reserved'])} | {gib(r['real_peak_reserved'])} "
                f"| {_frag(r['peak_allocated'], r['real_peak_reserved'])} "
                f"| {'yes' if r['same_decisions'] else 'NO'} | {r['stitches']} "
                f"| {r['data_errors']} | {leaked} |")
        lines.append("")
    errors = sum(fuzz[k] for k in ("va_overlaps", "phys_overlaps", "data_errors",
                                   "invariant_errors", "accounting_errors", "shape_errors"))
    residue = sum(fuzz[k] for k in fuzz if k.startswith(("residual_", "teardown_")))
    lines += [
        "## Randomized fuzzer against an oracle", "",
        f"`_C.fuzz_stitching(seed={fuzz['seed']}, ops={fuzz['ops']})` (csrc/stitching_check.h): "
        "mixed sizes (512 B to 320 MiB), 2 streams, fragmentation limit 4 MiB, at most 64 "
        "stitched blocks cached, up to 48 blocks live, empty_cache 0.3% of the time. The oracle "
        "checks that no two live blocks share an address or a physical byte, the pattern of "
        "every block (re-read every 4096 operations), the allocator's invariants and byte "
        "counts every 512 operations; then everything is freed and released, and a second "
        "allocator is torn down with blocks in use.", "",
        "| operations | allocs | normal / primitive / stitched | stitches | StitchFree drops "
        "| empty_cache | errors | residue after release and teardown | seconds |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        f"| {fuzz['ops']} | {fuzz['allocs']} | {fuzz['normal_allocs']} / "
        f"{fuzz['primitive_allocs']} / {fuzz['stitched_allocs']} | {fuzz['stats']['stitches']} "
        f"| {fuzz['stats']['sblocks_dropped']} | {fuzz['empty_caches']} | {errors} | {residue} "
        f"| {fuzz['seconds']:.1f} |", "",
        "The same fuzzer built with AddressSanitizer and UndefinedBehaviorSanitizer runs in the "
        "slow test `test_fuzzer_under_address_sanitizer` (100k operations, then 30k at a 1 GiB "
        "capacity).", "",
        "Plot: `stitching.png` (peak reserved and fragmentation per trace).", "",
    ]
    return lines


def plot(out_dir: Path, rows: list[dict]) -> None:
    """Two panels per trace: peak reserved GiB (log scale) and fragmentation = 1 - peak
    allocated / peak reserved, for the caching model, the stitching model and the real
    allocator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['snapshot'].removesuffix('.pickle')[:18]}\ndev {r['device']}" for r in rows]
    x = np.arange(len(rows))
    width = 0.27
    series = (("caching_peak_reserved", "caching model"),
              ("model_peak_reserved", "stitching model"),
              ("real_peak_reserved", "real allocator (host)"))
    fig, axes = plt.subplots(2, 1, figsize=(max(9, 1.5 * len(rows)), 7.5), sharex=True)
    for k, (key, label) in enumerate(series):
        axes[0].bar(x + (k - 1) * width, [r[key] / GiB for r in rows], width, label=label)
        axes[1].bar(x + (k - 1) * width,
                    [100 * (1 - r["peak_allocated"] / r[key]) for r in rows], width, label=label)
    axes[0].scatter(x, [r["peak_allocated"] / GiB for r in rows], color="black", marker="_",
                    s=400, zorder=3, label="peak allocated")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("peak reserved GiB")
    axes[0].set_title("Real snapshots, default fragmentation limit (128 MiB)")
    axes[1].set_ylabel("fragmentation %\n(1 - peak allocated / peak reserved)")
    axes[1].set_xticks(x, labels, fontsize=7, rotation=20)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / PLOT, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------- main

def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"only {QUICK_SNAPSHOT}, no sweep, 5000 fuzz operations")
    parser.add_argument("-o", "--output-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--fuzz-ops", type=int, default=None,
                        help="fuzzer operations (default 100000; --quick 5000)")
    cli = parser.parse_args(argv)
    if not SNAPSHOTS.is_dir():
        raise SystemExit(f"no snapshots at {SNAPSHOTS}: this bench replays the real snapshots "
                         "of shared/data/snapshots beside the repository")
    names = [QUICK_SNAPSHOT] if cli.quick else sorted(p.name for p in SNAPSHOTS.glob("*.pickle"))
    out_dir = cli.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    started = time.perf_counter()
    rows, sweep = [], []
    for name, t in traces(names):
        r = measure(name, t, DEFAULT_FRAG_LIMIT)
        rows.append(r)
        print(f"{name} device {t.device}: real {gib(r['real_peak_reserved'])} GiB, model "
              f"{gib(r['model_peak_reserved'])}, caching {gib(r['caching_peak_reserved'])}, "
              f"same decisions {r['same_decisions']}, data errors {r['data_errors']}",
              flush=True)
        if not cli.quick:
            for limit in SWEEP_FRAG_LIMITS:
                sweep.append(measure(name, t, limit))
    ops = cli.fuzz_ops if cli.fuzz_ops is not None else (5000 if cli.quick else 100_000)
    seed = 20261122
    fuzz = dict(_C.fuzz_stitching(seed=seed, ops=ops))
    fuzz["stats"] = dict(fuzz["stats"])
    fuzz["seed"] = seed
    seconds = time.perf_counter() - started
    lines = report_lines(rows, sweep, fuzz, argv, seconds, load)
    (out_dir / REPORT_MD).write_text("\n".join(lines))
    payload = {"argv": argv, "seconds": seconds, "load_average": load, "rows": rows,
               "sweep": sweep, "fuzz": fuzz}
    (out_dir / REPORT_JSON).write_text(json.dumps(payload, indent=1))
    plot(out_dir, rows)
    print((out_dir / REPORT_MD).read_text())
    return payload


if __name__ == "__main__":
    main()
