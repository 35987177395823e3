//! The plans of dispatch and combine: the kernels' names (kernels/moe.cu, looked up once in the
//! executor's kernel cache), the argument struct `MoeArgs` (mirrored field by field with the
//! CUDA source, checked by tests/kernel_table.rs), the plan submitted to the executor
//! (comm/exec/; its CPU twin on the host backend is host.rs), and the host-mapped status words
//! the kernels store a recorded error into (status.rs has the codes). Each call is one launch
//! of the whole call (`Phase::Both`) or of one half of it (the split API: `Phase::Send`, up to
//! and including publishing, and `Phase::Recv`, the wait and the pull or the sum); an object
//! created with the clock probe on launches the kernels' probe instances.
//!
//! Invariants: a launch reads nothing from the device and waits for nothing, so both calls are
//! capturable; the kernels of the object run after the communicator's earlier kernels (the
//! collectives' stream order); a refusing rank still launches (its kernel publishes the refusal
//! and touches none of its caller's buffers); the host reads the status words only at calls,
//! never in a loop.

use super::config::{IndexType, Payload, ScaleLayout};
use super::layout::Layout;
use super::status::{self, Found, Refusal};
use super::{host, host_combine, Combine, Dispatch, Last, Moe, THREADS};
use crate::comm::collective::kernel_args::{SymmArgs, COUNTERS_OFFSET, MAX_RANKS};
use crate::comm::collective::Ctx;
use crate::comm::exec::{self, ArgBlock, Family, KernelId};
use crate::error::{Error, Result};

/// The kernels (kernels/moe.cu): the whole calls (dispatch by payload and index type, then the
/// combine), the send halves of dispatch, the receive halves (by payload only), the combine's
/// halves, the dispatch of bf16 x quantized to FP8 in the kernel (whole, send halves by index
/// type, receive half); then the same `PROBE_OFFSET` kernels again as probe instances.
pub const MOE_KERNELS: [&str; 2 * PROBE_OFFSET] = [
    "symm_moe_dispatch_bf16_i32",
    "symm_moe_dispatch_bf16_i64",
    "symm_moe_dispatch_fp8_i32",
    "symm_moe_dispatch_fp8_i64",
    "symm_moe_combine_bf16",
    "symm_moe_dispatch_send_bf16_i32",
    "symm_moe_dispatch_send_bf16_i64",
    "symm_moe_dispatch_send_fp8_i32",
    "symm_moe_dispatch_send_fp8_i64",
    "symm_moe_dispatch_recv_bf16",
    "symm_moe_dispatch_recv_fp8",
    "symm_moe_combine_send_bf16",
    "symm_moe_combine_recv_bf16",
    "symm_moe_dispatch_bf16_to_fp8_i32",
    "symm_moe_dispatch_bf16_to_fp8_i64",
    "symm_moe_dispatch_send_bf16_to_fp8_i32",
    "symm_moe_dispatch_send_bf16_to_fp8_i64",
    "symm_moe_dispatch_recv_bf16_to_fp8",
    "symm_moe_dispatch_bf16_i32_probe",
    "symm_moe_dispatch_bf16_i64_probe",
    "symm_moe_dispatch_fp8_i32_probe",
    "symm_moe_dispatch_fp8_i64_probe",
    "symm_moe_combine_bf16_probe",
    "symm_moe_dispatch_send_bf16_i32_probe",
    "symm_moe_dispatch_send_bf16_i64_probe",
    "symm_moe_dispatch_send_fp8_i32_probe",
    "symm_moe_dispatch_send_fp8_i64_probe",
    "symm_moe_dispatch_recv_bf16_probe",
    "symm_moe_dispatch_recv_fp8_probe",
    "symm_moe_combine_send_bf16_probe",
    "symm_moe_combine_recv_bf16_probe",
    "symm_moe_dispatch_bf16_to_fp8_i32_probe",
    "symm_moe_dispatch_bf16_to_fp8_i64_probe",
    "symm_moe_dispatch_send_bf16_to_fp8_i32_probe",
    "symm_moe_dispatch_send_bf16_to_fp8_i64_probe",
    "symm_moe_dispatch_recv_bf16_to_fp8_probe",
];

/// Kernels without the probe; `MOE_KERNELS[i + PROBE_OFFSET]` is `MOE_KERNELS[i]`'s probe
/// instance.
pub const PROBE_OFFSET: usize = 18;

/// What one launch runs of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The whole call (`symm_moe_dispatch`, `symm_moe_combine`).
    Both,
    /// The send half: up to and including publishing (no wait on a peer).
    Send,
    /// The receive half: the wait, then the pull (dispatch) or the sum (combine).
    Recv,
}

/// The index in `MOE_KERNELS` of a dispatch launch. `quantize`: x is bf16 and the kernel
/// quantizes it to the FP8 payload (`p` is then `Fp8`).
pub fn dispatch_index(
    p: Payload,
    it: IndexType,
    quantize: bool,
    phase: Phase,
    probe: bool,
) -> usize {
    let pi = match p {
        Payload::Bf16 => 0,
        Payload::Fp8 => 1,
    };
    let ii = match it {
        IndexType::I32 => 0,
        IndexType::I64 => 1,
    };
    let i = match (quantize, phase) {
        (false, Phase::Both) => 2 * pi + ii,
        (false, Phase::Send) => 5 + 2 * pi + ii,
        (false, Phase::Recv) => 9 + pi,
        (true, Phase::Both) => 13 + ii,
        (true, Phase::Send) => 15 + ii,
        (true, Phase::Recv) => 17,
    };
    i + probe as usize * PROBE_OFFSET
}

/// The index in `MOE_KERNELS` of the whole-call dispatch that quantizes bf16 x, for an index
/// type.
pub fn quantize_index(it: IndexType) -> usize {
    dispatch_index(Payload::Fp8, it, true, Phase::Both, false)
}

/// The index in `MOE_KERNELS` of a combine launch.
pub fn combine_index(phase: Phase, probe: bool) -> usize {
    let i = match phase {
        Phase::Both => 4,
        Phase::Send => 11,
        Phase::Recv => 12,
    };
    i + probe as usize * PROBE_OFFSET
}

/// The dispatch kernel's name for a payload and an index type.
pub fn dispatch_kernel(p: Payload, it: IndexType) -> &'static str {
    MOE_KERNELS[dispatch_index(p, it, false, Phase::Both, false)]
}

/// The name of a moe kernel id (its index in `MOE_KERNELS`).
fn kernel_name(id: KernelId) -> Result<String> {
    MOE_KERNELS
        .get(id.key() as usize)
        .map(|n| n.to_string())
        .ok_or_else(|| Error::internal(format!("no moe kernel {:#x}", id.0)))
}

/// The launch of `MOE_KERNELS[index]` with `args` on the object's grid.
fn launch(m: &Moe, index: usize, args: &MoeArgs) -> exec::Launch {
    exec::Launch {
        id: KernelId::new(Family::Moe, index as u64),
        name: kernel_name,
        grid: m.grid,
        block: THREADS,
        cluster: 1,
        shared: 0,
        args: ArgBlock::of(args),
    }
}

/// The argument of the moe kernels (kernels/moe.cu `MoeArgs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MoeArgs {
    pub s: SymmArgs,
    pub blocks: [u64; MAX_RANKS],
    pub x: u64,
    pub x_scales: u64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    pub expert_out: u64,
    pub y: u64,
    pub status: u64,
    pub off_flags: u64,
    pub off_recv_counts: u64,
    pub off_recv_src: u64,
    pub off_recv_x: u64,
    pub off_recv_scales: u64,
    pub off_idx: u64,
    pub off_weights: u64,
    pub off_pos: u64,
    pub off_list: u64,
    pub off_xstage: u64,
    pub off_xscales: u64,
    pub off_cbuf: u64,
    pub max_recv: u64,
    pub num_tokens: u64,
    pub refuse_value: i64,
    /// T and H (config.rs bounds both to 2^20).
    pub max_tokens: u32,
    pub hidden: u32,
    pub k: i32,
    pub topk: i32,
    pub experts: i32,
    pub local: i32,
    pub refuse_code: i32,
    /// `SCALE_MODE_*` bits: UE8M0 scales (the quantizing dispatch), column-major TMA-aligned
    /// `recv_scales` (the kernel derives the strides of config.rs `scale_strides` from R).
    pub scale_mode: i32,
}

const _: () = assert!(std::mem::size_of::<MoeArgs>() == 256 + 64 + 22 * 8 + 8 * 4);

/// `MoeArgs::scale_mode` bits (kernels/moe.cu `MOE_SCALE_*`).
pub const SCALE_MODE_UE8M0: i32 = 1;
pub const SCALE_MODE_COL_TMA: i32 = 2;

/// The host backend's combine after a dispatch that failed (the kernels keep their own word,
/// so only the CPU twin refuses it).
pub(super) const NOTHING_TO_COMBINE: &str =
    "symm_moe_combine: the last dispatch failed (its error \
     said why), so there is nothing to combine; dispatch again";

impl Moe {
    /// The communicator's part of either mode's kernel arguments (timeout, rank, world, the
    /// counters, the error word, the peers' pads).
    pub(super) fn symm_args(&self, c: &Ctx) -> SymmArgs {
        let mut s = SymmArgs {
            timeout_ns: c.settings.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: self.rank as i32,
            world: self.world as i32,
            counters: c.internal + COUNTERS_OFFSET,
            error_word: c.coll.errors.device_ptr(),
            ..SymmArgs::default()
        };
        s.pads[..self.world].copy_from_slice(&c.peer.pads);
        s
    }

    fn args(&self, c: &Ctx, l: &Layout) -> MoeArgs {
        MoeArgs {
            s: self.symm_args(c),
            blocks: self.blocks,
            status: self.status.as_ref().map_or(0, |w| w.device_ptr),
            off_flags: l.flags,
            off_recv_counts: l.recv_counts,
            off_recv_src: l.recv_src,
            off_recv_x: l.recv_x,
            off_recv_scales: l.recv_scales,
            off_idx: l.idx,
            off_weights: l.weights,
            off_pos: l.pos,
            off_list: l.list,
            off_xstage: l.xstage,
            off_xscales: l.xscales,
            off_cbuf: l.cbuf,
            max_tokens: self.cfg.tokens as u32,
            hidden: self.cfg.hidden as u32,
            max_recv: self.cfg.max_recv,
            topk: self.cfg.topk as i32,
            experts: self.cfg.experts as i32,
            local: self.cfg.local_experts(self.world as u64) as i32,
            scale_mode: self.scale_mode(),
            ..MoeArgs::default()
        }
    }

    /// Both modes' `scale_mode` argument (`SCALE_MODE_*` bits).
    pub(super) fn scale_mode(&self) -> i32 {
        (if self.cfg.ue8m0 { SCALE_MODE_UE8M0 } else { 0 })
            | match self.cfg.scales {
                ScaleLayout::RowMajor => 0,
                ScaleLayout::ColTma => SCALE_MODE_COL_TMA,
            }
    }

    /// The error the kernels recorded since the last call (cleared: reported once).
    pub fn take_status(&mut self) -> Option<Error> {
        let w = self.status.as_ref()?;
        // SAFETY: w.host is a live pinned allocation of 16 words; volatile because the GPU
        // writes it.
        let rd = |i: usize| unsafe { std::ptr::read_volatile(w.host.add(i)) };
        let code = rd(status::SW_CODE);
        if code == 0 {
            return None;
        }
        let f = Found {
            code,
            rank: rd(status::SW_RANK),
            token: rd(status::SW_TOKEN),
            k: rd(status::SW_K),
            value: rd(status::SW_VALUE) as i64 | ((rd(status::SW_VALUE + 1) as i64) << 32),
        };
        // SAFETY: as above; the host clears the code it reported.
        unsafe { std::ptr::write_volatile(w.host.add(status::SW_CODE), 0) };
        Some(f.error(&self.bounds()))
    }
}

/// The dispatch's plan (`phase`: the whole call or one half), submitted in a begun call (`c`).
/// The receive half takes the same arguments as its send half.
pub(super) fn dispatch(
    c: &mut Ctx,
    m: &mut Moe,
    a: &Dispatch,
    it: IndexType,
    refusal: Option<&Refusal>,
    phase: Phase,
) -> Result<()> {
    let mut args = m.args(c, &m.layout);
    match refusal {
        Some(r) => {
            args.refuse_code = r.code as i32;
            args.refuse_value = r.value;
            args.k = 1;
        }
        None => {
            args.x = a.x;
            args.x_scales = a.x_scales;
            args.topk_idx = a.idx;
            args.topk_weights = a.weights;
            args.num_tokens = a.tokens;
            args.k = a.k as i32;
        }
    }
    let i = dispatch_index(m.cfg.dtype, it, m.cfg.quantize, phase, m.cfg.probe);
    let l = launch(m, i, &args);
    let timeout = c.settings.timeout;
    let mut twin = || match phase {
        Phase::Both => host::dispatch(m, a, it, refusal, timeout),
        Phase::Send => {
            host::dispatch_send(m, a, it, refusal);
            Ok(())
        }
        Phase::Recv => host::dispatch_recv(m, a, refusal.is_some(), timeout),
    };
    c.exec.submit(exec::Plan::work(
        a.stream,
        true,
        exec::Device::Kernel(l),
        &mut twin,
    ))
}

/// The combine's plan (`phase`: the whole call or one half), submitted in a begun call (`c`).
pub(super) fn combine(
    c: &mut Ctx,
    m: &mut Moe,
    a: &Combine,
    last: Last,
    refused: bool,
    phase: Phase,
) -> Result<()> {
    let mut args = m.args(c, &m.layout);
    args.num_tokens = last.tokens;
    args.k = last.k as i32;
    if refused {
        args.refuse_code = status::ST_COMBINE_REFUSED as i32;
    } else {
        args.expert_out = a.expert_out;
        args.y = a.y;
    }
    let l = launch(m, combine_index(phase, m.cfg.probe), &args);
    let timeout = c.settings.timeout;
    let mut twin = || {
        if !last.ok {
            return Err(Error::invalid(NOTHING_TO_COMBINE));
        }
        match phase {
            Phase::Both => host_combine::combine(m, a, last, refused, timeout),
            Phase::Send => {
                host_combine::combine_send(m, a, refused);
                Ok(())
            }
            Phase::Recv => host_combine::combine_recv(m, a, last, refused, timeout),
        }
    };
    c.exec.submit(exec::Plan::work(
        a.stream,
        true,
        exec::Device::Kernel(l),
        &mut twin,
    ))
}
