// One-shot LL (low-latency) all-reduce: barrier-free, the data carries its own flags
// (ll.cuh; docs/DESIGN.md, "LL protocol"). Every rank pushes its input into a slot of every
// peer's LL buffer, then pulls each peer's items from its own buffer and reduces them with its
// own input, in fixed rank order. User buffers are only touched locally, so in place needs no
// extra care. Items are 16-byte vectors; with VEC false the elements past the last whole vector
// are read and written one by one (the scalar variant serves unaligned buffers).
#pragma once
#include "ll.cuh"

// Item i (16 bytes) of this rank's input; elements past count read as 0.
template <typename T, bool VEC>
__device__ __forceinline__ uint4 ll_load_input(const SymmArgs& a, uint64_t i) {
  constexpr int N = 16 / sizeof(T);
  const uint64_t first = i * N;
  if (VEC && first + N <= a.count) return ((const uint4*)a.in[a.rank])[i];
  uint4 v = make_uint4(0, 0, 0, 0);
  T* e = (T*)&v;
  const T* in = (const T*)a.in[a.rank];
#pragma unroll
  for (int k = 0; k < N; ++k)
    if (first + k < a.count) e[k] = in[first + k];
  return v;
}

template <typename T, bool VEC>
__device__ __forceinline__ void ll_store_output(const SymmArgs& a, uint64_t i, uint4 v) {
  constexpr int N = 16 / sizeof(T);
  const uint64_t first = i * N;
  if (VEC && first + N <= a.count) {
    ((uint4*)a.out[a.rank])[i] = v;
    return;
  }
  const T* e = (const T*)&v;
  T* out = (T*)a.out[a.rank];
#pragma unroll
  for (int k = 0; k < N; ++k)
    if (first + k < a.count) out[first + k] = e[k];
}

template <typename T, int OP, bool VEC>
__device__ __forceinline__ void one_shot_ll_body(const SymmArgs& a) {
  constexpr int N = 16 / sizeof(T);
  const uint64_t items = (a.count + N - 1) / N;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t first = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  // The thread's first input vector does not depend on the call: in flight before the counter
  // and abort-word loads, so the two latencies overlap; the pull reuses it.
  const uint4 first_in = first < items ? ll_load_input<T, VEC>(a, first) : make_uint4(0, 0, 0, 0);
  uint32_t call;
  if (!ll_begin(a, call)) return;  // aborted: push nothing into the peers' buffers
  const uint32_t buf = call % SYMM_LL_BUFFERS;
  const uint64_t start = globaltimer();

  // Push: small grids of small blocks spread a message over many SMs (one SM's stores to a
  // peer are the bottleneck otherwise).
  for (uint64_t i = first; i < items; i += stride)
    ll_push<T>(a, buf, i, i == first ? first_in : ll_load_input<T, VEC>(a, i));
  bool ok = ll_check_desc(a, buf, start);

  // Pull: wait for every peer's item, reduce in rank order, reset the words read.
  for (uint64_t i = first; ok && i < items; i += stride) {
    uint4 own = i == first ? first_in : ll_load_input<T, VEC>(a, i);
    ll_sanitize<T>(own);
    float acc[N];
    if (!ll_reduce<T, OP>(a, buf, i, own, start, acc)) {
      ok = false;
      break;
    }
    ll_store_output<T, VEC>(a, i, pack<T, true>(acc));
  }
  ll_end(a, call);
}
