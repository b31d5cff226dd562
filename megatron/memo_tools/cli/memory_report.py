"""Summarize a PyTorch CUDA memory snapshot or an allocation trace, and replay it through the
allocator models.

    python tools/memory_report.py SNAPSHOT_OR_TRACE [--device N] [--capacity-gb G]
        [--policies caching,expandable,stitching,arena] [--plan PLAN.json] [--max-split-mb M]
        [--compare-recorded] [--no-host-stitching] [--plot out.png]

Input: a snapshot pickle from torch.cuda.memory._dump_snapshot (read with memo_ext.alloc's
restricted unpickler: no code from the file runs), or one of our trace files (.npz, or JSON
lines, possibly gzipped, with columns action, addr, size, stream, as tools/trace.py writes them;
see docs/allocator_models.md).

For a snapshot, the first table is the recorded run per device: trace events, allocated/reserved
GiB (initial = before the trace's first event, which starts mid-run; peak over the trace;
final = at the dump), fragmentation = 1 - peak allocated / peak reserved, segment events, OOMs.
Then one table per policy (default: all four) with what the model reserves at --capacity-gb
(default: unlimited); a snapshot's blocks live before the recording are allocated first. The
arena policy uses --plan (a plan of this trace from memo-plan, or {request, offset}
placements), or a best-fit plan of the trace itself. The stitching policy also
drives the real GMLake allocator on host memory (memo_ext.alloc.replay_host: memfd chunks,
stitched mmap views, every block filled with a pattern and verified at its free) and prints its
table beside the model's, unless --no-host-stitching. --compare-recorded (snapshots
only) replays the recorded events through the model of the recording allocator from the
reconstructed starting state and prints `recorded segment decisions matched: K/N`. --plot
writes OUT.png (the recorded timeline of a snapshot, or every policy's reserved bytes for a
trace) and OUT_<policy>.png per policy. Exit code 2 with a one-line error for a missing file, a
rejected or malformed input, an unknown device or a bad option.
"""
import argparse
import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from memo_ext.alloc import (
    POLICIES,
    DeviceSummary,
    HostReplayResult,
    RecordedComparison,
    ReplayResult,
    compare_recorded,
    load_plan,
    load_snapshot,
    load_trace,
    replay,
    replay_host,
    snapshot_trace,
    summarize_snapshot,
)

GIB = 1 << 30  # bytes per GiB
MIB = 1 << 20
PLOT_POINTS = 20_000  # timelines longer than this are reduced to per-bin maxima for plotting


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f}"


def markdown_table(summaries: list[DeviceSummary]) -> str:
    """One markdown row per device summary, then one line per OOM event."""
    lines = [
        "| device | events | initial alloc GiB | peak alloc GiB | peak reserved GiB "
        "| final alloc GiB | final reserved GiB | fragmentation | segment alloc/free "
        "| segment map/unmap | OOMs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s.device} | {s.num_events} | {_gib(s.initial_allocated_bytes)} "
            f"| {_gib(s.peak_allocated_bytes)} | {_gib(s.peak_reserved_bytes)} "
            f"| {_gib(s.final_allocated_bytes)} | {_gib(s.final_reserved_bytes)} "
            f"| {s.fragmentation:.1%} | {s.num_segment_alloc}/{s.num_segment_free} "
            f"| {s.num_segment_map}/{s.num_segment_unmap} | {len(s.ooms)} |"
        )
    for s in summaries:
        for oom in s.ooms:
            free = "unknown" if oom.device_free_bytes is None else _gib(oom.device_free_bytes)
            lines.append(
                f"\nOOM on device {s.device} at event {oom.event_index}: requested "
                f"{_gib(oom.requested_bytes)} GiB, device free {free} GiB"
            )
    return "\n".join(lines)


def _notes(r: ReplayResult) -> str:
    c = r.counters
    if r.policy == "stitching":
        return (f"exact hits {c['exact_hits']}, splits {c['splits']}, stitches {c['stitches']} "
                f"({_gib(c['stitched_bytes'])} GiB mapped)")
    if r.policy == "arena":
        return (f"arena {_gib(c['arena_bytes'])} GiB, planned {c['planned']}, "
                f"fallbacks {c['fallbacks']}, unplanned {c['unplanned']}")
    if r.policy == "expandable":
        return f"virtual ranges {c['virtual_ranges']}"
    return f"segments at end {c['final_segments']}"


def policy_table(policy: str, results: list[ReplayResult], capacity: int | None) -> str:
    """A markdown table of one policy's replay per device (event indices count the prologue)."""
    cap = "unlimited" if capacity is None else f"{_gib(capacity)} GiB"
    lines = [
        f"\n### policy {policy} (capacity {cap})\n",
        "| device | events | peak alloc GiB | peak reserved GiB | fragmentation "
        "| device malloc/free | reorganisations | OOM (first failing request) | notes |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        oom = "none"
        if r.oom is not None:
            oom = (f"{r.oom.count}x, first: event {r.oom.event_index}, "
                   f"{_gib(r.oom.request_bytes)} GiB on stream {r.oom.stream}")
        lines.append(
            f"| {r.device} | {r.num_events} | {_gib(r.peak_allocated_bytes)} "
            f"| {_gib(r.peak_reserved_bytes)} | {r.fragmentation:.1%} "
            f"| {r.device_mallocs}/{r.device_frees} | {r.reorganisations} | {oom} "
            f"| {_notes(r)} |"
        )
    return "\n".join(lines)


def host_stitching_table(results: list[HostReplayResult], model: list[ReplayResult],
                         capacity: int | None) -> str:
    """The real host allocator's replay per device, the model's peak reserved beside it."""
    cap = "unlimited" if capacity is None else f"{_gib(capacity)} GiB"
    lines = [
        f"\n### policy stitching: real allocator on host memory (capacity {cap})\n",
        "| device | peak alloc GiB | peak reserved GiB | model peak reserved GiB "
        "| peak mapped GiB | physical create/release | stitches | map calls (ms) "
        "| reorganisations | OOMs | blocks verified (stitched) | data errors | leaked |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r, m in zip(results, model):
        st = r.stats
        leaked = "none" if not any(r.leaked.values()) else \
            ", ".join(f"{k} {v}" for k, v in r.leaked.items() if v)
        oom = r.oom.count if r.oom is not None else 0
        errors = f"{r.data_errors}" + (f" ({r.first_error})" if r.data_errors else "")
        if r.invariant_error:
            errors += f"; invariant broken: {r.invariant_error}"
        lines.append(
            f"| {r.device} | {_gib(r.peak_allocated_bytes)} | {_gib(r.peak_reserved_bytes)} "
            f"| {_gib(m.peak_reserved_bytes)} | {_gib(r.peak_mapped_bytes)} "
            f"| {r.physical_creates}/{r.physical_releases} | {st['stitches']} "
            f"| {st['map_calls']} ({st['map_seconds'] * 1e3:.1f}) | {r.reorganisations} "
            f"| {oom} | {r.checked_blocks} ({r.stitched_checked}) | {errors} | {leaked} |"
        )
    return "\n".join(lines)


def comparison_report(comparisons: list[RecordedComparison]) -> str:
    """Per-device table, the mismatches, then the one `recorded segment decisions matched` line."""
    lines = [
        "\n### recorded vs model segment decisions\n",
        "| device | model | capacity GiB | capacity from | matched | recorded | model only "
        "| empty_cache inputs | OOMs reproduced |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in comparisons:
        cap = "unlimited" if c.capacity_bytes is None else f"{c.capacity_bytes / GIB:.3f}"
        lines.append(
            f"| {c.device} | {c.policy} | {cap} | {c.capacity_source} | {c.matched} "
            f"| {c.recorded} | {c.model_only} | {c.empty_cache_inputs} "
            f"| {c.reproduced_ooms}/{c.recorded_ooms} |"
        )
    for c in comparisons:
        for m in c.mismatches[:20]:
            lines.append(f"mismatch on device {c.device} at the request of event "
                         f"{m.event_index}: recorded {list(m.recorded)}, model {list(m.model)}")
        if len(c.mismatches) > 20:
            lines.append(f"... {len(c.mismatches) - 20} more mismatches on device {c.device}")
    k = sum(c.matched for c in comparisons)
    n = sum(c.recorded for c in comparisons)
    lines.append(f"\nrecorded segment decisions matched: {k}/{n}")
    return "\n".join(lines)


def _reduce(y: np.ndarray, points: int = PLOT_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """x positions and per-bin maxima, so peaks survive plotting a million-event timeline."""
    if len(y) <= points:
        return np.arange(len(y)), y
    bins = np.linspace(0, len(y), points + 1).astype(np.int64)
    return bins[:-1], np.maximum.reduceat(y, bins[:-1])


@contextlib.contextmanager
def _panels(rows: int, out: Path):
    """One figure of ``rows`` stacked panels (yields their axes), saved to ``out`` at the end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(10, 3 * rows), squeeze=False)
    yield axes[:, 0]
    for ax in axes[:, 0]:
        ax.set_xlabel("event index")
        ax.set_ylabel("GiB")
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot(summaries: list[DeviceSummary], out: Path, title: str) -> None:
    """Write a PNG of allocated and reserved GiB vs event index, one panel per device."""
    with _panels(len(summaries), out) as axes:
        for ax, s in zip(axes, summaries):
            ax.plot(s.reserved_timeline / GIB, label="reserved", color="tab:orange")
            ax.plot(s.allocated_timeline / GIB, label="allocated", color="tab:blue")
            for k, oom in enumerate(s.ooms):
                label = "OOM" if k == 0 else None
                ax.axvline(oom.event_index, color="tab:red", linestyle="--", label=label)
            ax.set_title(f"{title}: device {s.device}")


def plot_policy(results: list[ReplayResult], out: Path, title: str) -> None:
    """Write a PNG of one policy's modelled allocated and reserved GiB, one panel per device."""
    with _panels(len(results), out) as axes:
        for ax, r in zip(axes, results):
            x, y = _reduce(r.reserved_timeline)
            ax.plot(x, y / GIB, label="reserved (model)", color="tab:orange")
            x, y = _reduce(r.allocated_timeline)
            ax.plot(x, y / GIB, label="allocated", color="tab:blue")
            if r.capacity_bytes is not None:
                ax.axhline(r.capacity_bytes / GIB, color="gray", linestyle=":", label="capacity")
            if r.oom is not None:
                ax.axvline(r.oom.event_index, color="tab:red", linestyle="--", label="first OOM")
            ax.set_title(f"{title}: {r.policy}, device {r.device}, fragmentation "
                         f"{r.fragmentation:.1%}")


def plot_overview(by_policy: dict, out: Path, title: str) -> None:
    """Write a PNG of every policy's reserved GiB (and the allocated GiB), one panel per device."""
    devices = [r.device for r in next(iter(by_policy.values()))]
    with _panels(len(devices), out) as axes:
        for row, ax in enumerate(axes):
            for policy, results in by_policy.items():
                x, y = _reduce(results[row].reserved_timeline)
                ax.plot(x, y / GIB, label=f"reserved: {policy}")
            x, y = _reduce(next(iter(by_policy.values()))[row].allocated_timeline)
            ax.plot(x, y / GIB, label="allocated", color="black", linewidth=0.8)
            ax.set_title(f"{title}: device {devices[row]}")


def write_plots(out: Path, title: str, summaries, by_policy: dict) -> list[Path]:
    """OUT.png (recorded timeline of a snapshot, or all policies of a trace) and
    OUT_<policy>.png per policy; returns the paths written."""
    written = []
    if summaries:
        plot(summaries, out, title)
        written.append(out)
    elif summaries is None and by_policy:
        plot_overview(by_policy, out, title)
        written.append(out)
    for p, results in by_policy.items():
        if results:
            path = out.with_name(f"{out.stem}_{p}{out.suffix or '.png'}")
            plot_policy(results, path, title)
            written.append(path)
    return written


def _arena_plan(path: Path, trace_path: Path, snapshot):
    """--plan: a bi-level plan from memo-plan (tools/memo_plan.py) made for this trace, or a
    list of {request, offset} placements (memo_ext.alloc.load_plan)."""
    from memo_ext.planner.plan import PLAN_FORMAT, arena_plan, read_plan, validate_plan
    from memo_ext.trace import read_trace

    try:
        is_memo_plan = json.loads(path.read_text()).get("format") == PLAN_FORMAT
    except (AttributeError, UnicodeDecodeError, json.JSONDecodeError):
        is_memo_plan = False
    if not is_memo_plan:
        return load_plan(path)
    if snapshot is not None:
        raise ValueError(f"--plan {path}: a memo-plan plan is made for a trace from memo-trace, "
                         f"not for the snapshot {trace_path}")
    plan, trace = read_plan(path), read_trace(trace_path)
    try:
        validate_plan(plan, trace)
    except ValueError as exc:
        raise ValueError(f"--plan {path}: {exc}; plan {trace_path} with memo-plan") from None
    return replace(arena_plan(plan, trace), source=str(path))


def _is_snapshot(path: Path) -> bool:
    """Pickles start with the PROTO opcode 0x80; our traces are .npz (zip: "PK"), JSON lines,
    or gzipped JSON lines (0x1f 0x8b)."""
    with path.open("rb") as f:
        head = f.read(1)
    return head == b"\x80" or (head not in (b"P", b"\x1f", b"{", b"#", b"\n", b" ")
                               and path.suffix not in (".npz", ".jsonl", ".json", ".gz"))


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {bad[0] if bad else text!r}: choose from {','.join(POLICIES)}")
    return names


def _capacity(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive GiB, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, like the other errors
        print(f"memory_report: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("input", type=Path, metavar="SNAPSHOT_OR_TRACE",
                        help="pickle from torch.cuda.memory._dump_snapshot, or a .npz/.jsonl trace")
    parser.add_argument("--device", type=int, help="report only this device index")
    parser.add_argument("--capacity-gb", type=_capacity, metavar="G",
                        help="device memory the models may reserve, GiB (default: unlimited)")
    parser.add_argument("--policies", type=_policies, default=list(POLICIES),
                        help=f"comma-separated subset of {','.join(POLICIES)} (default: all)")
    parser.add_argument("--plan", type=Path, metavar="PLAN.json",
                        help="arena plan: a plan of this trace from memo-plan, or a JSON list "
                             "of {request, offset} (default: best fit)")
    parser.add_argument("--max-split-mb", type=_capacity, metavar="M",
                        help="caching policy: max_split_size in MiB (default: unlimited)")
    parser.add_argument("--compare-recorded", action="store_true",
                        help="replay a snapshot through the model of its allocator and count "
                             "the recorded segment decisions it reproduces")
    parser.add_argument("--no-host-stitching", action="store_true",
                        help="stitching policy: replay through the model only, not also "
                             "through the real allocator on host memory")
    parser.add_argument("--plot", type=Path, metavar="OUT.png",
                        help="write timeline plots (OUT.png and OUT_<policy>.png)")
    args = parser.parse_args(argv)
    capacity = None if args.capacity_gb is None else int(args.capacity_gb * GIB)
    max_split = None if args.max_split_mb is None else int(args.max_split_mb * MIB)

    try:
        snapshot = load_snapshot(args.input) if _is_snapshot(args.input) else None
        if snapshot is None:
            if args.compare_recorded:
                raise ValueError(f"{args.input}: --compare-recorded needs a memory snapshot "
                                 "(a trace file has no recorded segment decisions)")
            trace = load_trace(args.input)
            if args.device not in (None, 0):
                raise ValueError(f"no device {args.device} in this trace (a trace file holds "
                                 "device 0 only)")
            traces, summaries = [trace], None
        else:
            summaries = summarize_snapshot(snapshot, device=args.device)
            traces = [snapshot_trace(snapshot, s.device, name=args.input.name)
                      for s in summaries]
        plan = _arena_plan(args.plan, args.input, snapshot) if args.plan is not None else None
        if plan is not None and len(traces) > 1:
            raise ValueError("--plan applies to one device: choose it with --device")
        by_policy = {
            p: [replay(t, p, capacity, max_split_size=max_split if p == "caching" else None,
                       plan=plan if p == "arena" else None) for t in traces]
            for p in args.policies
        }
        host = ([replay_host(t, capacity) for t in traces]
                if "stitching" in by_policy and not args.no_host_stitching else None)
        comparisons = (compare_recorded(snapshot, device=args.device, capacity_bytes=capacity)
                       if args.compare_recorded else None)
    except OSError as exc:
        print(f"memory_report: cannot read {exc.filename or args.input}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # SnapshotError, TraceError, PlanError, an unknown --device
        message = " ".join(str(exc).split())  # one line, whatever the file held
        print(f"memory_report: {message}", file=sys.stderr)
        return 2

    if summaries is not None:
        print(markdown_table(summaries))
    else:
        t = traces[0]
        print(f"trace {args.input.name}: {len(t)} events, {t.num_allocs} allocations, "
              f"{len(np.unique(t.streams))} stream(s)")
    for p, results in by_policy.items():
        print(policy_table(p, results, capacity))
        if p == "stitching" and host is not None:
            print(host_stitching_table(host, results, capacity))
    if comparisons is not None:
        print(comparison_report(comparisons))
    if args.plot is not None:
        try:
            written = write_plots(args.plot, args.input.name, summaries, by_policy)
        except OSError as exc:
            print(f"memory_report: cannot write plot {exc.filename or args.plot}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return 2
        if written:
            print(f"\nplots written: {', '.join(map(str, written))}")
        else:
            print("\nno device has events or segments: no plot written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
