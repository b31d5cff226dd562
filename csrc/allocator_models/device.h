// Allocator models, what every policy shares: the modelled device (capacity, reserved bytes,
// the log of device mallocs/frees and page maps/unmaps), the models' constants, and the block
// bookkeeping (live blocks by request id) that the caching and expandable policies share.
// One header per policy (caching.h, expandable.h, stitching.h, arena.h) builds on it; replay.h
// drives any of them through a trace; bindings.cpp is the Python entry point.
//
// Why C++: see bindings.cpp (millions of events per trace, replayed under several policies and
// capacities; bench/allocator_replay.py measures the rate).
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../caching_rules.h"
#include "../int64_columns.h"

namespace memo_models {

namespace py = pybind11;

using memo_columns::Int64Array;
using memo_columns::require_1d;
using namespace memo_columns;  // action codes
// PyTorch's caching rules, blocks and constants (kMinBlockSize ... kOversizeTolerance)
using namespace memo_caching;

// ------------------------------------------------------------------------------------ constants
constexpr int64_t kGiB = int64_t{1} << 30;
// Expandable segments map physical memory in pages of this size: 2 MiB in the small pool and
// 20 MiB (kLargeBuffer) in the large pool, the granularity PyTorch 2.x creates its handles in;
// every segment_map/segment_unmap size in the qwen3 reference snapshot is a multiple of it.
constexpr int64_t kExpandableSmallPage = kSmallBuffer;
constexpr int64_t kExpandableLargePage = kLargeBuffer;
// Virtual range reserved per expandable segment, as a multiple of the capacity (9/8, PyTorch's
// choice), or kUnlimitedVirtualRange when the capacity is unlimited.
constexpr int64_t kVirtualRangeNum = 9;
constexpr int64_t kVirtualRangeDen = 8;
constexpr int64_t kUnlimitedVirtualRange = int64_t{1} << 40;
// GMLake's constants (granularity, normal-path limit, fragmentation limit, StitchFree's cap)
// are stitching_rules.h's, shared with the real allocator.
// Arena placements are aligned like every other block.
constexpr int64_t kArenaAlignment = kMinBlockSize;
// Addresses the models invent (segments the recorded run did not have) start here, far above any
// real device address, so they never collide with addresses taken from a snapshot.
constexpr int64_t kSyntheticBase = int64_t{1} << 56;

// ---------------------------------------------------------------------------------- the device
// Capacity, reserved bytes, device malloc/free counts and the log of segment decisions
// (event index, action code, bytes, address) shared by every allocator of one replay.
struct Device {
  int64_t capacity = 0;  // bytes; <= 0 means unlimited
  int64_t reserved = 0;
  int64_t peak_reserved = 0;
  int64_t mallocs = 0;
  int64_t frees = 0;
  int64_t reorganisations = 0;
  int64_t event = -1;  // index of the event being replayed
  std::vector<int64_t> log_event, log_kind, log_size, log_addr;

  bool fits(int64_t bytes) const { return capacity <= 0 || reserved + bytes <= capacity; }
  void log(int64_t kind, int64_t bytes, int64_t addr) {
    log_event.push_back(event);
    log_kind.push_back(kind);
    log_size.push_back(bytes);
    log_addr.push_back(addr);
  }
  void take(int64_t bytes, int64_t kind, int64_t addr) {
    reserved += bytes;
    peak_reserved = std::max(peak_reserved, reserved);
    ++mallocs;
    log(kind, bytes, addr);
  }
  void give(int64_t bytes, int64_t kind, int64_t addr) {
    reserved -= bytes;
    ++frees;
    log(kind, bytes, addr);
  }
};

// -------------------------------------------------------------------------------------- blocks
// Unmapped parts of expandable segments, by address within one stream.
struct ByAddress {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    return a->addr < b->addr;
  }
};

struct LiveEntry {
  Block* block;
};

// What the caching allocator and expandable segments share: the block store, the live blocks by
// request id, and the allocated part of the final layout.
class BlockAllocator {
 protected:
  explicit BlockAllocator(Device& dev) : dev_(dev) {}

  void assign(Block* b, int64_t id, int64_t requested) {
    b->allocated = true;
    b->requested = requested;
    live_[id] = LiveEntry{b};
  }

  // Take block `id` out of the live set, marked free, and hand it to `give_back` (the policy's
  // own free path). Returns its requested bytes, or -1 when the id is not live here.
  template <class GiveBack>
  int64_t free_live(int64_t id, GiveBack give_back) {
    auto it = live_.find(id);
    if (it == live_.end()) return -1;
    Block* b = it->second.block;
    live_.erase(it);
    const int64_t requested = b->requested;
    b->allocated = false;
    b->requested = 0;
    give_back(b);
    return requested;
  }

  void live_layout(std::vector<std::tuple<int64_t, int64_t, int64_t>>& out) const {
    for (const auto& kv : live_) out.emplace_back(kv.second.block->addr, kv.second.block->size, 1);
  }

  Device& dev_;
  BlockStore store_;
  std::unordered_map<int64_t, LiveEntry> live_;
};

}  // namespace memo_models
