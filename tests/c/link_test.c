/* Links libsymmalloc.so through the header. Without a GPU (default backend) it checks the
 * no-device path; on a GPU or the host backend it allocates, writes, reads back and frees. */
#include "harness.h"
#include "symmalloc.h"

int main(void) {
  void *p = symm_malloc(1 << 20, 0, NULL);
  if (!p) {
    const char *e = symm_last_error();
    CHECK(!harness_host_backend(), "host backend allocation failed: %s", e);
    CHECK(strstr(e, "SYMM_ERR_NO_DEVICE") != NULL, "expected a no-device error, got: %s", e);
    symm_comm_t *comm = NULL;
    symm_unique_id_t id;
    CHECK(symm_get_unique_id(&id) == SYMM_SUCCESS, "unique id: %s", symm_last_error());
    CHECK(symm_comm_init(&comm, 1, 0, 0, &id) == SYMM_ERR_NO_DEVICE, "comm_init: %s",
          symm_last_error());
    CHECK(comm == NULL, "comm must stay NULL on failure");
    printf("link_test: no GPU: checked the no-device path (%s)\n", e);
    return 0;
  }
  harness_write_read(p, 1 << 20, 7);
  symm_memory_stats_t s;
  CHECK(symm_memory_stats(0, &s) == SYMM_SUCCESS, "stats: %s", symm_last_error());
  CHECK(s.active_blocks == 1 && s.allocated_bytes == (1 << 20), "stats %llu blocks %llu bytes",
        (unsigned long long)s.active_blocks, (unsigned long long)s.allocated_bytes);
  symm_free(p, 1 << 20, 0, NULL);
  CHECK(symm_last_error()[0] == 0, "free: %s", symm_last_error());
  symm_free(p, 1 << 20, 0, NULL);
  CHECK(strstr(symm_last_error(), "double free") != NULL, "double free not caught: %s",
        symm_last_error());
  CHECK(symm_malloc(0, 0, NULL) == NULL && symm_last_error()[0] == 0, "size 0 is not an error");
  CHECK(symm_memory_stats(0, NULL) == SYMM_ERR_INVALID_ARGUMENT, "NULL stats pointer");
  CHECK(strcmp(symm_status_string(SYMM_ERR_TIMEOUT), "SYMM_ERR_TIMEOUT: a wait exceeded SYMMALLOC_TIMEOUT_S") == 0,
        "status string");
  printf("link_test: allocated, wrote, read back and freed on the %s backend\n",
         harness_host_backend() ? "host" : "CUDA");
  return 0;
}
