// Thread-block clusters (sm_90): the special registers, the cluster barrier's two halves, and a
// fence-free exchange of small values between the blocks of a cluster through their shared
// memory (distributed shared memory, "DSMEM").
//
// The exchange (used by the cluster kernel, rms_norm_cluster.cuh): block q sends a value to
// block b with st_async_v2, which writes b's shared memory and completes 8 bytes of a
// transaction on b's mbarrier; b announces how many bytes it expects (mbar_expect_arrive, the
// phase's one arrival) and waits on its own mbarrier. Nothing in it is a release at cluster scope: such a release
// (`barrier.cluster.arrive` with its default .release, `mbarrier.arrive.release.cluster`)
// compiles to MEMBAR.ALL.GPU, which waits for every store the thread has in flight, including
// the LL pushes to peers over NVLink and the slot resets (docs/DESIGN.md, "Kernels and their grids"). The
// complete-tx of st.async is itself a release at cluster scope for the data it carries, and
// mbar_wait is the matching acquire.
//
// Invariants the caller keeps:
//   - every block of the cluster initializes its mbarriers (mbar_init, fence_mbarrier_init)
//     and the cluster meets at a barrier before any block sends;
//   - a block sends into a buffer again only after a wait that proves the receiver has read it
//     (rms_norm_cluster.cuh double-buffers by row parity; its comment gives the chain);
//   - no block exits while a send to it may still come: every block waits for every send
//     addressed to it.
// Spinning in mbar_wait touches only this block's shared memory (common.cuh's spin-loop rule);
// it cannot outlast the cluster, whose every block reaches every exchange.
#pragma once
#include <stdint.h>

#include "symm_constants.cuh"  // SYMM_MAX_CLUSTER

// This block's rank in its cluster, the blocks per cluster, this cluster's index in the grid and
// the number of clusters.
#define SYMM_CLUSTER_SREG(NAME, REG)                  \
  __device__ __forceinline__ uint32_t NAME() {        \
    uint32_t r;                                       \
    asm volatile("mov.u32 %0, %%" REG ";" : "=r"(r)); \
    return r;                                         \
  }
SYMM_CLUSTER_SREG(cluster_ctarank, "cluster_ctarank")
SYMM_CLUSTER_SREG(cluster_nctarank, "cluster_nctarank")
SYMM_CLUSTER_SREG(cluster_id, "clusterid.x")
SYMM_CLUSTER_SREG(cluster_count, "nclusterid.x")

// A cluster barrier in two halves: arrive (relaxed: it orders no memory access, so no fence),
// and wait.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
// The address of `p` (this block's shared memory) in block `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_addr(const void* p, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  return remote;
}

// An mbarrier of this block expecting `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes this thread's mbar_init visible to the cluster (before the cluster barrier that follows).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// This phase of `bar` waits for `bytes` more bytes of transactions; then one arrival.
__device__ __forceinline__ void mbar_expect_arrive(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// Writes {lo, hi} to `dst` (this block's shared memory layout) in block `rank`, completing 8
// bytes of transaction on that block's `bar`.
__device__ __forceinline__ void st_async_v2(uint32_t* dst, uint32_t lo, uint32_t hi, uint64_t* bar,
                                            uint32_t rank) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
                   cluster_addr(dst, rank)),
               "r"(lo), "r"(hi), "r"(cluster_addr(bar, rank))
               : "memory");
}
// Waits until the phase of `bar` with parity `phase` has completed; the data its transactions
// carried is then visible to this thread.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  uint32_t done;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(phase)
        : "memory");
  } while (!done);
}
