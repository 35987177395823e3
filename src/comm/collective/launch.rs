//! The second half of every collective call: `launch` enqueues a `Plan` (plan.rs) on the call's
//! stream: the order after the communicator's previous call, the copy into the scratch, the
//! kernel with its argument struct (or, on the host backend, the CPU collective), the copy out.
//! The one place that launches a collective kernel.
//!
//! Invariants: a plan's kernel and grid are the same on every rank (plan.rs), so block b meets
//! block b; kernels of one communicator are ordered (streams.rs), whatever streams carry them.

use super::algo::{DType, Kernel, Quant, ReduceOp};
use super::call::Coll;
use super::desc::{CallDesc, RANK_LOCAL};
use super::host_reduce::{self, HostCall, HostRms};
use super::kernel_args::*;
use super::kernels;
use super::plan::Plan;
use crate::comm::Communicator;
use crate::cuda;
use crate::error::{Error, Result, Status};

impl Communicator {
    /// Enqueues the plan on its call's stream (runs it, on the host backend).
    pub(super) fn launch(&mut self, plan: &Plan) -> Result<()> {
        let stream = plan.call.stream;
        // Before the call's first work on the stream: the staged copy uses the scratch.
        self.order_streams(stream)?;
        if let Some(c) = plan.stage_in {
            self.stage_in(c.dst, c.src, c.bytes, stream)?;
        }
        self.trace_plan(plan);
        if self.host {
            self.run_host(plan)?;
        } else {
            self.run_kernel(plan)?;
        }
        if let Some(c) = plan.stage_out {
            self.copy(c.dst, c.src, c.bytes, stream)?;
        }
        Ok(())
    }

    /// The CPU collective (host backend); a timeout leaves the communicator broken (`sticky`).
    fn run_host(&mut self, plan: &Plan) -> Result<()> {
        let (inputs, outputs) = self.buffers(&plan.desc);
        let world = self.world;
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
            rank: self.rank,
            world,
            pads: &self.peer.pads,
            inputs: &inputs[..world],
            outputs: &outputs[..world],
            count: plan.desc.count as usize,
            dtype: plan.call.dtype,
            op: plan.call.op,
            kernel: plan.kernel,
            in_place: plan.desc.send_off == plan.desc.recv_off,
            desc: plan.desc.digest(),
            timeout: self.settings.timeout,
            rms,
        };
        let r = host_reduce::run(&call, &mut self.coll.host_epoch);
        if let Err(e) = &r {
            if e.status == Status::ErrTimeout {
                self.coll.sticky = Some(e.clone());
            }
        }
        r
    }

    /// The kernel, with `SymmArgs` (or the fused call's `RmsArgs`) on the plan's grid.
    fn run_kernel(&mut self, plan: &Plan) -> Result<()> {
        let (dtype, stream) = (plan.call.dtype, plan.call.stream);
        let mut s = self.symm_args(&plan.desc, plan.mc_out);
        s.in_place = (plan.desc.send_off == plan.desc.recv_off) as i32;
        let Coll::AddRmsNorm(r) = plan.call.coll else {
            let f = self.kernel_fn(plan.kernel, dtype, plan.call.op, plan.vec)?;
            return cuda::module::launch(self.device, f, plan.grid, plan.threads, stream, &s);
        };
        let f = self.fused_kernel_fn(plan.kernel, dtype, r.quant.map(|q| q.mode))?;
        let args = RmsArgs {
            s,
            residual: r.residual,
            weight: r.weight,
            out: r.out,
            hidden: r.hidden,
            tokens: r.tokens,
            eps: r.eps,
            push_threads: plan.push_threads,
            scale: r.quant.map_or(0, |q| q.scale),
        };
        if plan.cluster > 1 {
            return cuda::module::launch_cluster(
                self.device,
                f,
                plan.grid,
                plan.threads,
                plan.cluster,
                stream,
                &args,
            );
        }
        cuda::module::launch(self.device, f, plan.grid, plan.threads, stream, &args)
    }

    /// Every rank's input and output at the descriptor's offsets, in this address space
    /// (entries past the world, and rank-local outputs, stay 0).
    fn buffers(&self, desc: &CallDesc) -> ([u64; MAX_RANKS], [u64; MAX_RANKS]) {
        let (mut inputs, mut outputs) = ([0u64; MAX_RANKS], [0u64; MAX_RANKS]);
        for (r, b) in self.peer.windows.bases.iter().enumerate() {
            inputs[r] = b + desc.send_off;
            if desc.recv_off != RANK_LOCAL {
                outputs[r] = b + desc.recv_off;
            }
        }
        (inputs, outputs)
    }

    /// The argument struct every kernel starts with: the buffers, the pads, the call counters
    /// and epochs, the error words.
    fn symm_args(&self, desc: &CallDesc, mc_out: u64) -> SymmArgs {
        let (inputs, outputs) = self.buffers(desc);
        let mut args = SymmArgs {
            inputs,
            outputs,
            count: desc.count,
            desc: desc.digest(),
            timeout_ns: self.settings.timeout.as_nanos() as u64,
            rank: self.rank as i32,
            world: self.world as i32,
            counters: self.group.internal + COUNTERS_OFFSET,
            error_word: self.coll.errors.device_ptr(),
            ll_slot_kib: (self.settings.ll_slot >> 10) as i32,
            mc_out,
            ..SymmArgs::default()
        };
        args.pads[..self.world].copy_from_slice(&self.peer.pads);
        args
    }

    /// The kernel for (kernel, type, op, vector width), looked up in the module once.
    pub(super) fn kernel_fn(
        &mut self,
        kernel: Kernel,
        dtype: DType,
        op: ReduceOp,
        vec: bool,
    ) -> Result<cuda::module::Function> {
        if let Some(&f) = self.coll.kernels.get(&(kernel, dtype, op, vec)) {
            return Ok(f);
        }
        let name = kernels::kernel_name(kernel, dtype, op, vec).ok_or_else(|| {
            Error::unsupported(format!(
                "no {} kernel for {} {}",
                kernel.name(),
                dtype.name(),
                op.name()
            ))
        })?;
        let f = cuda::module::function(self.device, &name)?;
        self.coll.kernels.insert((kernel, dtype, op, vec), f);
        Ok(f)
    }

    /// A fused kernel: its bf16/fp16-output instance (`kernel_fn`), or its FP8 instance of
    /// `quant`'s mode, looked up in the module once.
    pub(super) fn fused_kernel_fn(
        &mut self,
        kernel: Kernel,
        dtype: DType,
        quant: Option<Quant>,
    ) -> Result<cuda::module::Function> {
        let Some(q) = quant else {
            return self.kernel_fn(kernel, dtype, ReduceOp::Sum, true);
        };
        if let Some(&f) = self.coll.quant_kernels.get(&(kernel, dtype, q)) {
            return Ok(f);
        }
        let name = kernels::quant_kernel_name(kernel, dtype, q).ok_or_else(|| {
            Error::unsupported(format!(
                "no {} kernel with {} output for {}",
                kernel.name(),
                q.name(),
                dtype.name()
            ))
        })?;
        let f = cuda::module::function(self.device, &name)?;
        self.coll.quant_kernels.insert((kernel, dtype, q), f);
        Ok(f)
    }

    /// Orders this call's work on `stream` after the communicator's previous call, when that
    /// was on another stream (streams.rs). The host backend runs calls synchronously.
    fn order_streams(&mut self, stream: u64) -> Result<()> {
        if self.host {
            return Ok(());
        }
        self.coll.streams.before_launch(self.device, stream)
    }

    /// Copies a caller's input from outside the heap into the scratch (stream-ordered) and
    /// counts the call in `staged_collectives`.
    fn stage_in(&self, scratch: u64, src: u64, bytes: u64, stream: u64) -> Result<()> {
        self.copy(scratch, src, bytes, stream)?;
        self.alloc.heap(self.device)?.stats.staged_collectives += 1;
        Ok(())
    }

    /// A stream-ordered copy (immediate on the host backend).
    fn copy(&self, dst: u64, src: u64, bytes: u64, stream: u64) -> Result<()> {
        if self.host {
            // SAFETY: both are buffers of at least `bytes` bytes (the caller's arguments and
            // our scratch); they never overlap (the scratch is ours alone).
            unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes as usize)
            };
            Ok(())
        } else {
            cuda::mem::copy_async(self.device, dst, src, bytes, stream)
        }
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
