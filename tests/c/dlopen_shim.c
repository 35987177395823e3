/* Loads the pluggable shim exactly as PyTorch's CUDAPluggableAllocator does:
 * dlopen(path, RTLD_NOW | RTLD_LOCAL), then dlsym("malloc"), dlsym("free"), ... */
#include "harness.h"

typedef void *(*alloc_fn)(size_t, int, void *);
typedef void (*free_fn)(void *, size_t, int, void *);
typedef void (*pool_fn)(int, unsigned long long, unsigned long long);
typedef const char *(*err_fn)(void);

int main(int argc, char **argv) {
  CHECK(argc == 2, "usage: dlopen_shim LIBDIR");
  char path[4096];
  snprintf(path, sizeof path, "%s/libsymmalloc_pluggable.so", argv[1]);
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  CHECK(h != NULL, "dlopen %s: %s", path, dlerror());
  alloc_fn a = (alloc_fn)dlsym(h, "malloc");
  free_fn f = (free_fn)dlsym(h, "free");
  pool_fn begin = (pool_fn)dlsym(h, "begin_pool");
  pool_fn end = (pool_fn)dlsym(h, "end_pool");
  pool_fn release = (pool_fn)dlsym(h, "release_pool");
  CHECK(a && f && begin && end && release, "shim lacks a symbol");
  CHECK((void *)a != (void *)malloc, "dlsym(malloc) returned libc's malloc");
  begin(0, 7, 9); /* the shim loads libsymmalloc.so on its first call */
  /* The shim's library was loaded from the same folder: reach its last error. */
  snprintf(path, sizeof path, "%s/libsymmalloc.so", argv[1]);
  void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  CHECK(lib != NULL, "the shim did not load libsymmalloc.so from its own folder");
  err_fn last = (err_fn)dlsym(lib, "symm_last_error");
  void *p = a(4096, 0, NULL);
  if (!p) {
    CHECK(!harness_host_backend(), "host allocation failed: %s", last());
    CHECK(strstr(last(), "SYMM_ERR_NO_DEVICE") != NULL, "expected no-device, got %s", last());
    printf("dlopen_shim: no GPU: checked the no-device path\n");
    return 0;
  }
  end(0, 7, 9);
  CHECK(last()[0] == 0, "end_pool: %s", last());
  harness_write_read(p, 4096, 3);
  f(p, 4096, 0, NULL);
  CHECK(last()[0] == 0, "free: %s", last());
  release(0, 7, 9);
  CHECK(last()[0] == 0, "release_pool: %s", last());
  end(0, 7, 9);
  CHECK(strstr(last(), "no pool is open") != NULL, "mismatched end_pool not reported: %s", last());
  printf("dlopen_shim: malloc/free/pools through the shim work\n");
  return 0;
}
