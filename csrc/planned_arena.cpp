// MEMO's runtime arena: serve request k of a layer phase at its planned offset.
//
// The plan (memo_ext/planner/plan.py) gives every kind of layer phase (a transformer layer's
// forward, or its backward with the recomputation before it) a table: for each allocation
// request the layer makes in that phase, in order, the bytes planned for it and its offset in
// the arena, or -1 where the request outlives the phase (a skeletal activation) and belongs to the
// normal allocator. At runtime the caller says which phase kind begins; each request is then
// checked against the table entry of its position and either gets its offset or is refused
// (-1: the caller uses the normal allocator). Refusals are counted by reason, and never corrupt:
//   - no phase open, or more requests than the table has, or an entry planned for -1;
//   - a request larger than planned (a different sequence length or model than planned);
//   - a planned range that overlaps a block still in use (the sequence drifted from the plan
//     so that two live requests would share bytes): the live blocks are kept in an ordered map
//     and every placement is checked against it (csrc/arena_ranges.h, the rule the "arena"
//     allocator model, csrc/allocator_models/arena.h, applies too).
// Why two arenas: this one serves a running program phase by phase (tables per layer-phase kind,
// the resync window, refusals the caller handles); the model replays a recorded trace with one
// planned offset per event and a modelled caching allocator behind it. They share the placement
// rule above and agree on which requests a plan places where
// (tests/unit/memo_ext/alloc/test_arena_agreement.py).
// A request is served at its position only when its size (rounded as planned) is the size
// planned there. Otherwise it looks at the next kResyncWindow entries for one of exactly its
// size and continues from there; with none it is refused *without* using up the position. On a
// GPU kernels allocate what the tracer (a dispatch mode, which sees op outputs only) never
// recorded: workspaces larger than the entry at their position, and small tensors the kernel
// returns and the op drops (flash attention's 16-byte RNG state, torch's 8-byte placeholder).
// A small one used to be served at the position of the larger planned request it arrived
// before ("it fits"), which shifted every later request of the phase one entry off its plan:
// on one H100 that left 96 size mismatches, 96 overlaps and 368 requests beyond the plan per
// iteration (bench/results/gpu_check_h100.md). Exact sizes cannot drift so.
// A request of one alignment unit (512 bytes or less) is served only at its own position, only
// when it asks for the very bytes the traced request asked for (the table keeps them), and
// never resyncs: layer tables hold small planned tensors too (reductions' results, scalars), and
// a 16-byte RNG state arriving just before a 4-byte sum would take the sum's entry, or, by a
// resync onto one further ahead, skip every planned entry before it; refused, it costs nothing.
// Zero-byte requests never reach the arena (nbytes <= 0: -1 and nothing counted): PyTorch's
// caching allocator is not called for them, so the recorder has none and no table plans one;
// the CUDA hooks below answer them with nullptr before asking the arena.
//
// Why C++: the CUDA path calls this from the allocator hooks of
// torch.cuda.memory.CUDAPluggableAllocator (memo_arena_malloc / memo_arena_free below), once per
// tensor allocation of every layer, where a Python callback would stall the launch queue; on CPU
// the same object is driven from Python (memo_ext/planner/arena.py) so tests exercise the code a
// GPU run uses.
//
// The CUDA hooks need no CUDA headers (c10's, for the out-of-memory error they throw:
// csrc/torch_errors.h): they call the CUDA runtime's stream-ordered allocator
// (cudaMallocAsync / cudaFreeAsync, with the device's default pool told to keep what is freed,
// so it caches like PyTorch's allocator) in the runtime library PyTorch loaded
// (csrc/cuda_runtime_subset.h). Only requests on the stream the arena was opened for go to the
// arena: its offsets are reused in that stream's order. They count what they hand out (PyTorch's
// memory statistics raise under a pluggable allocator) and order frees after the streams a block
// was recorded on. The hooks have run on one H100 (bench/results/gpu_check_h100.md);
// tests/unit/memo_ext/planner/test_planned_arena_hooks.py drives them on CPU against a fake CUDA runtime
// (csrc/standalone/fake_cuda_runtime.c). They are exported with default visibility (pybind11
// builds the module with everything else hidden).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "arena_ranges.h"
#include "caching_rules.h"
#include "cuda_runtime_subset.h"
#include "int64_columns.h"
#include "torch_errors.h"

namespace py = pybind11;

namespace {

using memo_columns::Int64Array;
using memo_columns::require_1d;

// How far ahead a request that does not fit its position looks for its own entry.
constexpr size_t kResyncWindow = 8;
// Requests no larger than this (after rounding) never resync (see the top of this file).
constexpr int64_t kNoResyncBytes = memo_caching::kMinBlockSize;

// A request's bytes as planned: rounded like the caching allocator rounds them (512 bytes).
int64_t aligned(int64_t nbytes) { return memo_caching::round_request(nbytes); }

struct Entry {
  int64_t bytes;
  int64_t offset;     // -1: not planned
  int64_t requested;  // the bytes the traced tensor asked for; -1: not known (an old plan)
};

class PlannedArena {
 public:
  explicit PlannedArena(int64_t arena_bytes) : arena_bytes_(arena_bytes) {
    if (arena_bytes < 0) throw py::value_error("arena_bytes must be >= 0");
  }

  void add_kind(int64_t kind, const Int64Array& sizes, const Int64Array& offsets,
                std::optional<Int64Array> requested) {
    require_1d(sizes, "sizes");
    require_1d(offsets, "offsets", sizes.shape(0));
    if (requested) require_1d(*requested, "requested", sizes.shape(0));
    std::vector<Entry> table(sizes.shape(0));
    for (py::ssize_t i = 0; i < sizes.shape(0); ++i) {
      const int64_t bytes = sizes.data()[i];
      const int64_t offset = offsets.data()[i];
      if (bytes <= 0 || offset < -1 || (offset >= 0 && offset + bytes > arena_bytes_)) {
        throw py::value_error("kind " + std::to_string(kind) + ", request " +
                              std::to_string(i) + ": " + std::to_string(bytes) + " bytes at " +
                              std::to_string(offset) + " do not fit an arena of " +
                              std::to_string(arena_bytes_) + " bytes");
      }
      table[i] = Entry{bytes, offset, requested ? requested->data()[i] : -1};
    }
    std::lock_guard<std::mutex> lock(mutex_);
    kinds_[kind] = std::move(table);
  }

  void begin_phase(int64_t kind) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = kinds_.find(kind);
    if (it == kinds_.end()) throw py::value_error("unknown phase kind " + std::to_string(kind));
    current_ = &it->second;
    next_ = 0;
    paused_ = false;
    ++phases_;
  }

  void end_phase() {
    std::lock_guard<std::mutex> lock(mutex_);
    current_ = nullptr;
  }

  // Requests between pause_phase() and resume_phase() (ops outside the layers that run inside a
  // layer phase, such as gradient hooks) are refused without using up positions of the table.
  void pause_phase() {
    std::lock_guard<std::mutex> lock(mutex_);
    paused_ = true;
  }

  void resume_phase() {
    std::lock_guard<std::mutex> lock(mutex_);
    paused_ = false;
  }

  // The arena offset for a request of `nbytes`, or -1 (use the normal allocator).
  int64_t allocate(int64_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (nbytes <= 0) return -1;  // not a request (see the top of this file)
    if (!current_ || paused_) return refuse(outside_phase_);
    if (next_ >= current_->size()) return refuse(beyond_plan_);
    const int64_t bytes = aligned(nbytes);
    // A request of one alignment unit must also ask for the bytes the traced one asked for.
    const auto fits = [&](const Entry& e) {
      return e.bytes == bytes &&
             (bytes > kNoResyncBytes || e.requested < 0 || e.requested == nbytes);
    };
    size_t k = next_;
    if (!fits((*current_)[k])) {  // smaller or larger than planned here
      if (bytes <= kNoResyncBytes) return refuse(size_mismatches_);
      const size_t end = std::min(current_->size(), next_ + 1 + kResyncWindow);
      for (k = next_ + 1; k < end && !fits((*current_)[k]); ++k) {
      }
      if (k == end) return refuse(size_mismatches_);
      ++resyncs_;
    }
    next_ = k + 1;
    const Entry& e = (*current_)[k];
    if (e.offset < 0) return refuse(unplanned_);
    if (live_.overlaps(e.offset, e.bytes)) return refuse(overlaps_);
    live_.occupy(e.offset, e.bytes);
    live_bytes_ += e.bytes;
    peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
    ++served_;
    return e.offset;
  }

  // A request the CUDA hooks kept away from the arena (made on another stream).
  void count_other_stream() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++other_stream_;
  }

  // Return an arena block; false when no block starts at `offset`.
  bool release(int64_t offset) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t bytes = live_.release(offset);
    if (bytes < 0) return false;
    live_bytes_ -= bytes;
    return true;
  }

  py::dict stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    py::dict d;
    d["arena_bytes"] = arena_bytes_;
    d["phases"] = phases_;
    d["served"] = served_;
    d["outside_phase"] = outside_phase_;
    d["unplanned"] = unplanned_;
    d["beyond_plan"] = beyond_plan_;
    d["size_mismatches"] = size_mismatches_;
    d["overlaps"] = overlaps_;
    d["resyncs"] = resyncs_;
    d["other_stream"] = other_stream_;
    d["live_blocks"] = live_.size();
    d["live_bytes"] = live_bytes_;
    d["peak_live_bytes"] = peak_live_bytes_;
    return d;
  }

  int64_t arena_bytes() const { return arena_bytes_; }

  int64_t live_blocks() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(live_.size());
  }

 private:
  int64_t refuse(int64_t& counter) {
    ++counter;
    return -1;
  }

  const int64_t arena_bytes_;
  mutable std::mutex mutex_;
  std::unordered_map<int64_t, std::vector<Entry>> kinds_;
  const std::vector<Entry>* current_ = nullptr;
  size_t next_ = 0;
  bool paused_ = false;
  memo_arena::LiveRanges live_;  // blocks in use (the placement rule the arena model shares)
  int64_t live_bytes_ = 0, peak_live_bytes_ = 0;
  int64_t phases_ = 0, served_ = 0, outside_phase_ = 0, unplanned_ = 0, beyond_plan_ = 0;
  int64_t size_mismatches_ = 0, overlaps_ = 0, resyncs_ = 0, other_stream_ = 0;
};

// ---------------------------------------------------------------- CUDAPluggableAllocator hooks
// One arena per process serves the CUDA hooks (set from Python with the device address of a
// tensor that holds the arena's bytes and the stream whose requests it serves).
//
// The hooks share ownership of it (the Python object holds the other share): a tensor served
// by the arena may be freed after the trainer dropped the arena, for instance during the
// interpreter's teardown, where module globals and the tensors they reach go in no set order.
// A raw pointer here then pointed at a destroyed arena. Replacing or closing the arena
// (set_cuda_arena(None, ...), CudaArena.close()) stops it serving new requests, but while
// blocks it served are still alive it stays "draining": their frees are still recognised by
// address and returned to it (never passed to cudaFreeAsync, which would free an address inside
// the arena's buffer), and the hooks let go of it when its last block comes back.
struct HookedArena {
  std::shared_ptr<PlannedArena> arena;
  uintptr_t base = 0;   // device address of planned offset 0
  void* stream = nullptr;

  bool contains(uintptr_t address) const {
    return arena && address >= base &&
           address < base + static_cast<uintptr_t>(arena->arena_bytes());
  }
};
constexpr int kMaxDevices = 64;

// What the hooks hand out, per device, for memo_ext.device_memory (PyTorch's statistics raise
// under a pluggable allocator). Bytes. The arena's own buffer is one pool allocation and counts
// whole while it exists: the tensors served inside it add nothing, since its bytes are held
// for them anyway.
struct DeviceCounters {
  int64_t allocated = 0;
  int64_t peak_allocated = 0;
};

struct HookState {
  std::mutex mutex;
  HookedArena serving;                 // serves new requests (arena null: none)
  std::vector<HookedArena> draining;   // closed, with blocks still alive
  DeviceCounters counters[kMaxDevices];
  // Streams other than its allocation stream that a live block is used on
  // (memo_ext.device_memory.record_stream -> memo_arena_record_stream).
  std::unordered_map<void*, std::vector<void*>> stream_uses;
};
// Never destroyed, like PyTorch's own allocator state: the free hook can run after this
// library's static destructors (a tensor freed by another library's teardown at exit), and a
// destroyed mutex or map there is undefined behaviour.
HookState& g_hooks = *new HookState();

// The default pool hands freed memory back to the driver at every synchronisation unless told
// to keep it; then every iteration would pay for cudaMalloc again.
void keep_freed_memory_cached(int device) {
  static std::once_flag once[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return;
  std::call_once(once[device], [device] {
    static auto default_pool =
        memo_cudart::symbol<memo_cudart::DeviceGetDefaultMemPoolFn>("cudaDeviceGetDefaultMemPool");
    static auto set_attribute =
        memo_cudart::symbol<memo_cudart::MemPoolSetAttributeFn>("cudaMemPoolSetAttribute");
    void* pool = nullptr;
    if (!default_pool || !set_attribute || default_pool(&pool, device) != 0) return;
    uint64_t keep_everything = UINT64_MAX;
    set_attribute(pool, memo_cudart::kMemPoolAttrReleaseThreshold, &keep_everything);
  });
}

// The device's default pool attribute `attribute` (bytes), or -1 when the runtime cannot say.
int64_t pool_attribute(int device, int attribute) {
  static auto default_pool =
      memo_cudart::symbol<memo_cudart::DeviceGetDefaultMemPoolFn>("cudaDeviceGetDefaultMemPool");
  static auto get_attribute =
      memo_cudart::symbol<memo_cudart::MemPoolGetAttributeFn>("cudaMemPoolGetAttribute");
  void* pool = nullptr;
  uint64_t value = 0;
  if (!default_pool || !get_attribute || default_pool(&pool, device) != 0 ||
      get_attribute(pool, attribute, &value) != 0) {
    return -1;
  }
  return static_cast<int64_t>(value);
}

// Order what `stream` does from now on after the work queued on `user` so far (an event
// recorded on `user`, waited for by `stream`). Returns false when the runtime cannot.
bool order_after(void* stream, void* user) {
  static auto create = memo_cudart::symbol<memo_cudart::EventCreateWithFlagsFn>(
      "cudaEventCreateWithFlags");
  static auto record = memo_cudart::symbol<memo_cudart::EventRecordFn>("cudaEventRecord");
  static auto wait = memo_cudart::symbol<memo_cudart::StreamWaitEventFn>("cudaStreamWaitEvent");
  static auto destroy = memo_cudart::symbol<memo_cudart::EventDestroyFn>("cudaEventDestroy");
  void* event = nullptr;
  if (!create || !record || !wait || !destroy ||
      create(&event, memo_cudart::kEventDisableTiming) != 0) {
    return false;
  }
  const bool ok = record(event, user) == 0 && wait(stream, event, 0) == 0;
  destroy(event);  // legal while pending: the runtime frees it once it completes
  return ok;
}

void count_allocation(int device, int64_t delta) {
  if (device < 0 || device >= kMaxDevices) return;
  DeviceCounters& c = g_hooks.counters[device];
  c.allocated += delta;
  c.peak_allocated = std::max(c.peak_allocated, c.allocated);
}

void set_cuda_arena(std::shared_ptr<PlannedArena> arena, uintptr_t base, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(g_hooks.mutex);
  if (g_hooks.serving.arena && g_hooks.serving.arena->live_blocks() > 0) {
    g_hooks.draining.push_back(g_hooks.serving);
  }
  g_hooks.serving = HookedArena{std::move(arena), base, reinterpret_cast<void*>(stream)};
}

// The pool allocation failed: PyTorch's out-of-memory error, as its stream-ordered allocator
// raises it (CUDAMallocAsyncAllocator.cpp clears the runtime's error first, so that a caller
// who catches the error, frees tensors and retries does not trip over a stale error code at
// its next CUDA call; cudaMallocAsync's out-of-memory is not sticky, cudaGetLastError resets
// it). Called with g_hooks.mutex held; the throw releases it.
[[noreturn]] void out_of_memory(ssize_t size, int device, int status) {
  static auto last_error = memo_cudart::symbol<memo_cudart::GetLastErrorFn>("cudaGetLastError");
  if (last_error) last_error();
  const int64_t held =
      device >= 0 && device < kMaxDevices ? g_hooks.counters[device].allocated : -1;
  memo_torch::throw_out_of_memory(
      "MEMO's planned-arena allocator (--memo-plan: memo_arena_malloc, the CUDA runtime's "
      "stream-ordered pool outside the arena)",
      size, device,
      "cudaMallocAsync returned error " + std::to_string(status) + "; the hooks hold " +
          std::to_string(held) + " bytes of the pool (memo_ext.device_memory reports them).");
}

}  // namespace

extern "C" {
// Signatures of torch.cuda.memory.CUDAPluggableAllocator's alloc/free functions.
//
// What PyTorch does with them (torch/csrc/cuda/CUDAPluggableAllocator.cpp): allocate() calls the
// alloc hook for every size, 0 included (the caching allocator returns a null pointer for 0
// bytes without allocating; the pluggable one has no such shortcut), stores whatever comes
// back, null included, in its table of live allocations keyed by address (emplace: a second
// entry under the same address does not replace the first), and wraps it in the tensor's
// DataPtr. The free hook runs from that DataPtr's deleter, which a null pointer never reaches
// (the deleter lives in a std::unique_ptr, which skips null), with the size, device and stream
// the table kept. So:
//   - 0 bytes: nullptr, the caching allocator's answer. No free hook call follows, the arena
//     is not asked (no table plans a zero-byte request: the recorder never records one, since
//     the caching allocator is never called for it) and nothing is counted. A non-null
//     "sentinel" would be wrong twice over: every zero-byte tensor would share its table entry,
//     and the second of their frees would find none ("Trying to free a pointer not allocated
//     here", thrown inside a deleter: std::terminate).
//   - no memory: c10::OutOfMemoryError (csrc/torch_errors.h says why a null return cannot be
//     the answer), torch.OutOfMemoryError in Python.
__attribute__((visibility("default"))) void* memo_arena_malloc(ssize_t size, int device,
                                                             void* stream) {
  if (size == 0) return nullptr;
  std::lock_guard<std::mutex> lock(g_hooks.mutex);
  if (g_hooks.serving.arena) {
    if (stream == g_hooks.serving.stream) {
      const int64_t offset = g_hooks.serving.arena->allocate(size);
      if (offset >= 0) return reinterpret_cast<void*>(g_hooks.serving.base + offset);
    } else {
      g_hooks.serving.arena->count_other_stream();
    }
  }
  keep_freed_memory_cached(device);
  static auto malloc_async = memo_cudart::symbol<memo_cudart::MallocAsyncFn>("cudaMallocAsync");
  if (!malloc_async) {
    memo_torch::throw_error("MEMO's planned-arena allocator (memo_arena_malloc)",
                            "no CUDA runtime with cudaMallocAsync is loaded in this process");
  }
  void* ptr = nullptr;
  const int status = malloc_async(&ptr, static_cast<size_t>(size), stream);
  if (status != 0 || !ptr) out_of_memory(size, device, status);
  count_allocation(device, size);
  return ptr;
}

// A block is used on `stream` besides the stream it was allocated on (Tensor.record_stream,
// which PyTorch does not forward to a pluggable allocator: memo_ext.device_memory calls this).
__attribute__((visibility("default"))) void memo_arena_record_stream(void* ptr, void* stream) {
  std::lock_guard<std::mutex> lock(g_hooks.mutex);
  std::vector<void*>& uses = g_hooks.stream_uses[ptr];
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

// The free is ordered after the work queued so far on every stream the block was recorded on,
// without stalling the freeing stream: an arena block's offset is reused in the compute
// stream's order, so that stream waits for the users (a planned tensor on a copy stream is
// rare); a pool block is freed on its last user after that user waited for the others and for
// the freeing stream, and the pool (which follows event dependencies) reuses it safely.
__attribute__((visibility("default"))) void memo_arena_free(void* ptr, ssize_t size, int device,
                                                          void* stream) {
  if (!ptr) return;  // PyTorch never frees a null pointer; nothing was allocated for it
  std::lock_guard<std::mutex> lock(g_hooks.mutex);
  std::vector<void*> users;
  auto used = g_hooks.stream_uses.find(ptr);
  if (used != g_hooks.stream_uses.end()) {
    users = std::move(used->second);
    g_hooks.stream_uses.erase(used);
  }
  users.erase(std::remove(users.begin(), users.end(), stream), users.end());
  const uintptr_t address = reinterpret_cast<uintptr_t>(ptr);
  // The serving arena, else a draining one, whose range holds the address.
  HookedArena* owner = g_hooks.serving.contains(address) ? &g_hooks.serving : nullptr;
  auto draining = g_hooks.draining.end();
  if (!owner) {
    draining = std::find_if(g_hooks.draining.begin(), g_hooks.draining.end(),
                            [address](const HookedArena& a) { return a.contains(address); });
    if (draining != g_hooks.draining.end()) owner = &*draining;
  }
  if (owner) {
    for (void* user : users) order_after(stream, user);
    if (owner->arena->release(static_cast<int64_t>(address - owner->base))) {
      if (draining != g_hooks.draining.end() && draining->arena->live_blocks() == 0) {
        g_hooks.draining.erase(draining);  // its last block: the hooks let go of it
      }
      return;
    }
  }
  void* free_on = stream;
  if (!users.empty()) {
    free_on = users.back();
    users.pop_back();
    users.push_back(stream);
    for (void* other : users) {
      if (!order_after(free_on, other)) free_on = stream;  // no events: the old behaviour
    }
  }
  count_allocation(device, -static_cast<int64_t>(size));
  static auto free_async = memo_cudart::symbol<memo_cudart::FreeAsyncFn>("cudaFreeAsync");
  if (free_async) free_async(ptr, free_on);
}
}

void register_planned_arena(py::module_& m) {
  // Held by shared_ptr: the CUDA hooks keep their own share (set_cuda_arena).
  using Holder = std::shared_ptr<PlannedArena>;
  py::class_<PlannedArena, Holder>(m, "PlannedArena", R"doc(MEMO's runtime arena (csrc/planned_arena.cpp).

PlannedArena(arena_bytes); add_kind(kind, sizes, offsets, requested=None) registers a layer-phase
kind's request table (sizes as planned, rounded; offsets -1: not planned; requested: the bytes
each traced request asked for, None: not known); begin_phase(kind) / end_phase() bracket a
layer phase, pause_phase() / resume_phase() requests from outside the layers inside it;
allocate(nbytes) returns the planned offset or -1 (use the normal allocator); release(offset)
returns an arena block; stats() counts what was served and why requests were refused.)doc")
      .def(py::init<int64_t>(), py::arg("arena_bytes"))
      .def("add_kind", &PlannedArena::add_kind, py::arg("kind"), py::arg("sizes"),
           py::arg("offsets"), py::arg("requested") = py::none())
      .def("begin_phase", &PlannedArena::begin_phase, py::arg("kind"))
      .def("end_phase", &PlannedArena::end_phase)
      .def("pause_phase", &PlannedArena::pause_phase)
      .def("resume_phase", &PlannedArena::resume_phase)
      .def("allocate", &PlannedArena::allocate, py::arg("nbytes"))
      .def("release", &PlannedArena::release, py::arg("offset"))
      .def("stats", &PlannedArena::stats)
      .def_property_readonly("arena_bytes", &PlannedArena::arena_bytes);
  m.def("cuda_arena_memory",
        [](int device) {
          if (device < 0 || device >= kMaxDevices) throw py::index_error("device index");
          DeviceCounters c;
          {
            std::lock_guard<std::mutex> lock(g_hooks.mutex);
            c = g_hooks.counters[device];
          }
          const int64_t reserved = pool_attribute(device, memo_cudart::kMemPoolAttrReservedMemCurrent);
          const int64_t peak = pool_attribute(device, memo_cudart::kMemPoolAttrReservedMemHigh);
          py::dict d;
          d["allocated"] = c.allocated;
          d["peak_allocated"] = c.peak_allocated;
          d["reserved"] = reserved >= 0 ? reserved : c.allocated;
          d["peak_reserved"] = peak >= 0 ? peak : c.peak_allocated;
          return d;
        },
        py::arg("device"),
        "Bytes memo_arena_malloc handed out on `device` (allocated, peak_allocated; the arena's "
        "buffer counts whole) and the stream-ordered pool's reserved bytes (reserved, "
        "peak_reserved; the allocated figures when the runtime cannot say).");
  m.def("cuda_arena_reset_peak",
        [](int device) {
          if (device < 0 || device >= kMaxDevices) throw py::index_error("device index");
          {
            std::lock_guard<std::mutex> lock(g_hooks.mutex);
            g_hooks.counters[device].peak_allocated = g_hooks.counters[device].allocated;
          }
          static auto default_pool = memo_cudart::symbol<memo_cudart::DeviceGetDefaultMemPoolFn>(
              "cudaDeviceGetDefaultMemPool");
          static auto set_attribute = memo_cudart::symbol<memo_cudart::MemPoolSetAttributeFn>(
              "cudaMemPoolSetAttribute");
          void* pool = nullptr;
          uint64_t zero = 0;  // the only value the runtime accepts: back to the current
          if (default_pool && set_attribute && default_pool(&pool, device) == 0) {
            set_attribute(pool, memo_cudart::kMemPoolAttrReservedMemHigh, &zero);
          }
        },
        py::arg("device"), "Start new peaks of cuda_arena_memory(device).");
  m.def("cuda_runtime_library", &memo_cudart::loaded_runtime_path,
        "The CUDA runtime library loaded in this process, which the arena's hooks call ('' when "
        "none is loaded).");
  m.def("set_cuda_arena",
        [](std::shared_ptr<PlannedArena> arena, uintptr_t base, uintptr_t stream) {
          set_cuda_arena(std::move(arena), base, stream);
        },
        py::arg("arena").none(true), py::arg("base_address"), py::arg("stream"),
        "Make `arena` (None: none) serve memo_arena_malloc/memo_arena_free for requests on "
        "`stream` (a cudaStream_t as an integer), its byte 0 at the device address "
        "base_address. The arena served before stops serving; while blocks it served are "
        "alive the hooks keep it (whatever Python does with it) and return their frees to it.");
  m.def("cuda_arena_hooks",
        [] {
          std::lock_guard<std::mutex> lock(g_hooks.mutex);
          int64_t draining_blocks = 0;
          for (const HookedArena& a : g_hooks.draining) draining_blocks += a.arena->live_blocks();
          py::dict d;
          d["serving"] = static_cast<bool>(g_hooks.serving.arena);
          const auto& serving = g_hooks.serving.arena;
          d["serving_live_blocks"] = serving ? serving->live_blocks() : 0;
          d["draining"] = static_cast<int64_t>(g_hooks.draining.size());
          d["draining_live_blocks"] = draining_blocks;
          return d;
        },
        "What memo_arena_malloc/memo_arena_free hold: whether an arena serves (and its live "
        "blocks), and the closed arenas kept until their live blocks are freed.");
}
