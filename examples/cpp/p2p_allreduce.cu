// A one-shot all-reduce written by hand over symmalloc's symmetric memory, with the device
// helpers of <symmalloc_device.cuh>: every block tells every rank its input is ready (a signal),
// waits for theirs, sums every rank's input through peer pointers in rank order, then tells
// them it is done reading before it returns. Epochs live in device memory, so the kernel can be
// captured into a CUDA graph and replayed with no host values.
//
// Ranks are processes (fork), one per GPU or, with SYMMALLOC_SHARED_GPU=1, several sharing GPUs
// (rank r on GPU r mod GPUs). Checked against a float64 reference on fresh random data, eager and
// over graph replays. Exit code 77: no GPU (the C harness then reports the test as skipped).
//   ./p2p_allreduce [ranks=2]
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <symmalloc_device.cuh>

#define CHECK_CUDA(x)                                                                        \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "rank %d: %s: %s\n", rank, #x, cudaGetErrorString(e_));           \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)
#define CHECK_SYMM(x)                                                                        \
  do {                                                                                       \
    if ((x) != SYMM_SUCCESS) {                                                               \
      std::fprintf(stderr, "rank %d: %s: %s\n", rank, #x, symm_last_error());                \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

// Slots of block b: [2b * SYMM_MAX_RANKS, +SYMM_MAX_RANKS) "input ready from rank r", then
// the same number of "done reading, rank r". Values are 2e - 1 and 2e at epoch e: increasing,
// so no slot is ever reset.
__global__ void one_shot_sum(symm_device_comm_t d, const float *in, float *out, size_t n,
                             unsigned long long *epochs) {
  __shared__ uint64_t epoch;
  __shared__ int ok;
  if (threadIdx.x == 0) {
    epoch = epochs[blockIdx.x] + 1;
    ok = 1;
  }
  __syncthreads();
  const uint32_t ready = 2u * SYMM_MAX_RANKS * blockIdx.x, done = ready + SYMM_MAX_RANKS;
  const int p = threadIdx.x;
  if (p < d.world) symm_signal_send(d, p, ready + d.rank, 2 * epoch - 1);
  if (p < d.world && !symm_signal_wait(d, ready + p, 2 * epoch - 1)) ok = 0;
  __syncthreads();
  if (ok) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
      float acc = 0.f;
      for (int r = 0; r < d.world; ++r) acc += symm_peer(d, in, r)[i];  // rank order: same bits everywhere
      out[i] = acc;
    }
  }
  __syncthreads();  // every read of the peers' inputs before the "done" signal
  if (p < d.world) symm_signal_send(d, p, done + d.rank, 2 * epoch);
  if (p < d.world) symm_signal_wait(d, done + p, 2 * epoch);
  if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
}

static float input(int rank, int round, size_t i) {
  unsigned long long x = (i * 0x9e3779b97f4a7c15ull) ^ ((unsigned long long)rank << 40) ^ ((unsigned long long)round << 52);
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return (float)(x % 8192) / 1024.f - 4.f;
}

static int run(int rank, int world, const symm_unique_id_t &id) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("rank %d: SKIPPED: no GPU\n", rank);
    return 77;
  }
  const int device = rank % gpus;
  const size_t n = (1 << 20) + 3;
  const int blocks = 32, threads = 256;
  CHECK_CUDA(cudaSetDevice(device));
  symm_comm_t *comm = nullptr;
  CHECK_SYMM(symm_comm_init(&comm, world, rank, device, &id));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float *in = (float *)symm_malloc(n * sizeof(float), device, stream);
  float *out = (float *)symm_malloc(n * sizeof(float), device, stream);
  if (!in || !out) CHECK_SYMM(SYMM_ERR_OUT_OF_MEMORY);
  CHECK_SYMM(symm_rendezvous(comm, in, n * sizeof(float)));
  symm_device_comm_t d;
  CHECK_SYMM(symm_comm_device(comm, &d, sizeof d));
  unsigned long long *epochs;
  CHECK_CUDA(cudaMalloc(&epochs, blocks * sizeof *epochs));
  CHECK_CUDA(cudaMemset(epochs, 0, blocks * sizeof *epochs));

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  one_shot_sum<<<blocks, threads, 0, stream>>>(d, in, out, n, epochs);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  std::vector<float> host(n), got(n);
  for (int round = 0; round < 4; ++round) {  // round 0 eager, then three graph replays
    for (size_t i = 0; i < n; ++i) host[i] = input(rank, round, i);
    CHECK_CUDA(cudaMemcpyAsync(in, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream));
    CHECK_CUDA(cudaMemsetAsync(out, 0xff, n * sizeof(float), stream));  // NaN: every element must be written
    if (round == 0) {
      one_shot_sum<<<blocks, threads, 0, stream>>>(d, in, out, n, epochs);
      CHECK_CUDA(cudaGetLastError());
    } else {
      CHECK_CUDA(cudaGraphLaunch(exec, stream));
    }
    CHECK_CUDA(cudaMemcpyAsync(got.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    // The next round's input must not overwrite this one while a peer still reads it: the
    // kernel's "done" signals ensured that; a symm_barrier before the copy would too.
    double num = 0, den = 0;
    for (size_t i = 0; i < n; ++i) {
      double want = 0;
      for (int r = 0; r < world; ++r) want += input(r, round, i);
      if (!std::isfinite(got[i])) {
        std::fprintf(stderr, "rank %d round %d: element %zu not written\n", rank, round, i);
        return 1;
      }
      num += (got[i] - want) * (got[i] - want);
      den += want * want;
    }
    const double err = std::sqrt(num / den);
    if (err > 1e-6) {
      std::fprintf(stderr, "rank %d round %d: relative error %.3g\n", rank, round, err);
      return 1;
    }
  }
  // A wait that timed out would surface at this call.
  CHECK_SYMM(symm_barrier(comm, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::printf("rank %d: one-shot sum of %zu floats over %d ranks correct, eager and 3 graph replays\n", rank, n, world);
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaFree(epochs));
  symm_free(in, n * sizeof(float), device, stream);
  symm_free(out, n * sizeof(float), device, stream);
  return symm_comm_destroy(comm) == SYMM_SUCCESS ? 0 : 1;
}

int main(int argc, char **argv) {
  const int world = argc > 1 ? std::atoi(argv[1]) : 2;
  if (world < 1 || world > SYMM_MAX_RANKS) {
    std::fprintf(stderr, "ranks: 1..%d\n", SYMM_MAX_RANKS);
    return 2;
  }
  symm_unique_id_t id;  // plain random bytes: no CUDA involved
  if (symm_get_unique_id(&id) != SYMM_SUCCESS) return 1;
  // Fork before any CUDA call: CUDA state does not survive fork.
  std::vector<pid_t> kids;
  for (int r = 1; r < world; ++r) {
    pid_t p = fork();
    if (p == 0) return run(r, world, id);
    kids.push_back(p);
  }
  int rc = run(0, world, id);
  for (pid_t p : kids) {
    int st = 0;
    waitpid(p, &st, 0);
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    if (rc == 0 || rc == 77) rc = code == 0 ? rc : code;
  }
  return rc;
}
