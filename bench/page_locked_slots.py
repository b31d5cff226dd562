"""MEMO's page-locked host slot (CopyEngine.alloc_host) beside PyTorch's pinned caching
allocator (alloc_host_cached) and pageable memory, for one slot just over a power of two:
host memory taken and given back after the slot is dropped, is_pinned(), how long the
offload call blocks, D2H bandwidth. Needs CUDA and about 9 GiB of free host memory:

    PYTHONPATH=. python3 bench/page_locked_slots.py RESULT.json

bench/results/page_locked_slots_h100.json is its output on one H100."""
import gc, json, sys, time
import psutil, torch
from memo_ext.device import CopyEngine

GiB, MiB = 1 << 30, 1 << 20
n = 2 * GiB + 16 * MiB  # a slot just over a power of two
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
engine = CopyEngine("cuda")
avail = lambda: psutil.virtual_memory().available
stats = lambda: (torch.cuda.host_memory_stats().get("reserved_bytes.current")
                 if hasattr(torch.cuda, "host_memory_stats") else None)
dev = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(3)
out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "slot_bytes": n}
allocs = {"page_locked (alloc_host)": engine.alloc_host,
          "pinned caching (alloc_host_cached)": engine.alloc_host_cached,
          "pageable (torch.empty)": lambda k: torch.empty(k, dtype=torch.uint8)}
for name, alloc in allocs.items():
    gc.collect(); time.sleep(0.3); a0 = avail(); t0 = time.perf_counter()
    host = alloc(n); host[::4096].fill_(0)  # touch every page (pageable pages come lazily)
    t1 = time.perf_counter(); a1 = avail(); torch.cuda.synchronize()
    c0 = time.perf_counter(); event = engine.offload(host, dev); c1 = time.perf_counter()
    event.synchronize(); c2 = time.perf_counter()
    ok = bool((host[:1 << 20] == 3).all()) and bool((host[-(1 << 20):] == 3).all())
    row = {"is_pinned": host.is_pinned(), "alloc_s": round(t1 - t0, 3),
           "host_taken_GiB": round((a0 - a1) / GiB, 3), "offload_call_returns_ms": round((c1 - c0) * 1e3, 3),
           "copy_done_ms": round((c2 - c0) * 1e3, 1), "GB_per_s": round(n / (c2 - c0) / 1e9, 2),
           "bytes_ok": ok, "torch_pinned_allocator_reserved": stats()}
    del host, event; gc.collect(); time.sleep(0.5)
    row["host_given_back_GiB"] = round((avail() - a1) / GiB, 3)
    out[name] = row
    print(name, row, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
