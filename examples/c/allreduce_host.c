/* All-reduce across two processes on host memory (the host backend): runs on any machine, with
 * no GPU. The parent makes the unique id and forks one process per rank; each fills a symmetric
 * buffer with (rank + 1) * (i % 7), all-reduces it in place and checks every element. Every call
 * is checked and a failure names it with symm_last_error().
 *
 *   cc -std=c11 -Iinclude examples/c/allreduce_host.c -Ltarget/release \
 *      -Wl,-rpath,$PWD/target/release -lsymmalloc -o allreduce_host && ./allreduce_host
 * (or, installed: cc examples/c/allreduce_host.c $(pkg-config --cflags --libs symmalloc)) */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "symmalloc.h"

enum { WORLD = 2, COUNT = 1 << 16 };

static int fail(int rank, const char *what) {
  fprintf(stderr, "rank %d: %s failed: %s\n", rank, what, symm_last_error());
  return 1;
}

static int run(int rank, const symm_unique_id_t *id) {
  symm_comm_t *comm = NULL;
  if (symm_comm_init(&comm, WORLD, rank, rank, id) != SYMM_SUCCESS) return fail(rank, "symm_comm_init");
  float *buf = symm_malloc(COUNT * sizeof(float), rank, NULL);
  if (!buf) return fail(rank, "symm_malloc");
  for (int i = 0; i < COUNT; ++i) buf[i] = (float)((rank + 1) * (i % 7)); /* host memory */
  if (symm_all_reduce(comm, buf, buf, COUNT, SYMM_FP32, SYMM_SUM, NULL) != SYMM_SUCCESS)
    return fail(rank, "symm_all_reduce");
  const int total = WORLD * (WORLD + 1) / 2;
  for (int i = 0; i < COUNT; ++i)
    if (buf[i] != (float)((i % 7) * total)) {
      fprintf(stderr, "rank %d: element %d = %g, expected %d\n", rank, i, buf[i], (i % 7) * total);
      return 1;
    }
  printf("rank %d: fp32 sum of %d elements across %d processes correct\n", rank, COUNT, WORLD);
  symm_free(buf, COUNT * sizeof(float), rank, NULL);
  if (symm_comm_destroy(comm) != SYMM_SUCCESS) return fail(rank, "symm_comm_destroy");
  return 0;
}

int main(void) {
  if (setenv("SYMMALLOC_BACKEND", "host", 1) != 0) return 1; /* before any symmalloc call */
  symm_unique_id_t id;
  if (symm_get_unique_id(&id) != SYMM_SUCCESS) return fail(-1, "symm_get_unique_id");
  fflush(stdout);
  pid_t kids[WORLD];
  for (int r = 0; r < WORLD; ++r) {
    kids[r] = fork();
    if (kids[r] < 0) {
      perror("fork");
      return 1;
    }
    if (kids[r] == 0) {
      int rc = run(r, &id);
      fflush(stdout);
      _exit(rc);
    }
  }
  int failed = 0;
  for (int r = 0; r < WORLD; ++r) {
    int st = 0;
    if (waitpid(kids[r], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "rank %d failed (see above)\n", r);
      failed = 1;
    }
  }
  if (!failed) printf("allreduce_host.c: correct on every rank\n");
  return failed;
}
