// Allocator model "expandable": PyTorch's expandable segments -- one growing virtual range per
// (stream, pool) whose pages are mapped on demand and unmapped when the allocator reorganises.
// Same block rules as caching_rules.h (best fit, always split, merge free neighbours) over
// mapped and unmapped parts of the ranges. C++ for the replay rate (see bindings.cpp).
#pragma once

#include "device.h"

namespace memo_models {

// ------------------------------------------------------------------ expandable segments
class ExpandableAllocator : BlockAllocator {
 public:
  ExpandableAllocator(Device& dev, int64_t small_page, int64_t large_page, int64_t virtual_size)
      : BlockAllocator(dev), page_{large_page, small_page}, virtual_size_(virtual_size) {}

  bool malloc(int64_t id, int64_t requested, int64_t stream) {
    const int64_t size = round_request(requested);
    const bool small = size <= kSmallSize;
    FreeSet& free_blocks = free_[small];
    Block* b = best_fit(free_blocks, stream, size);
    if (b) {
      free_blocks.erase(b);
    } else {
      b = expand(stream, small, size);
      if (!b) {  // mapping failed: unmap every cached free page and retry
        ++dev_.reorganisations;
        release_cached();
        b = expand(stream, small, size);
        if (!b) return false;
      }
    }
    // expandable segments always split
    if (b->size - size >= kMinBlockSize) split_tail(store_, b, size, free_blocks);
    assign(b, id, requested);
    return true;
  }

  int64_t free(int64_t id) {
    return free_live(id, [this](Block* b) { insert_free(b); });
  }

  // Unmap the whole pages inside every free mapped block (large pool first, best-fit order);
  // a virtual range that this leaves with nothing mapped is released.
  void release_cached() {
    for (int small = 0; small < 2; ++small) {
      std::vector<Block*> todo(free_[small].begin(), free_[small].end());
      for (Block* b : todo) unmap(b);
    }
  }

  int64_t released_ranges() const { return released_ranges_; }
  int64_t virtual_ranges() const { return static_cast<int64_t>(segments_.size()); }

  // Every block (address, bytes, state 0 free / 1 allocated / 2 unmapped), by address.
  std::vector<std::tuple<int64_t, int64_t, int64_t>> layout() const {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    live_layout(out);
    for (int k = 0; k < 2; ++k) {
      for (const Block* b : free_[k]) out.emplace_back(b->addr, b->size, 0);
      for (const Block* b : unmapped_[k]) out.emplace_back(b->addr, b->size, 2);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  struct Range {
    int64_t base;
    int64_t size;
    int64_t page;
  };

  static int64_t expandable_size(const Block* b) {
    return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
  }

  // Best fit among mapped free blocks; a block that could grow into the unmapped tail after it
  // is passed over for the next candidate when that one has less room to grow.
  Block* best_fit(FreeSet& free_blocks, int64_t stream, int64_t size) {
    auto it = smallest_fit(free_blocks, stream, size);
    if (it == free_blocks.end()) return nullptr;
    for (auto next = std::next(it); next != free_blocks.end() && (*next)->stream == stream &&
                                    expandable_size(*next) < expandable_size(*it);
         ++next) {
      it = next;
    }
    return *it;
  }

  // Insert a free mapped block, merged with free mapped neighbours.
  Block* insert_free(Block* b) {
    FreeSet& free_blocks = free_[b->small];
    absorb_neighbours(store_, b, free_blocks,
                      [](const Block* x) { return !x->allocated && x->mapped; });
    free_blocks.insert(b);
    return b;
  }

  // Same for an unmapped block, merged with unmapped neighbours.
  void insert_unmapped(Block* b) {
    auto& unmapped = unmapped_[b->small];
    absorb_neighbours(store_, b, unmapped, [](const Block* x) { return !x->mapped; });
    unmapped.insert(b);
  }

  // Map the first `bytes` of unmapped block u (rounded up to whole pages). All or nothing:
  // returns the free mapped block now holding them (merged with its free neighbours), or nullptr
  // when the pages do not fit in the capacity.
  Block* map(Block* u, int64_t bytes) {
    const Range& r = segments_[u->segment];
    bytes = std::min(u->size, round_up(bytes, r.page));
    if (!dev_.fits(bytes)) return nullptr;
    dev_.take(bytes, kSegmentMap, u->addr);
    auto& unmapped = unmapped_[u->small];
    unmapped.erase(u);
    Block* f = u;
    if (bytes < u->size) {
      f = store_.make(u->addr, bytes, u->stream, u->small, u->segment);
      f->prev = u->prev;
      f->next = u;
      if (u->prev) u->prev->next = f;
      u->prev = f;
      u->addr += bytes;
      u->size -= bytes;
      unmapped.insert(u);
    }
    f->mapped = true;
    return insert_free(f);
  }

  // Grow into unmapped address space: the first unmapped block of this stream and pool (lowest
  // address first) that, with the free mapped block before it and the free or unmapped blocks
  // after it, has `size` bytes of room; a new virtual range when none has. Returns the free
  // block (taken out of the free set) or nullptr when mapping exceeds the capacity.
  Block* expand(int64_t stream, bool small, int64_t size) {
    auto& unmapped = unmapped_[small];
    Block key;
    key.stream = stream;
    key.addr = std::numeric_limits<int64_t>::min();
    Block* start = nullptr;
    for (auto it = unmapped.lower_bound(&key); it != unmapped.end() && (*it)->stream == stream;
         ++it) {
      Block* c = *it;
      if (c->prev && !c->prev->allocated && c->prev->mapped) c = c->prev;
      int64_t room = 0;
      for (Block* b = c; b && room < size && !b->allocated; b = b->next) room += b->size;
      if (room >= size) {
        start = c;
        break;
      }
    }
    if (!start) {
      const int64_t page = page_[small];
      const int64_t vsize = std::max(round_up(virtual_size_, page), round_up(size, page));
      const int32_t index = static_cast<int32_t>(segments_.size());
      segments_.push_back(Range{next_base_, vsize, page});
      start = store_.make(next_base_, vsize, stream, small, index);
      start->mapped = false;
      unmapped.insert(start);
      next_base_ += round_up(vsize, kGiB) + kGiB;
    }
    Block* c = start;
    if (!c->mapped) {
      c = map(c, std::min(c->size, size));
      if (!c) return nullptr;
    }
    while (c->size < size) {
      Block* u = c->next;  // free mapped neighbours are merged, so this one is unmapped
      c = map(u, std::min(u->size, size - c->size));
      if (!c) return nullptr;
    }
    free_[small].erase(c);
    return c;
  }

  void unmap(Block* b) {
    const Range& r = segments_[b->segment];
    const int64_t begin = r.base + round_up(b->addr - r.base, r.page);
    const int64_t end = r.base + (b->addr + b->size - r.base) / r.page * r.page;
    if (end <= begin) return;
    FreeSet& free_blocks = free_[b->small];
    free_blocks.erase(b);
    if (b->addr + b->size > end) {  // keep the mapped tail
      Block* t = store_.make(end, b->addr + b->size - end, b->stream, b->small, b->segment);
      t->prev = b;
      t->next = b->next;
      if (b->next) b->next->prev = t;
      b->next = t;
      b->size = end - b->addr;
      free_blocks.insert(t);
    }
    if (b->addr < begin) {  // keep the mapped head
      Block* h = store_.make(b->addr, begin - b->addr, b->stream, b->small, b->segment);
      h->prev = b->prev;
      h->next = b;
      if (b->prev) b->prev->next = h;
      b->prev = h;
      b->size -= begin - b->addr;
      b->addr = begin;
      free_blocks.insert(h);
    }
    dev_.give(end - begin, kSegmentUnmap, begin);
    b->mapped = false;
    insert_unmapped(b);
    if (!b->prev && !b->next) {  // nothing of its range is mapped any more: release the range
      unmapped_[b->small].erase(b);
      store_.recycle(b);
      ++released_ranges_;
    }
  }

  const int64_t page_[2];  // [large, small]
  const int64_t virtual_size_;
  FreeSet free_[2];                             // [large, small]: mapped free blocks
  std::set<Block*, ByAddress> unmapped_[2];     // unmapped parts of the virtual ranges
  std::vector<Range> segments_;
  int64_t next_base_ = kSyntheticBase;
  int64_t released_ranges_ = 0;
};

}  // namespace memo_models
