/* The shim (dlopen'ed) and libsymmalloc.so (linked) share one allocator state. */
#include "harness.h"
#include "symmalloc.h"

typedef void *(*alloc_fn)(size_t, int, void *);
typedef void (*free_fn)(void *, size_t, int, void *);

int main(int argc, char **argv) {
  CHECK(argc == 2, "usage: shared_state LIBDIR");
  char path[4096];
  snprintf(path, sizeof path, "%s/libsymmalloc_pluggable.so", argv[1]);
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  CHECK(h != NULL, "dlopen: %s", dlerror());
  alloc_fn a = (alloc_fn)dlsym(h, "malloc");
  free_fn f = (free_fn)dlsym(h, "free");
  void *p = a(1 << 16, 0, NULL);
  if (!p) {
    CHECK(!harness_host_backend(), "host allocation failed: %s", symm_last_error());
    CHECK(strstr(symm_last_error(), "SYMM_ERR_NO_DEVICE") != NULL, "expected no-device: %s",
          symm_last_error());
    printf("shared_state: no GPU: the linked library reports the shim's error (one state)\n");
    return 0;
  }
  harness_write_read(p, 1 << 16, 5);
  symm_memory_stats_t s;
  CHECK(symm_memory_stats(0, &s) == SYMM_SUCCESS, "%s", symm_last_error());
  CHECK(s.active_blocks == 1, "linked library sees %llu blocks, expected the shim's 1",
        (unsigned long long)s.active_blocks);
  symm_free(p, 1 << 16, 0, NULL); /* freed through the other door */
  CHECK(symm_last_error()[0] == 0, "%s", symm_last_error());
  f(p, 1 << 16, 0, NULL);
  CHECK(strstr(symm_last_error(), "double free") != NULL, "second free through the shim: %s",
        symm_last_error());
  printf("shared_state: one allocator state\n");
  return 0;
}
