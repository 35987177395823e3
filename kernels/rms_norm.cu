// All-reduce fused with residual add and RMSNorm, for tensor-parallel inference:
//   r = allreduce_sum(x) + residual   (fp32: every rank's x in fixed rank order, then residual)
//   residual <- r (rounded to T);  out <- r * rsqrt(mean(r^2) + eps) * weight (rounded to T)
// x, residual and out are [tokens, hidden]; weight is [hidden]. Only x is read by peers
// (one-shot: every rank reads every rank's row, so every rank computes the same bits); residual,
// out and weight are this rank's own. A block takes whole rows (a grid-stride loop over tokens):
// the sum of squares is a block reduction in a fixed tree order, so the result does not depend
// on timing. The first barrier makes every rank's x ready; the closing barrier keeps a caller
// from overwriting x while a peer still reads it. 16-byte vectors: hidden is a multiple of 8
// and every pointer is 16-byte aligned (the launch checks). Messages up to the LL threshold take
// the barrier-free LL kernel instead (rms_ll_body, below); both reduce in the same order.
#include "common.cuh"

// Vectors per thread per row: a block of SYMM_THREADS covers hidden <= 512 * 4 * 8 = 16384.
#define SYMM_RMS_VECS 4

struct RmsArgs {
  SymmArgs s;          // in[] = every rank's x; count = tokens * hidden
  uint64_t residual;   // this rank's, updated in place
  uint64_t weight;
  uint64_t out;
  uint64_t hidden;
  float eps;
  uint32_t push_threads;  // LL kernel: threads per block that push x (the LL all-reduce's spread)
  uint32_t cluster;       // LL kernel: blocks per row (1, or a cluster of 2..8 blocks on sm_90+)
  uint32_t reserved;
};

// Sum over the block in a fixed order (shuffle tree per warp, then warp 0 over the warps).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[SYMM_THREADS / 32];
  __shared__ float total;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < (int)(blockDim.x / 32) ? part[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
    if (lane == 0) total = w;
  }
  __syncthreads();
  return total;
}

template <typename T>
__device__ __forceinline__ void rms_body(const RmsArgs& f) {
  using P = Pack<T, true>;
  constexpr int N = P::N;
  const SymmArgs& a = f.s;
  uint32_t e;
  if (!epoch_begin(a, e)) return;  // aborted: touch no peer memory
  bool ok = block_barrier(a, ++e, true);
  const uint64_t vecs = f.hidden / N;
  const uint64_t tokens = a.count / f.hidden;
  for (uint64_t t = blockIdx.x; ok && t < tokens; t += gridDim.x) {
    float r[SYMM_RMS_VECS][N];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < SYMM_RMS_VECS; ++k) {
      const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
      if (j >= vecs) continue;
      const uint64_t item = t * vecs + j;
      reduce_item<T, OP_SUM, true>(a, item, r[k]);
      const uint4 res = ((const uint4*)f.residual)[item];
      const T* re = (const T*)&res;
#pragma unroll
      for (int q = 0; q < N; ++q) {
        r[k][q] += to_f32(re[q]);
        ss += r[k][q] * r[k][q];
      }
      ((uint4*)f.residual)[item] = pack<T, true>(r[k]);
    }
    const float inv = rsqrtf(block_sum(ss) / (float)f.hidden + f.eps);
#pragma unroll
    for (int k = 0; k < SYMM_RMS_VECS; ++k) {
      const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
      if (j >= vecs) continue;
      const uint4 wv = ((const uint4*)f.weight)[j];
      const T* w = (const T*)&wv;
      float o[N];
#pragma unroll
      for (int q = 0; q < N; ++q) o[q] = r[k][q] * inv * to_f32(w[q]);
      ((uint4*)f.out)[t * vecs + j] = pack<T, true>(o);
    }
  }
  if (ok) ok = block_barrier(a, ++e, false);
  epoch_end(a, e);
}

// Small messages (x up to the LL threshold): the LL protocol of one_shot_ll.cu instead of the two
// barriers, so the fused call costs about what the LL all-reduce costs. Every block of the
// communicator's fixed LL grid pushes its share of x into every peer's slot, spread over the
// blocks exactly as the LL all-reduce spreads a message (push_threads per block, grid-stride:
// one SM's stores to a peer are the bottleneck otherwise), takes part in the descriptor check and
// bumps its call counter, as the LL all-reduce does (so the two share buffers and counters in
// step). Then each row is pulled by `cluster` blocks (a thread-block cluster on sm_90+, else 1):
// block q of a cluster takes vectors [q*seg, (q+1)*seg) of rows g, g + groups, ... (g its
// cluster). It waits for each peer's items, reduces them with its own in rank order and adds the
// residual; the row's sum of squares is each block's tree sum, then the cluster's blocks' sums in
// block order read through distributed shared memory: a fixed order, so every rank computes the
// same bits. Any block may pull and reset any item: slots are indexed by item, and each item is
// read and reset once per call. A failed wait (timeout, abort) stops the waits of that thread;
// the cluster learns of it at the row's exchange and every block of it stops there together
// (a block never leaves a cluster barrier unmatched, nor exits while a peer block may still read
// its shared memory).
#ifndef LL_BUFFERS
#error "rms_norm.cu uses one_shot_ll.cu's LL protocol: build.rs includes kernels/*.cu in name order"
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SYMM_HAS_CLUSTERS 1
// Every thread of every block of the cluster arrives; release/acquire orders shared memory.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// `local` (this block's shared variable) as it is in block `q` of the cluster.
__device__ __forceinline__ uint32_t cluster_addr(const void* local, uint32_t q) {
  uint32_t mine = (uint32_t)__cvta_generic_to_shared(local), theirs;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(theirs) : "r"(mine), "r"(q));
  return theirs;
}
__device__ __forceinline__ float ld_cluster_f32(const float* local, uint32_t q) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(local, q)) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_cluster_u32(const uint32_t* local, uint32_t q) {
  uint32_t v;
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(cluster_addr(local, q)) : "memory");
  return v;
}
#else
#define SYMM_HAS_CLUSTERS 0
#endif

template <typename T>
__device__ __forceinline__ void rms_ll_body(const RmsArgs& f) {
  constexpr int N = 16 / sizeof(T);
  const SymmArgs& a = f.s;
  uint32_t* counters = (uint32_t*)(ll_region(a, a.rank) + LL_COUNTERS_OFFSET);
  __shared__ uint32_t call, dead;
  __shared__ float row_part[2];     // this block's share of a row's sum of squares, by row parity
  __shared__ uint32_t row_ok[2];    // and whether all its waits succeeded
  if (threadIdx.x == 0) {  // both loads in flight before either store (see epoch_begin)
    const uint32_t c0 = counters[blockIdx.x];
    const uint32_t d0 = *(volatile uint32_t*)abort_word(a);
    call = c0;
    dead = d0;
  }
  __syncthreads();
  const uint32_t C = SYMM_HAS_CLUSTERS ? f.cluster : 1;
  if (dead && C == 1) return;  // aborted: push nothing into the peers' buffers
  bool ok = !dead;             // (in a cluster, an aborted block still meets its peers below)
  const uint32_t buf = call % LL_BUFFERS;
  const uint64_t start = globaltimer();
  const uint64_t items = a.count / N;  // hidden is a multiple of 8: whole vectors
  const uint4* x = (const uint4*)a.in[a.rank];
  if (ok) {
    const uint64_t tp = f.push_threads;
    for (uint64_t u = threadIdx.x; u < tp; u += blockDim.x) {
      for (uint64_t i = (uint64_t)blockIdx.x * tp + u; i < items; i += (uint64_t)gridDim.x * tp) {
        uint4 v = x[i];
        ll_sanitize<T>(v);
#pragma unroll
        for (int r = 0; r < SYMM_MAX_RANKS; ++r)
          if (r < a.world && r != a.rank) st_volatile_v4(ll_slot(a, r, buf, a.rank) + i, v);
      }
    }
    ok = ll_check_desc(a, buf, start);
  }

  const uint64_t vecs = f.hidden / N;
  const uint64_t tokens = a.count / f.hidden;
  // 32-bit: a row has at most 2048 vectors; C is a power of two.
  const uint32_t seg = ((uint32_t)vecs + C - 1) / C;  // <= SYMM_RMS_VECS * blockDim.x (the host checks)
  const uint32_t lo = (blockIdx.x % C) * seg, hi = min((uint32_t)vecs, lo + seg);
  const uint32_t groups = gridDim.x / C;
  uint32_t parity = 0;
  for (uint64_t t = blockIdx.x / C; t < tokens; t += groups, parity ^= 1) {
    if (C == 1 && !ok) break;
    float r[SYMM_RMS_VECS][N];
    uint4 own[SYMM_RMS_VECS], res[SYMM_RMS_VECS], wgt[SYMM_RMS_VECS];
    float ss = 0.f;
    bool mine = ok;  // this thread's waits all succeeded
#pragma unroll
    for (int k = 0; k < SYMM_RMS_VECS; ++k) {  // local loads first: in flight during the polls
      const uint32_t j = lo + threadIdx.x + k * blockDim.x;
      if (mine && j < hi) {
        own[k] = x[t * vecs + j];
        res[k] = ((const uint4*)f.residual)[t * vecs + j];
        wgt[k] = ((const uint4*)f.weight)[j];
        ll_sanitize<T>(own[k]);
      }
    }
    // Rank order (every rank adds the same values in the same order); per peer, every load of
    // the row's segment is issued before any wait, so the polls overlap.
#pragma unroll
    for (int p = 0; p < SYMM_MAX_RANKS; ++p) {
      if (p >= a.world || !ok) break;
      uint4 v[SYMM_RMS_VECS];
#pragma unroll
      for (int k = 0; k < SYMM_RMS_VECS; ++k) {
        const uint32_t j = lo + threadIdx.x + k * blockDim.x;
        if (j < hi) v[k] = p == a.rank ? own[k] : ld_volatile_v4(ll_slot(a, a.rank, buf, p) + t * vecs + j);
      }
#pragma unroll
      for (int k = 0; k < SYMM_RMS_VECS; ++k) {
        const uint32_t j = lo + threadIdx.x + k * blockDim.x;
        if (j >= hi) continue;
        if (p != a.rank) {
          uint4* slot = ll_slot(a, a.rank, buf, p) + t * vecs + j;
          if (!ll_arrived(v[k]) && !(mine && ll_wait(a, slot, p, start, v[k]))) {
            mine = false;
            continue;
          }
          *slot = make_uint4(LL_EMPTY, LL_EMPTY, LL_EMPTY, LL_EMPTY);
        }
        const T* e = (const T*)&v[k];
#pragma unroll
        for (int q = 0; q < N; ++q) r[k][q] = p == 0 ? to_f32(e[q]) : r[k][q] + to_f32(e[q]);
      }
    }
#pragma unroll
    for (int k = 0; k < SYMM_RMS_VECS; ++k) {
      const uint32_t j = lo + threadIdx.x + k * blockDim.x;
      if (!ok || j >= hi) continue;
      const T* re = (const T*)&res[k];
#pragma unroll
      for (int q = 0; q < N; ++q) {
        r[k][q] += to_f32(re[q]);
        ss += r[k][q] * r[k][q];
      }
    }
    float total = block_sum(ss);
    ok = __syncthreads_and(mine) != 0;
#if SYMM_HAS_CLUSTERS
    if (C > 1) {  // the cluster's sums in block order; a failed block stops every block here
      if (threadIdx.x == 0) {
        row_part[parity] = total;
        row_ok[parity] = ok;
      }
      cluster_sync();
      total = 0.f;
      for (uint32_t q = 0; q < C; ++q) {
        total += ld_cluster_f32(&row_part[parity], q);
        ok = ld_cluster_u32(&row_ok[parity], q) != 0 && ok;
      }
    }
#endif
    if (!ok) break;
    const float inv = rsqrtf(total / (float)f.hidden + f.eps);
#pragma unroll
    for (int k = 0; k < SYMM_RMS_VECS; ++k) {
      const uint32_t j = lo + threadIdx.x + k * blockDim.x;
      if (j >= hi) continue;
      ((uint4*)f.residual)[t * vecs + j] = pack<T, true>(r[k]);
      const T* w = (const T*)&wgt[k];
      float o[N];
#pragma unroll
      for (int q = 0; q < N; ++q) o[q] = r[k][q] * inv * to_f32(w[q]);
      ((uint4*)f.out)[t * vecs + j] = pack<T, true>(o);
    }
  }
#if SYMM_HAS_CLUSTERS
  if (C > 1) cluster_sync();  // no block exits while a peer block may still read its row_part
#endif
  __syncthreads();
  if (threadIdx.x == 0 && !dead) counters[blockIdx.x] = call + 1;
}

extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_all_reduce_add_rms_norm_ll_bf16(RmsArgs f) {
  rms_ll_body<__nv_bfloat16>(f);
}
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_all_reduce_add_rms_norm_ll_fp16(RmsArgs f) {
  rms_ll_body<__half>(f);
}

extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_all_reduce_add_rms_norm_bf16(RmsArgs f) {
  rms_body<__nv_bfloat16>(f);
}
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_all_reduce_add_rms_norm_fp16(RmsArgs f) {
  rms_body<__half>(f);
}
