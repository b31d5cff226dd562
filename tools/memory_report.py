"""Summarize a PyTorch CUDA memory snapshot: a markdown table per device, optionally a plot.

    python tools/memory_report.py SNAPSHOT.pickle [--device N] [--plot out.png]

The snapshot is read with memo_ext.alloc's restricted unpickler (no code from the file runs).
Columns: trace events, allocated/reserved GiB (initial = before the trace's first event, which
starts mid-run; peak over the trace; final = at the dump), fragmentation = 1 - peak allocated /
peak reserved, segment events, OOMs. Exit code 2 with a one-line error for a missing file, a
rejected pickle or an unknown device.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not a package

from memo_ext.alloc import (  # noqa: E402  (needs the sys.path line above)
    DeviceSummary,
    load_snapshot,
    summarize_snapshot,
)

GIB = 1 << 30  # bytes per GiB


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


def plot(summaries: list[DeviceSummary], out: Path, title: str) -> None:
    """Write a PNG of allocated and reserved GiB vs event index, one panel per device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(summaries), 1, figsize=(10, 3 * len(summaries)), squeeze=False)
    for ax, s in zip(axes[:, 0], summaries):
        ax.plot(s.reserved_timeline / GIB, label="reserved", color="tab:orange")
        ax.plot(s.allocated_timeline / GIB, label="allocated", color="tab:blue")
        for k, oom in enumerate(s.ooms):
            label = "OOM" if k == 0 else None
            ax.axvline(oom.event_index, color="tab:red", linestyle="--", label=label)
        ax.set_title(f"{title}: device {s.device}")
        ax.set_xlabel("event index")
        ax.set_ylabel("GiB")
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", type=Path, help="pickle from torch.cuda.memory._dump_snapshot")
    parser.add_argument("--device", type=int, help="summarize only this device index")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="write a timeline plot")
    args = parser.parse_args(argv)

    try:
        summaries = summarize_snapshot(load_snapshot(args.snapshot), device=args.device)
    except OSError as exc:
        print(f"memory_report: cannot read {args.snapshot}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # SnapshotError (rejected or malformed) or an unknown --device
        print(f"memory_report: {exc}", file=sys.stderr)
        return 2
    print(markdown_table(summaries))
    if args.plot is not None:
        if summaries:
            plot(summaries, args.plot, args.snapshot.name)
            print(f"\nplot written to {args.plot}")
        else:
            print("\nno device has events or segments: no plot written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
