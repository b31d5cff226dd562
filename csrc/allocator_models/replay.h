// Allocator models, the replay loop: drive one policy's model (caching.h, expandable.h,
// stitching.h, arena.h: anything with malloc(id, requested, stream), free(id) and
// release_cached()) through a trace and keep the byte totals, peaks and out-of-memory record.
//
// Input events are four equally long int64 arrays: action, id, size, stream. ALLOC asks for
// `size` requested bytes on `stream` and names the block `id` (an address in a snapshot); FREE
// returns block `id`. SEGMENT_* and OTHER events are ignored (they are the recorded allocator's
// own decisions); EMPTY_CACHE releases every cached unused segment (torch.cuda.empty_cache());
// FAILED_ALLOC is a request the recorded run failed with an out-of-memory error: the model tries
// it too and, if it succeeds, hands the block straight back (the program never got it).
// C++ because it is the per-event loop whose rate bindings.cpp's header explains.
#pragma once

#include "device.h"

namespace memo_models {

struct Totals {
  int64_t allocated = 0;  // sum of 512-rounded requested bytes of live requests
  int64_t requested = 0;  // sum of requested bytes of live requests
  int64_t peak_allocated = 0;
  int64_t peak_allocated_index = -1;
  int64_t peak_requested = 0;
  int64_t ooms = 0;
  int64_t first_oom_index = -1;
  int64_t first_oom_request = 0;
  int64_t first_oom_stream = 0;
  int64_t unmatched_frees = 0;
  int64_t duplicate_allocs = 0;
  int64_t failed_reproduced = 0;
  int64_t failed_succeeded = 0;
};

template <class Model>
void replay(Model& model, Device& dev, Totals& t, py::ssize_t n, const int64_t* act,
            const int64_t* id, const int64_t* size, const int64_t* stream, int64_t* alloc_tl,
            int64_t* reserved_tl) {
  std::unordered_set<int64_t> refused;  // ids of requests that ran out of memory
  auto record_oom = [&](py::ssize_t i) {
    if (t.ooms++ == 0) {
      t.first_oom_index = i;
      t.first_oom_request = size[i];
      t.first_oom_stream = stream[i];
    }
  };
  for (py::ssize_t i = 0; i < n; ++i) {
    dev.event = i;
    const int64_t s = size[i];
    if (s < 0) throw std::invalid_argument("sizes[" + std::to_string(i) + "] is negative");
    switch (act[i]) {
      case kAlloc: {
        if (int64_t old = model.free(id[i]); old >= 0) {  // allocated twice without a free
          ++t.duplicate_allocs;
          t.allocated -= round_request(old);
          t.requested -= old;
        }
        if (model.malloc(id[i], s, stream[i])) {
          t.allocated += round_request(s);
          t.requested += s;
          if (t.allocated > t.peak_allocated) {
            t.peak_allocated = t.allocated;
            t.peak_allocated_index = i;
          }
          t.peak_requested = std::max(t.peak_requested, t.requested);
        } else {
          record_oom(i);
          refused.insert(id[i]);
        }
        break;
      }
      case kFree: {
        const int64_t old = model.free(id[i]);
        if (old >= 0) {
          t.allocated -= round_request(old);
          t.requested -= old;
        } else if (refused.empty() || refused.erase(id[i]) == 0) {
          ++t.unmatched_frees;
        }
        break;
      }
      case kFailedAlloc: {
        const int64_t probe = std::numeric_limits<int64_t>::min() + i;
        if (model.malloc(probe, s, stream[i])) {
          ++t.failed_succeeded;
          model.free(probe);
        } else {
          ++t.failed_reproduced;
          record_oom(i);
        }
        break;
      }
      case kEmptyCache:
        model.release_cached();
        break;
      case kSegmentAlloc:
      case kSegmentFree:
      case kSegmentMap:
      case kSegmentUnmap:
      case kOther:
        break;
      default:
        throw std::invalid_argument("actions[" + std::to_string(i) + "] = " +
                                    std::to_string(act[i]) + " is not an action code (0..8)");
    }
    if (alloc_tl) {
      alloc_tl[i] = t.allocated;
      reserved_tl[i] = dev.reserved;
    }
  }
}

}  // namespace memo_models
