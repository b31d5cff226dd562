// Allocator model "caching": PyTorch's CUDACachingAllocator (512-byte rounding, small/large
// pools with per-stream best fit, splitting, merging, max_split_size, and a reorganisation -- free
// every cached unused segment, retry -- when a device malloc fails). The rules themselves are
// csrc/caching_rules.h's; this file gives them segment addresses (recorded or invented), the
// state a snapshot started in, and the final layout. The stitching and arena models use it as
// their fallback path. C++ for the replay rate (see bindings.cpp).
#pragma once

#include "device.h"

namespace memo_models {

// ------------------------------------------------------------------------- caching allocator
// caching_rules.h's pools over invented (or recorded) segment addresses.
class CachingAllocator : BlockAllocator {
 public:
  CachingAllocator(Device& dev, int64_t max_split_size, int64_t small_split_min = kMinBlockSize)
      : BlockAllocator(dev), pools_(*this, store_, max_split_size, small_split_min) {}

  // Addresses of the recorded run's device mallocs, per event (0: none). A new segment takes the
  // recorded address when its size equals the recorded one and the range is not in use, so that
  // best-fit ties between equally sized blocks break the way they did on the GPU.
  void set_hints(const int64_t* addr, const int64_t* size) {
    hint_addr_ = addr;
    hint_size_ = size;
  }

  // A segment that existed before the first event; its gaps between `blocks` are free.
  void add_initial_segment(int64_t addr, int64_t size, int64_t stream, bool small,
                           std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> blocks) {
    // blocks: (addr, size, requested, id), sorted here by address
    std::sort(blocks.begin(), blocks.end());
    if (segments_.count(addr)) {
      throw std::invalid_argument("initial segment at " + std::to_string(addr) + " given twice");
    }
    segments_[addr] = size;
    dev_.reserved += size;
    dev_.peak_reserved = std::max(dev_.peak_reserved, dev_.reserved);
    Block* last = nullptr;
    int64_t cursor = addr;
    auto link = [&](Block* b) {
      b->prev = last;
      if (last) last->next = b;
      last = b;
    };
    for (const auto& [baddr, bsize, breq, bid] : blocks) {
      if (baddr < cursor || bsize <= 0 || baddr + bsize > addr + size) {
        throw std::invalid_argument("initial block at " + std::to_string(baddr) +
                                    " overlaps another or lies outside segment " +
                                    std::to_string(addr));
      }
      if (baddr > cursor) link(store_.make(cursor, baddr - cursor, stream, small));
      Block* b = store_.make(baddr, bsize, stream, small);
      b->allocated = true;
      b->requested = breq;
      if (!live_.emplace(bid, LiveEntry{b}).second) {
        throw std::invalid_argument("initial block id " + std::to_string(bid) + " given twice");
      }
      link(b);
      cursor = baddr + bsize;
    }
    if (cursor < addr + size) link(store_.make(cursor, addr + size - cursor, stream, small));
    for (Block* b = last; b; b = b->prev) {
      if (!b->allocated) pools_.pool(small).insert(b);
    }
  }

  // Serve a request. Returns false when the device is out of memory even after a reorganisation.
  bool malloc(int64_t id, int64_t requested, int64_t stream) {
    Block* b = pools_.malloc(round_request(requested), stream);
    if (!b) return false;
    assign(b, id, requested);
    return true;
  }

  // Return block `id`. Returns its requested bytes, or -1 when the id is not live here.
  int64_t free(int64_t id) {
    return free_live(id, [this](Block* b) { pools_.free(b); });
  }

  // Free every segment that holds no allocated block (caching_rules.h's order).
  void release_cached() { pools_.release_cached(); }

  int64_t num_segments() const { return static_cast<int64_t>(segments_.size()); }

  // Every block (address, bytes, state 0 free / 1 allocated), by address.
  std::vector<std::tuple<int64_t, int64_t, int64_t>> layout() const {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    live_layout(out);
    for (const FreeSet* set : {&pools_.pool(true), &pools_.pool(false)}) {
      for (const Block* b : *set) out.emplace_back(b->addr, b->size, 0);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  friend class memo_caching::CachingPools<CachingAllocator>;

  bool range_free(int64_t addr, int64_t size) const {
    auto it = segments_.upper_bound(addr);
    if (it != segments_.end() && it->first < addr + size) return false;
    if (it != segments_.begin()) {
      --it;
      if (it->first + it->second > addr) return false;
    }
    return true;
  }

  // CachingPools' hooks. One device malloc; nullptr when it would exceed the capacity.
  Block* new_segment(int64_t size, int64_t stream, bool small) {
    if (!dev_.fits(size)) return nullptr;
    int64_t addr = 0;
    if (hint_addr_ && dev_.event >= 0 && hint_addr_[dev_.event] != 0 &&
        hint_size_[dev_.event] == size && range_free(hint_addr_[dev_.event], size)) {
      addr = hint_addr_[dev_.event];
    } else {
      addr = next_synthetic_;
      next_synthetic_ += round_up(size, kRoundLarge);
    }
    segments_[addr] = size;
    dev_.take(size, kSegmentAlloc, addr);
    return store_.make(addr, size, stream, small);
  }

  void reorganising() { ++dev_.reorganisations; }

  void release_segment(const Block* b) {
    segments_.erase(b->addr);
    dev_.give(b->size, kSegmentFree, b->addr);
  }

  CachingPools<CachingAllocator> pools_;
  std::map<int64_t, int64_t> segments_;  // address -> bytes
  int64_t next_synthetic_ = kSyntheticBase;
  const int64_t* hint_addr_ = nullptr;
  const int64_t* hint_size_ = nullptr;
};

}  // namespace memo_models
