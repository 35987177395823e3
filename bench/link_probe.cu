// NVLink traffic patterns between two GPUs, without symmalloc: what the large all-reduce path
// can hope for. One process drives GPUs 0 and 1 (peer access on), and each pattern runs on
// both GPUs at once, so both link directions are loaded as in an all-reduce.
//
//   read     each GPU copies the peer's buffer into its own (remote loads)
//   write    each GPU copies its buffer into the peer's (remote stores)
//   twoshot  the two-shot data flow without barriers: GPU g reads the peer's half g, adds its
//            own, stores the sum locally and into the peer (half reads, half stores)
//   push     the push-based flow without barriers: GPU g stores the peer's half into the
//            peer's scratch, then adds its own half and the scratch and stores the sum locally
//            and into the peer (stores only)
//   bulk     as write, but each block stages 16 KiB chunks in shared memory and stores them
//            with the bulk copy engine (cp.async.bulk.global.shared::cta), 4 stages deep
//   ce       cudaMemcpyPeerAsync, each GPU pushing its buffer to the peer
//   cepipe   a two-shot whose NVLink traffic is all copy-engine pushes, pipelined over C
//            chunks: copy engine A pushes the peer's half of the input into the peer's scratch,
//            the SMs add it to the local half (no remote access), copy engine B pushes each
//            summed chunk into the peer's output. Cross-GPU order comes from events (one
//            process), i.e. ideal signalling; C is the column heading.
//
// Every pattern moves N bytes into each GPU (N = 64 MiB by default); GB/s = N / time. Times are
// CUDA events around R back-to-back launches on each GPU (the larger of the two), after warm-up,
// median of 15. The data is not checked: this measures traffic, not results.
//
// Build and run (needs 2 GPUs joined by NVLink):
//   nvcc -O3 -arch=sm_90 -o link_probe bench/link_probe.cu && ./link_probe [MiB [pattern [grid threads]]]
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

#include "cuda_check.cuh"

constexpr int U = 4;

__device__ __forceinline__ uint4 add(uint4 a, uint4 b) {
  return make_uint4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// dst[i] = src[i] over n vectors, U vectors in flight per thread.
__global__ void copy(const uint4* __restrict__ src, uint4* __restrict__ dst, uint64_t n) {
  const uint64_t span = (uint64_t)gridDim.x * blockDim.x * U;
  for (uint64_t i0 = (uint64_t)blockIdx.x * blockDim.x * U + threadIdx.x; i0 < n; i0 += span) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * blockDim.x < n) v[u] = src[i0 + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * blockDim.x < n) dst[i0 + u * blockDim.x] = v[u];
  }
}

// out[i] = a[i] + b[i] over n vectors, and peer_out[i] too unless peer_out is null.
__global__ void add_store2(const uint4* __restrict__ a, const uint4* __restrict__ b,
                           uint4* __restrict__ out, uint4* __restrict__ peer_out, uint64_t n) {
  const uint64_t span = (uint64_t)gridDim.x * blockDim.x * U;
  for (uint64_t i0 = (uint64_t)blockIdx.x * blockDim.x * U + threadIdx.x; i0 < n; i0 += span) {
    uint4 v[U], w[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * blockDim.x < n) {
        v[u] = a[i0 + u * blockDim.x];
        w[u] = b[i0 + u * blockDim.x];
      }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * blockDim.x < n) {
        const uint4 s = add(v[u], w[u]);
        out[i0 + u * blockDim.x] = s;
        if (peer_out) peer_out[i0 + u * blockDim.x] = s;
      }
  }
}

constexpr int CHUNK = 16 << 10, STAGES = 4;

// dst = src in CHUNK pieces: coalesced loads into a shared-memory stage, then one bulk store of
// the stage by thread 0. A stage is refilled only after its previous bulk store has read it.
__global__ void bulk_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, uint64_t n) {
  extern __shared__ __align__(128) uint4 stage[];
  constexpr int V = CHUNK / 16;
  const uint64_t chunks = n / V;
  int it = 0;
  for (uint64_t c = blockIdx.x; c < chunks; c += gridDim.x, ++it) {
    uint4* sm = stage + (it % STAGES) * V;
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(STAGES - 1) : "memory");
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += blockDim.x) sm[i] = src[c * V + i];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      const uint32_t s = (uint32_t)__cvta_generic_to_shared(sm);
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + c * V),
                   "r"(s), "r"(CHUNK)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

constexpr int MAX_CHUNKS = 64;
struct Pipe {
  cudaStream_t sa, sb;
  cudaEvent_t fork, done_a, done_b, a[MAX_CHUNKS], r[MAX_CHUNKS];
};
static Pipe pp[2];

struct Gpu {
  int dev;
  uint4 *in, *out, *scratch;
  cudaStream_t s;
  cudaEvent_t t0, t1;
};

static Gpu g[2];
static uint64_t bytes;

enum Pattern { READ, WRITE, TWOSHOT, PUSH, BULK, CE, CEPIPE };
static const char* names[] = {"read", "write", "twoshot", "push", "bulk", "ce", "cepipe"};

static void launch(Pattern p, int me, int grid, int threads) {
  Gpu& a = g[me];
  Gpu& b = g[1 - me];
  const uint64_t n = bytes / 16, half = n / 2;
  switch (p) {
    case READ: copy<<<grid, threads, 0, a.s>>>(b.in, a.out, n); break;
    case WRITE: copy<<<grid, threads, 0, a.s>>>(a.in, b.out, n); break;
    case TWOSHOT:
      add_store2<<<grid, threads, 0, a.s>>>(a.in + me * half, b.in + me * half, a.out + me * half,
                                            b.out + me * half, half);
      break;
    case PUSH:
      copy<<<grid, threads, 0, a.s>>>(a.in + (1 - me) * half, b.scratch, half);
      add_store2<<<grid, threads, 0, a.s>>>(a.in + me * half, a.scratch, a.out + me * half,
                                            b.out + me * half, half);
      break;
    case BULK: bulk_copy<<<grid, threads, STAGES * CHUNK, a.s>>>(a.in, b.out, n); break;
    case CE: CHECK(cudaMemcpyPeerAsync(b.out, b.dev, a.in, a.dev, bytes, a.s)); break;
  }
  CHECK(cudaGetLastError());
}

// Both GPUs' work for one cepipe all-reduce, enqueued chunk by chunk so that every event waited
// on has been recorded in this round.
static void launch_cepipe(int chunks) {
  const uint64_t half = bytes / 16 / 2, cn = half / chunks;
  for (int me = 0; me < 2; ++me) {
    CHECK(cudaSetDevice(me));
    CHECK(cudaEventRecord(pp[me].fork, g[me].s));
    CHECK(cudaStreamWaitEvent(pp[me].sa, pp[me].fork, 0));
    CHECK(cudaStreamWaitEvent(pp[me].sb, pp[me].fork, 0));
    for (int c = 0; c < chunks; ++c) {
      CHECK(cudaMemcpyPeerAsync(g[1 - me].scratch + c * cn, 1 - me, g[me].in + (1 - me) * half + c * cn,
                                me, cn * 16, pp[me].sa));
      CHECK(cudaEventRecord(pp[me].a[c], pp[me].sa));
    }
    CHECK(cudaEventRecord(pp[me].done_a, pp[me].sa));
  }
  for (int c = 0; c < chunks; ++c)
    for (int me = 0; me < 2; ++me) {
      CHECK(cudaSetDevice(me));
      uint4* mine = g[me].out + me * half + c * cn;
      CHECK(cudaStreamWaitEvent(g[me].s, pp[1 - me].a[c], 0));
      add_store2<<<132, 512, 0, g[me].s>>>(g[me].in + me * half + c * cn, g[me].scratch + c * cn, mine,
                                           nullptr, cn);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(pp[me].r[c], g[me].s));
      CHECK(cudaStreamWaitEvent(pp[me].sb, pp[me].r[c], 0));
      CHECK(cudaMemcpyPeerAsync(g[1 - me].out + me * half + c * cn, 1 - me, mine, me, cn * 16, pp[me].sb));
    }
  for (int me = 0; me < 2; ++me) {
    CHECK(cudaSetDevice(me));
    CHECK(cudaEventRecord(pp[me].done_b, pp[me].sb));
  }
  for (int me = 0; me < 2; ++me) {
    CHECK(cudaSetDevice(me));
    CHECK(cudaStreamWaitEvent(g[me].s, pp[me].done_a, 0));
    CHECK(cudaStreamWaitEvent(g[me].s, pp[me].done_b, 0));
    CHECK(cudaStreamWaitEvent(g[me].s, pp[1 - me].done_b, 0));
  }
}

static void launch_both(Pattern p, int grid, int threads) {
  if (p == CEPIPE) return launch_cepipe(grid);
  for (int me = 0; me < 2; ++me) {
    CHECK(cudaSetDevice(me));
    launch(p, me, grid, threads);
  }
}

static double time_us(Pattern p, int grid, int threads, int reps) {
  for (int w = 0; w < 3; ++w) launch_both(p, grid, threads);
  std::vector<double> v;
  for (int k = 0; k < 15; ++k) {
    for (int me = 0; me < 2; ++me) {
      CHECK(cudaSetDevice(me));
      CHECK(cudaStreamSynchronize(g[me].s));
    }
    for (int me = 0; me < 2; ++me) {
      CHECK(cudaSetDevice(me));
      CHECK(cudaEventRecord(g[me].t0, g[me].s));
    }
    for (int r = 0; r < reps; ++r) launch_both(p, grid, threads);
    double worst = 0;
    for (int me = 0; me < 2; ++me) {
      CHECK(cudaSetDevice(me));
      CHECK(cudaEventRecord(g[me].t1, g[me].s));
      CHECK(cudaEventSynchronize(g[me].t1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, g[me].t0, g[me].t1));
      worst = std::max(worst, ms * 1000.0 / reps);
    }
    v.push_back(worst);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  bytes = (argc > 1 ? atoll(argv[1]) : 64) << 20;
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  if (n < 2) {
    fprintf(stderr, "link_probe needs 2 GPUs, found %d\n", n);
    return 1;
  }
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    int ok = 0;
    CHECK(cudaDeviceCanAccessPeer(&ok, d, 1 - d));
    if (!ok) {
      fprintf(stderr, "GPU %d cannot access GPU %d\n", d, 1 - d);
      return 1;
    }
    CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
    g[d].dev = d;
    CHECK(cudaMalloc(&g[d].in, bytes));
    CHECK(cudaMalloc(&g[d].out, bytes));
    CHECK(cudaMalloc(&g[d].scratch, bytes));
    CHECK(cudaMemset(g[d].in, 1, bytes));
    CHECK(cudaStreamCreateWithFlags(&g[d].s, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&pp[d].sa, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&pp[d].sb, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&pp[d].fork, &pp[d].done_a, &pp[d].done_b})
      CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    for (int c = 0; c < MAX_CHUNKS; ++c) {
      CHECK(cudaEventCreateWithFlags(&pp[d].a[c], cudaEventDisableTiming));
      CHECK(cudaEventCreateWithFlags(&pp[d].r[c], cudaEventDisableTiming));
    }
    CHECK(cudaEventCreate(&g[d].t0));
    CHECK(cudaEventCreate(&g[d].t1));
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  printf("%llu MiB into each GPU, both GPUs at once; %d SMs; us (GB/s per direction)\n",
         (unsigned long long)(bytes >> 20), sms);
  std::vector<int> grids = {32, 64, 128, sms, 2 * sms, 4 * sms}, threads = {256, 512, 1024};
  if (argc > 4) grids = {atoi(argv[3])}, threads = {atoi(argv[4])};
  printf("%-8s %7s", "pattern", "threads");
  for (int gr : grids) printf(" %17d", gr);
  printf("\n");
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaFuncSetAttribute(bulk_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, STAGES * CHUNK));
  }
  const char* only = argc > 2 ? argv[2] : nullptr;
  for (int p = READ; p <= BULK; ++p)
    for (int t : threads) {
      if (only && strcmp(only, names[p]) != 0) continue;
      printf("%-8s %7d", names[p], t);
      for (int gr : grids) {
        const double us = time_us((Pattern)p, gr, t, 10);
        printf(" %8.1f (%5.0f)", us, bytes / us / 1e3);
      }
      printf("\n");
      fflush(stdout);
    }
  if (only && strncmp(only, "ce", 2) != 0) return 0;
  const double us = time_us(CE, 0, 0, 10);
  printf("%-8s %7s %8.1f (%5.0f)\n", "ce", "-", us, bytes / us / 1e3);
  printf("%-8s %7s", "cepipe", "chunks");
  for (int c : {1, 2, 4, 8, 16, 32, 64}) {
    const double t = time_us(CEPIPE, c, 0, 10);
    printf(" %d: %.1f (%.0f)", c, t, bytes / t / 1e3);
  }
  printf("\n");
  return 0;
}
