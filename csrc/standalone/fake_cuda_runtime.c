// A stand-in for the ten CUDA runtime calls the planned arena's allocator hooks make
// (csrc/cuda_runtime_subset.h), on host memory, for testing those hooks on a machine without a
// GPU. It is NOT a CUDA runtime: allocations are malloc'ed, streams and events are opaque
// handles, and nothing runs asynchronously. It keeps what a test needs to check the hooks'
// decisions: calls counted, the stream of the last malloc/free, the stream-ordered pool's
// attributes (release threshold; reserved bytes current and high, modelled as the bytes
// malloc'ed and not freed, since this pool caches nothing), and every cross-stream dependency
// (an event recorded on one stream and waited for by another), with the documented rules:
// recording or waiting on a destroyed event fails; waiting on one never recorded is a no-op.
// fake_capacity (bytes, -1: none) makes cudaMallocAsync fail with cudaErrorMemoryAllocation
// beyond it; like the runtime it then records that error as the thread's last error, which
// cudaGetLastError returns and resets (fake_last_error reads it without resetting).
//
// Tests build it as libcudart.so.<major> and load it as PyTorch loads its runtime (RTLD_LOCAL).
//   cc -shared -fPIC -O1 fake_cuda_runtime.c -o libcudart.so.13
#include <stdint.h>
#include <stdlib.h>

enum { kSuccess = 0, kErrorInvalidValue = 1, kErrorMemoryAllocation = 2,
       kErrorInvalidResourceHandle = 400 };
enum { kReleaseThreshold = 4, kReservedMemCurrent = 5, kReservedMemHigh = 6 };
enum { kMaxEvents = 1024 };

int fake_mallocs = 0, fake_frees = 0, fake_pool_device = -1, fake_pool_attribute = -1;
void* fake_last_stream = 0;       // the stream of the last cudaMallocAsync / cudaFreeAsync
uint64_t fake_release_threshold = 0;
int64_t fake_reserved = 0, fake_reserved_high = 0;
int fake_waits = 0;               // successful cudaStreamWaitEvent calls
void* fake_last_waiter = 0;       // ... the stream that waited in the last one
void* fake_last_waited_for = 0;   // ... and the stream its event was recorded on
int fake_live_events = 0;
int fake_invalid_frees = 0;       // cudaFreeAsync of an address it never handed out
int64_t fake_capacity = -1;
int fake_last_error = kSuccess;

typedef struct { int live; int recorded; void* stream; } Event;
static Event events[kMaxEvents];
typedef struct { void* ptr; size_t size; } Block;
enum { kMaxBlocks = 1 << 16 };
static Block blocks[kMaxBlocks];

static Event* event_of(void* handle) {
  intptr_t i = (intptr_t)handle - 1;
  return (i >= 0 && i < kMaxEvents && events[i].live) ? &events[i] : 0;
}

int cudaMallocAsync(void** ptr, size_t size, void* stream) {
  ++fake_mallocs;
  fake_last_stream = stream;
  if (fake_capacity >= 0 && fake_reserved + (int64_t)size > fake_capacity) {
    *ptr = 0;
    fake_last_error = kErrorMemoryAllocation;
    return kErrorMemoryAllocation;
  }
  *ptr = malloc(size ? size : 1);
  if (!*ptr) return fake_last_error = kErrorMemoryAllocation;
  int slot = 0;
  while (slot < kMaxBlocks && blocks[slot].ptr) ++slot;
  if (slot == kMaxBlocks) {  // more live blocks than this fake keeps: refuse, as out of memory
    free(*ptr);
    *ptr = 0;
    return fake_last_error = kErrorMemoryAllocation;
  }
  blocks[slot].ptr = *ptr;
  blocks[slot].size = size;
  fake_reserved += (int64_t)size;
  if (fake_reserved > fake_reserved_high) fake_reserved_high = fake_reserved;
  return kSuccess;
}

int cudaFreeAsync(void* ptr, void* stream) {
  ++fake_frees;
  fake_last_stream = stream;
  for (int i = 0; i < kMaxBlocks; ++i) {
    if (blocks[i].ptr == ptr) {
      fake_reserved -= (int64_t)blocks[i].size;
      blocks[i].ptr = 0;
      free(ptr);
      return kSuccess;
    }
  }
  // Not an address cudaMallocAsync handed out (say, one inside a block it did): the runtime
  // refuses it; freeing it here would corrupt the host heap.
  ++fake_invalid_frees;
  return fake_last_error = kErrorInvalidValue;
}

int cudaDeviceGetDefaultMemPool(void** pool, int device) {
  fake_pool_device = device;
  *pool = (void*)0x1000;
  return kSuccess;
}

int cudaMemPoolSetAttribute(void* pool, int attribute, void* value) {
  (void)pool;
  fake_pool_attribute = attribute;
  if (attribute == kReleaseThreshold) { fake_release_threshold = *(uint64_t*)value; return kSuccess; }
  // "It is illegal to set this attribute to a non-zero value" (the high-water marks).
  if (attribute == kReservedMemHigh) {
    if (*(uint64_t*)value != 0) return kErrorInvalidValue;
    fake_reserved_high = fake_reserved;
    return kSuccess;
  }
  return kErrorInvalidValue;
}

int cudaMemPoolGetAttribute(void* pool, int attribute, void* value) {
  (void)pool;
  if (attribute == kReservedMemCurrent) { *(uint64_t*)value = (uint64_t)fake_reserved; return kSuccess; }
  if (attribute == kReservedMemHigh) { *(uint64_t*)value = (uint64_t)fake_reserved_high; return kSuccess; }
  if (attribute == kReleaseThreshold) { *(uint64_t*)value = fake_release_threshold; return kSuccess; }
  return kErrorInvalidValue;
}

int cudaEventCreateWithFlags(void** event, unsigned int flags) {
  (void)flags;
  for (int i = 0; i < kMaxEvents; ++i) {
    if (!events[i].live) {
      events[i].live = 1; events[i].recorded = 0; events[i].stream = 0;
      *event = (void*)(intptr_t)(i + 1);
      ++fake_live_events;
      return kSuccess;
    }
  }
  return kErrorMemoryAllocation;
}

int cudaEventRecord(void* event, void* stream) {
  Event* e = event_of(event);
  if (!e) return kErrorInvalidResourceHandle;
  e->recorded = 1;
  e->stream = stream;
  return kSuccess;
}

int cudaStreamWaitEvent(void* stream, void* event, unsigned int flags) {
  Event* e = event_of(event);
  if (!e || flags != 0) return kErrorInvalidResourceHandle;
  if (e->recorded) {  // waiting for an event never recorded is a no-op in CUDA
    ++fake_waits;
    fake_last_waiter = stream;
    fake_last_waited_for = e->stream;
  }
  return kSuccess;
}

int cudaEventDestroy(void* event) {
  Event* e = event_of(event);
  if (!e) return kErrorInvalidResourceHandle;
  e->live = 0;
  --fake_live_events;
  return kSuccess;
}

int cudaGetLastError(void) {
  int error = fake_last_error;
  fake_last_error = kSuccess;
  return error;
}
