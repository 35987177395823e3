// Multimem all-reduce (sm_90+): each rank reduces its slice with one multimem.ld_reduce from
// the multicast address (the NVSwitch sums every rank's copy, fp32 accumulation) and stores the
// result to every rank with one multimem.st. Needs a multicast object bound to the output
// segment; it runs only under the multicast safety rule (see DESIGN.md and src/comm/multicast.rs).
// In place only (the multicast object covers the output). Items are 16-byte vectors; the
// count must be a multiple of 8 bf16/fp16 elements or 4 fp32 elements.
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

template <int DT>
__device__ __forceinline__ void multimem_body(const SymmArgs& a) {
#ifdef SYMM_HAS_MULTIMEM
  uint32_t e;
  if (!epoch_begin(a, e)) return;  // aborted: touch no peer memory
  bool ok = block_barrier(a, ++e, true);
  const uint64_t items = a.count / (DT == 2 ? 4 : 8);
  const uint64_t slice = (items + a.world - 1) / a.world;
  const uint64_t begin = min(items, slice * a.rank);
  const uint64_t end = min(items, begin + slice);
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  if (ok) {
    for (uint64_t i = begin + (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < end; i += stride)
      multimem_sum_item<DT>(a.mc_out + i * 16);
    ok = block_barrier(a, ++e, false);
  }
  epoch_end(a, e);
#else
  if (threadIdx.x == 0 && blockIdx.x == 0) report(a, SYMM_ERR_NO_MULTIMEM_CODE, a.rank);
#endif
}

extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_multimem_bf16_sum_vec(SymmArgs a) { multimem_body<0>(a); }
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_multimem_fp16_sum_vec(SymmArgs a) { multimem_body<1>(a); }
extern "C" __global__ void __launch_bounds__(SYMM_THREADS) symm_multimem_fp32_sum_vec(SymmArgs a) { multimem_body<2>(a); }
