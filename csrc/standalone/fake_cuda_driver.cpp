// A stand-in for the CUDA driver's virtual memory calls, on host memory, for testing
// csrc/cuda/stitching_cuda.cpp on a machine without a GPU. It is NOT a CUDA driver: it implements
// only the nine entry points that backend loads (MEMO_STITCH_CUDA_DRIVER points at this library),
// with host memfd/mmap, and it enforces the rules the CUDA documentation states for them, so that
// a backend that breaks one fails here:
//   - cuMemCreate sizes and every cuMemMap/cuMemUnmap/cuMemAddressReserve address and size are
//     multiples of the granularity (2 MiB);
//   - cuMemMap: offset 0 and the handle's whole size ("currently must be zero"), into a reserved
//     range, onto addresses that are not mapped;
//   - cuMemSetAccess: only over mapped addresses;
//   - cuMemUnmap: the range consists of whole mappings ("cannot unmap a sub-range");
//   - cuMemAddressFree: the exact reserved range, with nothing mapped in it;
//   - cuMemRelease: a live handle; its memory goes when it is also unmapped everywhere.
// FAKE_CUDA_CAPACITY (bytes) makes cuMemCreate fail with CUDA_ERROR_OUT_OF_MEMORY beyond it.
// fake_cuda_counts() reports what is held, for leak checks. Single-threaded use only.
//
//   g++ -std=c++17 -O2 -shared -fPIC -I$CUDA_HOME/include fake_cuda_driver.cpp -o libfakecuda.so
#include <cuda.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <map>

namespace {

constexpr size_t kGran = size_t{2} << 20;

struct Handle {
  int fd;
  size_t size;
  int mappings;
  bool released;
};
struct Mapping {
  size_t size;
  CUmemGenericAllocationHandle handle;
  bool accessible;
};

std::map<CUmemGenericAllocationHandle, Handle> g_handles;
std::map<CUdeviceptr, size_t> g_ranges;     // reserved start -> size
std::map<CUdeviceptr, Mapping> g_mappings;  // mapped start -> mapping
CUmemGenericAllocationHandle g_next = 1;
long long g_creates = 0, g_held = 0, g_violations = 0;

CUresult violation() {
  ++g_violations;
  return CUDA_ERROR_INVALID_VALUE;
}

bool aligned(size_t x) { return x % kGran == 0; }

bool inside_reservation(CUdeviceptr p, size_t size) {
  auto it = g_ranges.upper_bound(p);
  if (it == g_ranges.begin()) return false;
  --it;
  return p >= it->first && p + size <= it->first + it->second;
}

bool any_mapping_in(CUdeviceptr p, size_t size) {
  auto it = g_mappings.lower_bound(p);
  if (it != g_mappings.end() && it->first < p + size) return true;
  if (it != g_mappings.begin() && std::prev(it)->first + std::prev(it)->second.size > p) {
    return true;
  }
  return false;
}

void drop_if_dead(CUmemGenericAllocationHandle h) {
  auto it = g_handles.find(h);
  if (it != g_handles.end() && it->second.released && it->second.mappings == 0) {
    close(it->second.fd);
    g_held -= static_cast<long long>(it->second.size);
    g_handles.erase(it);
  }
}

}  // namespace

extern "C" {

CUresult cuGetErrorString(CUresult error, const char** str) {
  *str = error == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory (fake driver)"
                                           : "invalid value (fake driver)";
  return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp*,
                                       CUmemAllocationGranularity_flags) {
  *granularity = kGran;
  return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                     const CUmemAllocationProp* prop, unsigned long long flags) {
  if (!aligned(size) || size == 0 || flags != 0 || !prop ||
      prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return violation();
  }
  if (const char* cap = std::getenv("FAKE_CUDA_CAPACITY")) {
    if (g_held + static_cast<long long>(size) > std::atoll(cap)) return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *handle = g_next++;
  g_handles[*handle] = Handle{fd, size, 0, false};
  g_held += static_cast<long long>(size);
  ++g_creates;
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  auto it = g_handles.find(handle);
  if (it == g_handles.end() || it->second.released) return violation();
  it->second.released = true;
  drop_if_dead(handle);
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  if (!aligned(size) || size == 0 || flags != 0 || addr != 0 || alignment % kGran != 0) {
    return violation();
  }
  // over-reserve to honour the 2 MiB alignment, then trim
  void* p = mmap(nullptr, size + kGran, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t start = (base + kGran - 1) / kGran * kGran;
  if (start > base) munmap(p, start - base);
  if (start + size < base + size + kGran) {
    munmap(reinterpret_cast<void*>(start + size), base + size + kGran - (start + size));
  }
  *ptr = start;
  g_ranges[start] = size;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  auto it = g_ranges.find(ptr);
  if (it == g_ranges.end() || it->second != size || any_mapping_in(ptr, size)) return violation();
  munmap(reinterpret_cast<void*>(ptr), size);
  g_ranges.erase(it);
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                  CUmemGenericAllocationHandle handle, unsigned long long flags) {
  auto h = g_handles.find(handle);
  if (h == g_handles.end() || h->second.released || offset != 0 || flags != 0 ||
      size != h->second.size || !aligned(ptr) || !inside_reservation(ptr, size) ||
      any_mapping_in(ptr, size)) {
    return violation();
  }
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                 h->second.fd, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  g_mappings[ptr] = Mapping{size, handle, false};
  ++h->second.mappings;
  return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                        size_t count) {
  if (count != 1 || !desc || desc->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
    return violation();
  }
  for (CUdeviceptr p = ptr; p < ptr + size;) {  // every byte must be mapped
    auto it = g_mappings.upper_bound(p);
    if (it == g_mappings.begin()) return violation();
    --it;
    if (p >= it->first + it->second.size) return violation();
    p = it->first + it->second.size;
  }
  for (auto it = g_mappings.lower_bound(ptr); it != g_mappings.end() && it->first < ptr + size;
       ++it) {
    it->second.accessible = true;
  }
  mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE);
  return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  // whole mappings only, covering the range exactly
  CUdeviceptr p = ptr;
  auto it = g_mappings.find(ptr);
  while (p < ptr + size) {
    if (it == g_mappings.end() || it->first != p || p + it->second.size > ptr + size) {
      return violation();
    }
    p += it->second.size;
    ++it;
  }
  for (auto m = g_mappings.find(ptr); m != g_mappings.end() && m->first < ptr + size;) {
    const CUmemGenericAllocationHandle h = m->second.handle;
    m = g_mappings.erase(m);
    --g_handles[h].mappings;
    drop_if_dead(h);
  }
  mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  return CUDA_SUCCESS;
}

// out: live handles, reserved ranges, mappings, bytes held, handles created, rule violations.
__attribute__((visibility("default"))) void fake_cuda_counts(long long* out) {
  out[0] = static_cast<long long>(g_handles.size());
  out[1] = static_cast<long long>(g_ranges.size());
  out[2] = static_cast<long long>(g_mappings.size());
  out[3] = g_held;
  out[4] = g_creates;
  out[5] = g_violations;
}
}
