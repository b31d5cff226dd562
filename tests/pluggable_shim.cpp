// The C++ side of tests/cuda_double.py's pluggable allocator: calls an alloc hook as PyTorch's
// CUDAPluggableAllocator::malloc does (torch/csrc/cuda/CUDAPluggableAllocator.cpp) and reports
// what a C++ exception thrown by the hook would become in Python.
//
// Why C++: PyTorch calls the hook from C++, where an exception the hook throws (our hooks throw
// c10::OutOfMemoryError: csrc/torch_errors.h) unwinds to the Python binding layer. ctypes cannot
// catch a C++ exception: one unwinding through it would terminate the process. So the double
// calls the hook through this function, which catches what PyTorch's binding layer catches
// (torch/csrc/Exceptions.h, CATCH_CORE_ERRORS: c10::OutOfMemoryError -> torch.OutOfMemoryError,
// any other c10::Error -> RuntimeError; CATCH_ALL_ERRORS: std::exception -> RuntimeError) and
// returns which one it was with its message; the double raises the Python exception.
// Like PyTorch, nothing here looks at the pointer the hook returns: null is passed on.
//
// Built by tests/cuda_double.py on first use, against the installed torch's c10
// (memo_ext/torch_build.py), into build/test_shims/.
#include <c10/util/Exception.h>
#include <sys/types.h>

#include <cstddef>
#include <cstring>
#include <exception>
#include <string>

namespace {

using AllocFn = void* (*)(ssize_t, int, void*);

void copy_message(const char* text, char* out, size_t capacity) {
  if (!capacity) return;
  std::strncpy(out, text, capacity - 1);
  out[capacity - 1] = '\0';
}

}  // namespace

// kind: 0 returned (the pointer, maybe null), 1 c10::OutOfMemoryError, 2 another c10::Error,
// 3 another std::exception, 4 anything else.
extern "C" __attribute__((visibility("default"))) void* memo_test_call_alloc_hook(
    void* hook, ssize_t size, int device, void* stream, int* kind, char* message,
    size_t capacity) {
  *kind = 0;
  copy_message("", message, capacity);
  try {
    return reinterpret_cast<AllocFn>(hook)(size, device, stream);
  } catch (const c10::OutOfMemoryError& e) {
    *kind = 1;
    copy_message(e.what_without_backtrace(), message, capacity);
  } catch (const c10::Error& e) {
    *kind = 2;
    copy_message(e.what_without_backtrace(), message, capacity);
  } catch (const std::exception& e) {
    *kind = 3;
    copy_message(e.what(), message, capacity);
  } catch (...) {
    *kind = 4;
    copy_message("unknown C++ exception", message, capacity);
  }
  return nullptr;
}
