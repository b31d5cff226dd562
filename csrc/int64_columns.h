// What the trace replays in csrc/ share: the event action codes (exported to Python as
// memo_ext._C.ALLOC ...; memo_ext/alloc maps PyTorch's snapshot action strings onto them) and
// the 1-D int64 column type with its shape check.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace memo_columns {

namespace py = pybind11;

// FREE is PyTorch's "free_completed" (the block really returns to the cache); OTHER covers
// everything that moves no bytes ("free_requested", "snapshot", ...); EMPTY_CACHE is
// torch.cuda.empty_cache(); FAILED_ALLOC a request the recorded run failed with out-of-memory.
enum Action : int64_t {
  kAlloc = 0,
  kFree = 1,
  kSegmentAlloc = 2,
  kSegmentFree = 3,
  kSegmentMap = 4,
  kSegmentUnmap = 5,
  kOther = 6,
  kEmptyCache = 7,
  kFailedAlloc = 8,
};

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Raise ValueError unless `a` is 1-D with `n` entries (any length when n < 0).
inline void require_1d(const Int64Array& a, const char* name, py::ssize_t n = -1) {
  if (a.ndim() != 1) {
    throw py::value_error(std::string(name) + " must be a 1-D array, got " +
                          std::to_string(a.ndim()) + " dimensions");
  }
  if (n >= 0 && a.shape(0) != n) {
    throw py::value_error(std::string(name) + " has " + std::to_string(a.shape(0)) +
                          " entries, expected " + std::to_string(n) + " (one per event)");
  }
}

}  // namespace memo_columns
