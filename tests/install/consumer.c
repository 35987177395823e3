/* Built against the installed header and library: the versions agree and a call works. */
#include <stdio.h>
#include <symmalloc.h>

int main(void) {
  if (symm_version() != SYMMALLOC_VERSION_CODE) {
    fprintf(stderr, "library %d, header %d\n", symm_version(), SYMMALLOC_VERSION_CODE);
    return 1;
  }
  symm_memory_stats_t s;
  if (symm_memory_stats_sized(0, &s, sizeof s) != SYMM_SUCCESS) {
    fprintf(stderr, "stats: %s\n", symm_last_error());
    return 1;
  }
  printf("consumer: symmalloc %d.%d.%d, heap of %llu bytes\n", SYMMALLOC_VERSION_MAJOR,
         SYMMALLOC_VERSION_MINOR, SYMMALLOC_VERSION_PATCH, (unsigned long long)s.heap_bytes);
  return 0;
}
