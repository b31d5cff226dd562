// The GMLake stitching allocator on a GPU: the core of csrc/stitching_allocator.h over the CUDA
// virtual memory management API, exposed as torch.cuda.memory.CUDAPluggableAllocator hooks.
//
// Built as its own shared library (not part of memo_ext._C, which must build without CUDA) by
// memo_ext/alloc/stitching_cuda.py when the CUDA toolkit headers are present:
//   g++ -std=c++17 -O3 -shared -fPIC -Icsrc -I$CUDA_HOME/include csrc/cuda/stitching_cuda.cpp
//       -o libmemo_stitching_cuda.so -ldl
// The driver entry points are looked up at run time (dlopen of libcuda.so.1, or of the library
// named by MEMO_STITCH_CUDA_DRIVER), so the library links against nothing CUDA.
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
// The normal path's segments come from the same backend (GMLake keeps cudaMalloc for it: a
// difference that changes no decision, only which API holds the bytes).
//
// Status: compiled and exercised on the CPU dev machine against a fake driver that implements
// these calls with memfd/mmap (tests/unit/test_stitching_cuda_backend.py); never run on a GPU
// in this project. tests/gpu/test_stitching_cuda.py is the GPU test (skipped without CUDA).
#include <cuda.h>
#include <dlfcn.h>
#include <sys/types.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "../stitching_allocator.h"

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
  int64_t next_ = 0;
  int64_t physical_bytes_ = 0;
};

// ---------------------------------------------------------------- one allocator per device
struct DeviceAllocator {
  std::unique_ptr<CudaBackend> backend;
  std::unique_ptr<memo_stitch::StitchingAllocator> alloc;
};

std::mutex g_mutex;
memo_stitch::Options g_options;
std::map<int, DeviceAllocator> g_devices;
std::string g_last_error;

memo_stitch::StitchingAllocator& allocator_for(int device) {
  DeviceAllocator& d = g_devices[device];
  if (!d.alloc) {
    d.backend = std::make_unique<CudaBackend>(device);
    d.alloc = std::make_unique<memo_stitch::StitchingAllocator>(*d.backend, g_options);
  }
  return *d.alloc;
}

}  // namespace

// ------------------------------------------------------------------------- exported hooks
// Signatures of torch.cuda.memory.CUDAPluggableAllocator's alloc/free functions. The stream (a
// cudaStream_t) keys the pools, as PyTorch's allocator keys its own. A failure returns nullptr
// (PyTorch raises its out-of-memory error); memo_stitch_last_error() says why.
extern "C" {

__attribute__((visibility("default"))) void* memo_stitch_malloc(ssize_t size, int device,
                                                              void* stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  try {
    const uintptr_t p = allocator_for(device).malloc(static_cast<int64_t>(size),
                                                     reinterpret_cast<int64_t>(stream));
    if (!p) g_last_error = "out of memory: " + std::to_string(size) + " bytes";
    return reinterpret_cast<void*>(p);
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return nullptr;
  }
}

__attribute__((visibility("default"))) void memo_stitch_free(void* ptr, ssize_t size, int device,
                                                           void* stream) {
  (void)size;
  (void)stream;
  if (!ptr) return;  // what a zero-byte or failed allocation handed out
  std::lock_guard<std::mutex> lock(g_mutex);
  try {
    auto it = g_devices.find(device);
    if (it == g_devices.end() || !it->second.alloc ||
        it->second.alloc->free(reinterpret_cast<uintptr_t>(ptr)) < 0) {
      g_last_error = "free of an address this allocator did not hand out";
    }
  } catch (const std::exception& e) {
    g_last_error = e.what();
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

// Drop unused stitched blocks and release free physical memory of `device`.
__attribute__((visibility("default"))) void memo_stitch_empty_cache(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  try {
    auto it = g_devices.find(device);
    if (it != g_devices.end() && it->second.alloc) it->second.alloc->release_cached();
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
      it->second.backend->physical_bytes(), it->second.backend->live_handles()};
  const int count = static_cast<int>(sizeof(values) / sizeof(values[0]));
  int k = 0;
  for (; k < n && k < count; ++k) out[k] = values[k];
  return k;
}

__attribute__((visibility("default"))) const char* memo_stitch_stat_names() {
  return "reserved_bytes,peak_reserved_bytes,active_bytes,peak_active_bytes,mapped_bytes,"
         "sblocks_alive,allocs,frees,exact_hits,splits,stitches,new_pblocks,sblocks_dropped,"
         "reorganisations,ooms,physical_creates,physical_releases,map_calls,map_nanoseconds,"
         "backend_physical_bytes,backend_handles";
}

// Release everything of `device` (blocks in use included: only when nothing uses them).
__attribute__((visibility("default"))) void memo_stitch_teardown(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_devices.find(device);
  if (it == g_devices.end()) return;
  try {
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
