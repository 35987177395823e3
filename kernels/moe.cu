// MoE dispatch and combine (docs/moe.md is the contract; src/comm/moe/host.rs and
// host_combine.rs run the same protocol on the CPU, with the same arithmetic).
//
// Owns: the kernels' argument struct `MoeArgs` (mirrored by src/comm/moe/launch.rs, checked by
// tests/kernel_table.rs), the control words of a moe block (layout.rs `CTRL_*`), the dispatch
// kernel (routing, counts exchange, rows to the experts' ranks) and the combine kernel (rows back
// to their tokens' ranks, the weighted sum in a fixed order).
//
// One kernel per call, and every block does the same work on its share: there is no routing
// block. Dispatch: each block reads the whole routing once (block 0 the counts per expert, the
// others those of the tokens before their chunk; warp-aggregated shared atomics: sums, so the
// order does not matter), ranks the entries of its own chunk of tokens in token order (a warp
// walks the chunk's entries 32 at a time, `__match_any_sync`), writes their list (a slot per
// expert and token: no scan) and stages its tokens' rows (world > 1). Block 0 stores this
// rank's counts into every rank's counts row as soon as the routing is read, and every block,
// once its chunk's list and rows are in place, fences and stores its own word of that row; each
// word is tagged with the epoch: that is the call's only cross-rank wait. Every block then waits
// for every word of every source's tagged row (keeping what it reads in shared memory: no count
// word is read twice, and nothing after the wait is a chain of round trips) and pulls its share
// of this rank's experts' rows from the sources (rows ordered by source rank, then token: the
// source's list order). Blocks wait for each other's block words, so the grid must be resident
// at once: at most one block per SM (moe/mod.rs `MAX_GRID`, the communicator's fewest SMs,
// `num_sms`), each fits an SM (`MOE_BOUNDS`).
//
// Epochs: a call's epoch is the rank's count of earlier calls of its kind plus one, read from
// the control words at kernel start, and stored at the call's end where no block reads it late:
// the dispatch's block 0 (its wait saw every block of this rank past its read; a receive half
// takes its send half's epoch, D_HALF), the combine's last block to count itself in (C_FIN).
// Graph replays need no reset. Counts rows, entry lists and staged rows alternate by the
// dispatch epoch's parity: a source reaches dispatch n + 2 only after every rank published its
// row of n + 1, i.e. finished pulling call n. The combine's flag row and landing buffer (cbuf)
// alternate by the combine epoch's parity (moe_cbuf), so combines of one dispatch may follow
// each other back to back: a rank reaches combine c + 2 only after every rank raised its flag of
// c + 1, i.e. after every rank's kernel of c finished reading its cbuf and flags. Only peers' rows go through cbuf: a rank sums its own
// experts' rows straight from expert_out.
//
// Determinism: each entry's row within (this rank, its expert) follows token order, rows are
// placed by (source rank, token), and the combine sums k = 0..K-1 with fmaf from 0 into fp32 and
// rounds to bf16 once: y does not depend on arrival order, grid or timing.
//
// Waits follow common.cuh's rule: they poll words in this GPU's memory and, once per
// SYMM_SPIN_CHECK spins, the clock and the abort word; a timeout aborts the communicator naming
// the rank waited for. The only host-mapped memory a kernel touches is stored to: the
// communicator's error words (report_to_host) and the object's status words (moe_record).
#include "common.cuh"
#include "quant.cuh"

#define MOE_THREADS 512
#define MOE_WARPS (MOE_THREADS / 32)
// Every MoE kernel's launch bounds: MOE_THREADS threads and one block per SM (the grid must be
// resident at once, and at most one block per SM is what moe/mod.rs sizes it for), so ptxas may
// use up to 128 registers a thread: with the default it capped them at 64 and spilled.
#define MOE_BOUNDS __launch_bounds__(MOE_THREADS, 1)
#define MOE_MAX_EXPERTS 1024
#define MOE_ROW_EXTRA 8
// Words after ROW_EXTRA in a counts row: one per block of the source's grid (moe/mod.rs
// MAX_GRID), each stored by its block once its list and staged rows are in place.
#define MOE_ROW_BLOCKS 132
#define MOE_SCALE_GROUP 128
// Entries of a block's chunk the dispatch keeps in shared memory between its steps (ent_s, pos_s).
#define MOE_ENT_CACHE 1024
// Bytes of the control part at the start of a moe block; the counts rows follow it.
#define MOE_CTRL_BYTES 4096
// Control words (u64) at the start of a moe block (src/comm/moe/layout.rs CTRL_*).
#define MOE_CTRL_D_DONE 0
#define MOE_CTRL_D_SENT 1
#define MOE_CTRL_C_DONE 2
#define MOE_CTRL_C_SENT 3
#define MOE_CTRL_OK_EPOCH 4
#define MOE_CTRL_D_FIN 5
#define MOE_CTRL_C_FIN 6
#define MOE_CTRL_D_HALF 7
// The clock probe's words (layout.rs CTRL_PROBE, PROBE_*): %globaltimer at the phase boundaries
// of the last dispatch (words 0..7, and 14..15 in the throughput mode) and combine (8..13), in the
// control part, written only by the probe kernels (`PROBE`), local.
#define MOE_CTRL_PROBE 64
#define MOE_P_D_START 0
#define MOE_P_D_ROUTED 1
#define MOE_P_D_STAGED 2
#define MOE_P_D_PUBLISHED 3
#define MOE_P_D_RECV 4
#define MOE_P_D_WAITED 5
#define MOE_P_D_PULLED 6
#define MOE_P_D_EPOCH 7
#define MOE_P_C_START 8
#define MOE_P_C_PUSHED 9
#define MOE_P_C_RECV 10
#define MOE_P_C_WAITED 11
#define MOE_P_C_SUMMED 12
#define MOE_P_C_EPOCH 13
#define MOE_P_D_SCANNED 14  // throughput mode: the CSR's per-expert scans over the blocks done
#define MOE_P_D_SORTED 15   // throughput mode: every block placed its rows (the grid's end)
// Phases of a kernel instance: the whole call, or its send half (up to and including publishing:
// no wait on a peer) or its receive half (the wait, then the pull or the sum). The halves are two
// launches on the same grid; the receive half reads the epoch the send half used (the done count
// moves at its end only) and finds in the block what the send half left there.
#define MOE_BOTH 0
#define MOE_SEND 1
#define MOE_RECV 2
// Flag rows (layout.rs FLAG_*): the combine's two, one per parity of its epoch.
#define MOE_FLAG_COMBINE 0
// MoeArgs::scale_mode bits (launch.rs SCALE_MODE_*): the quantizing dispatch rounds its scales up
// to powers of two; recv_scales is column-major TMA-aligned (per local expert [H/128][R4], R4 = R
// rounded up to a multiple of 4) instead of row-major [L][R][H/128] (config.rs scale_strides).
#define MOE_SCALE_UE8M0 1
#define MOE_SCALE_COL_TMA 2
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
  uint64_t off_flags;              // offsets of the block's parts (layout.rs; counts at
  uint64_t off_recv_counts;        // MOE_CTRL_BYTES)
  uint64_t off_recv_src;
  uint64_t off_recv_x;
  uint64_t off_recv_scales;
  uint64_t off_idx;
  uint64_t off_weights;
  uint64_t off_pos;
  uint64_t off_list;
  uint64_t off_xstage;
  uint64_t off_xscales;
  uint64_t off_cbuf;
  uint64_t max_recv;               // R
  uint64_t num_tokens;             // n of this call (the last dispatch's for combine)
  int64_t refuse_value;
  uint32_t max_tokens;             // T
  uint32_t hidden;                 // H
  int32_t k;                       // the caller's k (<= topk)
  int32_t topk;                    // K
  int32_t experts;                 // E
  int32_t local;                   // L = E / world
  int32_t refuse_code;             // this rank's own refusal (status code), or 0
  int32_t scale_mode;              // MOE_SCALE_* bits
};

__device__ __forceinline__ uint64_t* moe_ctrl(const MoeArgs& a) {
  return (uint64_t*)a.blocks[a.s.rank];
}

// Flag `which` of source `src` in rank `d`'s block.
__device__ __forceinline__ uint64_t* moe_flag(const MoeArgs& a, int d, int which, int src) {
  return (uint64_t*)(a.blocks[d] + a.off_flags) + (uint64_t)which * a.s.world + src;
}

// The counts row of source `src` for `epoch`'s parity, in rank `d`'s block: u64 words, the
// epoch's low 32 bits then the value (layout.rs `tagged`).
__device__ __forceinline__ uint64_t* moe_row(const MoeArgs& a, int d, uint64_t epoch, int src) {
  const uint64_t words = (uint64_t)a.experts + MOE_ROW_EXTRA + MOE_ROW_BLOCKS;
  return (uint64_t*)(a.blocks[d] + MOE_CTRL_BYTES) + ((epoch & 1) * a.s.world + src) * words;
}

// A counts-row word's store and load: system scope when peers take part, GPU scope at world 1
// (nothing then leaves this GPU, and the GPU-scope fences are the cheaper ones).
__device__ __forceinline__ void moe_st_release(uint64_t* p, uint64_t v, bool peers) {
  if (peers)
    st_release_sys_u64(p, v);
  else
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// A release fence: with a barrier before it, the block's earlier writes are ordered before the
// relaxed stores (or atomics) after it. fence.acq_rel, not __threadfence's fence.sc: a release
// needs no total order of fences, and the SC fence costs more.
__device__ __forceinline__ void moe_fence_release(bool peers) {
  if (peers)
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  else
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// A counts-row word that releases nothing (the counts: each word is its own value and tag).
__device__ __forceinline__ void moe_st_relaxed(uint64_t* p, uint64_t v, bool peers) {
  if (peers)
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t moe_ld_acquire(const uint64_t* p, bool peers) {
  if (peers) return ld_acquire_sys_u64(p);
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t moe_tagged(uint64_t epoch, int32_t v) {
  return ((epoch & 0xffffffffull) << 32) | (uint64_t)(uint32_t)v;
}

// Rank `d`'s entry list of dispatch `epoch` for expert `e` (its parity's part of [2][E][T] int32,
// layout.rs `list_at`): element p is the entry (t * K + k) of the p-th token, in token order,
// that rank `d` routed to expert e. A slot per (expert, token), so a sender places an entry
// without a scan over the experts, and a receiver finds (source, expert, row) without the
// source's offsets.
__device__ __forceinline__ int32_t* moe_list(const MoeArgs& a, int d, uint64_t epoch, int e) {
  return (int32_t*)(a.blocks[d] + a.off_list) + (epoch & 1) * (uint64_t)a.experts * a.max_tokens +
         (uint64_t)e * a.max_tokens;
}

// The landing buffer of combine `epoch` in rank `d`'s block: two [T][K][H] bf16 buffers, one per
// parity of the combine epoch (layout.rs cbuf_at).
__device__ __forceinline__ uint8_t* moe_cbuf(const MoeArgs& a, int d, uint64_t epoch) {
  const uint64_t slot = (uint64_t)a.max_tokens * a.topk * a.hidden * 2;
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

// The clock probe's word `i` in a control block (PROBE instances only; one thread stores each
// word): both modes' probes (moe_probe here, tp_probe in moe_tp.cu).
__device__ __forceinline__ void moe_probe_at(uint64_t* ctrl, int i) {
  ctrl[MOE_CTRL_PROBE + i] = globaltimer();
}
__device__ __forceinline__ void moe_probe(const MoeArgs& a, int i) {
  moe_probe_at(moe_ctrl(a), i);
}

// Records a status for the host (moe/status.rs words: the code last) at `status`, the host-mapped
// words of either mode's arguments. Plain posted stores.
__device__ __forceinline__ void moe_record_at(uint64_t status, uint32_t code, int rank, uint32_t token, uint32_t k,
                                              int64_t value, uint32_t call) {
  volatile uint32_t* w = (volatile uint32_t*)status;
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
__device__ __forceinline__ void moe_record(const MoeArgs& a, uint32_t code, int rank, uint32_t token,
                                           uint32_t k, int64_t value, uint32_t call) {
  moe_record_at(a.status, code, rank, token, k, value, call);
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
  // 32-bit: i < W * T * K < 2^31 (config.rs), so no 64-bit division on the routing's path.
  const uint32_t K = (uint32_t)a.topk, t = (uint32_t)i / K, j = (uint32_t)i - t * K;
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

// Copies `bytes` (a multiple of 16) from src to dst with the 32 lanes of a warp, U vectors per
// lane loaded before any is stored (past L1 when CG: rows another GPU or another block wrote in
// this kernel). With `parts` warps on one row, warp `part` copies its every parts-th run of
// 32 * U vectors.
template <int U = 4, bool CG = false>
__device__ __forceinline__ void moe_copy_row(uint8_t* dst, const uint8_t* src, uint64_t bytes, int lane,
                                             uint64_t part = 0, uint64_t parts = 1) {
  const uint64_t n = bytes / 16;
  const uint4* s = (const uint4*)src;
  uint4* d = (uint4*)dst;
  for (uint64_t v = lane + part * 32 * U; v < n; v += 32 * U * parts) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v + u * 32 < n) r[u] = CG ? __ldcg(s + v + u * 32) : s[v + u * 32];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v + u * 32 < n) d[v + u * 32] = r[u];
  }
}

// Vectors per lane a row copy keeps in flight (moe_pull_row's default; the throughput mode's:
// moe_tp.cu MOE_TP_COPY_U).
#define MOE_PULL_U 4
// Slots whose rows the combine's sum loads together.
#define MOE_SUM_J 8
// moe_copy_row loading past L1, with the pull's vectors per lane.
template <int U = MOE_PULL_U>
__device__ __forceinline__ void moe_pull_row(uint8_t* dst, const uint8_t* src, uint64_t bytes, int lane,
                                             uint64_t part = 0, uint64_t parts = 1) {
  moe_copy_row<U, true>(dst, src, bytes, lane, part, parts);
}

// A row's S fp32 scales copied by the 32 lanes of a warp in two steps, so that its row's copy
// goes between them and both are one round trip, not two: moe_scales_load issues the loads of
// the first 64 (past L1 when CG), moe_scales_store stores them at dst[v * stride] and copies any
// others (S > 64: hidden > 8192) itself.
struct MoeScales {
  float v[2];
};
template <bool CG>
__device__ __forceinline__ MoeScales moe_scales_load(const float* src, uint64_t S, int lane) {
  MoeScales r;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const uint64_t v = lane + u * 32;
    r.v[u] = v < S ? (CG ? __ldcg(src + v) : src[v]) : 0.f;
  }
  return r;
}
template <bool CG>
__device__ __forceinline__ void moe_scales_store(const MoeScales& r, float* dst, uint64_t stride, const float* src,
                                                 uint64_t S, int lane) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const uint64_t v = lane + u * 32;
    if (v < S) dst[v * stride] = r.v[u];
  }
  for (uint64_t v = lane + 64; v < S; v += 32) dst[v * stride] = CG ? __ldcg(src + v) : src[v];
}

// Quantizes a bf16 row of H elements (H % 128 == 0) with the 32 lanes of a warp into e4m3 bytes
// at dst and one fp32 scale per 128 elements at scales[0 .. H/128): quant.cuh's per-group
// arithmetic (QUANT_PER_GROUP: a half warp holds a group's 16 vectors), s = max(amax / 448,
// FLT_MIN), rounded up to a power of two when ue8m0, q = e4m3(y * (1 / s)). The host backend does
// the same (src/comm/moe/host.rs quantize_rows): bit for bit the same bytes and scales. With
// `parts` warps on one row, warp `part` does its every parts-th run of 32 vectors (two groups).
template <int U = 4>
__device__ __forceinline__ void moe_quantize_row(uint8_t* dst, float* scales, const uint4* src, uint64_t H,
                                                 bool ue8m0, int lane, uint64_t part = 0, uint64_t parts = 1) {
  const uint64_t vecs = H / 8;  // a multiple of 16: a half warp is all in or all out
  // U of the warp's runs loaded before any is converted: one round trip for them, not U.
  for (uint64_t b = part * 32; b < vecs; b += 32 * parts * U) {
    uint4 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint64_t v = b + u * 32 * parts + lane;
      if (v < vecs) raw[u] = src[v];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint64_t v = b + u * 32 * parts + lane;
      if (b + u * 32 * parts >= vecs) break;  // warp-uniform
      float y[8];
      if (v < vecs) {
        const __nv_bfloat16* h = (const __nv_bfloat16*)&raw[u];
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = __bfloat162float(h[i]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = 0.f;
      }
      float s = amax_scale(half_warp_max(vec_amax(y)));
      if (ue8m0) s = ue8m0_ceil(s);
      if (v < vecs) {
        ((uint2*)dst)[v] = to_e4m3x8(y, 1.f / s);
        if ((lane & 15) == 0) scales[v / 16] = s;
      }
    }
  }
}

// The inclusive scan of x over a warp's lanes below `lanes` (a power of two <= 32; lanes at or
// above it get a partial sum their callers do not use). Every lane of the warp calls it.
template <int lanes = 32>
__device__ __forceinline__ int32_t moe_warp_inclusive(int32_t x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < lanes; o <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// Exclusive prefix sums of in[0..n) into out[0..n) by one warp, 32 at a time (no block
// barrier); returns the total. Every lane of the warp calls it.
__device__ __forceinline__ int64_t moe_warp_scan(const int32_t* in, int32_t* out, int n, int lane) {
  int64_t carry = 0;
  for (int b = 0; b < n; b += 32) {
    const int i = b + lane;
    const int32_t v = i < n ? in[i] : 0;
    const int32_t x = moe_warp_inclusive(v);
    if (i < n) out[i] = (int32_t)(carry + x - v);
    carry += __shfl_sync(0xffffffffu, x, 31);
  }
  return carry;
}

// Exclusive block scan of one value per thread, up to its last barrier: returns the sum of the
// lower threads' values and sets `total`. A warp scan, then every warp scans the warps' totals
// itself (one barrier). warp_s (MOE_WARPS words) stays in use until the caller's next barrier.
__device__ __forceinline__ int32_t moe_block_scan_open(int32_t f, int32_t* warp_s, int32_t& total) {
  static_assert(MOE_WARPS <= 32, "one warp scans the warps' totals");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t x = moe_warp_inclusive(f);
  if (lane == 31) warp_s[warp] = x;
  __syncthreads();
  const int32_t w = moe_warp_inclusive<MOE_WARPS>(lane < MOE_WARPS ? warp_s[lane] : 0);
  const int32_t below = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);  // lane warp - 1
  total = __shfl_sync(0xffffffffu, w, MOE_WARPS - 1);
  return (warp > 0 ? below : 0) + x - f;
}

// The same, closed: every thread of the block calls it, and warp_s is free again on return.
__device__ __forceinline__ int32_t moe_block_scan_value(int32_t f, int32_t* warp_s, int32_t& total) {
  const int32_t ex = moe_block_scan_open(f, warp_s, total);
  __syncthreads();
  return ex;
}

// Exclusive prefix sums of in[0..n) into out[0..n) by the whole block (n <= MOE_MAX_EXPERTS;
// in may be out); returns the total. Each thread takes a run of at most two items: two barriers
// and 5 + 4 shuffle steps, where one warp's scan of 256 items is 8 rounds of 5 dependent steps.
// Every thread calls it, with `in` complete (the caller's barrier); `out` is readable by every
// thread and warp_s free on return.
#define MOE_SCAN_PER (MOE_MAX_EXPERTS / MOE_THREADS)
__device__ __forceinline__ int32_t moe_block_scan(const int32_t* in, int32_t* out, int n, int32_t* warp_s) {
  static_assert(MOE_SCAN_PER * MOE_THREADS == MOE_MAX_EXPERTS, "a run of at most MOE_SCAN_PER items");
  const int per = (n + MOE_THREADS - 1) / MOE_THREADS;  // 1 or 2
  const int i0 = threadIdx.x * per;
  int32_t v[MOE_SCAN_PER], sum = 0;
#pragma unroll
  for (int u = 0; u < MOE_SCAN_PER; ++u) {
    v[u] = u < per && i0 + u < n ? in[i0 + u] : 0;
    sum += v[u];
  }
  int32_t total;
  int32_t run = moe_block_scan_open(sum, warp_s, total);
#pragma unroll
  for (int u = 0; u < MOE_SCAN_PER; ++u) {
    if (u < per && i0 + u < n) out[i0 + u] = run;
    run += v[u];
  }
  __syncthreads();
  return total;
}

// Dispatch (docs/moe.md, "Protocol"): every block runs every step on its share. QUANT: x is bf16,
// quantized to the FP8 payload (PAYLOAD_BYTES 1, SCALES) once per token when its block stages it
// (at every world), and every row, this rank's own too, is pulled from the staged copy. PHASE: the
// whole call (MOE_BOTH), steps 1-2 (MOE_SEND) or steps 3-4 (MOE_RECV); PROBE: record the clock
// probe.
template <int PAYLOAD_BYTES, bool SCALES, typename IDX, bool QUANT = false, int PHASE = MOE_BOTH,
          bool PROBE = false>
__device__ void moe_dispatch_body(const MoeArgs& a) {
  __shared__ int32_t hist_s[MOE_MAX_EXPERTS];    // this rank's counts per expert (block 0 only)
  __shared__ int32_t run_s[MOE_MAX_EXPERTS];     // entries before this block's chunk, per expert
  __shared__ int32_t base_s[MOE_MAX_EXPERTS];    // rows of lower sources per (source, local expert)
  __shared__ int32_t pre_s[MOE_MAX_EXPERTS + 1]; // rows of lower local experts
  // What the wait saw (step 3), so steps 3-4 read no count word twice: per expert the sum over
  // every source (tot_s) and over the sources below this rank (lbel_s); per (source, local
  // expert) the source's count (loc_s); per source its status words (stat_s).
  __shared__ int32_t tot_s[MOE_MAX_EXPERTS];
  __shared__ int32_t lbel_s[MOE_MAX_EXPERTS];
  __shared__ int32_t loc_s[MOE_MAX_EXPERTS];
  __shared__ int32_t stat_s[SYMM_MAX_RANKS][5];
  __shared__ uint64_t epoch_s;
  __shared__ uint32_t bad_s, cap_s;
  __shared__ int32_t found_s[4];                 // code, rank, token, k
  __shared__ int64_t found_v;
  __shared__ int live_s;
  __shared__ int32_t scan_s[MOE_WARPS];          // the block scan's warp totals
  // The block's chunk's entries (expert ids) and their rows within (this rank, expert), kept from
  // step 1b for step 4 when the chunk fits (the one-call form; the receive half reloads them).
  __shared__ int32_t ent_s[MOE_ENT_CACHE];
  __shared__ int32_t pos_s[MOE_ENT_CACHE];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int me = a.s.rank, W = a.s.world, E = a.experts, L = a.local;
  const uint64_t K = a.topk, T = a.max_tokens, H = a.hidden, R = a.max_recv;
  const uint64_t row_bytes = H * PAYLOAD_BYTES, S = H / MOE_SCALE_GROUP;
  uint64_t* ctrl = moe_ctrl(a);
  const uint64_t n = a.refuse_code ? 0 : a.num_tokens;
  // This block's chunk of tokens.
  const uint64_t per = ((uint32_t)n + gridDim.x - 1) / gridDim.x;  // 32-bit: n <= T < 2^31
  const uint64_t c0 = min((uint64_t)blockIdx.x * per, n), c1 = min(c0 + per, n);
  // The routing's first MOE_THREADS entries (step 1a), and this block's chunk's first
  // MOE_THREADS entries and weights (step 1b), loaded while thread 0 reads the control words
  // (one round trip for all, not one after the other).
  uint32_t code0 = 0;
  int32_t key0 = -1;  // the entry's expert, or -1 (none, or offending: code0)
  int32_t ent0 = -1;  // chunk entry c0 * K + tid: its expert (-1 past k), and its weight
  float wt0 = 0.f;
  if (PHASE != MOE_RECV) {
    if (tid < n * K) {
      const int64_t e = moe_entry<IDX>(a, tid, code0);
      key0 = code0 == 0 && e >= 0 ? (int32_t)e : -1;
      if (c0 == 0) ent0 = (int32_t)e;
    }
    const uint64_t i = c0 * K + tid;
    const uint32_t ti = (uint32_t)i / (uint32_t)K, j = (uint32_t)i - ti * (uint32_t)K;
    if (i < c1 * K) {
      uint32_t code;
      if (c0 != 0) ent0 = (int32_t)moe_entry<IDX>(a, i, code);
      if ((int)j < a.k) wt0 = ((const float*)a.topk_weights)[(uint64_t)ti * a.k + j];
    }
  }
  if (tid == 0) {
    // Both loads in flight before any store (block_start's rule: a store between them would
    // wait for the first and serialize two round trips). The receive half takes the epoch its
    // send half stored (D_HALF): D_DONE moves at block 0's end, which other blocks of the
    // receive half may start after.
    const uint64_t done = *(volatile uint64_t*)&ctrl[PHASE == MOE_RECV ? MOE_CTRL_D_HALF : MOE_CTRL_D_DONE];
    const uint32_t dead = *(volatile uint32_t*)abort_word(a.s);
    epoch_s = PHASE == MOE_RECV ? done : done + 1;
    live_s = dead == 0;
    bad_s = 0xffffffffu;
    cap_s = 0xffffffffu;
    if constexpr (PHASE == MOE_RECV) found_s[0] = 0;
    if constexpr (PROBE) {
      if (blockIdx.x == 0) {
        moe_probe(a, PHASE == MOE_RECV ? MOE_P_D_RECV : MOE_P_D_START);
        moe_ctrl(a)[MOE_CTRL_PROBE + MOE_P_D_EPOCH] = epoch_s;
      }
    }
  }
  for (int e = tid; e < E; e += MOE_THREADS) {
    if (blockIdx.x == 0) hist_s[e] = 0;  // block 0's counts (step 1a)
    run_s[e] = 0;
    tot_s[e] = 0;
    lbel_s[e] = 0;
  }
  __syncthreads();
  if (!live_s) return;
  const uint64_t epoch = epoch_s;
  const bool cached = PHASE == MOE_BOTH && (c1 - c0) * K <= MOE_ENT_CACHE;
  int32_t* idx = (int32_t*)(a.blocks[me] + a.off_idx);
  float* wts = (float*)(a.blocks[me] + a.off_weights);
  int32_t* pos = (int32_t*)(a.blocks[me] + a.off_pos);
  // The send half, steps 1 and 2 (not indented, so the one-call form reads as before).
  if constexpr (PHASE != MOE_RECV) {

  // Step 1a: the whole routing, a thread per entry (its loads independent of every other
  // entry's): the first offending entry; block 0 the counts per expert (its counts row), every
  // other block those of the tokens before its chunk (its entries' rows); aggregated per warp,
  // sums, so the order does not matter.
  const bool first = blockIdx.x == 0;
  for (uint64_t b = 0; b < n * K; b += MOE_THREADS) {
    const uint64_t i = b + tid, t = (uint32_t)i / (uint32_t)K;
    uint32_t code = code0;
    int key = key0;
    if (b > 0) {
      const int64_t e = i < n * K ? moe_entry<IDX>(a, i, code) : -1;
      key = (code == 0 && e >= 0) ? (int)e : -1;
    }
    if (code) atomicMin(&bad_s, (uint32_t)i);
    if (first) {
      const uint32_t all = __match_any_sync(0xffffffffu, key);
      if (key >= 0 && lane == __ffs(all) - 1) atomicAdd(&hist_s[key], __popc(all));
    } else {
      const int key2 = t < c0 ? key : -1;
      const uint32_t before = __match_any_sync(0xffffffffu, key2);
      if (key2 >= 0 && lane == __ffs(before) - 1) atomicAdd(&run_s[key2], __popc(before));
    }
  }
  __syncthreads();
  if constexpr (PROBE) {
    if (blockIdx.x == 0 && tid == 0) moe_probe(a, MOE_P_D_ROUTED);
  }
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
      found_s[2] = (int32_t)(bad_s / (uint32_t)K);
      found_s[3] = (int32_t)(bad_s % (uint32_t)K);
      found_v = e;
    }
  }
  __syncthreads();
  const bool own_bad = found_s[0] != 0;

  // Step 2a: block 0 stores this rank's counts row (or zeros and its refusal / first bad entry)
  // into every rank, each word tagged with the epoch. Relaxed stores: a count releases nothing
  // (the block words of step 2b release the lists and staged rows), so the counts leave now,
  // before the chunk's work, and no store waits for a fence.
  if (blockIdx.x == 0) {
    const int words = E + MOE_ROW_EXTRA;
    for (int q = tid; q < W * words; q += MOE_THREADS) {
      const int d = q / words, w = q % words;
      int32_t v = 0;
      if (w < E) {
        v = own_bad ? 0 : hist_s[w];
      } else if (own_bad) {
        const int x = w - E;
        v = x == 0 ? found_s[0]
            : x == 1 ? found_s[2]
            : x == 2 ? found_s[3]
            : x == 3 ? (int32_t)(uint32_t)(uint64_t)found_v
            : x == 4 ? (int32_t)(uint32_t)((uint64_t)found_v >> 32)
                     : 0;
      }
      moe_st_relaxed(moe_row(a, d, epoch, me) + w, moe_tagged(epoch, v), W > 1);
    }
  }

  // Step 1b: this block's chunk of tokens: the local copy of the routing, each entry's row
  // within (this rank, its expert) in token order, the list, the staged rows.
  if (!own_bad) {
    for (uint64_t i = c0 * K + tid; i < c1 * K; i += MOE_THREADS) {
      int32_t e = ent0;
      float wt = wt0;
      if (i >= c0 * K + MOE_THREADS) {  // past what the kernel's start loaded
        const uint32_t t = (uint32_t)i / (uint32_t)K, j = (uint32_t)i - t * (uint32_t)K;
        uint32_t code;
        e = (int32_t)moe_entry<IDX>(a, i, code);
        wt = (int)j < a.k ? ((const float*)a.topk_weights)[t * a.k + j] : 0.f;
      }
      idx[i] = e;
      if (cached) ent_s[i - c0 * K] = e;
      wts[i] = wt;
    }
    __syncthreads();  // ent_s for warp 0
    if (warp == 0) {
      // 4 x 32 entries' ids loaded together, then ranked 32 at a time in entry order.
      for (uint64_t b0 = c0 * K; b0 < c1 * K; b0 += 32 * 4) {
        int32_t ev[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint64_t i = b0 + u * 32 + lane;
          ev[u] = i < c1 * K ? (cached ? ent_s[i - c0 * K] : idx[i]) : -1;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint64_t i = b0 + u * 32 + lane;
          const int32_t e = ev[u];
          const uint32_t peers = __match_any_sync(0xffffffffu, e);
          const uint32_t lower = peers & ((1u << lane) - 1);
          const int32_t r0 = e >= 0 ? run_s[e] : 0;
          __syncwarp();
          if (e >= 0 && lower == 0) run_s[e] = r0 + __popc(peers);
          __syncwarp();
          if (i < c1 * K) {
            const int32_t p = e >= 0 ? r0 + __popc(lower) : -1;
            pos[i] = p;
            if (cached) pos_s[i - c0 * K] = p;
            if (e >= 0) moe_list(a, me, epoch, e)[p] = (int32_t)i;
          }
        }
      }
    }
    if (W > 1 || QUANT) {
      // The warps a short chunk leaves idle share its rows: `parts` warps per token, each with
      // its own runs of the row (so a token is not one warp's chain of dependent round trips).
      uint8_t* xs = (uint8_t*)(a.blocks[me] + a.off_xstage) + (epoch & 1) * T * row_bytes;
      const uint64_t toks = c1 - c0;
      const uint64_t runs = QUANT ? (H / 8 + 31) / 32 : (row_bytes / 16 + 127) / 128;
      const uint64_t parts = toks == 0 ? 1 : max((uint64_t)1, min((uint64_t)(MOE_WARPS / (uint32_t)toks), runs));
      for (uint64_t qp = warp; qp < toks * parts; qp += MOE_WARPS) {
        const uint32_t qt = (uint32_t)qp / (uint32_t)parts;
        const uint64_t t = c0 + qt, part = (uint32_t)qp - qt * (uint32_t)parts;
        if (QUANT) {
          float* ds = (float*)(a.blocks[me] + a.off_xscales) + (epoch & 1) * T * S + t * S;
          moe_quantize_row(xs + t * row_bytes, ds, (const uint4*)a.x + t * (H / 8), H,
                           (a.scale_mode & MOE_SCALE_UE8M0) != 0, lane, part, parts);
          continue;
        }
        // The token's scales: its first part's warp, loaded before its run of the row.
        const float* xsc = SCALES ? (const float*)a.x_scales + t * S : nullptr;
        MoeScales sc{};
        if (SCALES && part == 0) sc = moe_scales_load<false>(xsc, S, lane);
        moe_copy_row(xs + t * row_bytes, (const uint8_t*)a.x + t * row_bytes, row_bytes, lane, part, parts);
        if (SCALES && part == 0) {
          float* ds = (float*)(a.blocks[me] + a.off_xscales) + (epoch & 1) * T * S + t * S;
          moe_scales_store<false>(sc, ds, 1, xsc, S, lane);
        }
      }
    }
  }
  __syncthreads();

  // Step 2b: the block's word in this rank's row on every rank, tagged with the epoch, after a
  // fence (system scope when peers read): it releases the block's list entries and staged rows.
  // No block waits for another here: the receivers wait for every block's word.
  if (tid == 0) {
    moe_fence_release(W > 1);
    if constexpr (PROBE) {
      if (blockIdx.x == 0) moe_probe(a, MOE_P_D_STAGED);
    }
    for (int d = 0; d < W; ++d)
      moe_st_relaxed(moe_row(a, d, epoch, me) + E + MOE_ROW_EXTRA + blockIdx.x, moe_tagged(epoch, 1), W > 1);
    if (blockIdx.x == 0) {
      ctrl[MOE_CTRL_D_HALF] = epoch;  // read by the receive half only (a later kernel)
      if constexpr (PROBE) moe_probe(a, MOE_P_D_PUBLISHED);
    }
  }
  }  // the send half
  if constexpr (PHASE == MOE_SEND) return;
  if constexpr (PROBE && PHASE == MOE_BOTH) {
    if (blockIdx.x == 0 && tid == 0) moe_probe(a, MOE_P_D_RECV);
  }

  // Step 3, the one wait: every word of every source's row carries this epoch's tag: its counts,
  // its status words and its grid's block words (the grid is the same on every rank). A warp
  // takes 32 consecutive words a pass, all its lanes every pass (a warp-uniform trip count), and
  // leaves together when one lane gives up. The sums are per expert, W words each at most.
  int ok = 1;
  {
    const int words = E + MOE_ROW_EXTRA + (int)gridDim.x, all = W * words;
    const uint64_t start = globaltimer();
    uint32_t spins = 0;
    const uint32_t tag = (uint32_t)epoch;
    for (int b = warp * 32; b < all; b += MOE_THREADS) {
      const int q = b + lane, s = q / words, wi = q - s * words;
      if (q < all && ok) {
        const uint64_t* w = moe_row(a, me, epoch, s) + wi;
        uint64_t got;
        while ((uint32_t)((got = moe_ld_acquire(w, W > 1)) >> 32) != tag) {
          if (give_up(a.s, spins, start, s)) {
            ok = 0;
            break;
          }
        }
        if (ok) {
          const int32_t v = (int32_t)(uint32_t)got;
          if (wi < E) {
            if (v != 0) {
              atomicAdd(&tot_s[wi], v);
              if (s < me) atomicAdd(&lbel_s[wi], v);
            }
            if (wi >= me * L && wi < (me + 1) * L) loc_s[s * L + (wi - me * L)] = v;
          } else if (wi - E < 5) {
            stat_s[s][wi - E] = v;
          }
        }
      }
      ok = __all_sync(0xffffffffu, ok);  // one lane's timeout or abort ends its warp's wait
      if (!ok) break;
    }
  }
  if (!__syncthreads_and(ok)) return;
  if constexpr (PROBE) {
    if (blockIdx.x == 0 && tid == 0) moe_probe(a, MOE_P_D_WAITED);
  }
  // After the wait, one pass and one block scan (two barriers; everything reads what the wait
  // left in shared memory): every thread checks its experts' capacity (cap_s: the lowest expert
  // over R) and writes the rows of lower sources per (source, local expert) (base_s); the scan
  // gives each local expert the rows of lower local experts (pre_s). A row's entry is then at
  // element row - base_s of its source's list for expert e (moe_list): no offset of the source's
  // is needed.
  for (int e = tid; e < E; e += MOE_THREADS)
    if ((int64_t)tot_s[e] > (int64_t)R) atomicMin(&cap_s, (uint32_t)e);
  for (int le = tid; le < L; le += MOE_THREADS) {
    int32_t below = 0;
    for (int s = 0; s < W; ++s) {
      base_s[s * L + le] = below;
      below += loc_s[s * L + le];
    }
  }
  const uint64_t total = (uint64_t)moe_block_scan(tot_s + me * L, pre_s, L, scan_s);
  // The first status (lowest rank), else capacity (lowest expert): the same on every rank, and
  // found by every thread from shared memory.
  int fs = -1;
  for (int s = 0; s < W && fs < 0; ++s)
    if (stat_s[s][0] != 0) fs = s;
  const bool failed = fs >= 0 || cap_s != 0xffffffffu;
  int32_t* recv_counts = (int32_t*)(a.blocks[me] + a.off_recv_counts);
  if (failed) {
    if (blockIdx.x == 0) {
      for (int le = tid; le < L; le += MOE_THREADS) recv_counts[le] = 0;
      if (tid == 0) {
        if (fs >= 0) {
          const int32_t code = stat_s[fs][0];
          if (!(fs == me && moe_is_refusal(code)))
            moe_record(a, code, fs, stat_s[fs][1], stat_s[fs][2],
                       (int64_t)((uint64_t)(uint32_t)stat_s[fs][3] | ((uint64_t)(uint32_t)stat_s[fs][4] << 32)), 0);
        } else {
          moe_record(a, MOE_ST_CAPACITY, (int32_t)(cap_s / L), cap_s, 0, (int64_t)tot_s[cap_s], 0);
        }
      }
    }
  } else {
    // Step 4: pull. Per (source, local expert) q = s * L + le: its rows (loc_s) and the rows of
    // lower sources (base_s); per local expert the rows of lower local experts (pre_s).
    if (blockIdx.x == 0)
      for (int le = tid; le < L; le += MOE_THREADS) recv_counts[le] = tot_s[me * L + le];
    // Each of this chunk's entries' row in its expert's rank (the combine reads this rank's own
    // experts' rows in place); stored before the pull, so these stores drain beside its copies.
    for (uint64_t i = c0 * K + tid; i < c1 * K; i += MOE_THREADS) {
      const int32_t e = cached ? ent_s[i - c0 * K] : idx[i];
      if (e < 0) continue;
      pos[i] = (int32_t)((uint64_t)(e % L) * R + lbel_s[e] + (cached ? pos_s[i - c0 * K] : pos[i]));
    }
    const uint64_t nwarps = (uint64_t)gridDim.x * MOE_WARPS;
    // Warps the rows leave idle share them: `parts` warps per row (at 1 token 8 rows on 64
    // warps), at most one run of 32 * MOE_PULL_U vectors each; every block computes the same.
    const uint64_t runs = (row_bytes / 16 + 32 * MOE_PULL_U - 1) / (32 * MOE_PULL_U);
    const uint64_t parts = total == 0 ? 1 : max((uint64_t)1, min((uint64_t)((uint32_t)nwarps / (uint32_t)total), runs));
    for (uint64_t qp = (uint64_t)blockIdx.x * MOE_WARPS + warp; qp < total * parts; qp += nwarps) {
      const uint32_t q = (uint32_t)qp / (uint32_t)parts, part = (uint32_t)qp - q * (uint32_t)parts;
      int lo = 0, hi = L;  // the local expert with pre_s[lo] <= q < pre_s[lo + 1]
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if ((uint64_t)pre_s[mid] <= q) lo = mid; else hi = mid;
      }
      const int32_t row = (int32_t)(q - (uint64_t)pre_s[lo]);
      int s = 0;
      while (s + 1 < W && base_s[(s + 1) * L + lo] <= row) ++s;
      const int32_t entry = __ldcg(moe_list(a, s, epoch, me * L + lo) + (row - base_s[s * L + lo]));
      const uint64_t t = (uint32_t)entry / (uint32_t)K, slot = (uint64_t)lo * R + row;
      const uint8_t* src = s == me && !QUANT ? (const uint8_t*)a.x
                                   : (const uint8_t*)(a.blocks[s] + a.off_xstage) + (epoch & 1) * T * row_bytes;
      // The row's scales: its first part's warp, loaded before its run of the row.
      const float* ss = !SCALES             ? nullptr
                        : s == me && !QUANT ? (const float*)a.x_scales + t * S
                                            : (const float*)(a.blocks[s] + a.off_xscales) + (epoch & 1) * T * S + t * S;
      MoeScales sc{};
      if (SCALES && part == 0) sc = moe_scales_load<true>(ss, S, lane);
      moe_pull_row((uint8_t*)(a.blocks[me] + a.off_recv_x) + slot * row_bytes, src + t * row_bytes, row_bytes, lane,
                   part, parts);
      if (part != 0) continue;  // the row's scales and source: its first part's warp
      if (SCALES) {
        // Scale (lo, row, g) at lo * se + row * sr + g * sg (config.rs scale_strides).
        const uint64_t R4 = (R + 3) & ~3ull;
        const bool col = (a.scale_mode & MOE_SCALE_COL_TMA) != 0;
        const uint64_t se = col ? S * R4 : R * S, sr = col ? 1 : S, sg = col ? R4 : 1;
        float* ds = (float*)(a.blocks[me] + a.off_recv_scales) + (uint64_t)lo * se + (uint64_t)row * sr;
        moe_scales_store<true>(sc, ds, sg, ss, S, lane);
      }
      if (lane == 0)
        ((int32_t*)(a.blocks[me] + a.off_recv_src))[slot] = (int32_t)((uint64_t)s * T * K + (uint64_t)entry);
    }
  }
  // The call's end: block 0 stores the done count. Every block of this rank read it at its start,
  // before storing its block word, which block 0's wait saw: none reads it late. Plain stores,
  // no fence: the next call is a later kernel. (The probe counts the blocks in to time the
  // grid's end.)
  __syncthreads();
  if (tid == 0) {
    if constexpr (PROBE) {
      __threadfence();
      const unsigned long long old = atomicAdd((unsigned long long*)&ctrl[MOE_CTRL_D_FIN], 1ull);
      if (old + 1 == epoch * gridDim.x) moe_probe(a, MOE_P_D_PULLED);
    }
    if (blockIdx.x == 0) {
      if (!failed) ctrl[MOE_CTRL_OK_EPOCH] = epoch;
      ctrl[MOE_CTRL_D_DONE] = epoch;
    }
  }
}

// Combine: every block sends its share of the received rows' expert outputs that belong to
// peers' tokens back to their ranks (cbuf[parity][t][k] there); the grid's last block raises the
// combine flags of the parity; every block waits for every peer, then sums its share of this
// rank's tokens in k order, reading its own experts' rows in place in expert_out (pos). Any
// number of combines may follow one dispatch (header: the parity alternation). PHASE: the whole
// call, step 1 (MOE_SEND: the rows out and the flags raised) or step 2 (MOE_RECV: the wait and
// the sum); PROBE: record the clock probe.
template <int PHASE = MOE_BOTH, bool PROBE = false>
__device__ void moe_combine_body(const MoeArgs& a) {
  __shared__ uint64_t epoch_s;
  __shared__ int live_s, dispatched_s;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int me = a.s.rank, W = a.s.world;
  uint64_t* ctrl = moe_ctrl(a);
  if (tid == 0) {
    // Every load in flight before any store (block_start's rule: one round trip, not four).
    const uint64_t c = *(volatile uint64_t*)&ctrl[MOE_CTRL_C_DONE];
    const uint64_t d = *(volatile uint64_t*)&ctrl[MOE_CTRL_D_DONE];
    const uint64_t ok = *(volatile uint64_t*)&ctrl[MOE_CTRL_OK_EPOCH];
    const uint32_t dead = *(volatile uint32_t*)abort_word(a.s);
    epoch_s = c + 1;
    dispatched_s = d > 0 && ok == d;
    live_s = dead == 0;
    if constexpr (PROBE) {
      if (blockIdx.x == 0) {
        moe_probe(a, PHASE == MOE_RECV ? MOE_P_C_RECV : MOE_P_C_START);
        ctrl[MOE_CTRL_PROBE + MOE_P_C_EPOCH] = epoch_s;
      }
    }
  }
  __syncthreads();
  if (!live_s) return;
  const uint64_t epoch = epoch_s;
  const int flag = MOE_FLAG_COMBINE + (int)(epoch & 1);
  const bool refused = a.refuse_code != 0;
  const bool dispatched = dispatched_s != 0;
  const uint64_t K = a.topk, T = a.max_tokens, H = a.hidden, R = a.max_recv;
  const uint64_t row_bytes = H * 2;

  // Step 1: the received rows' outputs to their sources' cbuf (none at world 1). The rows of all
  // local experts are numbered through (pre_s: the counts' prefix sums) and dealt to the grid's warps, so a
  // few rows per expert still spread over every warp.
  __shared__ int32_t pre_s[MOE_MAX_EXPERTS + 1];
  if (PHASE != MOE_RECV && !refused && dispatched && W > 1) {
    const int L = a.local;
    const int32_t* counts = (const int32_t*)(a.blocks[me] + a.off_recv_counts);
    const int32_t* src = (const int32_t*)(a.blocks[me] + a.off_recv_src);
    if (warp == 0) {
      const int64_t total = moe_warp_scan(counts, pre_s, L, lane);
      if (lane == 0) pre_s[L] = (int32_t)total;
    }
    __syncthreads();
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
      // 32-bit: a code is below W * T * K < 2^31 (config.rs).
      const uint32_t code = (uint32_t)src[slot], TK = (uint32_t)(T * K), s = code / TK;
      const uint32_t tk = code - s * TK, t = tk / (uint32_t)K, j = tk - t * (uint32_t)K;
      if ((int)s == me) continue;  // summed in place by this rank
      moe_copy_row(moe_cbuf(a, (int)s, epoch) + (t * K + j) * row_bytes,
                   (const uint8_t*)a.expert_out + slot * row_bytes, row_bytes, lane);
    }
  }
  if constexpr (PHASE != MOE_RECV) {
  __syncthreads();
  if (tid == 0 && W > 1) {  // at world 1 nobody waits for this rank's flag
    moe_fence_release(true);  // the rows this block pushed into peers' cbuf
    const unsigned long long old = atomicAdd((unsigned long long*)&ctrl[MOE_CTRL_C_SENT], 1ull);
    if (old + 1 == epoch * gridDim.x) moe_raise(a, flag, 2 * epoch + (refused ? 1 : 0));
    if constexpr (PROBE) {
      if (old + 1 == epoch * gridDim.x) moe_probe(a, MOE_P_C_PUSHED);
    }
  }
  if constexpr (PROBE) {
    if (tid == 0 && W == 1 && blockIdx.x == 0) moe_probe(a, MOE_P_C_PUSHED);
  }
  }  // the send half
  if constexpr (PHASE == MOE_SEND) return;
  if constexpr (PROBE && PHASE == MOE_BOTH) {
    if (blockIdx.x == 0 && tid == 0) moe_probe(a, MOE_P_C_RECV);
  }

  // Step 2: every source's rows are here (a flag is 2 * epoch, plus one when it refused; no
  // source can be two combines ahead, so the value is exactly this combine's).
  __shared__ int other_s;
  if (tid == 0) other_s = W;
  __syncthreads();
  int ok = 1;
  if (tid < W && tid != me) {
    const uint64_t v = moe_wait(a, flag, tid, 2 * epoch);
    ok = v != 0;
    if (ok && v == 2 * epoch + 1) atomicMin(&other_s, tid);
  }
  if (!__syncthreads_and(ok)) return;
  if constexpr (PROBE) {
    if (blockIdx.x == 0 && tid == 0) moe_probe(a, MOE_P_C_WAITED);
  }
  if (!refused) {
    const bool zeros = !dispatched || other_s < W;
    const uint64_t n = a.num_tokens, vecs = H / 8;
    const int32_t* idx = (const int32_t*)(a.blocks[me] + a.off_idx);
    const int32_t* pos = (const int32_t*)(a.blocks[me] + a.off_pos);
    const float* wts = (const float*)(a.blocks[me] + a.off_weights);
    const uint8_t* cbuf = moe_cbuf(a, me, epoch);
    const uint64_t step = (uint64_t)gridDim.x * MOE_THREADS;
    for (uint64_t q = (uint64_t)blockIdx.x * MOE_THREADS + tid; q < n * vecs; q += step) {
      // 32-bit division when the items fit (every shape in practice), else 64-bit.
      const bool small = n * vecs <= 0xffffffffull;
      const uint64_t t = small ? (uint32_t)q / (uint32_t)vecs : q / vecs, v = q - t * vecs;
      float acc[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] = 0.f;
      if (!zeros) {
        // MOE_SUM_J slots at a time: their ids, weights and places loaded together (every slot
        // below K has all three: the dispatch writes them), then their rows together, so a slot
        // is not a chain of round trips of its own; the sum stays in increasing k.
        for (uint64_t j0 = 0; j0 < K; j0 += MOE_SUM_J) {
          int32_t e[MOE_SUM_J], p[MOE_SUM_J];
          float w[MOE_SUM_J];
          uint4 raw[MOE_SUM_J];
#pragma unroll
          for (int u = 0; u < MOE_SUM_J; ++u) {
            const bool in = j0 + u < K;
            e[u] = in ? idx[t * K + j0 + u] : -1;
            w[u] = in ? wts[t * K + j0 + u] : 0.f;
            p[u] = in ? pos[t * K + j0 + u] : 0;
          }
#pragma unroll
          for (int u = 0; u < MOE_SUM_J; ++u) {
            raw[u] = make_uint4(0, 0, 0, 0);
            // A peer's row: written by the peer in this kernel, loaded past L1 (ld.global.cg).
            // This rank's own expert's row: where the experts left it.
            if (e[u] >= 0)
              raw[u] = e[u] / a.local == me
                           ? ((const uint4*)((const uint8_t*)a.expert_out + (uint64_t)p[u] * row_bytes))[v]
                           : __ldcg((const uint4*)(cbuf + (t * K + j0 + u) * row_bytes) + v);
          }
#pragma unroll
          for (int u = 0; u < MOE_SUM_J; ++u) {
            if (e[u] < 0) continue;
            const __nv_bfloat16* b = (const __nv_bfloat16*)&raw[u];
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[c] = fmaf(w[u], __bfloat162float(b[c]), acc[c]);
          }
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
  __syncthreads();
  if (tid == 0) {
    const unsigned long long old = atomicAdd((unsigned long long*)&ctrl[MOE_CTRL_C_FIN], 1ull);
    if (old + 1 == epoch * gridDim.x) ctrl[MOE_CTRL_C_DONE] = epoch;
    if constexpr (PROBE) {
      if (old + 1 == epoch * gridDim.x) moe_probe(a, MOE_P_C_SUMMED);
    }
  }
}

extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_bf16_i32(MoeArgs a) { moe_dispatch_body<2, false, int32_t>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_bf16_i64(MoeArgs a) { moe_dispatch_body<2, false, int64_t>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_fp8_i32(MoeArgs a) { moe_dispatch_body<1, true, int32_t>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_fp8_i64(MoeArgs a) { moe_dispatch_body<1, true, int64_t>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_combine_bf16(MoeArgs a) { moe_combine_body(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_bf16_to_fp8_i32(MoeArgs a) { moe_dispatch_body<1, true, int32_t, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_bf16_to_fp8_i64(MoeArgs a) { moe_dispatch_body<1, true, int64_t, true>(a); }

// The split halves (symm_moe_dispatch_send / _recv, symm_moe_combine_send / _recv). The receive
// half of a dispatch reads only the block (the staged list, idx, pos) and the caller's x and
// x_scales (its own rows), so it has one instance per payload.
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_bf16_i32(MoeArgs a) { moe_dispatch_body<2, false, int32_t, false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_bf16_i64(MoeArgs a) { moe_dispatch_body<2, false, int64_t, false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_fp8_i32(MoeArgs a) { moe_dispatch_body<1, true, int32_t, false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_fp8_i64(MoeArgs a) { moe_dispatch_body<1, true, int64_t, false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_recv_bf16(MoeArgs a) { moe_dispatch_body<2, false, int32_t, false, MOE_RECV>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_recv_fp8(MoeArgs a) { moe_dispatch_body<1, true, int32_t, false, MOE_RECV>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_combine_send_bf16(MoeArgs a) { moe_combine_body<MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_combine_recv_bf16(MoeArgs a) { moe_combine_body<MOE_RECV>(a); }

// The clock probe's instances of every kernel above (an object created with the probe on uses
// these; the others carry no probe code).
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_bf16_i32_probe(MoeArgs a) { moe_dispatch_body<2, false, int32_t, false, MOE_BOTH, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_bf16_i64_probe(MoeArgs a) { moe_dispatch_body<2, false, int64_t, false, MOE_BOTH, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_fp8_i32_probe(MoeArgs a) { moe_dispatch_body<1, true, int32_t, false, MOE_BOTH, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_fp8_i64_probe(MoeArgs a) { moe_dispatch_body<1, true, int64_t, false, MOE_BOTH, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_combine_bf16_probe(MoeArgs a) { moe_combine_body<MOE_BOTH, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_bf16_i32_probe(MoeArgs a) { moe_dispatch_body<2, false, int32_t, false, MOE_SEND, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_bf16_i64_probe(MoeArgs a) { moe_dispatch_body<2, false, int64_t, false, MOE_SEND, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_fp8_i32_probe(MoeArgs a) { moe_dispatch_body<1, true, int32_t, false, MOE_SEND, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_fp8_i64_probe(MoeArgs a) { moe_dispatch_body<1, true, int64_t, false, MOE_SEND, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_recv_bf16_probe(MoeArgs a) { moe_dispatch_body<2, false, int32_t, false, MOE_RECV, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_recv_fp8_probe(MoeArgs a) { moe_dispatch_body<1, true, int32_t, false, MOE_RECV, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_combine_send_bf16_probe(MoeArgs a) { moe_combine_body<MOE_SEND, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_combine_recv_bf16_probe(MoeArgs a) { moe_combine_body<MOE_RECV, true>(a); }

// The quantizing dispatch's halves and probe instances (its receive half pulls this rank's own
// rows from the staged copy too, so it is not the FP8 payload's).
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_bf16_to_fp8_i32(MoeArgs a) { moe_dispatch_body<1, true, int32_t, true, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_bf16_to_fp8_i64(MoeArgs a) { moe_dispatch_body<1, true, int64_t, true, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_recv_bf16_to_fp8(MoeArgs a) { moe_dispatch_body<1, true, int32_t, true, MOE_RECV>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_bf16_to_fp8_i32_probe(MoeArgs a) { moe_dispatch_body<1, true, int32_t, true, MOE_BOTH, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_bf16_to_fp8_i64_probe(MoeArgs a) { moe_dispatch_body<1, true, int64_t, true, MOE_BOTH, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_bf16_to_fp8_i32_probe(MoeArgs a) { moe_dispatch_body<1, true, int32_t, true, MOE_SEND, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_send_bf16_to_fp8_i64_probe(MoeArgs a) { moe_dispatch_body<1, true, int64_t, true, MOE_SEND, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_dispatch_recv_bf16_to_fp8_probe(MoeArgs a) { moe_dispatch_body<1, true, int32_t, true, MOE_RECV, true>(a); }
