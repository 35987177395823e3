//! The throughput mode (docs/moe.md, "Throughput mode"): one received row per (token,
//! destination rank), in one contiguous buffer of `W * T` rows ordered by source rank, then
//! token, with each row's top-k restricted to this rank's experts (local ids, -1 elsewhere),
//! the per-expert counts and a CSR of the rows by local expert; the combine takes one row per
//! received row (the caller's weighted sum over this rank's experts) and each token's rank sums
//! them over the destination ranks in increasing rank order in fp32, rounded to bf16 once.
//!
//! This file owns the mode's block layout (`TpLayout`, a pure function of config and world,
//! like layout.rs), its kernels' names and argument struct (`MoeTpArgs`, mirrored field by field
//! with kernels/moe_tp.cu) and its plans; the CPU protocol is tp_host.rs.
//!
//! Invariants: the parts are 256-byte aligned in a fixed order, `ctrl`, `counts` and `flags`
//! first (zeroed at create); the receive buffer holds `W * T` rows, which no routing
//! overflows (a token goes at most once to each rank).

use super::config::{Config, IndexType, Payload};
use super::layout::{Layout, CTRL_BYTES, PART_ALIGN, ROW_EXTRA};
use super::status::{self, Refusal};
use super::{tp_host, Combine, Dispatch, Last, Moe, THREADS};
use crate::comm::collective::kernel_args::{SymmArgs, COUNTERS_OFFSET, MAX_RANKS};
use crate::comm::collective::Ctx;
use crate::comm::exec::{self, ArgBlock, Family, KernelId};
use crate::error::{Error, Result};

/// The kernels (kernels/moe_tp.cu), by payload and index type, then the combine; their ids are
/// `Family::Moe` keys from `TP_KEY_BASE` (the low-latency kernels use the keys below it:
/// launch.rs `MOE_KERNELS`' indices).
pub const TP_KERNELS: [&str; 5] = [
    "symm_moe_tp_dispatch_bf16_i32",
    "symm_moe_tp_dispatch_bf16_i64",
    "symm_moe_tp_dispatch_fp8_i32",
    "symm_moe_tp_dispatch_fp8_i64",
    "symm_moe_tp_combine_bf16",
];
pub const TP_KEY_BASE: u64 = 64;
const _: () = assert!(super::launch::MOE_KERNELS.len() as u64 <= TP_KEY_BASE);
/// Control words (u64 indices in the block's ctrl part) besides layout.rs `CTRL_*`: the first
/// combine epoch of the last dispatch, and where block 0 leaves this rank's counts row for the
/// publishing block (W counts, then ROW_EXTRA status words; kernels/moe_tp.cu).
pub const CTRL_TP_FIRST: u64 = 7;
pub const CTRL_TP_ROW: u64 = 16;
const _: () = assert!((CTRL_TP_ROW + MAX_RANKS as u64 + ROW_EXTRA) * 8 <= CTRL_BYTES);

fn tp_kernel_name(id: KernelId) -> Result<String> {
    id.key()
        .checked_sub(TP_KEY_BASE)
        .and_then(|i| TP_KERNELS.get(i as usize))
        .map(|n| n.to_string())
        .ok_or_else(|| Error::internal(format!("no throughput moe kernel {:#x}", id.0)))
}

/// The argument of the throughput kernels (kernels/moe_tp.cu `MoeTpArgs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MoeTpArgs {
    pub s: SymmArgs,
    pub blocks: [u64; MAX_RANKS],
    /// Dispatch: x; combine: expert_out.
    pub x_or_expert_out: u64,
    pub x_scales: u64,
    pub topk_idx: u64,
    /// Dispatch: topk_weights; combine: y.
    pub weights_or_y: u64,
    pub status: u64,
    pub off_flags: u64,
    pub off_meta: u64,
    pub off_recv_src: u64,
    pub off_recv_idx: u64,
    pub off_recv_weights: u64,
    pub off_expert_rows: u64,
    pub off_recv_x: u64,
    pub off_recv_scales: u64,
    pub off_idx: u64,
    pub off_weights: u64,
    pub off_pos: u64,
    pub off_list: u64,
    pub off_xstage: u64,
    pub off_xscales: u64,
    pub off_cstage: u64,
    pub num_tokens: u64,
    pub refuse_value: i64,
    pub max_tokens: u32,
    pub hidden: u32,
    pub k: i32,
    pub topk: i32,
    pub experts: i32,
    pub local: i32,
    pub refuse_code: i32,
    pub pad: i32,
}

const _: () = assert!(std::mem::size_of::<MoeTpArgs>() == 256 + 64 + 22 * 8 + 8 * 4);

fn tp_args(c: &Ctx, m: &Moe, t: &TpLayout) -> MoeTpArgs {
    let mut s = SymmArgs {
        timeout_ns: c.settings.timeout.as_nanos().min(u64::MAX as u128) as u64,
        rank: m.rank as i32,
        world: m.world as i32,
        counters: c.internal + COUNTERS_OFFSET,
        error_word: c.coll.errors.device_ptr(),
        ..SymmArgs::default()
    };
    s.pads[..m.world].copy_from_slice(&c.peer.pads);
    MoeTpArgs {
        s,
        blocks: m.blocks,
        status: m.status.as_ref().map_or(0, |w| w.device_ptr),
        off_flags: t.flags,
        off_meta: t.meta,
        off_recv_src: t.recv_src,
        off_recv_idx: t.recv_idx,
        off_recv_weights: t.recv_weights,
        off_expert_rows: t.expert_rows,
        off_recv_x: t.recv_x,
        off_recv_scales: t.recv_scales,
        off_idx: t.idx,
        off_weights: t.weights,
        off_pos: t.pos,
        off_list: t.list,
        off_xstage: t.xstage,
        off_xscales: t.xscales,
        off_cstage: t.cstage,
        max_tokens: m.cfg.tokens as u32,
        hidden: m.cfg.hidden as u32,
        topk: m.cfg.topk as i32,
        experts: m.cfg.experts as i32,
        local: m.cfg.local_experts(m.world as u64) as i32,
        ..MoeTpArgs::default()
    }
}

fn tp_launch(m: &Moe, index: usize, args: &MoeTpArgs) -> exec::Launch {
    exec::Launch {
        id: KernelId::new(Family::Moe, TP_KEY_BASE + index as u64),
        name: tp_kernel_name,
        grid: m.grid,
        block: THREADS,
        cluster: 1,
        shared: 0,
        args: ArgBlock::of(args),
    }
}

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

/// The dispatch's plan (the kernel; host backend: its CPU twin, tp_host.rs).
pub(super) fn dispatch(
    c: &mut Ctx,
    m: &mut Moe,
    a: &Dispatch,
    it: IndexType,
    refusal: Option<&Refusal>,
) -> Result<()> {
    let t = m.tp.expect("a throughput-mode object has its layout");
    let mut args = tp_args(c, m, &t);
    match refusal {
        Some(r) => {
            args.refuse_code = r.code as i32;
            args.refuse_value = r.value;
            args.k = 1;
        }
        None => {
            args.x_or_expert_out = a.x;
            args.x_scales = a.x_scales;
            args.topk_idx = a.idx;
            args.weights_or_y = a.weights;
            args.num_tokens = a.tokens;
            args.k = a.k as i32;
        }
    }
    let i = match (m.cfg.dtype, it) {
        (Payload::Bf16, IndexType::I32) => 0,
        (Payload::Bf16, IndexType::I64) => 1,
        (Payload::Fp8, IndexType::I32) => 2,
        (Payload::Fp8, IndexType::I64) => 3,
    };
    let l = tp_launch(m, i, &args);
    let timeout = c.settings.timeout;
    let mut twin = || tp_host::dispatch(m, a, it, refusal, timeout);
    c.exec.submit(exec::Plan {
        stream: a.stream,
        ordered: true,
        copy_in: None,
        device: exec::Device::Kernel(l),
        cpu: Some(&mut twin),
        copy_out: None,
    })
}

/// The combine's plan (the kernel; host backend: its CPU twin, tp_host.rs).
pub(super) fn combine(
    c: &mut Ctx,
    m: &mut Moe,
    a: &Combine,
    last: Last,
    refused: bool,
) -> Result<()> {
    let t = m.tp.expect("a throughput-mode object has its layout");
    let mut args = tp_args(c, m, &t);
    args.num_tokens = last.tokens;
    args.k = last.k as i32;
    if refused {
        args.refuse_code = status::ST_COMBINE_REFUSED as i32;
    } else {
        args.x_or_expert_out = a.expert_out;
        args.weights_or_y = a.y;
    }
    let l = tp_launch(m, 4, &args);
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
        device: exec::Device::Kernel(l),
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
