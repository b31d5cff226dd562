// Python bindings of the real GMLake stitching allocator on Linux host memory
// (stitching_allocator.h over stitching_host_backend.h): the allocator itself, the trace replay
// with data checks (stitching_check.h) and the randomized fuzzer. Registered into memo_ext._C by
// trace_replay.cpp; wrapped by memo_ext/alloc/stitching.py (docs/stitching.md).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "int64_columns.h"
#include "stitching_allocator.h"
#include "stitching_check.h"
#include "stitching_counters_py.h"
#include "stitching_host_backend.h"

namespace py = pybind11;

namespace {

using memo_columns::Int64Array;
using memo_columns::require_1d;
using memo_stitch::HostBackend;
using memo_stitch::Options;
using memo_stitch::Stats;
using memo_stitch::StitchingAllocator;

py::dict stats_dict(const Stats& s) {
  py::dict d;
  d["reserved_bytes"] = s.reserved_bytes;
  d["peak_reserved_bytes"] = s.peak_reserved_bytes;
  d["active_bytes"] = s.active_bytes;
  d["peak_active_bytes"] = s.peak_active_bytes;
  d["requested_bytes"] = s.requested_bytes;
  d["live_blocks"] = s.live_blocks;
  d["mapped_bytes"] = s.mapped_bytes;
  d["peak_mapped_bytes"] = s.peak_mapped_bytes;
  d["sblocks_alive"] = s.sblocks_alive;
  d["segments_alive"] = s.segments_alive;
  d["normal_path_segments"] = s.normal_path_segments;
  d["allocs"] = s.allocs;
  d["frees"] = s.frees;
  d["normal_allocs"] = s.normal_allocs;
  memo_stitch::put_stitch_counters(d, s);  // the names the allocator model reports too
  d["reorganisations"] = s.reorganisations;
  d["ooms"] = s.ooms;
  d["physical_creates"] = s.physical_creates;
  d["physical_releases"] = s.physical_releases;
  d["map_calls"] = s.map_calls;
  d["reserve_calls"] = s.reserve_calls;
  d["map_seconds"] = s.map_seconds;
  d["reserve_seconds"] = s.reserve_seconds;
  d["create_seconds"] = s.create_seconds;
  return d;
}

int64_t cfg_int(const py::dict& cfg, const char* key, int64_t fallback) {
  if (!cfg.contains(key) || cfg[key].is_none()) return fallback;
  return cfg[key].cast<int64_t>();
}

Options options_from(int64_t capacity, int64_t frag_limit, int64_t max_sblocks, bool log) {
  if (capacity < 0) throw py::value_error("capacity must be >= 0 bytes (0: unlimited)");
  if (frag_limit < 0) throw py::value_error("frag_limit must be >= 0 bytes");
  if (max_sblocks < 0) throw py::value_error("max_sblocks must be >= 0");
  Options o;
  o.capacity = capacity;
  o.frag_limit = frag_limit;
  o.max_sblocks = max_sblocks;
  o.log = log;
  return o;
}

// The allocator with its own host backend, for Python.
class HostAllocator {
 public:
  HostAllocator(int64_t capacity, int64_t frag_limit, int64_t max_sblocks)
      : backend_(std::make_unique<HostBackend>()),
        alloc_(std::make_unique<StitchingAllocator>(
            *backend_, options_from(capacity, frag_limit, max_sblocks, false))) {}

  uintptr_t malloc(int64_t nbytes, int64_t stream) { return a().malloc(nbytes, stream); }
  int64_t free(uintptr_t ptr) { return a().free(ptr); }
  void empty_cache() { a().release_cached(); }
  py::list views(uintptr_t ptr) {
    py::list out;
    for (const auto& v : a().views(ptr)) {
      out.append(py::make_tuple(v.block_offset, v.va, v.bytes, v.handle, v.phys_offset));
    }
    return out;
  }
  std::string kind(uintptr_t ptr) { return a().kind(ptr); }
  int64_t block_bytes(uintptr_t ptr) { return a().block_bytes(ptr); }
  std::string check_invariants() { return a().check_invariants(); }
  py::dict stats() {
    py::dict d = stats_dict(a().stats());
    add_backend(d);
    return d;
  }
  // Release everything (blocks in use included); returns the backend's counts afterwards.
  py::dict close() {
    if (alloc_) {
      alloc_->teardown();
      alloc_.reset();
    }
    py::dict d;
    add_backend(d);
    return d;
  }
  bool closed() const { return !alloc_; }

 private:
  StitchingAllocator& a() {
    if (!alloc_) throw py::value_error("the allocator is closed");
    return *alloc_;
  }
  void add_backend(py::dict& d) const {
    d["backend_physical_bytes"] = backend_->physical_bytes();
    d["backend_peak_physical_bytes"] = backend_->peak_physical_bytes();
    d["backend_handles"] = backend_->live_handles();
    d["backend_ranges"] = backend_->live_ranges();
    d["backend_range_bytes"] = backend_->reserved_range_bytes();
    d["backend_mapped_bytes"] = backend_->mapped_bytes();
    d["backend_creates"] = backend_->creates();
    d["backend_releases"] = backend_->releases();
    d["backend_maps"] = backend_->maps();
    d["backend_unmaps"] = backend_->unmaps();
  }

  std::unique_ptr<HostBackend> backend_;
  std::unique_ptr<StitchingAllocator> alloc_;
};

py::array_t<int64_t> to_array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

py::dict replay_stitching_host(const Int64Array& actions, const Int64Array& ids,
                               const Int64Array& sizes, const Int64Array& streams,
                               const py::dict& cfg, bool check, bool timelines) {
  require_1d(actions, "actions", -1);
  const py::ssize_t n = actions.shape(0);
  require_1d(ids, "ids", n);
  require_1d(sizes, "sizes", n);
  require_1d(streams, "streams", n);
  const Options opt = options_from(cfg_int(cfg, "capacity", 0),
                                   cfg_int(cfg, "frag_limit", memo_stitch::kDefaultFragLimit),
                                   cfg_int(cfg, "max_sblocks", memo_stitch::kDefaultMaxSBlocks),
                                   cfg_int(cfg, "log", 0) != 0);
  memo_stitch::ReplayOutput r;
  {
    py::gil_scoped_release no_gil;
    r = memo_stitch::replay_trace(opt, n, actions.data(), ids.data(), sizes.data(),
                                  streams.data(), check, timelines);
  }
  py::dict d;
  d["stats"] = stats_dict(r.stats);
  d["num_events"] = static_cast<int64_t>(n);
  d["peak_allocated"] = r.peak_allocated;
  d["peak_allocated_index"] = r.peak_allocated_index;
  d["final_allocated"] = r.final_allocated;
  d["num_ooms"] = r.ooms;
  d["first_oom_index"] = r.first_oom_index;
  d["unmatched_frees"] = r.unmatched_frees;
  d["duplicate_allocs"] = r.duplicate_allocs;
  d["failed_allocs_reproduced"] = r.failed_reproduced;
  d["failed_allocs_succeeded"] = r.failed_succeeded;
  d["checked_blocks"] = r.checked_blocks;
  d["checked_bytes"] = r.checked_bytes;
  d["stitched_checked"] = r.stitched_checked;
  d["data_errors"] = r.data_errors;
  d["first_error"] = r.first_error;
  d["invariant_error"] = r.invariant_error;
  d["peak_resident_bytes"] = r.peak_resident_bytes;
  d["seconds"] = r.seconds;
  d["leaked_physical_bytes"] = r.leaked_physical_bytes;
  d["leaked_handles"] = r.leaked_handles;
  d["leaked_ranges"] = r.leaked_ranges;
  d["leaked_mapped_bytes"] = r.leaked_mapped_bytes;
  d["backend_peak_physical_bytes"] = r.backend_peak_physical_bytes;
  std::vector<int64_t> ev, kind, bytes;
  for (const auto& e : r.log) {
    ev.push_back(e.event);
    kind.push_back(e.kind);
    bytes.push_back(e.bytes);
  }
  d["decision_event"] = to_array(ev);
  d["decision_kind"] = to_array(kind);
  d["decision_size"] = to_array(bytes);
  d["allocated"] = to_array(r.allocated_tl);
  d["reserved"] = to_array(r.reserved_tl);
  return d;
}

py::dict fuzz_stitching(uint64_t seed, int64_t ops, int64_t capacity, int64_t frag_limit,
                        int64_t max_sblocks, int64_t streams, int64_t max_live) {
  if (ops < 0 || streams < 1 || max_live < 1) {
    throw py::value_error("ops must be >= 0, streams and max_live >= 1");
  }
  options_from(capacity, frag_limit, max_sblocks, false);  // validates
  memo_stitch::FuzzConfig c;
  c.seed = seed;
  c.ops = ops;
  c.capacity = capacity;
  c.frag_limit = frag_limit;
  c.max_sblocks = max_sblocks;
  c.streams = streams;
  c.max_live = max_live;
  memo_stitch::FuzzResult r;
  {
    py::gil_scoped_release no_gil;
    r = memo_stitch::fuzz(c);
  }
  py::dict d;
  d["ops"] = r.ops;
  d["allocs"] = r.allocs;
  d["frees"] = r.frees;
  d["ooms"] = r.ooms;
  d["empty_caches"] = r.empty_caches;
  d["rereads"] = r.rereads;
  d["va_overlaps"] = r.va_overlaps;
  d["phys_overlaps"] = r.phys_overlaps;
  d["data_errors"] = r.data_errors;
  d["invariant_errors"] = r.invariant_errors;
  d["accounting_errors"] = r.accounting_errors;
  d["shape_errors"] = r.shape_errors;
  d["normal_allocs"] = r.by_kind[0];
  d["primitive_allocs"] = r.by_kind[1];
  d["stitched_allocs"] = r.by_kind[2];
  d["peak_live"] = r.peak_live;
  d["first_error"] = r.first_error;
  d["stats"] = stats_dict(r.stats);
  d["residual_reserved"] = r.residual_reserved;
  d["residual_handles"] = r.residual_handles;
  d["residual_ranges"] = r.residual_ranges;
  d["residual_mapped"] = r.residual_mapped;
  d["teardown_handles"] = r.teardown_handles;
  d["teardown_ranges"] = r.teardown_ranges;
  d["teardown_physical"] = r.teardown_physical;
  d["seconds"] = r.seconds;
  return d;
}

}  // namespace

void register_stitching_allocator(py::module_& m) {
  py::dict constants;
  constants["kGranularity"] = memo_stitch::kGranularity;
  constants["kNormalPathLimit"] = memo_stitch::kNormalPathLimit;
  constants["kDefaultFragLimit"] = memo_stitch::kDefaultFragLimit;
  constants["kDefaultMaxSBlocks"] = memo_stitch::kDefaultMaxSBlocks;
  constants["kCheckWindow"] = memo_stitch::kCheckWindow;
  constants["kCheckStride"] = memo_stitch::kCheckStride;
  constants["kWholeCheckLimit"] = memo_stitch::kWholeCheckLimit;
  m.attr("STITCHING_CONSTANTS") = constants;
  py::class_<HostAllocator>(m, "HostStitchingAllocator", R"doc(GMLake stitching allocator on
Linux host memory (memfd_create + mmap), csrc/stitching_allocator.h; see docs/stitching.md.

HostStitchingAllocator(capacity, frag_limit, max_sblocks): capacity in bytes (0: unlimited),
frag_limit in bytes, max_sblocks a count. malloc(nbytes, stream) returns the address of a
readable, writable block (0: out of memory); free(address) returns the requested bytes (-1: no
block starts there); empty_cache(); views(address): (block offset, address, bytes, handle,
physical offset) per piece; kind(address): "normal", "primitive", "stitched" or ""; stats();
check_invariants() ("" when all hold); close() releases everything.)doc")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("capacity") = 0,
           py::arg("frag_limit") = memo_stitch::kDefaultFragLimit,
           py::arg("max_sblocks") = memo_stitch::kDefaultMaxSBlocks)
      .def("malloc", &HostAllocator::malloc, py::arg("nbytes"), py::arg("stream") = 0)
      .def("free", &HostAllocator::free, py::arg("address"))
      .def("empty_cache", &HostAllocator::empty_cache)
      .def("views", &HostAllocator::views, py::arg("address"))
      .def("kind", &HostAllocator::kind, py::arg("address"))
      .def("block_bytes", &HostAllocator::block_bytes, py::arg("address"))
      .def("check_invariants", &HostAllocator::check_invariants)
      .def("stats", &HostAllocator::stats)
      .def("close", &HostAllocator::close)
      .def_property_readonly("closed", &HostAllocator::closed);
  m.def("replay_stitching_host", &replay_stitching_host, py::arg("actions"), py::arg("ids"),
        py::arg("sizes"), py::arg("streams"), py::arg("config") = py::dict(),
        py::arg("check") = true, py::arg("timelines") = true,
        R"doc(Replay a trace through the real stitching allocator on host memory.

Columns as for replay_allocator. config: capacity (bytes, 0 unlimited), frag_limit (bytes),
max_sblocks, log (1: return the decision log). check: fill every block with a pattern of its
request and verify it at its free (stitching_check.h). Returns stats, peaks, OOM and trace
counts, integrity counts (checked_blocks, data_errors, first_error), invariant_error, what the
backend still held after teardown (leaked_*), the decision log and the timelines.)doc");
  m.def("fuzz_stitching", &fuzz_stitching, py::arg("seed"), py::arg("ops") = 100000,
        py::arg("capacity") = 0, py::arg("frag_limit") = 4 * memo_stitch::kMiB,
        py::arg("max_sblocks") = 64, py::arg("streams") = 2, py::arg("max_live") = 48,
        "Randomized malloc/free/empty_cache against an oracle (stitching_check.h); returns "
        "the error and residue counts (all 0 when nothing is wrong).");
}
