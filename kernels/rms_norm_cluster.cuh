// The fused all-reduce + residual + RMSNorm kernel for wide rows on Hopper: a row split over a
// thread-block cluster (rms_llc_body). The operation, the canonical order of a row's sum of
// squares, the FP8 epilogue and the LL push are rms_norm.cuh's; the exchange between a
// cluster's blocks is cluster.cuh's.
#pragma once
#include "cluster.cuh"
#include "rms_norm.cuh"

// Wide rows on Hopper: a row split over a cluster of C blocks (C = 2-8, a launch attribute;
// src/comm/collective/shape.rs picks it), so no single SM moves a whole row of x, residual, weight, out and slot
// resets. Block q of a cluster takes vectors [q * B, (q + 1) * B) of the cluster's rows, one per
// thread (B = blockDim.x, a power of two, C * B >= vecs, B <= SYMM_RMS_LLC_THREADS). The sum of
// squares, in the canonical order: each warp's chunk tree, then warp 0 adds the block's W = B / 32
// chunks (an aligned power-of-two run: a subtree of the canonical tree) and sends that with the
// AND of the block's waits to every block of the cluster (cluster.cuh's fence-free exchange);
// each block then adds the C runs in the tree's top levels, so every block (and rank, and kernel)
// gets the same bits, and every block stops at the same row if a wait failed anywhere in the
// cluster.
// Warp 0 sends and waits; the other warps wait at a block barrier behind it (with every warp
// spinning on the mbarrier the call was slower: bench/NOTES.md, "The fused all-reduce +
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

template <typename T, int Q = QUANT_NONE>
__device__ __forceinline__ void rms_llc_body(const RmsArgs& f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int N = 16 / sizeof(T);
  const SymmArgs& a = f.s;
  const uint32_t C = cluster_nctarank(), q = cluster_ctarank();
  __shared__ float part[SYMM_RMS_LLC_THREADS / 32];
  __shared__ float part_max[Q == QUANT_PER_TOKEN ? SYMM_RMS_LLC_THREADS / 32 : 1];
  __shared__ uint32_t part_ok[SYMM_RMS_LLC_THREADS / 32];
  // (sum's bits, word): word's bit 31 set where a wait of the block failed; its other bits are the
  // block's max |r * w| for per-token FP8 (>= 0, never NaN: bit 31 is free), 0 otherwise.
  __shared__ __align__(8) uint32_t inbox[2][SYMM_MAX_CLUSTER][2];
  __shared__ __align__(8) uint64_t mbar[2];

  const uint64_t items = a.count / N;
  const uint64_t vecs = f.hidden / N;
  const uint4* x = (const uint4*)a.in[a.rank];
  const uint64_t tp = f.push_threads;
  const uint64_t p0 = (uint64_t)blockIdx.x * tp + threadIdx.x;
  uint4 pv = first_push(x, items, tp, p0);  // before the call counter (rms_norm.cuh)
  const float sraw = early_scale<Q>(f);

  uint32_t call;
  const bool live = ll_begin(a, call);  // block-uniform
  if (threadIdx.x == 0) {
#pragma unroll
    for (int b = 0; b < 2; ++b) mbar_init(&mbar[b], 1);
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

  // Block q takes vectors [q * blockDim.x, (q + 1) * blockDim.x): blockDim.x is a power of two
  // (shape.rs), so the block's W chunks are an aligned run of the canonical tree.
  const uint64_t j = (uint64_t)q * blockDim.x + threadIdx.x;
  const bool has = j < vecs;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, W = blockDim.x / 32;
  int parity = 0;
  uint32_t phases = 0;  // bit p: the parity of mbar[p]'s phase the next wait on it waits for
  for (uint64_t t = cluster_id(); t < f.tokens; t += cluster_count(), parity ^= 1) {
    const uint64_t at = t * vecs + j;
    float r[N];
    float ss = 0.f;  // vec_squares of this thread's vector (0 past the row)
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
    // Per-token FP8 (quant.cuh): m = max |r * w|, sent with the sum (one exchange); the new
    // residual packed now (stored once the exchange passed) and r <- r * w, so after the
    // exchange y = r * inv is one multiply.
    float m = 0.f;
    uint4 rpk = make_uint4(0, 0, 0, 0);
    if (has) {
      const T* re = (const T*)&res;
#pragma unroll
      for (int k = 0; k < N; ++k) r[k] += to_f32(re[k]);
      ss = vec_squares(r);
      if constexpr (Q == QUANT_PER_TOKEN) {
        rpk = pack<T, true>(r);
        const T* w = (const T*)&wgt;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          r[k] *= to_f32(w[k]);
          m = fmaxf(m, fabsf(r[k]));
        }
      }
    }
    ss = chunk_tree(ss);  // this warp's chunk
    const bool wok = __all_sync(0xffffffffu, mine);
    if constexpr (Q == QUANT_PER_TOKEN) m = warp_max(m);
    if (lane == 0) {
      part[warp] = ss;
      part_ok[warp] = wok;
      if constexpr (Q == QUANT_PER_TOKEN) part_max[warp] = m;
    }
    __syncthreads();
    if (warp == 0) {  // the block's run of chunks and AND (and max), then lane b sends them to block b
      const float w = __shfl_sync(0xffffffffu, chunk_tree(lane < W ? part[lane] : 0.f, W), 0);
      const uint32_t k = __all_sync(0xffffffffu, lane >= W || part_ok[lane] != 0);
      uint32_t word = k ? 0u : 0x80000000u;
      if constexpr (Q == QUANT_PER_TOKEN) word |= __float_as_uint(warp_max(lane < W ? part_max[lane] : 0.f));
      if (lane == 0) mbar_expect_arrive(&mbar[parity], C * 8);
      if (lane < (int)C) st_async_v2(inbox[parity][q], __float_as_uint(w), word, &mbar[parity], lane);
      mbar_wait(&mbar[parity], (phases >> parity) & 1);
    }
    phases ^= 1u << parity;
    __syncthreads();  // warp 0 saw the cluster's sums arrive (the others do not spin beside it)
    // The blocks' runs: the canonical tree's top levels over C <= 8 nodes, zero-padded to 8, in
    // lanes 0-7 (every warp of every block adds the same values in the same order), then lane
    // 0's sum to the whole warp.
    const uint32_t b = lane < (int)C ? lane : 0;
    const float sum = __shfl_sync(
        0xffffffffu, chunk_tree(lane < (int)C ? __uint_as_float(inbox[parity][b][0]) : 0.f, SYMM_MAX_CLUSTER), 0);
    if (!__all_sync(0xffffffffu, (inbox[parity][b][1] >> 31) == 0)) break;  // the same in every block
    const float inv = rsqrtf(sum / (float)f.hidden + f.eps);
    if constexpr (Q != QUANT_NONE) {
      float y[N];
#pragma unroll
      for (int k = 0; k < N; ++k) y[k] = 0.f;
      if (has) {
        ((uint4*)f.residual)[at] = Q == QUANT_PER_TOKEN ? rpk : pack<T, true>(r);
        const T* w = (const T*)&wgt;
#pragma unroll
        for (int k = 0; k < N; ++k) y[k] = Q == QUANT_PER_TOKEN ? r[k] * inv : r[k] * inv * to_f32(w[k]);
      }
      float qinv = Q == QUANT_STATIC ? static_inv(sraw) : 0.f;
      if constexpr (Q == QUANT_PER_GROUP) {
        const float sc = amax_scale(half_warp_max(has ? vec_amax(y) : 0.f));
        if (has && j % 16 == 0) ((float*)f.scale)[t * (vecs / 16) + j / 16] = sc;
        qinv = 1.f / sc;
      }
      if constexpr (Q == QUANT_PER_TOKEN) {
        // The cluster's max |r * w|: each block's, from the exchange above (bit 31 clear here).
        const float cm = warp_max(lane < (int)C ? __uint_as_float(inbox[parity][lane][1]) : 0.f);
        const float sc = amax_scale(token_amax(cm, inv));
        if (q == 0 && threadIdx.x == 0) ((float*)f.scale)[t] = sc;
        qinv = 1.f / sc;
      }
      if (has) store_out<T, Q>(f.out, at, y, qinv);
    } else if (has) {
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
  __trap();  // src/comm/collective/shape.rs picks the cluster kernels on sm_90 and later only
#endif
}
