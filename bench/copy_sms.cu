// What a row copy reaches on a budget of SMs: the question behind the throughput dispatch's pull
// at 24 SMs (bench/NOTES.md, "The throughput pull at 24 SMs is a chain of rows per warp").
//
// Copies ROWS rows of ROW_BYTES (4,096 x 14 KiB, the prefill shape's bf16 rows: 58.7 MB read and
// 58.7 MB written) from one buffer to another on G blocks, three ways:
// - regs: a warp per row, U 16-byte vectors per lane loaded (past L1) before any is stored, as
//   kernels/moe.cu's moe_copy_row does;
// - bulk: the Hopper bulk-copy engine (cp.async.bulk), global -> shared -> global, P pipes a
//   block (one thread each), a ring of NS stages of C bytes per pipe: the shared memory, not
//   the registers, holds what is in flight.
// - sum: the throughput combine's arithmetic at one rank on copy_regs's bytes (below).
// Every configuration's output is checked against the source (a pattern of finite bf16 values)
// before it is timed. Timing: CUDA events around 50 launches after 5 warm ones, 7 repetitions:
// p50 and max per launch in µs.
//
// Build and run on a GPU machine (sm_90):
//   nvcc -O3 -arch=sm_90 -o /tmp/copy_sms bench/copy_sms.cu && /tmp/copy_sms
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.cuh"

static constexpr uint64_t ROWS = 4096, ROW_BYTES = 14336;

template <int U>
__global__ void __launch_bounds__(512, 1) copy_regs(uint8_t* dst, const uint8_t* src) {
  const int lane = threadIdx.x & 31;
  const uint64_t gw = (uint64_t)blockIdx.x * 16 + (threadIdx.x >> 5), nw = (uint64_t)gridDim.x * 16;
  const uint32_t vecs = ROW_BYTES / 16;
  for (uint64_t r = gw; r < ROWS; r += nw) {
    const uint4* s = (const uint4*)(src + r * ROW_BYTES);
    uint4* d = (uint4*)(dst + r * ROW_BYTES);
    for (uint32_t v0 = 0; v0 < vecs; v0 += 32 * U) {
      uint4 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t v = v0 + u * 32 + lane;
        if (v < vecs) x[u] = __ldcg(s + v);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t v = v0 + u * 32 + lane;
        if (v < vecs) d[v] = x[u];
      }
    }
  }
}

// The throughput combine's sum at one rank (kernels/moe_tp.cu tp_combine_body): each run's
// vectors loaded, their 8 bf16 added to fp32 zeros, rounded back to bf16 (a packed convert), stored.
// The bytes are copy_regs's; what it adds is the arithmetic between the loads and the stores.
// PIPE: the next run's vectors load before this run's arithmetic (two runs of U in registers).
__device__ __forceinline__ uint4 sum1(const uint4 x) {
  const uint32_t w4[4] = {x.x, x.y, x.z, x.w};
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float lo = 0.f, hi = 0.f;
    lo += __uint_as_float(w4[i] << 16);
    hi += __uint_as_float(w4[i] & 0xffff0000u);
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    o[i] = *(const uint32_t*)&b;
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

template <int U, bool PIPE>
__global__ void __launch_bounds__(512, 1) sum_regs(uint8_t* dst, const uint8_t* src) {
  const int lane = threadIdx.x & 31;
  const uint64_t gw = (uint64_t)blockIdx.x * 16 + (threadIdx.x >> 5), nw = (uint64_t)gridDim.x * 16;
  const uint32_t vecs = ROW_BYTES / 16;
  for (uint64_t r = gw; r < ROWS; r += nw) {
    const uint4* s = (const uint4*)(src + r * ROW_BYTES);
    uint4* d = (uint4*)(dst + r * ROW_BYTES);
    uint4 x[U], nx[U];
    if (PIPE) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t v = u * 32 + lane;
        if (v < vecs) nx[u] = __ldcg(s + v);
      }
    }
    for (uint32_t v0 = 0; v0 < vecs; v0 += 32 * U) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t v = v0 + u * 32 + lane;
        if (PIPE) {
          x[u] = nx[u];
          const uint32_t vn = v + 32 * U;
          if (vn < vecs) nx[u] = __ldcg(s + vn);
        } else if (v < vecs) {
          x[u] = __ldcg(s + v);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t v = v0 + u * 32 + lane;
        if (v < vecs) d[v] = sum1(x[u]);
      }
    }
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(phase)
        : "memory");
  }
}

// Pipe i of the grid takes chunks i, i + pipes, ...; its ring of NS stages keeps NS - 1 loads in
// flight while a stage's store reads it out.
__global__ void __launch_bounds__(32, 1) copy_bulk(uint8_t* dst, const uint8_t* src, int P, int NS, uint32_t C) {
  extern __shared__ __align__(128) uint8_t sm[];
  const int p = threadIdx.x;
  if (p >= P) return;
  uint64_t* bars = (uint64_t*)sm + p * NS;                       // P * NS barriers first
  uint8_t* ring = sm + 8 * (uint64_t)P * NS + 128 + (uint64_t)p * NS * C;  // then the rings
  ring = (uint8_t*)(((uintptr_t)ring + 127) & ~(uintptr_t)127);
  for (int s = 0; s < NS; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bars + s)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const uint64_t total = ROWS * ROW_BYTES, chunks = total / C;
  const uint64_t pipe = (uint64_t)blockIdx.x * P + p, pipes = (uint64_t)gridDim.x * P;
  const uint64_t n = pipe < chunks ? (chunks - pipe + pipes - 1) / pipes : 0;
  auto load = [&](uint64_t i) {
    const int s = (int)(i % NS);
    const uint32_t bar = smem_addr(bars + s);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(C) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(ring + (uint64_t)s * C)),
                 "l"(src + (pipe + i * pipes) * C), "r"(C), "r"(bar)
                 : "memory");
  };
  for (uint64_t i = 0; i < n && i < (uint64_t)NS; ++i) load(i);
  for (uint64_t i = 0; i < n; ++i) {
    const int s = (int)(i % NS);
    mbar_wait(smem_addr(bars + s), (uint32_t)((i / NS) & 1));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + (pipe + i * pipes) * C),
                 "r"(smem_addr(ring + (uint64_t)s * C)), "r"(C)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (i + NS < n) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(i + NS);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void fill(uint8_t* x, uint64_t n, uint32_t salt) {
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
  {
    // Little-endian bf16 pairs whose high byte keeps them normal and finite (0x3C..0x43), so
    // the sums' round trip through fp32 gives the same bits back.
    const uint8_t h = (uint8_t)((i / ROW_BYTES) * 131 + (i % ROW_BYTES) * 7 + salt);
    x[i] = (i & 1) ? (uint8_t)(0x3C + (h & 7)) : h;
  }
}

__global__ void check(const uint8_t* a, const uint8_t* b, uint64_t n, unsigned long long* bad) {
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    if (a[i] != b[i]) atomicAdd(bad, 1ull);
}

template <typename F>
static void run(const char* name, int G, uint8_t* dst, const uint8_t* src, unsigned long long* bad, F launch) {
  const uint64_t n = ROWS * ROW_BYTES;
  fill<<<264, 512>>>(dst, n, 99);  // poison
  CHECK(cudaMemset(bad, 0, 8));
  launch();
  CHECK(cudaGetLastError());
  check<<<264, 512>>>(dst, src, n, bad);
  unsigned long long nbad = 0;
  CHECK(cudaMemcpy(&nbad, bad, 8, cudaMemcpyDeviceToHost));
  if (nbad) {
    printf("%-28s G=%3d  FAILED: %llu bytes differ\n", name, G, nbad);
    exit(1);
  }
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 5; ++i) launch();
  std::vector<float> us;
  for (int rep = 0; rep < 7; ++rep) {
    CHECK(cudaEventRecord(e0));
    for (int i = 0; i < 50; ++i) launch();
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(ms * 1000.f / 50);
  }
  std::sort(us.begin(), us.end());
  printf("%-28s G=%3d  p50 %7.2f us  max %7.2f us  %5.2f TB/s (read + write)\n", name, G, us[3], us.back(),
         2.0 * n / (us[3] * 1e-6) / 1e12);
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
}

int main() {
  const uint64_t n = ROWS * ROW_BYTES;
  uint8_t *src, *dst;
  unsigned long long* bad;
  CHECK(cudaMalloc(&src, n));
  CHECK(cudaMalloc(&dst, n));
  CHECK(cudaMalloc(&bad, 8));
  fill<<<264, 512>>>(src, n, 1);
  CHECK(cudaFuncSetAttribute(copy_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs; %llu rows of %llu bytes\n", prop.name, sms, (unsigned long long)ROWS,
         (unsigned long long)ROW_BYTES);
  for (int G : {24, 32, sms}) {
    run("regs U=4", G, dst, src, bad, [&] { copy_regs<4><<<G, 512>>>(dst, src); });
    run("regs U=8", G, dst, src, bad, [&] { copy_regs<8><<<G, 512>>>(dst, src); });
    run("regs U=16", G, dst, src, bad, [&] { copy_regs<16><<<G, 512>>>(dst, src); });
    run("sum U=8", G, dst, src, bad, [&] { sum_regs<8, false><<<G, 512>>>(dst, src); });
    run("sum U=4 pipelined", G, dst, src, bad, [&] { sum_regs<4, true><<<G, 512>>>(dst, src); });
    run("sum U=8 pipelined", G, dst, src, bad, [&] { sum_regs<8, true><<<G, 512>>>(dst, src); });
    struct Cfg {
      int P, NS;
      uint32_t C;
    };
    for (Cfg c : {Cfg{4, 2, 14336}, Cfg{8, 2, 7168}, Cfg{8, 3, 7168}, Cfg{16, 3, 3584}, Cfg{16, 2, 7168},
                  Cfg{7, 2, 14336}}) {
      const size_t smem = 8 * (size_t)c.P * c.NS + 256 + (size_t)c.P * c.NS * c.C;
      if (smem > 227 * 1024) continue;
      char name[64];
      snprintf(name, sizeof name, "bulk P=%d NS=%d C=%u", c.P, c.NS, c.C);
      run(name, G, dst, src, bad, [&] { copy_bulk<<<G, 32, smem>>>(dst, src, c.P, c.NS, c.C); });
    }
  }
  printf("copy_sms: all outputs checked\n");
  return 0;
}
