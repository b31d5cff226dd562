// Allocator model "stitching": GMLake virtual memory stitching -- primitive blocks (pBlocks) of
// physical 2 MiB chunks, stitched blocks (sBlocks) reused by exact size only, small requests on
// a caching path. The rules are csrc/stitching_rules.h's, which the real allocator
// (csrc/stitching_allocator.h) runs too; this file only gives them invented addresses and the
// modelled device. C++ for the replay rate (see bindings.cpp).
#pragma once

#include "../stitching_counters_py.h"
#include "../stitching_rules.h"
#include "caching.h"

namespace memo_models {

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
    memo_stitch::put_stitch_counters(d, counters_);  // named as the real allocator names them
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

}  // namespace memo_models
