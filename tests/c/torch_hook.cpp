/* PyTorch's begin-allocate-to-pool hook through the shim, called as PyTorch 2.11's
 * CUDAPluggableAllocator calls it: `void(int, MempoolId_t, std::function<bool(cudaStream_t)>)`,
 * the filter a real libstdc++ std::function passed by value. Checks (host backend; on the CUDA
 * backend without a GPU, the no-device path):
 *  - an allocation on the accepted stream from another thread (PyTorch's autograd thread) goes
 *    to the pool, one on another stream to the default pool;
 *  - the filter is called, and destroyed once the pool's route ends (its captures released);
 *  - a pool begun twice (two graphs sharing it) keeps its memory at the first release_pool and
 *    gives it back at the second. */
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "harness.h"
#include "symmalloc.h"

typedef void *(*alloc_fn)(size_t, int, struct CUstream_st *);
typedef void (*free_fn)(void *, size_t, int, struct CUstream_st *);
typedef void (*pool_fn)(int, unsigned long long, unsigned long long);
typedef void (*hook_fn)(int, std::pair<unsigned long long, unsigned long long>,
                        std::function<bool(struct CUstream_st *)>);
typedef const char *(*err_fn)(void);
typedef symm_status_t (*stats_fn)(int, symm_memory_stats_t *, size_t);

static struct CUstream_st *stream(unsigned long long s) { return reinterpret_cast<struct CUstream_st *>(s); }

int main(int argc, char **argv) {
  CHECK(argc == 2, "usage: torch_hook LIBDIR");
  char path[4096];
  snprintf(path, sizeof path, "%s/libsymmalloc_pluggable.so", argv[1]);
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  CHECK(h != NULL, "dlopen %s: %s", path, dlerror());
  alloc_fn a = reinterpret_cast<alloc_fn>(dlsym(h, "malloc"));
  free_fn f = reinterpret_cast<free_fn>(dlsym(h, "free"));
  hook_fn begin = reinterpret_cast<hook_fn>(dlsym(h, "begin_allocate_to_pool"));
  pool_fn end = reinterpret_cast<pool_fn>(dlsym(h, "end_pool"));
  pool_fn release = reinterpret_cast<pool_fn>(dlsym(h, "release_pool"));
  CHECK(a && f && begin && end && release, "shim lacks a symbol");

  /* Streams every backend takes: on a GPU the allocator orders frees on them (events), so
   * they must be real handles, not made-up numbers: CUDA's per-thread (0x2), null (0x0) and
   * legacy (0x1) default streams, three distinct values for the filter. */
  const unsigned long long capturing = 0x2, other = 0x0, third = 0x1;
  auto alive = std::make_shared<int>(0);  // held by the filter: counts its copies
  auto calls = std::make_shared<int>(0);
  std::function<bool(struct CUstream_st *)> filter = [alive, calls, capturing](struct CUstream_st *s) {
    ++*calls;
    return s == stream(capturing);
  };
  begin(0, {7, 9}, filter);  // a copy, as PyTorch passes its own
  const int host = harness_host_backend();
  snprintf(path, sizeof path, "%s/libsymmalloc.so", argv[1]);
  void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  CHECK(lib != NULL, "the shim did not load libsymmalloc.so from its own folder");
  err_fn last = reinterpret_cast<err_fn>(dlsym(lib, "symm_last_error"));
  stats_fn stats = reinterpret_cast<stats_fn>(dlsym(lib, "symm_memory_stats_sized"));
  CHECK(!host || last()[0] == 0, "begin_allocate_to_pool: %s", last());
  CHECK(!host || alive.use_count() == 3, "the shim should own one moved copy of the filter, has %ld", alive.use_count() - 2);

  void *in_pool = NULL, *in_default = NULL;
  std::thread autograd([&] {
    in_pool = a(4096, 0, stream(capturing));
    in_default = a(4096, 0, stream(other));
  });
  autograd.join();
  if (!in_pool) {
    CHECK(!host, "host allocation failed: %s", last());
    CHECK(alive.use_count() == 2, "a refused begin kept its filter");
    printf("torch_hook: no GPU: checked the no-device path\n");
    end(0, 7, 9);
    return 0;
  }
  CHECK(in_default != NULL, "allocation on the other stream failed: %s", last());
  CHECK(*calls >= 2, "the filter was not asked (%d calls)", *calls);
  harness_write_read(in_pool, 4096, 5);

  // A second capture into the same pool (a graph sharing it).
  begin(0, {7, 9}, filter);
  CHECK(alive.use_count() == 4, "two routes should hold a filter each, %ld do (%s)", alive.use_count() - 2, last());
  end(0, 7, 9);
  end(0, 7, 9);
  CHECK(last()[0] == 0, "end_pool: %s", last());
  CHECK(alive.use_count() == 2, "the filters were not destroyed when their routes ended (%ld left)",
        alive.use_count() - 2);

  f(in_pool, 4096, 0, stream(capturing));
  f(in_default, 4096, 0, stream(other));
  symm_memory_stats_t s0, s1, s2;
  CHECK(stats(0, &s0, sizeof s0) == SYMM_SUCCESS, "stats: %s", last());
  release(0, 7, 9);  // the first graph deleted: the other still replays into the pool
  CHECK(stats(0, &s1, sizeof s1) == SYMM_SUCCESS, "stats: %s", last());
  CHECK(s1.physical_releases == s0.physical_releases,
        "release_pool gave the pool's memory back while another graph holds it");
  release(0, 7, 9);  // the last graph deleted
  CHECK(stats(0, &s2, sizeof s2) == SYMM_SUCCESS, "stats: %s", last());
  CHECK(s2.physical_releases == s1.physical_releases + 1,
        "the pool's segment did not go back at its last release (%llu -> %llu): the other "
        "thread's allocation on the capturing stream did not go to the pool",
        (unsigned long long)s1.physical_releases, (unsigned long long)s2.physical_releases);
  CHECK(s2.reserved_bytes > 0, "the default pool's segment went with the pool");

  // A filter stored in place (PyTorch's capture filter captures one pointer).
  begin(0, {8, 1}, [third](struct CUstream_st *st) { return st == stream(third); });
  void *p3 = NULL;
  std::thread t([&] { p3 = a(4096, 0, stream(third)); });
  t.join();
  CHECK(p3 != NULL, "allocation failed: %s", last());
  end(0, 8, 1);
  f(p3, 4096, 0, stream(third));
  release(0, 8, 1);
  symm_memory_stats_t s3;
  CHECK(stats(0, &s3, sizeof s3) == SYMM_SUCCESS, "stats: %s", last());
  CHECK(s3.physical_releases == s2.physical_releases + 1, "a filter stored in place did not route");
  printf("torch_hook: the filter routes another thread's capture allocations; shared pools are counted\n");
  return 0;
}
