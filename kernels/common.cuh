// symmalloc kernels: shared definitions.
//
// Owns: the kernel argument struct (mirrored by src/comm/kernel_args.rs, keep in step), the
// signal-pad layout, element conversion, 16-byte vectors, and the cross-rank block barrier.
//
// Barrier protocol: block b of rank r owns slot pads[r][b][p] for each peer p. To arrive at
// epoch e, thread p of block b writes its call descriptor then e (release, system scope) into
// pads[p][b][r]; it then waits (acquire, system scope) until pads[r][b][p].flag >= e. Epochs
// count up per block index and are kept in `counters` (local memory), so graph replays need no
// reset. A wait longer than timeout_ns sets the host-visible error word and the kernel stops
// touching peer memory; a descriptor that differs from the peer's sets NOT_SYMMETRIC.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define SYMM_MAX_RANKS 8
#define SYMM_MAX_BLOCKS 128
#define SYMM_THREADS 512

#define SYMM_ERR_TIMEOUT_CODE 1u
#define SYMM_ERR_ASYMMETRIC_CODE 2u
#define SYMM_ERR_NO_MULTIMEM_CODE 3u
#define SYMM_ERR_LL_ASYMMETRIC_CODE 4u

enum { OP_SUM = 0, OP_MAX = 1, OP_MIN = 2 };

struct SymmArgs {
  uint64_t in[SYMM_MAX_RANKS];    // each rank's input, mapped in this rank's address space
  uint64_t out[SYMM_MAX_RANKS];   // each rank's output, likewise
  uint64_t pads[SYMM_MAX_RANKS];  // each rank's signal pad
  uint64_t mc_out;                // multicast address of the output (multimem only)
  uint64_t counters;              // uint32_t[SYMM_MAX_BLOCKS] epochs, local
  uint64_t error_word;            // uint32_t, host-mapped: (code << 16) | (rank + 1)
  uint64_t count;                 // elements
  uint64_t desc;                  // hash of (offsets, count, dtype, op, algo): equal on all ranks
  uint64_t timeout_ns;
  int32_t rank;
  int32_t world;
  int32_t in_place;
  int32_t ll_slot_kib;             // one-shot LL: bytes per sender slot / 1024
};

struct Slot {
  uint32_t flag;
  uint32_t pad;
  uint64_t desc;
};

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile_u64(uint64_t* p, uint64_t v) {
  *(volatile uint64_t*)p = v;
}

// A plain store, not an atomic: the word lives in host memory and PCIe atomics are not
// guaranteed. Any one of several concurrent reports is enough.
__device__ __forceinline__ void report(const SymmArgs& a, uint32_t code, int peer) {
  *(volatile uint32_t*)a.error_word = (code << 16) | (uint32_t)(peer + 1);
  __threadfence_system();
}

__device__ __forceinline__ bool failed(const SymmArgs& a) {
  return *(volatile uint32_t*)a.error_word != 0;
}

// The periodic check of every spinning wait (once per 1024 spins, so the poll stays tight):
// true when the wait must end, because another thread has already reported an error or this
// one has waited longer than timeout_ns since `start` for `peer` (reported as TIMEOUT).
__device__ __forceinline__ bool give_up(const SymmArgs& a, uint32_t& spins, uint64_t start, int peer) {
  if ((++spins & 1023u) != 0) return false;
  if (failed(a)) return true;
  if (globaltimer() - start <= a.timeout_ns) return false;
  report(a, SYMM_ERR_TIMEOUT_CODE, peer);
  return true;
}

// This block's barrier epoch at kernel start (every thread gets it). Each barrier uses the
// next value; epoch_end stores the last one used for the next kernel.
__device__ __forceinline__ uint32_t epoch_begin(const SymmArgs& a) {
  __shared__ uint32_t epoch;
  if (threadIdx.x == 0) epoch = ((const uint32_t*)a.counters)[blockIdx.x];
  __syncthreads();
  return epoch;
}

__device__ __forceinline__ void epoch_end(const SymmArgs& a, uint32_t e) {
  if (threadIdx.x == 0) ((uint32_t*)a.counters)[blockIdx.x] = e;
}

// All threads of the block call this. Returns false when the kernel must stop. The descriptor
// is compared only at a call's first barrier (check_desc): a peer cannot leave the call before
// this rank reaches its last barrier, so what it left in our slot is still this call's.
__device__ __forceinline__ bool block_barrier(const SymmArgs& a, uint32_t epoch, bool check_desc) {
  __syncthreads();  // the block's earlier stores happen before the release below
  int ok = 1;
  const int p = threadIdx.x;
  if (p < a.world && p != a.rank) {
    Slot* remote = (Slot*)a.pads[p] + blockIdx.x * SYMM_MAX_RANKS + a.rank;
    st_volatile_u64(&remote->desc, a.desc);
    st_release_sys(&remote->flag, epoch);
    Slot* mine = (Slot*)a.pads[a.rank] + blockIdx.x * SYMM_MAX_RANKS + p;
    const uint64_t start = globaltimer();
    uint32_t spins = 0;
    while ((int32_t)(ld_acquire_sys(&mine->flag) - epoch) < 0) {
      if (give_up(a, spins, start, p)) {
        ok = 0;
        break;
      }
    }
    if (ok && check_desc && *(volatile uint64_t*)&mine->desc != a.desc) {
      report(a, SYMM_ERR_ASYMMETRIC_CODE, p);
      ok = 0;
    }
  }
  return __syncthreads_and(ok) != 0;
}

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <int OP> __device__ __forceinline__ float combine(float x, float y) {
  if (OP == OP_SUM) return x + y;
  if (OP == OP_MAX) return fmaxf(x, y);
  return fminf(x, y);
}

template <bool C, typename A, typename B> struct Select { using type = A; };
template <typename A, typename B> struct Select<false, A, B> { using type = B; };

// A 16-byte vector of T, or a single T when VEC is false.
template <typename T, bool VEC> struct Pack {
  static constexpr int N = VEC ? 16 / sizeof(T) : 1;
  using Storage = typename Select<VEC, uint4, T>::type;
};

// Loads item i of every rank's input and reduces in fixed rank order, in fp32.
template <typename T, int OP, bool VEC>
__device__ __forceinline__ void reduce_item(const SymmArgs& a, uint64_t i,
                                            float (&acc)[Pack<T, VEC>::N]) {
  using P = Pack<T, VEC>;
  typename P::Storage v[SYMM_MAX_RANKS];
#pragma unroll
  for (int r = 0; r < SYMM_MAX_RANKS; ++r)
    if (r < a.world) v[r] = ((const typename P::Storage*)a.in[r])[i];
#pragma unroll
  for (int r = 0; r < SYMM_MAX_RANKS; ++r) {
    if (r < a.world) {
      const T* e = (const T*)&v[r];
#pragma unroll
      for (int k = 0; k < P::N; ++k) acc[k] = r == 0 ? to_f32(e[k]) : combine<OP>(acc[k], to_f32(e[k]));
    }
  }
}

// U items per thread (item u at i0 + u * step, those >= end skipped): the loads of two ranks
// for all U items are in flight together (enough to cover NVLink latency at two ranks without
// holding every rank's data in registers), then reduced in fixed rank order, in fp32.
template <typename T, int OP, bool VEC, int U>
__device__ __forceinline__ void reduce_items(const SymmArgs& a, uint64_t i0, uint64_t step,
                                             uint64_t end, float (&acc)[U][Pack<T, VEC>::N]) {
  using P = Pack<T, VEC>;
#pragma unroll
  for (int r0 = 0; r0 < SYMM_MAX_RANKS; r0 += 2) {
    if (r0 >= a.world) break;
    typename P::Storage v[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (r0 + j < a.world && i0 + u * step < end)
          v[u][j] = ((const typename P::Storage*)a.in[r0 + j])[i0 + u * step];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (r0 + j >= a.world) continue;
        const T* e = (const T*)&v[u][j];
#pragma unroll
        for (int k = 0; k < P::N; ++k)
          acc[u][k] = r0 + j == 0 ? to_f32(e[k]) : combine<OP>(acc[u][k], to_f32(e[k]));
      }
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ typename Pack<T, VEC>::Storage pack(const float (&acc)[Pack<T, VEC>::N]) {
  typename Pack<T, VEC>::Storage s;
  T* e = (T*)&s;
#pragma unroll
  for (int k = 0; k < Pack<T, VEC>::N; ++k) e[k] = from_f32<T>(acc[k]);
  return s;
}
