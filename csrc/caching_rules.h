// PyTorch's CUDACachingAllocator rules (512-byte rounding, small/large pools, per-stream best fit,
// splitting, merging, max_split_size, release of unused segments), written once for the places
// that apply them: the "caching" allocator model and the caching paths embedded in the other
// models (csrc/allocator_models/caching.h, expandable.h), and the real stitching allocator's normal path
// (csrc/stitching_allocator.h), whose decisions must equal the stitching model's. The blocks,
// their store and the split/merge helpers also serve the expandable-segments model.
//
// Where segments come from differs (the model invents addresses and follows the recorded run's,
// the real allocator maps backend memory), so CachingPools takes a Hooks type:
//
//   Block* new_segment(int64_t bytes, int64_t stream, bool small)
//       One device allocation of `bytes`, as one free block made by the BlockStore (its addr
//       orders it among equally sized blocks); nullptr when there is no memory for it.
//   void reorganising()
//       A device allocation failed: the unused segments are about to be released, then retried.
//   void release_segment(const Block* b)
//       Give back the segment that free block b covers whole; CachingPools recycles b after.
//
// Hand-written: best-fit ties and the release order decide which addresses the next requests
// get, which the models' decision logs are compared on, and the models replay millions of events
// a second through this code (the hooks are inlined, not virtual).
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <set>
#include <vector>

namespace memo_caching {

constexpr int64_t kMiB = int64_t{1} << 20;
// Every request is rounded up to a multiple of kMinBlockSize bytes (and at least that much). It is
// also the smallest remainder worth splitting off in the small pool and in expandable segments.
constexpr int64_t kMinBlockSize = 512;
// Rounded requests of at most kSmallSize bytes are served from the small pool; a large-pool block
// is split only when more than kSmallSize bytes would remain (a smaller tail stays attached).
constexpr int64_t kSmallSize = kMiB;
// Size of a small-pool segment (one device malloc serves many small blocks).
constexpr int64_t kSmallBuffer = 2 * kMiB;
// Size of a large-pool segment for rounded requests below kMinLargeAlloc.
constexpr int64_t kLargeBuffer = 20 * kMiB;
constexpr int64_t kMinLargeAlloc = 10 * kMiB;
// Requests of kMinLargeAlloc bytes or more get a segment of their own size rounded up to this.
constexpr int64_t kRoundLarge = 2 * kMiB;
// With max_split_size set, a request of at least max_split_size bytes may take a cached block
// only if the block is less than this many bytes larger (it would otherwise waste the tail).
constexpr int64_t kOversizeTolerance = kLargeBuffer;
// max_split_size unset (PyTorch's default): any cached block may be split for any request.
constexpr int64_t kNoMaxSplit = 0;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline int64_t round_request(int64_t requested) {
  return requested < kMinBlockSize ? kMinBlockSize : round_up(requested, kMinBlockSize);
}

// Bytes of the device allocation that serves a rounded request that no cached block fits.
inline int64_t segment_size(int64_t size) {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return kLargeBuffer;
  return round_up(size, kRoundLarge);
}

struct Block {
  int64_t addr = 0;
  int64_t size = 0;       // bytes the block spans
  int64_t requested = 0;  // bytes asked for (allocated blocks)
  int64_t stream = 0;
  int32_t segment = -1;  // the owner's number for its segment or virtual range
  bool small = false;
  bool allocated = false;
  bool mapped = true;  // expandable: false for an unmapped part of the virtual range
  Block* prev = nullptr;
  Block* next = nullptr;
};

// Free blocks in best-fit order: stream, then size, then address (lowest address wins a tie).
struct BySize {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->addr < b->addr;
  }
};

using FreeSet = std::set<Block*, BySize>;

// Block objects are recycled rather than freed: a replay creates and merges millions of them.
class BlockStore {
 public:
  Block* make(int64_t addr, int64_t size, int64_t stream, bool small, int32_t segment = -1) {
    Block* b;
    if (!spare_.empty()) {
      b = spare_.back();
      spare_.pop_back();
      *b = Block{};
    } else {
      blocks_.emplace_back();
      b = &blocks_.back();
    }
    b->addr = addr;
    b->size = size;
    b->stream = stream;
    b->small = small;
    b->segment = segment;
    return b;
  }
  void recycle(Block* b) { spare_.push_back(b); }

 private:
  std::deque<Block> blocks_;
  std::vector<Block*> spare_;
};

// The smallest free block of `stream` with at least `size` bytes (iterator into free_blocks).
inline FreeSet::iterator smallest_fit(FreeSet& free_blocks, int64_t stream, int64_t size) {
  Block key;
  key.stream = stream;
  key.size = size;
  key.addr = std::numeric_limits<int64_t>::min();
  auto it = free_blocks.lower_bound(&key);
  if (it != free_blocks.end() && (*it)->stream != stream) return free_blocks.end();
  return it;
}

// Cut `b` to `size` bytes; the rest becomes a free block right after it.
inline void split_tail(BlockStore& store, Block* b, int64_t size, FreeSet& free_blocks) {
  Block* rest = store.make(b->addr + size, b->size - size, b->stream, b->small, b->segment);
  rest->prev = b;
  rest->next = b->next;
  if (b->next) b->next->prev = rest;
  b->next = rest;
  b->size = size;
  free_blocks.insert(rest);
}

// Merge `b` with its neighbours that `mergeable` accepts, taking them out of `set` (the set
// they are filed in) and recycling them. Returns b, grown.
template <class Set, class Mergeable>
Block* absorb_neighbours(BlockStore& store, Block* b, Set& set, Mergeable mergeable) {
  if (Block* p = b->prev; p && mergeable(p)) {
    set.erase(p);
    b->addr = p->addr;
    b->size += p->size;
    b->prev = p->prev;
    if (b->prev) b->prev->next = b;
    store.recycle(p);
  }
  if (Block* n = b->next; n && mergeable(n)) {
    set.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (b->next) b->next->prev = b;
    store.recycle(n);
  }
  return b;
}

template <class Hooks>
class CachingPools {
 public:
  // max_split_size <= 0: kNoMaxSplit. small_split_min: the smallest remainder split off a small
  // block.
  CachingPools(Hooks& hooks, BlockStore& store, int64_t max_split_size, int64_t small_split_min)
      : hooks_(hooks),
        store_(store),
        max_split_(max_split_size > 0 ? max_split_size : kNoMaxSplit),
        small_split_min_(small_split_min) {}
  CachingPools(const CachingPools&) = delete;
  CachingPools& operator=(const CachingPools&) = delete;

  // An allocated block of at least `size` (round_request()'s) bytes; nullptr when the device is
  // out of memory even after releasing the unused segments.
  Block* malloc(int64_t size, int64_t stream) {
    const bool small = size <= kSmallSize;
    FreeSet& free_blocks = pool(small);
    Block* b = best_fit(free_blocks, stream, size);
    if (b) {
      free_blocks.erase(b);
    } else {
      const int64_t segment = segment_size(size);
      b = hooks_.new_segment(segment, stream, small);
      if (!b) {  // the device malloc failed: free every cached unused segment and retry
        hooks_.reorganising();
        release_cached();
        b = hooks_.new_segment(segment, stream, small);
        if (!b) return nullptr;
      }
    }
    if (should_split(b, size)) split_tail(store_, b, size, free_blocks);
    b->allocated = true;
    return b;
  }

  // Take back an allocated block, merged with its free neighbours. Returns it, grown.
  Block* free(Block* b) {
    b->allocated = false;
    b->requested = 0;
    FreeSet& free_blocks = pool(b->small);
    absorb_neighbours(store_, b, free_blocks, [](const Block* x) { return !x->allocated; });
    free_blocks.insert(b);
    return b;
  }

  // Free every segment that holds no allocated block: large pool first, then small, each in
  // best-fit order (stream, size, address), the order the recorded runs release them in.
  void release_cached() {
    for (int small = 0; small < 2; ++small) {
      FreeSet& free_blocks = pool(small != 0);
      for (auto it = free_blocks.begin(); it != free_blocks.end();) {
        Block* b = *it;
        if (b->prev || b->next) {
          ++it;
          continue;
        }
        it = free_blocks.erase(it);
        hooks_.release_segment(b);
        store_.recycle(b);
      }
    }
  }

  FreeSet& pool(bool small) { return small ? small_ : large_; }
  const FreeSet& pool(bool small) const { return small ? small_ : large_; }

 private:
  Block* best_fit(FreeSet& free_blocks, int64_t stream, int64_t size) {
    auto it = smallest_fit(free_blocks, stream, size);
    if (it == free_blocks.end()) return nullptr;
    Block* b = *it;
    if (max_split_) {
      // blocks of max_split_size or more are kept for requests of that size ...
      if (size < max_split_ && b->size >= max_split_) return nullptr;
      // ... and such a request takes one only if less than kOversizeTolerance would be wasted
      if (size >= max_split_ && b->size >= size + kOversizeTolerance) return nullptr;
    }
    return b;
  }

  bool should_split(const Block* b, int64_t size) const {
    const int64_t remaining = b->size - size;
    if (b->small) return remaining >= small_split_min_;
    return (!max_split_ || size < max_split_) && remaining > kSmallSize;
  }

  Hooks& hooks_;
  BlockStore& store_;
  const int64_t max_split_;
  const int64_t small_split_min_;
  FreeSet small_, large_;
};

}  // namespace memo_caching
