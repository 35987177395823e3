// Reduce-scatter and all-gather over the peers' buffers, with the barrier protocol of
// common.cuh (block b of every rank meets block b: the grid is a function of the call alone).
//
// Reduce-scatter: rank r reduces slice r (a.count elements) of every rank's input, in fixed
// rank order in fp32, into its own output. Peers read only their own slice of this rank's
// input, so an output at input + r * count (NCCL's in-place rule) is safe. The closing barrier
// keeps a caller from overwriting an input a peer still reads.
//
// All-gather: rank r pushes its input (a.count elements) to offset r * count of every rank's
// output. The first barrier makes sure every peer's output is free (its stream reached this
// call); the closing barrier's release publishes the stores before any rank returns. An input
// at output + r * count (in place) is copied onto itself, and nobody else writes there.
//
// Items are 16-byte vectors when every buffer peers share is 16-byte aligned and the slice is
// whole vectors (the plan decides, from values equal on every rank: every rank's input for
// reduce-scatter, every rank's output for all-gather), single elements otherwise. The buffer
// only this rank touches (reduce-scatter's output, all-gather's input) may still be unaligned:
// it is then written or read element by element, so ranks never pick different kernels. Small reduce-scatters take the LL kernel below instead.
#pragma once
#include "common.cuh"
#include "ll.cuh"

template <typename T, int OP, bool VEC>
__device__ __forceinline__ void reduce_scatter_body(const SymmArgs& a) {
  using P = Pack<T, VEC>;
  uint32_t e;
  bool ok;
  if (!barrier_open(a, e, ok)) return;  // aborted: touch no peer memory
  const uint64_t items = a.count / P::N;  // this rank's slice
  const uint64_t begin = items * a.rank;
  const bool own_aligned = (a.out[a.rank] & 15) == 0;  // rank-local: not part of VEC
  const uint64_t end = begin + items;
  constexpr int U = VEC ? SYMM_SG_UNROLL : 1;
  if (ok) {
    // Item i of this rank's slice, reduced, into this rank's own output.
    reduce_slice<T, OP, VEC, U>(a, begin, end, [&](uint64_t i, const float (&acc)[P::N]) {
      if (!VEC || own_aligned) {
        ((typename P::Storage*)a.out[a.rank])[i - begin] = pack<T, VEC>(acc);
      } else {  // this rank's output only is not 16-byte aligned: element by element
        T* o = (T*)a.out[a.rank] + (i - begin) * P::N;
#pragma unroll
        for (int k = 0; k < P::N; ++k) o[k] = from_f32<T>(acc[k]);
      }
    });
  }
  barrier_close(a, e, ok);
}

template <typename T, bool VEC>
__device__ __forceinline__ void all_gather_body(const SymmArgs& a) {
  using S = typename Pack<T, VEC>::Storage;
  uint32_t e;
  bool ok;
  if (!barrier_open(a, e, ok)) return;  // aborted: touch no peer memory
  const uint64_t items = a.count / Pack<T, VEC>::N;
  const uint64_t at = items * a.rank;
  const bool own_aligned = (a.in[a.rank] & 15) == 0;  // rank-local: not part of VEC
  constexpr int U = VEC ? SYMM_SG_UNROLL : 1;
  if (ok) {
    for (uint64_t i0 = (uint64_t)blockIdx.x * blockDim.x * U + threadIdx.x; i0 < items;
         i0 += (uint64_t)gridDim.x * blockDim.x * U) {
      S v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // U loads in flight before the stores
        const uint64_t i = i0 + (uint64_t)u * blockDim.x;
        if (i >= items) continue;
        if (!VEC || own_aligned) {
          v[u] = ((const S*)a.in[a.rank])[i];
        } else {  // this rank's input only is not 16-byte aligned: element by element
          T* e = (T*)&v[u];
#pragma unroll
          for (int k = 0; k < Pack<T, VEC>::N; ++k) e[k] = ((const T*)a.in[a.rank])[i * Pack<T, VEC>::N + k];
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint64_t i = i0 + (uint64_t)u * blockDim.x;
        if (i >= items) continue;
#pragma unroll
        for (int r = 0; r < SYMM_MAX_RANKS; ++r)
          if (r < a.world) ((S*)a.out[r])[at + i] = v[u];
      }
    }
  }
  barrier_close(a, e, ok);
}

// Reduce-scatter of small slices (up to AUTO's LL threshold) with the LL protocol (ll.cuh), no
// barrier: every rank pushes slice p of its input into its slot of peer p's LL buffer, then
// reduces its own slice from the slots in rank order. Peers never read this rank's buffers, so
// no closing barrier either. The launch picks it from values equal on every rank (the input's
// offset and the slice's size, whole 16-byte vectors), never from the output, which is
// rank-local: an output that is not 16-byte aligned is written element by element. Blocks run
// on the LL grid fitted to the slice and keep the call counters in step (ll_end).
template <typename T, int OP>
__device__ __forceinline__ void reduce_scatter_ll_body(const SymmArgs& a) {
  constexpr int N = 16 / sizeof(T);
  uint32_t call;
  if (!ll_begin(a, call)) return;  // aborted: push nothing into the peers' buffers
  const uint32_t buf = call % SYMM_LL_BUFFERS;
  const uint64_t start = globaltimer();
  const uint64_t items = a.count / N;  // this rank's slice, whole vectors (the launch checks)
  const uint4* x = (const uint4*)a.in[a.rank];
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t first = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (uint64_t i = first; i < items; i += stride) {
#pragma unroll
    for (int p = 0; p < SYMM_MAX_RANKS; ++p) {
      if (p >= a.world || p == a.rank) continue;
      ll_push_to<T>(a, p, buf, i, x[(uint64_t)p * items + i]);
    }
  }
  bool ok = ll_check_desc(a, buf, start);
  const bool vec_out = (a.out[a.rank] & 15) == 0;
  for (uint64_t i = first; ok && i < items; i += stride) {
    uint4 own = x[(uint64_t)a.rank * items + i];
    ll_sanitize<T>(own);
    float acc[N];
    if (!ll_reduce<T, OP>(a, buf, i, own, start, acc)) {
      ok = false;
      break;
    }
    if (vec_out) {
      ((uint4*)a.out[a.rank])[i] = pack<T, true>(acc);
    } else {
      T* o = (T*)a.out[a.rank] + i * N;
#pragma unroll
      for (int k = 0; k < N; ++k) o[k] = from_f32<T>(acc[k]);
    }
  }
  ll_end(a, call);
}
