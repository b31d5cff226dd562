// The GMLake stitching allocator on a GPU: the core of csrc/stitching_allocator.h over the CUDA
// virtual memory management API, exposed as torch.cuda.memory.CUDAPluggableAllocator hooks.
//
// Built as its own shared library (not part of memo_ext._C, which must build without CUDA) by
// memo_ext/alloc/stitching_cuda.py when the CUDA toolkit headers are present:
//   g++ -std=c++17 -O3 -shared -fPIC -Icsrc -I$CUDA_HOME/include -isystem $TORCH/include
//       csrc/cuda/stitching_cuda.cpp -o libmemo_stitching_cuda.so -ldl -L$TORCH/lib -lc10
// The driver entry points are looked up at run time (dlopen of libcuda.so.1, or of the library
// named by MEMO_STITCH_CUDA_DRIVER), so the library links against nothing CUDA; it links c10,
// whose out-of-memory error the alloc hook throws (csrc/torch_errors.h).
// Why one file: it is the one source memo_ext/alloc/stitching_cuda.py compiles on the machine
// that runs it, and its parts (driver table, backend, deferred frees, hooks) share the globals
// one mutex guards; the allocator core it wraps is csrc/stitching_allocator.h.
//
// Backend (one per device):
//   create(bytes)          bytes / 2 MiB calls of cuMemCreate, one handle per 2 MiB chunk: a
//                          primitive block can then be split, and its pieces released, at any
//                          chunk boundary (cuMemMap maps a handle from offset 0 only)
//   release(h, off, bytes) cuMemRelease of the chunks in the range
//   reserve / unreserve    cuMemAddressReserve (2 MiB aligned) / cuMemAddressFree
//   map(va, h, off, bytes) cuMemMap of each chunk in the range at consecutive addresses, then
//                          one cuMemSetAccess (read/write for this device) over the range
//   unmap(va, bytes)       cuMemUnmap over the range (it covers whole chunk mappings only)
//   synchronize(stream)    cuStreamSynchronize in the stream's context: the allocator calls it
//                          before it unmaps or releases memory a block of that stream used
//                          (csrc/stitching_allocator.h, StitchingAllocator::settle, says why)
// The normal path's segments come from the same backend (GMLake keeps cudaMalloc for it: a
// difference that changes no decision, only which API holds the bytes).
//
// Streams, as PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp: recordStream,
// insert_events, process_events, synchronize_and_free_events) handles them:
//   - a block is reused without waiting by its allocation stream only (the pools are keyed by
//     stream, and work on one stream runs in order);
//   - memo_stitch_record_stream(ptr, stream) marks a live block as used by another stream too;
//   - freeing such a block records one event per using stream (cuEventCreate with
//     CU_EVENT_DISABLE_TIMING, cuEventRecord in the stream's context) and defers the free
//     until all of them completed; until then the block stays active and cannot be handed out;
//   - pending frees are checked (cuEventQuery, never blocking) at the start of every malloc,
//     and waited for (cuEventSynchronize) by empty_cache and by a malloc that would otherwise
//     fail for lack of memory (then retried).
// PyTorch's Python CUDAPluggableAllocator(path, alloc, free) cannot install a record-stream hook
// (set_record_stream_fn is C++ only), so Tensor.record_stream() never reaches this library:
// callers go through memo_ext.device_memory's record_stream, which calls the export below.
// Not CUDA-graph aware: an event recorded while a stream is being captured becomes part of the
// graph (PyTorch defers those frees until capture ends; this library does not).
//
// Status: compiled and exercised on the CPU dev machine against a fake driver that implements
// these calls with memfd/mmap (tests/unit/memo_ext/alloc/test_stitching_cuda_backend.py); never run on a GPU
// in this project. tests/gpu/test_stitching_cuda.py is the GPU test (skipped without CUDA).
#include <cuda.h>
#include <dlfcn.h>
#include <sys/types.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../stitching_allocator.h"
#include "../torch_errors.h"

namespace {

using memo_stitch::kGranularity;

// ------------------------------------------------------------------------------ driver API
struct Driver {
  decltype(&cuMemCreate) mem_create = nullptr;
  decltype(&cuMemRelease) mem_release = nullptr;
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) mem_map = nullptr;
  decltype(&cuMemUnmap) mem_unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuGetErrorString) error_string = nullptr;
  decltype(&cuEventCreate) event_create = nullptr;
  decltype(&cuEventRecord) event_record = nullptr;
  decltype(&cuEventQuery) event_query = nullptr;
  decltype(&cuEventSynchronize) event_synchronize = nullptr;
  decltype(&cuEventDestroy) event_destroy = nullptr;
  decltype(&cuStreamGetCtx) stream_context = nullptr;
  decltype(&cuCtxPushCurrent) context_push = nullptr;
  decltype(&cuCtxPopCurrent) context_pop = nullptr;
  decltype(&cuStreamSynchronize) stream_synchronize = nullptr;
};

template <class F>
void load(void* lib, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!fn) throw std::runtime_error(std::string("CUDA driver has no ") + name);
}

const Driver& driver() {
  static const Driver d = [] {
    const char* path = std::getenv("MEMO_STITCH_CUDA_DRIVER");
    void* lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) throw std::runtime_error(std::string("cannot load the CUDA driver: ") + dlerror());
    Driver out;
    load(lib, "cuMemCreate", out.mem_create);
    load(lib, "cuMemRelease", out.mem_release);
    load(lib, "cuMemAddressReserve", out.address_reserve);
    load(lib, "cuMemAddressFree", out.address_free);
    load(lib, "cuMemMap", out.mem_map);
    load(lib, "cuMemUnmap", out.mem_unmap);
    load(lib, "cuMemSetAccess", out.set_access);
    load(lib, "cuMemGetAllocationGranularity", out.granularity);
    load(lib, "cuGetErrorString", out.error_string);
    load(lib, "cuEventCreate", out.event_create);
    load(lib, "cuEventRecord", out.event_record);
    load(lib, "cuEventQuery", out.event_query);
    load(lib, "cuEventSynchronize", out.event_synchronize);
    // cuda.h maps these two names to their _v2 entry points, which are what the driver exports
    load(lib, "cuEventDestroy_v2", out.event_destroy);
    load(lib, "cuStreamGetCtx", out.stream_context);
    load(lib, "cuCtxPushCurrent_v2", out.context_push);
    load(lib, "cuCtxPopCurrent_v2", out.context_pop);
    load(lib, "cuStreamSynchronize", out.stream_synchronize);
    return out;
  }();
  return d;
}

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (driver().error_string) driver().error_string(r, &text);
  throw std::runtime_error(std::string(what) + " failed: " + (text ? text : "unknown error") +
                           " (" + std::to_string(static_cast<int>(r)) + ")");
}

// ------------------------------------------------------------------------------ contexts
// An event is created, recorded, queried and destroyed, and a stream synchronized, in the
// context of that stream: the thread that frees a block (a Python deleter, an autograd thread)
// may have another device's context current, or none.
class ContextScope {
 public:
  explicit ContextScope(CUcontext ctx) { check(driver().context_push(ctx), "cuCtxPushCurrent"); }
  ~ContextScope() {
    CUcontext popped = nullptr;
    driver().context_pop(&popped);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;
};

// ------------------------------------------------------------------------------ the backend
class CudaBackend : public memo_stitch::PhysicalBackend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    size_t g = 0;
    check(driver().granularity(&g, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity");
    if (g == 0 || kGranularity % static_cast<int64_t>(g) != 0) {
      throw std::runtime_error("the device's allocation granularity (" + std::to_string(g) +
                               " bytes) does not divide 2 MiB");
    }
  }
  ~CudaBackend() override {
    for (auto& kv : handles_) {
      for (auto& c : kv.second) {
        if (c.live) driver().mem_release(c.handle);
      }
    }
  }

  int64_t granularity() const override { return kGranularity; }

  int64_t create(int64_t bytes) override {
    std::vector<Chunk> chunks;
    for (int64_t done = 0; done < bytes; done += kGranularity) {
      CUmemGenericAllocationHandle h = 0;
      const CUresult r = driver().mem_create(&h, kGranularity, &prop_, 0);
      if (r != CUDA_SUCCESS) {  // out of memory (or another failure): undo, report none
        for (auto& c : chunks) driver().mem_release(c.handle);
        return -1;
      }
      chunks.push_back(Chunk{h, true});
    }
    const int64_t id = next_++;
    handles_[id] = std::move(chunks);
    physical_bytes_ += bytes;
    return id;
  }

  void release(int64_t h, int64_t offset, int64_t bytes) override {
    auto& chunks = handles_.at(h);
    for (int64_t k = offset / kGranularity; k < (offset + bytes) / kGranularity; ++k) {
      if (!chunks.at(k).live) throw std::logic_error("CUDA chunk released twice");
      check(driver().mem_release(chunks[k].handle), "cuMemRelease");
      chunks[k].live = false;
    }
    physical_bytes_ -= bytes;
    bool any = false;
    for (const auto& c : chunks) any = any || c.live;
    if (!any) handles_.erase(h);
  }

  uintptr_t reserve(int64_t bytes) override {
    CUdeviceptr p = 0;
    check(driver().address_reserve(&p, static_cast<size_t>(bytes), kGranularity, 0, 0),
          "cuMemAddressReserve");
    return static_cast<uintptr_t>(p);
  }

  void unreserve(uintptr_t va, int64_t bytes) override {
    check(driver().address_free(static_cast<CUdeviceptr>(va), static_cast<size_t>(bytes)),
          "cuMemAddressFree");
  }

  void map(uintptr_t va, int64_t h, int64_t offset, int64_t bytes) override {
    auto& chunks = handles_.at(h);
    int64_t done = 0;
    try {
      for (; done < bytes; done += kGranularity) {
        const Chunk& c = chunks.at((offset + done) / kGranularity);
        check(driver().mem_map(static_cast<CUdeviceptr>(va + done), kGranularity, 0, c.handle,
                               0),
              "cuMemMap");
      }
      check(driver().set_access(static_cast<CUdeviceptr>(va), static_cast<size_t>(bytes),
                                &access_, 1),
            "cuMemSetAccess");
    } catch (...) {
      if (done) driver().mem_unmap(static_cast<CUdeviceptr>(va), static_cast<size_t>(done));
      throw;
    }
  }

  void unmap(uintptr_t va, int64_t bytes) override {
    check(driver().mem_unmap(static_cast<CUdeviceptr>(va), static_cast<size_t>(bytes)),
          "cuMemUnmap");
  }

  // Called from the hooks under the library's mutex, without Python's GIL (PyTorch's
  // unmapHandles calls cudaStreamSynchronize directly rather than c10's stream_synchronize for
  // the same reason: that one may take the GIL, and the allocator lock must come after it).
  void synchronize(int64_t stream) override {
    auto it = contexts_.find(stream);
    if (it == contexts_.end()) {
      throw std::logic_error("synchronize of a stream no block was allocated on");
    }
    ContextScope scope(it->second);
    check(driver().stream_synchronize(reinterpret_cast<CUstream>(stream)), "cuStreamSynchronize");
  }

  // Remember the context of a stream requests come on, read from the allocating thread (for
  // the NULL stream: its current context), for synchronize(): the thread that later unmaps
  // (a Python deleter, empty_cache) may have another context current, or none.
  void note_stream(void* stream) {
    const int64_t key = reinterpret_cast<int64_t>(stream);
    if (contexts_.count(key)) return;
    CUcontext ctx = nullptr;
    check(driver().stream_context(static_cast<CUstream>(stream), &ctx), "cuStreamGetCtx");
    contexts_[key] = ctx;
  }

  int64_t physical_bytes() const { return physical_bytes_; }
  int64_t live_handles() const { return static_cast<int64_t>(handles_.size()); }

 private:
  struct Chunk {
    CUmemGenericAllocationHandle handle;
    bool live;
  };
  const int device_;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  std::unordered_map<int64_t, std::vector<Chunk>> handles_;
  std::unordered_map<int64_t, CUcontext> contexts_;  // stream -> its context
  int64_t next_ = 0;
  int64_t physical_bytes_ = 0;
};

// ------------------------------------------------------------------ streams and events
// A stream that uses a block besides its allocation stream, with the context it belongs to.
struct StreamUse {
  CUstream stream;
  CUcontext ctx;
  bool operator<(const StreamUse& o) const {
    return std::make_pair(ctx, stream) < std::make_pair(o.ctx, o.stream);
  }
  bool operator==(const StreamUse& o) const { return ctx == o.ctx && stream == o.stream; }
};

struct PendingEvent {
  CUevent event;
  uintptr_t ptr;  // the block whose free waits for it
};

struct PendingFree {
  int events;     // not yet completed
  int64_t bytes;  // the block's bytes
};

// ---------------------------------------------------------------- one allocator per device
struct DeviceAllocator {
  std::unique_ptr<CudaBackend> backend;
  std::unique_ptr<memo_stitch::StitchingAllocator> alloc;
  // live blocks used by streams other than their allocation stream
  std::unordered_map<uintptr_t, std::vector<StreamUse>> uses;
  // freed blocks waiting for events, and the events per using stream in record order (a
  // stream's events complete in that order, so a query stops at the first not yet complete)
  std::unordered_map<uintptr_t, PendingFree> pending;
  std::map<StreamUse, std::deque<PendingEvent>> events;
  int64_t pending_bytes = 0;
  int64_t events_pending = 0;
  int64_t events_recorded = 0;  // since the allocator was created
  int64_t event_syncs = 0;      // cuEventSynchronize calls (blocking waits)
};

std::mutex g_mutex;
memo_stitch::Options g_options;
std::map<int, DeviceAllocator> g_devices;
std::string g_last_error;

// One event of `d`'s queue completed: the block's free goes ahead when it was its last.
void event_done(DeviceAllocator& d, const PendingEvent& e) {
  // the event completed: a failed destroy leaks its handle, never the block
  if (driver().event_destroy(e.event) != CUDA_SUCCESS) {
    g_last_error = "cuEventDestroy failed: one event handle leaked";
  }
  --d.events_pending;
  auto it = d.pending.find(e.ptr);
  if (--it->second.events > 0) return;
  d.pending_bytes -= it->second.bytes;
  d.pending.erase(it);
  d.alloc->free(e.ptr);
}

// Free the blocks whose events all completed, without waiting (process_events).
void process_events(DeviceAllocator& d) {
  for (auto it = d.events.begin(); it != d.events.end();) {
    {
      ContextScope scope(it->first.ctx);
      auto& queue = it->second;
      while (!queue.empty()) {
        const CUresult r = driver().event_query(queue.front().event);
        if (r == CUDA_ERROR_NOT_READY) break;
        check(r, "cuEventQuery");
        const PendingEvent e = queue.front();
        queue.pop_front();
        event_done(d, e);
      }
    }
    it = it->second.empty() ? d.events.erase(it) : std::next(it);
  }
}

// Wait for every pending event and free the blocks (synchronize_and_free_events). Returns
// whether any block was freed.
bool synchronize_and_free(DeviceAllocator& d) {
  const bool any = !d.pending.empty();
  for (auto it = d.events.begin(); it != d.events.end(); it = d.events.erase(it)) {
    ContextScope scope(it->first.ctx);
    auto& queue = it->second;
    while (!queue.empty()) {
      check(driver().event_synchronize(queue.front().event), "cuEventSynchronize");
      ++d.event_syncs;
      const PendingEvent e = queue.front();
      queue.pop_front();
      event_done(d, e);
    }
  }
  return any;
}

// Record one event per using stream of the block at `ptr` and defer its free (insert_events).
// When an event cannot be created or recorded, the block is never freed: it stays active until
// teardown rather than be handed out while a stream may still use it.
void defer_free(DeviceAllocator& d, uintptr_t ptr, const std::vector<StreamUse>& uses) {
  std::vector<std::pair<StreamUse, CUevent>> recorded;
  try {
    for (const StreamUse& u : uses) {
      ContextScope scope(u.ctx);
      CUevent ev = nullptr;
      check(driver().event_create(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
      recorded.emplace_back(u, ev);
      check(driver().event_record(ev, u.stream), "cuEventRecord");
    }
  } catch (...) {
    for (auto& r : recorded) {
      ContextScope scope(r.first.ctx);
      driver().event_destroy(r.second);
    }
    throw;
  }
  d.pending[ptr] = PendingFree{static_cast<int>(recorded.size()), d.alloc->block_bytes(ptr)};
  d.pending_bytes += d.alloc->block_bytes(ptr);
  for (auto& r : recorded) d.events[r.first].push_back(PendingEvent{r.second, ptr});
  d.events_pending += static_cast<int64_t>(recorded.size());
  d.events_recorded += static_cast<int64_t>(recorded.size());
}

DeviceAllocator& device_for(int device) {
  DeviceAllocator& d = g_devices[device];
  if (!d.alloc) {
    d.backend = std::make_unique<CudaBackend>(device);
    d.alloc = std::make_unique<memo_stitch::StitchingAllocator>(*d.backend, g_options);
    // a request about to fail for lack of memory first waits for the deferred frees
    d.alloc->set_reclaim([&d] { return synchronize_and_free(d); });
  }
  return d;
}

// The device whose allocator has a live block (not freed, not pending) at `ptr`; nullptr if none.
DeviceAllocator* owner_of(uintptr_t ptr) {
  for (auto& kv : g_devices) {
    DeviceAllocator& d = kv.second;
    if (d.alloc && d.alloc->block_bytes(ptr) >= 0 && !d.pending.count(ptr)) return &d;
  }
  return nullptr;
}

}  // namespace

// ------------------------------------------------------------------------- exported hooks
namespace {

enum class Outcome { kServed, kOutOfMemory, kFailed };

// The allocation behind both alloc exports. Sets *out, and g_last_error unless served.
Outcome allocate(ssize_t size, int device, void* stream, void** out, std::string* detail) {
  std::lock_guard<std::mutex> lock(g_mutex);
  *out = nullptr;
  try {
    DeviceAllocator& d = device_for(device);
    d.backend->note_stream(stream);
    if (!d.events.empty()) process_events(d);
    const uintptr_t p = d.alloc->malloc(static_cast<int64_t>(size),
                                        reinterpret_cast<int64_t>(stream));
    if (p) {
      *out = reinterpret_cast<void*>(p);
      return Outcome::kServed;
    }
    const memo_stitch::Stats& s = d.alloc->stats();
    g_last_error = "out of memory: " + std::to_string(size) + " bytes";
    if (detail) {
      *detail = "It holds " + std::to_string(s.reserved_bytes) + " bytes of physical memory, " +
                std::to_string(s.active_bytes) + " of them in blocks in use, after dropping its "
                "cache and waiting for the frees other streams held back (" +
                std::to_string(d.pending_bytes) + " bytes still held back).";
    }
    return Outcome::kOutOfMemory;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    if (detail) *detail = e.what();
    return Outcome::kFailed;
  }
}

constexpr const char* kAllocatorName =
    "MEMO's GMLake stitching allocator (--memo-stitching-allocator: memo_stitch_malloc)";

}  // namespace

// Signatures of torch.cuda.memory.CUDAPluggableAllocator's alloc/free functions. The stream (a
// cudaStream_t) keys the pools, as PyTorch's allocator keys its own.
//
// PyTorch's pluggable allocator calls the alloc hook for every size, 0 included, and never
// checks what comes back (torch/csrc/cuda/CUDAPluggableAllocator.cpp): 0 bytes get nullptr
// here, as PyTorch's caching allocator gives them (no block, and the free hook is never called
// for a null pointer); a request that cannot be served throws c10::OutOfMemoryError
// (torch.OutOfMemoryError; any other failure c10::Error, a RuntimeError) instead of handing
// PyTorch a null pointer for a tensor of `size` bytes (csrc/torch_errors.h). Driver API calls
// leave no error state behind to clear (that is the runtime's cudaGetLastError, for runtime
// calls); cuMemCreate's CUDA_ERROR_OUT_OF_MEMORY is only its return value.
extern "C" {

__attribute__((visibility("default"))) void* memo_stitch_malloc(ssize_t size, int device,
                                                              void* stream) {
  if (size == 0) return nullptr;
  void* ptr = nullptr;
  std::string detail;
  switch (allocate(size, device, stream, &ptr, &detail)) {
    case Outcome::kServed:
      return ptr;
    case Outcome::kOutOfMemory:
      memo_torch::throw_out_of_memory(kAllocatorName, size, device, detail);
    case Outcome::kFailed:
      break;
  }
  memo_torch::throw_error(kAllocatorName, detail);
}

// memo_stitch_malloc for callers that cannot catch a C++ exception (ctypes): nullptr for 0
// bytes and on any failure, memo_stitch_last_error() says why.
__attribute__((visibility("default"))) void* memo_stitch_try_malloc(ssize_t size, int device,
                                                                  void* stream) {
  if (size == 0) return nullptr;
  void* ptr = nullptr;
  allocate(size, device, stream, &ptr, nullptr);
  return ptr;
}

// A block used by other streams (memo_stitch_record_stream) is freed once their work queued so
// far completed; until then it stays active. `size` and `stream` are PyTorch's record of the
// allocation; the allocator keeps its own.
__attribute__((visibility("default"))) void memo_stitch_free(void* ptr, ssize_t size, int device,
                                                           void* stream) {
  (void)size;
  (void)stream;
  if (!ptr) return;  // what a zero-byte or failed allocation handed out
  std::lock_guard<std::mutex> lock(g_mutex);
  try {
    const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    auto it = g_devices.find(device);
    if (it == g_devices.end() || !it->second.alloc || it->second.alloc->block_bytes(p) < 0 ||
        it->second.pending.count(p)) {
      g_last_error = "free of an address this allocator did not hand out, or freed already";
      return;
    }
    DeviceAllocator& d = it->second;
    auto used = d.uses.find(p);
    if (used == d.uses.end()) {
      d.alloc->free(p);
      return;
    }
    const std::vector<StreamUse> uses = std::move(used->second);
    d.uses.erase(used);
    defer_free(d, p, uses);
  } catch (const std::exception& e) {
    g_last_error = e.what();
  }
}

// Mark the live block starting at `ptr` as used by `stream` (a cudaStream_t) as well as by its
// allocation stream (torch.Tensor.record_stream; the allocation stream itself is ignored): its
// free then waits for the work queued on `stream` until the free. Returns 0, or -1 when no live
// block of this allocator starts at `ptr` or the stream's context cannot be read
// (memo_stitch_last_error() says which).
__attribute__((visibility("default"))) int memo_stitch_record_stream(void* ptr, void* stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  try {
    const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    DeviceAllocator* d = owner_of(p);
    if (!d) {
      g_last_error = "record_stream of an address that is not a live block of this allocator "
                     "(a block starts at the storage's data_ptr, not a view's)";
      return -1;
    }
    if (*d->alloc->stream_of(p) == reinterpret_cast<int64_t>(stream)) return 0;
    const CUstream s = static_cast<CUstream>(stream);
    // the context is read now, from a thread that is using the stream (for the NULL stream: the
    // caller's current context), not at the free
    CUcontext ctx = nullptr;
    check(driver().stream_context(s, &ctx), "cuStreamGetCtx");
    const StreamUse use{s, ctx};
    std::vector<StreamUse>& uses = d->uses[p];
    for (const StreamUse& u : uses) {
      if (u == use) return 0;
    }
    uses.push_back(use);
    return 0;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return -1;
  }
}

// Options for allocators created after the call (bytes; a negative value keeps the default).
// Returns 0, or -1 when an allocator already exists (options cannot change under it).
__attribute__((visibility("default"))) int memo_stitch_configure(int64_t frag_limit,
                                                               int64_t max_sblocks,
                                                               int64_t capacity) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_devices.empty()) return -1;
  if (frag_limit >= 0) g_options.frag_limit = frag_limit;
  if (max_sblocks >= 0) g_options.max_sblocks = max_sblocks;
  if (capacity >= 0) g_options.capacity = capacity;
  return 0;
}

// Wait for the pending frees of `device` (cuEventSynchronize), then drop unused stitched blocks
// and release its free physical memory.
__attribute__((visibility("default"))) void memo_stitch_empty_cache(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  try {
    auto it = g_devices.find(device);
    if (it == g_devices.end() || !it->second.alloc) return;
    synchronize_and_free(it->second);
    it->second.alloc->release_cached();
  } catch (const std::exception& e) {
    g_last_error = e.what();
  }
}

// Counters of `device` into out[0..n): the order of memo_stitch_stat_names(). Returns how many
// were written (0 for a device with no allocator yet).
__attribute__((visibility("default"))) int memo_stitch_stats(int device, int64_t* out, int n) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_devices.find(device);
  if (it == g_devices.end() || !it->second.alloc) return 0;
  const memo_stitch::Stats& s = it->second.alloc->stats();
  const int64_t values[] = {
      s.reserved_bytes, s.peak_reserved_bytes, s.active_bytes, s.peak_active_bytes,
      s.mapped_bytes, s.sblocks_alive, s.allocs, s.frees, s.exact_hits, s.splits, s.stitches,
      s.new_pblocks, s.sblocks_dropped, s.reorganisations, s.ooms, s.physical_creates,
      s.physical_releases, s.map_calls, static_cast<int64_t>(s.map_seconds * 1e9),
      it->second.backend->physical_bytes(), it->second.backend->live_handles(),
      static_cast<int64_t>(it->second.pending.size()), it->second.pending_bytes,
      it->second.events_pending, it->second.events_recorded, it->second.event_syncs,
      s.stream_syncs};
  const int count = static_cast<int>(sizeof(values) / sizeof(values[0]));
  int k = 0;
  for (; k < n && k < count; ++k) out[k] = values[k];
  return k;
}

__attribute__((visibility("default"))) const char* memo_stitch_stat_names() {
  return "reserved_bytes,peak_reserved_bytes,active_bytes,peak_active_bytes,mapped_bytes,"
         "sblocks_alive,allocs,frees,exact_hits,splits,stitches,new_pblocks,sblocks_dropped,"
         "reorganisations,ooms,physical_creates,physical_releases,map_calls,map_nanoseconds,"
         "backend_physical_bytes,backend_handles,deferred_frees,deferred_bytes,events_pending,"
         "events_recorded,event_syncs,stream_syncs";
}

// Peak reserved, active and mapped bytes of `device` back to their current values
// (torch.cuda.reset_peak_memory_stats). A device with no allocator yet has no peaks to reset.
__attribute__((visibility("default"))) void memo_stitch_reset_peak(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_devices.find(device);
  if (it != g_devices.end() && it->second.alloc) it->second.alloc->reset_peaks();
}

// Release everything of `device` (blocks in use included: only when nothing uses them).
__attribute__((visibility("default"))) void memo_stitch_teardown(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_devices.find(device);
  if (it == g_devices.end()) return;
  try {
    // the blocks go anyway: their events are not waited for, only destroyed
    for (auto& kv : it->second.events) {
      ContextScope scope(kv.first.ctx);
      for (const PendingEvent& e : kv.second) driver().event_destroy(e.event);
    }
    if (it->second.alloc) it->second.alloc->teardown();
  } catch (const std::exception& e) {
    g_last_error = e.what();
  }
  g_devices.erase(it);
}

__attribute__((visibility("default"))) const char* memo_stitch_last_error() {
  return g_last_error.c_str();
}
}
