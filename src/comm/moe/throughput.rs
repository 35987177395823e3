//! The throughput mode (docs/moe.md, "Throughput mode"): one received row per (token,
//! destination rank), in one contiguous buffer of `W * T` rows ordered by source rank, then
//! token, with each row's top-k restricted to this rank's experts (local ids, -1 elsewhere),
//! the per-expert counts and a CSR of the rows by local expert; the combine takes one row per
//! received row (the caller's weighted sum over this rank's experts) and each token's rank sums
//! them over the destination ranks in increasing rank order in fp32, rounded to bf16 once.
//!
//! This file owns the mode's block layout (`TpLayout`, a pure function of config and world,
//! like layout.rs) and its plans; the CPU protocol is tp_host.rs. There is no CUDA kernel of
//! this mode yet: create refuses the mode on the CUDA backend on every rank (mod.rs), so no
//! plan of it ever reaches a GPU.
//!
//! Invariants: the parts are 256-byte aligned in a fixed order, `ctrl`, `counts` and `flags`
//! first (zeroed at create); the receive buffer holds `W * T` rows, which no routing
//! overflows (a token goes at most once to each rank).

use super::config::{Config, IndexType};
use super::layout::{Layout, CTRL_BYTES, PART_ALIGN, ROW_EXTRA};
use super::status::Refusal;
use super::{tp_host, Combine, Dispatch, Last, Moe};
use crate::comm::collective::Ctx;
use crate::comm::exec;
use crate::error::{Error, Result};

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
    /// `[W*T][H/128]` fp32 (FP8 only; else 0).
    pub recv_scales: u64,
    /// `[2][T][K]` int32 / fp32, per dispatch parity: this rank's routing (peers read it).
    pub idx: u64,
    pub weights: u64,
    /// `[T][W]` int32: the row of this rank's token t at rank d, or -1.
    pub pos: u64,
    /// `[2][W][T]` int32, per dispatch parity: this rank's tokens by destination rank, in
    /// token order (CSR; offsets are prefix sums of its counts row). Peers read it.
    pub list: u64,
    /// `[2][T][H]` payload and `[2][T][H/128]` fp32 (FP8), per dispatch parity: this rank's x.
    pub xstage: u64,
    pub xstage_slot: u64,
    pub xscales: u64,
    pub xscales_slot: u64,
    /// `[W*T][H]` bf16: this rank's combine input rows of peers' tokens (peers read them).
    pub cstage: u64,
    pub bytes: u64,
}

impl TpLayout {
    /// The layout of a checked throughput configuration (config.rs bounds every shape).
    pub fn new(c: &Config, world: u64) -> TpLayout {
        let (t, h, k, e) = (c.tokens, c.hidden, c.topk as u64, c.experts as u64);
        let l = e / world;
        let rows = world * t;
        let sc = c.scales_per_row();
        let mut at = 0u64;
        let mut part = |bytes: u64| {
            let off = at;
            at = (at + bytes).next_multiple_of(PART_ALIGN);
            off
        };
        let _ctrl = part(CTRL_BYTES);
        let counts = part(2 * world * tp_row_words(world) * 8);
        let flags = part(TP_FLAG_ROWS * world * 8);
        let meta = part((2 * l + 2) * 4);
        let recv_src = part(rows * 4);
        let recv_idx = part(rows * k * 4);
        let recv_weights = part(rows * k * 4);
        let expert_rows = part(rows * k * 4);
        let recv_x = part(rows * h * c.dtype.bytes());
        let recv_scales = if sc > 0 { part(rows * sc * 4) } else { 0 };
        let idx = part(2 * t * k * 4);
        let weights = part(2 * t * k * 4);
        let pos = part(t * world * 4);
        let list = part(2 * world * t * 4);
        let peers = world > 1;
        let xstage_slot = if peers { t * h * c.dtype.bytes() } else { 0 };
        let xstage = part(2 * xstage_slot);
        let xscales_slot = if peers { t * sc * 4 } else { 0 };
        let xscales = part(2 * xscales_slot);
        let cstage = part(if peers { rows * h * 2 } else { 0 });
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
            bytes: at,
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

/// The message of a throughput-mode call on an object of the other mode and vice versa.
pub fn wrong_mode(what: &str, m: &Moe) -> Error {
    Error::invalid(format!(
        "{what}: this moe object was created in {} mode; expected {}",
        m.cfg.mode.name(),
        if m.tp.is_some() {
            "symm_moe_tp_layout for a throughput-mode object"
        } else {
            "symm_moe_layout for a low-latency object"
        }
    ))
}

/// Create's check of the mode against where the kernels run: throughput mode has no CUDA
/// kernel yet (module header), so a CUDA communicator refuses it on every rank.
pub fn supported(c: &Config, backend: &str) -> Result<()> {
    if c.mode == super::config::Mode::Throughput && backend != "host" {
        return Err(Error::unsupported(
            "symm_moe_create: mode SYMM_MOE_THROUGHPUT runs on the host backend only in this \
             build (its CUDA kernels are not written yet); expected SYMM_MOE_LOW_LATENCY (0) on \
             GPUs",
        ));
    }
    Ok(())
}

/// The dispatch's plan (host backend: its CPU twin, tp_host.rs).
pub(super) fn dispatch(
    c: &mut Ctx,
    m: &mut Moe,
    a: &Dispatch,
    it: IndexType,
    refusal: Option<&Refusal>,
) -> Result<()> {
    let timeout = c.settings.timeout;
    let mut twin = || tp_host::dispatch(m, a, it, refusal, timeout);
    c.exec.submit(exec::Plan {
        stream: a.stream,
        ordered: true,
        copy_in: None,
        device: exec::Device::Nothing,
        cpu: Some(&mut twin),
        copy_out: None,
    })
}

/// The combine's plan (host backend: its CPU twin, tp_host.rs).
pub(super) fn combine(
    c: &mut Ctx,
    m: &mut Moe,
    a: &Combine,
    last: Last,
    refused: bool,
) -> Result<()> {
    let timeout = c.settings.timeout;
    let mut twin = || {
        if !last.ok {
            return Err(Error::invalid(super::launch::NOTHING_TO_COMBINE));
        }
        tp_host::combine(m, a, last, refused, timeout)
    };
    c.exec.submit(exec::Plan {
        stream: a.stream,
        ordered: true,
        copy_in: None,
        device: exec::Device::Nothing,
        cpu: Some(&mut twin),
        copy_out: None,
    })
}

#[cfg(test)]
mod tests {
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
        // 2 W T) and the counts/flags/meta, each part rounded to 256 bytes.
        let formula = 2 * w * t * h * 2 + 2 * t * h * 2;
        let small = w * t * (1 + 3 * k) * 4 + 4 * t * k * 4 + 3 * t * w * 4;
        assert!(l.bytes >= formula + small, "{l:?}");
        assert!(l.bytes <= formula + small + 64 * 1024, "{l:?}");
        assert!(l.bytes <= 1 << 30, "{} bytes", l.bytes);
        // FP8 payloads halve the received and staged rows (the combine stays bf16).
        let fp8 = Request { dtype: 1, ..req }.check(8).unwrap();
        assert!(TpLayout::new(&fp8, 8).bytes < l.bytes - w * t * h / 2);
    }

    #[test]
    fn parts_do_not_overlap_and_are_aligned() {
        for (w, fp8) in [(1u64, false), (2, true), (8, false)] {
            let req = Request {
                tokens: 5,
                hidden: 256,
                topk: 3,
                experts: 8 * w as u32,
                dtype: fp8 as u32,
                mode: super::super::config::MODE_THROUGHPUT,
                ..Request::default()
            };
            let c = req.check(w).unwrap();
            let l = TpLayout::new(&c, w);
            let (t, h, k, rows) = (5u64, 256u64, 3u64, w * 5);
            let (pay, sc) = (if fp8 { 1 } else { 2 }, if fp8 { 2 } else { 0 });
            let peers = (w > 1) as u64;
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
                (l.xstage, 2 * peers * t * h * pay),
                (l.xscales, 2 * peers * t * sc * 4),
                (l.cstage, peers * rows * h * 2),
                (l.bytes, 0),
            ];
            for p in parts.windows(2) {
                assert!(p[0].0 + p[0].1 <= p[1].0, "{p:?} {l:?}");
            }
            assert!(parts.iter().all(|p| p.0 % PART_ALIGN == 0), "{l:?}");
            assert!(l.counts >= CTRL_BYTES);
            if fp8 {
                assert!(l.recv_x + rows * h <= l.recv_scales && l.recv_scales + rows * 8 <= l.idx);
            }
            assert_eq!(l.block().zeroed_bytes(), l.meta);
        }
    }
}
