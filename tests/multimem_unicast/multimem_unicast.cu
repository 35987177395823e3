// The multimem all-reduce's body (kernels/multimem.cuh) run on a GPU with no multicast object:
// its unicast instantiation (kernels/multimem_unicast.cuh) at N ranks, one process each (fork,
// before any CUDA call), which may share one GPU (SYMMALLOC_SHARED_GPU=1; rank r on GPU r mod
// GPUs). symmalloc supplies what the body needs from the library: the communicator, symmetric
// buffers and each rank's pointers to its peers' (symm_rendezvous, symm_peer_ptr). The signal
// pads, epoch counters and error words are this test's own, laid out as the library's
// (SymmArgs, kernels/common.cuh).
//
// Every case: fresh random inputs, every output (and a guard past the end) poisoned with NaN
// first, one launch with the production grid (src/comm/collective/shape.rs, barrier_shape) or a
// small one (the grid-stride loop), out of place (each element must be written) and in place
// (production's only form). Checked on every rank: no CUDA call failed, the kernel reported no
// error and aborted nothing, each element is the fp32 sum in rank order rounded once (bit for
// bit; the unicast operation's documented order), within a per-element bound of the float64
// reference, the guard still poisoned; and the outputs of every case hash the same on every rank.
//   ./multimem_unicast [ranks=2]     exit 0 pass, 77 skipped (no GPU, or not sm_90+), else fail
// SYMMALLOC_TEST_SEED=S repeats a run (the seed is printed).
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <symmalloc.h>

#include "multimem_unicast.cuh"

#define CHECK_CUDA(x)                                                                        \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", rank, #x, cudaGetErrorString(e_));    \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)
#define CHECK_SYMM(x)                                                                        \
  do {                                                                                       \
    if ((x) != SYMM_SUCCESS) {                                                               \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", rank, #x, symm_last_error());         \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)
#define FAIL(...)                                                                            \
  do {                                                                                       \
    std::fprintf(stderr, __VA_ARGS__);                                                       \
    return 1;                                                                                \
  } while (0)

// The unicast instantiations of the multimem body, one per element type (multimem_body's DT).
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_test_multimem_unicast_bf16(SymmArgs a) {
  multimem_body<0, UnicastOp>(a);
}
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_test_multimem_unicast_fp16(SymmArgs a) {
  multimem_body<1, UnicastOp>(a);
}
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_test_multimem_unicast_fp32(SymmArgs a) {
  multimem_body<2, UnicastOp>(a);
}

static const char* kNames[3] = {"bf16", "fp16", "fp32"};
static const size_t kGuard = 256;                  // poisoned bytes past each output
static const size_t kCtlBytes = 32 << 10;          // pads and the abort word, as the internal block's
static const size_t kMaxCount = (1 << 20) + 24;    // elements
static_assert(SYMM_ABORT_OFFSET + SYMM_CONTROL_BYTES <= kCtlBytes, "control block too small");

static size_t esize(int dt) { return dt == 2 ? 4 : 2; }

// The value `v` as dtype `dt` holds it (round to nearest even), and its bits.
static float round_to(int dt, float v) {
  if (dt == 0) return __bfloat162float(__float2bfloat16_rn(v));
  if (dt == 1) return __half2float(__float2half_rn(v));
  return v;
}
static void store(int dt, uint8_t* p, size_t i, float v) {
  if (dt == 0) {
    __nv_bfloat16 b = __float2bfloat16_rn(v);
    std::memcpy(p + 2 * i, &b, 2);
  } else if (dt == 1) {
    __half h = __float2half_rn(v);
    std::memcpy(p + 2 * i, &h, 2);
  } else {
    std::memcpy(p + 4 * i, &v, 4);
  }
}
static float load(int dt, const uint8_t* p, size_t i) {
  if (dt == 0) {
    __nv_bfloat16 b;
    std::memcpy(&b, p + 2 * i, 2);
    return __bfloat162float(b);
  }
  if (dt == 1) {
    __half h;
    std::memcpy(&h, p + 2 * i, 2);
    return __half2float(h);
  }
  float f;
  std::memcpy(&f, p + 4 * i, 4);
  return f;
}

// Rank r's element i of case c: uniform in [-4, 4), reproducible in every process.
static float input(uint64_t seed, int c, int r, size_t i) {
  uint64_t x = seed ^ ((uint64_t)c << 48) ^ ((uint64_t)(r + 1) << 40) ^ (i * 0x9E3779B97F4A7C15ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 32;
  return (float)(x >> 40) / (float)(1 << 21) - 4.f;
}

static uint64_t fnv(uint64_t h, const uint8_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

struct Case {
  int dt;
  size_t count;
  bool in_place;
  int grid;  // 0: the production grid
};

static std::vector<Case> cases(int world) {
  std::vector<Case> v;
  const size_t counts[] = {8, (size_t)24 * world - 8, 4104, kMaxCount};
  for (int dt = 0; dt < 3; ++dt) {
    for (size_t n : counts)
      for (bool ip : {false, true}) v.push_back({dt, n, ip, 0});
    v.push_back({dt, 4104, false, 3});
    v.push_back({dt, kMaxCount, true, 3});
  }
  return v;
}

// barrier_shape for Kernel::Multimem: a block of SYMM_THREADS per SYMM_THREADS items of a
// rank's slice, 1 to SYMM_MAX_BLOCKS.
static int production_grid(size_t items, int world) {
  const size_t slice = (items + world - 1) / world;
  size_t g = (slice + SYMM_THREADS - 1) / SYMM_THREADS;
  return (int)(g < 1 ? 1 : g > SYMM_MAX_BLOCKS ? SYMM_MAX_BLOCKS : g);
}

static int run(int rank, int world, const symm_unique_id_t& id, uint64_t seed, uint64_t* hashes) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("rank %d: SKIPPED: no GPU\n", rank);
    return 77;
  }
  const int device = rank % gpus;
  CHECK_CUDA(cudaSetDevice(device));
  int major = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) {
    std::printf("rank %d: SKIPPED: GPU %d is sm_%d0; the multimem body is built for sm_90 only\n", rank, device, major);
    return 77;
  }
  symm_comm_t* comm = nullptr;
  CHECK_SYMM(symm_comm_init(&comm, world, rank, device, &id));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t bytes = kMaxCount * 4 + kGuard;
  uint8_t* in = (uint8_t*)symm_malloc(bytes, device, stream);
  uint8_t* out = (uint8_t*)symm_malloc(bytes, device, stream);
  uint8_t* ctl = (uint8_t*)symm_malloc(kCtlBytes, device, stream);
  if (!in || !out || !ctl) FAIL("rank %d: symm_malloc failed: %s\n", rank, symm_last_error());
  // Pads zeroed before the rendezvous: once it returns on any rank, every rank's are.
  CHECK_CUDA(cudaMemsetAsync(ctl, 0, kCtlBytes, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_SYMM(symm_rendezvous(comm, in, bytes));
  CHECK_SYMM(symm_rendezvous(comm, out, bytes));
  CHECK_SYMM(symm_rendezvous(comm, ctl, kCtlBytes));
  SymmArgs base;
  std::memset(&base, 0, sizeof base);  // mc_out stays 0: no multicast address exists
  for (int p = 0; p < world; ++p) {
    void *pi = nullptr, *po = nullptr, *pc = nullptr;
    CHECK_SYMM(symm_peer_ptr(comm, in, p, &pi));
    CHECK_SYMM(symm_peer_ptr(comm, out, p, &po));
    CHECK_SYMM(symm_peer_ptr(comm, ctl, p, &pc));
    base.in[p] = (uint64_t)pi;
    base.out[p] = (uint64_t)po;
    base.pads[p] = (uint64_t)pc;
  }
  uint32_t *counters = nullptr, *errors = nullptr;
  CHECK_CUDA(cudaMalloc(&counters, SYMM_MAX_BLOCKS * sizeof(uint32_t)));
  CHECK_CUDA(cudaMalloc(&errors, 2 * sizeof(uint32_t)));
  // On the test's stream (non-blocking: the legacy stream's work would not order before it).
  CHECK_CUDA(cudaMemsetAsync(counters, 0, SYMM_MAX_BLOCKS * sizeof(uint32_t), stream));
  CHECK_CUDA(cudaMemsetAsync(errors, 0, 2 * sizeof(uint32_t), stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  base.counters = (uint64_t)counters;
  base.error_word = (uint64_t)errors;
  base.timeout_ns = 120ull * 1000000000ull;  // ranks sharing a GPU wait for each other's time slices
  base.rank = rank;
  base.world = world;

  std::vector<uint8_t> host(bytes), got(bytes);
  std::vector<float> mine(kMaxCount);
  std::vector<std::vector<float>> all(world, std::vector<float>(kMaxCount));
  uint64_t hash = 0xcbf29ce484222325ull;
  const std::vector<Case> cs = cases(world);
  for (int c = 0; c < (int)cs.size(); ++c) {
    const Case& k = cs[c];
    const size_t es = esize(k.dt), n = k.count, items = n * es / 16;
    const int grid = k.grid ? k.grid : production_grid(items, world);
    for (int r = 0; r < world; ++r)
      for (size_t i = 0; i < n; ++i) all[r][i] = round_to(k.dt, input(seed, c, r, i));
    std::memset(host.data(), 0xFF, bytes);  // NaN in every dtype, past the end too
    for (size_t i = 0; i < n; ++i) store(k.dt, host.data(), i, all[rank][i]);
    CHECK_CUDA(cudaMemcpyAsync(in, host.data(), bytes, cudaMemcpyHostToDevice, stream));
    if (!k.in_place) CHECK_CUDA(cudaMemsetAsync(out, 0xFF, bytes, stream));
    SymmArgs a = base;
    if (k.in_place)
      for (int p = 0; p < world; ++p) a.out[p] = a.in[p];
    a.in_place = k.in_place;
    a.count = n;
    const uint64_t d[4] = {(uint64_t)c, (uint64_t)k.dt, n, (uint64_t)k.in_place};  // equal on every rank
    a.desc = fnv(0xcbf29ce484222325ull, (const uint8_t*)d, sizeof d);
    void (*kernel)(SymmArgs) = k.dt == 0   ? symm_test_multimem_unicast_bf16
                               : k.dt == 1 ? symm_test_multimem_unicast_fp16
                                           : symm_test_multimem_unicast_fp32;
    kernel<<<grid, SYMM_THREADS, 0, stream>>>(a);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaStreamSynchronize(stream));
    uint32_t ew[2], abort_word;
    CHECK_CUDA(cudaMemcpy(ew, errors, sizeof ew, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(&abort_word, ctl + SYMM_ABORT_OFFSET, 4, cudaMemcpyDeviceToHost));
    if (ew[0] || ew[1] || abort_word)
      FAIL("rank %d case %d (%s n %zu): kernel reported error words %#x %#x, abort word %#x "
           "(code << 16 | peer + 1; kernels/symm_constants.cuh)\n",
           rank, c, kNames[k.dt], n, ew[0], ew[1], abort_word);
    CHECK_CUDA(cudaMemcpy(got.data(), k.in_place ? in : out, bytes, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    const double rel = k.dt == 0 ? 1.0 / 256 : k.dt == 1 ? 1.0 / 2048 : 0;
    for (size_t i = 0; i < n; ++i) {
      float acc = all[0][i];
      double want = all[0][i], mag = std::fabs((double)all[0][i]);
      for (int r = 1; r < world; ++r) {
        acc = acc + all[r][i];
        want += all[r][i];
        mag += std::fabs((double)all[r][i]);
      }
      const float g = load(k.dt, got.data(), i);
      uint8_t e[4];
      store(k.dt, e, 0, acc);
      if (std::memcmp(got.data() + i * es, e, es) != 0)
        FAIL("rank %d case %d (%s n %zu %s grid %d): element %zu is %g, expected %g (fp32 sum in "
             "rank order, rounded once)%s\n",
             rank, c, kNames[k.dt], n, k.in_place ? "in place" : "out of place", grid, i, g,
             round_to(k.dt, acc), std::isnan(g) ? ": never written" : "");
      const double bound = rel * std::fabs(want) + world * std::ldexp(mag, -23) + std::ldexp(1.0, -24);
      if (!(std::fabs(g - want) <= bound))
        FAIL("rank %d case %d (%s n %zu): element %zu is %g, float64 reference %.9g (bound %.3g)\n",
             rank, c, kNames[k.dt], n, i, g, want, bound);
      num += (g - want) * (g - want);
      den += want * want;
    }
    for (size_t b = n * es; b < bytes; ++b)
      if (got[b] != 0xFF)
        FAIL("rank %d case %d (%s n %zu): byte %zu past the end was overwritten\n", rank, c, kNames[k.dt], n, b);
    hash = fnv(hash, got.data(), n * es);
    if (rank == 0)
      std::printf("case %2d: %s n %7zu %-12s grid %3d: bitwise as expected, rel err %.2e\n", c, kNames[k.dt], n,
                  k.in_place ? "in place" : "out of place", grid, std::sqrt(num / (den > 0 ? den : 1)));
  }
  hashes[rank] = hash;
  std::printf("rank %d: %zu cases correct; outputs hash %016llx\n", rank, cs.size(), (unsigned long long)hash);
  CHECK_CUDA(cudaFree(counters));
  CHECK_CUDA(cudaFree(errors));
  symm_free(in, bytes, device, stream);
  symm_free(out, bytes, device, stream);
  symm_free(ctl, kCtlBytes, device, stream);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_SYMM(symm_comm_destroy(comm));
  return 0;
}

int main(int argc, char** argv) {
  const int world = argc > 1 ? std::atoi(argv[1]) : 2;
  if (world < 2 || world > SYMM_MAX_RANKS) {
    std::fprintf(stderr, "ranks: 2..%d\n", SYMM_MAX_RANKS);
    return 2;
  }
  const char* s = std::getenv("SYMMALLOC_TEST_SEED");
  const uint64_t seed = s ? std::strtoull(s, nullptr, 10)
                          : (uint64_t)std::chrono::system_clock::now().time_since_epoch().count();
  std::printf("multimem_unicast: %d ranks, seed: SYMMALLOC_TEST_SEED=%llu\n", world, (unsigned long long)seed);
  std::fflush(stdout);
  symm_unique_id_t id;  // plain random bytes: no CUDA involved
  if (symm_get_unique_id(&id) != SYMM_SUCCESS) {
    std::fprintf(stderr, "symm_get_unique_id failed: %s\n", symm_last_error());
    return 1;
  }
  // Each rank's output hash, written by its process.
  uint64_t* hashes = (uint64_t*)mmap(nullptr, SYMM_MAX_RANKS * sizeof(uint64_t), PROT_READ | PROT_WRITE,
                                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (hashes == MAP_FAILED) return 1;
  // Fork before any CUDA call: CUDA state does not survive fork.
  std::vector<pid_t> kids;
  for (int r = 1; r < world; ++r) {
    pid_t p = fork();
    if (p == 0) {
      const int rc = run(r, world, id, seed, hashes);
      std::fflush(stdout);
      _exit(rc);
    }
    kids.push_back(p);
  }
  const int rc0 = run(0, world, id, seed, hashes);
  int fails = rc0 != 0 && rc0 != 77, skips = rc0 == 77;
  for (pid_t p : kids) {
    int st = 0;
    waitpid(p, &st, 0);
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    fails += code != 0 && code != 77;
    skips += code == 77;
  }
  if (fails) {
    std::printf("multimem_unicast: FAILED on %d of %d ranks\n", fails, world);
    return 1;
  }
  if (skips) {
    std::printf("multimem_unicast: SKIPPED (see the ranks' reasons above)\n");
    return 77;
  }
  for (int r = 1; r < world; ++r)
    if (hashes[r] != hashes[0]) {
      std::printf("multimem_unicast: FAILED: rank %d's outputs hash %016llx, rank 0's %016llx\n", r,
                  (unsigned long long)hashes[r], (unsigned long long)hashes[0]);
      return 1;
    }
  std::printf("multimem_unicast: PASS: %d ranks, outputs bitwise identical on every rank (hash %016llx)\n", world,
              (unsigned long long)hashes[0]);
  return 0;
}
