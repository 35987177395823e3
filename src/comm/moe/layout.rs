//! The moe object's buffer: one `symm_comm_malloc` block at the same offset on every rank
//! (docs/moe.md, "Buffers"), cut into parts, each 256-byte aligned, in a fixed order. This file
//! computes the parts' offsets and sizes from a checked configuration and the world; the host
//! backend (host.rs) and the kernels (launch.rs passes the offsets, kernels/moe.cu) address the
//! parts only through these offsets.
//!
//! Invariants: the layout is a pure function of (config, world), so it is the same on every
//! rank (create compares the configs first); every size is computed with checked arithmetic
//! (config.rs bounds the shapes so none overflows); `ctrl`, `counts` and `flags` come first
//! and are zeroed at create, before any peer can write into them.

use super::config::Config;

/// Alignment of every part.
pub const PART_ALIGN: u64 = 256;
/// Bytes of the control part: the kernels' monotonic counters (dispatch done and sent, combine
/// done and sent, the last dispatch that succeeded, the last dispatch routed and the last that
/// failed), as `u64` words. Only this rank's kernels touch its control part.
pub const CTRL_BYTES: u64 = 4096;
/// `u64` words of the control part (word indices).
pub const CTRL_D_DONE: u64 = 0;
pub const CTRL_D_SENT: u64 = 1;
pub const CTRL_C_DONE: u64 = 2;
pub const CTRL_C_SENT: u64 = 3;
pub const CTRL_OK_EPOCH: u64 = 4;
pub const CTRL_ROUTED: u64 = 5;
pub const CTRL_FAILED: u64 = 6;
/// `i32` words after a source rank's counts in a counts row: status, then token, k, value (low
/// and high halves) of its first offending entry (status.rs has the codes), then padding.
pub const ROW_EXTRA: u64 = 8;
/// The four flag rows: counts ready, data done (dispatch), then combine done twice, one row
/// per parity of the combine's epoch (`FLAG_COMBINE + (epoch & 1)`, see `combine_flag`).
pub const FLAG_COUNTS: u64 = 0;
pub const FLAG_DATA: u64 = 1;
pub const FLAG_COMBINE: u64 = 2;
/// Flag rows in all.
pub const FLAG_ROWS: u64 = 4;

/// The flag row of combine `epoch`. Combines alternate between two rows and two landing
/// buffers (`Layout::cbuf_at`): a rank reaches combine `c + 2` only after every rank raised its
/// flag of combine `c + 1`, which a rank does only after it finished reading combine `c`; so a
/// later combine never writes into a row or buffer a peer still reads, and the value a rank
/// waits for is exactly `2 * c` or `2 * c + 1` (refused), never a later call's.
pub fn combine_flag(epoch: u64) -> u64 {
    FLAG_COMBINE + (epoch & 1)
}

/// Byte offsets of the parts in the block, and the block's size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    pub counts: u64,
    pub flags: u64,
    pub recv_counts: u64,
    pub recv_src: u64,
    pub recv_x: u64,
    /// 0 for bf16 (no scales).
    pub recv_scales: u64,
    pub idx: u64,
    pub weights: u64,
    /// `[T][K]` int32: each of this rank's (t, k) position within (this rank, its expert).
    pub pos: u64,
    /// Two `[T][K][H]` bf16 landing buffers, one per combine parity (`cbuf_at`).
    pub cbuf: u64,
    /// Bytes of one landing buffer.
    pub cbuf_slot: u64,
    pub bytes: u64,
}

/// `i32` words of one source rank's counts row.
pub fn row_words(experts: u64) -> u64 {
    experts + ROW_EXTRA
}

impl Layout {
    /// The layout of a configuration checked by config.rs (shapes bounded, no overflow).
    pub fn new(c: &Config, world: u64) -> Layout {
        let (t, h, k, e, r) = (
            c.tokens,
            c.hidden,
            c.topk as u64,
            c.experts as u64,
            c.max_recv,
        );
        let l = e / world;
        let mut at = 0u64;
        let mut part = |bytes: u64| {
            let off = at;
            at = (at + bytes).next_multiple_of(PART_ALIGN);
            off
        };
        let _ctrl = part(CTRL_BYTES);
        let counts = part(2 * world * row_words(e) * 4);
        let flags = part(FLAG_ROWS * world * 8);
        let recv_counts = part(l * 4);
        let recv_src = part(l * r * 4);
        let recv_x = part(l * r * h * c.dtype.bytes());
        let recv_scales = if c.dtype.has_scales() {
            part(l * r * (h / 128) * 4)
        } else {
            0
        };
        let idx = part(t * k * 4);
        let weights = part(t * k * 4);
        let pos = part(t * k * 4);
        let cbuf_slot = t * k * h * 2;
        let cbuf = part(2 * cbuf_slot);
        Layout {
            counts,
            flags,
            recv_counts,
            recv_src,
            recv_x,
            recv_scales,
            idx,
            weights,
            pos,
            cbuf,
            cbuf_slot,
            bytes: at,
        }
    }

    /// The counts row of source `src` for the call of `epoch`'s parity.
    pub fn row(&self, experts: u64, world: u64, epoch: u64, src: u64) -> u64 {
        self.counts + ((epoch & 1) * world + src) * row_words(experts) * 4
    }

    /// Flag `which` (FLAG_*) of source `src`.
    pub fn flag(&self, world: u64, which: u64, src: u64) -> u64 {
        self.flags + (which * world + src) * 8
    }

    /// The landing buffer of combine `epoch` (its parity's; `combine_flag` says why two).
    pub fn cbuf_at(&self, epoch: u64) -> u64 {
        self.cbuf + (epoch & 1) * self.cbuf_slot
    }

    /// Bytes at the start of the block that create zeroes (ctrl, counts, flags).
    pub fn zeroed_bytes(&self) -> u64 {
        self.recv_counts
    }
}
