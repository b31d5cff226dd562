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
//     and every placement is checked against it.
//
// Why C++: the CUDA path calls this from the allocator hooks of
// torch.cuda.memory.CUDAPluggableAllocator (memo_arena_malloc / memo_arena_free below), once per
// tensor allocation of every layer, where a Python callback would stall the launch queue; on CPU
// the same object is driven from Python (memo_ext/planner/arena.py) so tests exercise the code a
// GPU run uses.
//
// The CUDA hooks need no CUDA headers: the fallback for refused requests is cudaMalloc/cudaFree,
// looked up with dlsym in the process (PyTorch has loaded libcudart by the time a pool exists).
// They have never run on this project's CPU machines. Both are exported with default visibility
// (pybind11 builds the module with everything else hidden).
#include <dlfcn.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "int64_columns.h"

namespace py = pybind11;

namespace {

using memo_columns::Int64Array;
using memo_columns::require_1d;

constexpr int64_t kAlignment = 512;

int64_t aligned(int64_t nbytes) {
  return std::max(kAlignment, (nbytes + kAlignment - 1) / kAlignment * kAlignment);
}

struct Entry {
  int64_t bytes;
  int64_t offset;  // -1: not planned
};

class PlannedArena {
 public:
  explicit PlannedArena(int64_t arena_bytes) : arena_bytes_(arena_bytes) {
    if (arena_bytes < 0) throw py::value_error("arena_bytes must be >= 0");
  }

  void add_kind(int64_t kind, const Int64Array& sizes, const Int64Array& offsets) {
    require_1d(sizes, "sizes");
    require_1d(offsets, "offsets", sizes.shape(0));
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
      table[i] = Entry{bytes, offset};
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
    ++phases_;
  }

  void end_phase() {
    std::lock_guard<std::mutex> lock(mutex_);
    current_ = nullptr;
  }

  // The arena offset for a request of `nbytes`, or -1 (use the normal allocator).
  int64_t allocate(int64_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!current_) return refuse(outside_phase_);
    const size_t k = next_++;
    if (k >= current_->size()) return refuse(beyond_plan_);
    const Entry& e = (*current_)[k];
    if (e.offset < 0) return refuse(unplanned_);
    if (aligned(nbytes) > e.bytes) return refuse(size_mismatches_);
    auto after = live_.lower_bound(e.offset + e.bytes);  // first block starting at/after our end
    if (after != live_.begin()) {
      auto before = std::prev(after);
      if (before->second > e.offset) return refuse(overlaps_);
    }
    live_[e.offset] = e.offset + e.bytes;
    live_bytes_ += e.bytes;
    peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
    ++served_;
    return e.offset;
  }

  // Return an arena block; false when no block starts at `offset`.
  bool release(int64_t offset) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(offset);
    if (it == live_.end()) return false;
    live_bytes_ -= it->second - it->first;
    live_.erase(it);
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
    d["live_blocks"] = static_cast<int64_t>(live_.size());
    d["live_bytes"] = live_bytes_;
    d["peak_live_bytes"] = peak_live_bytes_;
    return d;
  }

  int64_t arena_bytes() const { return arena_bytes_; }

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
  std::map<int64_t, int64_t> live_;  // start -> end of blocks in use
  int64_t live_bytes_ = 0, peak_live_bytes_ = 0;
  int64_t phases_ = 0, served_ = 0, outside_phase_ = 0, unplanned_ = 0, beyond_plan_ = 0;
  int64_t size_mismatches_ = 0, overlaps_ = 0;
};

// ---------------------------------------------------------------- CUDAPluggableAllocator hooks
// One arena per process is active for the CUDA hooks (set from Python with the device address
// of a tensor that holds the arena's bytes).
PlannedArena* g_cuda_arena = nullptr;
uintptr_t g_cuda_base = 0;

using CudaMallocFn = int (*)(void**, size_t);
using CudaFreeFn = int (*)(void*);

template <class Fn>
Fn cuda_symbol(const char* name) {
  static void* handle = dlopen(nullptr, RTLD_NOW);
  void* symbol = handle ? dlsym(handle, name) : nullptr;
  if (!symbol) {
    void* runtime = dlopen("libcudart.so", RTLD_NOW | RTLD_NOLOAD);
    if (!runtime) runtime = dlopen("libcudart.so.12", RTLD_NOW | RTLD_NOLOAD);
    symbol = runtime ? dlsym(runtime, name) : nullptr;
  }
  return reinterpret_cast<Fn>(symbol);
}

void set_cuda_arena(PlannedArena* arena, uintptr_t base) {
  g_cuda_arena = arena;
  g_cuda_base = base;
}

}  // namespace

extern "C" {
// Signatures of torch.cuda.memory.CUDAPluggableAllocator's alloc/free functions; the stream
// (a cudaStream_t) is unused: the arena serves the compute stream's layers only.
__attribute__((visibility("default"))) void* memo_arena_malloc(ssize_t size, int device,
                                                             void* stream) {
  (void)device;
  (void)stream;
  if (g_cuda_arena) {
    const int64_t offset = g_cuda_arena->allocate(size);
    if (offset >= 0) return reinterpret_cast<void*>(g_cuda_base + offset);
  }
  static CudaMallocFn cuda_malloc = cuda_symbol<CudaMallocFn>("cudaMalloc");
  void* ptr = nullptr;
  if (!cuda_malloc || cuda_malloc(&ptr, static_cast<size_t>(size)) != 0) return nullptr;
  return ptr;
}

__attribute__((visibility("default"))) void memo_arena_free(void* ptr, ssize_t size, int device,
                                                          void* stream) {
  (void)size;
  (void)device;
  (void)stream;
  const uintptr_t address = reinterpret_cast<uintptr_t>(ptr);
  if (g_cuda_arena && address >= g_cuda_base &&
      address < g_cuda_base + static_cast<uintptr_t>(g_cuda_arena->arena_bytes()) &&
      g_cuda_arena->release(static_cast<int64_t>(address - g_cuda_base))) {
    return;
  }
  static CudaFreeFn cuda_free = cuda_symbol<CudaFreeFn>("cudaFree");
  if (cuda_free) cuda_free(ptr);
}
}

void register_planned_arena(py::module_& m) {
  py::class_<PlannedArena>(m, "PlannedArena", R"doc(MEMO's runtime arena (csrc/planned_arena.cpp).

PlannedArena(arena_bytes); add_kind(kind, sizes, offsets) registers a layer-phase kind's request
table (offsets -1: not planned); begin_phase(kind) / end_phase() bracket a layer phase;
allocate(nbytes) returns the planned offset or -1 (use the normal allocator); release(offset)
returns an arena block; stats() counts what was served and why requests were refused.)doc")
      .def(py::init<int64_t>(), py::arg("arena_bytes"))
      .def("add_kind", &PlannedArena::add_kind, py::arg("kind"), py::arg("sizes"),
           py::arg("offsets"))
      .def("begin_phase", &PlannedArena::begin_phase, py::arg("kind"))
      .def("end_phase", &PlannedArena::end_phase)
      .def("allocate", &PlannedArena::allocate, py::arg("nbytes"))
      .def("release", &PlannedArena::release, py::arg("offset"))
      .def("stats", &PlannedArena::stats)
      .def_property_readonly("arena_bytes", &PlannedArena::arena_bytes);
  m.def("set_cuda_arena",
        [](PlannedArena* arena, uintptr_t base) { set_cuda_arena(arena, base); },
        py::arg("arena").none(true), py::arg("base_address"),
        "Make `arena` (None: none) serve memo_arena_malloc/memo_arena_free, its byte 0 at the "
        "device address base_address.");
}
