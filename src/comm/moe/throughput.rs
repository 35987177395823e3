//! The throughput mode (docs/moe.md, "Throughput mode"): one received row per (token,
//! destination rank), in one contiguous buffer of `W * T` rows ordered by source rank, then
//! token, with each row's top-k restricted to this rank's experts (local ids, -1 elsewhere),
//! the per-expert counts and a CSR of the rows by local expert; the combine takes one row per
//! received row (the caller's weighted sum over this rank's experts) and each token's rank sums
//! them over the destination ranks in increasing rank order in fp32, rounded to bf16 once.
//!
//! This file owns the mode's kernels' names and argument struct (`MoeTpArgs`, mirrored field by
//! field with kernels/moe_tp.cu) and its plans; its block layout is layout.rs's `TpLayout`, the
//! CPU protocol tp_host.rs.
//!
//! Invariants: the receive buffer holds `W * T` rows, which no routing overflows (a token goes
//! at most once to each rank); the arguments name the layout's parts and nothing else.

use super::config::{IndexType, Payload};
use super::launch::Phase;
use super::layout::{TpLayout, CTRL_PROBE, ROW_EXTRA};
use super::status::{self, Refusal};
use super::{tp_host, Combine, Dispatch, Last, Moe, THREADS};
use crate::comm::collective::kernel_args::{SymmArgs, MAX_RANKS};
use crate::comm::collective::Ctx;
use crate::comm::exec::{self, ArgBlock, Family, KernelId};
use crate::error::{Error, Result};

/// The kernels (kernels/moe_tp.cu): the whole calls (dispatch by payload and index type, then
/// the combine), the send halves of dispatch (by payload and index type), the receive halves
/// (by payload), the combine's halves; then the same `TP_PROBE_OFFSET` kernels as probe
/// instances (an object created with the clock probe on). `fp8q`: bf16 `x` quantized to the FP8
/// payload in the dispatch. Their ids are `Family::Moe` keys from `TP_KEY_BASE` (the low-latency
/// kernels use the keys below it: launch.rs `MOE_KERNELS`' indices).
pub const TP_KERNELS: [&str; 2 * TP_PROBE_OFFSET] = [
    "symm_moe_tp_dispatch_bf16_i32",
    "symm_moe_tp_dispatch_bf16_i64",
    "symm_moe_tp_dispatch_fp8_i32",
    "symm_moe_tp_dispatch_fp8_i64",
    "symm_moe_tp_dispatch_fp8q_i32",
    "symm_moe_tp_dispatch_fp8q_i64",
    "symm_moe_tp_combine_bf16",
    "symm_moe_tp_dispatch_send_bf16_i32",
    "symm_moe_tp_dispatch_send_bf16_i64",
    "symm_moe_tp_dispatch_send_fp8_i32",
    "symm_moe_tp_dispatch_send_fp8_i64",
    "symm_moe_tp_dispatch_send_fp8q_i32",
    "symm_moe_tp_dispatch_send_fp8q_i64",
    "symm_moe_tp_dispatch_recv_bf16",
    "symm_moe_tp_dispatch_recv_fp8",
    "symm_moe_tp_dispatch_recv_fp8q",
    "symm_moe_tp_combine_send_bf16",
    "symm_moe_tp_combine_recv_bf16",
    "symm_moe_tp_dispatch_bf16_i32_probe",
    "symm_moe_tp_dispatch_bf16_i64_probe",
    "symm_moe_tp_dispatch_fp8_i32_probe",
    "symm_moe_tp_dispatch_fp8_i64_probe",
    "symm_moe_tp_dispatch_fp8q_i32_probe",
    "symm_moe_tp_dispatch_fp8q_i64_probe",
    "symm_moe_tp_combine_bf16_probe",
    "symm_moe_tp_dispatch_send_bf16_i32_probe",
    "symm_moe_tp_dispatch_send_bf16_i64_probe",
    "symm_moe_tp_dispatch_send_fp8_i32_probe",
    "symm_moe_tp_dispatch_send_fp8_i64_probe",
    "symm_moe_tp_dispatch_send_fp8q_i32_probe",
    "symm_moe_tp_dispatch_send_fp8q_i64_probe",
    "symm_moe_tp_dispatch_recv_bf16_probe",
    "symm_moe_tp_dispatch_recv_fp8_probe",
    "symm_moe_tp_dispatch_recv_fp8q_probe",
    "symm_moe_tp_combine_send_bf16_probe",
    "symm_moe_tp_combine_recv_bf16_probe",
];
pub const TP_PROBE_OFFSET: usize = 18;

/// The index in `TP_KERNELS` (without the probe) of a dispatch launch: payload (`quantize`: bf16
/// x quantized to the FP8 payload), index type, phase.
pub fn tp_dispatch_index(p: Payload, quantize: bool, it: IndexType, phase: Phase) -> usize {
    let pi = match (p, quantize) {
        (Payload::Bf16, _) => 0,
        (Payload::Fp8, false) => 1,
        (Payload::Fp8, true) => 2,
    };
    let ii = match it {
        IndexType::I32 => 0,
        IndexType::I64 => 1,
    };
    match phase {
        Phase::Both => 2 * pi + ii,
        Phase::Send => 7 + 2 * pi + ii,
        Phase::Recv => 13 + pi,
    }
}

/// The index in `TP_KERNELS` (without the probe) of a combine launch.
pub fn tp_combine_index(phase: Phase) -> usize {
    match phase {
        Phase::Both => 6,
        Phase::Send => 16,
        Phase::Recv => 17,
    }
}
pub const TP_KEY_BASE: u64 = 64;
const _: () = assert!(super::launch::MOE_KERNELS.len() as u64 <= TP_KEY_BASE);
/// Control words (u64 indices in the block's ctrl part) besides layout.rs `CTRL_*`: the first
/// combine epoch of the last dispatch, and where block 0 leaves this rank's counts row for the
/// publishing block (W counts, then ROW_EXTRA status words; kernels/moe_tp.cu).
pub const CTRL_TP_FIRST: u64 = 7;
/// The count of the dispatch's grid barriers, the routing's and the CSR's one (two on grids
/// above 48 blocks, kernels/moe_tp.cu `MOE_TP_CSR_DIRECT_G`; `tp_grid_sync`).
pub const CTRL_TP_SYNC: u64 = 8;
pub const CTRL_TP_ROW: u64 = 16;
const _: () = assert!(CTRL_TP_ROW + MAX_RANKS as u64 + ROW_EXTRA <= CTRL_PROBE);

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
    /// `[MAX_GRID][L]` int32: the grid CSR's counts per block, then their prefixes.
    pub off_csr: u64,
    pub num_tokens: u64,
    pub refuse_value: i64,
    pub max_tokens: u32,
    pub hidden: u32,
    pub k: i32,
    pub topk: i32,
    pub experts: i32,
    pub local: i32,
    pub refuse_code: i32,
    /// launch.rs `SCALE_MODE_*` bits: UE8M0 scales (quantizing), column-major `recv_scales`
    /// (the kernel derives config.rs `scale_strides` from `W * T`).
    pub scale_mode: i32,
}

const _: () = assert!(std::mem::size_of::<MoeTpArgs>() == 256 + 64 + 23 * 8 + 8 * 4);

fn tp_args(c: &Ctx, m: &Moe, t: &TpLayout) -> MoeTpArgs {
    MoeTpArgs {
        s: m.symm_args(c),
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
        off_csr: t.csr,
        max_tokens: m.cfg.tokens as u32,
        hidden: m.cfg.hidden as u32,
        topk: m.cfg.topk as i32,
        experts: m.cfg.experts as i32,
        local: m.cfg.local_experts(m.world as u64) as i32,
        scale_mode: m.scale_mode(),
        ..MoeTpArgs::default()
    }
}

/// The launch of `TP_KERNELS[index]` (its probe instance on an object with the probe on).
fn tp_launch(m: &Moe, index: usize, args: &MoeTpArgs) -> exec::Launch {
    let index = index + m.cfg.probe as usize * TP_PROBE_OFFSET;
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

/// The dispatch's plan (`phase`: the whole call or one half; the kernel, on the host backend
/// its CPU twin, tp_host.rs). The receive half takes the same arguments as its send half.
pub(super) fn dispatch(
    c: &mut Ctx,
    m: &mut Moe,
    a: &Dispatch,
    it: IndexType,
    refusal: Option<&Refusal>,
    phase: Phase,
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
    let i = tp_dispatch_index(m.cfg.dtype, m.cfg.quantize, it, phase);
    let l = tp_launch(m, i, &args);
    let timeout = c.settings.timeout;
    let mut twin = || match phase {
        Phase::Both => tp_host::dispatch(m, a, it, refusal, timeout),
        Phase::Send => {
            tp_host::dispatch_send(m, a, it, refusal);
            Ok(())
        }
        Phase::Recv => tp_host::dispatch_recv(m, a, refusal.is_some(), timeout),
    };
    c.exec.submit(exec::Plan::work(
        a.stream,
        true,
        exec::Device::Kernel(l),
        &mut twin,
    ))
}

/// The combine's plan (`phase`: the whole call or one half; the kernel, on the host backend its
/// CPU twin, tp_host.rs).
pub(super) fn combine(
    c: &mut Ctx,
    m: &mut Moe,
    a: &Combine,
    last: Last,
    refused: bool,
    phase: Phase,
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
    let l = tp_launch(m, tp_combine_index(phase), &args);
    let timeout = c.settings.timeout;
    let mut twin = || {
        if !last.ok {
            return Err(Error::invalid(super::launch::NOTHING_TO_COMBINE));
        }
        match phase {
            Phase::Both => tp_host::combine(m, a, last, refused, timeout),
            Phase::Send => tp_host::combine_send(m, a, refused, timeout),
            Phase::Recv => tp_host::combine_recv(m, a, last, refused, timeout),
        }
    };
    c.exec.submit(exec::Plan::work(
        a.stream,
        true,
        exec::Device::Kernel(l),
        &mut twin,
    ))
}
