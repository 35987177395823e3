// The LL (low-latency) protocol: barrier-free exchanges in which the data carries its own
// arrival flags. The one-shot LL all-reduce, the small reduce-scatter and the fused all-reduce +
// RMSNorm kernels are built from the primitives here: ll_begin, ll_push, ll_check_desc, ll_pull
// (or a load + ll_settle, for a caller that issues a row's loads before its waits), ll_reduce
// and ll_end. docs/DESIGN.md, "LL protocol", states the protocol and why it is safe.
//
// In brief. Every rank pushes its items into a slot of every peer's LL buffer (NVLink writes
// only), then polls its own buffer until each peer's items have arrived and reduces them in
// fixed rank order. No barrier and no remote read: one one-way NVLink trip instead of the
// barrier one-shot's three round trips.
//
// Flags in the data: an LL buffer word (4 bytes) that still holds SYMM_LL_EMPTY (all ones) has
// not arrived. Writers never send an all-ones element: all ones is a NaN in bf16, fp16 and fp32,
// and it is sent as another NaN (lowest bit cleared, ll_sanitize), which reduces the same way.
// Stores of 16 bytes are at least 4-byte single-copy atomic, so a word is either empty or
// complete.
//
// Buffers alternate (SYMM_LL_BUFFERS, picked by the block's call counter); after reading, a
// block sets the words it read back to SYMM_LL_EMPTY. A peer writes buffer b again only two
// calls later, after it has received all of this rank's data of the call in between, which this
// rank sends only once this call's kernel (resets included) has finished: collectives of a
// communicator are stream-ordered. So a reset is never overtaken by the next write.
//
// Layout of rank r's LL region (pads[r] + SYMM_LL_*_OFFSET, symm_constants.cuh): per-block call
// counters (local), SYMM_LL_BUFFERS x SYMM_MAX_RANKS call-descriptor words (the last block of
// each sender writes its descriptor; the receiver checks it and resets it to 0), then
// SYMM_LL_BUFFERS x world slots of ll_slot_kib KiB, one per sending rank.
//
// Call counters: an LL call runs on G' blocks, just enough for its message (at most the
// communicator's LL grid, SYMMALLOC_LL_GRID; a function of the call and of settings equal on
// every rank). Block b reads counters[b] (ll_begin) and, at its end, writes the next call's
// number into counters b, b + G', b + 2G', ... below SYMM_MAX_BLOCKS (ll_end). So every counter
// moves by exactly one per call whatever grid a call ran on: between two calls all counters are
// equal, and every block of every rank picks the same buffer.
#pragma once
#include "common.cuh"

__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile_v4(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ bool ll_arrived(uint4 v) {
  return v.x != SYMM_LL_EMPTY && v.y != SYMM_LL_EMPTY && v.z != SYMM_LL_EMPTY && v.w != SYMM_LL_EMPTY;
}

// No element of a sent vector may read as all ones (an all-ones bf16/fp16/fp32 is a NaN).
template <typename T> __device__ __forceinline__ void ll_sanitize(uint4& v) {
  if (sizeof(T) == 4) {
    uint32_t* w = (uint32_t*)&v;
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = w[k] == SYMM_LL_EMPTY ? SYMM_LL_EMPTY - 1 : w[k];
  } else {
    uint16_t* h = (uint16_t*)&v;
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = h[k] == 0xffffu ? (uint16_t)0xfffeu : h[k];
  }
}

__device__ __forceinline__ uint8_t* ll_region(const SymmArgs& a, int r) {
  return (uint8_t*)a.pads[r];
}

// Slot `sender` of buffer `buf` in rank `owner`'s LL region.
__device__ __forceinline__ uint4* ll_slot(const SymmArgs& a, int owner, uint32_t buf, int sender) {
  return (uint4*)(ll_region(a, owner) + SYMM_LL_DATA_OFFSET +
                  ((uint64_t)buf * a.world + sender) * ((uint64_t)a.ll_slot_kib << 10));
}

// The block's call number, or false when the communicator was aborted (block_start): the block
// must then return at once, pushing nothing into the peers' buffers. Loads a caller issued
// before this that do not depend on the call stay in flight across it.
__device__ __forceinline__ bool ll_begin(const SymmArgs& a, uint32_t& call) {
  return block_start(a, (const uint32_t*)(ll_region(a, a.rank) + SYMM_LL_COUNTERS_OFFSET) + blockIdx.x, call);
}

// Every LL kernel's last step (all threads call it): the next call's number into this block's
// counters, b, b + G', ... (the header: every counter moves once per call).
__device__ __forceinline__ void ll_end(const SymmArgs& a, uint32_t call) {
  __syncthreads();
  uint32_t* counters = (uint32_t*)(ll_region(a, a.rank) + SYMM_LL_COUNTERS_OFFSET);
  for (uint32_t c = blockIdx.x + threadIdx.x * gridDim.x; c < SYMM_MAX_BLOCKS; c += blockDim.x * gridDim.x)
    counters[c] = call + 1;
}

// Push: item i of this rank (16 bytes, as loaded) into slot i of every peer's buffer.
template <typename T>
__device__ __forceinline__ void ll_push(const SymmArgs& a, uint32_t buf, uint64_t i, uint4 v) {
  ll_sanitize<T>(v);
#pragma unroll
  for (int r = 0; r < SYMM_MAX_RANKS; ++r)
    if (r < a.world && r != a.rank) st_volatile_v4(ll_slot(a, r, buf, a.rank) + i, v);
}

// Push to one peer: item v into slot i of peer p's buffer (a reduce-scatter sends slice p to p).
template <typename T>
__device__ __forceinline__ void ll_push_to(const SymmArgs& a, int p, uint32_t buf, uint64_t i, uint4 v) {
  ll_sanitize<T>(v);
  st_volatile_v4(ll_slot(a, p, buf, a.rank) + i, v);
}

// Spins until `p` holds an arrived vector; false on timeout or once the communicator was
// aborted (common.cuh: what a spin loop may touch).
__device__ __forceinline__ bool ll_wait(const SymmArgs& a, const uint4* p, int peer, uint64_t start,
                                        uint4& v) {
  uint32_t spins = 0;
  while (true) {
    v = ld_volatile_v4(p);
    if (ll_arrived(v)) return true;
    if (give_up(a, spins, start, peer)) return false;
  }
}

// Pull in two steps, for a caller that issues every load of a row before any wait (the polls
// then overlap): load the slot's words as they are now (ld_volatile_v4 on ll_slot(...) + i),
// then ll_settle waits for them when they had not arrived (only while `may_wait`: a thread
// whose wait failed once waits no more) and resets the slot. False when the item is not there.
__device__ __forceinline__ bool ll_settle(const SymmArgs& a, uint4* slot, int p, uint64_t start,
                                          uint4& v, bool may_wait) {
  if (!ll_arrived(v) && !(may_wait && ll_wait(a, slot, p, start, v))) return false;
  *slot = make_uint4(SYMM_LL_EMPTY, SYMM_LL_EMPTY, SYMM_LL_EMPTY, SYMM_LL_EMPTY);
  return true;
}

// Pull: peer p's item i into v, waiting for it; the word is reset. False when the wait failed.
__device__ __forceinline__ bool ll_pull(const SymmArgs& a, uint32_t buf, int p, uint64_t i,
                                        uint64_t start, uint4& v) {
  uint4* slot = ll_slot(a, a.rank, buf, p) + i;
  v = ld_volatile_v4(slot);
  return ll_settle(a, slot, p, start, v, true);
}

// Item i of every rank reduced in rank order, in fp32: this rank's own (sanitized, as it was
// pushed) and each peer's pulled from slot i. False when a wait failed (acc is then partial).
template <typename T, int OP>
__device__ __forceinline__ bool ll_reduce(const SymmArgs& a, uint32_t buf, uint64_t i, uint4 own,
                                          uint64_t start, float (&acc)[16 / sizeof(T)]) {
#pragma unroll
  for (int r = 0; r < SYMM_MAX_RANKS; ++r) {
    if (r >= a.world) break;
    uint4 v = own;
    if (r != a.rank && !ll_pull(a, buf, r, i, start, v)) return false;
    const T* e = (const T*)&v;
#pragma unroll
    for (int k = 0; k < (int)(16 / sizeof(T)); ++k)
      acc[k] = r == 0 ? to_f32(e[k]) : combine<OP>(acc[k], to_f32(e[k]));
  }
  return true;
}

// The last block exchanges call descriptors: a peer that runs another collective (other count,
// type or buffers) would leave words behind in our slots, so a mismatch is never reduced: it
// aborts the communicator, which also stops the other blocks' waits for words that will not
// come. The last block, because it has the least to pull: on a fitted grid its share of the
// message is the remainder, and a fused call with more blocks than rows gives it no row, so no
// row waits behind the check.
__device__ __forceinline__ bool ll_check_desc(const SymmArgs& a, uint32_t buf, uint64_t start) {
  int ok = 1;
  const int p = threadIdx.x;
  if (blockIdx.x == gridDim.x - 1 && p < a.world && p != a.rank) {
    uint64_t* remote = (uint64_t*)(ll_region(a, p) + SYMM_LL_DESC_OFFSET) + buf * SYMM_MAX_RANKS + a.rank;
    st_volatile_u64(remote, a.desc);
    volatile uint64_t* mine =
        (volatile uint64_t*)(ll_region(a, a.rank) + SYMM_LL_DESC_OFFSET) + buf * SYMM_MAX_RANKS + p;
    uint32_t spins = 0;
    uint64_t d;
    while ((d = *mine) == 0) {
      if (give_up(a, spins, start, p)) {
        ok = 0;
        break;
      }
    }
    if (ok && d != a.desc) {
      abort_comm(a, SYMM_ERR_LL_ASYMMETRIC_CODE, p);
      ok = 0;
    }
    *mine = 0;
  }
  return __syncthreads_and(ok) != 0;
}
