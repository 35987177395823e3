// Multimem all-reduce (sm_90+): each rank reduces its slice with one multimem.ld_reduce from
// the multicast address (the NVSwitch sums every rank's copy, fp32 accumulation) and stores the
// result to every rank with one multimem.st. Needs a multicast object bound to the output
// segment; it runs only under the multicast safety rule (README, "Multicast
// safety rule"; src/cuda/multicast_gate.rs).
// In place only (the multicast object covers the output). Items are 16-byte vectors; the
// count must be a multiple of 8 bf16/fp16 elements or 4 fp32 elements.
//
// The body is a template over its memory operation (`Op::template sum_item<DT>(a, i)`: reduce
// item i over every rank and store the result to every rank). Production instantiates only
// MultimemOp, the PTX above; kernels/multimem_unicast.cuh supplies UnicastOp, the same reduction
// through each rank's unicast pointers to its peers' buffers, so a test runs this body's
// slicing, indexing and barriers with no multicast object (docs/multicast.md, "How its logic is
// tested").
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SYMM_HAS_MULTIMEM 1
#endif

template <int DT>  // 0 bf16, 1 fp16, 2 fp32
__device__ __forceinline__ void multimem_sum_item(uint64_t addr) {
#ifdef SYMM_HAS_MULTIMEM
  uint32_t x, y, z, w;
  if (DT == 0) {
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0,%1,%2,%3}, [%4];"
                 : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "l"(addr) : "memory");
    asm volatile("multimem.st.relaxed.sys.global.v4.bf16x2 [%0], {%1,%2,%3,%4};"
                 ::"l"(addr), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
  } else if (DT == 1) {
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0,%1,%2,%3}, [%4];"
                 : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "l"(addr) : "memory");
    asm volatile("multimem.st.relaxed.sys.global.v4.f16x2 [%0], {%1,%2,%3,%4};"
                 ::"l"(addr), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
  } else {
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "l"(addr) : "memory");
    asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};"
                 ::"l"(addr), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
  }
#endif
}

// The real memory operation: one multimem.ld_reduce and one multimem.st on the output's
// multicast address.
struct MultimemOp {
  template <int DT>
  static __device__ __forceinline__ void sum_item(const SymmArgs& a, uint64_t i) {
    multimem_sum_item<DT>(a.mc_out + i * 16);
  }
};

template <int DT, class Op = MultimemOp>
__device__ __forceinline__ void multimem_body(const SymmArgs& a) {
#ifdef SYMM_HAS_MULTIMEM
  uint32_t e;
  bool ok;
  if (!barrier_open(a, e, ok)) return;  // aborted: touch no peer memory
  const uint64_t items = a.count / (DT == 2 ? 4 : 8);
  const uint64_t slice = (items + a.world - 1) / a.world;
  const uint64_t begin = min(items, slice * a.rank);
  const uint64_t end = min(items, begin + slice);
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  if (ok) {
    for (uint64_t i = begin + (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < end; i += stride)
      Op::template sum_item<DT>(a, i);
  }
  barrier_close(a, e, ok);
#else
  if (threadIdx.x == 0 && blockIdx.x == 0) report(a, SYMM_ERR_NO_MULTIMEM_CODE, a.rank);
#endif
}
