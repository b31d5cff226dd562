// Compile-time check of csrc/cuda_runtime_subset.h against the CUDA toolkit's
// cuda_runtime_api.h: every runtime function the planned arena's hooks look up must have the
// signature the hooks call it with (with cudaError_t, enums and opaque handles erased to the
// plain types the header uses so that memo_ext._C builds without CUDA), and every constant
// must have the toolkit's value. Nothing here runs: tests/unit/test_cuda_sources_compile.py
// compiles it with nvcc, and a mismatch is a compile error naming the function or constant.
#include <cuda_runtime_api.h>

#include <type_traits>

#include "../cuda_runtime_subset.h"

namespace {

// The type the subset header uses for a runtime API type.
template <class T>
struct Erase {
  using type = T;
};
template <>
struct Erase<cudaError_t> {
  using type = memo_cudart::Status;
};
template <>
struct Erase<cudaMemPoolAttr> {
  using type = int;
};
// Opaque handles (cudaStream_t = CUstream_st*, ...) are void*, pointers to them void**.
template <class T>
struct Erase<T*> {
  using type = std::conditional_t<std::is_class_v<T>, void*,
                                  std::conditional_t<std::is_pointer_v<T>, void**, T*>>;
};
template <class R, class... A>
struct Erase<R (*)(A...)> {
  using type = typename Erase<R>::type (*)(typename Erase<A>::type...);
};
template <class F>
using Erased = typename Erase<F>::type;

// The toolkit must declare `fn` with exactly these CUDA parameter types (the static_cast picks
// that overload or fails), and the subset's `ours` must be that signature erased.
#define MEMO_CHECK_RUNTIME_FUNCTION(fn, ours, ...)                                      \
  static_assert(std::is_same_v<Erased<cudaError_t (*)(__VA_ARGS__)>, memo_cudart::ours>, \
                #fn " as memo_cudart::" #ours);                                          \
  [[maybe_unused]] constexpr auto declared_##fn = static_cast<cudaError_t (*)(__VA_ARGS__)>(&fn);

MEMO_CHECK_RUNTIME_FUNCTION(cudaMallocAsync, MallocAsyncFn, void**, size_t, cudaStream_t)
MEMO_CHECK_RUNTIME_FUNCTION(cudaFreeAsync, FreeAsyncFn, void*, cudaStream_t)
MEMO_CHECK_RUNTIME_FUNCTION(cudaDeviceGetDefaultMemPool, DeviceGetDefaultMemPoolFn,
                            cudaMemPool_t*, int)
MEMO_CHECK_RUNTIME_FUNCTION(cudaMemPoolSetAttribute, MemPoolSetAttributeFn, cudaMemPool_t,
                            cudaMemPoolAttr, void*)
MEMO_CHECK_RUNTIME_FUNCTION(cudaMemPoolGetAttribute, MemPoolGetAttributeFn, cudaMemPool_t,
                            cudaMemPoolAttr, void*)
MEMO_CHECK_RUNTIME_FUNCTION(cudaEventCreateWithFlags, EventCreateWithFlagsFn, cudaEvent_t*,
                            unsigned int)
MEMO_CHECK_RUNTIME_FUNCTION(cudaEventRecord, EventRecordFn, cudaEvent_t, cudaStream_t)
MEMO_CHECK_RUNTIME_FUNCTION(cudaStreamWaitEvent, StreamWaitEventFn, cudaStream_t, cudaEvent_t,
                            unsigned int)
MEMO_CHECK_RUNTIME_FUNCTION(cudaEventDestroy, EventDestroyFn, cudaEvent_t)
MEMO_CHECK_RUNTIME_FUNCTION(cudaGetLastError, GetLastErrorFn, void)

static_assert(cudaSuccess == 0, "cudaSuccess");
static_assert(memo_cudart::kMemPoolAttrReleaseThreshold == cudaMemPoolAttrReleaseThreshold,
              "cudaMemPoolAttrReleaseThreshold");
static_assert(memo_cudart::kMemPoolAttrReservedMemCurrent == cudaMemPoolAttrReservedMemCurrent,
              "cudaMemPoolAttrReservedMemCurrent");
static_assert(memo_cudart::kMemPoolAttrReservedMemHigh == cudaMemPoolAttrReservedMemHigh,
              "cudaMemPoolAttrReservedMemHigh");
static_assert(memo_cudart::kEventDisableTiming == cudaEventDisableTiming,
              "cudaEventDisableTiming");

}  // namespace
