//! The second half of every collective call: `launch` turns a `Plan` (plan.rs) into the
//! executor's plan (comm/exec/) and submits it: the copy into the scratch, the kernel (its
//! `KernelId`, `kernel_id`, and its name in the module, `kernel_id_name`) with its argument
//! struct (`SymmArgs`, or the fused call's `RmsArgs`) on the plan's grid, the copy out, ordered
//! after the communicator's previous call; and the CPU twin the host backend runs instead
//! (host_reduce.rs). Also the call descriptor the plan carries (`CallDesc`, below) and its
//! digest.
//!
//! Invariants: a plan's kernel and grid are the same on every rank (plan.rs), so block b meets
//! block b; kernels of one communicator are ordered (exec/gpu.rs, `StreamOrder`), whatever
//! streams carry them; distinct kernel instances have distinct ids, and an id names exactly the
//! instance `kernels::kernel_name` / `quant_kernel_name` name for its parts; the argument
//! structs are built here only, from views of the communicator (its peers' bases and pads, its
//! group's internal block, its settings, its error words).

use super::algo::{DType, Kernel, Quant, ReduceOp};
use super::call::{Call, Coll};
use super::host_reduce::{self, HostCall, HostRms, DIGEST_SET, DIGEST_SHARING, DIGEST_STAGED};
use super::kernel_args::*;
use super::kernels;
use super::{CollSettings, Collectives, Ctx};
use crate::comm::exec::{self, ArgBlock, Family, KernelId};
use crate::error::{Error, Result, Status};

/// Everything a launch needs, decided once (plan.rs, `prepare`).
pub(in crate::comm) struct Plan {
    pub call: Call,
    pub kernel: Kernel,
    /// The working buffers' offsets (the caller's, or the scratch's when staged).
    /// What the ranks agreed on; its digest (`CallDesc::digest`, below) is what the kernels
    /// compare, worked out here when the arguments are made.
    pub desc: CallDesc,
    pub vec: bool,
    pub grid: u32,
    pub threads: u32,
    /// Blocks per thread-block cluster (the fused cluster kernel), 1 otherwise.
    pub cluster: u32,
    /// The fused LL kernels: threads per block that push x (the LL all-reduce's spread).
    pub push_threads: u32,
    pub stage_in: Option<exec::Copy>,
    pub stage_out: Option<exec::Copy>,
    /// The output's multicast address (MULTIMEM only).
    pub mc_out: u64,
}

impl Ctx<'_> {
    /// Submits the plan on its call's stream (runs it, on the host backend).
    pub(in crate::comm) fn launch(&mut self, plan: &Plan) -> Result<()> {
        self.trace_plan(plan);
        let (inputs, outputs) = buffers(&self.peer.windows.bases, &plan.desc);
        let view = View {
            rank: self.rank,
            world: self.world,
            settings: self.settings,
            pads: &self.peer.pads,
            internal: self.internal,
        };
        let launch = kernel_launch(plan, &view, self.coll, inputs, outputs);
        let coll = &mut *self.coll;
        let mut twin = || host_twin(plan, &view, coll, &inputs, &outputs);
        // A staged call was counted in `staged_collectives` as its scratch was located
        // (place.rs, one hold of the heap's lock).
        self.exec.submit(exec::Plan {
            stream: plan.call.stream,
            ordered: true,
            copy_in: plan.stage_in,
            device: exec::Device::Kernel(launch),
            cpu: Some(&mut twin),
            copy_out: plan.stage_out,
        })
    }

    /// The TRACE line of one collective call (formats nothing unless SYMMALLOC_DEBUG=TRACE).
    fn trace_plan(&self, p: &Plan) {
        let off = |o: u64| match o {
            RANK_LOCAL => "-".to_string(),
            o => format!("+{o:#x}"),
        };
        crate::trace!(
            "rank {}/{}: {} {} {} x {} {} send {} recv {}{} stream {:#x}{}",
            self.rank,
            self.world,
            p.call.name(),
            p.kernel.name(),
            p.call.count,
            p.call.dtype.name(),
            p.call.op.name(),
            off(p.desc.send_off),
            off(p.desc.recv_off),
            if p.grid > 0 {
                format!(" grid {}x{}", p.grid, p.threads)
            } else {
                String::new()
            },
            p.call.stream,
            if p.stage_in.is_some() {
                " (staged)"
            } else {
                ""
            }
        );
    }
}

/// What a collective's launch reads of its communicator.
struct View<'a> {
    rank: usize,
    world: usize,
    settings: &'a CollSettings,
    /// Every rank's signal pad here.
    pads: &'a [u64],
    /// The internal block (call counters, epochs).
    internal: u64,
}

/// The kernel, with `SymmArgs` (or the fused call's `RmsArgs`) on the plan's grid.
fn kernel_launch(
    plan: &Plan,
    v: &View,
    coll: &Collectives,
    inputs: [u64; MAX_RANKS],
    outputs: [u64; MAX_RANKS],
) -> exec::Launch {
    let mut s = SymmArgs {
        inputs,
        outputs,
        count: plan.desc.count,
        desc: plan.desc.digest(),
        timeout_ns: v.settings.timeout.as_nanos() as u64,
        rank: v.rank as i32,
        world: v.world as i32,
        counters: v.internal + COUNTERS_OFFSET,
        error_word: coll.error_word,
        ll_slot_kib: (v.settings.ll_slot >> 10) as i32,
        mc_out: plan.mc_out,
        ..SymmArgs::default()
    };
    s.pads[..v.world].copy_from_slice(v.pads);
    s.in_place = (plan.desc.send_off == plan.desc.recv_off) as i32;
    let (id, args) = match plan.call.coll {
        Coll::AddRmsNorm(r) => (
            fused_kernel_id(plan.kernel, plan.call.dtype, r.quant.map(|q| q.mode)),
            ArgBlock::of(&RmsArgs {
                s,
                residual: r.residual,
                weight: r.weight,
                out: r.out,
                hidden: r.hidden,
                tokens: r.tokens,
                eps: r.eps,
                push_threads: plan.push_threads,
                scale: r.quant.map_or(0, |q| q.scale),
            }),
        ),
        _ => (
            kernel_id(plan.kernel, plan.call.dtype, plan.call.op, plan.vec),
            ArgBlock::of(&s),
        ),
    };
    exec::Launch {
        id,
        name: kernel_id_name,
        grid: plan.grid,
        block: plan.threads,
        cluster: plan.cluster,
        shared: 0,
        args,
    }
}

/// The CPU collective (host backend); a timeout leaves the communicator broken (`sticky`).
fn host_twin(
    plan: &Plan,
    v: &View,
    coll: &mut Collectives,
    inputs: &[u64; MAX_RANKS],
    outputs: &[u64; MAX_RANKS],
) -> Result<()> {
    let rms = match plan.call.coll {
        Coll::AddRmsNorm(r) => Some(HostRms {
            residual: r.residual,
            weight: r.weight,
            out: r.out,
            hidden: r.hidden as usize,
            eps: r.eps,
            quant: r.quant.map(|q| (q.mode, q.scale)),
        }),
        _ => None,
    };
    let call = HostCall {
        rank: v.rank,
        world: v.world,
        pads: v.pads,
        inputs: &inputs[..v.world],
        outputs: &outputs[..v.world],
        count: plan.desc.count as usize,
        dtype: plan.call.dtype,
        op: plan.call.op,
        kernel: plan.kernel,
        in_place: plan.desc.send_off == plan.desc.recv_off,
        desc: plan.desc.digest(),
        timeout: v.settings.timeout,
        rms,
    };
    let r = host_reduce::run(&call, &mut coll.host_epoch);
    if let Err(e) = &r {
        if e.status == Status::ErrTimeout {
            coll.sticky = Some(e.clone());
        }
    }
    r
}

/// Every rank's input and output at the descriptor's offsets, in this address space
/// (entries past the world, and rank-local outputs, stay 0).
fn buffers(bases: &[u64], desc: &CallDesc) -> ([u64; MAX_RANKS], [u64; MAX_RANKS]) {
    let (mut inputs, mut outputs) = ([0u64; MAX_RANKS], [0u64; MAX_RANKS]);
    for (r, b) in bases.iter().enumerate() {
        inputs[r] = b + desc.send_off;
        if desc.recv_off != RANK_LOCAL {
            outputs[r] = b + desc.recv_off;
        }
    }
    (inputs, outputs)
}

// The collectives' kernels as the executor knows them (comm/exec/): an id per instance (kernel,
// type, op, vector width; or the fused call's FP8-output instance), packed into `KernelId`, and
// its name in the module (kernels.rs), asked only on the instance's first launch (tested below).

const KERNELS: [Kernel; 11] = [
    Kernel::OneShot,
    Kernel::OneShotLL,
    Kernel::TwoShot,
    Kernel::Multimem,
    Kernel::ReduceScatter,
    Kernel::ReduceScatterLL,
    Kernel::AllGather,
    Kernel::AddRmsNorm,
    Kernel::AddRmsNormLL,
    Kernel::AddRmsNormLL1,
    Kernel::AddRmsNormLLC,
];
const DTYPES: [DType; 3] = [DType::Bf16, DType::Fp16, DType::Fp32];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];
const QUANTS: [Quant; 3] = [Quant::Static, Quant::PerToken, Quant::PerGroup128];

/// The id of the instance (kernel, type, op, vector width) (`kernels::kernel_name`).
pub(in crate::comm) fn kernel_id(
    kernel: Kernel,
    dtype: DType,
    op: ReduceOp,
    vec: bool,
) -> KernelId {
    let key = (kernel as u64) << 16 | (dtype as u64) << 8 | (op as u64) << 4 | vec as u64;
    KernelId::new(Family::Collective, key)
}

/// The id of a fused kernel's instance: its bf16/fp16-output one (`kernel_id`), or its FP8 one
/// of `quant`'s mode (`kernels::quant_kernel_name`).
pub(in crate::comm) fn fused_kernel_id(
    kernel: Kernel,
    dtype: DType,
    quant: Option<Quant>,
) -> KernelId {
    match quant {
        None => kernel_id(kernel, dtype, ReduceOp::Sum, true),
        Some(q) => KernelId::new(
            Family::CollectiveFp8,
            (kernel as u64) << 16 | (dtype as u64) << 8 | q as u64,
        ),
    }
}

/// The name of a collective kernel id, or why the module has no such instance.
pub(in crate::comm) fn kernel_id_name(id: KernelId) -> Result<String> {
    let k = id.key();
    let kernel = KERNELS[(k >> 16) as usize & 0xff];
    let dtype = DTYPES[(k >> 8) as usize & 0xf];
    if id == KernelId::new(Family::Collective, k) {
        let (op, vec) = (OPS[(k >> 4) as usize & 0xf], k & 1 == 1);
        return kernels::kernel_name(kernel, dtype, op, vec).ok_or_else(|| {
            Error::unsupported(format!(
                "no {} kernel for {} {}",
                kernel.name(),
                dtype.name(),
                op.name()
            ))
        });
    }
    let q = QUANTS[k as usize & 0xf];
    kernels::quant_kernel_name(kernel, dtype, q).ok_or_else(|| {
        Error::unsupported(format!(
            "no {} kernel with {} output for {}",
            kernel.name(),
            q.name(),
            dtype.name()
        ))
    })
}

// The call descriptor: what every rank must agree on for one collective call (`CallDesc`,
// typed; plan.rs fills it in), its words on the wire (the segment exchange sends them,
// exchange.rs) and its 64-bit digest (what the kernels and the host barriers compare, made into
// the arguments above), with the bits that say what differs when two ranks' words do
// (host_reduce.rs: `mismatch`, `meeting_word`). It lives beside the plan that carries
// it, so a steady call works its digest out where it makes the arguments.
//
// Invariants: a digest is never 0 and never a meeting's word (`DIGEST_SHARING` is set only in
// the latter); offsets that only their own rank uses are `RANK_LOCAL` in the words, so ranks
// never compare them.

/// Which exchange a descriptor belongs to (its tag word).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::comm) enum DescKind {
    Init,
    Barrier,
    AllReduce,
    ReduceScatter,
    AllGather,
    AddRmsNorm,
    /// `symm_rendezvous` (comm/p2p/): send offset = the range's offset, count = its bytes.
    Rendezvous,
}

/// Everything ranks must agree on for one collective call, typed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::comm) struct CallDesc {
    pub kind: DescKind,
    /// The kernel the call runs (ranks that chose differently fail the comparison).
    pub kernel: Kernel,
    pub send_off: u64,
    pub recv_off: u64,
    /// Elements, as the call counts them (call.rs).
    pub count: u64,
    pub dtype: DType,
    pub op: ReduceOp,
    /// The fused call's row width (hidden) and, from bit 32, its output format (plan.rs); 0
    /// otherwise.
    pub width: u64,
    /// This rank runs the call on its scratch (a buffer peers touch is outside the heap:
    /// plan.rs, `place`). Ranks must agree: a peer reads the scratch at the offsets only where
    /// every rank staged.
    pub staged: bool,
}

/// Stands for an offset that only its own rank uses, so ranks need not agree on it.
pub(in crate::comm) const RANK_LOCAL: u64 = u64::MAX - 1;

/// Words of a descriptor on the wire (exchange messages start with them).
pub(super) const DESC_WORDS: usize = 7;

/// Bit of the descriptor's first word (above the kind) that says the rank staged.
pub(super) const WORD_STAGED: u64 = 1 << 8;

impl CallDesc {
    /// What every rank must agree on, as words. Reduce-scatter and the fused call write only
    /// the caller's own output, and all-gather reads only the caller's own `send` (in place,
    /// those offsets differ by rank by design), so those are left out (RANK_LOCAL).
    pub fn words(&self) -> [u64; DESC_WORDS] {
        let (send, recv) = match self.kind {
            DescKind::ReduceScatter | DescKind::AddRmsNorm => (self.send_off, RANK_LOCAL),
            DescKind::AllGather => (RANK_LOCAL, self.recv_off),
            _ => (self.send_off, self.recv_off),
        };
        [
            self.kind as u64 | if self.staged { WORD_STAGED } else { 0 },
            self.kernel as u64,
            send,
            recv,
            self.count,
            (self.dtype as u64) << 8 | self.op as u64,
            self.width,
        ]
    }
    /// A 64-bit digest the kernels compare (at their first barrier, or in the LL check): a hash
    /// of the words, with the low bits as `mismatch` reads them.
    pub fn digest(&self) -> u64 {
        let mut x: u64 = 0xcbf29ce484222325;
        for w in self.words() {
            for b in w.to_le_bytes() {
                x ^= b as u64;
                x = x.wrapping_mul(0x100000001b3);
            }
        }
        let staged = if self.staged { DIGEST_STAGED } else { 0 };
        x & !(DIGEST_STAGED | DIGEST_SHARING) | DIGEST_SET | staged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_id_names_its_instance() {
        for &k in &KERNELS {
            for &d in &DTYPES {
                for &op in &OPS {
                    for vec in [false, true] {
                        let id = kernel_id(k, d, op, vec);
                        match kernels::kernel_name(k, d, op, vec) {
                            Some(n) => assert_eq!(kernel_id_name(id).unwrap(), n),
                            None => assert!(kernel_id_name(id).is_err()),
                        }
                    }
                }
                for &q in &QUANTS {
                    let id = fused_kernel_id(k, d, Some(q));
                    match kernels::quant_kernel_name(k, d, q) {
                        Some(n) => assert_eq!(kernel_id_name(id).unwrap(), n),
                        None => assert!(kernel_id_name(id).is_err()),
                    }
                }
            }
        }
    }

    #[test]
    fn kernel_ids_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for &k in &KERNELS {
            for &d in &DTYPES {
                for &op in &OPS {
                    for vec in [false, true] {
                        assert!(seen.insert(kernel_id(k, d, op, vec)));
                    }
                }
                for &q in &QUANTS {
                    assert!(seen.insert(fused_kernel_id(k, d, Some(q))));
                }
            }
        }
    }
}
