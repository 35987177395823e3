//! Everything the host shares with the kernels: the constants (limits, unrolls, block sizes,
//! error codes, the internal block's layout), from which kernels/symm_constants.cuh is generated
//! (`SHARED_CONSTANTS`, kernels.rs), and the Rust mirrors of the argument structs `SymmArgs`
//! (kernels/common.cuh) and `RmsArgs` (kernels/rms_norm.cuh), checked field by field against the
//! CUDA source by tests/kernel_table.rs. docs/DESIGN.md, "Internal buffer layout", draws the
//! layout.

pub const MAX_RANKS: usize = 8;
pub const MAX_BLOCKS: usize = 128;
pub const THREADS: u32 = 512;
/// Vectors per thread per round in the two-shot kernel (16-byte path only).
pub const TWO_SHOT_UNROLL: u64 = 4;
/// The same for reduce-scatter and all-gather (kernels/scatter_gather.cuh).
pub const SG_UNROLL: u64 = 4;
/// One signal slot: `u32 flag, u32 pad, u64 desc`.
pub const SLOT_BYTES: u64 = 16;
/// Signal pad: `[MAX_BLOCKS][MAX_RANKS]` slots.
pub const PAD_BYTES: u64 = (MAX_BLOCKS * MAX_RANKS) as u64 * SLOT_BYTES;
/// The communicator's internal block: pad, local barrier epochs, control words (the abort
/// word), then the LL region (kernels/ll.cuh; docs/DESIGN.md, "Internal buffer layout"): per-block call counters,
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
/// What an LL data word holds until a peer's value arrives (every byte LL_EMPTY_BYTE).
pub const LL_EMPTY_BYTE: u8 = 0xff;
pub const LL_EMPTY: u32 = u32::from_ne_bytes([LL_EMPTY_BYTE; 4]);
/// The most blocks of a thread-block cluster the fused cluster kernel uses (the portable limit).
pub const MAX_CLUSTER: u64 = 8;

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
/// A p2p signal wait (include/symmalloc_device.cuh) waited past the timeout; its fatal word's
/// low half is the slot's writer word, and words 2..8 hold the slot and the values
/// (p2p/device_comm.rs, `SYMM_DEVICE_ERR_SIGNAL_TIMEOUT`, which is asserted equal there).
pub const ERR_SIGNAL_TIMEOUT: u32 = 5;

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

/// Vectors per thread per row in the fused all-reduce + RMSNorm kernel (kernels/rms_norm.cuh).
pub const RMS_VECS: u64 = 4;
/// The largest hidden size one block covers: THREADS x RMS_VECS vectors of 8 elements.
pub const RMS_MAX_HIDDEN: u64 = THREADS as u64 * RMS_VECS * 8;
/// The fused LL kernel with one vector per thread (`..._ll1_*`) runs blocks of up to this many
/// threads: rows up to hidden 6144. Wider rows take the four-vector kernel, which at hidden 8192
/// (512 threads, two vectors each) beat 1024 threads of one (bench/NOTES.md, "The fused
/// all-reduce + RMSNorm kernels").
pub const RMS_LL1_THREADS: u64 = 768;
/// The most vectors of a row one block of the cluster kernel (`..._llc_*`) takes, one per thread
/// (its launch bound): a row is split over at least ceil(vecs / this) blocks of a cluster.
pub const RMS_LLC_THREADS: u64 = 512;

/// Mirror of `RmsArgs` (kernels/rms_norm.cuh).
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
    /// FP8 output (kernels/quant.cuh): the static scale's address, or where the per-token or
    /// per-group scales go; 0 for a bf16/fp16 output.
    pub scale: u64,
}

const _: () = assert!(std::mem::size_of::<RmsArgs>() == 256 + 56);

/// A constant kernels/symm_constants.cuh defines: `#define NAME VALUE[SUFFIX]`.
pub struct SharedConstant {
    pub name: &'static str,
    pub value: u64,
    /// "u" for the values kernels compare with unsigned words.
    pub suffix: &'static str,
    pub doc: &'static str,
}

const fn c(name: &'static str, value: u64, doc: &'static str) -> SharedConstant {
    SharedConstant {
        name,
        value,
        suffix: "",
        doc,
    }
}

const fn cu(name: &'static str, value: u64, doc: &'static str) -> SharedConstant {
    SharedConstant {
        name,
        value,
        suffix: "u",
        doc,
    }
}

/// Every constant the kernels take from the host, in the order the header lists them.
pub const SHARED_CONSTANTS: &[SharedConstant] = &[
    c(
        "SYMM_MAX_RANKS",
        MAX_RANKS as u64,
        "Ranks of a communicator, at most.",
    ),
    c(
        "SYMM_MAX_BLOCKS",
        MAX_BLOCKS as u64,
        "Blocks of a collective's grid, at most (one signal slot row each).",
    ),
    c(
        "SYMM_THREADS",
        THREADS as u64,
        "Threads per block of the barrier kernels (and the LL kernels' bound).",
    ),
    c(
        "SYMM_TWO_SHOT_UNROLL",
        TWO_SHOT_UNROLL,
        "Vectors per thread per round in the two-shot kernel.",
    ),
    c(
        "SYMM_SG_UNROLL",
        SG_UNROLL,
        "Vectors per thread per round in reduce-scatter and all-gather.",
    ),
    c(
        "SYMM_RMS_VECS",
        RMS_VECS,
        "Vectors of a row per thread in the four-vector fused kernels.",
    ),
    c(
        "SYMM_RMS_LL1_THREADS",
        RMS_LL1_THREADS,
        "Threads per block, at most, of the one-vector fused LL kernel.",
    ),
    c(
        "SYMM_RMS_LLC_THREADS",
        RMS_LLC_THREADS,
        "Threads per block, at most, of the fused cluster kernel.",
    ),
    c(
        "SYMM_MAX_CLUSTER",
        MAX_CLUSTER,
        "Blocks per thread-block cluster, at most.",
    ),
    c(
        "SYMM_PAD_BYTES",
        PAD_BYTES,
        "The signal pad: [SYMM_MAX_BLOCKS][SYMM_MAX_RANKS] 16-byte slots.",
    ),
    c(
        "SYMM_ABORT_OFFSET",
        ABORT_OFFSET,
        "The abort word's offset in the internal block (after the per-block epochs).",
    ),
    c(
        "SYMM_CONTROL_BYTES",
        CONTROL_BYTES,
        "Control words (the abort word) before the LL region.",
    ),
    c(
        "SYMM_LL_COUNTERS_OFFSET",
        LL_COUNTERS_OFFSET,
        "LL region: per-block call counters.",
    ),
    c(
        "SYMM_LL_DESC_OFFSET",
        LL_DESC_OFFSET,
        "LL region: SYMM_LL_BUFFERS x SYMM_MAX_RANKS call-descriptor words.",
    ),
    c(
        "SYMM_LL_DATA_OFFSET",
        LL_DATA_OFFSET,
        "LL region: SYMM_LL_BUFFERS x world data slots of ll_slot_kib KiB.",
    ),
    c(
        "SYMM_LL_BUFFERS",
        LL_BUFFERS,
        "LL buffers, alternating between calls.",
    ),
    cu(
        "SYMM_LL_EMPTY",
        LL_EMPTY as u64,
        "What an LL data word holds until a peer's value arrives.",
    ),
    cu(
        "SYMM_SPIN_CHECK",
        SPIN_CHECK as u64,
        "Spins between two looks at the clock and the abort word.",
    ),
    cu(
        "SYMM_ERR_TIMEOUT_CODE",
        ERR_TIMEOUT as u64,
        "Error word code: a peer did not answer in time (fatal).",
    ),
    cu(
        "SYMM_ERR_ASYMMETRIC_CODE",
        ERR_ASYMMETRIC as u64,
        "Error word code: a barrier kernel's descriptors differ (this call did not run).",
    ),
    cu(
        "SYMM_ERR_NO_MULTIMEM_CODE",
        ERR_NO_MULTIMEM as u64,
        "Error word code: multimem on a GPU without it.",
    ),
    cu(
        "SYMM_ERR_LL_ASYMMETRIC_CODE",
        ERR_LL_ASYMMETRIC as u64,
        "Error word code: an LL kernel's descriptors differ (fatal).",
    ),
];
