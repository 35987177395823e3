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
// Items are 16-byte vectors when every pointer and slice is 16-byte aligned (the launch
// decides), single elements otherwise.
#include "common.cuh"

// Vectors per thread per round (kernel_args.rs mirrors it).
#define SYMM_SG_UNROLL 4

template <typename T, int OP, bool VEC>
__device__ __forceinline__ void reduce_scatter_body(const SymmArgs& a) {
  using P = Pack<T, VEC>;
  uint32_t e;
  if (!epoch_begin(a, e)) return;  // aborted: touch no peer memory
  bool ok = block_barrier(a, ++e, true);
  const uint64_t items = a.count / P::N;  // this rank's slice
  const uint64_t begin = items * a.rank;
  const uint64_t end = begin + items;
  constexpr int U = VEC ? SYMM_SG_UNROLL : 1;
  const uint64_t span = (uint64_t)gridDim.x * blockDim.x * U;
  if (ok) {
    for (uint64_t i0 = begin + (uint64_t)blockIdx.x * blockDim.x * U + threadIdx.x; i0 < end;
         i0 += span) {
      float acc[U][P::N];
      reduce_items<T, OP, VEC, U>(a, i0, blockDim.x, end, acc);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint64_t i = i0 + (uint64_t)u * blockDim.x;
        if (i < end) ((typename P::Storage*)a.out[a.rank])[i - begin] = pack<T, VEC>(acc[u]);
      }
    }
    ok = block_barrier(a, ++e, false);
  }
  epoch_end(a, e);
}

template <typename T, bool VEC>
__device__ __forceinline__ void all_gather_body(const SymmArgs& a) {
  using S = typename Pack<T, VEC>::Storage;
  uint32_t e;
  if (!epoch_begin(a, e)) return;  // aborted: touch no peer memory
  bool ok = block_barrier(a, ++e, true);
  const uint64_t items = a.count / Pack<T, VEC>::N;
  const uint64_t at = items * a.rank;
  constexpr int U = VEC ? SYMM_SG_UNROLL : 1;
  if (ok) {
    for (uint64_t i0 = (uint64_t)blockIdx.x * blockDim.x * U + threadIdx.x; i0 < items;
         i0 += (uint64_t)gridDim.x * blockDim.x * U) {
      S v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // U loads in flight before the stores
        const uint64_t i = i0 + (uint64_t)u * blockDim.x;
        if (i < items) v[u] = ((const S*)a.in[a.rank])[i];
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
    ok = block_barrier(a, ++e, false);
  }
  epoch_end(a, e);
}

#define SYMM_REDUCE_SCATTER(NAME, T, OP, VEC) \
  extern "C" __global__ void __launch_bounds__(SYMM_THREADS) NAME(SymmArgs a) { reduce_scatter_body<T, OP, VEC>(a); }
#define SYMM_ALL_GATHER(NAME, T, VEC) \
  extern "C" __global__ void __launch_bounds__(SYMM_THREADS) NAME(SymmArgs a) { all_gather_body<T, VEC>(a); }

SYMM_REDUCE_SCATTER(symm_reduce_scatter_bf16_sum_vec, __nv_bfloat16, OP_SUM, true)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_bf16_max_vec, __nv_bfloat16, OP_MAX, true)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_bf16_min_vec, __nv_bfloat16, OP_MIN, true)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp16_sum_vec, __half, OP_SUM, true)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp16_max_vec, __half, OP_MAX, true)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp16_min_vec, __half, OP_MIN, true)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp32_sum_vec, float, OP_SUM, true)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp32_max_vec, float, OP_MAX, true)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp32_min_vec, float, OP_MIN, true)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_bf16_sum_scalar, __nv_bfloat16, OP_SUM, false)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_bf16_max_scalar, __nv_bfloat16, OP_MAX, false)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_bf16_min_scalar, __nv_bfloat16, OP_MIN, false)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp16_sum_scalar, __half, OP_SUM, false)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp16_max_scalar, __half, OP_MAX, false)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp16_min_scalar, __half, OP_MIN, false)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp32_sum_scalar, float, OP_SUM, false)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp32_max_scalar, float, OP_MAX, false)
SYMM_REDUCE_SCATTER(symm_reduce_scatter_fp32_min_scalar, float, OP_MIN, false)
SYMM_ALL_GATHER(symm_all_gather_bf16_vec, __nv_bfloat16, true)
SYMM_ALL_GATHER(symm_all_gather_fp16_vec, __half, true)
SYMM_ALL_GATHER(symm_all_gather_fp32_vec, float, true)
SYMM_ALL_GATHER(symm_all_gather_bf16_scalar, __nv_bfloat16, false)
SYMM_ALL_GATHER(symm_all_gather_fp16_scalar, __half, false)
SYMM_ALL_GATHER(symm_all_gather_fp32_scalar, float, false)
