// Standalone fuzzer of the stitching allocator on host memory (no Python, no pybind11), so that
// it can be built with AddressSanitizer and UndefinedBehaviorSanitizer:
//
//   g++ -std=c++17 -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer \
//       -Icsrc csrc/standalone/stitching_fuzz_main.cpp -o stitching_fuzz
//   ./stitching_fuzz SEED OPS [CAPACITY_BYTES [FRAG_LIMIT_BYTES [MAX_SBLOCKS]]]
//
// Runs memo_stitch::fuzz (csrc/stitching_check.h: random malloc/free/empty_cache of mixed sizes
// against an oracle of live blocks, their address ranges and physical pieces, a data pattern in
// every block, invariant and accounting checks, then everything freed and released, and a
// teardown with blocks in use) and prints one `key value` line per count. Exit status 0 when
// every error and residue count is 0 and no file descriptor was left open, 1 otherwise.
// tests/unit/memo_ext/alloc/test_stitching_allocator.py builds and runs it (marked slow).
#include <dirent.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "stitching_check.h"

namespace {

int open_fds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: %s SEED OPS [CAPACITY_BYTES [FRAG_LIMIT_BYTES [MAX_SBLOCKS]]]\n",
                 argv[0]);
    return 2;
  }
  memo_stitch::FuzzConfig c;
  c.seed = std::strtoull(argv[1], nullptr, 10);
  c.ops = std::strtoll(argv[2], nullptr, 10);
  if (argc > 3) c.capacity = std::strtoll(argv[3], nullptr, 10);
  if (argc > 4) c.frag_limit = std::strtoll(argv[4], nullptr, 10);
  if (argc > 5) c.max_sblocks = std::strtoll(argv[5], nullptr, 10);
  const int fds_before = open_fds();
  const memo_stitch::FuzzResult r = memo_stitch::fuzz(c);
  const int fds_after = open_fds();
  const int64_t errors = r.va_overlaps + r.phys_overlaps + r.data_errors + r.invariant_errors +
                         r.accounting_errors + r.shape_errors;
  const int64_t residue = r.residual_reserved + r.residual_handles + r.residual_ranges +
                          r.residual_mapped + r.teardown_handles + r.teardown_ranges +
                          r.teardown_physical;
  std::printf("ops %lld\nallocs %lld\nfrees %lld\nooms %lld\nempty_caches %lld\n",
              (long long)r.ops, (long long)r.allocs, (long long)r.frees, (long long)r.ooms,
              (long long)r.empty_caches);
  std::printf("normal_allocs %lld\nprimitive_allocs %lld\nstitched_allocs %lld\n",
              (long long)r.by_kind[0], (long long)r.by_kind[1], (long long)r.by_kind[2]);
  std::printf("stitches %lld\nsplits %lld\nreorganisations %lld\n", (long long)r.stats.stitches,
              (long long)r.stats.splits, (long long)r.stats.reorganisations);
  std::printf("errors %lld\nresidue %lld\nleaked_fds %d\nseconds %.3f\n", (long long)errors,
              (long long)residue, fds_after - fds_before, r.seconds);
  if (!r.first_error.empty()) std::printf("first_error %s\n", r.first_error.c_str());
  return errors == 0 && residue == 0 && fds_after == fds_before ? 0 : 1;
}
