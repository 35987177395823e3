// All-reduce fused with residual add and RMSNorm, for tensor-parallel inference:
//   r = allreduce_sum(x) + residual   (fp32: every rank's x in fixed rank order, then residual)
//   residual <- r (rounded to T);  out <- r * rsqrt(mean(r^2) + eps) * weight (rounded to T)
// x, residual and out are [tokens, hidden]; weight is [hidden]. Only x is read by peers
// (one-shot: every rank reads every rank's row, so every rank computes the same bits); residual,
// out and weight are this rank's own. A block takes whole rows (a grid-stride loop over tokens):
// the sum of squares is a block reduction in a fixed tree order, so the result does not depend
// on timing. The first barrier makes every rank's x ready; the closing barrier keeps a caller
// from overwriting x while a peer still reads it. 16-byte vectors: hidden is a multiple of 8
// and every pointer is 16-byte aligned (the launch checks).
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
  float reserved;
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

extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_all_reduce_add_rms_norm_bf16(RmsArgs f) {
  rms_body<__nv_bfloat16>(f);
}
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_all_reduce_add_rms_norm_fp16(RmsArgs f) {
  rms_body<__half>(f);
}
