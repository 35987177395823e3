//! Rust mirror of `SymmArgs` and the signal-pad layout in kernels/common.cuh (keep in step; the
//! size is asserted here and in tests/kernel_table.rs against the C source).

pub const MAX_RANKS: usize = 8;
pub const MAX_BLOCKS: usize = 128;
pub const THREADS: u32 = 512;
/// Vectors per thread per round in the two-shot kernel (16-byte path only).
pub const TWO_SHOT_UNROLL: u64 = 4;
/// The same for reduce-scatter and all-gather (kernels/scatter_gather.cu).
pub const SG_UNROLL: u64 = 4;
/// One signal slot: `u32 flag, u32 pad, u64 desc`.
pub const SLOT_BYTES: u64 = 16;
/// Signal pad: `[MAX_BLOCKS][MAX_RANKS]` slots.
pub const PAD_BYTES: u64 = (MAX_BLOCKS * MAX_RANKS) as u64 * SLOT_BYTES;
/// The communicator's internal block: pad, local barrier epochs, control words (the abort
/// word), then the one-shot LL region (kernels/one_shot_ll.cu): per-block call counters,
/// call-descriptor words, data slots. Everything before `LL_DATA_OFFSET` starts at 0.
pub const COUNTERS_OFFSET: u64 = PAD_BYTES;
/// The abort word (`u32`, device memory of this rank): 0, or the first fatal error's
/// `(code << 16) | (peer + 1)`. Kernels poll it in their waits; the host never reads it.
pub const ABORT_OFFSET: u64 = COUNTERS_OFFSET + (MAX_BLOCKS * 4) as u64;
pub const CONTROL_BYTES: u64 = 128;
pub const LL_COUNTERS_OFFSET: u64 = ABORT_OFFSET + CONTROL_BYTES;
pub const LL_DESC_OFFSET: u64 = LL_COUNTERS_OFFSET + (MAX_BLOCKS * 4) as u64;
pub const LL_DATA_OFFSET: u64 = LL_DESC_OFFSET + 4096;
/// Alternating buffers, each with one slot per sending rank; a slot holds the largest
/// message the LL kernel takes (`SYMMALLOC_LL_BYTES`).
pub const LL_BUFFERS: u64 = 2;
/// What an LL data word holds until a peer's value arrives.
pub const LL_EMPTY_BYTE: u8 = 0xff;

/// Size of the internal block for `world` ranks and LL slots of `ll_slot` bytes.
pub fn internal_bytes(world: usize, ll_slot: u64) -> u64 {
    LL_DATA_OFFSET + LL_BUFFERS * world as u64 * ll_slot
}

/// Spins between two looks at the clock and the abort word in every kernel wait.
pub const SPIN_CHECK: u32 = 1024;

/// Error codes kernels write into the host-mapped error words (`SymmArgs::error_word` points at
/// two `u32`: `[0]` a recoverable error of one call, `[1]` the fatal error), each as
/// `(code << 16) | (peer + 1)`.
pub const ERR_TIMEOUT: u32 = 1;
pub const ERR_ASYMMETRIC: u32 = 2;
pub const ERR_NO_MULTIMEM: u32 = 3;
/// A peer ran another collective while this rank ran the LL kernel: words it sent may be left
/// in the LL buffers, so the communicator cannot be trusted any more.
pub const ERR_LL_ASYMMETRIC: u32 = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SymmArgs {
    pub inputs: [u64; MAX_RANKS],
    pub outputs: [u64; MAX_RANKS],
    pub pads: [u64; MAX_RANKS],
    pub mc_out: u64,
    pub counters: u64,
    pub error_word: u64,
    pub count: u64,
    pub desc: u64,
    pub timeout_ns: u64,
    pub rank: i32,
    pub world: i32,
    pub in_place: i32,
    pub ll_slot_kib: i32,
}

const _: () = assert!(std::mem::size_of::<SymmArgs>() == 256);
// The abort word lies in the part of the block that init zeroes, before the LL region.
const _: () =
    assert!(ABORT_OFFSET + 4 <= LL_COUNTERS_OFFSET && LL_COUNTERS_OFFSET < LL_DATA_OFFSET);

/// Address of slot `[block][peer]` of the pad at `pad`.
pub fn slot(pad: u64, block: usize, peer: usize) -> u64 {
    pad + ((block * MAX_RANKS + peer) as u64) * SLOT_BYTES
}

/// Vectors per thread per row in the fused all-reduce + RMSNorm kernel (kernels/rms_norm.cu).
pub const RMS_VECS: u64 = 4;
/// The largest hidden size one block covers: THREADS x RMS_VECS vectors of 8 elements.
pub const RMS_MAX_HIDDEN: u64 = THREADS as u64 * RMS_VECS * 8;
/// The fused LL kernel with one vector per thread (`..._ll1_*`) runs blocks of up to this many
/// threads: rows up to hidden 6144. Wider rows take the four-vector kernel, which at hidden 8192
/// (512 threads, two vectors each) was 0.03-0.08 µs faster than 1024 threads of one on one H200
/// (bench/RESULTS.md, session 9).
pub const RMS_LL1_THREADS: u64 = 768;
/// The most vectors of a row one block of the cluster kernel (`..._llc_*`) takes, one per thread
/// (its launch bound): a row is split over at least ceil(vecs / this) blocks of a cluster.
pub const RMS_LLC_THREADS: u64 = 512;

/// Mirror of `RmsArgs` (kernels/rms_norm.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RmsArgs {
    pub s: SymmArgs,
    pub residual: u64,
    pub weight: u64,
    pub out: u64,
    pub hidden: u64,
    /// count / hidden, so the kernels divide nothing before their first loads.
    pub tokens: u64,
    pub eps: f32,
    /// LL kernel: threads per block that push x (the LL all-reduce's spread of the message).
    pub push_threads: u32,
}

const _: () = assert!(std::mem::size_of::<RmsArgs>() == 256 + 48);
