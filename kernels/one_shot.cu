// One-shot all-reduce: every rank reads every rank's input and reduces locally.
// Best for small messages: one barrier, one NVLink read round trip, no second phase.
//
// Items are 16-byte vectors (VEC) or single elements; the elements after the last whole
// vector (the tail) are done by block 0 as single elements. In place, every round reads all
// ranks, meets the peers at a barrier, then writes, so no rank overwrites data a peer still
// reads; that barrier also ends the last round's reads, so no closing barrier is needed.
// Out of place, a closing barrier keeps the caller from overwriting an input a peer still reads.
#include "common.cuh"

template <typename T, int OP, bool VEC>
__device__ __forceinline__ void one_shot_body(const SymmArgs& a) {
  using P = Pack<T, VEC>;
  uint32_t e;
  if (!epoch_begin(a, e)) return;  // aborted: touch no peer memory
  bool ok = block_barrier(a, ++e, true);
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
  if (ok && !a.in_place) ok = block_barrier(a, ++e, false);
  epoch_end(a, e);
}

#define SYMM_ONE_SHOT(NAME, T, OP, VEC) \
  extern "C" __global__ void __launch_bounds__(SYMM_THREADS) NAME(SymmArgs a) { one_shot_body<T, OP, VEC>(a); }

SYMM_ONE_SHOT(symm_one_shot_bf16_sum_vec, __nv_bfloat16, OP_SUM, true)
SYMM_ONE_SHOT(symm_one_shot_bf16_max_vec, __nv_bfloat16, OP_MAX, true)
SYMM_ONE_SHOT(symm_one_shot_bf16_min_vec, __nv_bfloat16, OP_MIN, true)
SYMM_ONE_SHOT(symm_one_shot_fp16_sum_vec, __half, OP_SUM, true)
SYMM_ONE_SHOT(symm_one_shot_fp16_max_vec, __half, OP_MAX, true)
SYMM_ONE_SHOT(symm_one_shot_fp16_min_vec, __half, OP_MIN, true)
SYMM_ONE_SHOT(symm_one_shot_fp32_sum_vec, float, OP_SUM, true)
SYMM_ONE_SHOT(symm_one_shot_fp32_max_vec, float, OP_MAX, true)
SYMM_ONE_SHOT(symm_one_shot_fp32_min_vec, float, OP_MIN, true)
SYMM_ONE_SHOT(symm_one_shot_bf16_sum_scalar, __nv_bfloat16, OP_SUM, false)
SYMM_ONE_SHOT(symm_one_shot_bf16_max_scalar, __nv_bfloat16, OP_MAX, false)
SYMM_ONE_SHOT(symm_one_shot_bf16_min_scalar, __nv_bfloat16, OP_MIN, false)
SYMM_ONE_SHOT(symm_one_shot_fp16_sum_scalar, __half, OP_SUM, false)
SYMM_ONE_SHOT(symm_one_shot_fp16_max_scalar, __half, OP_MAX, false)
SYMM_ONE_SHOT(symm_one_shot_fp16_min_scalar, __half, OP_MIN, false)
SYMM_ONE_SHOT(symm_one_shot_fp32_sum_scalar, float, OP_SUM, false)
SYMM_ONE_SHOT(symm_one_shot_fp32_max_scalar, float, OP_MAX, false)
SYMM_ONE_SHOT(symm_one_shot_fp32_min_scalar, float, OP_MIN, false)
