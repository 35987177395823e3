// symmalloc kernels: shared definitions.
//
// Owns: the kernel argument struct (mirrored by src/comm/collective/kernel_args.rs;
// tests/kernel_table.rs checks them field by field), error reporting, element conversion,
// 16-byte vectors, the cross-rank block barrier with the barrier kernels' opening and closing
// steps, and the reductions over every rank's input in rank order (reduce_item, reduce_items,
// and reduce_slice, the loop the two-shot all-reduce and the reduce-scatter share).
//
// Barrier protocol: block b of rank r owns slot pads[r][b][p] for each peer p. To arrive at
// epoch e, thread p of block b writes its call descriptor then e (release, system scope) into
// pads[p][b][r]; it then waits (acquire, system scope) until pads[r][b][p].flag >= e. Epochs
// count up per block index and are kept in `counters` (local memory), so graph replays need no
// reset. A descriptor that differs from the peer's is reported as NOT_SYMMETRIC.
//
// What a spin loop may touch (the rule every wait in kernels/ follows):
//   - its own flag or data words, in this GPU's memory (peers write them over NVLink);
//   - once every SYMM_SPIN_CHECK spins: %globaltimer (a register) and this rank's abort word
//     (device memory of this GPU, an L2 hit). The lanes of a warp spin in step, so that is one
//     load per warp, not per thread;
//   - never host-mapped memory. A PCIe read per spinning thread turned one late peer into
//     self-sustaining 0.4-1.2 ms stalls of captured graphs (docs/DESIGN.md, "What a spin
//     loop may touch"). Kernels only ever *write* the host-mapped error words: one posted
//     store per error, by the thread that records it.
// A wait longer than timeout_ns records TIMEOUT in the abort word; every wait of this kernel
// and of every later kernel of the communicator then stops within SYMM_SPIN_CHECK spins, and
// blocks that start after it skip their work at once, touching no peer memory.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Every constant the host shares with the kernels (limits, error codes, the internal block's
// offsets, unrolls, block sizes): generated from src/comm/collective/kernel_args.rs, checked for
// drift by tests/kernel_table.rs. The layout of the internal block is docs/DESIGN.md,
// "Internal buffer layout".
#include "symm_constants.cuh"

enum { OP_SUM = 0, OP_MAX = 1, OP_MIN = 2 };

struct SymmArgs {
  uint64_t in[SYMM_MAX_RANKS];    // each rank's input, mapped in this rank's address space
  uint64_t out[SYMM_MAX_RANKS];   // each rank's output, likewise
  uint64_t pads[SYMM_MAX_RANKS];  // each rank's signal pad
  uint64_t mc_out;                // multicast address of the output (multimem only)
  uint64_t counters;              // uint32_t[SYMM_MAX_BLOCKS] epochs, local
  uint64_t error_word;            // uint32_t[2], host-mapped, written only: see report()
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

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile_u64(uint64_t* p, uint64_t v) {
  *(volatile uint64_t*)p = v;
}

// The communicator's abort word: 0, or the first fatal error's (code << 16) | (peer + 1). In
// this rank's own internal block (device memory): waits poll it, the host never reads it.
__device__ __forceinline__ uint32_t* abort_word(const SymmArgs& a) {
  return (uint32_t*)(a.pads[a.rank] + SYMM_ABORT_OFFSET);
}

__device__ __forceinline__ bool aborted(const SymmArgs& a) {
  return *(volatile uint32_t*)abort_word(a) != 0;
}

// Host-mapped error words, written by kernels and read by the host at its next call: [0] holds
// a recoverable error of one call (the host clears it), [1] the fatal error (never cleared), so
// a recoverable report can never hide a fatal one. Plain posted stores, not atomics: PCIe
// atomics are not guaranteed, and any one of several concurrent reports is enough.
__device__ __forceinline__ void report_to_host(const SymmArgs& a, int which, uint32_t w) {
  ((volatile uint32_t*)a.error_word)[which] = w;
  __threadfence_system();
}

// A recoverable error: this call did not run (its blocks stop); later calls may.
__device__ __forceinline__ void report(const SymmArgs& a, uint32_t code, int peer) {
  report_to_host(a, 0, (code << 16) | (uint32_t)(peer + 1));
}

// A fatal error (a peer timed out, or the LL buffers may hold a stray call's words): the first
// thread to see one records it in the abort word, which stops every wait of this and every later
// kernel, and tells the host once.
__device__ __forceinline__ void abort_comm(const SymmArgs& a, uint32_t code, int peer) {
  const uint32_t w = (code << 16) | (uint32_t)(peer + 1);
  if (atomicCAS(abort_word(a), 0u, w) == 0u) report_to_host(a, 1, w);
}

// The periodic check of every spinning wait (once per SYMM_SPIN_CHECK spins, so the poll stays
// tight): true when the wait must end, because the communicator was aborted or this thread has
// waited longer than timeout_ns since `start` for `peer` (then it aborts with TIMEOUT).
// give_up_after is the same with a limit of the caller's (a wait that only backs up another).
__device__ __forceinline__ bool give_up_after(const SymmArgs& a, uint32_t& spins, uint64_t start, int peer,
                                              uint64_t limit_ns) {
  if ((++spins % SYMM_SPIN_CHECK) != 0) return false;
  if (aborted(a)) return true;
  if (globaltimer() - start <= limit_ns) return false;
  abort_comm(a, SYMM_ERR_TIMEOUT_CODE, peer);
  return true;
}

__device__ __forceinline__ bool give_up(const SymmArgs& a, uint32_t& spins, uint64_t start, int peer) {
  return give_up_after(a, spins, start, peer, a.timeout_ns);
}

// Every kernel's first step: thread 0 loads the block's word `*word` (a barrier epoch or an LL
// call counter) and the abort word, and every thread gets the word. False when the communicator
// was aborted: the block must then return at once, touching no peer memory. Both loads are in
// flight before either store: a store between them would wait for the first load and serialize
// two L2 round trips (measured: bench/NOTES.md, "What limits small messages").
__device__ __forceinline__ bool block_start(const SymmArgs& a, const uint32_t* word, uint32_t& value) {
  __shared__ uint32_t value_s, dead_s;
  if (threadIdx.x == 0) {
    const uint32_t v0 = *word;
    const uint32_t d0 = *(volatile uint32_t*)abort_word(a);
    value_s = v0;
    dead_s = d0;
  }
  __syncthreads();
  value = value_s;
  return dead_s == 0;
}

// This block's barrier epoch at kernel start, or false when aborted (block_start). Each barrier
// uses the next epoch; epoch_end stores the last one used for the next kernel.
__device__ __forceinline__ bool epoch_begin(const SymmArgs& a, uint32_t& e) {
  return block_start(a, (const uint32_t*)a.counters + blockIdx.x, e);
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

// Every barrier kernel's opening: the block's epoch (epoch_begin) and the call's first barrier,
// which checks the call descriptors. False when the communicator was aborted: the block must
// return at once, touching no peer memory (and not storing its epoch). Otherwise `ok` says
// whether the kernel may do its work.
__device__ __forceinline__ bool barrier_open(const SymmArgs& a, uint32_t& e, bool& ok) {
  if (!epoch_begin(a, e)) return false;
  ok = block_barrier(a, ++e, true);
  return true;
}

// Every barrier kernel's closing: a last barrier unless the kernel already failed (it keeps a
// caller from touching buffers a peer still reads, and its release publishes the block's
// stores into peers' memory), then the epoch stored for the next kernel.
__device__ __forceinline__ void barrier_close(const SymmArgs& a, uint32_t e, bool ok) {
  if (ok) block_barrier(a, ++e, false);
  epoch_end(a, e);
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

// The reduce-my-slice loop of the two-shot all-reduce and the reduce-scatter: this thread's
// items of [begin, end), U per round (item u of a round at i0 + u * blockDim.x, so a block covers
// U * blockDim.x contiguous items; the grid strides over the range), each reduced from every
// rank's input in fixed rank order in fp32 (reduce_items), then handed to `store(i, acc)`, which
// is all that differs between the two: the two-shot stores item i into every rank's output, the
// reduce-scatter into this rank's own.
template <typename T, int OP, bool VEC, int U, typename Store>
__device__ __forceinline__ void reduce_slice(const SymmArgs& a, uint64_t begin, uint64_t end,
                                             Store&& store) {
  const uint64_t span = (uint64_t)gridDim.x * blockDim.x * U;
  for (uint64_t i0 = begin + (uint64_t)blockIdx.x * blockDim.x * U + threadIdx.x; i0 < end;
       i0 += span) {
    float acc[U][Pack<T, VEC>::N];
    reduce_items<T, OP, VEC, U>(a, i0, blockDim.x, end, acc);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint64_t i = i0 + (uint64_t)u * blockDim.x;
      if (i >= end) continue;
      store(i, acc[u]);
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
