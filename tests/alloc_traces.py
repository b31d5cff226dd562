"""Hand-made allocator traces shared by the allocator-model tests and the real stitching
allocator's tests, which replay the same traces through both and compare."""
import numpy as np

from memo_ext import _C
from memo_ext.alloc import AllocatorTrace

MiB = 1 << 20


def trace(*events) -> AllocatorTrace:
    """("alloc", id, bytes[, stream]), ("free", id), ("empty_cache",), ("oom", bytes[, stream])."""
    codes = {"alloc": _C.ALLOC, "free": _C.FREE, "empty_cache": _C.EMPTY_CACHE,
             "oom": _C.FAILED_ALLOC}
    rows = []
    for e in events:
        if e[0] == "alloc":
            rows.append((codes["alloc"], e[1], e[2], e[3] if len(e) > 3 else 0))
        elif e[0] == "free":
            rows.append((codes["free"], e[1], 0, 0))
        elif e[0] == "oom":
            rows.append((codes["oom"], -1, e[1], e[2] if len(e) > 2 else 0))
        else:
            rows.append((codes[e[0]], 0, 0, 0))
    cols = np.array(rows, np.int64).reshape(-1, 4)
    return AllocatorTrace(*(cols[:, k] for k in range(4)), name="hand-made")


def training_steps(n: int) -> AllocatorTrace:
    """n training steps: a 20 MiB buffer, then 8 + 12 + 6 MiB, then a 26 MiB one."""
    events, k = [], 0
    for _ in range(n):
        events += [("alloc", k, 20 * MiB), ("free", k),
                   ("alloc", k + 1, 8 * MiB), ("alloc", k + 2, 12 * MiB), ("alloc", k + 3, 6 * MiB),
                   ("free", k + 1), ("free", k + 2), ("free", k + 3),
                   ("alloc", k + 4, 26 * MiB), ("free", k + 4)]
        k += 5
    return trace(*events)
