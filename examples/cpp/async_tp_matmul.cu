// All-gather + matmul, overlapped, in C++ on symmalloc's programming model and cuBLAS: the form
// of python/symmalloc/async_tp.py's all_gather_matmul for engines that do not run Python.
//
// Every rank holds a_shard [m, K] (bf16) and b [K, N]; the result is all_gather(a_shard) @ b,
// [world * m, N]. Per call, on the caller's stream S and a side stream C:
//   1. symm_barrier on S: every peer finished reading its workspace in the previous call;
//   2. C: symm_put of the shard into every peer's workspace block `rank` (copy engine, no SM),
//      then symm_signal of that peer's slot SLOT0 + rank to 1;
//   3. S: the local block's GEMM, then per peer p in ring order: symm_wait (slot SLOT0 + p >= 1),
//      the slot reset to 0 (the next call's barrier orders it before any new raise, so a graph
//      replays with the same values), the GEMM of block p;
//   4. S waits for C.
// Checked against a float64 reference on fresh random data over 3 calls and 3 replays of a
// captured graph. Ranks are processes (fork); several share a GPU with SYMMALLOC_SHARED_GPU=1.
// Built by the C harness where nvcc and cuBLAS are found. Exit code 77: no GPU.
//   ./async_tp_matmul [ranks=2]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <symmalloc.h>

#define CHECK(cond, what)                                                        \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", rank, #what, what_err()); \
      return 1;                                                                  \
    }                                                                            \
  } while (0)
#define CUDA(x) CHECK((x) == cudaSuccess, x)
#define SYMM(x) CHECK((x) == SYMM_SUCCESS, x)
#define BLAS(x) CHECK((x) == CUBLAS_STATUS_SUCCESS, x)

static const char *what_err() {
  const cudaError_t e = cudaPeekAtLastError();
  return e != cudaSuccess ? cudaGetErrorString(e) : symm_last_error();
}

static const uint32_t SLOT0 = 64;  // slots SLOT0 .. SLOT0 + world - 1: "block p arrived"
static const int M_PER_RANK = 96, K = 256, N = 192;

static float value(int rank, int round, size_t i, int salt) {
  unsigned long long x = (i * 0x9e3779b97f4a7c15ull) ^ ((unsigned long long)(rank + 16 * salt) << 40) ^
                         ((unsigned long long)round << 52);
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return __bfloat162float(__float2bfloat16((float)(x % 4096) / 1024.f - 2.f));
}

// One call of the pipeline (eager or under capture): ws is [world, m, K], out [world, m, N],
// row-major; cuBLAS is column-major, so block p computes out_p^T = b^T a_p^T.
static int all_gather_matmul(int rank, int world, symm_comm_t *comm, cublasHandle_t blas, cudaStream_t s,
                             cudaStream_t c, cudaEvent_t fork, cudaEvent_t join, const __nv_bfloat16 *a_shard,
                             const __nv_bfloat16 *b, __nv_bfloat16 *ws, __nv_bfloat16 *out) {
  const size_t block = (size_t)M_PER_RANK * K;
  const float one = 1.f, zero = 0.f;
  SYMM(symm_barrier(comm, s));
  CUDA(cudaEventRecord(fork, s));
  CUDA(cudaStreamWaitEvent(c, fork, 0));
  for (int i = 1; i < world; ++i) {
    const int p = (rank + i) % world;
    SYMM(symm_put(comm, p, ws + rank * block, a_shard, block * sizeof *a_shard, c));
    SYMM(symm_signal(comm, p, SLOT0 + rank, 1, c));
  }
  CUDA(cudaEventRecord(join, c));
  for (int i = 0; i < world; ++i) {
    const int p = (rank + i) % world;
    const __nv_bfloat16 *a_p = p == rank ? a_shard : ws + p * block;
    if (p != rank) {
      SYMM(symm_wait(comm, SLOT0 + p, 1, s));
      SYMM(symm_signal(comm, rank, SLOT0 + p, 0, s));
    }
    BLAS(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, N, M_PER_RANK, K, &one, b, CUDA_R_16BF, N, a_p, CUDA_R_16BF, K,
                      &zero, out + (size_t)p * M_PER_RANK * N, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT));
  }
  CUDA(cudaStreamWaitEvent(s, join, 0));
  return 0;
}

static int run(int rank, int world, const symm_unique_id_t &id) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("rank %d: SKIPPED: no GPU\n", rank);
    return 77;
  }
  const int device = rank % gpus;
  const size_t block = (size_t)M_PER_RANK * K, rows = (size_t)world * M_PER_RANK;
  CUDA(cudaSetDevice(device));
  symm_comm_t *comm = nullptr;
  SYMM(symm_comm_init(&comm, world, rank, device, &id));
  cudaStream_t s, c;
  cudaEvent_t fork, join;
  CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
  CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CUDA(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  cublasHandle_t blas;
  BLAS(cublasCreate(&blas));
  BLAS(cublasSetStream(blas, s));
  auto *ws = (__nv_bfloat16 *)symm_malloc(world * block * 2, device, s);
  CHECK(ws != nullptr, symm_malloc);
  SYMM(symm_rendezvous(comm, ws, world * block * 2));
  __nv_bfloat16 *a_shard, *b, *out;
  CUDA(cudaMalloc(&a_shard, block * 2));
  CUDA(cudaMalloc(&b, (size_t)K * N * 2));
  CUDA(cudaMalloc(&out, rows * N * 2));

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<__nv_bfloat16> ha(block), hb((size_t)K * N), got(rows * N);
  for (int round = 0; round < 6; ++round) {  // 3 eager calls, then 3 replays of a captured call
    for (size_t i = 0; i < block; ++i) ha[i] = __float2bfloat16(value(rank, round, i, 0));
    for (size_t i = 0; i < hb.size(); ++i) hb[i] = __float2bfloat16(value(0, round, i, 1) / 16.f);
    CUDA(cudaMemcpyAsync(a_shard, ha.data(), block * 2, cudaMemcpyHostToDevice, s));
    CUDA(cudaMemcpyAsync(b, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice, s));
    CUDA(cudaMemsetAsync(out, 0xff, rows * N * 2, s));  // NaN: every element must be written
    if (round < 3) {
      if (all_gather_matmul(rank, world, comm, blas, s, c, fork, join, a_shard, b, ws, out)) return 1;
    } else {
      if (!exec) {
        CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        if (all_gather_matmul(rank, world, comm, blas, s, c, fork, join, a_shard, b, ws, out)) return 1;
        CUDA(cudaStreamEndCapture(s, &graph));
        CUDA(cudaGraphInstantiate(&exec, graph, 0));
      }
      CUDA(cudaGraphLaunch(exec, s));
    }
    CUDA(cudaMemcpyAsync(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost, s));
    CUDA(cudaStreamSynchronize(s));
    double worst = 0, scale = 0;
    for (size_t row = 0; row < rows; ++row) {
      const int p = (int)(row / M_PER_RANK);
      const size_t r = row % M_PER_RANK;
      for (int j = 0; j < N; ++j) {
        double want = 0;
        for (int k = 0; k < K; ++k) want += (double)value(p, round, r * K + k, 0) * (value(0, round, (size_t)k * N + j, 1) / 16.f);
        const double g = __bfloat162float(got[row * N + j]);
        if (!std::isfinite(g)) {
          std::fprintf(stderr, "rank %d round %d: element [%zu, %d] not written\n", rank, round, row, j);
          return 1;
        }
        worst = std::fmax(worst, std::fabs(g - want));
        scale = std::fmax(scale, std::fabs(want));
      }
    }
    if (worst > 2 * scale / 128) {
      std::fprintf(stderr, "rank %d round %d: max error %.3g for values up to %.3g\n", rank, round, worst, scale);
      return 1;
    }
  }
  SYMM(symm_barrier(comm, s));  // a timed-out wait would surface here
  CUDA(cudaStreamSynchronize(s));
  std::printf("rank %d: all-gather + matmul [%zu, %d] x [%d, %d] over %d ranks correct, 3 eager calls and 3 graph replays\n",
              rank, rows, K, K, N, world);
  CUDA(cudaGraphExecDestroy(exec));
  CUDA(cudaGraphDestroy(graph));
  BLAS(cublasDestroy(blas));
  CUDA(cudaFree(a_shard));
  CUDA(cudaFree(b));
  CUDA(cudaFree(out));
  symm_free(ws, world * block * 2, device, s);
  return symm_comm_destroy(comm) == SYMM_SUCCESS ? 0 : 1;
}

int main(int argc, char **argv) {
  const int world = argc > 1 ? std::atoi(argv[1]) : 2;
  if (world < 1 || world > SYMM_MAX_RANKS) {
    std::fprintf(stderr, "ranks: 1..%d\n", SYMM_MAX_RANKS);
    return 2;
  }
  symm_unique_id_t id;
  if (symm_get_unique_id(&id) != SYMM_SUCCESS) return 1;
  std::vector<pid_t> kids;  // fork before any CUDA call: CUDA state does not survive fork
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
