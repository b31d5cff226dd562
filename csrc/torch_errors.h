// PyTorch's own errors, thrown from our CUDAPluggableAllocator hooks (the planned arena's in
// csrc/planned_arena.cpp, the stitching allocator's in csrc/cuda/stitching_cuda.cpp).
//
// Why a hook throws instead of returning nullptr: PyTorch's pluggable allocator
// (torch/csrc/cuda/CUDAPluggableAllocator.cpp) calls the alloc hook, records whatever pointer
// comes back (nullptr included) in its table of live allocations and wraps it in the tensor's
// DataPtr. It never compares the pointer with null, so a hook that answers "no memory" with
// nullptr gives the caller a tensor of N bytes at address 0: no error at the allocation, the
// first kernel that touches it faults (or, for a copy, reports an illegal address much later),
// and torch.OutOfMemoryError -- which telemetry's OOM report and every caller's recovery catch
// -- is never raised. PyTorch's own allocators report the same condition by throwing
// c10::OutOfMemoryError (TORCH_CHECK_WITH(OutOfMemoryError, ...) in CUDACachingAllocator.cpp's
// malloc and CUDAMallocAsyncAllocator.cpp's mallocAsync), and the Python binding layer
// (torch/csrc/Exceptions.h, CATCH_CORE_ERRORS) turns exactly that C++ type into
// torch.OutOfMemoryError; any other c10::Error becomes a RuntimeError. The pluggable allocator
// calls the hook before taking its own lock and has no handler of its own, so an exception
// thrown by the hook reaches that layer the same way one thrown by the caching allocator does.
//
// The hooks are extern "C" functions, but they are compiled as C++ with exceptions enabled and
// called from C++ (a std::function in PyTorch): letting an exception leave them is well defined
// with the Itanium ABI that GCC and Clang use on Linux. Callers that are not C++ (ctypes) must
// not reach a throwing path: the libraries export non-throwing variants for them.
//
// Building against c10 only needs its headers (torch/include, the torch package installed in
// the build environment) and libc10.so at link time; setup.py and
// memo_ext/alloc/stitching_cuda.py pass both (memo_ext.torch_build).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace memo_torch {

// "8.00 MiB": the unit PyTorch's own message uses for the size.
inline std::string human_bytes(int64_t bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[64];
  std::snprintf(text, sizeof(text), unit ? "%.2f %s" : "%.0f %s", value, units[unit]);
  return text;
}

// c10::OutOfMemoryError (torch.OutOfMemoryError in Python). The message begins as PyTorch's
// ("CUDA out of memory. Tried to allocate ...", which log parsers such as
// megatron/memo_tools/gpu_check look for) and names the allocator, the bytes and the device.
[[noreturn]] inline void throw_out_of_memory(const std::string& allocator, int64_t bytes,
                                             int device, const std::string& detail) {
  C10_THROW_ERROR(OutOfMemoryError,
                  "CUDA out of memory. Tried to allocate " + human_bytes(bytes) + " (" +
                      std::to_string(bytes) + " bytes) on device " + std::to_string(device) +
                      " from " + allocator + ". " + detail);
}

// c10::Error (a RuntimeError in Python): a failure that is not a lack of memory.
[[noreturn]] inline void throw_error(const std::string& allocator, const std::string& what) {
  C10_THROW_ERROR(Error, allocator + ": " + what);
}

}  // namespace memo_torch
