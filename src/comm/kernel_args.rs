//! Rust mirror of `SymmArgs` and the signal-pad layout in kernels/common.cuh (keep in step; the
//! size is asserted here and in tests/kernel_table.rs against the C source).

pub const MAX_RANKS: usize = 8;
pub const MAX_BLOCKS: usize = 128;
pub const THREADS: u32 = 512;
/// One signal slot: `u32 flag, u32 pad, u64 desc`.
pub const SLOT_BYTES: u64 = 16;
/// Signal pad: `[MAX_BLOCKS][MAX_RANKS]` slots.
pub const PAD_BYTES: u64 = (MAX_BLOCKS * MAX_RANKS) as u64 * SLOT_BYTES;
/// The communicator's internal block: pad, then local epoch counters.
pub const COUNTERS_OFFSET: u64 = PAD_BYTES;
pub const INTERNAL_BYTES: u64 = PAD_BYTES + (MAX_BLOCKS * 4) as u64;

/// Error word codes written by kernels: `(code << 16) | (peer + 1)`.
pub const ERR_TIMEOUT: u32 = 1;
pub const ERR_ASYMMETRIC: u32 = 2;
pub const ERR_NO_MULTIMEM: u32 = 3;

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
    pub reserved: i32,
}

const _: () = assert!(std::mem::size_of::<SymmArgs>() == 256);

/// Address of slot `[block][peer]` of the pad at `pad`.
pub fn slot(pad: u64, block: usize, peer: usize) -> u64 {
    pad + ((block * MAX_RANKS + peer) as u64) * SLOT_BYTES
}
