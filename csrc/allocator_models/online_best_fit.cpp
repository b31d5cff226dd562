// Online best fit for the "arena" allocator model when no plan file is given
// (memo_ext._C.plan_best_fit, memo_ext.alloc.best_fit_plan): offsets for every ALLOC of a trace
// in one contiguous arena, in event order, knowing nothing of the future -- best fit among the
// gaps left by freed requests (coalesced), else the top of the arena.
//
// Not the planner's greedy: memo_ext/planner/dsa.py's greedy_offsets is offline (it knows every
// lifetime, sorts requests largest first and places each at the lowest offset free over its whole
// lifetime) and seeds the MIP; this one sees requests one at a time as a real allocator would, so
// its peak is an upper bound on a real plan's. Different inputs, different rules, different
// results: neither can stand in for the other without changing plans or reports.
// Why C++: it runs once per event of traces of millions of events, next to the models.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "../caching_rules.h"
#include "../int64_columns.h"

namespace py = pybind11;

using memo_caching::round_request;
using memo_columns::Int64Array;
using memo_columns::kAlloc;
using memo_columns::kFree;
using memo_columns::require_1d;

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
