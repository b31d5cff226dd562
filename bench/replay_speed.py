"""Speed of the C++ trace replay (memo_ext._C.replay_live_bytes, csrc/trace_replay.cpp) against a
tight pure-Python loop doing the same work over the same int64 arrays (a dict of live blocks,
list timelines), on a synthetic 1M-event trace: allocs and frees over 20k addresses, 2% segment
events. The figure csrc/trace_replay.cpp's header quotes comes from here.

    python bench/replay_speed.py [--events 1000000] [--repeats 3] [--out bench/results]

Writes OUT/replay_speed.md. Each time is the best of --repeats runs.
"""
import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memo_ext import _C  # noqa: E402


def synthetic(n: int, addresses: int = 20_000, seed: int = 0):
    """Columns (action, addr, size): an alloc of a free address or a free of a live one, 2% segment
    allocs/frees."""
    rng = np.random.default_rng(seed)
    actions = np.empty(n, np.int64)
    addrs = rng.integers(0, addresses, n) * 4096
    sizes = rng.integers(1, 1 << 20, n)
    live = set()
    segment = rng.random(n) < 0.02
    for i in range(n):
        if segment[i]:
            actions[i] = _C.SEGMENT_ALLOC if i % 2 else _C.SEGMENT_FREE
        elif addrs[i] in live:
            actions[i] = _C.FREE
            live.discard(addrs[i])
        else:
            actions[i] = _C.ALLOC
            live.add(addrs[i])
    return actions, addrs, sizes


def python_replay(actions, addrs, sizes):
    """The pure-Python loop the C++ replaces (same rules, no checks)."""
    ALLOC, FREE, SA, SF = _C.ALLOC, _C.FREE, _C.SEGMENT_ALLOC, _C.SEGMENT_FREE
    live, allocated, reserved, atl, rtl = {}, 0, 0, [], []
    for a, addr, s in zip(actions.tolist(), addrs.tolist(), sizes.tolist()):
        if a == ALLOC:
            live[addr] = s
            allocated += s
        elif a == FREE:
            allocated -= live.pop(addr, s)
        elif a == SA:
            reserved += s
        elif a == SF:
            reserved -= s
        atl.append(allocated)
        rtl.append(reserved)
    return atl, rtl


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args()
    load = os.getloadavg()[0]
    actions, addrs, sizes = synthetic(args.events)
    t_py, (atl, rtl) = best(lambda: python_replay(actions, addrs, sizes), args.repeats)
    t_cpp, r = best(lambda: _C.replay_live_bytes(actions, addrs, sizes), args.repeats)
    assert r["allocated"].tolist() == atl and r["reserved"].tolist() == rtl
    args.out.mkdir(parents=True, exist_ok=True)
    text = (f"# Trace replay speed (bench/replay_speed.py)\n\n"
            f"{args.events:,} synthetic events (20k addresses, 2% segment events), best of "
            f"{args.repeats}, on {platform.processor() or platform.machine()} "
            f"(Python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
            f"{load:.1f} at the start: a shared machine slows both); both give the same "
            f"timelines.\n\n"
            f"| replay | seconds | speed-up |\n|---|---:|---:|\n"
            f"| pure-Python loop | {t_py:.3f} | 1.0x |\n"
            f"| memo_ext._C.replay_live_bytes | {t_cpp:.3f} | {t_py / t_cpp:.1f}x |\n")
    (args.out / "replay_speed.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
