/*
 * symmalloc device helpers: header-only (no library symbols), for CUDA kernels that program
 * symmetric memory themselves. Fill a symm_device_comm_t with symm_comm_device() on the host
 * (it is a plain struct: pass it to a kernel by value), rendezvous the buffers with
 * symm_rendezvous() (every rank), then in device code:
 *
 *   float *peer = symm_peer(d, buf, r);            // rank r's buf, over NVLink
 *   symm_signal_send(d, r, slot, epoch);           // after this thread's earlier writes
 *   if (!symm_signal_wait(d, slot, epoch)) return; // bounded; false: timed out or aborted
 *
 * Semantics (docs/DESIGN.md, "Programming symmetric memory"):
 *  - symm_signal_send stores `v` into slot `slot` of rank `peer`'s signal pad with release
 *    semantics at system scope (after a fence.sc.sys), so a thread that sees `v` with an acquire
 *    also sees every write this thread made before the call (puts into the peer included).
 *    Values are stored, not added: raise a slot by storing a larger value (monotonic counters),
 *    or raise it to 1 and have its owner store 0 after the wait (a reset). The writer word
 *    records the last other rank that raised the slot: a rank's stores into its own slots
 *    leave it.
 *  - symm_signal_wait spins, with acquire loads at system scope, until this rank's slot is
 *    >= v (unsigned 64-bit). It reads nothing but that slot, the clock register and, every
 *    SYMM_SPIN_POLL spins, the communicator's abort word (device memory): never host memory.
 *    Past the communicator's timeout (SYMMALLOC_TIMEOUT_S) it records the timeout in the abort
 *    word and, once per communicator, in the host-mapped error words (slot, values, the rank
 *    that raised the slot last), and returns false; the host reports it at its next call on
 *    the communicator, which is then unusable. Once the abort word is set, every wait of the
 *    communicator (and every symmalloc collective kernel) returns at once.
 *  - Only the thread that waited has acquired; make the rest of the block see the peers' data
 *    with __syncthreads() after the wait.
 *
 * Compiles as CUDA (nvcc) and, for symm_peer alone, as host C++.
 */
#ifndef SYMMALLOC_DEVICE_CUH
#define SYMMALLOC_DEVICE_CUH

#include <stdint.h>

#include "symmalloc.h"

#ifdef __CUDACC__
#define SYMM_HD __host__ __device__ __forceinline__
#else
#define SYMM_HD inline
#endif

/* Spins between two looks at the clock and the abort word. */
#define SYMM_SPIN_POLL 1024u

/* Rank r's address of `ptr`, a pointer into this rank's symmetric heap that every rank passed
 * to symm_rendezvous. Nothing is checked here: symm_peer_ptr() is the checked host form. */
template <typename T>
SYMM_HD T *symm_peer(const symm_device_comm_t &d, T *ptr, int r) {
  return (T *)(uintptr_t)(d.heap_bases[r] + ((uint64_t)(uintptr_t)ptr - d.heap_bases[d.rank]));
}

/* Rank r's slot `slot` value word (uint64_t) and writer word (uint32_t). */
SYMM_HD uint64_t *symm_signal_slot(const symm_device_comm_t &d, int r, uint32_t slot) {
  return (uint64_t *)(uintptr_t)d.signal_pads[r] + slot;
}
SYMM_HD uint32_t *symm_signal_writer(const symm_device_comm_t &d, int r, uint32_t slot) {
  return (uint32_t *)(uintptr_t)(d.signal_pads[r] + SYMM_SIGNAL_WRITERS_OFFSET) + slot;
}

#ifdef __CUDACC__

__device__ __forceinline__ uint64_t symm_globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t symm_ld_acquire_sys(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void symm_st_release_sys(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* Raises rank `peer`'s slot `slot` to `v` (see the top of this file). */
__device__ __forceinline__ void symm_signal_send(const symm_device_comm_t &d, int peer, uint32_t slot,
                                                 uint64_t v) {
  /* A rank's store into its own slot (a reset, typically) leaves the writer word: a timeout
     keeps naming the last other rank that raised the slot, the one the waiter expects. */
  if (peer != d.rank) *(volatile uint32_t *)symm_signal_writer(d, peer, slot) = (uint32_t)d.rank + 1u;
  __threadfence_system();
  symm_st_release_sys(symm_signal_slot(d, peer, slot), v);
}

/* A timed-out wait: the first fatal error of the communicator goes into the abort word; the
 * thread that put it there records the slot and the values in the host-mapped error words
 * (store only, never a load), then the fatal word. */
__device__ __forceinline__ void symm_report_signal_timeout(const symm_device_comm_t &d, uint32_t slot,
                                                        uint64_t awaited, uint64_t seen) {
  const uint32_t writer = *(volatile uint32_t *)symm_signal_writer(d, d.rank, slot) & 0xffffu;
  const uint32_t w = (SYMM_DEVICE_ERR_SIGNAL_TIMEOUT << 16) | writer;
  if (atomicCAS((unsigned int *)(uintptr_t)d.abort_word, 0u, w) != 0u || d.error_word == 0) return;
  volatile uint32_t *e = (volatile uint32_t *)(uintptr_t)d.error_word;
  e[SYMM_DEVICE_ERR_SLOT] = slot;
  e[SYMM_DEVICE_ERR_AWAITED] = (uint32_t)awaited;
  e[SYMM_DEVICE_ERR_AWAITED + 1] = (uint32_t)(awaited >> 32);
  e[SYMM_DEVICE_ERR_SEEN] = (uint32_t)seen;
  e[SYMM_DEVICE_ERR_SEEN + 1] = (uint32_t)(seen >> 32);
  __threadfence_system();
  e[SYMM_DEVICE_ERR_FATAL] = w;
  __threadfence_system();
}

/* Waits until this rank's slot `slot` is >= v (see the top of this file). True when it is;
 * false when the wait timed out (recorded) or the communicator was aborted. */
__device__ __forceinline__ bool symm_signal_wait(const symm_device_comm_t &d, uint32_t slot, uint64_t v) {
  const uint64_t *p = symm_signal_slot(d, d.rank, slot);
  const volatile uint32_t *abort_word = (const volatile uint32_t *)(uintptr_t)d.abort_word;
  uint64_t seen = symm_ld_acquire_sys(p);
  if (seen >= v) return true;
  if (*abort_word != 0) return false;
  const uint64_t start = symm_globaltimer();
  for (uint32_t spins = 1;; ++spins) {
    seen = symm_ld_acquire_sys(p);
    if (seen >= v) return true;
    if (spins % SYMM_SPIN_POLL == 0) {
      if (*abort_word != 0) return false;
      if (symm_globaltimer() - start > d.timeout_ns) {
        symm_report_signal_timeout(d, slot, v, seen);
        return false;
      }
    }
  }
}

#endif /* __CUDACC__ */
#endif /* SYMMALLOC_DEVICE_CUH */
