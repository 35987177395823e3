/* The floors of a pluggable allocator, built only for bench/torch_global.py. What torch costs
 * around any CUDAPluggableAllocator (its wrapper, the metadata map, the dlopen'ed call) is what
 * these allocators cost; a real one cannot go under them.
 *
 *   cc -O2 -shared -fPIC bench/bump_alloc.c -o libbump_alloc.so -ldl
 *
 * bump_malloc / bump_free (mode floor): a bump pointer over one region taken from the driver at
 * the first call, and a free that does nothing. Memory is handed out again once the region wraps
 * (16 GiB), live or not: fine for the per-pair rows, wrong for a training step (PyTorch's
 * pluggable wrapper refuses an address handed out twice).
 *
 * reuse_malloc / reuse_free (mode floor-reuse): the floor for a training step, whose shapes
 * repeat: a freed block goes on a stack for its exact size (512-byte rounded, no streams, no
 * splitting, no merging, nothing ever given back), the next request of that size pops it, and
 * only a size with nothing on its stack takes new memory from the same region (never wrapping:
 * NULL once it is used up). One spin lock, as PyTorch's allocator has one mutex. The recorded
 * ResNet-50 step (bench/NOTES.md) needs 4.3 GiB of it over 5 steps, in 58 sizes.
 *
 * Not allocators to use. PyTorch's pluggable signatures; load with dlopen only
 * (CUDAPluggableAllocator does). */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

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

/* ---- reuse_malloc / reuse_free ---- */

#define BINS 4096 /* distinct sizes, open addressing; a step has tens */
struct bin {
  size_t size; /* 0: an empty slot */
  size_t n, cap;
  unsigned long long *ptrs;
};
static struct bin bins[BINS];
static atomic_flag lock = ATOMIC_FLAG_INIT;
static size_t used; /* reuse's bump offset, under the lock */

static void acquire(void) {
  while (atomic_flag_test_and_set_explicit(&lock, memory_order_acquire)) {
  }
}
static void release(void) { atomic_flag_clear_explicit(&lock, memory_order_release); }

/* The bin of `bytes`, claimed if new; NULL when every slot holds another size. Under the lock. */
static struct bin *bin_of(size_t bytes) {
  size_t h = (size_t)(((bytes >> 9) * 0x9E3779B97F4A7C15ull) >> 40) & (BINS - 1);
  for (size_t i = 0; i < BINS; i++) {
    struct bin *b = &bins[(h + i) & (BINS - 1)];
    if (b->size == bytes) return b;
    if (b->size == 0) {
      b->size = bytes;
      return b;
    }
  }
  return NULL;
}

void *reuse_malloc(size_t size, int device, void *stream) {
  (void)device;
  (void)stream;
  size_t bytes = size ? (size + 511) & ~(size_t)511 : 512;
  unsigned long long p = 0;
  acquire();
  if (base || take_region() == 0) {
    struct bin *b = bin_of(bytes);
    if (b && b->n) {
      p = b->ptrs[--b->n];
    } else if (bytes <= REGION - used) {
      p = base + used;
      used += bytes;
    }
  }
  release();
  if (!p) fprintf(stderr, "reuse_malloc: no memory for %zu bytes (%zu of the region used)\n", size, used);
  return (void *)(uintptr_t)p;
}

void reuse_free(void *ptr, size_t size, int device, void *stream) {
  (void)device;
  (void)stream;
  if (!ptr) return;
  size_t bytes = size ? (size + 511) & ~(size_t)511 : 512;
  acquire();
  struct bin *b = bin_of(bytes);
  if (b && b->n == b->cap) {
    size_t cap = b->cap ? 2 * b->cap : 64;
    unsigned long long *grown = realloc(b->ptrs, cap * sizeof *grown);
    if (grown) {
      b->ptrs = grown;
      b->cap = cap;
    }
  }
  if (b && b->n < b->cap) b->ptrs[b->n++] = (unsigned long long)(uintptr_t)ptr;
  /* else: the block is lost to the floor (no slot or no host memory), never handed out twice */
  release();
}
