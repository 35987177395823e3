// The FP8 (e4m3) output of the fused all-reduce + residual + RMSNorm kernels (rms_norm.cuh): the
// quantization epilogue applied to the fp32 value y = r * inv_rms * weight the kernel already
// holds (no round trip through bf16/fp16). docs/DESIGN.md, "Quantized output", is the reference;
// the host backend does the same arithmetic in software (src/comm/collective/host_norm.rs).
//
//   q = e4m3(y * (1 / s))   round to nearest even, saturated to +-448 (cvt ... satfinite: an
//                           infinite or too large product gives +-448), NaN stays NaN (0x7f)
//   QUANT_STATIC:    s = *scale, one fp32 read from device memory by every thread at kernel
//                    start (so a captured graph sees the value of each replay). An s that is not
//                    finite and > 0 makes every q NaN (static_inv), never a hang.
//   QUANT_PER_TOKEN: s_t = max(amax_t / 448, FLT_MIN), amax_t = max |y| over row t (NaN ignored),
//                    written to scale[t]. Here y = (r * w) * inv (the other modes: (r * inv) * w),
//                    so amax_t = max(RN(max |r * w| * inv), 0) exactly (token_amax): every
//                    kernel reduces max |r * w| with the row's sum of squares (the cluster kernel
//                    in its one exchange, the others through block_squares_and's one barrier), a
//                    warp's max in one redux (warp_max), so the scale needs no reduction of its own.
//   QUANT_PER_GROUP: one s per 128 consecutive elements of a row (16 vectors: half a warp's
//                    lanes, which hold consecutive vectors in every fused kernel), the same
//                    formula over the group, written to scale[t * (hidden / 128) + g]: row-major
//                    [tokens, hidden / 128] (hidden % 128 == 0, checked by the host).
// A max is exact and order-free, so the scales and q depend on the row's values only, never on
// the kernel or the row count: the determinism of the bf16 output carries over.
// Multiplying by the reciprocal (vLLM's static quant does the same) instead of dividing: the two
// differ by at most one fp32 ulp before the e4m3 rounding.
#pragma once
#include <cuda_fp8.h>
#include <float.h>

#include "common.cuh"

// Template values of the fused kernels' output; 0-2 are the C ABI's symm_quant_t.
enum { QUANT_NONE = -1, QUANT_STATIC = 0, QUANT_PER_TOKEN = 1, QUANT_PER_GROUP = 2 };

#define SYMM_FP8_MAX 448.f

// 1 / s of a static scale, NaN unless s is finite and > 0 (then every q is NaN).
__device__ __forceinline__ float static_inv(float s) {
  return (s > 0.f && s <= FLT_MAX) ? 1.f / s : __int_as_float(0x7fffffff);
}

// The scale of an amax: max(amax / 448, FLT_MIN).
__device__ __forceinline__ float amax_scale(float amax) { return fmaxf(amax / SYMM_FP8_MAX, FLT_MIN); }

// s rounded up to a power of two (UE8M0 scales: the MoE dispatch's option): a positive normal s
// with a nonzero mantissa goes to the next power of two; powers of two and +inf stay. Host
// mirror: src/comm/collective/host_norm.rs ue8m0_ceil.
__device__ __forceinline__ float ue8m0_ceil(float s) {
  const uint32_t b = __float_as_uint(s);
  return (b & 0x7fffffu) ? __uint_as_float((b & 0x7f800000u) + 0x800000u) : s;
}

// max |y| over a vector's 8 values (NaN ignored: fmaxf returns the other operand).
__device__ __forceinline__ float vec_amax(const float (&y)[8]) {
  float m = 0.f;
#pragma unroll
  for (int q = 0; q < 8; ++q) m = fmaxf(m, fabsf(y[q]));
  return m;
}

// The max over lanes l .. l ^ 15 (a half warp: 16 vectors, one group of 128 elements). Every lane
// of the warp calls it.
__device__ __forceinline__ float half_warp_max(float m) {
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// The max over the warp, for m >= 0 and not NaN in every lane (every amax here: fmaxf from 0
// over fabsf values): there the float order is the order of the bits as unsigned integers, so
// one redux.sync (sm_80+) replaces a five-shuffle butterfly. Every lane calls it and gets it.
__device__ __forceinline__ float warp_max(float m) {
  return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(m)));
}

// 8 values as 8 e4m3 bytes, element 0 in the lowest byte: q = e4m3(y * inv), RNE, satfinite.
__device__ __forceinline__ uint2 to_e4m3x8(const float (&y)[8], float inv) {
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(y[4 * h] * inv, y[4 * h + 1] * inv),
                                                 __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(y[4 * h + 2] * inv, y[4 * h + 3] * inv),
                                                 __NV_SATFINITE, __NV_E4M3);
    w[h] = (lo & 0xffffu) | (hi << 16);
  }
  return make_uint2(w[0], w[1]);
}

// Vector `at` of the output: T (16 bytes) for QUANT_NONE, 8 e4m3 bytes otherwise.
template <typename T, int Q>
__device__ __forceinline__ void store_out(uint64_t out, uint64_t at, const float (&y)[8], float inv) {
  if constexpr (Q == QUANT_NONE) {
    ((uint4*)out)[at] = pack<T, true>(y);
  } else {
    ((uint2*)out)[at] = to_e4m3x8(y, inv);
  }
}

// A row's amax from m = max |r * w| over the row and inv = its rsqrt: max |RN(rw * inv)| =
// RN(m * inv) (rounding is monotone and odd, and inv >= 0), so the per-token scale needs no
// reduction of its own (m travels with the sum). fmaxf(., 0) gives what the direct max gives where m * inv is NaN (0 * inf
// or inf * 0: every y is then 0 or NaN, and NaN is ignored).
__device__ __forceinline__ float token_amax(float m, float inv) { return fmaxf(m * inv, 0.f); }
