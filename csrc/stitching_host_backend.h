// Linux host memory as a PhysicalBackend for the stitching allocator (stitching_allocator.h):
// the mechanism GMLake uses on the GPU, with host system calls in place of the CUDA driver's.
//
//   physical allocation  memfd_create + ftruncate: an anonymous file whose pages are allocated
//                        on first touch (shmem; transparent huge pages for shmem are off on the
//                        dev machine, so a touch costs one 4 KiB page)      ~ cuMemCreate
//   release of a piece   fallocate(PUNCH_HOLE): those pages go back to the kernel; the file is
//                        closed when its last piece goes                    ~ cuMemRelease
//   virtual range        mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE): address
//                        space only                                         ~ cuMemAddressReserve
//   map                  mmap(va, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_FIXED, fd, offset):
//                        the file's pages appear at va; two mappings of the same offset are two
//                        views of the same memory               ~ cuMemMap + cuMemSetAccess
//   unmap                the PROT_NONE reservation mapped back over the range  ~ cuMemUnmap
//   free range           munmap                                 ~ cuMemAddressFree
//
// Everything it holds is counted, so that tests can show that nothing leaks, and released on
// destruction. The granularity is 2 MiB, as on the GPU (a memfd could be split at 4 KiB).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "stitching_allocator.h"

namespace memo_stitch {

class HostBackend : public PhysicalBackend {
 public:
  // capacity: physical bytes this backend may hold at once (<= 0: unlimited); create() fails
  // beyond it as cuMemCreate fails on a full GPU.
  explicit HostBackend(int64_t capacity = 0) : capacity_(capacity) {}
  HostBackend(const HostBackend&) = delete;
  HostBackend& operator=(const HostBackend&) = delete;
  ~HostBackend() override {
    for (auto& kv : handles_) ::close(kv.second.fd);
    for (auto& kv : ranges_) ::munmap(reinterpret_cast<void*>(kv.first), kv.second);
  }

  int64_t granularity() const override { return kGranularity; }

  int64_t create(int64_t bytes) override {
    check_size(bytes, "create");
    if (capacity_ > 0 && physical_bytes_ + bytes > capacity_) return -1;
    const int fd = ::memfd_create("memo-stitch", MFD_CLOEXEC);
    if (fd < 0) {
      last_error_ = std::string("memfd_create: ") + std::strerror(errno);
      return -1;
    }
    if (::ftruncate(fd, bytes) != 0) {
      last_error_ = std::string("ftruncate: ") + std::strerror(errno);
      ::close(fd);
      return -1;
    }
    const int64_t h = next_handle_++;
    handles_[h] = Handle{fd, bytes, bytes};
    physical_bytes_ += bytes;
    peak_physical_bytes_ = std::max(peak_physical_bytes_, physical_bytes_);
    ++creates_;
    return h;
  }

  void release(int64_t h, int64_t offset, int64_t bytes) override {
    check_size(bytes, "release");
    Handle& hd = handle(h, offset, bytes, "release");
    hd.live -= bytes;
    physical_bytes_ -= bytes;
    ++releases_;
    if (hd.live == 0) {
      ::close(hd.fd);
      handles_.erase(h);
      return;
    }
    if (::fallocate(hd.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, bytes) != 0) {
      throw std::runtime_error(std::string("fallocate(PUNCH_HOLE): ") + std::strerror(errno));
    }
  }

  uintptr_t reserve(int64_t bytes) override {
    check_size(bytes, "reserve");
    void* p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw std::runtime_error(std::string("mmap(PROT_NONE) of ") + std::to_string(bytes) +
                               " bytes: " + std::strerror(errno));
    }
    const auto va = reinterpret_cast<uintptr_t>(p);
    ranges_[va] = bytes;
    reserved_range_bytes_ += bytes;
    return va;
  }

  void unreserve(uintptr_t va, int64_t bytes) override {
    auto it = ranges_.find(va);
    if (it == ranges_.end() || it->second != bytes) {
      throw std::logic_error("unreserve of a range that was not reserved with that size");
    }
    ::munmap(reinterpret_cast<void*>(va), static_cast<size_t>(bytes));
    ranges_.erase(it);
    reserved_range_bytes_ -= bytes;
  }

  void map(uintptr_t va, int64_t h, int64_t offset, int64_t bytes) override {
    check_size(bytes, "map");
    Handle& hd = handle(h, offset, bytes, "map");
    void* p = ::mmap(reinterpret_cast<void*>(va), static_cast<size_t>(bytes),
                     PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, hd.fd, offset);
    if (p == MAP_FAILED) {
      throw std::runtime_error(
          std::string("mmap(MAP_FIXED|MAP_SHARED) of ") + std::to_string(bytes) +
          " bytes: " + std::strerror(errno) +
          (errno == ENOMEM ? " (too many mappings? see /proc/sys/vm/max_map_count)" : ""));
    }
    mapped_bytes_ += bytes;
    ++maps_;
  }

  void unmap(uintptr_t va, int64_t bytes) override {
    check_size(bytes, "unmap");
    void* p = ::mmap(reinterpret_cast<void*>(va), static_cast<size_t>(bytes), PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) {
      throw std::runtime_error(std::string("mmap(PROT_NONE, MAP_FIXED): ") +
                               std::strerror(errno));
    }
    mapped_bytes_ -= bytes;
    ++unmaps_;
  }

  // What it holds now: physical bytes, physical allocations (open memfds), reserved ranges
  // and their bytes, mapped bytes; and its call counts.
  int64_t physical_bytes() const { return physical_bytes_; }
  int64_t peak_physical_bytes() const { return peak_physical_bytes_; }
  int64_t live_handles() const { return static_cast<int64_t>(handles_.size()); }
  int64_t live_ranges() const { return static_cast<int64_t>(ranges_.size()); }
  int64_t reserved_range_bytes() const { return reserved_range_bytes_; }
  int64_t mapped_bytes() const { return mapped_bytes_; }
  int64_t creates() const { return creates_; }
  int64_t releases() const { return releases_; }
  int64_t maps() const { return maps_; }
  int64_t unmaps() const { return unmaps_; }
  const std::string& last_error() const { return last_error_; }

 private:
  struct Handle {
    int fd;
    int64_t size;
    int64_t live;
  };

  void check_size(int64_t bytes, const char* what) const {
    if (bytes <= 0 || bytes % kGranularity != 0) {
      throw std::logic_error(std::string(what) + ": " + std::to_string(bytes) +
                             " bytes is not a positive multiple of 2 MiB");
    }
  }

  Handle& handle(int64_t h, int64_t offset, int64_t bytes, const char* what) {
    auto it = handles_.find(h);
    if (it == handles_.end() || offset < 0 || offset % kGranularity ||
        offset + bytes > it->second.size) {
      throw std::logic_error(std::string(what) + ": no physical bytes [" +
                             std::to_string(offset) + ", +" + std::to_string(bytes) +
                             ") in handle " + std::to_string(h));
    }
    return it->second;
  }

  const int64_t capacity_;
  std::unordered_map<int64_t, Handle> handles_;
  std::unordered_map<uintptr_t, int64_t> ranges_;  // reserved va -> bytes
  int64_t next_handle_ = 0;
  int64_t physical_bytes_ = 0, peak_physical_bytes_ = 0;
  int64_t reserved_range_bytes_ = 0, mapped_bytes_ = 0;
  int64_t creates_ = 0, releases_ = 0, maps_ = 0, unmaps_ = 0;
  std::string last_error_;
};

}  // namespace memo_stitch
