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
// barriers, so the fused call costs about what the LL all-reduce costs. The grid is fitted to the
// call (rms_norm.rs): enough blocks to push x with the LL all-reduce's spread (push_threads per
// block; one SM's stores to a peer are the bottleneck otherwise) and to give each row a block, at
// most the communicator's LL grid; ll_end keeps every call counter in step whatever the grid.
// Each block pushes its grid-stride share of x into every peer's slot and takes part in the
// descriptor check, exactly as the LL all-reduce does (the two share buffers and counters). Then
// block b pulls whole rows b, b + grid, ...: it waits for each peer's items of the row, reduces
// them with its own in rank order, adds the residual and normalizes. V vectors per thread: V = 1
// (up to 768 threads, hidden <= 6144) keeps every poll of a thread independent; V = 4 (512
// threads) covers hidden up to 16384. Any
// block may pull and reset any item: slots are indexed by item, and each item is read and reset
// once per call. A failed wait (timeout, abort) stops the waits of that thread; the block still
// meets at every barrier and writes nothing for the row.
#ifndef LL_BUFFERS
#error "rms_norm.cu uses one_shot_ll.cu's LL protocol: build.rs includes kernels/*.cu in name order"
#endif

// The sum of v over the block, in the fixed order of block_sum (a shuffle tree per warp, then a
// shuffle tree over the warps' sums), with one barrier instead of two, which also ANDs `mine`
// over the block into `all`: every warp reduces the warps' sums itself (each gets the same bits).
// part[] is double-buffered by the row's parity, so a warp that is a row ahead never overwrites
// sums a slower warp still reads (the row in between has a barrier every warp must pass).
__device__ __forceinline__ float block_sum_and(float v, int parity, bool mine, bool& all) {
  __shared__ float part[2][32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) part[parity][warp] = v;
  all = __syncthreads_and(mine) != 0;
  float w = lane < (int)(blockDim.x / 32) ? part[parity][lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
  return w;
}

// This block's grid-stride share of x, tp threads per block, into every peer's slot (the LL
// all-reduce's spread). pv is item p0, loaded before the call counter.
template <typename T>
__device__ __forceinline__ void rms_ll_push(const SymmArgs& a, uint64_t tp, uint64_t p0, uint4 pv,
                                            uint32_t buf) {
  constexpr int N = 16 / sizeof(T);
  const uint64_t items = a.count / N;
  const uint4* x = (const uint4*)a.in[a.rank];
  for (uint64_t u = threadIdx.x; u < tp; u += blockDim.x) {
    for (uint64_t i = (uint64_t)blockIdx.x * tp + u; i < items; i += (uint64_t)gridDim.x * tp) {
      uint4 v = i == p0 ? pv : x[i];
      ll_sanitize<T>(v);
#pragma unroll
      for (int r = 0; r < SYMM_MAX_RANKS; ++r)
        if (r < a.world && r != a.rank) st_volatile_v4(ll_slot(a, r, buf, a.rank) + i, v);
    }
  }
}

template <typename T, int V>
__device__ __forceinline__ void rms_ll_body(const RmsArgs& f) {
  constexpr int N = 16 / sizeof(T);
  const SymmArgs& a = f.s;
  const uint64_t items = a.count / N;  // hidden is a multiple of 8: whole vectors
  const uint64_t vecs = f.hidden / N;
  const uint64_t tokens = a.count / f.hidden;
  const uint4* x = (const uint4*)a.in[a.rank];
  const uint64_t tp = f.push_threads;
  // The first pushed vector does not depend on the call: in flight before the counter and
  // abort-word loads, so the two latencies overlap (as in the LL all-reduce). The row's own
  // loads are not hoisted as well: at 2 ranks that delayed the counter load behind them and
  // cost 0.1-0.3 us (bench/NOTES.md); they are issued before the polls instead.
  const uint64_t p0 = (uint64_t)blockIdx.x * tp + threadIdx.x;
  uint4 pv = make_uint4(0, 0, 0, 0);
  if (threadIdx.x < tp && p0 < items) pv = x[p0];

  uint32_t call;
  if (!ll_begin(a, call)) return;  // aborted: push nothing into the peers' buffers
  const uint32_t buf = call % LL_BUFFERS;
  const uint64_t start = globaltimer();
  rms_ll_push<T>(a, tp, p0, pv, buf);
  bool ok = ll_check_desc(a, buf, start);

  int parity = 0;
  for (uint64_t t = blockIdx.x; ok && t < tokens; t += gridDim.x, parity ^= 1) {
    float r[V][N];
    float ss = 0.f;
    bool mine = true;  // this thread's waits all succeeded
    uint4 own[V], res[V], wgt[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {  // in flight during the polls
      const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
      if (j < vecs) {
        own[k] = x[t * vecs + j];
        res[k] = ((const uint4*)f.residual)[t * vecs + j];
        wgt[k] = ((const uint4*)f.weight)[j];
      }
    }
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (threadIdx.x + (uint64_t)k * blockDim.x < vecs) ll_sanitize<T>(own[k]);
    // Rank order (every rank adds the same values in the same order); per peer, every load of
    // the row is issued before any wait, so the polls overlap.
#pragma unroll
    for (int p = 0; p < SYMM_MAX_RANKS; ++p) {
      if (p >= a.world) break;
      uint4 v[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
        if (j < vecs) v[k] = p == a.rank ? own[k] : ld_volatile_v4(ll_slot(a, a.rank, buf, p) + t * vecs + j);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
        if (j >= vecs) continue;
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
    for (int k = 0; k < V; ++k) {
      const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
      if (j >= vecs) continue;
      const T* re = (const T*)&res[k];
#pragma unroll
      for (int q = 0; q < N; ++q) {
        r[k][q] += to_f32(re[q]);
        ss += r[k][q] * r[k][q];
      }
    }
    const float inv = rsqrtf(block_sum_and(ss, parity, mine, ok) / (float)f.hidden + f.eps);
    if (!ok) break;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
      if (j >= vecs) continue;
      ((uint4*)f.residual)[t * vecs + j] = pack<T, true>(r[k]);
      const T* w = (const T*)&wgt[k];
      float o[N];
#pragma unroll
      for (int q = 0; q < N; ++q) o[q] = r[k][q] * inv * to_f32(w[q]);
      ((uint4*)f.out)[t * vecs + j] = pack<T, true>(o);
    }
  }
  ll_end(a, call);
}

// One vector per thread, up to 768 threads (hidden <= 6144; kernel_args.rs says why not wider).
#define SYMM_RMS_LL1_THREADS 768
extern "C" __global__ void __launch_bounds__(SYMM_RMS_LL1_THREADS) symm_all_reduce_add_rms_norm_ll1_bf16(RmsArgs f) {
  rms_ll_body<__nv_bfloat16, 1>(f);
}
extern "C" __global__ void __launch_bounds__(SYMM_RMS_LL1_THREADS) symm_all_reduce_add_rms_norm_ll1_fp16(RmsArgs f) {
  rms_ll_body<__half, 1>(f);
}
// SYMM_RMS_VECS vectors per thread, up to SYMM_THREADS threads (hidden <= 16384).
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_all_reduce_add_rms_norm_ll_bf16(RmsArgs f) {
  rms_ll_body<__nv_bfloat16, SYMM_RMS_VECS>(f);
}
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_all_reduce_add_rms_norm_ll_fp16(RmsArgs f) {
  rms_ll_body<__half, SYMM_RMS_VECS>(f);
}

// Wide rows on Hopper: a row split over a cluster of C blocks (C = 2-8, a launch attribute;
// rms_norm.rs picks it), so no single SM moves a whole row of x, residual, weight, out and slot
// resets. Block q of a cluster takes vectors [q * span, (q + 1) * span) of the cluster's rows,
// one per thread (span = ceil(vecs / C) <= SYMM_RMS_LLC_THREADS). The sum of squares: each warp's
// sum into the block's shared memory, one cluster barrier, then every warp of every block of the
// cluster sums the cluster's C x W warp sums in one fixed order (lane l: sums l and l + 32, then a
// shuffle tree), so every block gets the same bits; the same exchange ANDs the waits' results.
// The warp sums are double-buffered by the row's parity: a block writes buffer p again two rows
// later, after a barrier that every block reaches only once it has read buffer p. A closing
// barrier keeps each block's shared memory alive until the cluster is done reading it; a block
// arrives at it (relaxed: it orders nothing) as soon as it has read its last row's sums, and
// waits at its exit, so the row's stores do not hold the cluster up (1,000 cycles less). Every
// block of a cluster meets every barrier: an aborted communicator or a failed descriptor check
// skips the pushes and waits but not the barriers, and the cluster-wide AND stops all its blocks
// at the same row. Push, descriptor check, call counters: as rms_ll_body.
#define SYMM_RMS_LLC_THREADS 256

// The cluster's special registers: this block's rank in its cluster, the blocks per cluster,
// this cluster's index in the grid and the number of clusters.
#define SYMM_CLUSTER_SREG(NAME, REG)                             \
  __device__ __forceinline__ uint32_t NAME() {                   \
    uint32_t r;                                                  \
    asm volatile("mov.u32 %0, %%" REG ";" : "=r"(r));            \
    return r;                                                    \
  }
SYMM_CLUSTER_SREG(cluster_ctarank, "cluster_ctarank")
SYMM_CLUSTER_SREG(cluster_nctarank, "cluster_nctarank")
SYMM_CLUSTER_SREG(cluster_id, "clusterid.x")
SYMM_CLUSTER_SREG(cluster_count, "nclusterid.x")
// All threads of every block of the cluster; orders each block's earlier shared-memory stores
// before every block's later loads.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The two halves of cluster_sync: arrive without ordering any memory access (the block only
// promises it will read no other block's shared memory after this), and wait.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}
// The word at `p` (this block's shared memory) in block `rank` of the cluster.
__device__ __forceinline__ uint32_t ld_cluster_u32(const void* p, uint32_t rank) {
  const uint32_t local = (uint32_t)__cvta_generic_to_shared(p);
  uint32_t remote, v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
  return v;
}

template <typename T>
__device__ __forceinline__ void rms_llc_body(const RmsArgs& f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int N = 16 / sizeof(T);
  const SymmArgs& a = f.s;
  const uint64_t items = a.count / N;
  const uint64_t vecs = f.hidden / N;
  const uint64_t tokens = a.count / f.hidden;
  const uint4* x = (const uint4*)a.in[a.rank];
  const uint64_t tp = f.push_threads;
  const uint64_t p0 = (uint64_t)blockIdx.x * tp + threadIdx.x;
  uint4 pv = make_uint4(0, 0, 0, 0);
  if (threadIdx.x < tp && p0 < items) pv = x[p0];

  uint32_t call;
  const bool live = ll_begin(a, call);  // block-uniform
  const uint32_t buf = call % LL_BUFFERS;
  const uint64_t start = globaltimer();
  if (live) rms_ll_push<T>(a, tp, p0, pv, buf);
  const bool ok = live && ll_check_desc(a, buf, start);

  const uint32_t C = cluster_nctarank(), q = cluster_ctarank();
  const uint64_t span = (vecs + C - 1) / C;
  const uint64_t j = q * span + threadIdx.x;
  const bool has = threadIdx.x < span && j < vecs;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, W = blockDim.x / 32;
  __shared__ float part[2][SYMM_RMS_LLC_THREADS / 32];
  __shared__ uint32_t part_ok[2][SYMM_RMS_LLC_THREADS / 32];
  int parity = 0;
  bool arrived = false;  // this block's arrival at the closing barrier
  for (uint64_t t = cluster_id(); t < tokens; t += cluster_count(), parity ^= 1) {
    const uint64_t at = t * vecs + j;
    float r[N];
    float ss = 0.f;
    bool mine = ok;  // this thread's waits all succeeded
    uint4 own = make_uint4(0, 0, 0, 0), res = own, wgt = own;
    if (has) {  // in flight during the polls
      own = x[at];
      res = ((const uint4*)f.residual)[at];
      wgt = ((const uint4*)f.weight)[j];
      ll_sanitize<T>(own);
    }
#pragma unroll
    for (int p = 0; p < SYMM_MAX_RANKS; ++p) {
      if (p >= a.world) break;
      uint4 v = own;
      if (has && p != a.rank) {
        uint4* slot = ll_slot(a, a.rank, buf, p) + at;
        v = ld_volatile_v4(slot);
        if (!ll_arrived(v) && !(mine && ll_wait(a, slot, p, start, v))) {
          mine = false;
          continue;
        }
        *slot = make_uint4(LL_EMPTY, LL_EMPTY, LL_EMPTY, LL_EMPTY);
      }
      const T* e = (const T*)&v;
#pragma unroll
      for (int k = 0; k < N; ++k) r[k] = p == 0 ? to_f32(e[k]) : r[k] + to_f32(e[k]);
    }
    if (has) {
      const T* re = (const T*)&res;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        r[k] += to_f32(re[k]);
        ss += r[k] * r[k];
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const bool wok = __all_sync(0xffffffffu, mine);
    if (lane == 0) {
      part[parity][warp] = ss;
      part_ok[parity][warp] = wok;
    }
    cluster_sync();
    float sum = 0.f;
    uint32_t all = 1;
    for (uint32_t i = lane; i < C * W; i += 32) {
      sum += __uint_as_float(ld_cluster_u32(&part[parity][i % W], i / W));
      all &= ld_cluster_u32(&part_ok[parity][i % W], i / W);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const bool go = __all_sync(0xffffffffu, all != 0);  // the same for every block of the cluster
    // The last row's partial sums are read (and used): the closing barrier's arrival goes now,
    // so the stores below do not hold it up.
    if (t + cluster_count() >= tokens) {
      cluster_arrive_relaxed();
      arrived = true;
    }
    if (!go) break;
    const float inv = rsqrtf(sum / (float)f.hidden + f.eps);
    if (has) {
      ((uint4*)f.residual)[at] = pack<T, true>(r);
      const T* w = (const T*)&wgt;
      float o[N];
#pragma unroll
      for (int k = 0; k < N; ++k) o[k] = r[k] * inv * to_f32(w[k]);
      ((uint4*)f.out)[at] = pack<T, true>(o);
    }
  }
  // No block leaves while another may still read its part[].
  if (!arrived) cluster_arrive_relaxed();
  cluster_wait();
  if (live) ll_end(a, call);
#else
  __trap();  // rms_norm.rs launches the cluster kernels on sm_90 and later only
#endif
}

extern "C" __global__ void __launch_bounds__(SYMM_RMS_LLC_THREADS) symm_all_reduce_add_rms_norm_llc_bf16(RmsArgs f) {
  rms_llc_body<__nv_bfloat16>(f);
}
extern "C" __global__ void __launch_bounds__(SYMM_RMS_LLC_THREADS) symm_all_reduce_add_rms_norm_llc_fp16(RmsArgs f) {
  rms_llc_body<__half>(f);
}

extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_all_reduce_add_rms_norm_bf16(RmsArgs f) {
  rms_body<__nv_bfloat16>(f);
}
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_all_reduce_add_rms_norm_fp16(RmsArgs f) {
  rms_body<__half>(f);
}
