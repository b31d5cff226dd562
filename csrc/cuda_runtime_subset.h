// The few CUDA runtime calls the planned arena's allocator hooks make, looked up at run time in
// the CUDA runtime library this process already loaded (PyTorch's), so that memo_ext._C builds
// and imports without CUDA.
//
// Why not link libcudart: memo_ext._C must build on machines without a CUDA toolkit, and a
// second copy of the runtime would keep its own context state apart from PyTorch's.
// Why not dlopen("libcudart.so.12"): the runtime's soname changes with its major version
// (CUDA 13 builds of PyTorch load libcudart.so.13, and a pip-installed runtime lives in
// site-packages/nvidia/cuda_runtime/lib, off the loader's search path), and PyTorch opens it
// with RTLD_LOCAL, so its symbols are not in the global scope either. The loaded objects are
// walked with dl_iterate_phdr instead and the first whose file name starts with
// "libcudart.so" is reopened with RTLD_NOLOAD (which never loads a second copy).
//
// csrc/cuda/check_runtime_subset.cu, compiled by nvcc in the test suite, checks every type and
// constant below against the toolkit's cuda_runtime_api.h.
#pragma once

#include <dlfcn.h>
#include <link.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace memo_cudart {

// cudaError_t is an enum with cudaSuccess == 0; cudaStream_t, cudaEvent_t and cudaMemPool_t are
// opaque pointers.
using Status = int;
using MallocAsyncFn = Status (*)(void**, size_t, void*);
using FreeAsyncFn = Status (*)(void*, void*);
using DeviceGetDefaultMemPoolFn = Status (*)(void**, int);
using MemPoolSetAttributeFn = Status (*)(void*, int, void*);
using MemPoolGetAttributeFn = Status (*)(void*, int, void*);
using EventCreateWithFlagsFn = Status (*)(void**, unsigned int);
using EventRecordFn = Status (*)(void*, void*);
using StreamWaitEventFn = Status (*)(void*, void*, unsigned int);
using EventDestroyFn = Status (*)(void*);
using GetLastErrorFn = Status (*)();

// enum cudaMemPoolAttr
constexpr int kMemPoolAttrReleaseThreshold = 4;
constexpr int kMemPoolAttrReservedMemCurrent = 5;
constexpr int kMemPoolAttrReservedMemHigh = 6;
// cudaEventDisableTiming
constexpr unsigned int kEventDisableTiming = 0x02;

inline bool is_runtime_file(const char* path) {
  const char* slash = std::strrchr(path, '/');
  const char* name = slash ? slash + 1 : path;
  return std::strncmp(name, "libcudart.so", std::strlen("libcudart.so")) == 0;
}

// The path of the CUDA runtime library loaded in this process ("" when none is).
inline std::string loaded_runtime_path() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) -> int {
        if (info->dlpi_name && is_runtime_file(info->dlpi_name)) {
          *static_cast<std::string*>(out) = info->dlpi_name;
          return 1;  // stop at the first
        }
        return 0;
      },
      &found);
  return found;
}

// `name` from the global scope (a runtime linked into the executable or loaded RTLD_GLOBAL),
// else from the loaded runtime library; nullptr when neither has it.
template <class Fn>
Fn symbol(const char* name) {
  void* found = dlsym(RTLD_DEFAULT, name);
  if (!found) {
    const std::string path = loaded_runtime_path();
    void* runtime = path.empty() ? nullptr : dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    found = runtime ? dlsym(runtime, name) : nullptr;
  }
  return reinterpret_cast<Fn>(found);
}

}  // namespace memo_cudart
