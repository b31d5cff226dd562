// The placement rule the planned arena and its model share: a planned range [offset, offset +
// bytes) is taken only when it overlaps no block still in use; the blocks in use are kept in an
// ordered map (start -> end) that never holds two overlapping ranges.
//
// Two users, one rule: csrc/planned_arena.cpp (the runtime arena behind the CUDA allocator hooks,
// which follows a plan's per-layer-phase tables) and csrc/allocator_models/arena.h (the "arena"
// allocator model, which follows one offset per trace event and sends what does not fit to a
// modelled caching allocator). tests/unit/memo_ext/alloc/test_arena_agreement.py replays one plan through both
// and checks they place the same requests at the same offsets. Header-only C++ because both
// users are C++ (the runtime runs inside the allocator hooks).
#pragma once

#include <cstdint>
#include <iterator>
#include <map>

namespace memo_arena {

class LiveRanges {
 public:
  // Whether [offset, offset + bytes) (bytes > 0) shares a byte with a block in use. The ranges
  // in use never overlap, so their ends rise with their starts and only the last one starting
  // before our end can reach into our range.
  bool overlaps(int64_t offset, int64_t bytes) const {
    auto after = live_.lower_bound(offset + bytes);  // first block starting at/after our end
    return after != live_.begin() && std::prev(after)->second > offset;
  }

  void occupy(int64_t offset, int64_t bytes) { live_[offset] = offset + bytes; }

  // Bytes of the block in use at `offset`, now released; -1 when no block starts there.
  int64_t release(int64_t offset) {
    auto it = live_.find(offset);
    if (it == live_.end()) return -1;
    const int64_t bytes = it->second - it->first;
    live_.erase(it);
    return bytes;
  }

  int64_t size() const { return static_cast<int64_t>(live_.size()); }

 private:
  std::map<int64_t, int64_t> live_;  // start -> end
};

}  // namespace memo_arena
