// The stitching pools' counters (stitching_rules.h's StitchCounters) as Python dict entries, under
// the one set of names that both the "stitching" allocator model (allocator_models/stitching.h)
// and the real allocator's bindings (stitching_host.cpp, whose Stats extends StitchCounters)
// report (tests/unit/memo_ext/alloc/test_stitching_allocator.py compares the two by key). C++: both callers are.
#pragma once

#include <pybind11/pybind11.h>

#include "stitching_rules.h"

namespace memo_stitch {

inline void put_stitch_counters(pybind11::dict& d, const StitchCounters& c) {
  d["exact_hits"] = c.exact_hits;
  d["splits"] = c.splits;
  d["stitches"] = c.stitches;
  d["stitched_bytes"] = c.stitched_bytes;
  d["new_pblocks"] = c.new_pblocks;
  d["sblocks_dropped"] = c.sblocks_dropped;
}

}  // namespace memo_stitch
