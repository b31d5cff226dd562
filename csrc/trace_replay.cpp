// Fast replay of a CUDA caching-allocator trace: live (allocated) and reserved bytes per event.
//
// Why C++: the memory snapshots of long-context runs hold millions of allocator events
// (every activation, recompute and offload buffer of every layer and micro-batch), and the
// planner and the allocator models replay them again and again. Each event costs a hash lookup
// and a few integer updates, which a Python loop turns into ~1 us of interpreter work.
// bench/replay_speed.py measures the speed-up over a tight pure-Python loop doing the same work
// over the same int64 arrays (dict of live blocks, list timelines) on a 1M-event synthetic trace
// (allocs and frees over 20k addresses, 2% segment events); bench/results/replay_speed.md has
// its last run.
//
// Input: three equally long 1-D int64 arrays (action code, address, size in bytes) and the
// allocated/reserved bytes live before the first event (a trace starts mid-run). The action
// codes are exported as module attributes (ALLOC, FREE, ...). A FREE subtracts the size of the
// block allocated at that address during the trace; a block that predates the trace is not in
// the table, so the event's own size is used and the free is counted as unmatched. Segment
// events move reserved bytes by the event's size. O(n) time, O(live blocks) memory.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <unordered_map>

#include "int64_columns.h"

namespace py = pybind11;

namespace {

using memo_columns::Int64Array;
using memo_columns::require_1d;
using namespace memo_columns;  // action codes

struct Counts {
  int64_t allocs = 0;
  int64_t frees = 0;
  int64_t unmatched_frees = 0;
  int64_t segment_allocs = 0;
  int64_t segment_frees = 0;
  int64_t segment_maps = 0;
  int64_t segment_unmaps = 0;
};

py::dict replay_live_bytes(const Int64Array& actions, const Int64Array& addrs,
                           const Int64Array& sizes, int64_t initial_live_bytes,
                           int64_t initial_reserved_bytes) {
  require_1d(actions, "actions");
  require_1d(addrs, "addrs");
  require_1d(sizes, "sizes");
  const py::ssize_t n = actions.shape(0);
  if (addrs.shape(0) != n || sizes.shape(0) != n) {
    throw py::value_error("actions, addrs and sizes must have the same length, got " +
                          std::to_string(n) + ", " + std::to_string(addrs.shape(0)) + ", " +
                          std::to_string(sizes.shape(0)));
  }
  if (initial_live_bytes < 0 || initial_reserved_bytes < 0) {
    throw py::value_error("initial_live_bytes and initial_reserved_bytes must be >= 0");
  }

  Int64Array allocated_out(n);
  Int64Array reserved_out(n);
  const int64_t* act = actions.data();
  const int64_t* addr = addrs.data();
  const int64_t* size = sizes.data();
  int64_t* allocated_tl = allocated_out.mutable_data();
  int64_t* reserved_tl = reserved_out.mutable_data();

  Counts c;
  int64_t allocated = initial_live_bytes;
  int64_t reserved = initial_reserved_bytes;
  int64_t peak_allocated = allocated;
  int64_t peak_reserved = reserved;
  int64_t peak_allocated_index = -1;  // -1: no event rose above the initial state
  {
    py::gil_scoped_release no_gil;
    std::unordered_map<int64_t, int64_t> live;  // block address -> block size (bytes)
    for (py::ssize_t i = 0; i < n; ++i) {
      const int64_t s = size[i];
      if (s < 0) {
        throw py::value_error("sizes[" + std::to_string(i) + "] is negative");
      }
      switch (act[i]) {
        case kAlloc:
          ++c.allocs;
          live[addr[i]] = s;
          allocated += s;
          break;
        case kFree: {
          ++c.frees;
          auto it = live.find(addr[i]);
          if (it == live.end()) {
            ++c.unmatched_frees;
            allocated -= s;
          } else {
            allocated -= it->second;
            live.erase(it);
          }
          break;
        }
        case kSegmentAlloc:
          ++c.segment_allocs;
          reserved += s;
          break;
        case kSegmentFree:
          ++c.segment_frees;
          reserved -= s;
          break;
        case kSegmentMap:
          ++c.segment_maps;
          reserved += s;
          break;
        case kSegmentUnmap:
          ++c.segment_unmaps;
          reserved -= s;
          break;
        case kOther:
          break;
        default:
          throw py::value_error("actions[" + std::to_string(i) + "] = " +
                                std::to_string(act[i]) + " is not an action code (0..6)");
      }
      allocated_tl[i] = allocated;
      reserved_tl[i] = reserved;
      if (allocated > peak_allocated) {
        peak_allocated = allocated;
        peak_allocated_index = i;
      }
      if (reserved > peak_reserved) peak_reserved = reserved;
    }
  }

  py::dict out;
  out["allocated"] = allocated_out;
  out["reserved"] = reserved_out;
  out["final_allocated"] = allocated;
  out["final_reserved"] = reserved;
  out["peak_allocated"] = peak_allocated;
  out["peak_reserved"] = peak_reserved;
  out["peak_allocated_index"] = peak_allocated_index;
  out["num_allocs"] = c.allocs;
  out["num_frees"] = c.frees;
  out["num_unmatched_frees"] = c.unmatched_frees;
  out["num_segment_allocs"] = c.segment_allocs;
  out["num_segment_frees"] = c.segment_frees;
  out["num_segment_maps"] = c.segment_maps;
  out["num_segment_unmaps"] = c.segment_unmaps;
  return out;
}

}  // namespace

// Defined in allocator_models/bindings.cpp, planned_arena.cpp, stitching_host.cpp and
// greedy_offsets.cpp (every csrc/*.cpp and csrc/allocator_models/*.cpp builds into this one
// module).
void register_allocator_models(py::module_& m);
void register_planned_arena(py::module_& m);
void register_stitching_allocator(py::module_& m);
void register_greedy_offsets(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "Megatron-MEMO C++ kernels (trace replay).";
  register_allocator_models(m);
  register_planned_arena(m);
  register_stitching_allocator(m);
  register_greedy_offsets(m);
  m.attr("ALLOC") = static_cast<int64_t>(kAlloc);
  m.attr("FREE") = static_cast<int64_t>(kFree);
  m.attr("SEGMENT_ALLOC") = static_cast<int64_t>(kSegmentAlloc);
  m.attr("SEGMENT_FREE") = static_cast<int64_t>(kSegmentFree);
  m.attr("SEGMENT_MAP") = static_cast<int64_t>(kSegmentMap);
  m.attr("SEGMENT_UNMAP") = static_cast<int64_t>(kSegmentUnmap);
  m.attr("OTHER") = static_cast<int64_t>(kOther);
  m.def("replay_live_bytes", &replay_live_bytes, py::arg("actions"), py::arg("addrs"),
        py::arg("sizes"), py::arg("initial_live_bytes") = 0,
        py::arg("initial_reserved_bytes") = 0,
        R"doc(Replay an allocator trace and return its byte timelines.

actions, addrs, sizes: equally long 1-D int64 arrays; sizes in bytes. initial_live_bytes and
initial_reserved_bytes: allocated and reserved bytes before the first event.

Returns a dict: "allocated" and "reserved" (int64 arrays, bytes after each event),
"final_allocated", "final_reserved", "peak_allocated", "peak_reserved" (bytes, the initial state
included), "peak_allocated_index" (first event reaching the allocated peak, -1 when no event
rises above the initial state), and the counts "num_allocs", "num_frees",
"num_unmatched_frees" (frees of blocks allocated before the trace), "num_segment_allocs",
"num_segment_frees", "num_segment_maps", "num_segment_unmaps". Raises ValueError on mismatched
lengths, non-1-D arrays, negative sizes or unknown action codes.)doc");
}
