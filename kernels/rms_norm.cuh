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
#pragma once
#include "cluster.cuh"
#include "common.cuh"
#include "ll.cuh"

// SYMM_RMS_VECS (symm_constants.cuh): vectors per thread per row, so a block of SYMM_THREADS
// covers hidden <= 512 * 4 * 8 = 16384.

struct RmsArgs {
  SymmArgs s;          // in[] = every rank's x; count = tokens * hidden
  uint64_t residual;   // this rank's, updated in place
  uint64_t weight;
  uint64_t out;
  uint64_t hidden;
  uint64_t tokens;     // count / hidden (the host's: no division in the kernels)
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
  bool ok;
  if (!barrier_open(a, e, ok)) return;  // aborted: touch no peer memory
  const uint64_t vecs = f.hidden / N;
  for (uint64_t t = blockIdx.x; ok && t < f.tokens; t += gridDim.x) {
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
  barrier_close(a, e, ok);
}

// Small messages (x up to the LL threshold): the LL protocol of ll.cuh instead of the two
// barriers, so the fused call costs about what the LL all-reduce costs. The grid is fitted to the
// call (src/comm/shape.rs, `fused_ll_shape`): enough blocks to push x with the LL all-reduce's spread (push_threads per
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
      ll_push<T>(a, buf, i, i == p0 ? pv : x[i]);
    }
  }
}

template <typename T, int V>
__device__ __forceinline__ void rms_ll_body(const RmsArgs& f) {
  constexpr int N = 16 / sizeof(T);
  const SymmArgs& a = f.s;
  const uint64_t items = a.count / N;  // hidden is a multiple of 8: whole vectors
  const uint64_t vecs = f.hidden / N;
  const uint4* x = (const uint4*)a.in[a.rank];
  const uint64_t tp = f.push_threads;
  // The first pushed vector does not depend on the call: in flight before the counter and
  // abort-word loads, so the two latencies overlap (as in the LL all-reduce). The row's own
  // loads are not hoisted as well: at 2 ranks that delayed the counter load behind them and
  // cost 0.1-0.3 us (bench/NOTES.md, "The fused all-reduce + RMSNorm kernels"); they are issued before the polls instead.
  const uint64_t p0 = (uint64_t)blockIdx.x * tp + threadIdx.x;
  uint4 pv = make_uint4(0, 0, 0, 0);
  if (threadIdx.x < tp && p0 < items) pv = x[p0];

  uint32_t call;
  if (!ll_begin(a, call)) return;  // aborted: push nothing into the peers' buffers
  const uint32_t buf = call % SYMM_LL_BUFFERS;
  const uint64_t start = globaltimer();
  rms_ll_push<T>(a, tp, p0, pv, buf);
  bool ok = ll_check_desc(a, buf, start);

  int parity = 0;
  // The rows from the host (f.tokens), not count / hidden: the compiler put that division (a
  // 64-bit call, or some 20 dependent instructions with a reciprocal when both fit in 32 bits)
  // ahead of the first loads, 0.15-0.25 µs per call (bench/NOTES.md, "The fused all-reduce + RMSNorm kernels").
  for (uint64_t t = blockIdx.x; ok && t < f.tokens; t += gridDim.x, parity ^= 1) {
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
        if (p != a.rank && !ll_settle(a, ll_slot(a, a.rank, buf, p) + t * vecs + j, p, start, v[k], mine)) {
          mine = false;
          continue;
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


// Wide rows on Hopper: a row split over a cluster of C blocks (C = 2-8, a launch attribute;
// src/comm/shape.rs picks it), so no single SM moves a whole row of x, residual, weight, out and slot
// resets. Block q of a cluster takes vectors [q * span, (q + 1) * span) of the cluster's rows,
// one per thread (span = ceil(vecs / C) <= SYMM_RMS_LLC_THREADS). The sum of squares: the
// block's sum (a shuffle tree per warp, then warp 0 over the warps' sums) goes with the AND of
// the block's waits to every block of the cluster (cluster.cuh's fence-free exchange); each
// block then adds the C sums in block order, so every block (and rank) gets the same bits, and
// every block stops at the same row if a wait failed anywhere in the cluster.
// Warp 0 sends and waits; the other warps wait at a block barrier behind it (with every warp
// spinning on the mbarrier the call was 0.03-0.09 µs slower on one H200; bench/NOTES.md, "The fused all-reduce +
// RMSNorm kernels").
// The inbox is double-buffered by the row's parity. Block s sends into inbox[p] of block b for
// row t + 2 only after its wait on row t + 1 completed, which needed b's send of row t + 1,
// which b issues after the barrier that follows its reads of inbox[p] for row t. part[] needs
// no second buffer: a warp writes it for the next row only after the barrier that follows warp
// 0's send, which reads it. No closing barrier: a block's last wait returns only after every
// send addressed to it has landed.
// Every block of a cluster takes part in every exchange: an aborted communicator or a failed
// descriptor check skips the pushes and waits but not the exchanges. Push, descriptor check,
// call counters: as rms_ll_body.

template <typename T>
__device__ __forceinline__ void rms_llc_body(const RmsArgs& f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int N = 16 / sizeof(T);
  const SymmArgs& a = f.s;
  const uint32_t C = cluster_nctarank(), q = cluster_ctarank();
  __shared__ float part[SYMM_RMS_LLC_THREADS / 32];
  __shared__ uint32_t part_ok[SYMM_RMS_LLC_THREADS / 32];
  __shared__ __align__(8) uint32_t inbox[2][SYMM_MAX_CLUSTER][2];  // (sum's bits, AND of waits)
  __shared__ __align__(8) uint64_t mbar[2];

  const uint64_t items = a.count / N;
  const uint64_t vecs = f.hidden / N;
  const uint4* x = (const uint4*)a.in[a.rank];
  const uint64_t tp = f.push_threads;
  const uint64_t p0 = (uint64_t)blockIdx.x * tp + threadIdx.x;
  uint4 pv = make_uint4(0, 0, 0, 0);
  if (threadIdx.x < tp && p0 < items) pv = x[p0];

  uint32_t call;
  const bool live = ll_begin(a, call);  // block-uniform
  if (threadIdx.x == 0) {
    mbar_init(&mbar[0], 1);
    mbar_init(&mbar[1], 1);
    fence_mbarrier_init();
  }
  // Every block's mbarriers exist before any block sends: the barrier's wait comes after the push.
  // After the call counter, not before: ahead of it this setup delayed the counter's load (0.07-0.1
  // µs on one H200, bench/NOTES.md, "The fused all-reduce + RMSNorm kernels").
  cluster_arrive_relaxed();
  const uint32_t buf = call % SYMM_LL_BUFFERS;
  const uint64_t start = globaltimer();
  if (live) rms_ll_push<T>(a, tp, p0, pv, buf);
  const bool ok = live && ll_check_desc(a, buf, start);
  cluster_wait();

  const uint32_t span = ((uint32_t)vecs + C - 1) / C;  // vecs <= 2048 here: 32-bit division
  const uint64_t j = q * span + threadIdx.x;
  const bool has = threadIdx.x < span && j < vecs;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, W = blockDim.x / 32;
  int parity = 0;
  uint32_t phases = 0;  // bit p: the parity of mbar[p]'s phase the next wait on it waits for
  for (uint64_t t = cluster_id(); t < f.tokens; t += cluster_count(), parity ^= 1) {
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
        if (!ll_settle(a, slot, p, start, v, mine)) {
          mine = false;
          continue;
        }
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
      part[warp] = ss;
      part_ok[warp] = wok;
    }
    __syncthreads();
    if (warp == 0) {  // the block's sum and AND, then lane b sends them to block b
      float w = lane < W ? part[lane] : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
      const uint32_t k = __all_sync(0xffffffffu, lane >= W || part_ok[lane] != 0);
      if (lane == 0) mbar_expect_arrive(&mbar[parity], C * 8);
      if (lane < (int)C) st_async_v2(inbox[parity][q], __float_as_uint(w), k, &mbar[parity], lane);
      mbar_wait(&mbar[parity], (phases >> parity) & 1);
    }
    phases ^= 1u << parity;
    __syncthreads();  // warp 0 saw the cluster's sums arrive (the others do not spin beside it)
    float sum = 0.f;
    uint32_t all = 1;
    for (uint32_t b = 0; b < C; ++b) {  // block order: every block gets the same bits
      sum += __uint_as_float(inbox[parity][b][0]);
      all &= inbox[parity][b][1];
    }
    if (all == 0) break;  // the same in every block of the cluster
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
  if (live) ll_end(a, call);
#else
  __trap();  // src/comm/shape.rs picks the cluster kernels on sm_90 and later only
#endif
}
