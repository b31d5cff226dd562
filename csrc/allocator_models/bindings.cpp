// Allocator models, the Python entry point memo_ext._C.replay_allocator: replay an allocation
// trace against a modelled GPU allocator at a given capacity and report what the allocator would
// have reserved, when it had to reorganise and whether it ran out of memory. This file parses the
// config, builds the policy's model and returns the result dict; the models are the headers
// beside it, one per policy (rules in docs/allocator_models.md):
//   caching.h     PyTorch's CUDACachingAllocator (rules: csrc/caching_rules.h)
//   expandable.h  expandable segments
//   stitching.h   GMLake virtual memory stitching (rules: csrc/stitching_rules.h)
//   arena.h       a planned arena (placement rule: csrc/arena_ranges.h)
// and replay.h is the event loop, device.h what they share.
//
// Why C++: a long-context run emits millions of allocator events, and the planner and the report
// replay each trace under several policies and capacities. The models do an ordered-set lookup
// and a hash lookup per event, a few hundred nanoseconds here versus tens of microseconds in
// Python. bench/allocator_replay.py measures the rate (bench/results/allocator_replay.md).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "arena.h"
#include "caching.h"
#include "device.h"
#include "expandable.h"
#include "replay.h"
#include "stitching.h"

namespace py = pybind11;

namespace memo_models {
namespace {

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

}  // namespace
}  // namespace memo_models

// Defined in online_best_fit.cpp.
py::dict plan_best_fit(const memo_columns::Int64Array& actions,
                       const memo_columns::Int64Array& ids, const memo_columns::Int64Array& sizes);

// Called from the PYBIND11_MODULE in trace_replay.cpp: all of csrc/ builds one module, memo_ext._C.
void register_allocator_models(py::module_& m) {
  using namespace memo_models;
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
