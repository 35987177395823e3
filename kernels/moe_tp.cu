// MoE dispatch and combine, throughput mode (docs/moe.md "Throughput mode"; src/comm/moe/tp_host.rs
// runs the same protocol on the CPU, with the same arithmetic).
//
// Owns: the kernels' argument struct `MoeTpArgs` (mirrored by src/comm/moe/throughput.rs), the
// throughput dispatch kernels (one row per (token, destination rank), by source rank then token,
// the local top-k of each row, per-expert counts and the CSR of rows by local expert) and the
// combine kernel (per token, the rows of the ranks it went to summed in increasing rank order in
// fp32, rounded once). Uses moe.cu's control words, status codes and helpers (build.rs puts every
// kernels/*.cu in one unit, moe.cu before this file).
//
// Dispatch: every block routes its chunk of tokens (validation, its tokens' ranks per destination
// by block scans), and after a grid barrier (tp_grid_sync: a count-in every block waits on)
// places them in the token lists by destination at the lower blocks' counts, so the lists keep
// token order; every block stages rows (quantized, the fp8q kernels, at every world). The grid's
// last block to count itself in (D_SENT) stores this rank's counts row, each word tagged with the
// epoch, into every rank (the call's one cross-rank wait); every block pulls a contiguous share of
// the received rows with their local top-k, counting its slots per local expert, then the CSR by
// local expert (tp_grid_csr: two grid barriers, per-expert scans over the blocks' counts, then
// each block places its own rows); block 0 writes the control words at its end (the probe's
// kernels count the blocks in at D_FIN to time the grid's end).
// Combine: the second and later combines of one dispatch first wait for every rank's "read" flag
// of the previous one (CTRL_TP_FIRST); each rank stages its peers' rows in its cstage, the last
// block raises "staged" (2c + refused) on every rank, every block waits for all of them (the one
// wait), sums its share of y, and the last block raises "read" (c). The grid must be resident at
// once (moe/mod.rs MAX_GRID).
//
// Waits follow common.cuh's rule (poll local words, check the clock and the abort word once per
// SYMM_SPIN_CHECK spins; a timeout aborts the communicator naming the rank).

// Control words of the throughput mode besides moe.cu's (src/comm/moe/throughput.rs CTRL_TP_*):
// the first combine epoch of the last dispatch, the grid barrier's count, and this rank's counts
// row as block 0 leaves it for the publishing block (W counts, then the status words).
#define MOE_CTRL_TP_FIRST 7
#define MOE_CTRL_TP_SYNC 8   // tp_grid_sync's count
#define MOE_CTRL_TP_ROW 16
// Flag rows (throughput.rs TP_FLAG_*).
#define MOE_TP_FLAG_STAGED 0
#define MOE_TP_FLAG_READ 1

struct MoeTpArgs {
  SymmArgs s;
  uint64_t blocks[SYMM_MAX_RANKS];
  uint64_t x_or_expert_out;        // dispatch: x [n][H]; combine: expert_out [W*T][H] bf16
  uint64_t x_scales;               // [n][H/128] fp32 (FP8 dispatch)
  uint64_t topk_idx;               // [n][k] int32 or int64 (dispatch)
  uint64_t weights_or_y;           // dispatch: topk_weights [n][k] fp32; combine: y [n][H] bf16
  uint64_t status;                 // uint32_t[16], host-mapped, stored to only
  uint64_t off_flags;
  uint64_t off_meta;               // [1 + L + L + 1] int32
  uint64_t off_recv_src;
  uint64_t off_recv_idx;
  uint64_t off_recv_weights;
  uint64_t off_expert_rows;
  uint64_t off_recv_x;
  uint64_t off_recv_scales;
  uint64_t off_idx;                // [2][T][K] int32, per dispatch parity
  uint64_t off_weights;            // [2][T][K] fp32
  uint64_t off_pos;                // [T][W] int32
  uint64_t off_list;               // [2][W*T] int32
  uint64_t off_xstage;
  uint64_t off_xscales;
  uint64_t off_cstage;             // [W*T][H] bf16
  uint64_t off_csr;                // [MAX_GRID][L] int32: tp_grid_csr's counts (then prefixes, on large grids)
  uint64_t num_tokens;
  int64_t refuse_value;
  uint32_t max_tokens;             // T
  uint32_t hidden;                 // H
  int32_t k;
  int32_t topk;                    // K
  int32_t experts;                 // E
  int32_t local;                   // L
  int32_t refuse_code;
  int32_t scale_mode;              // MOE_SCALE_* bits (moe.cu): UE8M0 (QUANT), column-major recv_scales
};

__device__ __forceinline__ uint64_t* tp_flag(const MoeTpArgs& a, int d, int which, int src) {
  return (uint64_t*)(a.blocks[d] + a.off_flags) + (uint64_t)which * a.s.world + src;
}

// The counts row of source `src` for `epoch`'s parity in rank `d`'s block (W + 8 tagged words).
__device__ __forceinline__ uint64_t* tp_row(const MoeTpArgs& a, int d, uint64_t epoch, int src) {
  const uint64_t words = (uint64_t)a.s.world + MOE_ROW_EXTRA;
  return (uint64_t*)(a.blocks[d] + MOE_CTRL_BYTES) + ((epoch & 1) * a.s.world + src) * words;
}

__device__ __forceinline__ int32_t tp_count(const MoeTpArgs& a, uint64_t epoch, int src, int w) {
  return (int32_t)(uint32_t)*(volatile uint64_t*)(tp_row(a, a.s.rank, epoch, src) + w);
}

__device__ __forceinline__ void tp_record(const MoeTpArgs& a, uint32_t code, int rank, uint32_t token, uint32_t k,
                                          int64_t value, uint32_t call) {
  moe_record_at(a.status, code, rank, token, k, value, call);
}

// The clock probe's word `i` (moe_probe_at; PROBE instances only).
__device__ __forceinline__ void tp_probe(const MoeTpArgs& a, int i) {
  moe_probe_at((uint64_t*)a.blocks[a.s.rank], i);
}

template <typename IDX>
__device__ __forceinline__ int64_t tp_entry(const MoeTpArgs& a, uint64_t t, uint64_t j, uint32_t& code) {
  code = 0;
  if ((int)j >= a.k) return -1;
  const IDX* p = (const IDX*)a.topk_idx + t * a.k;
  const int64_t e = (int64_t)p[j];
  if (e < -1 || e >= a.experts) {
    code = MOE_ST_OUT_OF_RANGE;
  } else if (e >= 0) {
    for (uint64_t jj = 0; jj < j; ++jj)
      if ((int64_t)p[jj] == e) code = MOE_ST_DUPLICATE;
  }
  return e;
}

// The grid's last block to count itself in at ctrl word `which` (target epoch * grid); every
// block fences first (system scope when peers read what it wrote).
__device__ __forceinline__ bool tp_count_in(uint64_t* ctrl, int which, uint64_t epoch, bool peers, int* last_s) {
  if (threadIdx.x == 0) {
    moe_fence_release(peers);
    const unsigned long long old = atomicAdd((unsigned long long*)&ctrl[which], 1ull);
    *last_s = old + 1 == epoch * gridDim.x;
    if (*last_s) moe_fence_release(peers);  // here an acquire: the others' writes before ours
  }
  __syncthreads();
  return *last_s != 0;
}

// Entries of a token loaded together (the routing); the most blocks of a grid (moe/mod.rs
// MAX_GRID).
#define MOE_TP_GROUP 8
#define MOE_TP_MAX_GRID 132
// Vectors per lane a warp's row copy keeps in flight (moe_copy_row, moe_pull_row): twice the
// low-latency mode's, for fewer SMs to keep the memory busy (4,096 tokens on 24 SMs: 94 -> 87
// µs; 16 gave no more, and 8 in the low-latency kernels slowed its 1-token dispatch).
#define MOE_TP_COPY_U 8
// Vectors (8 elements) per lane of a destination's row the combine's warp loads before adding
// them (a warp per token; 4,096 tokens, world 1, 24 SMs: 96 µs with 4, 87 with 6, 84 with 8, at
// 128 registers; -D for a sweep).
#ifndef MOE_TP_SUM_V
#define MOE_TP_SUM_V 8
#endif

// The CSR's placement for rows [r0, r1), by one block: `rows` gets `r * K + j` for every slot
// of those rows with `ridx[r * K + j] == le`, at `start[le]` (shared memory, this block's first
// place of le) plus its rank among the range's slots of le, rows increasing. The rows go in tiles
// of TR (256; 128 or fewer where L > 256 or K > 8, so that a tile's masks and slots fit): each
// slot naming le sets bit `r % TR` of le's mask for the tile, and its place is le's slots before
// the tile (`base`) plus the bits set below its own, so the result does not depend on thread
// timing. One barrier per tile: three masks rotate (marked, ranked, cleared) and two `base`
// arrays alternate. Invariants: L <= MOE_MAX_EXPERTS, K <= 64, and a row names a local expert at
// most once (the routing was validated: a duplicate fails the call before this); a value
// outside 0..L-1 (-1) names none. `ridx` is read past L1 (__ldcg): the calling block wrote it
// before a barrier.
#define MOE_TP_CSR_WORDS 2048  // words of one mask: L * TR / 32 <= this
#define MOE_TP_CSR_EPT 4       // slots per thread per tile: TR * K <= MOE_THREADS * this
__device__ void tp_place_rows(const int32_t* ridx, int32_t* rows, uint32_t r0, uint32_t r1, uint32_t K, int L,
                              const int32_t* start) {
  __shared__ int32_t base_s[2][MOE_MAX_EXPERTS];    // start plus the slots of earlier tiles
  __shared__ uint32_t mask_s[3][MOE_TP_CSR_WORDS];  // per tile, [TR / 32][L]: bit r % TR of le's rows
  const int tid = threadIdx.x;
  const uint32_t q0 = r0 * K, NK = (r1 - r0) * K, UL = (uint32_t)L;
  uint32_t wpl = 8;  // mask words per local expert: TR = 32 * wpl rows per tile
  while (wpl > 1 && (wpl * UL > MOE_TP_CSR_WORDS || 32 * wpl * K > MOE_THREADS * MOE_TP_CSR_EPT)) wpl >>= 1;
  const uint32_t TE = 32 * wpl * K;  // slots per tile
  const uint32_t tiles = (NK + TE - 1) / TE;
  // This thread's slots of a tile are u * MOE_THREADS + tid; rt: their row in the tile (~0u: none).
  uint32_t rt[MOE_TP_CSR_EPT];
#pragma unroll
  for (int u = 0; u < MOE_TP_CSR_EPT; ++u) {
    const uint32_t x = (uint32_t)(u * MOE_THREADS + tid);
    rt[u] = x < TE ? x / K : ~0u;
  }
  int m_rank = 0, m_mark = 1, m_clear = 2;
  for (uint32_t q = tid; q < wpl * UL; q += MOE_THREADS) mask_s[m_rank][q] = mask_s[m_mark][q] = 0;
  for (int le = tid; le < L; le += MOE_THREADS) base_s[0][le] = start[le];
  __syncthreads();
  // Tile 0 marked.
  int32_t cur[MOE_TP_CSR_EPT], nxt[MOE_TP_CSR_EPT];
#pragma unroll
  for (int u = 0; u < MOE_TP_CSR_EPT; ++u) {
    const uint32_t q = (uint32_t)(u * MOE_THREADS + tid);
    cur[u] = rt[u] != ~0u && q < NK ? __ldcg(ridx + q0 + q) : -1;
  }
#pragma unroll
  for (int u = 0; u < MOE_TP_CSR_EPT; ++u)
    if ((uint32_t)cur[u] < UL) atomicOr(&mask_s[m_rank][(rt[u] >> 5) * UL + cur[u]], 1u << (rt[u] & 31));
  __syncthreads();
  // Tile t's slots are ranked with mask m_rank and base_s[t & 1]; tile t + 1's are marked in
  // m_mark; m_clear (tile t - 1's) is cleared for tile t + 2.
#pragma unroll 1
  for (uint32_t t = 0; t < tiles; ++t) {
    const uint32_t* rank_m = mask_s[m_rank];
    const int32_t* base = base_s[t & 1];
#pragma unroll
    for (int u = 0; u < MOE_TP_CSR_EPT; ++u) {
      const uint32_t q = (t + 1) * TE + (uint32_t)(u * MOE_THREADS + tid);
      nxt[u] = t + 1 < tiles && rt[u] != ~0u && q < NK ? __ldcg(ridx + q0 + q) : -1;
    }
#pragma unroll
    for (int u = 0; u < MOE_TP_CSR_EPT; ++u) {
      const uint32_t le = (uint32_t)cur[u];
      if (le < UL) {
        const uint32_t w = rt[u] >> 5;
        uint32_t rank = __popc(rank_m[w * UL + le] & ((1u << (rt[u] & 31)) - 1));
#pragma unroll 1
        for (uint32_t v = 0; v < w; ++v) rank += __popc(rank_m[v * UL + le]);
        rows[base[le] + (int32_t)rank] = (int32_t)(q0 + t * TE + (uint32_t)(u * MOE_THREADS + tid));
      }
    }
#pragma unroll 1
    for (int le = tid; le < L; le += MOE_THREADS) {
      int32_t c = 0;
#pragma unroll 1
      for (uint32_t v = 0; v < wpl; ++v) {
        c += __popc(rank_m[v * UL + le]);
        mask_s[m_clear][v * UL + le] = 0;
      }
      base_s[(t + 1) & 1][le] = base[le] + c;
    }
#pragma unroll
    for (int u = 0; u < MOE_TP_CSR_EPT; ++u) {
      cur[u] = nxt[u];
      if ((uint32_t)nxt[u] < UL) atomicOr(&mask_s[m_mark][(rt[u] >> 5) * UL + nxt[u]], 1u << (rt[u] & 31));
    }
    const int ranked = m_rank;
    m_rank = m_mark;
    m_mark = m_clear;
    m_clear = ranked;
    __syncthreads();
  }
}

// A barrier across the grid (resident by design): every block counts itself in at
// MOE_CTRL_TP_SYNC and waits for the rest of its generation (the count's multiple of the grid
// above its own count: every block passes the same barriers in the same order, failed calls
// none). Release before, acquire after, at GPU scope. False when the wait gave up (aborted or
// timed out, naming this rank).
__device__ __forceinline__ bool tp_grid_sync(const MoeTpArgs& a, uint64_t* ctrl) {
  __shared__ int sync_ok_s;
  __syncthreads();
  if (threadIdx.x == 0) {
    moe_fence_release(false);
    const unsigned long long old = atomicAdd((unsigned long long*)&ctrl[MOE_CTRL_TP_SYNC], 1ull);
    const uint64_t target = (old / gridDim.x + 1) * gridDim.x;
    const uint64_t start = globaltimer();
    uint32_t spins = 0;
    int ok = 1;
    while (moe_ld_acquire(&ctrl[MOE_CTRL_TP_SYNC], false) < target) {
      if (give_up(a.s, spins, start, a.s.rank)) {
        ok = 0;
        break;
      }
    }
    sync_ok_s = ok;
  }
  __syncthreads();
  return sync_ok_s != 0;
}

// The received rows' CSR by local expert, spread over the grid (after the pull). Block b owns the
// rows [r0, r1) = [b * per, (b + 1) * per) it pulled, whose top-k the pull stored in ridx / rw and
// counted per local expert into `c_s` (shared memory, this block's slots per le):
// 1. it stores `c_s` as `csr[b][le]`; a grid barrier;
// 2. on a grid of at most MOE_TP_CSR_DIRECT_G blocks, every block reads the G blocks' counts of
//    each local expert itself (a thread per expert, G independent loads): their sum is the
//    expert's total, the lower blocks' its own first place in the expert. On a larger grid, where
//    G reads a block would cost more than a barrier, it owns local experts
//    [b * lpb, (b + 1) * lpb): per expert an exclusive scan of the G blocks' counts (a warp per
//    expert) replaces them in `csr`, and the total is meta's count; a grid barrier; then every
//    block reads the totals and its `csr` row;
// 3. its first place per expert = the offsets (the totals' exclusive scan) plus its lower
//    blocks' slots; it places its rows (tp_place_rows). Block 0 writes the rest of meta.
// The result is the one-block sort's, bit for bit: rows by local expert, increasing.
#ifndef MOE_TP_CSR_DIRECT_G
#define MOE_TP_CSR_DIRECT_G 48
#endif
template <bool PROBE>
__device__ bool tp_grid_csr(const MoeTpArgs& a, uint64_t* ctrl, uint32_t N, uint32_t r0, uint32_t r1, int32_t* c_s,
                            int32_t* meta, int32_t* warp_s) {
  __shared__ int32_t o_s[MOE_MAX_EXPERTS];                  // the totals; their exclusive scan
  __shared__ int32_t col_s[MOE_MAX_EXPERTS + MOE_TP_MAX_GRID];  // step 2: [own expert][block]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int me = a.s.rank, L = a.local;
  const uint32_t G = gridDim.x, b = blockIdx.x, UL = (uint32_t)L, UK = (uint32_t)a.topk;
  const int32_t* ridx = (const int32_t*)(a.blocks[me] + a.off_recv_idx);
  int32_t* csr = (int32_t*)(a.blocks[me] + a.off_csr);
  // Step 1.
  __syncthreads();
  for (int le = tid; le < L; le += MOE_THREADS) csr[(uint64_t)b * UL + le] = c_s[le];
  if (!tp_grid_sync(a, ctrl)) return false;
  if constexpr (PROBE) {
    if (b == 0 && tid == 0) tp_probe(a, MOE_P_D_PULLED);
  }
  // Step 2.
  if (G <= MOE_TP_CSR_DIRECT_G) {
    for (int le = tid; le < L; le += MOE_THREADS) {
      int32_t tot = 0, below = 0;
#pragma unroll 8
      for (uint32_t bb = 0; bb < G; ++bb) {
        const int32_t v = __ldcg(csr + (uint64_t)bb * UL + le);
        tot += v;
        below += bb < b ? v : 0;
      }
      o_s[le] = tot;
      c_s[le] = below;
      if (b == 0) meta[1 + le] = tot;
    }
  } else {
    // This block's experts' columns, then a warp per expert scans its column.
    const uint32_t lpb = (UL + G - 1) / G, e0 = min(b * lpb, UL), e1 = min(e0 + lpb, UL), ne = e1 - e0;
    for (uint32_t i = tid; i < ne * G; i += MOE_THREADS) {
      const uint32_t le = e0 + i / G, bb = i % G;
      col_s[i] = __ldcg(csr + (uint64_t)bb * UL + le);
    }
    __syncthreads();
    for (uint32_t i = warp; i < ne; i += MOE_WARPS) {
      int32_t carry = 0;
      for (uint32_t c0 = 0; c0 < G; c0 += 32) {
        const uint32_t bb = c0 + lane;
        const int32_t v = bb < G ? col_s[i * G + bb] : 0;
        const int32_t x = moe_warp_inclusive(v);
        if (bb < G) csr[(uint64_t)bb * UL + e0 + i] = carry + x - v;
        carry += __shfl_sync(0xffffffffu, x, 31);
      }
      if (lane == 0) meta[1 + e0 + i] = carry;
    }
    if (!tp_grid_sync(a, ctrl)) return false;
    for (int le = tid; le < L; le += MOE_THREADS) {
      o_s[le] = __ldcg(meta + 1 + le);
      c_s[le] = __ldcg(csr + (uint64_t)b * UL + le);
    }
  }
  // Step 3.
  __syncthreads();
  if constexpr (PROBE) {
    if (b == 0 && tid == 0) tp_probe(a, MOE_P_D_SCANNED);
  }
  const int32_t total = moe_block_scan(o_s, o_s, L, warp_s);
  for (int le = tid; le < L; le += MOE_THREADS) {
    c_s[le] += o_s[le];
    if (b == 0) meta[1 + L + le] = o_s[le];
  }
  if (b == 0 && tid == 0) {
    meta[0] = (int32_t)N;
    meta[1 + 2 * L] = total;
  }
  __syncthreads();
  tp_place_rows(ridx, (int32_t*)(a.blocks[me] + a.off_expert_rows), r0, r1, UK, L, c_s);
  return true;
}

// The routing: the iterations whose destination masks stay in registers (MOE_THREADS tokens of
// a block's chunk each: a chunk of 4,096 tokens on a grid of one).
#define MOE_TP_MASK_REGS 8
// PROBE: record the clock probe (block 0 at its start, after the routing's barrier, the wait, the
// CSR's first barrier and its counts read; the last block to count in at D_SENT and D_FIN).
// QUANT: x is bf16, quantized to the FP8 payload (PAYLOAD_BYTES 1, SCALES) once per token when
// its block stages it, at every world (the pull reads this rank's own rows from the stage too).
// PHASE: the whole call (MOE_BOTH), steps 1-2 (MOE_SEND: up to and including the counts row) or
// steps 3-4 (MOE_RECV: the wait, the pull and the CSR; the same arguments). The halves find the
// same epoch: only the receive half's end moves the done count.
template <int PAYLOAD_BYTES, bool SCALES, typename IDX, bool QUANT = false, bool PROBE = false, int PHASE = MOE_BOTH>
__device__ void tp_dispatch_body(const MoeTpArgs& a) {
  __shared__ uint64_t epoch_s;
  __shared__ int live_s, last_s;
  __shared__ uint32_t bad_s;
  __shared__ int32_t found_s[4];
  __shared__ int64_t found_v;
  __shared__ int32_t warp_s[MOE_WARPS + 1];
  __shared__ int32_t rowbase_s[SYMM_MAX_RANKS + 1];  // rows from lower sources here
  __shared__ int32_t listoff_s[SYMM_MAX_RANKS];      // per source: its list offset for this rank
  __shared__ int32_t below_s[SYMM_MAX_RANKS];        // per destination: rows of lower sources there
  __shared__ int32_t csr_c_s[MOE_MAX_EXPERTS];       // its pulled rows' slots per local expert
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int me = a.s.rank, W = a.s.world, L = a.local;
  const uint64_t K = a.topk, T = a.max_tokens, H = a.hidden;
  const uint64_t row_bytes = H * PAYLOAD_BYTES, S = H / MOE_SCALE_GROUP;
  const bool peers = W > 1;
  uint64_t* ctrl = (uint64_t*)a.blocks[me];
  if (tid == 0) {
    // Both loads in flight before any store (block_start's rule).
    const uint64_t done = *(volatile uint64_t*)&ctrl[MOE_CTRL_D_DONE];
    const uint32_t dead = *(volatile uint32_t*)abort_word(a.s);
    epoch_s = done + 1;
    live_s = dead == 0;
    bad_s = 0xffffffffu;
    if constexpr (PROBE && PHASE != MOE_RECV) {
      if (blockIdx.x == 0) {
        tp_probe(a, MOE_P_D_START);
        ctrl[MOE_CTRL_PROBE + MOE_P_D_EPOCH] = done + 1;
      }
    }
  }
  __syncthreads();
  if (!live_s) return;
  const uint64_t epoch = epoch_s, par = epoch & 1;
  const uint64_t n = a.refuse_code ? 0 : a.num_tokens;
  int32_t* pos = (int32_t*)(a.blocks[me] + a.off_pos);
  const uint32_t G = gridDim.x, UW = (uint32_t)W;
  if constexpr (PHASE != MOE_RECV) {
  int32_t* idx = (int32_t*)(a.blocks[me] + a.off_idx) + par * T * K;
  float* wts = (float*)(a.blocks[me] + a.off_weights) + par * T * K;
  const float* w_in = (const float*)a.weights_or_y;

  // Step 1, every block: the routing of its chunk of tokens [t0, t1) (validated), its copy, the
  // chunk's ranks per destination; its counts in `rc` (the csr part, [G][W + 1]: W counts, then
  // its first bad entry t * K + j or -1); a grid barrier; then every block's offsets per
  // destination (the counts of lower blocks) place its tokens in the lists by destination (token
  // order) and in pos, and block 0 leaves the counts row and the status words in CTRL_TP_ROW...
  // The lists and pos come out as one block's serial scan would leave them.
  const uint32_t per = (uint32_t)((n + G - 1) / G);
  const uint32_t t0 = min((uint32_t)blockIdx.x * per, (uint32_t)n), t1 = min(t0 + per, (uint32_t)n);
  int32_t* rc = (int32_t*)(a.blocks[me] + a.off_csr);
  int32_t* list = (int32_t*)(a.blocks[me] + a.off_list) + par * (uint64_t)W * T;
  {
    // A thread per token (t = t0 + tid + it * MOE_THREADS), its entries loaded MOE_TP_GROUP at a
    // time before any is used (one round trip per group, not one per entry); a duplicate is
    // looked for in the group's registers and, past the first group, in memory (as tp_entry
    // does). The token's destination mask stays in a register for the scans below (the first
    // MOE_TP_MASK_REGS iterations; later ones read pos back).
    uint32_t mk[MOE_TP_MASK_REGS];
#pragma unroll
    for (int u = 0; u < MOE_TP_MASK_REGS; ++u) mk[u] = 0;
    const uint32_t UK = (uint32_t)a.k, UE = (uint32_t)a.experts, UL = (uint32_t)L;
    uint32_t it = 0;
    for (uint32_t t = t0 + tid; t < t1; t += MOE_THREADS, ++it) {
      const IDX* p = (const IDX*)a.topk_idx + (uint64_t)t * UK;
      const float* pw = w_in + (uint64_t)t * UK;
      uint32_t mask = 0;
      for (uint32_t j0 = 0; j0 < (uint32_t)K; j0 += MOE_TP_GROUP) {
        int64_t ev[MOE_TP_GROUP];
        float wv[MOE_TP_GROUP];
#pragma unroll
        for (int u = 0; u < MOE_TP_GROUP; ++u) {
          const uint32_t j = j0 + u;
          ev[u] = j < UK ? (int64_t)p[j] : -1;
          wv[u] = j < UK ? pw[j] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < MOE_TP_GROUP; ++u) {
          const uint32_t j = j0 + u;
          if (j >= (uint32_t)K) break;
          const int64_t e = ev[u];
          uint32_t code = 0;
          if (e < -1 || e >= (int64_t)UE) {
            code = MOE_ST_OUT_OF_RANGE;
          } else if (e >= 0) {
#pragma unroll
            for (int v = 0; v < u; ++v)
              if (ev[v] == e) code = MOE_ST_DUPLICATE;
            for (uint32_t jj = 0; jj < j0; ++jj)
              if ((int64_t)p[jj] == e) code = MOE_ST_DUPLICATE;
          }
          if (code) atomicMin(&bad_s, t * (uint32_t)K + j);  // < T * K < 2^31
          idx[(uint64_t)t * K + j] = (int32_t)e;
          wts[(uint64_t)t * K + j] = wv[u];
          if (!code && e >= 0) mask |= 1u << ((uint32_t)e / UL);
        }
      }
      for (int d = 0; d < W; ++d) pos[(uint64_t)t * W + d] = (mask >> d) & 1 ? 0 : -1;
#pragma unroll
      for (int u = 0; u < MOE_TP_MASK_REGS; ++u)
        if (it == (uint32_t)u) mk[u] = mask;
    }
    __syncthreads();
    // The chunk's rank of each token per destination (pos, for now), and its counts.
    for (int d = 0; d < W; ++d) {
      int32_t carry = 0;
      uint32_t it2 = 0;
      for (uint32_t b0 = t0; b0 < t1; b0 += MOE_THREADS, ++it2) {
        const uint32_t t = b0 + tid;
        uint32_t m = 0;
#pragma unroll
        for (int u = 0; u < MOE_TP_MASK_REGS; ++u)
          if (it2 == (uint32_t)u) m = mk[u];
        const int32_t f = t < t1 && (it2 < MOE_TP_MASK_REGS ? (m >> d) & 1 : pos[(uint64_t)t * W + d] >= 0);
        int32_t total;
        const int32_t ex = moe_block_scan_value(f, warp_s, total);
        if (f) pos[(uint64_t)t * W + d] = carry + ex;
        carry += total;
      }
      if (tid == 0) rc[blockIdx.x * (UW + 1) + d] = carry;
    }
    if (tid == 0) rc[blockIdx.x * (UW + 1) + UW] = (int32_t)bad_s;  // -1: none
  }
  if (!tp_grid_sync(a, ctrl)) return;
  if constexpr (PROBE) {
    if (blockIdx.x == 0 && tid == 0) tp_probe(a, MOE_P_D_ROUTED);
  }
  {
    // Every block's counts: this block's offset per destination (lower blocks' counts), the
    // totals, and the first bad entry of the call.
    __shared__ int32_t boff_s[SYMM_MAX_RANKS], tot_s[SYMM_MAX_RANKS], loff_s[SYMM_MAX_RANKS];
    if (tid < W) boff_s[tid] = tot_s[tid] = 0;
    __syncthreads();
    for (uint32_t q = tid; q < G * (UW + 1); q += MOE_THREADS) {
      const uint32_t bb = q / (UW + 1), d = q % (UW + 1);
      const int32_t v = __ldcg(rc + q);
      if (d == UW) {
        atomicMin(&bad_s, (uint32_t)v);
      } else {
        atomicAdd(&tot_s[d], v);
        if (bb < blockIdx.x) atomicAdd(&boff_s[d], v);
      }
    }
    __syncthreads();
    if (tid == 0) {
      int32_t off = 0;
      for (int d = 0; d < W; ++d) {
        loff_s[d] = off;
        off += tot_s[d];
      }
    }
    __syncthreads();
    const bool any_bad = bad_s != 0xffffffffu || a.refuse_code;
    for (uint32_t q = t0 * UW + tid; q < t1 * UW && !any_bad; q += MOE_THREADS) {  // < T * W < 2^31
      const int32_t pq = pos[q];
      if (pq >= 0) {
        const uint32_t d = q % UW;
        pos[q] = pq + boff_s[d];
        list[loff_s[d] + boff_s[d] + pq] = (int32_t)(q / UW);
      }
    }
    if (blockIdx.x == 0 && tid == 0) {
      found_s[0] = 0;
      if (a.refuse_code) {
        found_s[0] = a.refuse_code;
        found_s[2] = found_s[3] = 0;
        found_v = a.refuse_value;
      } else if (bad_s != 0xffffffffu) {
        uint32_t code;
        const int64_t e = tp_entry<IDX>(a, bad_s / K, bad_s % K, code);
        found_s[0] = code;
        found_s[2] = (int32_t)(bad_s / K);
        found_s[3] = (int32_t)(bad_s % K);
        found_v = e;
      }
      const bool own_bad = found_s[0] != 0;
      for (int d = 0; d < W; ++d) ctrl[MOE_CTRL_TP_ROW + d] = own_bad ? 0 : (uint64_t)(uint32_t)tot_s[d];
      const int64_t v = found_v;
      const int32_t extra[5] = {found_s[0], found_s[2], found_s[3], (int32_t)(uint32_t)(uint64_t)v,
                                (int32_t)(uint32_t)((uint64_t)v >> 32)};
      for (int x = 0; x < MOE_ROW_EXTRA; ++x)
        ctrl[MOE_CTRL_TP_ROW + W + x] = own_bad && x < 5 ? (uint64_t)(uint32_t)extra[x] : 0;
    }
  }
  // Every block stages its share of x for the peers (harmless when the call fails).
  if (peers || QUANT) {
    uint8_t* xs = (uint8_t*)(a.blocks[me] + a.off_xstage) + par * T * row_bytes;
    const uint64_t gw = (uint64_t)blockIdx.x * MOE_WARPS + warp, nw = (uint64_t)gridDim.x * MOE_WARPS;
    for (uint64_t t = gw; t < n; t += nw) {
      if (QUANT) {
        float* ds = (float*)(a.blocks[me] + a.off_xscales) + par * T * S + t * S;
        moe_quantize_row<MOE_TP_COPY_U>(xs + t * row_bytes, ds, (const uint4*)a.x_or_expert_out + t * (H / 8), H,
                                        (a.scale_mode & MOE_SCALE_UE8M0) != 0, lane);
        continue;
      }
      // The row's scales load before its bytes: one round trip, not two in a row (moe.cu).
      const float* xsc = SCALES ? (const float*)a.x_scales + t * S : nullptr;
      MoeScales sc{};
      if (SCALES) sc = moe_scales_load<false>(xsc, S, lane);
      moe_copy_row<MOE_TP_COPY_U>(xs + t * row_bytes, (const uint8_t*)a.x_or_expert_out + t * row_bytes, row_bytes, lane);
      if (SCALES)
        moe_scales_store<false>(sc, (float*)(a.blocks[me] + a.off_xscales) + par * T * S + t * S, 1, xsc, S, lane);
    }
  }
  __syncthreads();

  // Step 2: the last block to count itself in publishes the row (block 0's words, fenced).
  if (tp_count_in(ctrl, MOE_CTRL_D_SENT, epoch, peers, &last_s)) {
    if constexpr (PROBE) {
      if (tid == 0) tp_probe(a, MOE_P_D_STAGED);
    }
    const int words = W + MOE_ROW_EXTRA;
    const bool bad = *(volatile uint64_t*)&ctrl[MOE_CTRL_TP_ROW + W] != 0;
    for (int q = tid; q < W * words; q += MOE_THREADS) {
      const int d = q / words, w = q % words;
      int32_t v = (int32_t)(uint32_t)*(volatile uint64_t*)&ctrl[MOE_CTRL_TP_ROW + w];
      if (bad && w < W) v = 0;
      moe_st_release(tp_row(a, d, epoch, me) + w, moe_tagged(epoch, v), peers);
    }
    if constexpr (PROBE) {
      __syncthreads();
      if (tid == 0) tp_probe(a, MOE_P_D_PUBLISHED);
    }
  }
  }  // PHASE != MOE_RECV
  if constexpr (PHASE == MOE_SEND) return;

  // Step 3, the one wait: every word of every source's row carries this epoch's tag.
  int ok = 1;
  {
    const int words = W + MOE_ROW_EXTRA;
    const uint64_t start = globaltimer();
    uint32_t spins = 0;
    for (int q = tid; q < W * words && ok; q += MOE_THREADS) {
      const int s = q / words;
      const uint64_t* w = tp_row(a, me, epoch, s) + q % words;
      while ((uint32_t)(moe_ld_acquire(w, peers) >> 32) != (uint32_t)epoch) {
        if (give_up(a.s, spins, start, s)) {
          ok = 0;
          break;
        }
      }
    }
  }
  if (!__syncthreads_and(ok)) return;
  if constexpr (PROBE) {
    if (blockIdx.x == 0 && tid == 0) tp_probe(a, MOE_P_D_WAITED);
  }
  if (tid == 0) {
    found_s[0] = 0;
    for (int s = 0; s < W; ++s) {
      const int32_t code = tp_count(a, epoch, s, W);
      if (code != 0) {
        found_s[0] = code;
        found_s[1] = s;
        found_s[2] = tp_count(a, epoch, s, W + 1);
        found_s[3] = tp_count(a, epoch, s, W + 2);
        found_v = (int64_t)((uint64_t)(uint32_t)tp_count(a, epoch, s, W + 3) |
                            ((uint64_t)(uint32_t)tp_count(a, epoch, s, W + 4) << 32));
        break;
      }
    }
    int32_t acc = 0;
    for (int s = 0; s < W; ++s) {
      rowbase_s[s] = acc;
      acc += tp_count(a, epoch, s, me);
      int32_t lo = 0;
      for (int d = 0; d < me; ++d) lo += tp_count(a, epoch, s, d);
      listoff_s[s] = lo;
    }
    rowbase_s[W] = acc;
    for (int d = 0; d < W; ++d) {
      int32_t b = 0;
      for (int s = 0; s < me; ++s) b += tp_count(a, epoch, s, d);
      below_s[d] = b;
    }
  }
  for (int le = tid; le < L; le += MOE_THREADS) csr_c_s[le] = 0;
  __syncthreads();
  const bool failed = found_s[0] != 0;
  int32_t* meta = (int32_t*)(a.blocks[me] + a.off_meta);
  if (failed) {
    if (blockIdx.x == 0) {
      if (tid == 0 && !(moe_is_refusal(found_s[0]) && found_s[1] == me))
        tp_record(a, found_s[0], found_s[1], found_s[2], found_s[3], found_v, 0);
      for (int i = tid; i < 2 * L + 2; i += MOE_THREADS) meta[i] = 0;
    }
    // The receive half has no routing barrier: one here, so that every block has read the done
    // count before block 0 moves it (every block sees the same rows, so all come here).
    if constexpr (PHASE == MOE_RECV) {
      if (!tp_grid_sync(a, ctrl)) return;
    }
  } else {
    // Step 4: pull. Block b takes the received rows [r0, r1) = [b * per, (b + 1) * per), a warp
    // per row; row r comes from the source s with rowbase[s] <= r < rowbase[s + 1]. Lane j < K
    // loads the row's entry j and weight from the source's routing copy beside the row's copy,
    // stores its local top-k and counts it per local expert in csr_c_s (what tp_grid_csr's
    // step 1 stores for the other blocks).
    const uint32_t N = (uint32_t)rowbase_s[W], UK = (uint32_t)K;
    const uint32_t per = (N + G - 1) / G, r0 = min(blockIdx.x * per, N), r1 = min(r0 + per, N);
    int32_t* rsrc = (int32_t*)(a.blocks[me] + a.off_recv_src);
    int32_t* ridx = (int32_t*)(a.blocks[me] + a.off_recv_idx);
    float* rw = (float*)(a.blocks[me] + a.off_recv_weights);
    uint8_t* rx = (uint8_t*)(a.blocks[me] + a.off_recv_x);
    // A row's token is an entry of its source's list. Lane j of a warp loads the entry of the
    // warp's j-th next row, 32 rows at a time, so no row's copy waits for a load of its own entry.
    int src_l = 0;
    int32_t tok_l = 0;
    uint32_t k = 0;
    for (uint32_t r = r0 + warp; r < r1; r += MOE_WARPS, ++k) {
      if ((k & 31) == 0) {
        const uint32_t q = r + (uint32_t)lane * MOE_WARPS;
        if (q < r1) {
          src_l = 0;
          while (src_l + 1 < W && (uint32_t)rowbase_s[src_l + 1] <= q) ++src_l;
          const int32_t* slist = (const int32_t*)(a.blocks[src_l] + a.off_list) + par * (uint64_t)W * T;
          tok_l = __ldcg(slist + listoff_s[src_l] + (q - (uint32_t)rowbase_s[src_l]));
        }
      }
      const int s = __shfl_sync(0xffffffffu, src_l, k & 31);
      const uint64_t t = (uint64_t)__shfl_sync(0xffffffffu, tok_l, k & 31);
      int32_t e = -1;
      float wv = 0.f;
      if ((uint32_t)lane < UK) {
        const uint64_t q = par * T * K + t * K + lane;
        e = __ldcg((const int32_t*)(a.blocks[s] + a.off_idx) + q);
        wv = __ldcg((const float*)(a.blocks[s] + a.off_weights) + q);
      }
      const bool caller = s == me && !QUANT;  // this rank's own rows, from the caller's x
      const uint8_t* src = caller ? (const uint8_t*)a.x_or_expert_out + t * row_bytes
                                  : (const uint8_t*)(a.blocks[s] + a.off_xstage) + par * T * row_bytes + t * row_bytes;
      const float* ss = !SCALES ? nullptr
                        : caller ? (const float*)a.x_scales + t * S
                                 : (const float*)(a.blocks[s] + a.off_xscales) + par * T * S + t * S;
      MoeScales sc{};
      if (SCALES) sc = moe_scales_load<true>(ss, S, lane);  // before the row: one round trip
      if (caller) moe_copy_row<MOE_TP_COPY_U>(rx + (uint64_t)r * row_bytes, src, row_bytes, lane);
      else moe_pull_row<MOE_TP_COPY_U>(rx + (uint64_t)r * row_bytes, src, row_bytes, lane);
      if (SCALES) {
        // Scale (row, g) at row * sr + g * sg (config.rs scale_strides with R = W*T).
        const bool col = (a.scale_mode & MOE_SCALE_COL_TMA) != 0;
        const uint64_t R4 = ((uint64_t)W * T + 3) & ~3ull, sr = col ? 1 : S, sg = col ? R4 : 1;
        moe_scales_store<true>(sc, (float*)(a.blocks[me] + a.off_recv_scales) + (uint64_t)r * sr, sg, ss, S, lane);
      }
      if ((uint32_t)lane < UK) {
        const bool mine = e >= 0 && e / L == me;
        ridx[(uint64_t)r * K + lane] = mine ? e - me * L : -1;
        rw[(uint64_t)r * K + lane] = mine ? wv : 0.f;
        if (mine) atomicAdd(&csr_c_s[e - me * L], 1);
      }
      if (lane == 0) rsrc[r] = (int32_t)((uint64_t)s * T + t);
    }
    // Each of this rank's tokens' row at each rank it went to (after the lower sources').
    const uint64_t gt = (uint64_t)blockIdx.x * MOE_THREADS + tid, nt = (uint64_t)gridDim.x * MOE_THREADS;
    for (uint64_t q = gt; q < n * W; q += nt) {
      const int32_t p = pos[q];
      if (p >= 0) pos[q] = p + below_s[(uint32_t)q % (uint32_t)W];  // q < T * W < 2^31
    }
    if (!tp_grid_csr<PROBE>(a, ctrl, N, r0, r1, csr_c_s, meta, warp_s)) return;
  }
  __syncthreads();

  // The end: block 0 stores the epochs, as moe.cu's dispatch does. Every block read the done
  // count at its start, before the routing's grid barrier (the receive half: the CSR's, or the
  // failed call's), which block 0 passed: none reads it late. The combine count moves only in
  // combine kernels. Plain stores, no fence and no count-in: the next call is a later kernel,
  // which starts after every block has ended. (The probe counts the blocks in at D_FIN to time
  // the grid's end.)
  if constexpr (PROBE) {
    if (tp_count_in(ctrl, MOE_CTRL_D_FIN, epoch, false, &last_s) && tid == 0) tp_probe(a, MOE_P_D_SORTED);
  }
  if (blockIdx.x == 0 && tid == 0) {
    if (!failed) ctrl[MOE_CTRL_OK_EPOCH] = epoch;
    ctrl[MOE_CTRL_TP_FIRST] = *(volatile uint64_t*)&ctrl[MOE_CTRL_C_DONE] + 1;
    ctrl[MOE_CTRL_D_DONE] = epoch;
  }
}

// Thread `src` (< world) waits until flag `which` of source `src` here is >= want; the value
// seen, or 0 when the wait ended (aborted or timed out).
__device__ __forceinline__ uint64_t tp_wait(const MoeTpArgs& a, int which, int src, uint64_t want) {
  const uint64_t* f = tp_flag(a, a.s.rank, which, src);
  const uint64_t start = globaltimer();
  uint32_t spins = 0;
  for (;;) {
    const uint64_t v = ld_acquire_sys_u64(f);
    if (v >= want) return v;
    if (give_up(a.s, spins, start, src)) return 0;
  }
}

// PROBE: record the clock probe (block 0 at its start and after the wait; the last block to count
// in at C_SENT and C_FIN). PHASE: the whole call (MOE_BOTH), the send half (MOE_SEND: the
// previous combine's wait, the staging and the "staged" flags) or the receive half (MOE_RECV: the
// one wait, the sum and the "read" flags); only the receive half's end moves the combine count.
template <bool PROBE = false, int PHASE = MOE_BOTH>
__device__ void tp_combine_body(const MoeTpArgs& a) {
  __shared__ uint64_t epoch_s, first_s;
  __shared__ int live_s, dispatched_s, last_s;
  __shared__ uint32_t other_s;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int me = a.s.rank, W = a.s.world;
  const uint64_t T = a.max_tokens, H = a.hidden, row_bytes = H * 2;
  const bool refused = a.refuse_code != 0, peers = W > 1;
  uint64_t* ctrl = (uint64_t*)a.blocks[me];
  const int32_t* meta = (const int32_t*)(a.blocks[me] + a.off_meta);
  if (tid == 0) {
    // Every load in flight before any store (block_start's rule: one round trip, not five).
    const uint64_t c = *(volatile uint64_t*)&ctrl[MOE_CTRL_C_DONE];
    const uint64_t first = *(volatile uint64_t*)&ctrl[MOE_CTRL_TP_FIRST];
    const uint64_t d = *(volatile uint64_t*)&ctrl[MOE_CTRL_D_DONE];
    const uint64_t ok = *(volatile uint64_t*)&ctrl[MOE_CTRL_OK_EPOCH];
    const uint32_t dead = *(volatile uint32_t*)abort_word(a.s);
    epoch_s = c + 1;
    first_s = first;
    dispatched_s = d > 0 && ok == d;
    live_s = dead == 0;
    other_s = 0xffffffffu;
    if constexpr (PROBE && PHASE != MOE_RECV) {
      if (blockIdx.x == 0) {
        tp_probe(a, MOE_P_C_START);
        ctrl[MOE_CTRL_PROBE + MOE_P_C_EPOCH] = c + 1;
      }
    }
  }
  __syncthreads();
  if (!live_s) return;
  const uint64_t c = epoch_s;
  const bool dispatched = dispatched_s != 0;
  if constexpr (PHASE != MOE_RECV) {
  // A later combine of the same dispatch: peers may still read this rank's cstage of c - 1.
  if (c > first_s) {
    const int ok = tid < W ? tp_wait(a, MOE_TP_FLAG_READ, tid, c - 1) != 0 : 1;
    if (!__syncthreads_and(ok)) return;
  }
  // Stage the rows of peers' tokens.
  if (!refused && peers && dispatched) {
    const uint64_t N = (uint64_t)meta[0];
    const int32_t* rsrc = (const int32_t*)(a.blocks[me] + a.off_recv_src);
    uint8_t* cs = (uint8_t*)(a.blocks[me] + a.off_cstage);
    const uint64_t gw = (uint64_t)blockIdx.x * MOE_WARPS + warp, nw = (uint64_t)gridDim.x * MOE_WARPS;
    for (uint64_t r = gw; r < N; r += nw) {
      if ((uint64_t)rsrc[r] / T == (uint64_t)me) continue;
      moe_copy_row<MOE_TP_COPY_U>(cs + r * row_bytes, (const uint8_t*)a.x_or_expert_out + r * row_bytes, row_bytes, lane);
    }
  }
  __syncthreads();
  if (tp_count_in(ctrl, MOE_CTRL_C_SENT, c, peers, &last_s) && tid == 0) {
    for (int d = 0; d < W; ++d) st_release_sys_u64(tp_flag(a, d, MOE_TP_FLAG_STAGED, me), 2 * c + (refused ? 1 : 0));
    if constexpr (PROBE) tp_probe(a, MOE_P_C_PUSHED);
  }
  }  // PHASE != MOE_RECV
  if constexpr (PHASE == MOE_SEND) return;
  // The one wait: every rank's rows are staged (or it refused).
  {
    int ok = 1;
    if (tid < W) {
      const uint64_t v = tp_wait(a, MOE_TP_FLAG_STAGED, tid, 2 * c);
      ok = v != 0;
      if (v == 2 * c + 1) atomicMin(&other_s, (uint32_t)tid);
    }
    if (!__syncthreads_and(ok)) return;
  }
  if constexpr (PROBE) {
    if (blockIdx.x == 0 && tid == 0) tp_probe(a, MOE_P_C_WAITED);
  }
  const bool zeros = !dispatched || other_s != 0xffffffffu;
  if (blockIdx.x == 0 && tid == 0 && !refused && other_s != 0xffffffffu)
    tp_record(a, MOE_ST_COMBINE_REFUSED, (int)other_s, 0, 0, 0, 1);
  if (!refused) {
    // A warp per token: lane d < W loads the token's row at rank d (pos, once), then per run of
    // 32 * MOE_TP_SUM_V vectors (8 elements each) the warp loads each destination's vectors, all
    // of a run before any is added, and sums them over d in increasing order in fp32, rounded
    // once (the same bits as one element at a time).
    // With fewer tokens than warps a token's runs are split over `parts` warps.
    const int32_t* pos = (const int32_t*)(a.blocks[me] + a.off_pos);
    const uint32_t vecs = (uint32_t)(H / 8), run = 32 * MOE_TP_SUM_V;
    const uint32_t gw = blockIdx.x * MOE_WARPS + warp, nw = gridDim.x * MOE_WARPS;
    const uint32_t n = (uint32_t)a.num_tokens, runs = (vecs + run - 1) / run;
    const uint32_t parts = n == 0 ? 1 : max(1u, min(runs, nw / n));
    for (uint32_t q = gw; q < n * parts; q += nw) {  // n * parts <= max(n, nw)
      const uint32_t t = q / parts, part = q - t * parts;
      const int32_t pl = lane < W && !zeros ? pos[(uint64_t)t * W + lane] : -1;
      uint4* yrow = (uint4*)((uint8_t*)a.weights_or_y + (uint64_t)t * row_bytes);
      for (uint32_t c0 = part * run; c0 < vecs; c0 += parts * run) {
        float acc[MOE_TP_SUM_V][8];
#pragma unroll
        for (int u = 0; u < MOE_TP_SUM_V; ++u)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
        for (int d = 0; d < W; ++d) {
          const int32_t p = __shfl_sync(0xffffffffu, pl, d);
          if (p < 0) continue;  // the same for the whole warp
          const uint4* src = (const uint4*)((d == me ? (const uint8_t*)a.x_or_expert_out
                                                     : (const uint8_t*)(a.blocks[d] + a.off_cstage)) +
                                            (uint64_t)p * row_bytes);
          uint4 x[MOE_TP_SUM_V];
#pragma unroll
          for (int u = 0; u < MOE_TP_SUM_V; ++u) {
            const uint32_t v = c0 + u * 32 + lane;
            if (v < vecs) x[u] = d == me ? src[v] : __ldcg(src + v);
          }
#pragma unroll
          for (int u = 0; u < MOE_TP_SUM_V; ++u) {
            if (c0 + u * 32 + lane >= vecs) continue;
            const uint32_t w4[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              acc[u][2 * i] += __uint_as_float(w4[i] << 16);
              acc[u][2 * i + 1] += __uint_as_float(w4[i] & 0xffff0000u);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < MOE_TP_SUM_V; ++u) {
          const uint32_t v = c0 + u * 32 + lane;
          if (v >= vecs) continue;
          uint32_t o[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(acc[u][2 * i]));
            const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(acc[u][2 * i + 1]));
            o[i] = lo | (hi << 16);
          }
          yrow[v] = make_uint4(o[0], o[1], o[2], o[3]);
        }
      }
    }
  }
  __syncthreads();
  // The end: the last block tells every rank this rank finished reading their cstage.
  if (tp_count_in(ctrl, MOE_CTRL_C_FIN, c, peers, &last_s) && tid == 0) {
    for (int d = 0; d < W; ++d) st_release_sys_u64(tp_flag(a, d, MOE_TP_FLAG_READ, me), c);
    if constexpr (PROBE) tp_probe(a, MOE_P_C_SUMMED);
    ctrl[MOE_CTRL_C_DONE] = c;
  }
}

// The kernels, then their probe instances (src/comm/moe/throughput.rs TP_KERNELS, in this order).
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_bf16_i32(MoeTpArgs a) { tp_dispatch_body<2, false, int32_t>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_bf16_i64(MoeTpArgs a) { tp_dispatch_body<2, false, int64_t>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_fp8_i32(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_fp8_i64(MoeTpArgs a) { tp_dispatch_body<1, true, int64_t>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_fp8q_i32(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_fp8q_i64(MoeTpArgs a) { tp_dispatch_body<1, true, int64_t, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_combine_bf16(MoeTpArgs a) { tp_combine_body(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_bf16_i32(MoeTpArgs a) { tp_dispatch_body<2, false, int32_t, false, false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_bf16_i64(MoeTpArgs a) { tp_dispatch_body<2, false, int64_t, false, false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_fp8_i32(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, false, false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_fp8_i64(MoeTpArgs a) { tp_dispatch_body<1, true, int64_t, false, false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_fp8q_i32(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, true, false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_fp8q_i64(MoeTpArgs a) { tp_dispatch_body<1, true, int64_t, true, false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_recv_bf16(MoeTpArgs a) { tp_dispatch_body<2, false, int32_t, false, false, MOE_RECV>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_recv_fp8(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, false, false, MOE_RECV>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_recv_fp8q(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, true, false, MOE_RECV>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_combine_send_bf16(MoeTpArgs a) { tp_combine_body<false, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_combine_recv_bf16(MoeTpArgs a) { tp_combine_body<false, MOE_RECV>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_bf16_i32_probe(MoeTpArgs a) { tp_dispatch_body<2, false, int32_t, false, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_bf16_i64_probe(MoeTpArgs a) { tp_dispatch_body<2, false, int64_t, false, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_fp8_i32_probe(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, false, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_fp8_i64_probe(MoeTpArgs a) { tp_dispatch_body<1, true, int64_t, false, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_fp8q_i32_probe(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, true, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_fp8q_i64_probe(MoeTpArgs a) { tp_dispatch_body<1, true, int64_t, true, true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_combine_bf16_probe(MoeTpArgs a) { tp_combine_body<true>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_bf16_i32_probe(MoeTpArgs a) { tp_dispatch_body<2, false, int32_t, false, true, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_bf16_i64_probe(MoeTpArgs a) { tp_dispatch_body<2, false, int64_t, false, true, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_fp8_i32_probe(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, false, true, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_fp8_i64_probe(MoeTpArgs a) { tp_dispatch_body<1, true, int64_t, false, true, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_fp8q_i32_probe(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, true, true, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_send_fp8q_i64_probe(MoeTpArgs a) { tp_dispatch_body<1, true, int64_t, true, true, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_recv_bf16_probe(MoeTpArgs a) { tp_dispatch_body<2, false, int32_t, false, true, MOE_RECV>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_recv_fp8_probe(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, false, true, MOE_RECV>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_dispatch_recv_fp8q_probe(MoeTpArgs a) { tp_dispatch_body<1, true, int32_t, true, true, MOE_RECV>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_combine_send_bf16_probe(MoeTpArgs a) { tp_combine_body<true, MOE_SEND>(a); }
extern "C" __global__ void MOE_BOUNDS symm_moe_tp_combine_recv_bf16_probe(MoeTpArgs a) { tp_combine_body<true, MOE_RECV>(a); }

