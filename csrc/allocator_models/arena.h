// Allocator model "arena": a planned arena. Request k goes to the offset the plan gives event k;
// a request the plan does not cover, or that does not fit where the plan puts it (larger than
// planned, misaligned, past the arena's end, or overlapping a block in use), takes the modelled
// caching path instead. The overlap rule is csrc/arena_ranges.h's, shared with the runtime arena
// (csrc/planned_arena.cpp); the runtime follows per-layer-phase tables and refuses (-1) where
// this model falls back, and it reserves the planned bytes where this model reserves the rounded
// request -- equal whenever a request matches its plan. C++ for the replay rate (bindings.cpp).
#pragma once

#include "../arena_ranges.h"
#include "caching.h"

namespace memo_models {

class ArenaAllocator {
 public:
  ArenaAllocator(Device& dev, int64_t arena_bytes, const int64_t* offsets, const int64_t* sizes)
      : dev_(dev), fallback_(dev, kNoMaxSplit), arena_(arena_bytes), offsets_(offsets), sizes_(sizes) {
    if (arena_ > 0) {
      arena_ok_ = dev_.fits(arena_);
      if (arena_ok_) dev_.take(arena_, kSegmentAlloc, kSyntheticBase / 2);
    }
  }

  bool malloc(int64_t id, int64_t requested, int64_t stream) {
    const int64_t offset = offsets_ ? offsets_[dev_.event] : -1;
    if (offset < 0) {
      ++unplanned_;
      return fallback_.malloc(id, requested, stream);
    }
    const int64_t size = round_request(requested);
    if (!arena_ok_ || (sizes_ && sizes_[dev_.event] >= 0 && size > sizes_[dev_.event]) ||
        offset % kArenaAlignment != 0 || offset + size > arena_ || busy_.overlaps(offset, size)) {
      ++fallbacks_;
      return fallback_.malloc(id, requested, stream);
    }
    busy_.occupy(offset, size);
    live_[id] = {offset, requested};
    ++planned_;
    return true;
  }

  int64_t free(int64_t id) {
    auto it = live_.find(id);
    if (it == live_.end()) return fallback_.free(id);
    const int64_t requested = it->second.second;
    busy_.release(it->second.first);
    live_.erase(it);
    return requested;
  }

  void release_cached() { fallback_.release_cached(); }

  py::dict counters() const {
    py::dict d;
    d["arena_bytes"] = arena_;
    d["planned"] = planned_;
    d["fallbacks"] = fallbacks_;
    d["unplanned"] = unplanned_;
    d["arena_allocated"] = static_cast<int64_t>(arena_ok_);
    return d;
  }

 private:
  Device& dev_;
  CachingAllocator fallback_;
  const int64_t arena_;
  const int64_t* offsets_;
  const int64_t* sizes_;
  bool arena_ok_ = false;
  memo_arena::LiveRanges busy_;  // live arena blocks
  std::unordered_map<int64_t, std::pair<int64_t, int64_t>> live_;  // id -> (offset, requested)
  int64_t planned_ = 0, fallbacks_ = 0, unplanned_ = 0;
};

}  // namespace memo_models
