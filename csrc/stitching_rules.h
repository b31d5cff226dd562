// GMLake's stitching rules (Guo et al., ASPLOS'24), written once for the two places that apply
// them: the "stitching" allocator model (csrc/allocator_models/stitching.h), which replays traces with
// invented addresses and maps nothing, and the real allocator (csrc/stitching_allocator.h),
// which maps physical memory through a PhysicalBackend. Both must make the same physical
// allocations and releases on every trace (tests/unit/memo_ext/alloc/test_stitching_allocator.py and
// bench/stitching.py compare their decision logs), so the decisions live here and only the
// physical side effects differ, supplied by a Hooks type:
//
//   int64_t create_piece(int64_t bytes)
//       A new physical allocation of `bytes` for a primitive block; returns a number that
//       locates it (the model: its invented address; the real allocator: its segment), or
//       kNoMemory when there is no memory for it.
//   void release_piece(const PrimitiveBlock& p)
//       Give back p's bytes [p.offset, p.offset + p.size) of the allocation p.base.
//   uintptr_t map_stitched(const std::vector<int32_t>& parts, int64_t bytes,
//                          const std::vector<PrimitiveBlock>& pblocks)
//       A virtual range of `bytes` mapped onto the primitive blocks `parts`, in order (the model:
//       0, it maps nothing). May throw; nothing has changed then.
//   void unmap_stitched(const StitchedBlock& s)
//       Unmap and give back s's range.
//
// Hand-written rather than a generic pool library: the rules' order (S1 primitive before
// stitched, slot recycling last in first out, release in best-fit order) breaks the ties that
// the two decision logs are compared on, and the model replays millions of events a second
// through this code, so the hooks are a template parameter (inlined, no virtual calls).
// Nothing here depends on pybind11 or CUDA.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace memo_stitch {

constexpr int64_t kMiB = int64_t{1} << 20;
// GMLake's physical chunk: stitched requests are rounded up to it, and pBlocks are split only at
// multiples of it (cuMemCreate's granularity on NVIDIA GPUs).
constexpr int64_t kGranularity = 2 * kMiB;
// Requests below this always take the normal (caching) path (GMLake: "requests < 2 MiB go the
// normal path"); requests below the fragmentation limit too.
constexpr int64_t kNormalPathLimit = 2 * kMiB;
// Default fragmentation limit: requests below it take the normal path, free pBlocks below it are
// never stitched (S3).
constexpr int64_t kDefaultFragLimit = 128 * kMiB;
// StitchFree: above this many stitched blocks, the least recently used inactive one is dropped.
constexpr int64_t kDefaultMaxSBlocks = 1024;
// What Hooks::create_piece returns when the physical allocation failed.
constexpr int64_t kNoMemory = -1;

// Index of a fresh (value-initialised) item: a recycled index from `spare` (last in, first
// out), else a new one at the end. Slot numbers break ties in S1, so both users number alike.
template <class T>
int32_t fresh_slot(std::vector<T>& items, std::vector<int32_t>& spare) {
  if (!spare.empty()) {
    const int32_t i = spare.back();
    spare.pop_back();
    items[i] = T{};
    return i;
  }
  items.emplace_back();
  return static_cast<int32_t>(items.size() - 1);
}

// What the stitching pools count.
struct StitchCounters {
  int64_t exact_hits = 0;       // S1
  int64_t splits = 0;           // pBlock splits (S2, and S3's overshoot)
  int64_t stitches = 0;         // stitched blocks created
  int64_t stitched_bytes = 0;   // bytes they map
  int64_t new_pblocks = 0;      // physical allocations of the stitching pools (S4)
  int64_t sblocks_dropped = 0;  // StitchFree and reorganisations
  int64_t sblocks_alive = 0;    // stitched blocks cached or in use
};

// A primitive block: bytes [offset, offset + size) of the physical allocation `base` (a number
// of the hooks). Split at 2 MiB boundaries; the pieces keep their base.
struct PrimitiveBlock {
  int64_t base = 0;
  int64_t offset = 0;
  int64_t size = 0;
  int64_t stream = 0;
  bool active = false;
  bool alive = true;
  std::vector<int32_t> sblocks;  // stitched blocks that map this one
};

// A stitched block: one virtual range over the physical pieces of several primitive blocks.
struct StitchedBlock {
  int64_t size = 0;
  int64_t stream = 0;
  uintptr_t va = 0;  // what Hooks::map_stitched returned
  std::vector<int32_t> parts;
  int32_t busy = 0;  // parts in use
  bool active = false;
  bool alive = true;
  int64_t last_use = 0;
};

// A block the pools handed out: a primitive or a stitched block's slot (index -1: none).
struct PoolHandle {
  int32_t index = -1;
  bool stitched = false;
};

template <class Hooks>
class StitchingPools {
 public:
  StitchingPools(Hooks& hooks, StitchCounters& counters, int64_t frag_limit, int64_t max_sblocks)
      : hooks_(hooks), counters_(counters), frag_limit_(frag_limit), max_sblocks_(max_sblocks) {}
  StitchingPools(const StitchingPools&) = delete;
  StitchingPools& operator=(const StitchingPools&) = delete;

  // GMLake's BestFit for `size` bytes (a multiple of kGranularity). Returns index -1 when
  // physical memory ran out.
  PoolHandle best_fit(int64_t size, int64_t stream) {
    PoolHandle h;
    // S1: an exact match, primitive first, then stitched
    auto it = pfree_.lower_bound(PKey{stream, size, -1});
    if (it != pfree_.end() && std::get<0>(*it) == stream && std::get<1>(*it) == size) {
      h.index = std::get<2>(*it);
      activate_p(h.index);
      ++counters_.exact_hits;
      return h;
    }
    if (auto s = savail_.find(std::make_pair(stream, size)); s != savail_.end()) {
      h.index = *s->second.begin();
      h.stitched = true;
      activate_s(h.index);
      ++counters_.exact_hits;
      return h;
    }
    // S2: the smallest larger primitive block: split it, stitch the pieces back for later
    it = pfree_.upper_bound(PKey{stream, size, std::numeric_limits<int32_t>::max()});
    if (it != pfree_.end() && std::get<0>(*it) == stream) {
      const int32_t p = std::get<2>(*it);
      const int32_t q = split_p(p, size);
      stitch({p, q}, stream);
      activate_p(p);
      h.index = p;
      return h;
    }
    // S3/S4: free primitive blocks of at least the limit (smaller ones, left over by splits, are
    // never stitched), largest first, stitched together, topped up with a new primitive block
    // when they are not enough
    std::vector<int32_t> parts;
    int64_t total = 0;
    for (auto r = pfree_.lower_bound(PKey{stream, std::numeric_limits<int64_t>::max(), -1});
         total < size && r != pfree_.begin();) {
      --r;
      if (std::get<0>(*r) != stream || std::get<1>(*r) < frag_limit_) break;
      parts.push_back(std::get<2>(*r));
      total += std::get<1>(*r);
    }
    if (total > size) {  // the last one overshoots: keep only what is needed
      const int32_t last = parts.back();
      split_p(last, pblocks_[last].size - (total - size));
      total = size;
    }
    if (total < size) {
      const int32_t p = new_p(size - total, stream);
      if (p < 0) return h;
      parts.push_back(p);
    }
    if (parts.size() == 1) {
      h.index = parts[0];
      activate_p(h.index);
      return h;
    }
    h.index = stitch(parts, stream);
    h.stitched = true;
    activate_s(h.index);
    return h;
  }

  // Take back a block best_fit() handed out.
  void free(PoolHandle h) {
    if (h.stitched) {
      sblocks_[h.index].active = false;
      for (int32_t p : sblocks_[h.index].parts) deactivate_p(p);
    } else {
      deactivate_p(h.index);
    }
  }

  // Drop every inactive stitched block, then give back every free primitive block in best-fit
  // order (the only time GMLake returns physical memory).
  void release_cached() {
    for (int32_t s = 0; s < static_cast<int32_t>(sblocks_.size()); ++s) {
      if (sblocks_[s].alive && !sblocks_[s].active) drop_s(s);
    }
    for (auto it = pfree_.begin(); it != pfree_.end();) {
      const int32_t p = std::get<2>(*it);
      it = pfree_.erase(it);
      release_p(p);
    }
  }

  // Drop every stitched block and give back every primitive block, blocks in use included.
  void release_all() {
    for (int32_t s = 0; s < static_cast<int32_t>(sblocks_.size()); ++s) {
      if (sblocks_[s].alive) drop_s(s);
    }
    pfree_.clear();
    savail_.clear();
    for (int32_t p = 0; p < static_cast<int32_t>(pblocks_.size()); ++p) {
      if (pblocks_[p].alive) release_p(p);
    }
  }

  // Slots, alive or recycled (check `alive`).
  const std::vector<PrimitiveBlock>& pblocks() const { return pblocks_; }
  const std::vector<StitchedBlock>& sblocks() const { return sblocks_; }

  // The pools' own invariants; "" or the first one broken. O(blocks).
  std::string check_invariants(int64_t granularity) const {
    size_t free_p = 0;
    for (int32_t p = 0; p < static_cast<int32_t>(pblocks_.size()); ++p) {
      const PrimitiveBlock& pb = pblocks_[p];
      if (!pb.alive) continue;
      if (pb.size <= 0 || pb.size % granularity) return "pBlock size off granularity";
      const bool listed = pfree_.count(PKey{pb.stream, pb.size, p}) != 0;
      if (listed == pb.active) return "pBlock free list disagrees with its state";
      if (!pb.active) ++free_p;
      for (int32_t s : pb.sblocks) {
        const auto& parts = sblocks_[s].parts;
        if (!sblocks_[s].alive || std::find(parts.begin(), parts.end(), p) == parts.end()) {
          return "pBlock names a stitched block that does not map it";
        }
      }
    }
    if (free_p != pfree_.size()) return "free pBlock list has stale entries";
    int64_t alive_s = 0;
    size_t avail = 0;
    for (int32_t s = 0; s < static_cast<int32_t>(sblocks_.size()); ++s) {
      const StitchedBlock& sb = sblocks_[s];
      if (!sb.alive) continue;
      ++alive_s;
      int64_t size = 0, busy = 0;
      for (int32_t p : sb.parts) {
        const PrimitiveBlock& pb = pblocks_[p];
        if (!pb.alive) return "stitched block maps a released pBlock";
        size += pb.size;
        if (pb.active) ++busy;
        if (sb.active && !pb.active) return "active stitched block has an inactive part";
      }
      if (size != sb.size) return "stitched block size differs from its parts";
      if (busy != sb.busy) return "stitched block busy count is wrong";
      const bool available = !sb.active && sb.busy == 0;
      auto it = savail_.find(std::make_pair(sb.stream, sb.size));
      const bool listed = it != savail_.end() && it->second.count(s) != 0;
      if (listed != available) return "stitched block availability list is wrong";
      if (available) ++avail;
    }
    size_t listed_total = 0;
    for (const auto& kv : savail_) listed_total += kv.second.size();
    if (listed_total != avail) return "stitched availability list has stale entries";
    if (alive_s != counters_.sblocks_alive) return "stitched block count is wrong";
    return "";
  }

 private:
  using PKey = std::tuple<int64_t, int64_t, int32_t>;  // stream, size, index

  void set_available(int32_t s, bool available) {
    StitchedBlock& sb = sblocks_[s];
    auto key = std::make_pair(sb.stream, sb.size);
    if (available) {
      savail_[key].insert(s);
    } else {
      auto it = savail_.find(key);
      if (it != savail_.end()) {
        it->second.erase(s);
        if (it->second.empty()) savail_.erase(it);
      }
    }
  }

  void activate_p(int32_t p) {
    PrimitiveBlock& pb = pblocks_[p];
    pb.active = true;
    pfree_.erase(PKey{pb.stream, pb.size, p});
    for (int32_t s : pb.sblocks) {
      if (sblocks_[s].busy++ == 0 && !sblocks_[s].active) set_available(s, false);
    }
  }

  void deactivate_p(int32_t p) {
    PrimitiveBlock& pb = pblocks_[p];
    pb.active = false;
    pfree_.insert(PKey{pb.stream, pb.size, p});
    for (int32_t s : pb.sblocks) {
      if (--sblocks_[s].busy == 0 && !sblocks_[s].active) set_available(s, true);
    }
  }

  void activate_s(int32_t s) {
    StitchedBlock& sb = sblocks_[s];
    sb.active = true;
    sb.last_use = ++clock_;
    set_available(s, false);
    for (int32_t p : sb.parts) activate_p(p);
  }

  // A new primitive block: one physical allocation of `size` bytes; -1 when there is none.
  int32_t new_p(int64_t size, int64_t stream) {
    const int64_t base = hooks_.create_piece(size);
    if (base == kNoMemory) return -1;
    const int32_t p = fresh_slot(pblocks_, spare_p_);
    PrimitiveBlock& pb = pblocks_[p];
    pb.base = base;
    pb.size = size;
    pb.stream = stream;
    pfree_.insert(PKey{stream, size, p});
    ++counters_.new_pblocks;
    return p;
  }

  // Split free pBlock p so that it keeps its first `size` bytes; returns the rest (free). Every
  // sBlock that maps p now maps both pieces (its mapping is unchanged: same physical bytes).
  int32_t split_p(int32_t p, int64_t size) {
    ++counters_.splits;
    const int32_t q = fresh_slot(pblocks_, spare_p_);
    PrimitiveBlock& pb = pblocks_[p];
    PrimitiveBlock& qb = pblocks_[q];
    pfree_.erase(PKey{pb.stream, pb.size, p});
    qb.base = pb.base;
    qb.offset = pb.offset + size;
    qb.size = pb.size - size;
    qb.stream = pb.stream;
    qb.sblocks = pb.sblocks;
    pb.size = size;
    pfree_.insert(PKey{pb.stream, pb.size, p});
    pfree_.insert(PKey{qb.stream, qb.size, q});
    for (int32_t s : qb.sblocks) {
      auto& parts = sblocks_[s].parts;
      parts.insert(std::find(parts.begin(), parts.end(), p) + 1, q);
    }
    return q;
  }

  // A stitched block over `parts` in order. Returns its index.
  int32_t stitch(const std::vector<int32_t>& parts, int64_t stream) {
    int64_t total = 0;
    for (int32_t p : parts) total += pblocks_[p].size;
    const uintptr_t va = hooks_.map_stitched(parts, total, pblocks_);
    const int32_t s = fresh_slot(sblocks_, spare_s_);
    StitchedBlock& sb = sblocks_[s];
    sb.size = total;
    sb.stream = stream;
    sb.va = va;
    sb.parts = parts;
    for (int32_t p : parts) {
      pblocks_[p].sblocks.push_back(s);
      if (pblocks_[p].active) ++sb.busy;
    }
    sb.last_use = ++clock_;
    if (sb.busy == 0) set_available(s, true);
    ++counters_.stitches;
    counters_.stitched_bytes += total;
    if (++counters_.sblocks_alive > max_sblocks_) drop_least_recently_used(s);
    return s;
  }

  void drop_s(int32_t s) {
    StitchedBlock& sb = sblocks_[s];
    if (sb.busy == 0 && !sb.active) set_available(s, false);
    for (int32_t p : sb.parts) {
      auto& v = pblocks_[p].sblocks;
      v.erase(std::find(v.begin(), v.end(), s));
    }
    hooks_.unmap_stitched(sb);
    sb.alive = false;
    sb.parts.clear();
    spare_s_.push_back(s);
    --counters_.sblocks_alive;
    ++counters_.sblocks_dropped;
  }

  // StitchFree: drop the least recently used inactive stitched block other than `keep`.
  void drop_least_recently_used(int32_t keep) {
    int32_t victim = -1;
    for (int32_t s = 0; s < static_cast<int32_t>(sblocks_.size()); ++s) {
      const StitchedBlock& sb = sblocks_[s];
      if (s == keep || !sb.alive || sb.active) continue;
      if (victim < 0 || sb.last_use < sblocks_[victim].last_use) victim = s;
    }
    if (victim >= 0) drop_s(victim);
  }

  // Give back free pBlock p's physical piece (no alive sBlock maps it: release_cached() drops
  // the inactive ones first, and an active one's parts are all active).
  void release_p(int32_t p) {
    PrimitiveBlock& pb = pblocks_[p];
    hooks_.release_piece(pb);
    pb.alive = false;
    pb.sblocks.clear();
    spare_p_.push_back(p);
  }

  Hooks& hooks_;
  StitchCounters& counters_;
  const int64_t frag_limit_;
  const int64_t max_sblocks_;
  std::vector<PrimitiveBlock> pblocks_;
  std::vector<StitchedBlock> sblocks_;
  std::vector<int32_t> spare_p_, spare_s_;
  std::set<PKey> pfree_;  // free primitive blocks in best-fit order
  // available (inactive, no part in use) stitched blocks by (stream, size)
  std::map<std::pair<int64_t, int64_t>, std::set<int32_t>> savail_;
  int64_t clock_ = 0;  // last_use stamps for StitchFree
};

}  // namespace memo_stitch
