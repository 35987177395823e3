// Two-shot all-reduce: reduce-scatter then all-gather through peer stores. Rank r reduces
// slice r of the items (reading every rank) and stores the result into every rank's output.
// Each thread takes UNROLL vectors per round (a block covers UNROLL * blockDim contiguous
// items), so enough NVLink reads are in flight to approach the link rate.
// Each rank reads only its own slice, so it is race-free in place; the closing barrier makes
// every peer's stores into this rank's output visible before the kernel ends. The element tail
// after the last whole vector belongs to the last rank.
#pragma once
#include "common.cuh"

template <typename T, int OP, bool VEC>
__device__ __forceinline__ void two_shot_body(const SymmArgs& a) {
  using P = Pack<T, VEC>;
  uint32_t e;
  bool ok;
  if (!barrier_open(a, e, ok)) return;  // aborted: touch no peer memory
  const uint64_t items = a.count / P::N;
  const uint64_t slice = (items + a.world - 1) / a.world;
  const uint64_t begin = min(items, slice * a.rank);
  const uint64_t end = min(items, begin + slice);
  constexpr int U = VEC ? SYMM_TWO_SHOT_UNROLL : 1;
  if (ok) {
    // Item i of the slice, reduced, into every rank's output.
    reduce_slice<T, OP, VEC, U>(a, begin, end, [&](uint64_t i, const float (&acc)[P::N]) {
      const typename P::Storage s = pack<T, VEC>(acc);
#pragma unroll
      for (int r = 0; r < SYMM_MAX_RANKS; ++r)
        if (r < a.world) ((typename P::Storage*)a.out[r])[i] = s;
    });
    if (VEC && a.rank == a.world - 1 && blockIdx.x == 0) {
      const uint64_t i = items * P::N + threadIdx.x;
      if (i < a.count) {
        float acc[1];
        reduce_item<T, OP, false>(a, i, acc);
        const T s = from_f32<T>(acc[0]);
#pragma unroll
        for (int r = 0; r < SYMM_MAX_RANKS; ++r)
          if (r < a.world) ((T*)a.out[r])[i] = s;
      }
    }
  }
  // The closing barrier's release (after __syncthreads) publishes the block's stores into the
  // peers' outputs; no per-thread system fence (what one cost: bench/history/
  // NOTES-sessions-1-10.md).
  barrier_close(a, e, ok);
}
