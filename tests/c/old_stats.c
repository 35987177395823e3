/* A caller built against the first header, whose symm_memory_stats_t had ten fields: nothing
 * the library writes may land past them. The struct is followed by canary words; both stats
 * entry points must leave them intact, and sizes the library cannot serve must be refused
 * with a message naming the size. Runs on the host backend (CI) and on a GPU. */
#include "harness.h"
#include "symmalloc.h"

#include <stdint.h>

/* The v1 layout, as a program compiled against the first header declared it. */
typedef struct {
  uint64_t allocated_bytes, reserved_bytes, peak_allocated_bytes, active_blocks, segments,
      physical_creates, cache_hits, cache_misses, peer_mappings, staged_collectives;
} stats_v1_t;

#define CANARY 0x5afe5afe5afe5afeULL

struct frame {
  stats_v1_t s;
  uint64_t canary[8];
};

static void arm(struct frame *f) {
  memset(&f->s, 0xff, sizeof f->s);
  for (int i = 0; i < 8; i++) f->canary[i] = CANARY;
}

static void intact(const struct frame *f, const char *what) {
  for (int i = 0; i < 8; i++)
    CHECK(f->canary[i] == CANARY, "%s wrote past the v1 struct (canary %d = %#llx)", what, i,
          (unsigned long long)f->canary[i]);
}

int main(void) {
  CHECK(symm_version() == SYMMALLOC_VERSION_CODE, "library %d, header %d", symm_version(),
        SYMMALLOC_VERSION_CODE);
  CHECK(sizeof(stats_v1_t) == SYMM_MEMORY_STATS_V1_SIZE, "v1 size");
  CHECK(sizeof(symm_memory_stats_t) > SYMM_MEMORY_STATS_V1_SIZE, "the struct grew since v1");
  void *p = symm_malloc(4096, 0, NULL);
  if (!p) {
    CHECK(!harness_host_backend(), "host backend allocation failed: %s", symm_last_error());
    printf("old_stats: no GPU and not the host backend: checked the version only\n");
    return 0;
  }
  harness_write_read(p, 4096, 3);
  struct frame f;
  arm(&f);
  CHECK(symm_memory_stats(0, (symm_memory_stats_t *)&f.s) == SYMM_SUCCESS, "v1 call: %s",
        symm_last_error());
  intact(&f, "symm_memory_stats");
  CHECK(f.s.active_blocks == 1 && f.s.allocated_bytes >= 4096, "v1 fields: %llu blocks",
        (unsigned long long)f.s.active_blocks);

  arm(&f);
  CHECK(symm_memory_stats_sized(0, (symm_memory_stats_t *)&f.s, sizeof f.s) == SYMM_SUCCESS,
        "sized call: %s", symm_last_error());
  intact(&f, "symm_memory_stats_sized");
  CHECK(f.s.active_blocks == 1, "sized v1 fields");

  /* Sizes it cannot serve: refused, named, nothing written. */
  const size_t bad[] = {0, 8, SYMM_MEMORY_STATS_V1_SIZE - 8, SYMM_MEMORY_STATS_V1_SIZE + 4,
                        sizeof(symm_memory_stats_t) + 8};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    arm(&f);
    CHECK(symm_memory_stats_sized(0, (symm_memory_stats_t *)&f.s, bad[i]) ==
              SYMM_ERR_INVALID_ARGUMENT,
          "size %zu accepted", bad[i]);
    char want[32];
    snprintf(want, sizeof want, "size %zu ", bad[i]);
    CHECK(strstr(symm_last_error(), want) != NULL, "message does not name %zu: %s", bad[i],
          symm_last_error());
    CHECK(f.s.active_blocks == UINT64_MAX, "size %zu: a field was written", bad[i]);
    intact(&f, "a refused call");
  }

  /* A caller of this header gets every field. */
  symm_memory_stats_t full;
  memset(&full, 0xff, sizeof full);
  CHECK(symm_memory_stats_sized(0, &full, sizeof full) == SYMM_SUCCESS, "full: %s",
        symm_last_error());
  CHECK(full.heap_bytes > 0 && full.heap_bytes != UINT64_MAX, "heap_bytes %llu",
        (unsigned long long)full.heap_bytes);
  CHECK(symm_memory_stats_sized(0, NULL, sizeof full) == SYMM_ERR_INVALID_ARGUMENT, "NULL out");
  symm_free(p, 4096, 0, NULL);
  printf("old_stats: nothing written past a v1 struct; bad sizes refused (%s backend)\n",
         harness_host_backend() ? "host" : "CUDA");
  return 0;
}
