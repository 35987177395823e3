// Test only: the multimem all-reduce body (kernels/multimem.cuh) with its memory operation done
// through unicast pointers, so its slicing, indexing and barriers run where no multicast object
// may exist. Never part of the library: build.rs compiles kernels/*.cu only, and nothing there
// includes this file. The test program tests/multimem_unicast/multimem_unicast.cu instantiates
// it (its kernels live there, outside the kernel table that tests/kernel_table.rs checks), and
// `make test-multimem-unicast` checks that program's PTX for the absence of multimem instructions.
//
// UnicastOp::sum_item<DT>(a, i) stands for one multimem.ld_reduce + multimem.st on item i: it
// loads item i (16 bytes) from every rank's buffer through this rank's pointers to them, sums in
// fp32 in rank order 0..world-1, rounds once to the element type, and stores the result into
// every rank's output. The real instruction accumulates in fp32 too (`.acc::f32` for bf16/fp16,
// f32 adds for fp32) but PTX leaves the order in which the switch adds the ranks' copies
// unspecified, so the fixed order here is the test's choice: it makes the result reproducible on
// the host bit for bit. With either, every rank holds the same bits, because each item is
// reduced once, by the rank whose slice holds it, and that one result is stored to every rank.
// It reads a.in[r] and writes a.out[r]: production multimem is in place (in == out, the call
// check refuses anything else), which the test runs; with in != out the test can poison every
// output first and see each element written.
#pragma once
#include "multimem.cuh"

template <int DT> struct MultimemElem;  // 0 bf16, 1 fp16, 2 fp32, as multimem_body's DT
template <> struct MultimemElem<0> { using T = __nv_bfloat16; };
template <> struct MultimemElem<1> { using T = __half; };
template <> struct MultimemElem<2> { using T = float; };

struct UnicastOp {
  template <int DT>
  static __device__ __forceinline__ void sum_item(const SymmArgs& a, uint64_t i) {
    using T = typename MultimemElem<DT>::T;
    constexpr int N = 16 / sizeof(T);
    uint4 v[SYMM_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < SYMM_MAX_RANKS; ++r)
      if (r < a.world) v[r] = ((const uint4*)a.in[r])[i];
    float acc[N];
#pragma unroll
    for (int r = 0; r < SYMM_MAX_RANKS; ++r) {
      if (r < a.world) {
        const T* e = (const T*)&v[r];
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] = r == 0 ? to_f32(e[k]) : acc[k] + to_f32(e[k]);
      }
    }
    uint4 out;
    T* o = (T*)&out;
#pragma unroll
    for (int k = 0; k < N; ++k) o[k] = from_f32<T>(acc[k]);
#pragma unroll
    for (int r = 0; r < SYMM_MAX_RANKS; ++r)
      if (r < a.world) ((uint4*)a.out[r])[i] = out;
  }
};
