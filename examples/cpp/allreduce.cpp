// All-reduce across every local GPU with symmalloc: one process per GPU (fork), the unique id
// shared through fork. Each rank fills its buffer with rank+1 and checks the sum.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "symmalloc.h"

// Every CUDA call is checked: a failure names the call and CUDA's reason, and the rank fails.
#define CUDA_CHECK(call)                                                                   \
  do {                                                                                     \
    cudaError_t err_ = (call);                                                             \
    if (err_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", rank, #call, cudaGetErrorString(err_)); \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

static int run(int rank, int world, const symm_unique_id_t& id) {
  const size_t count = 1 << 20;
  CUDA_CHECK(cudaSetDevice(rank));
  symm_comm_t* comm = nullptr;
  if (symm_comm_init(&comm, world, rank, rank, &id) != SYMM_SUCCESS) {
    std::fprintf(stderr, "rank %d: %s\n", rank, symm_last_error());
    return 1;
  }
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto* buf = static_cast<float*>(symm_malloc(count * sizeof(float), rank, stream));
  if (buf == nullptr) {
    std::fprintf(stderr, "rank %d: symm_malloc failed: %s\n", rank, symm_last_error());
    return 1;
  }
  std::vector<float> host(count, float(rank + 1));
  CUDA_CHECK(cudaMemcpyAsync(buf, host.data(), count * sizeof(float), cudaMemcpyHostToDevice, stream));
  if (symm_all_reduce(comm, buf, buf, count, SYMM_FP32, SYMM_SUM, stream) != SYMM_SUCCESS) {
    std::fprintf(stderr, "rank %d: %s\n", rank, symm_last_error());
    return 1;
  }
  CUDA_CHECK(cudaMemcpyAsync(host.data(), buf, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  const float want = world * (world + 1) / 2.0f;
  for (size_t i = 0; i < count; ++i)
    if (host[i] != want) {
      std::fprintf(stderr, "rank %d: element %zu is %f, expected %f\n", rank, i, host[i], want);
      return 1;
    }
  std::printf("rank %d: fp32 sum of %zu elements across %d GPUs correct\n", rank, count, world);
  symm_free(buf, count * sizeof(float), rank, stream);
  CUDA_CHECK(cudaStreamDestroy(stream));
  if (symm_comm_destroy(comm) != SYMM_SUCCESS) {
    std::fprintf(stderr, "rank %d: symm_comm_destroy failed: %s\n", rank, symm_last_error());
    return 1;
  }
  return 0;
}

// Counts GPUs without initialising CUDA (a process that forks must not have touched CUDA).
static int count_gpus() {
  int n = 0;
  if (DIR* d = opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

int main(int argc, char** argv) {
  int world = argc > 1 ? std::atoi(argv[1]) : count_gpus();
  if (world < 2) {
    std::fprintf(stderr, "needs two or more GPUs (found %d; pass the count as argument)\n", world);
    return 1;
  }
  if (world > 8) world = 8;
  symm_unique_id_t id;  // plain random bytes: no CUDA involved
  if (symm_get_unique_id(&id) != SYMM_SUCCESS) {
    std::fprintf(stderr, "symm_get_unique_id failed: %s\n", symm_last_error());
    return 1;
  }
  // Fork before any CUDA call in this process: CUDA state does not survive fork.
  std::vector<pid_t> kids;
  for (int r = 1; r < world; ++r) {
    pid_t p = fork();
    if (p < 0) {
      std::perror("fork");
      return 1;
    }
    if (p == 0) return run(r, world, id);
    kids.push_back(p);
  }
  int rc = run(0, world, id);
  for (size_t i = 0; i < kids.size(); ++i) {
    int st = 0;
    if (waitpid(kids[i], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      std::fprintf(stderr, "rank %zu failed (see above)\n", i + 1);
      rc = 1;
    }
  }
  return rc;
}
