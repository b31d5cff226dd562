// The arena planner's greedy placement (memo_ext/planner/dsa.py, greedy_offsets): offline best
// fit -- blocks taken largest first (then longest-lived, then earliest, then in input order),
// each placed at the lowest offset where it overlaps no placed block alive at the same time.
// Its plan seeds the MIP, and for the traces of a long-sequence search (tens of thousands of
// blocks, one plan per replayed length) it is the plan.
//
// Not memo_ext._C.plan_best_fit (online_best_fit.cpp): that one is online, in event order,
// without lifetimes, as a plan-less allocator places requests.
// Why C++: each block scans every placed block; in Python (numpy per block) that was most of an
// estimate's replay (3.5 s of the 7B 4.46M-token answer's 10 s under a profiler).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "int64_columns.h"

namespace py = pybind11;

using memo_columns::Int64Array;
using memo_columns::require_1d;

Int64Array greedy_offsets(const Int64Array& sizes, const Int64Array& starts,
                          const Int64Array& ends) {
  require_1d(sizes, "sizes", -1);
  const py::ssize_t n = sizes.shape(0);
  require_1d(starts, "starts", n);
  require_1d(ends, "ends", n);
  const int64_t* size = sizes.data();
  const int64_t* start = starts.data();
  const int64_t* end = ends.data();
  Int64Array offsets(n);
  int64_t* out = offsets.mutable_data();
  {
    py::gil_scoped_release no_gil;
    std::vector<py::ssize_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](py::ssize_t a, py::ssize_t b) {
      if (size[a] != size[b]) return size[a] > size[b];
      if (end[a] - start[a] != end[b] - start[b]) return end[a] - start[a] > end[b] - start[b];
      return start[a] < start[b];
    });
    // Placed blocks: lifetime and byte range, in placement order.
    std::vector<int64_t> placed_start, placed_end, placed_low, placed_high;
    placed_start.reserve(n);
    placed_end.reserve(n);
    placed_low.reserve(n);
    placed_high.reserve(n);
    std::vector<std::pair<int64_t, int64_t>> busy;  // (low, high) of those alive with the block
    for (py::ssize_t i : order) {
      busy.clear();
      for (size_t k = 0; k < placed_low.size(); ++k) {
        if (placed_start[k] < end[i] && placed_end[k] > start[i]) {
          busy.emplace_back(placed_low[k], placed_high[k]);
        }
      }
      std::sort(busy.begin(), busy.end());
      // Scanning the busy ranges by their low end, the candidate is past every range seen;
      // the first range starting at or above candidate + size leaves room below it.
      int64_t offset = 0;
      for (const auto& [low, high] : busy) {
        if (offset + size[i] <= low) break;
        offset = std::max(offset, high);
      }
      out[i] = offset;
      placed_start.push_back(start[i]);
      placed_end.push_back(end[i]);
      placed_low.push_back(offset);
      placed_high.push_back(offset + size[i]);
    }
  }
  return offsets;
}

// Called from the PYBIND11_MODULE in trace_replay.cpp: all of csrc/ builds one module, memo_ext._C.
void register_greedy_offsets(py::module_& m) {
  m.def("greedy_offsets", &greedy_offsets, py::arg("sizes"), py::arg("starts"), py::arg("ends"),
        R"doc(Offsets of blocks (sizes, lifetimes [start, end)) by offline best fit, largest first:
memo_ext.planner.dsa.greedy_offsets. Equally long 1-D int64 arrays in, an int64 array out.)doc");
}
