// One-shot all-reduce: every rank reads every rank's input and reduces locally.
// Best for small messages: one barrier, one NVLink read round trip, no second phase.
//
// Items are 16-byte vectors (VEC) or single elements; the elements after the last whole
// vector (the tail) are done by block 0 as single elements. In place, every round reads all
// ranks, meets the peers at a barrier, then writes, so no rank overwrites data a peer still
// reads; that barrier also ends the last round's reads, so no closing barrier is needed.
// Out of place, a closing barrier keeps the caller from overwriting an input a peer still reads.
#pragma once
#include "common.cuh"

template <typename T, int OP, bool VEC>
__device__ __forceinline__ void one_shot_body(const SymmArgs& a) {
  using P = Pack<T, VEC>;
  uint32_t e;
  bool ok;
  if (!barrier_open(a, e, ok)) return;  // aborted: touch no peer memory
  const uint64_t items = a.count / P::N;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t rounds = (items + stride - 1) / stride;
  for (uint64_t round = 0; ok && round < rounds; ++round) {
    const uint64_t i = round * stride + (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    float acc[P::N];
    if (i < items) reduce_item<T, OP, VEC>(a, i, acc);
    if (a.in_place) ok = block_barrier(a, ++e, false);
    if (ok && i < items) ((typename P::Storage*)a.out[a.rank])[i] = pack<T, VEC>(acc);
  }
  if (VEC && blockIdx.x == 0 && ok && items * P::N < a.count) {  // a tail exists
    const uint64_t first = items * P::N;
    const uint64_t i = first + threadIdx.x;
    float acc[1];
    bool mine = i < a.count;
    if (mine) reduce_item<T, OP, false>(a, i, acc);
    if (a.in_place) ok = block_barrier(a, ++e, false);
    if (ok && mine) ((T*)a.out[a.rank])[i] = from_f32<T>(acc[0]);
  }
  barrier_close(a, e, ok && !a.in_place);
}
