// One-shot LL (low-latency) all-reduce: barrier-free, the data carries its own flags.
//
// Every rank pushes its input into a slot of every peer's LL buffer (NVLink writes only),
// then polls its own buffer until each peer's values have arrived and reduces them with its
// own input, in fixed rank order. No barrier and no remote read: one one-way NVLink trip
// instead of the barrier one-shot's three round trips. User buffers are only touched locally,
// so in place needs no extra care.
//
// Flags in the data: an LL buffer word (4 bytes) that still holds LL_EMPTY (all ones) has not
// arrived. Writers never send an all-ones element: all ones is a NaN in bf16, fp16 and fp32,
// and it is sent as another NaN (lowest bit cleared), which reduces the same way. Stores of 16
// bytes are at least 4-byte single-copy atomic, so a word is either empty or complete.
//
// Buffers alternate (LL_BUFFERS, picked by the block's call counter); after reading, a block
// sets the words it read back to LL_EMPTY. A peer writes buffer b again only two calls later,
// after it has received all of this rank's data of the call in between, which this rank sends
// only once this call's kernel (resets included) has finished: collectives of a communicator
// are stream-ordered. So a reset is never overtaken by the next write.
//
// Layout of rank r's LL region (pads[r] + LL_*_OFFSET, kernel_args.rs mirrors it): per-block
// call counters (local), LL_BUFFERS x MAX_RANKS call-descriptor words (the last block of each
// sender writes its descriptor; the receiver checks it and resets it to 0), then LL_BUFFERS x world
// slots of ll_slot_kib KiB, one per sending rank.
//
// Call counters: an LL call runs on G' blocks, just enough for its message (at most the
// communicator's LL grid, SYMMALLOC_LL_GRID; a function of the call and of settings equal on
// every rank). Block b reads counters[b] (ll_begin) and, at its end, writes the next call's
// number into counters b, b + G', b + 2G', ... below SYMM_MAX_BLOCKS (ll_end). So every counter
// moves by exactly one per call whatever grid a call ran on: between two calls all counters are
// equal (kernels of a communicator are stream-ordered), and every block of every rank picks the
// same buffer. Before this, every call ran on the full LL grid; 120 of 128 blocks idle at 8 KiB.
#include "common.cuh"

#define LL_BUFFERS 2
#define LL_EMPTY 0xffffffffu
// Offsets inside the communicator's internal block (after the pad, epochs and control words).
#define LL_COUNTERS_OFFSET (SYMM_ABORT_OFFSET + SYMM_CONTROL_BYTES)
#define LL_DESC_OFFSET (LL_COUNTERS_OFFSET + SYMM_MAX_BLOCKS * 4)
#define LL_DATA_OFFSET (LL_DESC_OFFSET + 4096)
// (kernel_args.rs mirrors every value above; tests/kernel_table.rs checks them.)

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
  return v.x != LL_EMPTY && v.y != LL_EMPTY && v.z != LL_EMPTY && v.w != LL_EMPTY;
}

// No element of a sent vector may read as all ones (an all-ones bf16/fp16/fp32 is a NaN).
template <typename T> __device__ __forceinline__ void ll_sanitize(uint4& v) {
  if (sizeof(T) == 4) {
    uint32_t* w = (uint32_t*)&v;
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = w[k] == LL_EMPTY ? LL_EMPTY - 1 : w[k];
  } else {
    uint16_t* h = (uint16_t*)&v;
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = h[k] == 0xffffu ? (uint16_t)0xfffeu : h[k];
  }
}

__device__ __forceinline__ uint8_t* ll_region(const SymmArgs& a, int r) {
  return (uint8_t*)a.pads[r];
}

__device__ __forceinline__ uint4* ll_slot(const SymmArgs& a, int owner, uint32_t buf, int sender) {
  return (uint4*)(ll_region(a, owner) + LL_DATA_OFFSET +
                  ((uint64_t)buf * a.world + sender) * ((uint64_t)a.ll_slot_kib << 10));
}

// The block's call number, or false when the communicator was aborted (block_start): the block
// must then return at once, pushing nothing into the peers' buffers. Loads a caller issued
// before this that do not depend on the call stay in flight across it.
__device__ __forceinline__ bool ll_begin(const SymmArgs& a, uint32_t& call) {
  return block_start(a, (const uint32_t*)(ll_region(a, a.rank) + LL_COUNTERS_OFFSET) + blockIdx.x, call);
}

// Every LL kernel's last step (all threads call it): the next call's number into this block's
// counters, b, b + G', ... (the file's header: every counter moves once per call).
__device__ __forceinline__ void ll_end(const SymmArgs& a, uint32_t call) {
  __syncthreads();
  uint32_t* counters = (uint32_t*)(ll_region(a, a.rank) + LL_COUNTERS_OFFSET);
  for (uint32_t c = blockIdx.x + threadIdx.x * gridDim.x; c < SYMM_MAX_BLOCKS; c += blockDim.x * gridDim.x)
    counters[c] = call + 1;
}

// Item i (16 bytes) of this rank's input; elements past count read as 0.
template <typename T, bool VEC>
__device__ __forceinline__ uint4 ll_load_input(const SymmArgs& a, uint64_t i) {
  constexpr int N = 16 / sizeof(T);
  const uint64_t first = i * N;
  if (VEC && first + N <= a.count) return ((const uint4*)a.in[a.rank])[i];
  uint4 v = make_uint4(0, 0, 0, 0);
  T* e = (T*)&v;
  const T* in = (const T*)a.in[a.rank];
#pragma unroll
  for (int k = 0; k < N; ++k)
    if (first + k < a.count) e[k] = in[first + k];
  return v;
}

template <typename T, bool VEC>
__device__ __forceinline__ void ll_store_output(const SymmArgs& a, uint64_t i, uint4 v) {
  constexpr int N = 16 / sizeof(T);
  const uint64_t first = i * N;
  if (VEC && first + N <= a.count) {
    ((uint4*)a.out[a.rank])[i] = v;
    return;
  }
  const T* e = (const T*)&v;
  T* out = (T*)a.out[a.rank];
#pragma unroll
  for (int k = 0; k < N; ++k)
    if (first + k < a.count) out[first + k] = e[k];
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

// The last block exchanges call descriptors: a peer that runs another collective (other count,
// type or buffers) would leave words behind in our slots, so a mismatch is never reduced: it
// aborts the communicator, which also stops the other blocks' waits for words that will not
// come. The last block, because it has the least to pull: on a fitted grid its share of the
// message is the remainder, and a fused call with more blocks than rows gives it no row, so no
// row waits behind the check (block 0 checked before session 9).
__device__ __forceinline__ bool ll_check_desc(const SymmArgs& a, uint32_t buf, uint64_t start) {
  int ok = 1;
  const int p = threadIdx.x;
  if (blockIdx.x == gridDim.x - 1 && p < a.world && p != a.rank) {
    uint64_t* remote = (uint64_t*)(ll_region(a, p) + LL_DESC_OFFSET) + buf * SYMM_MAX_RANKS + a.rank;
    st_volatile_u64(remote, a.desc);
    volatile uint64_t* mine =
        (volatile uint64_t*)(ll_region(a, a.rank) + LL_DESC_OFFSET) + buf * SYMM_MAX_RANKS + p;
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

template <typename T, int OP, bool VEC>
__device__ __forceinline__ void one_shot_ll_body(const SymmArgs& a) {
  constexpr int N = 16 / sizeof(T);
  const uint64_t items = (a.count + N - 1) / N;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t first = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  // The thread's first input vector does not depend on the call: in flight before the counter
  // and abort-word loads, so the two latencies overlap; the pull reuses it.
  const uint4 first_in = first < items ? ll_load_input<T, VEC>(a, first) : make_uint4(0, 0, 0, 0);
  uint32_t call;
  if (!ll_begin(a, call)) return;  // aborted: push nothing into the peers' buffers
  const uint32_t buf = call % LL_BUFFERS;
  const uint64_t start = globaltimer();

  // Push: this rank's input into its slot of every peer's buffer. Small grids of small blocks
  // spread a message over many SMs: one SM's stores to a peer are the bottleneck otherwise.
  for (uint64_t i = first; i < items; i += stride) {
    uint4 v = i == first ? first_in : ll_load_input<T, VEC>(a, i);
    ll_sanitize<T>(v);
#pragma unroll
    for (int r = 0; r < SYMM_MAX_RANKS; ++r)
      if (r < a.world && r != a.rank) st_volatile_v4(ll_slot(a, r, buf, a.rank) + i, v);
  }
  bool ok = ll_check_desc(a, buf, start);

  // Pull: wait for every peer's item, reduce in rank order, reset the words read.
  for (uint64_t i = first; ok && i < items; i += stride) {
    uint4 own = i == first ? first_in : ll_load_input<T, VEC>(a, i);
    ll_sanitize<T>(own);
    float acc[N];
#pragma unroll
    for (int r = 0; r < SYMM_MAX_RANKS; ++r) {
      if (r >= a.world) break;
      uint4 v = own;
      if (r != a.rank) {
        uint4* p = ll_slot(a, a.rank, buf, r) + i;
        v = ld_volatile_v4(p);
        if (!ll_arrived(v) && !ll_wait(a, p, r, start, v)) { ok = false; break; }
        *p = make_uint4(LL_EMPTY, LL_EMPTY, LL_EMPTY, LL_EMPTY);
      }
      const T* e = (const T*)&v;
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] = r == 0 ? to_f32(e[k]) : combine<OP>(acc[k], to_f32(e[k]));
    }
    if (!ok) break;
    uint4 s;
    T* e = (T*)&s;
#pragma unroll
    for (int k = 0; k < N; ++k) e[k] = from_f32<T>(acc[k]);
    ll_store_output<T, VEC>(a, i, s);
  }
  ll_end(a, call);
}

#define SYMM_ONE_SHOT_LL(NAME, T, OP, VEC) \
  extern "C" __global__ void __launch_bounds__(SYMM_THREADS) NAME(SymmArgs a) { one_shot_ll_body<T, OP, VEC>(a); }

SYMM_ONE_SHOT_LL(symm_one_shot_ll_bf16_sum_vec, __nv_bfloat16, OP_SUM, true)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_bf16_max_vec, __nv_bfloat16, OP_MAX, true)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_bf16_min_vec, __nv_bfloat16, OP_MIN, true)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp16_sum_vec, __half, OP_SUM, true)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp16_max_vec, __half, OP_MAX, true)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp16_min_vec, __half, OP_MIN, true)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp32_sum_vec, float, OP_SUM, true)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp32_max_vec, float, OP_MAX, true)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp32_min_vec, float, OP_MIN, true)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_bf16_sum_scalar, __nv_bfloat16, OP_SUM, false)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_bf16_max_scalar, __nv_bfloat16, OP_MAX, false)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_bf16_min_scalar, __nv_bfloat16, OP_MIN, false)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp16_sum_scalar, __half, OP_SUM, false)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp16_max_scalar, __half, OP_MAX, false)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp16_min_scalar, __half, OP_MIN, false)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp32_sum_scalar, float, OP_SUM, false)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp32_max_scalar, float, OP_MAX, false)
SYMM_ONE_SHOT_LL(symm_one_shot_ll_fp32_min_scalar, float, OP_MIN, false)
