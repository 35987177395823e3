// All-reduce fused with residual add and RMSNorm, for tensor-parallel inference:
//   r = allreduce_sum(x) + residual   (fp32: every rank's x in fixed rank order, then residual)
//   residual <- r (rounded to T);  out <- r * rsqrt(mean(r^2) + eps) * weight (rounded to T)
// x, residual and out are [tokens, hidden]; weight is [hidden]. Only x is read by peers
// (one-shot: every rank reads every rank's row, so every rank computes the same bits); residual,
// out and weight are this rank's own. A block takes whole rows (a grid-stride loop over tokens);
// the sum of squares is added in the canonical order below, which every fused kernel (whatever
// its block, vectors per thread or cluster) reproduces exactly. The first barrier makes every
// rank's x ready; the closing barrier keeps a caller from overwriting x while a peer still reads
// it. 16-byte vectors: hidden is a multiple of 8
// and every pointer is 16-byte aligned (the launch checks). Messages up to the LL threshold take
// the barrier-free LL kernel instead (rms_ll_body, below), and wide rows on Hopper the cluster
// kernel (rms_norm_cluster.cuh); all reduce in the same order. Every
// body takes the output's format Q: QUANT_NONE (out is T) or an FP8 mode of quant.cuh (out is
// e4m3 bytes, plus the scales).
#pragma once
#include "common.cuh"
#include "ll.cuh"
#include "quant.cuh"

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
  uint64_t scale;      // FP8 output (quant.cuh): the static scale, or where the scales go; else 0
};

// The canonical order of a row's sum of squares (docs/DESIGN.md, "Determinism"): every fused
// kernel and the host backend (host_reduce.rs) add a row's squares in this one order, so a row's
// bits do not depend on the kernel, block, cluster or number of rows the call takes:
//   1. each 16-byte vector v (N elements): s_v = fma(r_{N-1}, r_{N-1}, ... fma(r_1, r_1, r_0 * r_0)),
//      in element order (vec_squares);
//   2. each chunk of 32 consecutive vectors (vectors past the row count 0): the pairwise tree in
//      natural order, ((s_0 + s_1) + (s_2 + s_3)) + ..., a warp butterfly with xor 1, 2, 4, 8, 16
//      over lanes holding vectors 32c .. 32c + 31 (chunk_tree; IEEE addition commutes, so every
//      lane ends with the same bits);
//   3. the chunk sums: the pairwise tree in natural order over the chunks padded with zeros to
//      any power of two (row_tree). Squares are never -0, and x + 0 = x, so the padding does not
//      change the bits: a tree over 64 slots and one over 8 give the same sum, and a block that
//      owns an aligned power-of-two run of chunks may add its run first (the cluster kernel).
// A row has at most 2048 vectors (hidden 16384): at most 64 chunks.
#define SYMM_RMS_MAX_CHUNKS 64

template <int N>
__device__ __forceinline__ float vec_squares(const float (&r)[N]) {
  float s = r[0] * r[0];
#pragma unroll
  for (int q = 1; q < N; ++q) s = __fmaf_rn(r[q], r[q], s);
  return s;
}

// The pairwise tree over the first `lanes` lanes' values (a power of two, at most 32), in lane
// order, in lanes 0 .. lanes - 1; lanes >= `lanes` hold the trees of their own groups (a caller
// that needs the sum in every lane broadcasts lane 0's).
__device__ __forceinline__ float chunk_tree(float v, int lanes = 32) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1)
    if (o < lanes) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Step 3 by one warp: the pairwise tree over chunk sums c[0 .. n) (n <= 64), every lane gets it.
__device__ __forceinline__ float row_tree(const float* c, int n) {
  const int lane = threadIdx.x % 32;
  float v;
  if (n > 32) {  // the first level pairs (2l, 2l + 1)
    const float lo = 2 * lane < n ? c[2 * lane] : 0.f, hi = 2 * lane + 1 < n ? c[2 * lane + 1] : 0.f;
    v = lo + hi;
  } else {  // the tree over 32 slots: the one over 64 with a zero upper half
    v = lane < n ? c[lane] : 0.f;
  }
  return chunk_tree(v);
}

// A row's sum of squares over the block, in the canonical order, for a block whose thread t
// holds vectors t + k * blockDim.x (k < V), ss[k] their vec_squares (0 past the row): so warp w's
// lanes hold chunk k * W + w for each k (W warps). One barrier, which also ANDs `mine` over the
// block into `all`; every warp adds the chunk sums itself (each gets the same bits). part[] is
// double-buffered by the row's parity, so a warp that is a row ahead never overwrites sums a
// slower warp still reads (the row in between has a barrier every warp must pass).
// With MAX (per-token FP8), m (this thread's max |r * w|, >= 0) becomes the block's max through
// the same barrier: a warp max (one redux, quant.cuh) beside each chunk tree, and one after.
template <int V, bool MAX = false>
__device__ __forceinline__ float block_squares_and(const float (&ss)[V], uint32_t vecs, int parity,
                                                   bool mine, bool& all, float& m) {
  __shared__ float part[2][SYMM_RMS_MAX_CHUNKS];
  __shared__ float pmax[2][MAX ? 32 : 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, W = blockDim.x / 32;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int c = k * W + warp;
    if (MAX && k == 0) {  // every warp, so every pmax slot is written (0 past the row)
      const float v = chunk_tree(ss[0]);
      m = warp_max(m);
      if (lane == 0) {
        if ((uint32_t)c * 32 < vecs) part[parity][c] = v;
        pmax[parity][warp] = m;
      }
      continue;
    }
    if ((uint32_t)c * 32 >= vecs) continue;  // warp-uniform: a chunk past the row
    const float v = chunk_tree(ss[k]);
    if (lane == 0) part[parity][c] = v;
  }
  all = __syncthreads_and(mine) != 0;
  if constexpr (MAX) m = warp_max(lane < W ? pmax[parity][lane] : 0.f);
  return row_tree(part[parity], (int)((vecs + 31) / 32));
}

// The FP8 outputs of row t for a thread holding vectors j_k = threadIdx.x + k * blockDim.x
// (k < V; those >= vecs absent) with values r[k] (the new residual) and weights wgt[k]: y in
// place, then the scale of quant.cuh's mode Q and the e4m3 bytes; sraw is the static scale as
// read (QUANT_STATIC), inverted here. y = (r * inv) * w, per token (r * w) * inv, whose amax is
// token_amax(m, inv) for m = the row's max |r * w|, which block_squares_and reduced with the row's
// sum of squares (quant.cuh). Every thread of the block calls it (the scales take every lane).
template <typename T, int V, int Q>
__device__ __forceinline__ void rows_out_fp8(const RmsArgs& f, uint64_t t, uint64_t vecs, float (&r)[V][8],
                                             const uint4 (&wgt)[V], float inv, float sraw, float m) {
  const float sinv = Q == QUANT_STATIC ? static_inv(sraw) : 0.f;
  float qinv[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    qinv[k] = sinv;
    if (threadIdx.x + (uint64_t)k * blockDim.x >= vecs) continue;
    const T* w = (const T*)&wgt[k];
#pragma unroll
    for (int q = 0; q < 8; ++q) r[k][q] = Q == QUANT_PER_TOKEN ? r[k][q] * to_f32(w[q]) * inv : r[k][q] * inv * to_f32(w[q]);
  }
  if constexpr (Q == QUANT_PER_TOKEN) {
    const float sc = amax_scale(token_amax(m, inv));
    if (threadIdx.x == 0) ((float*)f.scale)[t] = sc;
#pragma unroll
    for (int k = 0; k < V; ++k) qinv[k] = 1.f / sc;
  }
  if constexpr (Q == QUANT_PER_GROUP) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
      const float sc = amax_scale(half_warp_max(j < vecs ? vec_amax(r[k]) : 0.f));
      if (j < vecs && j % 16 == 0) ((float*)f.scale)[t * (vecs / 16) + j / 16] = sc;
      qinv[k] = 1.f / sc;
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
    if (j < vecs) store_out<T, Q>(f.out, t * vecs + j, r[k], qinv[k]);
  }
}

// This thread's max |r * w| over its vectors of the row (0 for none): per-token FP8's amax
// before the row's rsqrt (token_amax), reduced with the sum of squares.
template <typename T, int V>
__device__ __forceinline__ float thread_rw_max(uint64_t vecs, const float (&r)[V][8], const uint4 (&wgt)[V]) {
  float m = 0.f;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (threadIdx.x + (uint64_t)k * blockDim.x >= vecs) continue;
    const T* w = (const T*)&wgt[k];
#pragma unroll
    for (int q = 0; q < 8; ++q) m = fmaxf(m, fabsf(r[k][q] * to_f32(w[q])));
  }
  return m;
}

// The static scale as read (QUANT_STATIC; else 0): every fused kernel issues this load at its
// start, so it is in flight across the call counter's, and inverts it at first use (a compare
// and a division that waited for the load there stalled the counter's load behind it).
template <int Q>
__device__ __forceinline__ float early_scale(const RmsArgs& f) {
  return Q == QUANT_STATIC ? *(const float*)f.scale : 0.f;
}

// Item p0 of x (`items` vectors; p0 = blockIdx.x * tp + threadIdx.x), the first vector this
// thread pushes, or 0 for a thread that pushes none. It does not depend on the call, so the LL
// kernels load it before the call counter and the abort word and the latencies overlap (as in
// the LL all-reduce). A row's own loads are not hoisted as well: at 2 ranks that delayed the
// counter load behind them and cost time (bench/NOTES.md, "The fused all-reduce +
// RMSNorm kernels", has the figures); they are issued before the polls instead.
__device__ __forceinline__ uint4 first_push(const uint4* x, uint64_t items, uint64_t tp,
                                            uint64_t p0) {
  uint4 pv = make_uint4(0, 0, 0, 0);
  if (threadIdx.x < tp && p0 < items) pv = x[p0];
  return pv;
}

template <typename T, int Q = QUANT_NONE>
__device__ __forceinline__ void rms_body(const RmsArgs& f) {
  using P = Pack<T, true>;
  constexpr int N = P::N;
  const SymmArgs& a = f.s;
  uint32_t e;
  bool ok;
  const float sraw = early_scale<Q>(f);
  if (!barrier_open(a, e, ok)) return;  // aborted: touch no peer memory
  const uint64_t vecs = f.hidden / N;
  int parity = 0;
  for (uint64_t t = blockIdx.x; ok && t < f.tokens; t += gridDim.x, parity ^= 1) {
    float r[SYMM_RMS_VECS][N];
    float ss[SYMM_RMS_VECS];
#pragma unroll
    for (int k = 0; k < SYMM_RMS_VECS; ++k) {
      ss[k] = 0.f;
      const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
      if (j >= vecs) continue;
      const uint64_t item = t * vecs + j;
      reduce_item<T, OP_SUM, true>(a, item, r[k]);
      const uint4 res = ((const uint4*)f.residual)[item];
      const T* re = (const T*)&res;
#pragma unroll
      for (int q = 0; q < N; ++q) r[k][q] += to_f32(re[q]);
      ss[k] = vec_squares(r[k]);
      ((uint4*)f.residual)[item] = pack<T, true>(r[k]);
    }
    bool all;
    if constexpr (Q != QUANT_NONE) {
      uint4 wgt[SYMM_RMS_VECS];
#pragma unroll
      for (int k = 0; k < SYMM_RMS_VECS; ++k) {
        const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
        if (j < vecs) wgt[k] = ((const uint4*)f.weight)[j];
      }
      float m = Q == QUANT_PER_TOKEN ? thread_rw_max<T, SYMM_RMS_VECS>(vecs, r, wgt) : 0.f;
      const float inv = rsqrtf(block_squares_and<SYMM_RMS_VECS, Q == QUANT_PER_TOKEN>(ss, (uint32_t)vecs, parity, true, all, m) /
                                   (float)f.hidden + f.eps);
      rows_out_fp8<T, SYMM_RMS_VECS, Q>(f, t, vecs, r, wgt, inv, sraw, m);
    } else {
      float m = 0.f;
      const float inv = rsqrtf(block_squares_and(ss, (uint32_t)vecs, parity, true, all, m) / (float)f.hidden + f.eps);
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
  }
  barrier_close(a, e, ok);
}

// Small messages (x up to the LL threshold): the LL protocol of ll.cuh instead of the two
// barriers, so the fused call costs about what the LL all-reduce costs. The grid is fitted to the
// call (src/comm/collective/shape.rs, `fused_ll_shape`): enough blocks to push x with the LL all-reduce's spread (push_threads per
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

template <typename T, int V, int Q = QUANT_NONE>
__device__ __forceinline__ void rms_ll_body(const RmsArgs& f) {
  constexpr int N = 16 / sizeof(T);
  const SymmArgs& a = f.s;
  const uint64_t items = a.count / N;  // hidden is a multiple of 8: whole vectors
  const uint64_t vecs = f.hidden / N;
  const uint4* x = (const uint4*)a.in[a.rank];
  const uint64_t tp = f.push_threads;
  const uint64_t p0 = (uint64_t)blockIdx.x * tp + threadIdx.x;
  uint4 pv = first_push(x, items, tp, p0);
  const float sraw = early_scale<Q>(f);

  uint32_t call;
  if (!ll_begin(a, call)) return;  // aborted: push nothing into the peers' buffers
  const uint32_t buf = call % SYMM_LL_BUFFERS;
  const uint64_t start = globaltimer();
  rms_ll_push<T>(a, tp, p0, pv, buf);
  bool ok = ll_check_desc(a, buf, start);

  int parity = 0;
  // The rows from the host (f.tokens), not count / hidden: the compiler put that division (a
  // 64-bit call, or some 20 dependent instructions with a reciprocal when both fit in 32 bits)
  // ahead of the first loads (what it cost: bench/NOTES.md, "The fused all-reduce + RMSNorm kernels").
  for (uint64_t t = blockIdx.x; ok && t < f.tokens; t += gridDim.x, parity ^= 1) {
    float r[V][N];
    float ss[V];
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
      ss[k] = 0.f;
      const uint64_t j = threadIdx.x + (uint64_t)k * blockDim.x;
      if (j >= vecs) continue;
      const T* re = (const T*)&res[k];
#pragma unroll
      for (int q = 0; q < N; ++q) r[k][q] += to_f32(re[q]);
      ss[k] = vec_squares(r[k]);
    }
    float m = Q == QUANT_PER_TOKEN ? thread_rw_max<T, V>(vecs, r, wgt) : 0.f;
    const float inv =
        rsqrtf(block_squares_and<V, Q == QUANT_PER_TOKEN>(ss, (uint32_t)vecs, parity, mine, ok, m) / (float)f.hidden + f.eps);
    if (!ok) break;
    if constexpr (Q != QUANT_NONE) {
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (threadIdx.x + (uint64_t)k * blockDim.x < vecs)
          ((uint4*)f.residual)[t * vecs + threadIdx.x + (uint64_t)k * blockDim.x] = pack<T, true>(r[k]);
      rows_out_fp8<T, V, Q>(f, t, vecs, r, wgt, inv, sraw, m);
    } else {
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
  }
  ll_end(a, call);
}
