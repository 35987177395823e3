/* Shared helpers of the C harness: checks, and CUDA driver access through dlopen (so the
 * harness builds and runs on machines without CUDA). */
#ifndef SYMMALLOC_HARNESS_H
#define SYMMALLOC_HARNESS_H
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                        \
      fprintf(stderr, "\n");                                               \
      exit(1);                                                             \
    }                                                                      \
  } while (0)

static int harness_host_backend(void) {
  const char *b = getenv("SYMMALLOC_BACKEND");
  return b && strcmp(b, "host") == 0;
}

/* Minimal driver API, looked up at run time. */
typedef int (*cu_init_t)(unsigned);
typedef int (*cu_retain_t)(void **, int);
typedef int (*cu_set_t)(void *);
typedef int (*cu_h2d_t)(unsigned long long, const void *, size_t);
typedef int (*cu_d2h_t)(void *, unsigned long long, size_t);

struct harness_cuda {
  cu_h2d_t h2d;
  cu_d2h_t d2h;
};

/* Makes device 0's primary context current; returns 0 when no driver is there. */
static int harness_cuda_open(struct harness_cuda *c) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return 0;
  cu_init_t init = (cu_init_t)dlsym(h, "cuInit");
  cu_retain_t retain = (cu_retain_t)dlsym(h, "cuDevicePrimaryCtxRetain");
  cu_set_t set = (cu_set_t)dlsym(h, "cuCtxSetCurrent");
  c->h2d = (cu_h2d_t)dlsym(h, "cuMemcpyHtoD_v2");
  c->d2h = (cu_d2h_t)dlsym(h, "cuMemcpyDtoH_v2");
  void *ctx = NULL;
  if (!init || !retain || !set || !c->h2d || !c->d2h) return 0;
  if (init(0) != 0 || retain(&ctx, 0) != 0 || set(ctx) != 0) return 0;
  return 1;
}

/* Writes a pattern into device or host memory at p and reads it back. */
static void harness_write_read(void *p, size_t n, unsigned seed) {
  unsigned char *src = (unsigned char *)malloc(n), *dst = (unsigned char *)malloc(n);
  for (size_t i = 0; i < n; i++) src[i] = (unsigned char)(i * 131u + seed);
  if (harness_host_backend()) {
    memcpy(p, src, n);
    memcpy(dst, p, n);
  } else {
    struct harness_cuda c;
    CHECK(harness_cuda_open(&c), "a GPU allocation succeeded but libcuda is not usable");
    CHECK(c.h2d((unsigned long long)(size_t)p, src, n) == 0, "cuMemcpyHtoD");
    CHECK(c.d2h(dst, (unsigned long long)(size_t)p, n) == 0, "cuMemcpyDtoH");
  }
  CHECK(memcmp(src, dst, n) == 0, "read back differs from what was written");
  free(src);
  free(dst);
}
#endif
