// Allocator models: replay an allocation trace against a modelled GPU allocator at a given
// capacity and report what the allocator would have reserved, when it had to reorganise and
// whether it ran out of memory.
//
// Four policies, each written from the rules in docs/allocator_models.md:
//   "caching"     PyTorch's CUDACachingAllocator: 512-byte rounding, small/large pools with
//                 per-stream best fit, splitting, merging, max_split_size, and a "reorganisation"
//                 (free every cached unused segment, retry) when a device malloc fails.
//   "expandable"  expandable segments: one growing virtual range per (stream, pool) whose pages
//                 are mapped on demand and unmapped when the allocator reorganises.
//   "stitching"   GMLake virtual memory stitching: primitive blocks (pBlocks) of physical 2 MiB
//                 chunks, stitched blocks (sBlocks) reused by exact size only; the rules are
//                 csrc/stitching_rules.h's, which the real allocator runs too.
//   "arena"       a planned arena: request k goes to a planned offset; a request the plan does not
//                 cover, or that does not fit where the plan puts it, takes the caching path.
//
// Why C++: a long-context run emits millions of allocator events, and the planner and the report
// replay each trace under several policies and capacities. The models do an ordered-set lookup
// and a hash lookup per event, a few hundred nanoseconds here versus tens of microseconds in
// Python. bench/allocator_replay.py measures the rate (bench/results/allocator_replay.md).
//
// Input events are four equally long int64 arrays: action, id, size, stream. ALLOC asks for
// `size` requested bytes on `stream` and names the block `id` (an address in a snapshot); FREE
// returns block `id`. SEGMENT_* and OTHER events are ignored (they are the recorded allocator's
// own decisions); EMPTY_CACHE releases every cached unused segment (torch.cuda.empty_cache());
// FAILED_ALLOC is a request the recorded run failed with an out-of-memory error: the model tries
// it too and, if it succeeds, hands the block straight back (the program never got it).
#include <pybind11/numpy.h>
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

#include "caching_rules.h"
#include "int64_columns.h"
#include "stitching_rules.h"

namespace py = pybind11;

namespace {

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

  // Take block `id` out of the live set, marked free; nullptr when the id is not live here.
  Block* release(int64_t id, int64_t* requested) {
    auto it = live_.find(id);
    if (it == live_.end()) return nullptr;
    Block* b = it->second.block;
    live_.erase(it);
    *requested = b->requested;
    b->allocated = false;
    b->requested = 0;
    return b;
  }

  void live_layout(std::vector<std::tuple<int64_t, int64_t, int64_t>>& out) const {
    for (const auto& kv : live_) out.emplace_back(kv.second.block->addr, kv.second.block->size, 1);
  }

  Device& dev_;
  BlockStore store_;
  std::unordered_map<int64_t, LiveEntry> live_;
};

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
    int64_t requested = 0;
    Block* b = release(id, &requested);
    if (!b) return -1;
    pools_.free(b);
    return requested;
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
    int64_t requested = 0;
    Block* b = release(id, &requested);
    if (!b) return -1;
    insert_free(b);
    return requested;
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

// ------------------------------------------------------------------------- GMLake stitching
// stitching_rules.h's decisions over invented addresses: a primitive block's base is the address
// its physical allocation was given, and a stitched block maps nothing.
struct SyntheticPhysical {
  Device& dev;
  int64_t next_addr = kSyntheticBase;

  int64_t create_piece(int64_t bytes) {
    if (!dev.fits(bytes)) return memo_stitch::kNoMemory;
    const int64_t addr = next_addr;
    next_addr += bytes;
    dev.take(bytes, kSegmentAlloc, addr);
    return addr;
  }
  void release_piece(const memo_stitch::PrimitiveBlock& p) {
    dev.give(p.size, kSegmentFree, p.base + p.offset);
  }
  uintptr_t map_stitched(const std::vector<int32_t>&, int64_t,
                         const std::vector<memo_stitch::PrimitiveBlock>&) {
    return 0;
  }
  void unmap_stitched(const memo_stitch::StitchedBlock&) {}
};

class StitchingAllocator {
 public:
  StitchingAllocator(Device& dev, int64_t frag_limit, int64_t max_sblocks)
      : dev_(dev),
        normal_(dev, kNoMaxSplit),
        frag_limit_(frag_limit),
        physical_{dev},
        pools_(physical_, counters_, frag_limit, max_sblocks) {}

  // Requests below the fragmentation limit (and always below kNormalPathLimit) take the normal
  // caching path, with its splitting and merging; larger ones the stitching pools.
  bool malloc(int64_t id, int64_t requested, int64_t stream) {
    if (round_request(requested) < std::max(memo_stitch::kNormalPathLimit, frag_limit_)) {
      return normal_.malloc(id, requested, stream);
    }
    const int64_t size = round_up(requested, memo_stitch::kGranularity);
    memo_stitch::PoolHandle h = pools_.best_fit(size, stream);
    if (h.index < 0) {  // no physical memory left: drop the cache and retry
      ++dev_.reorganisations;
      release_cached();
      h = pools_.best_fit(size, stream);
      if (h.index < 0) return false;
    }
    live_[id] = Live{h, requested};
    return true;
  }

  int64_t free(int64_t id) {
    auto it = live_.find(id);
    if (it == live_.end()) return normal_.free(id);
    const Live live = it->second;
    live_.erase(it);
    pools_.free(live.handle);
    return live.requested;
  }

  // The stitching pools' cached blocks, then the normal path's cached segments.
  void release_cached() {
    pools_.release_cached();
    normal_.release_cached();
  }

  py::dict counters() const {
    py::dict d;
    d["exact_hits"] = counters_.exact_hits;
    d["splits"] = counters_.splits;
    d["stitches"] = counters_.stitches;
    d["stitched_bytes"] = counters_.stitched_bytes;
    d["new_pblocks"] = counters_.new_pblocks;
    d["sblocks_dropped"] = counters_.sblocks_dropped;
    d["normal_path_segments"] = normal_.num_segments();
    return d;
  }

 private:
  struct Live {
    memo_stitch::PoolHandle handle;
    int64_t requested;
  };

  Device& dev_;
  CachingAllocator normal_;
  const int64_t frag_limit_;
  memo_stitch::StitchCounters counters_;
  SyntheticPhysical physical_;
  memo_stitch::StitchingPools<SyntheticPhysical> pools_;
  std::unordered_map<int64_t, Live> live_;
};

// ---------------------------------------------------------------------------- planned arena
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
        offset % kArenaAlignment != 0 || offset + size > arena_ || overlaps(offset, size)) {
      ++fallbacks_;
      return fallback_.malloc(id, requested, stream);
    }
    busy_[offset] = offset + size;
    live_[id] = {offset, requested};
    ++planned_;
    return true;
  }

  int64_t free(int64_t id) {
    auto it = live_.find(id);
    if (it == live_.end()) return fallback_.free(id);
    const int64_t requested = it->second.second;
    busy_.erase(it->second.first);
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
  bool overlaps(int64_t offset, int64_t size) const {
    auto it = busy_.upper_bound(offset);
    if (it != busy_.end() && it->first < offset + size) return true;
    if (it != busy_.begin() && std::prev(it)->second > offset) return true;
    return false;
  }

  Device& dev_;
  CachingAllocator fallback_;
  const int64_t arena_;
  const int64_t* offsets_;
  const int64_t* sizes_;
  bool arena_ok_ = false;
  std::map<int64_t, int64_t> busy_;  // offset -> end of live arena blocks
  std::unordered_map<int64_t, std::pair<int64_t, int64_t>> live_;  // id -> (offset, requested)
  int64_t planned_ = 0, fallbacks_ = 0, unplanned_ = 0;
};

// ------------------------------------------------------------------------------ replay loop

int64_t cfg_int(const py::dict& cfg, const char* key, int64_t fallback) {
  if (!cfg.contains(key) || cfg[key].is_none()) return fallback;
  return cfg[key].cast<int64_t>();
}

// An optional per-event array of the config (nullptr when absent); `keep` holds the reference.
const int64_t* cfg_array(const py::dict& cfg, const char* key, py::ssize_t n,
                         std::vector<Int64Array>& keep) {
  if (!cfg.contains(key) || cfg[key].is_none()) return nullptr;
  keep.push_back(cfg[key].cast<Int64Array>());
  require_1d(keep.back(), key, n);
  return keep.back().data();
}

struct Totals {
  int64_t allocated = 0;  // sum of 512-rounded requested bytes of live requests
  int64_t requested = 0;  // sum of requested bytes of live requests
  int64_t peak_allocated = 0;
  int64_t peak_allocated_index = -1;
  int64_t peak_requested = 0;
  int64_t ooms = 0;
  int64_t first_oom_index = -1;
  int64_t first_oom_request = 0;
  int64_t first_oom_stream = 0;
  int64_t unmatched_frees = 0;
  int64_t duplicate_allocs = 0;
  int64_t failed_reproduced = 0;
  int64_t failed_succeeded = 0;
};

template <class Model>
void replay(Model& model, Device& dev, Totals& t, py::ssize_t n, const int64_t* act,
            const int64_t* id, const int64_t* size, const int64_t* stream, int64_t* alloc_tl,
            int64_t* reserved_tl) {
  std::unordered_set<int64_t> refused;  // ids of requests that ran out of memory
  auto record_oom = [&](py::ssize_t i) {
    if (t.ooms++ == 0) {
      t.first_oom_index = i;
      t.first_oom_request = size[i];
      t.first_oom_stream = stream[i];
    }
  };
  for (py::ssize_t i = 0; i < n; ++i) {
    dev.event = i;
    const int64_t s = size[i];
    if (s < 0) throw std::invalid_argument("sizes[" + std::to_string(i) + "] is negative");
    switch (act[i]) {
      case kAlloc: {
        if (int64_t old = model.free(id[i]); old >= 0) {  // allocated twice without a free
          ++t.duplicate_allocs;
          t.allocated -= round_request(old);
          t.requested -= old;
        }
        if (model.malloc(id[i], s, stream[i])) {
          t.allocated += round_request(s);
          t.requested += s;
          if (t.allocated > t.peak_allocated) {
            t.peak_allocated = t.allocated;
            t.peak_allocated_index = i;
          }
          t.peak_requested = std::max(t.peak_requested, t.requested);
        } else {
          record_oom(i);
          refused.insert(id[i]);
        }
        break;
      }
      case kFree: {
        const int64_t old = model.free(id[i]);
        if (old >= 0) {
          t.allocated -= round_request(old);
          t.requested -= old;
        } else if (refused.empty() || refused.erase(id[i]) == 0) {
          ++t.unmatched_frees;
        }
        break;
      }
      case kFailedAlloc: {
        const int64_t probe = std::numeric_limits<int64_t>::min() + i;
        if (model.malloc(probe, s, stream[i])) {
          ++t.failed_succeeded;
          model.free(probe);
        } else {
          ++t.failed_reproduced;
          record_oom(i);
        }
        break;
      }
      case kEmptyCache:
        model.release_cached();
        break;
      case kSegmentAlloc:
      case kSegmentFree:
      case kSegmentMap:
      case kSegmentUnmap:
      case kOther:
        break;
      default:
        throw std::invalid_argument("actions[" + std::to_string(i) + "] = " +
                                    std::to_string(act[i]) + " is not an action code (0..8)");
    }
    if (alloc_tl) {
      alloc_tl[i] = t.allocated;
      reserved_tl[i] = dev.reserved;
    }
  }
}

py::array_t<int64_t> layout_array(const std::vector<std::tuple<int64_t, int64_t, int64_t>>& v) {
  py::array_t<int64_t> a({static_cast<py::ssize_t>(v.size()), py::ssize_t{3}});
  auto m = a.mutable_unchecked<2>();
  for (size_t i = 0; i < v.size(); ++i) {
    m(i, 0) = std::get<0>(v[i]);
    m(i, 1) = std::get<1>(v[i]);
    m(i, 2) = std::get<2>(v[i]);
  }
  return a;
}

py::array_t<int64_t> to_array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

py::dict replay_allocator(const std::string& policy, const Int64Array& actions,
                          const Int64Array& ids, const Int64Array& sizes,
                          const Int64Array& streams, const py::dict& cfg, bool timelines) {
  require_1d(actions, "actions", -1);
  const py::ssize_t n = actions.shape(0);
  require_1d(ids, "ids", n);
  require_1d(sizes, "sizes", n);
  require_1d(streams, "streams", n);
  std::vector<Int64Array> keep;

  Device dev;
  dev.capacity = cfg_int(cfg, "capacity", 0);
  if (dev.capacity < 0) throw py::value_error("capacity must be >= 0 bytes (0: unlimited)");
  const int64_t max_split = cfg_int(cfg, "max_split_size", 0);
  if (max_split < 0) throw py::value_error("max_split_size must be >= 0 bytes (0: unlimited)");
  Totals t;

  Int64Array alloc_out(timelines ? n : 0);
  Int64Array reserved_out(timelines ? n : 0);
  int64_t* alloc_tl = timelines ? alloc_out.mutable_data() : nullptr;
  int64_t* reserved_tl = timelines ? reserved_out.mutable_data() : nullptr;
  const int64_t* act = actions.data();
  const int64_t* id = ids.data();
  const int64_t* size = sizes.data();
  const int64_t* stream = streams.data();
  py::dict extra;
  py::object layout = py::none();
  int64_t initial_reserved = 0;

  if (policy == "caching") {
    CachingAllocator model(dev, max_split,
                           cfg_int(cfg, "small_split_min", kMinBlockSize));
    model.set_hints(cfg_array(cfg, "hint_addr", n, keep), cfg_array(cfg, "hint_size", n, keep));
    if (cfg.contains("initial_segments") && !cfg["initial_segments"].is_none()) {
      // initial_segments: (addr, size, stream, small) rows; initial_blocks: (segment row, addr,
      // size, requested, id) rows
      auto segs = cfg["initial_segments"].cast<Int64Array>();
      auto blks = cfg["initial_blocks"].cast<Int64Array>();
      if (segs.ndim() != 2 || segs.shape(1) != 4 || blks.ndim() != 2 || blks.shape(1) != 5) {
        throw py::value_error("initial_segments must be (k, 4) and initial_blocks (m, 5)");
      }
      std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>> per(segs.shape(0));
      for (py::ssize_t j = 0; j < blks.shape(0); ++j) {
        const int64_t row = blks.at(j, 0);
        if (row < 0 || row >= segs.shape(0)) throw py::value_error("initial block segment row");
        per[row].emplace_back(blks.at(j, 1), blks.at(j, 2), blks.at(j, 3), blks.at(j, 4));
        t.allocated += round_request(blks.at(j, 3));
        t.requested += blks.at(j, 3);
      }
      for (py::ssize_t k = 0; k < segs.shape(0); ++k) {
        model.add_initial_segment(segs.at(k, 0), segs.at(k, 1), segs.at(k, 2), segs.at(k, 3) != 0,
                                  std::move(per[k]));
      }
      t.peak_allocated = t.allocated;
      t.peak_requested = t.requested;
      initial_reserved = dev.reserved;
    }
    {
      py::gil_scoped_release no_gil;
      replay(model, dev, t, n, act, id, size, stream, alloc_tl, reserved_tl);
    }
    extra["final_segments"] = model.num_segments();
    if (cfg_int(cfg, "final_layout", 0)) layout = layout_array(model.layout());
  } else if (policy == "expandable") {
    const int64_t cap = dev.capacity;
    const int64_t vsize = cfg_int(
        cfg, "virtual_size",
        cap > 0 ? cap / kVirtualRangeDen * kVirtualRangeNum : kUnlimitedVirtualRange);
    ExpandableAllocator model(dev, cfg_int(cfg, "small_page", kExpandableSmallPage),
                              cfg_int(cfg, "large_page", kExpandableLargePage), vsize);
    {
      py::gil_scoped_release no_gil;
      replay(model, dev, t, n, act, id, size, stream, alloc_tl, reserved_tl);
    }
    extra["virtual_ranges"] = model.virtual_ranges();
    extra["released_ranges"] = model.released_ranges();
    if (cfg_int(cfg, "final_layout", 0)) layout = layout_array(model.layout());
  } else if (policy == "stitching") {
    StitchingAllocator model(dev, cfg_int(cfg, "frag_limit", memo_stitch::kDefaultFragLimit),
                             cfg_int(cfg, "max_sblocks", memo_stitch::kDefaultMaxSBlocks));
    {
      py::gil_scoped_release no_gil;
      replay(model, dev, t, n, act, id, size, stream, alloc_tl, reserved_tl);
    }
    extra = model.counters();
  } else if (policy == "arena") {
    const int64_t* offsets = cfg_array(cfg, "plan_offset", n, keep);
    const int64_t* planned = cfg_array(cfg, "plan_size", n, keep);
    ArenaAllocator model(dev, cfg_int(cfg, "arena_bytes", 0), offsets, planned);
    {
      py::gil_scoped_release no_gil;
      replay(model, dev, t, n, act, id, size, stream, alloc_tl, reserved_tl);
    }
    extra = model.counters();
  } else {
    throw py::value_error("unknown policy '" + policy +
                          "': expected caching, expandable, stitching or arena");
  }

  py::dict out;
  out["policy"] = policy;
  out["capacity"] = dev.capacity;
  out["num_events"] = static_cast<int64_t>(n);
  out["initial_reserved"] = initial_reserved;
  out["peak_allocated"] = t.peak_allocated;
  out["peak_allocated_index"] = t.peak_allocated_index;
  out["peak_requested"] = t.peak_requested;
  out["peak_reserved"] = dev.peak_reserved;
  out["final_allocated"] = t.allocated;
  out["final_requested"] = t.requested;
  out["final_reserved"] = dev.reserved;
  out["device_mallocs"] = dev.mallocs;
  out["device_frees"] = dev.frees;
  out["reorganisations"] = dev.reorganisations;
  out["num_ooms"] = t.ooms;
  out["first_oom_index"] = t.first_oom_index;
  out["first_oom_request"] = t.first_oom_request;
  out["first_oom_stream"] = t.first_oom_stream;
  out["unmatched_frees"] = t.unmatched_frees;
  out["duplicate_allocs"] = t.duplicate_allocs;
  out["failed_allocs_reproduced"] = t.failed_reproduced;
  out["failed_allocs_succeeded"] = t.failed_succeeded;
  out["allocated"] = alloc_out;
  out["reserved"] = reserved_out;
  out["decision_event"] = to_array(dev.log_event);
  out["decision_kind"] = to_array(dev.log_kind);
  out["decision_size"] = to_array(dev.log_size);
  out["decision_addr"] = to_array(dev.log_addr);
  out["extra"] = extra;
  out["final_layout"] = layout;
  return out;
}

// Offsets for every ALLOC of a trace in one contiguous arena: best fit among the gaps left by
// freed requests (coalesced), else the top of the arena. A stand-in for the MEMO planner when no
// plan file is given: it knows no lifetimes, so its peak is an upper bound on a real plan's.
py::dict plan_best_fit(const Int64Array& actions, const Int64Array& ids, const Int64Array& sizes) {
  require_1d(actions, "actions", -1);
  const py::ssize_t n = actions.shape(0);
  require_1d(ids, "ids", n);
  require_1d(sizes, "sizes", n);
  Int64Array offsets(n);
  int64_t* out = offsets.mutable_data();
  const int64_t* act = actions.data();
  const int64_t* id = ids.data();
  const int64_t* size = sizes.data();
  int64_t top = 0, peak = 0;
  {
    py::gil_scoped_release no_gil;
    std::set<std::pair<int64_t, int64_t>> by_size;  // (size, offset) of gaps below the top
    std::map<int64_t, int64_t> by_offset;            // offset -> size
    std::unordered_map<int64_t, std::pair<int64_t, int64_t>> live;  // id -> (offset, size)
    auto add_gap = [&](int64_t off, int64_t sz) {
      auto next = by_offset.find(off + sz);
      if (next != by_offset.end()) {
        sz += next->second;
        by_size.erase({next->second, next->first});
        by_offset.erase(next);
      }
      auto it = by_offset.lower_bound(off);
      if (it != by_offset.begin()) {
        auto prev = std::prev(it);
        if (prev->first + prev->second == off) {
          off = prev->first;
          sz += prev->second;
          by_size.erase({prev->second, prev->first});
          by_offset.erase(prev);
        }
      }
      if (off + sz == top) {
        top = off;
        return;
      }
      by_offset[off] = sz;
      by_size.insert({sz, off});
    };
    for (py::ssize_t i = 0; i < n; ++i) {
      out[i] = -1;
      if (act[i] == kAlloc) {
        if (size[i] < 0) throw std::invalid_argument("sizes[" + std::to_string(i) + "] < 0");
        const int64_t sz = round_request(size[i]);
        if (auto old = live.find(id[i]); old != live.end()) {
          add_gap(old->second.first, old->second.second);
          live.erase(old);
        }
        int64_t off;
        auto g = by_size.lower_bound({sz, std::numeric_limits<int64_t>::min()});
        if (g != by_size.end()) {
          off = g->second;
          const int64_t gsz = g->first;
          by_size.erase(g);
          by_offset.erase(off);
          if (gsz > sz) {
            by_offset[off + sz] = gsz - sz;
            by_size.insert({gsz - sz, off + sz});
          }
        } else {
          // a gap that ends at the top can be extended upwards
          off = top;
          if (!by_offset.empty()) {
            auto last = std::prev(by_offset.end());
            if (last->first + last->second == top) {
              off = last->first;
              by_size.erase({last->second, last->first});
              by_offset.erase(last);
            }
          }
          top = off + sz;
        }
        live[id[i]] = {off, sz};
        out[i] = off;
        peak = std::max(peak, top);
      } else if (act[i] == kFree) {
        auto it = live.find(id[i]);
        if (it != live.end()) {
          add_gap(it->second.first, it->second.second);
          live.erase(it);
        }
      }
    }
  }
  py::dict d;
  d["offsets"] = offsets;
  d["arena_bytes"] = peak;
  return d;
}

}  // namespace

// Called from the PYBIND11_MODULE in trace_replay.cpp: all of csrc/ builds one module, memo_ext._C.
void register_allocator_models(py::module_& m) {
  m.attr("EMPTY_CACHE") = static_cast<int64_t>(kEmptyCache);
  m.attr("FAILED_ALLOC") = static_cast<int64_t>(kFailedAlloc);
  py::dict constants;
  constants["kMinBlockSize"] = kMinBlockSize;
  constants["kSmallSize"] = kSmallSize;
  constants["kSmallBuffer"] = kSmallBuffer;
  constants["kLargeBuffer"] = kLargeBuffer;
  constants["kMinLargeAlloc"] = kMinLargeAlloc;
  constants["kRoundLarge"] = kRoundLarge;
  constants["kOversizeTolerance"] = kOversizeTolerance;
  constants["kExpandableSmallPage"] = kExpandableSmallPage;
  constants["kExpandableLargePage"] = kExpandableLargePage;
  constants["kUnlimitedVirtualRange"] = kUnlimitedVirtualRange;
  constants["kStitchGranularity"] = memo_stitch::kGranularity;
  constants["kStitchNormalPathLimit"] = memo_stitch::kNormalPathLimit;
  constants["kDefaultFragLimit"] = memo_stitch::kDefaultFragLimit;
  constants["kDefaultMaxSBlocks"] = memo_stitch::kDefaultMaxSBlocks;
  constants["kArenaAlignment"] = kArenaAlignment;
  constants["kSyntheticBase"] = kSyntheticBase;
  m.attr("ALLOCATOR_CONSTANTS") = constants;
  m.def("replay_allocator", &replay_allocator, py::arg("policy"), py::arg("actions"),
        py::arg("ids"), py::arg("sizes"), py::arg("streams"), py::arg("config") = py::dict(),
        py::arg("timelines") = true,
        R"doc(Replay a trace through one allocator model (see docs/allocator_models.md).

policy: "caching", "expandable", "stitching" or "arena". actions, ids, sizes (requested bytes),
streams: equally long 1-D int64 arrays. config: dict of options, all optional: capacity (bytes,
0 = unlimited), max_split_size (bytes, caching, 0 = unlimited), hint_addr/hint_size (caching,
per-event address and size of the recorded device malloc), small_split_min (caching, bytes: the
smallest remainder split off a small-pool block, default 512), final_layout (caching and
expandable: also return "final_layout", (k, 3) rows of address, bytes, state 0 free / 1
allocated / 2 unmapped), initial_segments ((k, 4): addr, size,
stream, small) and initial_blocks ((m, 5): segment row, addr, size, requested, id) for caching,
small_page/large_page/virtual_size (expandable, bytes), frag_limit/max_sblocks (stitching),
arena_bytes/plan_offset/plan_size (arena; per-event arrays, -1 = none). timelines: also return
allocated/reserved bytes after each event.

Returns a dict of byte peaks and finals, counts (device_mallocs, device_frees,
reorganisations, num_ooms, first_oom_index/request/stream, unmatched_frees, ...), the timelines
and the decision log (decision_event, decision_kind, decision_size, decision_addr) of every
device malloc/free (segment_alloc/free) or page map/unmap the model made; "extra" holds
policy-specific counters.)doc");
  m.def("plan_best_fit", &plan_best_fit, py::arg("actions"), py::arg("ids"), py::arg("sizes"),
        R"doc(Arena offsets (bytes, -1 for non-ALLOC events) for every ALLOC of a trace by online
best fit with coalescing; returns {"offsets": int64 array, "arena_bytes": peak}.)doc");
}
