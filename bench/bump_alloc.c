/* The floor of a pluggable allocator, built only for bench/torch_global.py: a bump pointer over
 * one region taken from the driver at the first call, and a free that does nothing. What torch
 * costs around any CUDAPluggableAllocator (its wrapper, the metadata map, the dlopen'ed call)
 * is what this allocator costs; a real one cannot go under it.
 *
 *   cc -O2 -shared -fPIC bench/bump_alloc.c -o libbump_alloc.so -ldl
 *
 * Not an allocator to use: memory is handed out again once the region wraps (16 GiB), live or
 * not, which is fine for timing and wrong for anything else. Exports bump_malloc / bump_free with
 * PyTorch's pluggable signatures. Load with dlopen only (CUDAPluggableAllocator does). */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef int (*mem_alloc_fn)(unsigned long long *, size_t);
static const size_t REGION = (size_t)16 << 30;
static unsigned long long base;
static _Atomic size_t next;

static int take_region(void) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  mem_alloc_fn alloc = cuda ? (mem_alloc_fn)dlsym(cuda, "cuMemAlloc_v2") : NULL;
  if (!alloc || alloc(&base, REGION) != 0) {
    fprintf(stderr, "bump_alloc: could not take %zu bytes from the driver\n", REGION);
    return -1;
  }
  return 0;
}

void *bump_malloc(size_t size, int device, void *stream) {
  (void)device;
  (void)stream;
  if (!base && take_region() != 0) return NULL;
  size_t bytes = (size + 511) & ~(size_t)511;
  if (bytes > REGION) return NULL;
  size_t at = atomic_fetch_add(&next, bytes) % REGION;
  if (at + bytes > REGION) at = 0;
  return (void *)(uintptr_t)(base + at);
}

void bump_free(void *ptr, size_t size, int device, void *stream) {
  (void)ptr;
  (void)size;
  (void)device;
  (void)stream;
}
