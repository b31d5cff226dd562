"""Replay speed of the allocator models (events per second), on a synthetic trace of 1M+ events
and on the real snapshots in ../shared/data/snapshots.

    python bench/allocator_replay.py [--events 1200000] [--repeats 3] [--out bench/results]

Writes OUT/allocator_replay.md (tables) and OUT/allocator_replay.png (bar chart). Each number is
the best of --repeats calls of memo_ext.alloc.replay (the Python API, timelines on: what
tools/memory_report.py does), so it includes the Python-side preparation; the arena policy gets
its plan beforehand (planning time is reported on its own line). The synthetic trace imitates
training steps: per layer, activations kept for the backward pass and short-lived temporaries
whose sizes vary with the micro-batch's sequence length, a second stream for communication
buffers, and a few large optimizer buffers.
"""
import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memo_ext import _C  # noqa: E402
from memo_ext.alloc import (  # noqa: E402
    POLICIES,
    SnapshotError,
    AllocatorTrace,
    best_fit_plan,
    load_snapshot,
    replay,
    snapshot_trace,
)

SNAPSHOTS = REPO.parent / "shared" / "data" / "snapshots"
MiB, GiB = 1 << 20, 1 << 30


def synthetic_trace(num_events: int, seed: int = 0) -> AllocatorTrace:
    """Training-like alloc/free events until at least ``num_events`` rows."""
    rng = random.Random(seed)
    actions, ids, sizes, streams = [], [], [], []
    next_id = 0

    def alloc(size, stream=0):
        nonlocal next_id
        actions.append(_C.ALLOC)
        ids.append(next_id)
        sizes.append(size)
        streams.append(stream)
        next_id += 1
        return next_id - 1

    def free(i):
        actions.append(_C.FREE)
        ids.append(i)
        sizes.append(0)
        streams.append(0)

    hidden, layers = 4096, 24
    optimizer = [alloc(rng.choice([64, 128, 256]) * MiB) for _ in range(8)]
    while len(actions) < num_events:
        seq = rng.choice([1024, 2048, 3072, 4096])  # tokens of this micro-batch
        act = seq * hidden * 2  # bytes of one bf16 activation
        kept = []
        for _ in range(layers):  # forward
            kept.append(alloc(act))
            kept.append(alloc(act * 4 // 3))
            tmp = [alloc(rng.randint(1, 64) * 1024) for _ in range(rng.randint(3, 8))]
            big = alloc(act * 4)
            for i in reversed(tmp):
                free(i)
            free(big)
            if rng.random() < 0.3:  # a communication buffer on the second stream
                c = alloc(act, stream=7)
                free(c)
        for _ in range(layers):  # backward
            grad = alloc(act * 4)
            tmp = [alloc(rng.randint(1, 256) * 1024) for _ in range(rng.randint(2, 6))]
            free(kept.pop())
            free(kept.pop())
            for i in tmp:
                free(i)
            free(grad)
    for i in optimizer:
        free(i)
    return AllocatorTrace(np.array(actions), np.array(ids), np.array(sizes), np.array(streams),
                 name=f"synthetic ({len(actions)} events)")


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(trace: AllocatorTrace, repeats: int, capacity=None) -> dict:
    """policy -> (events/s, result) for one trace."""
    plan = best_fit_plan(trace)
    out = {}
    for p in POLICIES:
        kw = {"plan": plan} if p == "arena" else {}
        result = replay(trace, p, capacity, **kw)
        seconds = best_time(lambda p=p, kw=kw: replay(trace, p, capacity, **kw), repeats)
        out[p] = (len(trace) / seconds, result)
    return out


def machine() -> str:
    from memo_ext.estimate.cpu_profile import cpu_name

    cpu = cpu_name()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} cores, load average {load} (1/5/15 min) at the start"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    where = machine()

    t0 = time.perf_counter()
    trace = synthetic_trace(args.events)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    best_fit_plan(trace)
    plan_s = time.perf_counter() - t0
    unlimited = measure(trace, args.repeats)
    peak_alloc = unlimited["caching"][1].peak_allocated_bytes
    tight_capacity = int(peak_alloc * 1.05)
    tight = measure(trace, args.repeats, tight_capacity)

    real = []  # (file, device, events, {policy: events/s})
    for path in sorted(SNAPSHOTS.glob("*.pickle")) if SNAPSHOTS.is_dir() else []:
        try:
            snap = load_snapshot(path)
        except (OSError, SnapshotError) as exc:
            print(f"skipping {path.name}: {exc}", file=sys.stderr)
            continue
        for d, events in enumerate(snap.get("device_traces", [])):
            if events:
                t = snapshot_trace(snap, d, name=path.name)
                rates = {p: r for p, (r, _) in measure(t, max(args.repeats, 10)).items()}
                real.append((path.name, d, len(t), rates))

    lines = [
        "# Allocator model replay speed",
        "",
        f"Measured by `bench/allocator_replay.py --events {args.events} --repeats "
        f"{args.repeats}` on {where}. CPU only; the machine is shared with other jobs, so "
        "these are lower bounds. Each rate is the best of the repeats of one "
        "`memo_ext.alloc.replay` call (Python API, C++ replay loop, allocated/reserved "
        "timelines written for every event).",
        "",
        f"## Synthetic trace: {len(trace):,} events ({trace.num_allocs:,} allocations, "
        "2 streams)",
        "",
        f"Generated in {gen_s:.1f} s; the best-fit arena plan took {plan_s:.2f} s "
        f"({len(trace) / plan_s / 1e6:.1f} M events/s) and is made before timing the arena "
        f"policy. Tight capacity = 1.05 x peak allocated = {tight_capacity / GiB:.2f} GiB.",
        "",
        "| policy | M events/s (unlimited) | M events/s (tight) | peak reserved GiB (unlimited) "
        "| fragmentation (unlimited) | reorganisations (tight) | OOMs (tight) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in POLICIES:
        rate, r = unlimited[p]
        trate, tr = tight[p]
        lines.append(
            f"| {p} | {rate / 1e6:.2f} | {trate / 1e6:.2f} | {r.peak_reserved_bytes / GiB:.2f} "
            f"| {r.fragmentation:.1%} | {tr.reorganisations} "
            f"| {tr.oom.count if tr.oom else 0} |")
    lines += ["", f"Peak allocated: {peak_alloc / GiB:.2f} GiB (the same for every policy)."]
    short = [p for p in POLICIES if tight[p][1].oom is not None]
    if short:
        lines.append(f"At the tight capacity {', '.join(short)} run out of memory (the failing "
                     "requests are skipped and the replay goes on): they need more than "
                     f"{tight_capacity / GiB:.2f} GiB for this trace; the others fit.")
    lines.append("")
    if real:
        lines += [
            "## Real snapshots (unlimited capacity, blocks live before the recording allocated "
            "first)",
            "",
            "Small traces (10^2 to 10^4 events), so fixed per-call costs (building the "
            "result, copying the timelines) weigh more than on the synthetic trace.",
            "",
            "| snapshot | device | events | " + " | ".join(f"{p} M ev/s" for p in POLICIES)
            + " |",
            "|---|---:|---:|" + "---:|" * len(POLICIES),
        ]
        for name, d, n, rates in real:
            lines.append(f"| {name} | {d} | {n:,} | "
                         + " | ".join(f"{rates[p] / 1e6:.2f}" for p in POLICIES) + " |")
    lines.append("")
    md = args.out / "allocator_replay.md"
    md.write_text("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    groups = [("synthetic, unlimited", {p: unlimited[p][0] for p in POLICIES}),
              ("synthetic, tight", {p: tight[p][0] for p in POLICIES})]
    groups += [(f"{name.split('.')[0][:22]}\ndev {d} ({n:,} ev)", rates)
               for name, d, n, rates in real]
    width = 0.8 / len(POLICIES)
    for k, p in enumerate(POLICIES):
        ax.bar([g + k * width for g in range(len(groups))],
               [rates[p] / 1e6 for _, rates in groups], width, label=p)
    ax.axhline(1.0, color="gray", linestyle=":", label="1 M events/s")
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([label for label, _ in groups], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("M events / s")
    ax.set_title("Allocator model replay speed (measured, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = args.out / "allocator_replay.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(md.read_text())
    print(f"written: {md}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
