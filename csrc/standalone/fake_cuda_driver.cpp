// A stand-in for the CUDA driver's virtual memory, event and context calls, on host memory, for
// testing csrc/cuda/stitching_cuda.cpp on a machine without a GPU. It is NOT a CUDA driver: it
// implements only the eighteen entry points that backend loads (MEMO_STITCH_CUDA_DRIVER points
// at this library), memory with host memfd/mmap, and it enforces the rules the CUDA
// documentation states for them, so that a backend that breaks one fails here:
//   - cuMemCreate sizes and every cuMemMap/cuMemUnmap/cuMemAddressReserve address and size are
//     multiples of the granularity (2 MiB);
//   - cuMemMap: offset 0 and the handle's whole size ("currently must be zero"), into a reserved
//     range, onto addresses that are not mapped;
//   - cuMemSetAccess: only over mapped addresses;
//   - cuMemUnmap: the range consists of whole mappings ("cannot unmap a sub-range");
//   - cuMemAddressFree: the exact reserved range, with nothing mapped in it;
//   - cuMemRelease: a live handle; its memory goes when it is also unmapped everywhere.
//   - cuEventCreate: a context is current (the event belongs to it); flags are
//     CU_EVENT_DISABLE_TIMING (the backend's own rule: its events order frees, timing them costs);
//   - cuEventRecord: a live event and a stream of the event's context ("must be from the same
//     context"); the NULL stream and CU_STREAM_LEGACY mean the current context's;
//   - cuEventQuery / cuEventSynchronize / cuEventDestroy: a live event (never a destroyed one);
//   - cuStreamGetCtx and cuStreamSynchronize on the NULL/legacy stream, and cuCtxPopCurrent: a
//     context is current.
// cuStreamSynchronize completes the events recorded on the stream (the host waited for it).
// Every cuStreamSynchronize, cuMemUnmap and cuMemRelease is logged in call order
// (fake_cuda_call_log), so a test can check that memory a stream used is unmapped only after
// that stream was synchronized: nothing here runs kernels, so an unmap too early cannot fault.
// One device, one context (the primary), current from the start as in a thread that has used
// CUDA; fake_cuda_set_current_context(0) pops it, as in a thread that never did. Streams are any
// other handle, all of that context. The GPU's progress is the test's: a recorded event stays
// not ready (cuEventQuery: CUDA_ERROR_NOT_READY) until fake_cuda_complete_events() completes it
// or cuEventSynchronize waits for it.
// FAKE_CUDA_CAPACITY (bytes) makes cuMemCreate fail with CUDA_ERROR_OUT_OF_MEMORY beyond it.
// fake_cuda_counts() / fake_cuda_event_counts() report what is held, for leak checks.
// Single-threaded use only.
//
//   g++ -std=c++17 -O2 -shared -fPIC -I$CUDA_HOME/include fake_cuda_driver.cpp -o libfakecuda.so
#include <cuda.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <utility>
#include <vector>

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

// The one context: a fake handle the backend only passes back.
CUcontext const kPrimary = reinterpret_cast<CUcontext>(uintptr_t{0xC0DE});
std::vector<CUcontext> g_context_stack{kPrimary};

struct Event {
  CUcontext ctx;
  CUstream stream;  // where it was last recorded
  bool pending;     // recorded and not completed
};
std::map<uintptr_t, Event> g_events;  // live events; handles are never reused
uintptr_t g_next_event = 1;
long long g_events_created = 0, g_event_syncs = 0;

// The ordered log of the calls fake_cuda_call_log reports: (kind, value).
enum : long long { kLogSync = 1, kLogUnmap = 2, kLogRelease = 3 };
std::vector<std::pair<long long, long long>> g_call_log;

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

CUcontext current() { return g_context_stack.empty() ? nullptr : g_context_stack.back(); }

bool is_null_stream(CUstream s) { return s == nullptr || s == CU_STREAM_LEGACY; }

// The live event behind `e`, or nullptr (a destroyed or unknown handle: a violation).
Event* live_event(CUevent e) {
  auto it = g_events.find(reinterpret_cast<uintptr_t>(e));
  if (it == g_events.end()) {
    ++g_violations;
    return nullptr;
  }
  return &it->second;
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
  switch (error) {
    case CUDA_ERROR_OUT_OF_MEMORY: *str = "out of memory (fake driver)"; break;
    case CUDA_ERROR_NOT_READY: *str = "not ready (fake driver)"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *str = "invalid context (fake driver)"; break;
    case CUDA_ERROR_INVALID_HANDLE: *str = "invalid handle (fake driver)"; break;
    default: *str = "invalid value (fake driver)";
  }
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
  g_call_log.emplace_back(kLogRelease, static_cast<long long>(handle));
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
  g_call_log.emplace_back(kLogUnmap, static_cast<long long>(ptr));
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

CUresult cuCtxPushCurrent(CUcontext ctx) {
  if (ctx != kPrimary) return violation();
  g_context_stack.push_back(ctx);
  return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent(CUcontext* ctx) {
  if (g_context_stack.empty()) {
    ++g_violations;
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  if (ctx) *ctx = g_context_stack.back();
  g_context_stack.pop_back();
  return CUDA_SUCCESS;
}

CUresult cuStreamGetCtx(CUstream stream, CUcontext* ctx) {
  if (!ctx) return violation();
  if (is_null_stream(stream) && !current()) {
    ++g_violations;
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  *ctx = kPrimary;
  return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream stream) {
  if (is_null_stream(stream) && !current()) {
    ++g_violations;
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  g_call_log.emplace_back(kLogSync, static_cast<long long>(reinterpret_cast<uintptr_t>(stream)));
  for (auto& kv : g_events) {
    if (kv.second.stream == stream) kv.second.pending = false;
  }
  return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  if (!event || flags != CU_EVENT_DISABLE_TIMING) return violation();
  if (!current()) {
    ++g_violations;
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  const uintptr_t h = g_next_event++;
  g_events[h] = Event{current(), nullptr, false};
  *event = reinterpret_cast<CUevent>(h);
  ++g_events_created;
  return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent event, CUstream stream) {
  Event* e = live_event(event);
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  const CUcontext stream_ctx = is_null_stream(stream) ? current() : kPrimary;
  if (stream_ctx != e->ctx) {
    ++g_violations;
    return CUDA_ERROR_INVALID_HANDLE;
  }
  e->stream = stream;
  e->pending = true;
  return CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent event) {
  Event* e = live_event(event);
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  return e->pending ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent event) {
  Event* e = live_event(event);
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  e->pending = false;  // the host waited until the device got there
  ++g_event_syncs;
  return CUDA_SUCCESS;
}

// Legal on a pending event (its resources go once it completes).
CUresult cuEventDestroy(CUevent event) {
  if (!live_event(event)) return CUDA_ERROR_INVALID_HANDLE;
  g_events.erase(reinterpret_cast<uintptr_t>(event));
  return CUDA_SUCCESS;
}

// The device reaches every event recorded on `stream` (all streams when all_streams != 0).
__attribute__((visibility("default"))) void fake_cuda_complete_events(CUstream stream,
                                                                     int all_streams) {
  for (auto& kv : g_events) {
    if (all_streams || kv.second.stream == stream) kv.second.pending = false;
  }
}

// present != 0: the primary context is the current one (and the only one on the stack);
// 0: no context is current.
__attribute__((visibility("default"))) void fake_cuda_set_current_context(int present) {
  g_context_stack.clear();
  if (present) g_context_stack.push_back(kPrimary);
}

// out: live events, of which pending, events created, cuEventSynchronize calls, contexts on the
// stack.
__attribute__((visibility("default"))) void fake_cuda_event_counts(long long* out) {
  long long pending = 0;
  for (const auto& kv : g_events) pending += kv.second.pending ? 1 : 0;
  out[0] = static_cast<long long>(g_events.size());
  out[1] = pending;
  out[2] = g_events_created;
  out[3] = g_event_syncs;
  out[4] = static_cast<long long>(g_context_stack.size());
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

extern "C" {
// Up to `max` entries of the call log into out[2 * i], out[2 * i + 1] as (kind, value): kind 1
// cuStreamSynchronize (value: the stream), 2 cuMemUnmap (the address), 3 cuMemRelease (the
// handle). Returns the log's length; fake_cuda_clear_call_log() empties it.
__attribute__((visibility("default"))) long long fake_cuda_call_log(long long* out,
                                                                   long long max) {
  const long long n = static_cast<long long>(g_call_log.size());
  for (long long i = 0; i < n && i < max; ++i) {
    out[2 * i] = g_call_log[i].first;
    out[2 * i + 1] = g_call_log[i].second;
  }
  return n;
}

__attribute__((visibility("default"))) void fake_cuda_clear_call_log() { g_call_log.clear(); }
}
