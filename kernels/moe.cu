// MoE dispatch and combine (docs/moe.md is the contract; src/comm/moe/host.rs runs the same
// protocol on the CPU, with the same arithmetic).
//
// Owns: the kernels' argument struct `MoeArgs` (mirrored by src/comm/moe/launch.rs, checked by
// tests/kernel_table.rs), the control words of a moe block (layout.rs `CTRL_*`), the dispatch
// kernel (routing, counts exchange, rows to the experts' ranks) and the combine kernel (rows back
// to their tokens' ranks, the weighted sum in a fixed order).
//
// One kernel per call. Block 0 routes; every block sends. The other blocks wait for block 0's
// route on a control word of this rank's own block (this GPU's memory, never host memory), so
// the grid must be resident at once: it is at most one block per SM (moe/mod.rs `MAX_GRID`,
// the communicator's fewest SMs) and every block fits an SM (`__launch_bounds__`).
//
// Epochs: a call's epoch is the rank's count of earlier calls of its kind plus one, read from
// the control words at kernel start; block 0 stores it at the end, after every block of the grid
// has counted itself in (so none reads it late). Flags are monotonic (`>= epoch`), so graph
// replays need no reset and nothing is ever cleared. Count rows alternate by the dispatch epoch's
// parity; the combine's flag row and landing buffer (cbuf) by the combine epoch's (moe_cbuf), so
// combines of one dispatch may follow each other back to back: a rank reaches combine c + 2 only
// after every rank raised its flag of c + 1, i.e. after every rank's kernel of c finished reading
// its cbuf and flags; a combine's wait therefore sees exactly its own value, never a later call's.
//
// Determinism: each (token, slot)'s row within (this rank, its expert) follows token order (one
// warp walks the entries in order; `__match_any_sync` ranks equal experts inside a group of 32),
// rows are placed by (source rank, token), and the combine sums k = 0..K-1 with fmaf from 0 into
// fp32 and rounds to bf16 once: y does not depend on arrival order, grid or timing.
//
// Waits follow common.cuh's rule: they poll their own flag words in this GPU's memory and, once
// per SYMM_SPIN_CHECK spins, the clock and the abort word; a timeout aborts the communicator
// naming the rank waited for. The only host-mapped memory a kernel touches is stored to: the
// communicator's error words (report_to_host) and the object's status words (moe_record).
#include "common.cuh"

#define MOE_THREADS 512
#define MOE_WARPS (MOE_THREADS / 32)
#define MOE_MAX_EXPERTS 1024
#define MOE_ROW_EXTRA 8
#define MOE_SCALE_GROUP 128
// Control words (u64) at the start of a moe block (src/comm/moe/layout.rs CTRL_*).
#define MOE_CTRL_D_DONE 0
#define MOE_CTRL_D_SENT 1
#define MOE_CTRL_C_DONE 2
#define MOE_CTRL_C_SENT 3
#define MOE_CTRL_OK_EPOCH 4
#define MOE_CTRL_ROUTED 5
#define MOE_CTRL_FAILED 6
// Flag rows (layout.rs FLAG_*); the combine has two, one per parity of its epoch.
#define MOE_FLAG_COUNTS 0
#define MOE_FLAG_DATA 1
#define MOE_FLAG_COMBINE 2
// Status codes (src/comm/moe/status.rs ST_*) and status word indices (SW_*).
#define MOE_ST_OUT_OF_RANGE 1
#define MOE_ST_DUPLICATE 2
#define MOE_ST_CAPACITY 3
#define MOE_ST_TOO_MANY_TOKENS 4
#define MOE_ST_BAD_K 5
#define MOE_ST_REFUSED 6
#define MOE_ST_COMBINE_REFUSED 7

struct MoeArgs {
  SymmArgs s;                      // rank, world, pads (abort word), timeout, error words
  uint64_t blocks[SYMM_MAX_RANKS]; // every rank's moe block, mapped here
  uint64_t x;                      // [n][H] payload (dispatch)
  uint64_t x_scales;               // [n][H/128] fp32 (FP8 dispatch)
  uint64_t topk_idx;               // [n][k] int32 or int64 (dispatch)
  uint64_t topk_weights;           // [n][k] fp32 (dispatch)
  uint64_t expert_out;             // [L][R][H] bf16 (combine)
  uint64_t y;                      // [n][H] bf16 (combine)
  uint64_t status;                 // uint32_t[16], host-mapped, stored to only (moe_record)
  uint64_t off_counts;             // offsets of the block's parts (layout.rs)
  uint64_t off_flags;
  uint64_t off_recv_counts;
  uint64_t off_recv_src;
  uint64_t off_recv_x;
  uint64_t off_recv_scales;
  uint64_t off_idx;
  uint64_t off_weights;
  uint64_t off_pos;
  uint64_t off_cbuf;
  uint64_t max_tokens;             // T
  uint64_t hidden;                 // H
  uint64_t max_recv;               // R
  uint64_t num_tokens;             // n of this call (the last dispatch's for combine)
  int64_t refuse_value;
  int32_t k;                       // the caller's k (<= topk)
  int32_t topk;                    // K
  int32_t experts;                 // E
  int32_t local;                   // L = E / world
  int32_t refuse_code;             // this rank's own refusal (status code), or 0
  int32_t pad;
};

__device__ __forceinline__ uint64_t* moe_ctrl(const MoeArgs& a) {
  return (uint64_t*)a.blocks[a.s.rank];
}

// Flag `which` of source `src` in rank `d`'s block.
__device__ __forceinline__ uint64_t* moe_flag(const MoeArgs& a, int d, int which, int src) {
  return (uint64_t*)(a.blocks[d] + a.off_flags) + (uint64_t)which * a.s.world + src;
}

// The counts row of source `src` for `epoch`'s parity, in rank `d`'s block.
__device__ __forceinline__ int32_t* moe_row(const MoeArgs& a, int d, uint64_t epoch, int src) {
  const uint64_t words = (uint64_t)a.experts + MOE_ROW_EXTRA;
  return (int32_t*)(a.blocks[d] + a.off_counts) + ((epoch & 1) * a.s.world + src) * words;
}

// The landing buffer of combine `epoch` in rank `d`'s block: two [T][K][H] bf16 buffers, one per
// parity of the combine epoch (layout.rs cbuf_at).
__device__ __forceinline__ uint8_t* moe_cbuf(const MoeArgs& a, int d, uint64_t epoch) {
  const uint64_t slot = a.max_tokens * (uint64_t)a.topk * a.hidden * 2;
  return (uint8_t*)(a.blocks[d] + a.off_cbuf) + (epoch & 1) * slot;
}

// Stores `v` into flag `which` of this rank on every rank (one thread; after the caller's fence).
__device__ __forceinline__ void moe_raise(const MoeArgs& a, int which, uint64_t v) {
  for (int d = 0; d < a.s.world; ++d) st_release_sys_u64(moe_flag(a, d, which, a.s.rank), v);
}

// Thread `src` (< world) waits until flag `which` of source `src` here is >= want. Returns the
// value seen, or 0 when the wait ended (aborted or timed out: the communicator is aborted).
__device__ __forceinline__ uint64_t moe_wait(const MoeArgs& a, int which, int src, uint64_t want) {
  const uint64_t* f = moe_flag(a, a.s.rank, which, src);
  const uint64_t start = globaltimer();
  uint32_t spins = 0;
  for (;;) {
    const uint64_t v = ld_acquire_sys_u64(f);
    if (v >= want) return v;
    if (give_up(a.s, spins, start, src)) return 0;
  }
}

// Records a status for the host (moe/status.rs words: the code last). Plain posted stores.
__device__ __forceinline__ void moe_record(const MoeArgs& a, uint32_t code, int rank, uint32_t token,
                                           uint32_t k, int64_t value, uint32_t call) {
  volatile uint32_t* w = (volatile uint32_t*)a.status;
  w[1] = (uint32_t)rank;
  w[2] = token;
  w[3] = k;
  w[4] = (uint32_t)(uint64_t)value;
  w[5] = (uint32_t)((uint64_t)value >> 32);
  w[6] = call;
  __threadfence_system();
  w[0] = code;
  __threadfence_system();
}

__device__ __forceinline__ bool moe_is_refusal(uint32_t code) {
  return code == MOE_ST_TOO_MANY_TOKENS || code == MOE_ST_BAD_K || code == MOE_ST_REFUSED ||
         code == MOE_ST_COMBINE_REFUSED;
}

template <typename IDX>
__device__ __forceinline__ int64_t moe_load_idx(const MoeArgs& a, uint64_t i) {
  return (int64_t)((const IDX*)a.topk_idx)[i];
}

// Entry i = t * K + j of this call: its expert (-1 past k) and the code of what is wrong with it.
template <typename IDX>
__device__ __forceinline__ int64_t moe_entry(const MoeArgs& a, uint64_t i, uint32_t& code) {
  const uint64_t K = a.topk, t = i / K, j = i % K;
  code = 0;
  if ((int)j >= a.k) return -1;
  const int64_t e = moe_load_idx<IDX>(a, t * a.k + j);
  if (e < -1 || e >= a.experts) {
    code = MOE_ST_OUT_OF_RANGE;
  } else if (e >= 0) {
    for (uint64_t jj = 0; jj < j; ++jj)
      if (moe_load_idx<IDX>(a, t * a.k + jj) == e) code = MOE_ST_DUPLICATE;
  }
  return e;
}

// Copies `bytes` (a multiple of 16) from src to dst with the 32 lanes of a warp.
__device__ __forceinline__ void moe_copy_row(uint8_t* dst, const uint8_t* src, uint64_t bytes, int lane) {
  const uint64_t n = bytes / 16;
  const uint4* s = (const uint4*)src;
  uint4* d = (uint4*)dst;
  constexpr int U = 4;
  for (uint64_t v = lane; v < n; v += 32 * U) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v + u * 32 < n) r[u] = s[v + u * 32];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v + u * 32 < n) d[v + u * 32] = r[u];
  }
}

// Block 0 of a dispatch: steps 1-3 of docs/moe.md ("Protocol"). Leaves in this rank's block,
// for every block of the grid: pos[i] = the destination slot (local expert * R + row) of each
// entry, or -1; ctrl[FAILED] = epoch when the call failed; then ctrl[ROUTED] = epoch. Returns
// false when a wait ended (the communicator is aborted).
template <typename IDX>
__device__ bool moe_route(const MoeArgs& a, uint64_t epoch) {
  __shared__ int32_t counts_s[MOE_MAX_EXPERTS];
  __shared__ int32_t base_s[MOE_MAX_EXPERTS];
  __shared__ uint32_t bad_s, cap_s;
  __shared__ int32_t found_s[5];  // code, rank, token, k, (value in found_v)
  __shared__ int64_t found_v;
  const int tid = threadIdx.x, lane = tid & 31;
  const int me = a.s.rank, W = a.s.world;
  const int E = a.experts, L = a.local;
  const uint64_t K = a.topk, R = a.max_recv;
  const uint64_t n = a.refuse_code ? 0 : a.num_tokens;
  const uint64_t entries = n * K;
  int32_t* idx = (int32_t*)(a.blocks[me] + a.off_idx);
  float* wts = (float*)(a.blocks[me] + a.off_weights);
  int32_t* pos = (int32_t*)(a.blocks[me] + a.off_pos);
  uint64_t* ctrl = moe_ctrl(a);

  // Step 1: the local copy of the routing, the first offending entry, counts and positions.
  if (tid == 0) bad_s = 0xffffffffu;
  for (int e = tid; e < E; e += MOE_THREADS) counts_s[e] = 0;
  __syncthreads();
  for (uint64_t i = tid; i < entries; i += MOE_THREADS) {
    uint32_t code;
    const int64_t e = moe_entry<IDX>(a, i, code);
    const uint64_t t = i / K, j = i % K;
    const float w = (int)j < a.k ? ((const float*)a.topk_weights)[t * a.k + j] : 0.f;
    idx[i] = (int32_t)e;
    wts[i] = w;
    if (code) atomicMin(&bad_s, (uint32_t)i);
  }
  __syncthreads();
  if (tid == 0) {
    found_s[0] = 0;
    if (a.refuse_code) {
      found_s[0] = a.refuse_code;
      found_s[1] = me;
      found_s[2] = 0;
      found_s[3] = 0;
      found_v = a.refuse_value;
    } else if (bad_s != 0xffffffffu) {
      uint32_t code;
      const int64_t e = moe_entry<IDX>(a, bad_s, code);
      found_s[0] = code;
      found_s[1] = me;
      found_s[2] = (int32_t)(bad_s / K);
      found_s[3] = (int32_t)(bad_s % K);
      found_v = e;
    }
  }
  __syncthreads();
  const bool own_bad = found_s[0] != 0;
  if (!own_bad && tid < 32) {
    // One warp, the entries in order: each entry's row within (this rank, its expert).
    for (uint64_t b = 0; b < entries; b += 32) {
      const uint64_t i = b + lane;
      const int32_t e = i < entries ? idx[i] : -1;
      const uint32_t peers = __match_any_sync(0xffffffffu, e);
      const uint32_t lower = peers & ((1u << lane) - 1);
      const int32_t c0 = e >= 0 ? counts_s[e] : 0;
      __syncwarp();
      if (e >= 0 && lower == 0) counts_s[e] = c0 + __popc(peers);
      __syncwarp();
      if (i < entries) pos[i] = e >= 0 ? c0 + __popc(lower) : -1;
    }
  }
  __syncthreads();

  // Step 2: this rank's row (counts, or zeros and a status) into every rank's counts.
  const uint32_t words = E + MOE_ROW_EXTRA;
  for (int d = 0; d < W; ++d) {
    int32_t* row = moe_row(a, d, epoch, me);
    for (uint32_t w = tid; w < words; w += MOE_THREADS) {
      int32_t v;
      if (w < (uint32_t)E) {
        v = own_bad ? 0 : counts_s[w];
      } else {
        const uint32_t x = w - E;
        v = x == 0 ? found_s[0]
            : x == 1 ? found_s[2]
            : x == 2 ? found_s[3]
            : x == 3 ? (int32_t)(uint32_t)(uint64_t)found_v
            : x == 4 ? (int32_t)(uint32_t)((uint64_t)found_v >> 32)
                     : 0;
        if (!own_bad && x < 5) v = 0;
      }
      row[w] = v;
    }
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();
    moe_raise(a, MOE_FLAG_COUNTS, epoch);
  }

  // Step 3: every source's row; the first status (lowest rank), else capacity.
  int ok = 1;
  if (tid < W) ok = moe_wait(a, MOE_FLAG_COUNTS, tid, epoch) != 0;
  if (!__syncthreads_and(ok)) return false;
  if (tid == 0) {
    found_s[0] = 0;
    for (int s = 0; s < W; ++s) {
      const int32_t* ex = moe_row(a, me, epoch, s) + E;
      const int32_t code = ((volatile int32_t*)ex)[0];
      if (code != 0) {
        found_s[0] = code;
        found_s[1] = s;
        found_s[2] = ((volatile int32_t*)ex)[1];
        found_s[3] = ((volatile int32_t*)ex)[2];
        found_v = (int64_t)((uint64_t)(uint32_t)((volatile int32_t*)ex)[3] |
                            ((uint64_t)(uint32_t)((volatile int32_t*)ex)[4] << 32));
        break;
      }
    }
    cap_s = 0xffffffffu;
  }
  __syncthreads();
  if (found_s[0] == 0) {
    for (int e = tid; e < E; e += MOE_THREADS) {
      int64_t total = 0, below = 0;
      for (int s = 0; s < W; ++s) {
        const int32_t c = ((volatile int32_t*)moe_row(a, me, epoch, s))[e];
        total += c;
        if (s < me) below += c;
      }
      base_s[e] = (int32_t)below;
      counts_s[e] = (int32_t)min(total, (int64_t)0x7fffffff);
      if (total > (int64_t)R) atomicMin(&cap_s, (uint32_t)e);
    }
    __syncthreads();
    if (tid == 0 && cap_s != 0xffffffffu) {
      found_s[0] = MOE_ST_CAPACITY;
      found_s[1] = (int32_t)(cap_s / L);
      found_s[2] = (int32_t)cap_s;
      found_s[3] = 0;
      found_v = counts_s[cap_s];
    }
    __syncthreads();
  }
  const bool failed = found_s[0] != 0;
  if (!failed) {
    for (uint64_t i = tid; i < entries; i += MOE_THREADS) {
      const int32_t e = idx[i];
      if (e >= 0) pos[i] = (int32_t)((uint64_t)(e % L) * R + base_s[e] + pos[i]);
    }
  } else if (tid == 0) {
    const uint32_t code = found_s[0];
    if (!(found_s[1] == me && moe_is_refusal(code)))
      moe_record(a, code, found_s[1], found_s[2], found_s[3], found_v, 0);
  }
  __syncthreads();
  if (tid == 0) {
    if (failed) ctrl[MOE_CTRL_FAILED] = epoch;
    __threadfence();
    *(volatile uint64_t*)&ctrl[MOE_CTRL_ROUTED] = epoch;
  }
  return true;
}

// Dispatch: block 0 routes (moe_route); every block sends its share of the entries' rows to the
// experts' ranks; the grid's last block raises the data flags; block 0 waits for every source's
// data and writes recv_counts.
template <int PAYLOAD_BYTES, bool SCALES, typename IDX>
__device__ void moe_dispatch_body(const MoeArgs& a) {
  __shared__ uint64_t epoch_s;
  __shared__ int live_s;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int me = a.s.rank, W = a.s.world;
  uint64_t* ctrl = moe_ctrl(a);
  if (tid == 0) {
    epoch_s = *(volatile uint64_t*)&ctrl[MOE_CTRL_D_DONE] + 1;
    live_s = !aborted(a.s);
  }
  __syncthreads();
  if (!live_s) return;
  const uint64_t epoch = epoch_s;
  int ok = 1;
  if (blockIdx.x == 0) {
    ok = moe_route<IDX>(a, epoch);
  } else if (tid == 0) {
    // Block 0 waits for the peers with the communicator's timeout and names the one that did
    // not come; this wait only backs it up (twice as long), so the error names the peer.
    const uint64_t start = globaltimer();
    uint32_t spins = 0;
    while (*(volatile uint64_t*)&ctrl[MOE_CTRL_ROUTED] < epoch) {
      if (give_up_after(a.s, spins, start, me, 2 * a.s.timeout_ns)) {
        ok = 0;
        break;
      }
    }
    __threadfence();
  }
  if (!__syncthreads_and(ok)) return;
  const bool failed = *(volatile uint64_t*)&ctrl[MOE_CTRL_FAILED] == epoch;

  // Step 4: this block's entries, a warp per row.
  if (!failed) {
    const uint64_t K = a.topk, T = a.max_tokens, H = a.hidden;
    const uint64_t row_bytes = H * PAYLOAD_BYTES, S = H / MOE_SCALE_GROUP;
    const uint64_t entries = a.num_tokens * K;
    const int32_t* idx = (const int32_t*)(a.blocks[me] + a.off_idx);
    const int32_t* pos = (const int32_t*)(a.blocks[me] + a.off_pos);
    const uint64_t nwarps = (uint64_t)gridDim.x * MOE_WARPS;
    for (uint64_t i = (uint64_t)blockIdx.x * MOE_WARPS + warp; i < entries; i += nwarps) {
      // Written by block 0 in this kernel: loaded past L1 (ld.global.cg).
      const int32_t slot = __ldcg(pos + i);
      if (slot < 0) continue;
      const int d = __ldcg(idx + i) / a.local;
      const uint64_t t = i / K, j = i % K;
      moe_copy_row((uint8_t*)(a.blocks[d] + a.off_recv_x) + (uint64_t)slot * row_bytes,
                   (const uint8_t*)a.x + t * row_bytes, row_bytes, lane);
      if (SCALES) {
        float* ds = (float*)(a.blocks[d] + a.off_recv_scales) + (uint64_t)slot * S;
        const float* ss = (const float*)a.x_scales + t * S;
        for (uint64_t v = lane; v < S; v += 32) ds[v] = ss[v];
      }
      if (lane == 0)
        ((int32_t*)(a.blocks[d] + a.off_recv_src))[slot] = (int32_t)(((uint64_t)me * T + t) * K + j);
    }
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();
    const unsigned long long old = atomicAdd((unsigned long long*)&ctrl[MOE_CTRL_D_SENT], 1ull);
    if (old + 1 == epoch * gridDim.x) moe_raise(a, MOE_FLAG_DATA, epoch);
  }
  if (blockIdx.x != 0) return;

  // Step 5 (block 0): every source's rows are here; this rank's experts' counts.
  ok = 1;
  if (tid < W) ok = moe_wait(a, MOE_FLAG_DATA, tid, epoch) != 0;
  if (!__syncthreads_and(ok)) return;
  int32_t* recv_counts = (int32_t*)(a.blocks[me] + a.off_recv_counts);
  for (int le = tid; le < a.local; le += MOE_THREADS) {
    int32_t total = 0;
    if (!failed)
      for (int s = 0; s < W; ++s) total += ((volatile int32_t*)moe_row(a, me, epoch, s))[me * a.local + le];
    recv_counts[le] = total;
  }
  __syncthreads();
  if (tid == 0) {
    if (!failed) ctrl[MOE_CTRL_OK_EPOCH] = epoch;
    ctrl[MOE_CTRL_D_DONE] = epoch;
  }
}

// Combine: every block sends its share of the received rows' expert outputs back to their
// tokens' ranks (cbuf[parity][t][k] there); the grid's last block raises the combine flags of the
// parity; every block waits for every source, then sums its share of this rank's tokens in k
// order. Any number of combines may follow one dispatch (header: the parity alternation).
__device__ void moe_combine_body(const MoeArgs& a) {
  __shared__ uint64_t epoch_s;
  __shared__ int live_s, dispatched_s;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int me = a.s.rank, W = a.s.world;
  uint64_t* ctrl = moe_ctrl(a);
  if (tid == 0) {
    epoch_s = *(volatile uint64_t*)&ctrl[MOE_CTRL_C_DONE] + 1;
    const uint64_t d = *(volatile uint64_t*)&ctrl[MOE_CTRL_D_DONE];
    dispatched_s = d > 0 && *(volatile uint64_t*)&ctrl[MOE_CTRL_OK_EPOCH] == d;
    live_s = !aborted(a.s);
  }
  __syncthreads();
  if (!live_s) return;
  const uint64_t epoch = epoch_s;
  const int flag = MOE_FLAG_COMBINE + (int)(epoch & 1);
  const bool refused = a.refuse_code != 0;
  const bool dispatched = dispatched_s != 0;
  const uint64_t K = a.topk, T = a.max_tokens, H = a.hidden, R = a.max_recv;
  const uint64_t row_bytes = H * 2;

  // Step 1: the received rows' outputs to their sources' cbuf. The rows of all local experts
  // are numbered through (pre_s: the counts' prefix sums) and dealt to the grid's warps, so a
  // few rows per expert still spread over every warp.
  __shared__ int32_t pre_s[MOE_MAX_EXPERTS + 1];
  if (!refused && dispatched) {
    const int L = a.local;
    const int32_t* counts = (const int32_t*)(a.blocks[me] + a.off_recv_counts);
    const int32_t* src = (const int32_t*)(a.blocks[me] + a.off_recv_src);
    for (int i = tid; i < L; i += MOE_THREADS) pre_s[i + 1] = counts[i];
    if (tid == 0) pre_s[0] = 0;
    __syncthreads();
    // Inclusive scan of pre_s[1..L] (Hillis-Steele; L <= 2 * MOE_THREADS).
    for (int off = 1; off < L; off <<= 1) {
      int32_t v[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = tid + u * MOE_THREADS + 1;
        v[u] = (i <= L && i - off >= 1) ? pre_s[i - off] : 0;
      }
      __syncthreads();
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = tid + u * MOE_THREADS + 1;
        if (i <= L) pre_s[i] += v[u];
      }
      __syncthreads();
    }
    const uint64_t total = (uint64_t)pre_s[L];
    const uint64_t nwarps = (uint64_t)gridDim.x * MOE_WARPS;
    for (uint64_t q = (uint64_t)blockIdx.x * MOE_WARPS + warp; q < total; q += nwarps) {
      // The expert le with pre_s[le] <= q < pre_s[le + 1].
      int lo = 0, hi = L;
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if ((uint64_t)pre_s[mid] <= q) lo = mid; else hi = mid;
      }
      const uint64_t slot = (uint64_t)lo * R + (q - (uint64_t)pre_s[lo]);
      const uint64_t code = (uint64_t)src[slot];
      const uint64_t s = code / (T * K), t = (code / K) % T, j = code % K;
      moe_copy_row(moe_cbuf(a, (int)s, epoch) + (t * K + j) * row_bytes,
                   (const uint8_t*)a.expert_out + slot * row_bytes, row_bytes, lane);
    }
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();
    const unsigned long long old = atomicAdd((unsigned long long*)&ctrl[MOE_CTRL_C_SENT], 1ull);
    if (old + 1 == epoch * gridDim.x) moe_raise(a, flag, 2 * epoch + (refused ? 1 : 0));
  }

  // Step 2: every source's rows are here (a flag is 2 * epoch, plus one when it refused; no
  // source can be two combines ahead, so the value is exactly this combine's).
  __shared__ int other_s;
  if (tid == 0) other_s = W;
  __syncthreads();
  int ok = 1;
  if (tid < W) {
    const uint64_t v = moe_wait(a, flag, tid, 2 * epoch);
    ok = v != 0;
    if (ok && v == 2 * epoch + 1) atomicMin(&other_s, tid);
  }
  if (!__syncthreads_and(ok)) return;
  if (!refused) {
    const bool zeros = !dispatched || other_s < W;
    const uint64_t n = a.num_tokens, vecs = H / 8;
    const int32_t* idx = (const int32_t*)(a.blocks[me] + a.off_idx);
    const float* wts = (const float*)(a.blocks[me] + a.off_weights);
    const uint8_t* cbuf = moe_cbuf(a, me, epoch);
    const uint64_t step = (uint64_t)gridDim.x * MOE_THREADS;
    for (uint64_t q = (uint64_t)blockIdx.x * MOE_THREADS + tid; q < n * vecs; q += step) {
      const uint64_t t = q / vecs, v = q % vecs;
      float acc[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] = 0.f;
      if (!zeros) {
        for (uint64_t j = 0; j < K; ++j) {
          if (idx[t * K + j] < 0) continue;
          const float w = wts[t * K + j];
          // Written by the peers in this kernel: loaded past L1 (ld.global.cg).
          const uint4 raw = __ldcg((const uint4*)(cbuf + (t * K + j) * row_bytes) + v);
          const __nv_bfloat16* b = (const __nv_bfloat16*)&raw;
#pragma unroll
          for (int u = 0; u < 8; ++u) acc[u] = fmaf(w, __bfloat162float(b[u]), acc[u]);
        }
      }
      uint4 out;
      __nv_bfloat16* o = (__nv_bfloat16*)&out;
#pragma unroll
      for (int u = 0; u < 8; ++u) o[u] = __float2bfloat16_rn(acc[u]);
      ((uint4*)a.y)[q] = out;
    }
    if (blockIdx.x == 0 && tid == 0 && dispatched && other_s < W)
      moe_record(a, MOE_ST_COMBINE_REFUSED, other_s, 0, 0, 0, 1);
  }
  if (blockIdx.x == 0) {
    __syncthreads();
    if (tid == 0) ctrl[MOE_CTRL_C_DONE] = epoch;
  }
}

extern "C" __global__ void __launch_bounds__(MOE_THREADS) symm_moe_dispatch_bf16_i32(MoeArgs a) { moe_dispatch_body<2, false, int32_t>(a); }
extern "C" __global__ void __launch_bounds__(MOE_THREADS) symm_moe_dispatch_bf16_i64(MoeArgs a) { moe_dispatch_body<2, false, int64_t>(a); }
extern "C" __global__ void __launch_bounds__(MOE_THREADS) symm_moe_dispatch_fp8_i32(MoeArgs a) { moe_dispatch_body<1, true, int32_t>(a); }
extern "C" __global__ void __launch_bounds__(MOE_THREADS) symm_moe_dispatch_fp8_i64(MoeArgs a) { moe_dispatch_body<1, true, int64_t>(a); }
extern "C" __global__ void __launch_bounds__(MOE_THREADS) symm_moe_combine_bf16(MoeArgs a) { moe_combine_body(a); }
