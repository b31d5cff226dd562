// GMLake virtual memory stitching allocator (Guo et al., ASPLOS'24), the real one: every block it
// hands out is a readable, writable virtual range backed by physical memory, and a stitched
// block is one contiguous virtual range mapped onto several non-contiguous physical pieces.
// Why one file: one class; its segments, the normal path and the stitching pools' hooks are
// its private parts and change together (the decisions themselves are stitching_rules.h's).
//
// The stitching decisions (BestFit S1-S5, split, stitch, StitchFree, slot numbering, release
// order) are csrc/stitching_rules.h's, the code the "stitching" allocator model
// (csrc/allocator_models/stitching.h, docs/allocator_models.md) runs too; this file adds the physical
// side (hooks over a PhysicalBackend) and the segments of the embedded caching path for
// requests below the fragmentation limit, whose rules are csrc/caching_rules.h's with
// max_split_size unset (the model's CachingAllocator). tests/unit/memo_ext/alloc/test_stitching_allocator.py
// replays every real snapshot through both and compares their decision logs.
//
// Physical memory comes from a PhysicalBackend (below), implemented twice:
//   csrc/stitching_host_backend.h  Linux host memory: memfd_create + mmap(MAP_FIXED|MAP_SHARED)
//   csrc/cuda/stitching_cuda.cpp   CUDA VMM: cuMemCreate / cuMemAddressReserve / cuMemMap
//
// Structure:
//   Segment  one physical allocation (backend handle) with a virtual range of its own, mapped
//            1:1 when it is created. Primitive blocks and normal-path blocks are pieces of it.
//   pBlock   primitive block: a piece [offset, offset + size) of one segment, seen through the
//            segment's own range. Split at 2 MiB boundaries without any mapping call.
//   sBlock   stitched block: a virtual range of its own, mapped part by part onto the physical
//            pieces of several pBlocks (the same physical bytes are then mapped twice: reserved
//            bytes count physical memory only, mapped_bytes counts every view).
//   NBlock   a block of the normal (caching) path, inside a segment like PyTorch's blocks.
// Physical memory is released only by release_cached() (a reorganisation or empty_cache) and at
// teardown: a pBlock's piece is unmapped and handed back to the backend; a segment's range is
// released when nothing of it is left.
//
// Not thread-safe: callers serialise (the Python binding holds the GIL, the CUDA hooks a mutex).
// Nothing here depends on pybind11 or CUDA.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "caching_rules.h"
#include "stitching_rules.h"

namespace memo_stitch {

// ------------------------------------------------------------------------------------ constants
// Segments are ordered as the model orders its invented addresses: segment keys start here and
// advance by each segment's size rounded up to memo_caching::kRoundLarge.
constexpr int64_t kKeyBase = int64_t{1} << 56;

// The normal path's rounding (caching_rules.h), also the usable bytes of a block.
using memo_caching::round_request;
using memo_caching::round_up;

// Decision codes of the log, the same numbers as memo_columns::kSegmentAlloc / kSegmentFree.
constexpr int64_t kLogCreate = 2;
constexpr int64_t kLogRelease = 3;

// ------------------------------------------------------------------------- physical backends
// Where physical memory and virtual ranges come from. Sizes and offsets are bytes, multiples of
// granularity(). Handles name physical allocations; a handle's bytes may be released piece by
// piece, and the backend destroys it when the last piece goes.
class PhysicalBackend {
 public:
  virtual ~PhysicalBackend() = default;
  virtual int64_t granularity() const = 0;
  // A physical allocation of `bytes` bytes; -1 when the backend has no memory for it.
  virtual int64_t create(int64_t bytes) = 0;
  // Give back bytes [offset, offset + bytes) of handle `h` (no longer mapped anywhere).
  virtual void release(int64_t h, int64_t offset, int64_t bytes) = 0;
  // A virtual range of `bytes` bytes, inaccessible until mapped. Throws std::runtime_error.
  virtual uintptr_t reserve(int64_t bytes) = 0;
  virtual void unreserve(uintptr_t va, int64_t bytes) = 0;
  // Map bytes [offset, offset + bytes) of handle `h` at `va`, readable and writable. Throws.
  virtual void map(uintptr_t va, int64_t h, int64_t offset, int64_t bytes) = 0;
  // Unmap [va, va + bytes); the range stays reserved.
  virtual void unmap(uintptr_t va, int64_t bytes) = 0;
  // Wait until the work queued on `stream` so far has finished. The allocator calls it before
  // it unmaps or releases memory a block of that stream used (see StitchingAllocator::settle);
  // host memory has no queued work, so the host backend keeps this no-op.
  virtual void synchronize(int64_t stream) { (void)stream; }
};

// What the allocator counts, beyond the stitching pools' counters. Bytes, counts, seconds.
struct Stats : StitchCounters {
  int64_t reserved_bytes = 0;       // physical bytes held (each physical byte once)
  int64_t peak_reserved_bytes = 0;
  int64_t active_bytes = 0;         // bytes of the blocks in use (their full block sizes)
  int64_t peak_active_bytes = 0;
  int64_t requested_bytes = 0;      // bytes asked for by the blocks in use
  int64_t live_blocks = 0;
  int64_t mapped_bytes = 0;         // bytes of every mapped view: segments + stitched blocks
  int64_t peak_mapped_bytes = 0;
  int64_t segments_alive = 0;       // physical allocations (each with its own range)
  int64_t normal_path_segments = 0; // of which the normal path's
  int64_t allocs = 0;               // successful malloc calls
  int64_t frees = 0;
  int64_t normal_allocs = 0;        // of which served by the normal path
  int64_t reorganisations = 0;      // failed physical allocations answered by release_cached()
  int64_t ooms = 0;                 // requests refused after the retry
  int64_t physical_creates = 0;     // backend create() calls that succeeded (model: mallocs)
  int64_t physical_releases = 0;    // pieces handed back (model: frees)
  int64_t map_calls = 0;            // map + unmap calls (each may cover several chunks)
  int64_t stream_syncs = 0;         // backend synchronize() calls before unmapping
  int64_t reserve_calls = 0;        // reserve + unreserve calls
  double map_seconds = 0;           // wall time in map and unmap
  double reserve_seconds = 0;       // wall time in reserve and unreserve
  double create_seconds = 0;        // wall time in create and release
};

// One piece of a block as the backend sees it: bytes [block_offset, block_offset + bytes) of the
// block are physical bytes [phys_offset, ...) of `handle`, also visible at `va` (the pBlock's or
// segment's own view).
struct View {
  int64_t block_offset;
  uintptr_t va;
  int64_t bytes;
  int64_t handle;
  int64_t phys_offset;
};

struct Options {
  int64_t capacity = 0;  // bytes of physical memory it may hold; <= 0: unlimited
  int64_t frag_limit = kDefaultFragLimit;
  int64_t max_sblocks = kDefaultMaxSBlocks;
  bool log = false;      // keep a log of physical creates/releases (tests compare it)
};

struct LogEntry {
  int64_t event;  // set_event() at the time
  int64_t kind;   // kLogCreate or kLogRelease
  int64_t bytes;
};

class StitchingAllocator {
 public:
  StitchingAllocator(PhysicalBackend& backend, Options options)
      : be_(backend), opt_(options), pools_(hooks_, st_, opt_.frag_limit, opt_.max_sblocks) {
    if (be_.granularity() <= 0 || kGranularity % be_.granularity() != 0) {
      throw std::invalid_argument("the backend's granularity must divide 2 MiB");
    }
    if (opt_.frag_limit < 0) throw std::invalid_argument("frag_limit must be >= 0 bytes");
    if (opt_.max_sblocks < 0) throw std::invalid_argument("max_sblocks must be >= 0");
  }
  StitchingAllocator(const StitchingAllocator&) = delete;
  StitchingAllocator& operator=(const StitchingAllocator&) = delete;
  ~StitchingAllocator() {
    try {
      teardown();
    } catch (...) {
    }
  }

  // A block of at least `requested` bytes for `stream`; 0 when physical memory ran out even
  // after release_cached() and the reclaim callback (the request is counted in stats().ooms).
  uintptr_t malloc(int64_t requested, int64_t stream) {
    if (requested < 0) throw std::invalid_argument("requested bytes must be >= 0");
    if (torn_down_) throw std::logic_error("the allocator has been torn down");
    uintptr_t ptr = place(requested, stream);
    // blocks whose free was deferred (the CUDA backend: until other streams' work on them
    // completed) may be freed now and serve the request
    if (!ptr && reclaim_ && reclaim_()) ptr = place(requested, stream);
    if (!ptr) ++st_.ooms;
    return ptr;
  }

  // Called once when a request is about to be refused for lack of memory: it may free() blocks
  // and returns true when it freed any (the request is then tried once more).
  void set_reclaim(std::function<bool()> reclaim) { reclaim_ = std::move(reclaim); }

  // Return the block at `ptr`. Returns its requested bytes, or -1 when no block starts there.
  int64_t free(uintptr_t ptr) {
    auto it = live_.find(ptr);
    if (it == live_.end()) return -1;
    const Live live = it->second;
    live_.erase(it);
    unsettled_.insert(live.stream);
    ++st_.frees;
    --st_.live_blocks;
    st_.active_bytes -= live.bytes;
    st_.requested_bytes -= live.requested;
    if (live.kind == Live::kNormal) {
      normal_free(live.nblock);
    } else {
      pools_.free(PoolHandle{live.index, live.kind == Live::kStitched});
    }
    return live.requested;
  }

  // Drop every inactive stitched block, give back every free primitive block, then the normal
  // path's unused segments (GMLake's only release of physical memory; empty_cache()).
  void release_cached() {
    pools_.release_cached();
    normal_.release_cached();
  }

  // Release everything, blocks in use included (their pointers become invalid): what the
  // destructor does. Afterwards the backend holds nothing of this allocator.
  void teardown() {
    if (torn_down_) return;
    torn_down_ = true;
    // blocks in use go too: wait for every stream that may still use one
    for (const auto& kv : live_) unsettled_.insert(kv.second.stream);
    for (int64_t stream : unsettled_) synchronize(stream);
    unsettled_.clear();
    pools_.release_all();
    for (int32_t g = 0; g < static_cast<int32_t>(segments_.size()); ++g) {
      if (segments_[g].alive) release_segment(g, segments_[g].live, 0);  // settled above
    }
    live_.clear();
    st_.live_blocks = st_.active_bytes = st_.requested_bytes = 0;
  }

  // The pieces of the block at `ptr` (empty when no block starts there): one for a primitive or
  // normal-path block, one per part for a stitched block, in block order.
  std::vector<View> views(uintptr_t ptr) const {
    std::vector<View> out;
    auto it = live_.find(ptr);
    if (it == live_.end()) return out;
    const Live& live = it->second;
    if (live.kind == Live::kNormal) {
      const NBlock* b = live.nblock;
      const Segment& g = segments_[b->segment];
      out.push_back(View{0, nva(b), b->size, g.handle, b->addr - g.key});
    } else if (live.kind == Live::kPrimitive) {
      const PrimitiveBlock& p = pools_.pblocks()[live.index];
      out.push_back(View{0, pva(live.index), p.size, segments_[p.base].handle, p.offset});
    } else {
      int64_t off = 0;
      for (int32_t q : pools_.sblocks()[live.index].parts) {
        const PrimitiveBlock& p = pools_.pblocks()[q];
        out.push_back(View{off, pva(q), p.size, segments_[p.base].handle, p.offset});
        off += p.size;
      }
    }
    return out;
  }

  // "normal", "primitive" or "stitched" for a live block; "" when no block starts at `ptr`.
  const char* kind(uintptr_t ptr) const {
    auto it = live_.find(ptr);
    if (it == live_.end()) return "";
    static const char* names[] = {"normal", "primitive", "stitched"};
    return names[it->second.kind];
  }

  // Bytes of the block at `ptr` (-1: none): what the caller may use.
  int64_t block_bytes(uintptr_t ptr) const {
    auto it = live_.find(ptr);
    return it == live_.end() ? -1 : it->second.bytes;
  }

  // The stream the block at `ptr` was allocated for; nullopt when no block starts there.
  std::optional<int64_t> stream_of(uintptr_t ptr) const {
    auto it = live_.find(ptr);
    if (it == live_.end()) return std::nullopt;
    return it->second.stream;
  }

  const Stats& stats() const { return st_; }
  // Peaks (reserved, active, mapped bytes) back to their current values, so that the next
  // peak is measured from now (torch.cuda.reset_peak_memory_stats).
  void reset_peaks() {
    st_.peak_reserved_bytes = st_.reserved_bytes;
    st_.peak_active_bytes = st_.active_bytes;
    st_.peak_mapped_bytes = st_.mapped_bytes;
  }
  const std::vector<LogEntry>& log() const { return log_; }
  void set_event(int64_t event) { event_ = event; }
  const Options& options() const { return opt_; }

  // Check every internal invariant; returns "" or a description of the first one broken.
  // O(blocks): the fuzzer calls it every few hundred operations.
  std::string check_invariants() const {
    int64_t reserved = 0, segs = 0, normal_segs = 0, mapped = 0;
    for (const Segment& g : segments_) {
      if (!g.alive) continue;
      reserved += g.live;
      ++segs;
      mapped += g.live;
      if (g.normal) ++normal_segs;
    }
    if (reserved != st_.reserved_bytes) return "reserved bytes disagree with the segments";
    if (segs != st_.segments_alive || normal_segs != st_.normal_path_segments) {
      return "segment counts disagree";
    }
    if (std::string broken = pools_.check_invariants(be_.granularity()); !broken.empty()) {
      return broken;
    }
    // pBlocks cover their segment's live bytes (with the normal-path blocks); every stitched
    // block is one more mapped view
    std::map<int64_t, int64_t> seg_bytes;
    for (const PrimitiveBlock& pb : pools_.pblocks()) {
      if (pb.alive) seg_bytes[pb.base] += pb.size;
    }
    for (const StitchedBlock& sb : pools_.sblocks()) {
      if (sb.alive) mapped += sb.size;
    }
    if (mapped != st_.mapped_bytes) return "mapped bytes disagree";
    // normal path: each segment's block chain covers it; free blocks are in their pool, merged
    for (int32_t g = 0; g < static_cast<int32_t>(segments_.size()); ++g) {
      const Segment& seg = segments_[g];
      if (!seg.alive || !seg.normal) continue;
      const NBlock* b = seg.first;
      if (!b || b->prev || b->addr != seg.key) return "normal segment chain does not start it";
      int64_t cursor = seg.key;
      for (; b; b = b->next) {
        if (b->addr != cursor || b->segment != g) return "normal segment chain has a gap";
        if (b->next && b->next->prev != b) return "normal segment chain links are broken";
        if (!b->allocated) {
          if (!normal_.pool(b->small).count(const_cast<NBlock*>(b))) {
            return "free normal block not in its pool";
          }
          if (b->next && !b->next->allocated) return "two free normal neighbours not merged";
        }
        cursor += b->size;
      }
      if (cursor != seg.key + seg.size) return "normal segment chain does not end it";
      seg_bytes[g] += seg.size;
    }
    for (const auto& kv : seg_bytes) {
      if (segments_[kv.first].live != kv.second) return "segment live bytes disagree";
    }
    int64_t active = 0;
    for (const auto& kv : live_) active += kv.second.bytes;
    if (active != st_.active_bytes) return "active bytes disagree with the live blocks";
    return "";
  }

 private:
  // Serve the request (normal path or stitching pools) and record the block as live; 0 when
  // there is no physical memory for it, even after release_cached().
  uintptr_t place(int64_t requested, int64_t stream) {
    Live live;
    live.requested = requested;
    live.stream = stream;
    uintptr_t ptr = 0;
    int64_t block_bytes = 0;
    if (round_request(requested) < std::max(kNormalPathLimit, opt_.frag_limit)) {
      NBlock* b = normal_.malloc(round_request(requested), stream);
      if (!b) return 0;
      live.kind = Live::kNormal;
      live.nblock = b;
      ptr = nva(b);
      block_bytes = b->size;
      ++st_.normal_allocs;
    } else {
      const int64_t size = round_up(requested, kGranularity);
      PoolHandle h = pools_.best_fit(size, stream);
      if (h.index < 0) {  // no physical memory left: drop the cache and retry
        ++st_.reorganisations;
        release_cached();
        h = pools_.best_fit(size, stream);
        if (h.index < 0) return 0;
      }
      live.kind = h.stitched ? Live::kStitched : Live::kPrimitive;
      live.index = h.index;
      ptr = h.stitched ? pools_.sblocks()[h.index].va : pva(h.index);
      block_bytes = size;
    }
    live.bytes = block_bytes;
    live_[ptr] = live;
    ++st_.allocs;
    ++st_.live_blocks;
    st_.active_bytes += block_bytes;
    st_.peak_active_bytes = std::max(st_.peak_active_bytes, st_.active_bytes);
    st_.requested_bytes += requested;
    return ptr;
  }

  // ----------------------------------------------------------------------------- segments
  using NBlock = memo_caching::Block;
  struct Segment {
    int64_t handle = -1;
    uintptr_t va = 0;
    int64_t size = 0;
    int64_t live = 0;  // bytes not yet released
    int64_t key = 0;   // the model's address of its first byte
    bool alive = false;
    bool normal = false;
    NBlock* first = nullptr;  // normal path: the block at its start
  };

  template <class F>
  auto timed(double& seconds, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    struct Add {
      double& s;
      std::chrono::steady_clock::time_point t0;
      ~Add() {
        s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    } add{seconds, t0};
    return f();
  }

  bool fits(int64_t bytes) const {
    return opt_.capacity <= 0 || st_.reserved_bytes + bytes <= opt_.capacity;
  }

  // A new physical allocation of `bytes` with its own range, mapped; -1 when there is no
  // memory for it (capacity or backend).
  int32_t create_segment(int64_t bytes, bool normal) {
    if (!fits(bytes)) return -1;
    const int64_t h = timed(st_.create_seconds, [&] { return be_.create(bytes); });
    if (h < 0) return -1;
    uintptr_t va = 0;
    try {
      va = timed(st_.reserve_seconds, [&] { return be_.reserve(bytes); });
      ++st_.reserve_calls;
      timed(st_.map_seconds, [&] { be_.map(va, h, 0, bytes); });
      ++st_.map_calls;
    } catch (...) {
      if (va) be_.unreserve(va, bytes);
      be_.release(h, 0, bytes);
      throw;
    }
    const int32_t g = fresh_slot(segments_, spare_seg_);
    Segment& seg = segments_[g];
    seg.handle = h;
    seg.va = va;
    seg.size = seg.live = bytes;
    seg.alive = true;
    seg.normal = normal;
    seg.key = next_key_;
    next_key_ += round_up(bytes, memo_caching::kRoundLarge);
    st_.reserved_bytes += bytes;
    st_.peak_reserved_bytes = std::max(st_.peak_reserved_bytes, st_.reserved_bytes);
    st_.mapped_bytes += bytes;
    st_.peak_mapped_bytes = std::max(st_.peak_mapped_bytes, st_.mapped_bytes);
    ++st_.segments_alive;
    if (normal) ++st_.normal_path_segments;
    ++st_.physical_creates;
    add_log(kLogCreate, bytes);
    return g;
  }

  // Streams that freed a block since they were last synchronized. Unmapping is not ordered
  // with any stream: cuMemUnmap and cuMemRelease take effect when the host calls them, unlike
  // cudaFree (which waits for the device) or a block's reuse (which the pools allow only on the
  // block's own stream, whose work runs in order). A block freed on stream S may still be read
  // or written by kernels S has queued; unmapping its memory then makes those kernels fault.
  // So memory a stream used is unmapped only after that stream was synchronized, as PyTorch's
  // ExpandableSegment::unmapHandles (c10/cuda/CUDACachingAllocator.cpp) synchronizes its
  // segment's stream (or the whole device when the segment serves several) before its
  // cuMemUnmap/cuMemRelease. Other streams a block was recorded on need nothing here: its free
  // waited for their events (csrc/cuda/stitching_cuda.cpp) before the block came back. One
  // synchronize per stream and release batch: a stream is settled once, until it frees again.
  std::set<int64_t> unsettled_;

  void synchronize(int64_t stream) {
    be_.synchronize(stream);
    ++st_.stream_syncs;
  }

  void settle(int64_t stream) {
    if (unsettled_.erase(stream)) synchronize(stream);
  }

  // Hand back `bytes` at `offset` of segment g (unmapped first, after the work queued on
  // `stream`, the stream its blocks were used on, finished); the range goes with the last.
  void release_piece(int32_t g, int64_t offset, int64_t bytes, int64_t stream) {
    settle(stream);
    Segment& seg = segments_[g];
    const bool last = seg.live == bytes;
    // unmapped even when the range goes too: cuMemAddressFree wants a range with no mappings
    timed(st_.map_seconds, [&] { be_.unmap(seg.va + offset, bytes); });
    ++st_.map_calls;
    timed(st_.create_seconds, [&] { be_.release(seg.handle, offset, bytes); });
    seg.live -= bytes;
    st_.reserved_bytes -= bytes;
    st_.mapped_bytes -= bytes;
    ++st_.physical_releases;
    add_log(kLogRelease, bytes);
    if (last) {
      timed(st_.reserve_seconds, [&] { be_.unreserve(seg.va, seg.size); });
      ++st_.reserve_calls;
      seg.alive = false;
      --st_.segments_alive;
      if (seg.normal) --st_.normal_path_segments;
      spare_seg_.push_back(g);
    }
  }

  void release_segment(int32_t g, int64_t bytes, int64_t stream) {
    release_piece(g, 0, bytes, stream);
  }

  void add_log(int64_t kind, int64_t bytes) {
    if (opt_.log) log_.push_back(LogEntry{event_, kind, bytes});
  }

  // ------------------------------------------------------------------------- normal path
  // caching_rules.h's pools (max_split_size unset, as the stitching model's CachingAllocator)
  // over segments of this backend; a block's addr is its model address (segment key + offset).
  struct NormalHooks {
    StitchingAllocator& a;

    NBlock* new_segment(int64_t bytes, int64_t stream, bool small) {
      const int32_t g = a.create_segment(bytes, true);
      if (g < 0) return nullptr;
      NBlock* b = a.nblocks_.make(a.segments_[g].key, bytes, stream, small, g);
      a.segments_[g].first = b;
      return b;
    }
    void reorganising() { ++a.st_.reorganisations; }
    void release_segment(const NBlock* b) {  // a segment's blocks share its stream
      a.release_segment(b->segment, a.segments_[b->segment].size, b->stream);
    }
  };

  uintptr_t nva(const NBlock* b) const {
    const Segment& g = segments_[b->segment];
    return g.va + static_cast<uintptr_t>(b->addr - g.key);
  }

  void normal_free(NBlock* b) {
    normal_.free(b);  // b grows over its free neighbours
    if (!b->prev) segments_[b->segment].first = b;
  }

  // ------------------------------------------------------------------------ stitching pools
  // The physical side of stitching_rules.h's decisions: a primitive block's base is the segment
  // holding it, a stitched block is a range of its own mapped part by part.
  struct PoolHooks {
    StitchingAllocator& a;

    int64_t create_piece(int64_t bytes) {
      const int32_t g = a.create_segment(bytes, false);
      return g < 0 ? kNoMemory : g;
    }

    void release_piece(const PrimitiveBlock& p) {
      a.release_piece(static_cast<int32_t>(p.base), p.offset, p.size, p.stream);
    }

    uintptr_t map_stitched(const std::vector<int32_t>& parts, int64_t bytes,
                           const std::vector<PrimitiveBlock>& pblocks) {
      Stats& st = a.st_;
      PhysicalBackend& be = a.be_;
      const uintptr_t va = a.timed(st.reserve_seconds, [&] { return be.reserve(bytes); });
      ++st.reserve_calls;
      int64_t off = 0;
      try {
        for (int32_t p : parts) {
          const PrimitiveBlock& pb = pblocks[p];
          a.timed(st.map_seconds,
                  [&] { be.map(va + off, a.segments_[pb.base].handle, pb.offset, pb.size); });
          ++st.map_calls;
          off += pb.size;
        }
      } catch (...) {
        if (off) be.unmap(va, off);
        be.unreserve(va, bytes);
        throw;
      }
      st.mapped_bytes += bytes;
      st.peak_mapped_bytes = std::max(st.peak_mapped_bytes, st.mapped_bytes);
      return va;
    }

    // A stitched block is dropped (StitchFree's least recently used one, or by
    // release_cached()) once inactive: its last user freed it on its stream, whose kernels may
    // still read the range.
    void unmap_stitched(const StitchedBlock& s) {
      a.settle(s.stream);
      Stats& st = a.st_;
      a.timed(st.map_seconds, [&] { a.be_.unmap(s.va, s.size); });
      ++st.map_calls;
      a.timed(st.reserve_seconds, [&] { a.be_.unreserve(s.va, s.size); });
      ++st.reserve_calls;
      st.mapped_bytes -= s.size;
    }
  };

  struct Live {
    enum Kind : int { kNormal = 0, kPrimitive = 1, kStitched = 2 } kind = kNormal;
    int32_t index = -1;        // pBlock or sBlock
    NBlock* nblock = nullptr;  // normal path
    int64_t bytes = 0;
    int64_t requested = 0;
    int64_t stream = 0;        // the stream it was allocated for
  };

  uintptr_t pva(int32_t p) const {
    const PrimitiveBlock& pb = pools_.pblocks()[p];
    return segments_[pb.base].va + static_cast<uintptr_t>(pb.offset);
  }

  PhysicalBackend& be_;
  const Options opt_;
  Stats st_;
  std::vector<LogEntry> log_;
  int64_t event_ = -1;
  bool torn_down_ = false;
  std::function<bool()> reclaim_;
  // segments
  std::vector<Segment> segments_;
  std::vector<int32_t> spare_seg_;
  int64_t next_key_ = kKeyBase;
  // normal path
  memo_caching::BlockStore nblocks_;
  NormalHooks normal_hooks_{*this};
  memo_caching::CachingPools<NormalHooks> normal_{
      normal_hooks_, nblocks_, memo_caching::kNoMaxSplit, memo_caching::kMinBlockSize};
  // stitching pools (declared after st_ and opt_, which they are built from)
  PoolHooks hooks_{*this};
  StitchingPools<PoolHooks> pools_;
  // blocks in use, by address
  std::unordered_map<uintptr_t, Live> live_;
};

}  // namespace memo_stitch
