//! The moe object's buffer: one `symm_comm_malloc` block at the same offset on every rank
//! (docs/moe.md, "Buffers"), cut into parts, each 256-byte aligned, in a fixed order, one
//! layout per mode (`Layout`, the low-latency mode's; `TpLayout`, the throughput mode's). This
//! file computes the parts' offsets and sizes from a checked configuration and the world; the host
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
/// Bytes of the control part: the kernels' monotonic counters (dispatch done, blocks counted
/// in before its counts row and at its end; the same for the combine; the last dispatch that
/// succeeded), as `u64` words. Only this rank's kernels touch its control part.
pub const CTRL_BYTES: u64 = 4096;
/// `u64` words of the control part (word indices).
pub const CTRL_D_DONE: u64 = 0;
pub const CTRL_D_SENT: u64 = 1;
pub const CTRL_C_DONE: u64 = 2;
pub const CTRL_C_SENT: u64 = 3;
pub const CTRL_OK_EPOCH: u64 = 4;
pub const CTRL_D_FIN: u64 = 5;
pub const CTRL_C_FIN: u64 = 6;
/// The low-latency dispatch's epoch of its last send part, stored by block 0 (the receive
/// half's epoch: `CTRL_D_DONE` moves at block 0's end, which other blocks of a receive half may
/// start after). The low-latency dispatch counts blocks in only for the probe (`CTRL_D_FIN`);
/// `CTRL_D_SENT` is the throughput mode's.
pub const CTRL_D_HALF: u64 = 7;
/// The clock probe's first word (kernels/moe.cu MOE_CTRL_PROBE): `PROBE_WORDS` words, the last
/// dispatch's phase times (`PROBE_D_*`), then the last combine's (`PROBE_C_*`); written only when
/// the object was created with the probe on.
pub const CTRL_PROBE: u64 = 64;
pub const PROBE_WORDS: u64 = 16;
/// Probe words: dispatch start, routed (the routing read), staged (every block's list and rows
/// in place), published (the counts row stored into every rank), receive start (the receive
/// half's start; in the one-call form its wait's), wait done, pulled (the grid's end), its epoch.
pub const PROBE_D_START: u64 = 0;
pub const PROBE_D_ROUTED: u64 = 1;
pub const PROBE_D_STAGED: u64 = 2;
pub const PROBE_D_PUBLISHED: u64 = 3;
pub const PROBE_D_RECV: u64 = 4;
pub const PROBE_D_WAITED: u64 = 5;
pub const PROBE_D_PULLED: u64 = 6;
pub const PROBE_D_EPOCH: u64 = 7;
/// Combine: start, pushed (rows in the peers' landing buffers, flags raised), receive start,
/// wait done, summed (the grid's end), its epoch. The throughput mode leaves both receive starts
/// 0 (it has no halves), stores "pulled" when every block pulled its rows and counted their
/// slots, and uses words 14 and 15 (`PROBE_D_SCANNED`, `PROBE_D_SORTED`): the CSR's scans over
/// the blocks done, every block's rows placed (the grid's end); the low-latency mode leaves them 0.
pub const PROBE_C_START: u64 = 8;
pub const PROBE_C_PUSHED: u64 = 9;
pub const PROBE_C_RECV: u64 = 10;
pub const PROBE_C_WAITED: u64 = 11;
pub const PROBE_C_SUMMED: u64 = 12;
pub const PROBE_C_EPOCH: u64 = 13;
pub const PROBE_D_SCANNED: u64 = 14;
pub const PROBE_D_SORTED: u64 = 15;
const _: () = assert!((CTRL_PROBE + PROBE_WORDS) * 8 <= CTRL_BYTES);
/// Words after a source rank's counts in a counts row: status, then token, k, value (low and
/// high halves) of its first offending entry (status.rs has the codes), then padding.
pub const ROW_EXTRA: u64 = 8;
/// Words after `ROW_EXTRA` in a low-latency counts row: one per block of the source's grid
/// (`MAX_GRID` at most; the grid is the same on every rank), each stored by its block once the
/// block's list entries and staged rows are in place (the value 1, tagged). A receiver waits
/// for its grid's words of every source: the dispatch's one cross-rank wait covers the data.
pub const ROW_BLOCKS: u64 = super::MAX_GRID as u64;
/// The combine's flag rows, one per parity of its epoch (`combine_flag`).
pub const FLAG_COMBINE: u64 = 0;
/// Flag rows in all.
pub const FLAG_ROWS: u64 = 2;

/// A counts-row word: the low 32 bits of the dispatch epoch that wrote it, then the value.
/// A reader takes a word only once its tag is its own call's (`tag_of`): the words are the
/// dispatch's one cross-rank wait, no separate flag. Rows alternate by the epoch's parity, so
/// the word a reader may see instead is two calls old (another tag, even across the 2^32 wrap).
pub fn tagged(epoch: u64, value: i32) -> u64 {
    ((epoch & 0xffff_ffff) << 32) | value as u32 as u64
}

/// Whether counts-row word `w` was written by dispatch `epoch` (`tagged`).
pub fn tag_of(w: u64, epoch: u64) -> bool {
    w >> 32 == epoch & 0xffff_ffff
}

/// The value of a counts-row word (`tagged`).
pub fn untag(w: u64) -> i32 {
    w as u32 as i32
}

/// The flag row of combine `epoch`. Combines alternate between two rows and two landing
/// buffers (`Layout::cbuf_at`): a rank reaches combine `c + 2` only after every rank raised its
/// flag of combine `c + 1`, which a rank does only after it finished reading combine `c`; so a
/// later combine never writes into a row or buffer a peer still reads, and the value a rank
/// waits for is exactly `2 * c` or `2 * c + 1` (refused), never a later call's.
pub fn combine_flag(epoch: u64) -> u64 {
    FLAG_COMBINE + (epoch & 1)
}

/// The block cut front to back, each part starting `PART_ALIGN`-aligned where the last one
/// ended (both modes' layouts).
#[derive(Default)]
struct Parts {
    /// Where the next part starts: the block's size once every part is taken.
    end: u64,
}

impl Parts {
    /// The offset of the next part of `bytes` bytes.
    fn take(&mut self, bytes: u64) -> u64 {
        let off = self.end;
        self.end = (self.end + bytes).next_multiple_of(PART_ALIGN);
        off
    }
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
    /// `[T][K]` int32: each of this rank's (t, k) row in its expert's rank (`le * R + row`),
    /// or -1; the combine reads the rows of this rank's own experts straight from expert_out.
    pub pos: u64,
    /// `[2][E][T]` int32, per dispatch parity and expert (`list_at`): element p of expert e's
    /// part is this rank's routing entry (`t * K + k`) of the p-th token, in token order, routed
    /// to e (a slot per expert and token, so no offsets; kernels/moe.cu `moe_list`). Peers read
    /// it to pull their rows.
    pub list: u64,
    /// Bytes of one `list` parity (`E` experts' parts).
    pub list_slot: u64,
    /// Bytes of one expert's part of a parity (`T` entries).
    pub list_row: u64,
    /// `[2][T][H]` payload, per dispatch parity: this rank's `x` (quantized when the dispatch
    /// quantizes), for the peers to pull (0 bytes at world 1 without quantization: a rank reads
    /// its own rows from the caller's `x`).
    pub xstage: u64,
    /// Bytes of one `xstage` parity.
    pub xstage_slot: u64,
    /// `[2][T][H/128]` fp32, row-major (FP8 with `xstage`; else 0 bytes).
    pub xscales: u64,
    /// Bytes of one `xscales` parity.
    pub xscales_slot: u64,
    /// Two `[T][K][H]` bf16 landing buffers, one per combine parity (`cbuf_at`); the rows of
    /// peers' experts only (0 bytes at world 1).
    pub cbuf: u64,
    /// Bytes of one landing buffer.
    pub cbuf_slot: u64,
    pub bytes: u64,
}

/// `u64` words (`tagged`) of one source rank's counts row, its stride: counts, `ROW_EXTRA`
/// status words, `ROW_BLOCKS` block words (a grid of `g` blocks uses the first `g`).
pub fn row_words(experts: u64) -> u64 {
    experts + ROW_EXTRA + ROW_BLOCKS
}

/// The words of a counts row that a grid of `grid` blocks writes and its receivers wait for.
pub fn row_used(experts: u64, grid: u64) -> u64 {
    experts + ROW_EXTRA + grid
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
        let mut parts = Parts::default();
        let _ctrl = parts.take(CTRL_BYTES);
        // At CTRL_BYTES: the kernels take it from there (kernels/moe.cu MOE_CTRL_BYTES).
        let counts = parts.take(2 * world * row_words(e) * 8);
        let flags = parts.take(FLAG_ROWS * world * 8);
        let recv_counts = parts.take(l * 4);
        let recv_src = parts.take(l * r * 4);
        let recv_x = parts.take(l * r * h * c.dtype.bytes());
        let recv_scales = if c.dtype.has_scales() {
            parts.take(c.scale_elems(world) * 4)
        } else {
            0
        };
        let idx = parts.take(t * k * 4);
        let weights = parts.take(t * k * 4);
        let pos = parts.take(t * k * 4);
        let list_row = t * 4;
        let list_slot = e * list_row;
        let list = parts.take(2 * list_slot);
        // A dispatch that quantizes stages its quantized rows at world 1 too (its pull reads
        // them there, not the caller's bf16 x).
        let peers = world > 1 || c.quantize;
        let xstage_slot = if peers { t * h * c.dtype.bytes() } else { 0 };
        let xstage = parts.take(2 * xstage_slot);
        let xscales_slot = if peers { t * (h / 128) * 4 } else { 0 };
        let xscales_slot = if c.dtype.has_scales() {
            xscales_slot
        } else {
            0
        };
        let xscales = parts.take(2 * xscales_slot);
        let cbuf_slot = if peers { t * k * h * 2 } else { 0 };
        let cbuf = parts.take(2 * cbuf_slot);
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
            list,
            list_slot,
            list_row,
            xstage,
            xstage_slot,
            xscales,
            xscales_slot,
            cbuf,
            cbuf_slot,
            bytes: parts.end,
        }
    }

    /// The counts row of source `src` for the call of `epoch`'s parity.
    pub fn row(&self, experts: u64, world: u64, epoch: u64, src: u64) -> u64 {
        self.counts + ((epoch & 1) * world + src) * row_words(experts) * 8
    }

    /// Flag `which` (FLAG_*) of source `src`.
    pub fn flag(&self, world: u64, which: u64, src: u64) -> u64 {
        self.flags + (which * world + src) * 8
    }

    /// The landing buffer of combine `epoch` (its parity's; `combine_flag` says why two).
    pub fn cbuf_at(&self, epoch: u64) -> u64 {
        self.cbuf + (epoch & 1) * self.cbuf_slot
    }

    /// This rank's entry list of dispatch `epoch` (its parity's; `list`) for `expert`.
    pub fn list_at(&self, epoch: u64, expert: u64) -> u64 {
        self.list + (epoch & 1) * self.list_slot + expert * self.list_row
    }

    /// The staged `x` (and FP8 scales) of dispatch `epoch` (its parity's).
    pub fn xstage_at(&self, epoch: u64) -> (u64, u64) {
        (
            self.xstage + (epoch & 1) * self.xstage_slot,
            self.xscales + (epoch & 1) * self.xscales_slot,
        )
    }

    /// Bytes at the start of the block that create zeroes (ctrl, counts, flags).
    pub fn zeroed_bytes(&self) -> u64 {
        self.recv_counts
    }
}

// The throughput mode's parts (throughput.rs launches its kernels, tp_host.rs is their CPU
// twin; both address the block through these offsets).

/// Flag rows: the combine's "rows staged" (`2 * c + refused`) and "done reading" (`c`).
pub const TP_FLAG_STAGED: u64 = 0;
pub const TP_FLAG_READ: u64 = 1;
pub const TP_FLAG_ROWS: u64 = 2;

/// `u64` words (epoch-tagged) of one source rank's counts row: its tokens per destination
/// rank, then the status words (status.rs `row_extra`).
pub fn tp_row_words(world: u64) -> u64 {
    world + ROW_EXTRA
}

/// Byte offsets of the throughput mode's parts in the block, and the block's size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TpLayout {
    /// `[2][W][W + 8]` u64, per dispatch parity, per source: tokens to each rank, status.
    pub counts: u64,
    /// `[2][W]` u64: `TP_FLAG_STAGED`, `TP_FLAG_READ` per source rank.
    pub flags: u64,
    /// `[1 + L + L + 1]` int32: rows received, rows per local expert, the CSR offsets.
    pub meta: u64,
    /// `[W*T]` int32: `src_rank * T + token` of each received row.
    pub recv_src: u64,
    /// `[W*T][K]` int32: the row's top-k as local expert ids, -1 for other ranks' experts.
    pub recv_idx: u64,
    /// `[W*T][K]` fp32: the weights of those slots (0 where -1).
    pub recv_weights: u64,
    /// `[W*T*K]` int32: `row * K + k` grouped by local expert, rows increasing (CSR).
    pub expert_rows: u64,
    /// `[W*T][H]` payload.
    pub recv_x: u64,
    /// FP8 only (else 0): `[W*T][H/128]` fp32 row-major, or column-major `[H/128][R4]` (`R4` =
    /// `W*T` rounded up to 4; config.rs `scale_strides`).
    pub recv_scales: u64,
    /// `[2][T][K]` int32 / fp32, per dispatch parity: this rank's routing (peers read it).
    pub idx: u64,
    pub weights: u64,
    /// `[T][W]` int32: the row of this rank's token t at rank d, or -1.
    pub pos: u64,
    /// `[2][W][T]` int32, per dispatch parity: this rank's tokens by destination rank, in
    /// token order (CSR; offsets are prefix sums of its counts row). Peers read it.
    pub list: u64,
    /// `[2][T][H]` payload and `[2][T][H/128]` fp32 (FP8), per dispatch parity: this rank's x
    /// (quantized when the dispatch quantizes; 0 bytes at world 1 without quantization: a rank
    /// reads its own rows from the caller's x).
    pub xstage: u64,
    pub xstage_slot: u64,
    pub xscales: u64,
    pub xscales_slot: u64,
    /// `[W*T][H]` bf16: this rank's combine input rows of peers' tokens (peers read them).
    pub cstage: u64,
    /// `[MAX_GRID][max(L, W + 1)]` int32, only this rank's kernel reads it: first the dispatch's
    /// routing, per block its tokens per destination rank and its first bad entry (rows of
    /// W + 1); after the one cross-rank wait the CSR, per block its slots per local expert, then
    /// the slots of lower blocks (rows of L; kernels/moe_tp.cu step 1 and `tp_grid_csr`).
    pub csr: u64,
    pub bytes: u64,
}

impl TpLayout {
    /// The layout of a checked throughput configuration (config.rs bounds every shape).
    pub fn new(c: &Config, world: u64) -> TpLayout {
        let (t, h, k, e) = (c.tokens, c.hidden, c.topk as u64, c.experts as u64);
        let l = e / world;
        let rows = world * t;
        let sc = c.scales_per_row();
        let mut parts = Parts::default();
        let _ctrl = parts.take(CTRL_BYTES);
        let counts = parts.take(2 * world * tp_row_words(world) * 8);
        let flags = parts.take(TP_FLAG_ROWS * world * 8);
        let meta = parts.take((2 * l + 2) * 4);
        let recv_src = parts.take(rows * 4);
        let recv_idx = parts.take(rows * k * 4);
        let recv_weights = parts.take(rows * k * 4);
        let expert_rows = parts.take(rows * k * 4);
        let recv_x = parts.take(rows * h * c.dtype.bytes());
        // One "expert" of config.rs's strides: the whole buffer (R = W*T in this mode).
        let recv_scales = if sc > 0 {
            parts.take(c.scale_strides()[0] * 4)
        } else {
            0
        };
        let idx = parts.take(2 * t * k * 4);
        let weights = parts.take(2 * t * k * 4);
        let pos = parts.take(t * world * 4);
        let list = parts.take(2 * world * t * 4);
        let csr = parts.take(super::MAX_GRID as u64 * l.max(world + 1) * 4);
        let peers = world > 1;
        // A dispatch that quantizes stages its quantized rows at world 1 too (its pull reads
        // its own rows there).
        let staged = peers || c.quantize;
        let xstage_slot = if staged { t * h * c.dtype.bytes() } else { 0 };
        let xstage = parts.take(2 * xstage_slot);
        let xscales_slot = if staged { t * sc * 4 } else { 0 };
        let xscales = parts.take(2 * xscales_slot);
        let cstage = parts.take(if peers { rows * h * 2 } else { 0 });
        TpLayout {
            counts,
            flags,
            meta,
            recv_src,
            recv_idx,
            recv_weights,
            expert_rows,
            recv_x,
            recv_scales,
            idx,
            weights,
            pos,
            list,
            xstage,
            xstage_slot,
            xscales,
            xscales_slot,
            cstage,
            csr,
            bytes: parts.end,
        }
    }

    /// What mod.rs keeps of it as the object's `Layout`: the block's size and the bytes create
    /// zeroes (ctrl, counts, flags: everything before `meta`); the low-latency parts are unused.
    pub fn block(&self) -> Layout {
        Layout {
            counts: self.counts,
            flags: self.flags,
            recv_counts: self.meta,
            bytes: self.bytes,
            ..Layout::default()
        }
    }

    /// The counts row of source `src` for dispatch `epoch` (its parity's).
    pub fn row(&self, world: u64, epoch: u64, src: u64) -> u64 {
        self.counts + ((epoch & 1) * world + src) * tp_row_words(world) * 8
    }

    /// Flag `which` (TP_FLAG_*) of source `src`.
    pub fn flag(&self, world: u64, which: u64, src: u64) -> u64 {
        self.flags + (which * world + src) * 8
    }

    /// Parity parts of dispatch `epoch`: (idx, weights, list, xstage, xscales).
    pub fn parity(&self, c: &Config, world: u64, epoch: u64) -> (u64, u64, u64, u64, u64) {
        let p = epoch & 1;
        let tk = c.tokens * c.topk as u64 * 4;
        (
            self.idx + p * tk,
            self.weights + p * tk,
            self.list + p * world * c.tokens * 4,
            self.xstage + p * self.xstage_slot,
            self.xscales + p * self.xscales_slot,
        )
    }
}

/// Both layouts' check: `parts` ((offset, bytes) in block order, the block's end last) each end
/// before the next begins, all `PART_ALIGN`-aligned, the counts past the control words.
#[cfg(test)]
fn assert_parts_in_order(parts: &[(u64, u64)], counts: u64, layout: &dyn std::fmt::Debug) {
    for p in parts.windows(2) {
        assert!(p[0].0 + p[0].1 <= p[1].0, "{p:?} {layout:?}");
    }
    assert!(parts.iter().all(|p| p.0 % PART_ALIGN == 0), "{layout:?}");
    assert!(counts >= CTRL_BYTES);
}

#[cfg(test)]
mod tests {
    use super::super::config::Request;
    use super::*;

    /// The low-latency block's parts in order, each at its documented size (docs/moe.md,
    /// "Buffers"), none overlapping the next, each aligned; the list has a slot per expert and
    /// token in each parity, and `list_at` alternates between the two and steps by expert.
    #[test]
    fn parts_do_not_overlap_and_the_list_has_a_slot_per_expert_and_token() {
        for (w, dtype, input) in [(1u64, 0u32, 0u32), (2, 1, 0), (4, 1, 1), (8, 0, 0)] {
            let req = Request {
                tokens: 5,
                hidden: 256,
                topk: 3,
                experts: 8 * w as u32,
                dtype,
                input,
                ..Request::default()
            };
            let c = req.check(w).unwrap();
            let l = Layout::new(&c, w);
            let (t, h, k, e) = (5u64, 256u64, 3u64, 8 * w);
            let (lx, r) = (e / w, c.max_recv);
            let pay = c.dtype.bytes();
            let peers = (w > 1 || c.quantize) as u64;
            let scales = if c.dtype.has_scales() {
                c.scale_elems(w) * 4
            } else {
                0
            };
            let xscales = if c.dtype.has_scales() {
                peers * t * (h / 128) * 4
            } else {
                0
            };
            // (offset, bytes) in block order; recv_scales only with FP8 (else its offset is 0).
            let mut parts = vec![
                (l.counts, 2 * w * row_words(e) * 8),
                (l.flags, FLAG_ROWS * w * 8),
                (l.recv_counts, lx * 4),
                (l.recv_src, lx * r * 4),
                (l.recv_x, lx * r * h * pay),
            ];
            if c.dtype.has_scales() {
                parts.push((l.recv_scales, scales));
            }
            parts.extend([
                (l.idx, t * k * 4),
                (l.weights, t * k * 4),
                (l.pos, t * k * 4),
                (l.list, 2 * e * t * 4),
                (l.xstage, 2 * peers * t * h * pay),
                (l.xscales, 2 * xscales),
                (l.cbuf, 2 * peers * t * k * h * 2),
                (l.bytes, 0),
            ]);
            assert_parts_in_order(&parts, l.counts, &l);
            assert_eq!(l.list_slot, e * t * 4);
            assert_eq!(l.list_at(2, 0), l.list);
            assert_eq!(l.list_at(3, 0), l.list + e * t * 4);
            assert_eq!(l.list_at(4, 0), l.list);
            // Expert parts of T entries each: the last expert's ends where the parity does.
            assert_eq!(l.list_at(2, 1), l.list + t * 4);
            assert_eq!(l.list_at(3, e - 1) + t * 4, l.list + 2 * e * t * 4);
        }
    }

    /// docs/moe.md's 1 GiB bound for the low-latency block at 128 tokens x hidden 7168 x top-8
    /// of 256 experts, bf16, default R, at every world up to 8.
    #[test]
    fn the_low_latency_block_fits_one_gib_at_128_tokens_hidden_7168() {
        for w in [1u64, 2, 4, 8] {
            let req = Request {
                tokens: 128,
                hidden: 7168,
                topk: 8,
                experts: 256,
                ..Request::default()
            };
            let l = Layout::new(&req.check(w).unwrap(), w);
            assert!(l.bytes <= 1 << 30, "world {w}: {} bytes", l.bytes);
        }
    }

    #[test]
    fn tags_tell_a_call_from_the_one_two_before_across_the_wrap() {
        for epoch in [
            1u64,
            2,
            3,
            (1 << 32) - 2,
            (1 << 32) - 1,
            1 << 32,
            (1 << 32) + 1,
            (1 << 33) + 5,
        ] {
            for v in [0i32, 1, -1, i32::MAX, i32::MIN] {
                let w = tagged(epoch, v);
                assert!(tag_of(w, epoch), "epoch {epoch} value {v}");
                assert_eq!(untag(w), v);
                // The word a reader may find instead (same parity, two calls older) and the
                // zeroed word of a fresh block are never taken as this call's.
                assert!(!tag_of(tagged(epoch.wrapping_sub(2), v), epoch));
                if epoch & 0xffff_ffff != 0 {
                    assert!(!tag_of(0, epoch));
                }
            }
        }
    }
}

#[cfg(test)]
mod tp_tests {
    use super::super::config::Request;
    use super::*;

    /// docs/moe.md's formula and its 1 GiB bound at 4096 tokens x hidden 7168, 8 ranks, bf16.
    #[test]
    fn the_block_fits_one_gib_at_4096_tokens_hidden_7168_on_8_ranks() {
        let req = Request {
            tokens: 4096,
            hidden: 7168,
            topk: 8,
            experts: 256,
            mode: super::super::config::MODE_THROUGHPUT,
            ..Request::default()
        };
        let c = req.check(8).unwrap();
        let l = TpLayout::new(&c, 8);
        let (w, t, h, k) = (8u64, 4096u64, 7168u64, 8u64);
        // recv_x + cstage + 2 staged x, then the int32 parts (rows x (1 + 3K), 2 T K x 2, T W,
        // 2 W T, MAX_GRID L) and the counts/flags/meta, each part rounded to 256 bytes.
        let formula = 2 * w * t * h * 2 + 2 * t * h * 2;
        let small = w * t * (1 + 3 * k) * 4 + 4 * t * k * 4 + 3 * t * w * 4 + 132 * 32 * 4;
        assert!(l.bytes >= formula + small, "{l:?}");
        assert!(l.bytes <= formula + small + 64 * 1024, "{l:?}");
        assert!(l.bytes <= 1 << 30, "{} bytes", l.bytes);
        // FP8 payloads halve the received and staged rows (the combine stays bf16).
        let fp8 = Request { dtype: 1, ..req }.check(8).unwrap();
        assert!(TpLayout::new(&fp8, 8).bytes < l.bytes - w * t * h / 2);
    }

    #[test]
    fn parts_do_not_overlap_and_are_aligned() {
        // (world, FP8, quantizing, column-major scales)
        let cases = [
            (1u64, false, false, false),
            (2, true, false, false),
            (8, false, false, false),
            (1, true, true, true),
            (2, true, true, false),
            (3, true, false, true),
        ];
        for (w, fp8, quant, col) in cases {
            let req = Request {
                tokens: 5,
                hidden: 256,
                topk: 3,
                experts: 8 * w as u32,
                dtype: fp8 as u32,
                input: quant as u32,
                scale_layout: col as u32,
                mode: super::super::config::MODE_THROUGHPUT,
                ..Request::default()
            };
            let c = req.check(w).unwrap();
            let l = TpLayout::new(&c, w);
            let (t, h, k, rows) = (5u64, 256u64, 3u64, w * 5);
            let (pay, sc) = (if fp8 { 1 } else { 2 }, if fp8 { 2 } else { 0 });
            let peers = (w > 1) as u64;
            let staged = (w > 1 || quant) as u64;
            // Column-major: a column of R4 = rows rounded up to 4 per group.
            let scale_rows = if col { rows.next_multiple_of(4) } else { rows };
            // (offset, bytes) in block order: each part ends before the next begins.
            let parts = [
                (l.counts, 2 * w * tp_row_words(w) * 8),
                (l.flags, TP_FLAG_ROWS * w * 8),
                (l.meta, (2 * 8 + 2) * 4),
                (l.recv_src, rows * 4),
                (l.recv_idx, rows * k * 4),
                (l.recv_weights, rows * k * 4),
                (l.expert_rows, rows * k * 4),
                (l.recv_x, rows * h * pay),
                (l.idx, 2 * t * k * 4),
                (l.weights, 2 * t * k * 4),
                (l.pos, t * w * 4),
                (l.list, 2 * w * t * 4),
                (l.csr, 132 * 8u64.max(w + 1) * 4),
                (l.xstage, 2 * staged * t * h * pay),
                (l.xscales, 2 * staged * t * sc * 4),
                (l.cstage, peers * rows * h * 2),
                (l.bytes, 0),
            ];
            assert_parts_in_order(&parts, l.counts, &l);
            if fp8 {
                let end = l.recv_scales + scale_rows * sc * 4;
                assert!(
                    l.recv_x + rows * h <= l.recv_scales && end <= l.idx,
                    "{l:?}"
                );
                assert_eq!(c.scale_strides()[0], scale_rows * sc);
            }
            assert_eq!(l.block().zeroed_bytes(), l.meta);
        }
    }
}
