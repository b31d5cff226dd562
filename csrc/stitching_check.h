// Driving the real stitching allocator (stitching_allocator.h over stitching_host_backend.h)
// and checking what it hands out: the trace replay behind memo_ext.alloc.replay_host and
// tools/memory_report.py, and the randomized fuzzer against an oracle that
// tests/unit/memo_ext/alloc/test_stitching_allocator.py runs in-process and, built with AddressSanitizer, as a
// standalone program (csrc/standalone/stitching_fuzz_main.cpp). No pybind11 here.
//
// Data pattern. A block of n usable bytes (its 512-rounded request) belonging to request `id`
// gets the 64-bit word pattern_word(id, o) at every 8-byte offset o of its check windows:
//   n <= 8 KiB      the whole block;
//   otherwise       [0, 4 KiB), [k * 2 MiB, k * 2 MiB + 4 KiB) for every k >= 1 with the window
//                   ending before the last 4 KiB, and [n - 4 KiB, n).
// Snapshots hold blocks of many GiB while the dev machine has 24 GiB of RAM shared with other
// work, and memfd pages cost RAM when touched: the windows touch at most 1/512 of a large block
// plus two pages, yet every 2 MiB physical chunk of a stitched block (its parts start at
// multiples of 2 MiB of the block) has a window. The word depends on the offset, so a view
// that maps the right memory at the wrong place fails too. When the block is freed every window
// is read back through the block's own address and, piece by piece, through each piece's own
// view (a stitched block's parts through their primitive blocks' addresses). The fuzzer also
// fills small blocks whole and re-reads every live block periodically, so that a later block
// overwriting an earlier one is caught.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "stitching_allocator.h"
#include "stitching_host_backend.h"

namespace memo_stitch {

constexpr int64_t kCheckWindow = 4096;         // bytes per check window
constexpr int64_t kCheckStride = kGranularity;  // one window per 2 MiB of the block
constexpr int64_t kWholeCheckLimit = 2 * kCheckWindow;

inline uint64_t pattern_word(uint64_t id, uint64_t offset) {
  uint64_t x = (id + 1) * 0x9E3779B97F4A7C15ULL ^ offset * 0xC2B2AE3D27D4EB4FULL;
  x ^= x >> 31;
  return x;
}

// The check windows of a block of n bytes: (offset, bytes) pairs, in order, disjoint.
inline std::vector<std::pair<int64_t, int64_t>> check_windows(int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> w;
  if (n <= kWholeCheckLimit) {
    if (n > 0) w.emplace_back(0, n);
    return w;
  }
  w.emplace_back(0, kCheckWindow);
  for (int64_t o = kCheckStride; o + kCheckWindow <= n - kCheckWindow; o += kCheckStride) {
    w.emplace_back(o, kCheckWindow);
  }
  w.emplace_back(n - kCheckWindow, kCheckWindow);
  return w;
}

inline void fill_range(uintptr_t base, int64_t from, int64_t bytes, uint64_t id) {
  auto* p = reinterpret_cast<uint64_t*>(base + from);
  for (int64_t o = 0; o < bytes; o += 8) *p++ = pattern_word(id, from + o);
}

// First bad offset in [from, from + bytes) of the block whose byte `from` is at `addr`; -1 if
// every word is right.
inline int64_t bad_offset(uintptr_t addr, int64_t from, int64_t bytes, uint64_t id) {
  const auto* p = reinterpret_cast<const uint64_t*>(addr);
  for (int64_t o = 0; o < bytes; o += 8) {
    if (*p++ != pattern_word(id, from + o)) return from + o;
  }
  return -1;
}

inline int64_t fill_block(uintptr_t ptr, int64_t n, uint64_t id, bool whole = false) {
  if (whole) {
    fill_range(ptr, 0, n, id);
    return n;
  }
  int64_t bytes = 0;
  for (const auto& [o, b] : check_windows(n)) {
    fill_range(ptr, o, b, id);
    bytes += b;
  }
  return bytes;
}

// Read the pattern back through `ptr` and through every view; "" or what is wrong.
inline std::string verify_block(uintptr_t ptr, int64_t n, uint64_t id,
                                const std::vector<View>& views, bool whole = false) {
  std::vector<std::pair<int64_t, int64_t>> windows;
  if (whole) {
    windows.emplace_back(0, n);
  } else {
    windows = check_windows(n);
  }
  for (const auto& [o, b] : windows) {
    if (int64_t bad = bad_offset(ptr + o, o, b, id); bad >= 0) {
      return "block " + std::to_string(id) + ": wrong word at offset " + std::to_string(bad) +
             " read through the block's address";
    }
    for (const View& v : views) {  // the part of the window inside this view
      const int64_t lo = std::max(o, v.block_offset);
      const int64_t hi = std::min(o + b, v.block_offset + v.bytes);
      if (lo >= hi) continue;
      if (int64_t bad = bad_offset(v.va + (lo - v.block_offset), lo, hi - lo, id); bad >= 0) {
        return "block " + std::to_string(id) + ": wrong word at offset " + std::to_string(bad) +
               " read through its piece's own view";
      }
    }
  }
  return "";
}

inline int64_t resident_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
}

// ------------------------------------------------------------------------------- trace replay
// Event codes as in csrc/int64_columns.h.
enum ReplayAction : int64_t {
  kRAlloc = 0, kRFree = 1, kROther = 6, kREmptyCache = 7, kRFailedAlloc = 8,
};

struct ReplayOutput {
  Stats stats;                      // the allocator's, at the end (before teardown)
  int64_t peak_allocated = 0;       // sum of 512-rounded requests live at once (model's)
  int64_t peak_allocated_index = -1;
  int64_t final_allocated = 0;
  int64_t ooms = 0, first_oom_index = -1;
  int64_t unmatched_frees = 0, duplicate_allocs = 0;
  int64_t failed_reproduced = 0, failed_succeeded = 0;
  // integrity
  int64_t checked_blocks = 0;       // blocks verified (at their free, or live at the end)
  int64_t checked_bytes = 0;        // bytes written and read back (per read path once)
  int64_t stitched_checked = 0;     // of which stitched blocks (read through every part)
  int64_t data_errors = 0;
  std::string first_error;
  std::string invariant_error;      // check_invariants() at the end
  int64_t peak_resident_bytes = 0;  // process RSS, sampled every 256 events
  double seconds = 0;               // wall time of the replay loop
  // after teardown: what the backend still holds (all 0 when nothing leaked)
  int64_t leaked_physical_bytes = 0, leaked_handles = 0, leaked_ranges = 0,
          leaked_mapped_bytes = 0;
  int64_t backend_peak_physical_bytes = 0;
  std::vector<LogEntry> log;
  std::vector<int64_t> allocated_tl, reserved_tl;
};

inline ReplayOutput replay_trace(Options opt, int64_t n, const int64_t* act, const int64_t* id,
                                 const int64_t* size, const int64_t* stream, bool check,
                                 bool timelines) {
  ReplayOutput out;
  HostBackend backend;  // the capacity is enforced by the allocator (as the model does)
  {
    StitchingAllocator a(backend, opt);
    struct Block {
      uintptr_t ptr;
      int64_t requested;
      uint64_t tag;
    };
    std::unordered_map<int64_t, Block> live;
    std::unordered_set<int64_t> refused;
    uint64_t next_tag = 0;
    int64_t allocated = 0;
    if (timelines) {
      out.allocated_tl.resize(n);
      out.reserved_tl.resize(n);
    }
    auto note_error = [&](const std::string& e) {
      if (e.empty()) return;
      if (out.data_errors++ == 0) out.first_error = e;
    };
    auto retire = [&](const Block& b) {  // verify, then free
      if (check) {
        const int64_t usable = round_request(b.requested);
        note_error(verify_block(b.ptr, usable, b.tag, a.views(b.ptr)));
        ++out.checked_blocks;
        const bool stitched = std::strcmp(a.kind(b.ptr), "stitched") == 0;
        out.stitched_checked += stitched;
        for (const auto& w : check_windows(usable)) out.checked_bytes += w.second;
      }
      a.free(b.ptr);
      allocated -= round_request(b.requested);
    };
    auto take = [&](int64_t i, int64_t requested) -> uintptr_t {
      const uintptr_t p = a.malloc(requested, stream[i]);
      if (!p) {
        if (out.ooms++ == 0) out.first_oom_index = i;
      }
      return p;
    };
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) {
      a.set_event(i);
      if (size[i] < 0) throw std::invalid_argument("sizes[" + std::to_string(i) + "] < 0");
      switch (act[i]) {
        case kRAlloc: {
          if (auto it = live.find(id[i]); it != live.end()) {  // allocated twice, no free
            ++out.duplicate_allocs;
            retire(it->second);
            live.erase(it);
          }
          const uintptr_t p = take(i, size[i]);
          if (!p) {
            refused.insert(id[i]);
            break;
          }
          const Block b{p, size[i], next_tag++};
          if (check) fill_block(p, round_request(size[i]), b.tag);
          live.emplace(id[i], b);
          allocated += round_request(size[i]);
          if (allocated > out.peak_allocated) {
            out.peak_allocated = allocated;
            out.peak_allocated_index = i;
          }
          break;
        }
        case kRFree: {
          auto it = live.find(id[i]);
          if (it != live.end()) {
            retire(it->second);
            live.erase(it);
          } else if (refused.empty() || refused.erase(id[i]) == 0) {
            ++out.unmatched_frees;
          }
          break;
        }
        case kRFailedAlloc: {
          const uintptr_t p = a.malloc(size[i], stream[i]);
          if (p) {
            ++out.failed_succeeded;
            a.free(p);
          } else {
            ++out.failed_reproduced;
            if (out.ooms++ == 0) out.first_oom_index = i;
          }
          break;
        }
        case kREmptyCache:
          a.release_cached();
          break;
        default:
          if (act[i] < 0 || act[i] > kRFailedAlloc) {
            throw std::invalid_argument("actions[" + std::to_string(i) + "] = " +
                                        std::to_string(act[i]) + " is not an action code");
          }
          break;  // segment events and others: the recorded allocator's, ignored
      }
      if (timelines) {
        out.allocated_tl[i] = allocated;
        out.reserved_tl[i] = a.stats().reserved_bytes;
      }
      if ((i & 255) == 0) out.peak_resident_bytes = std::max(out.peak_resident_bytes,
                                                            resident_bytes());
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.peak_resident_bytes = std::max(out.peak_resident_bytes, resident_bytes());
    if (check) {  // blocks still live at the end: verify them too
      for (const auto& kv : live) {
        const Block& b = kv.second;
        const int64_t usable = round_request(b.requested);
        note_error(verify_block(b.ptr, usable, b.tag, a.views(b.ptr)));
        ++out.checked_blocks;
        out.stitched_checked += std::strcmp(a.kind(b.ptr), "stitched") == 0;
        for (const auto& w : check_windows(usable)) out.checked_bytes += w.second;
      }
    }
    out.invariant_error = a.check_invariants();
    out.final_allocated = allocated;
    out.stats = a.stats();
    out.log = a.log();
    a.teardown();
  }
  out.leaked_physical_bytes = backend.physical_bytes();
  out.leaked_handles = backend.live_handles();
  out.leaked_ranges = backend.live_ranges();
  out.leaked_mapped_bytes = backend.mapped_bytes();
  out.backend_peak_physical_bytes = backend.peak_physical_bytes();
  return out;
}

// ---------------------------------------------------------------------------------- fuzzer
struct FuzzConfig {
  uint64_t seed = 1;
  int64_t ops = 100000;
  int64_t capacity = 0;  // bytes, 0: unlimited
  int64_t frag_limit = 4 * kMiB;
  int64_t max_sblocks = 64;
  int64_t streams = 2;
  int64_t max_live = 48;
  int64_t check_every = 512;  // invariants + accounting every this many operations
  int64_t reread_every = 4096;  // re-read every live block every this many operations
};

struct FuzzResult {
  int64_t ops = 0, allocs = 0, frees = 0, ooms = 0, empty_caches = 0, rereads = 0;
  int64_t va_overlaps = 0, phys_overlaps = 0, data_errors = 0, invariant_errors = 0,
          accounting_errors = 0, shape_errors = 0;
  int64_t by_kind[3] = {0, 0, 0};  // normal, primitive, stitched allocations
  int64_t peak_live = 0;
  std::string first_error;
  Stats stats;  // before the final frees
  // after freeing everything and release_cached(): must all be 0
  int64_t residual_reserved = 0, residual_handles = 0, residual_ranges = 0, residual_mapped = 0;
  // after a teardown with blocks still in use (a second allocator): must all be 0
  int64_t teardown_handles = 0, teardown_ranges = 0, teardown_physical = 0;
  double seconds = 0;
};

// Random sizes in bytes: small (normal path, small pool), medium (normal path, large pool, or
// stitching pools when the limit is low), large and huge (stitching pools), a few exact
// multiples of 2 MiB so that exact matches happen.
inline int64_t fuzz_size(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> kind(0, 99);
  const int k = kind(rng);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  if (k < 35) return uni(1, kMiB);
  if (k < 55) return uni(kMiB, 20 * kMiB);
  if (k < 75) return uni(1, 24) * kGranularity;
  if (k < 93) return uni(4 * kMiB, 96 * kMiB);
  return uni(96 * kMiB, 320 * kMiB);
}

inline FuzzResult fuzz(const FuzzConfig& cfg) {
  FuzzResult r;
  std::mt19937_64 rng(cfg.seed);
  auto fail = [&](int64_t& counter, const std::string& what) {
    if (++counter == 1 && r.first_error.empty()) r.first_error = what;
  };
  const auto t0 = std::chrono::steady_clock::now();
  {
    HostBackend backend;
    Options opt;
    opt.capacity = cfg.capacity;
    opt.frag_limit = cfg.frag_limit;
    opt.max_sblocks = cfg.max_sblocks;
    StitchingAllocator a(backend, opt);
    struct Block {
      uintptr_t ptr;
      int64_t bytes;   // block bytes
      int64_t usable;  // 512-rounded request (the pattern's extent)
      uint64_t tag;
      bool whole;
    };
    std::vector<Block> live;                       // the oracle's live blocks
    std::map<uintptr_t, uintptr_t> va;             // start -> end of live blocks' addresses
    // (handle, offset) -> (handle, end) of the physical pieces of live blocks
    std::map<std::pair<int64_t, int64_t>, std::pair<int64_t, int64_t>> phys;
    int64_t active = 0;
    uint64_t tag = 0;
    auto overlaps = [](const auto& m, const auto& key, const auto& end) {
      auto it = m.lower_bound(key);
      if (it != m.end() && it->first < end) return true;
      if (it != m.begin() && std::prev(it)->second > key) return true;
      return false;
    };
    auto verify = [&](const Block& b) {
      const std::string e = verify_block(b.ptr, b.usable, b.tag, a.views(b.ptr), b.whole);
      if (!e.empty()) fail(r.data_errors, e);
    };
    auto release = [&](size_t k) {
      Block b = live[k];
      verify(b);
      for (const View& v : a.views(b.ptr)) phys.erase({v.handle, v.phys_offset});
      va.erase(b.ptr);
      active -= b.bytes;
      if (a.free(b.ptr) < 0) fail(r.shape_errors, "free of a live block returned -1");
      live[k] = live.back();
      live.pop_back();
      ++r.frees;
    };
    for (int64_t op = 0; op < cfg.ops; ++op) {
      ++r.ops;
      const int64_t roll = std::uniform_int_distribution<int64_t>(0, 999)(rng);
      // grow while few blocks are live, shrink when many are
      const bool grow = static_cast<int64_t>(live.size()) <
                        std::uniform_int_distribution<int64_t>(1, cfg.max_live)(rng);
      if (roll < 3) {
        a.release_cached();
        ++r.empty_caches;
      } else if (grow || live.empty()) {
        const int64_t req = fuzz_size(rng);
        const int64_t stream = std::uniform_int_distribution<int64_t>(0, cfg.streams - 1)(rng);
        const uintptr_t p = a.malloc(req, stream);
        if (!p) {
          ++r.ooms;
          if (cfg.capacity <= 0) fail(r.shape_errors, "out of memory without a capacity");
          continue;
        }
        ++r.allocs;
        Block b{p, a.block_bytes(p), round_request(req), tag++, false};
        b.whole = b.usable <= 64 * 1024;
        const char* kind = a.kind(p);
        r.by_kind[kind[0] == 'n' ? 0 : kind[0] == 'p' ? 1 : 2]++;
        if (b.bytes < b.usable) fail(r.shape_errors, "block smaller than its request");
        if (overlaps(va, p, p + b.bytes)) {
          fail(r.va_overlaps, "block at " + std::to_string(p) + " overlaps a live block");
        }
        int64_t off = 0;
        for (const View& v : a.views(p)) {
          if (v.block_offset != off) fail(r.shape_errors, "views are not contiguous");
          off += v.bytes;
          const auto key = std::make_pair(v.handle, v.phys_offset);
          const auto end = std::make_pair(v.handle, v.phys_offset + v.bytes);
          if (overlaps(phys, key, end)) {
            fail(r.phys_overlaps, "physical bytes of handle " + std::to_string(v.handle) +
                                      " handed out twice");
          }
          phys[key] = end;
        }
        if (off != b.bytes) fail(r.shape_errors, "views do not cover the block");
        va[p] = p + b.bytes;
        active += b.bytes;
        fill_block(p, b.usable, b.tag, b.whole);
        live.push_back(b);
        r.peak_live = std::max<int64_t>(r.peak_live, static_cast<int64_t>(live.size()));
      } else {
        release(std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng));
      }
      if (cfg.check_every > 0 && op % cfg.check_every == 0) {
        const std::string e = a.check_invariants();
        if (!e.empty()) fail(r.invariant_errors, e);
        const Stats& s = a.stats();
        if (s.active_bytes != active || s.live_blocks != static_cast<int64_t>(live.size()) ||
            s.reserved_bytes != backend.physical_bytes() ||
            s.mapped_bytes != backend.mapped_bytes() ||
            (cfg.capacity > 0 && s.reserved_bytes > cfg.capacity)) {
          fail(r.accounting_errors, "allocator statistics disagree with the oracle/backend");
        }
      }
      if (cfg.reread_every > 0 && op % cfg.reread_every == 0) {
        for (const Block& b : live) verify(b);
        ++r.rereads;
      }
    }
    r.stats = a.stats();
    while (!live.empty()) release(live.size() - 1);
    a.release_cached();
    if (const std::string e = a.check_invariants(); !e.empty()) fail(r.invariant_errors, e);
    r.residual_reserved = a.stats().reserved_bytes + backend.physical_bytes();
    r.residual_handles = backend.live_handles();
    r.residual_ranges = backend.live_ranges();
    r.residual_mapped = backend.mapped_bytes();
  }
  {  // teardown with blocks in use: a short run left live, then destroyed
    HostBackend backend;
    {
      Options opt;
      opt.frag_limit = cfg.frag_limit;
      opt.max_sblocks = cfg.max_sblocks;
      StitchingAllocator a(backend, opt);
      std::vector<uintptr_t> ptrs;
      for (int i = 0; i < 200; ++i) {
        if (!ptrs.empty() && rng() % 3 == 0) {
          const size_t k = rng() % ptrs.size();
          a.free(ptrs[k]);
          ptrs[k] = ptrs.back();
          ptrs.pop_back();
        } else {
          ptrs.push_back(a.malloc(fuzz_size(rng), static_cast<int64_t>(rng() % 2)));
        }
      }
    }
    r.teardown_handles = backend.live_handles();
    r.teardown_ranges = backend.live_ranges();
    r.teardown_physical = backend.physical_bytes();
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace memo_stitch
