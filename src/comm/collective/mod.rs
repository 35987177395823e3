//! The collectives: the front ends (`all_reduce`, `reduce_scatter`, `all_gather`,
//! `all_reduce_add_rms_norm`, `barrier`) and the one pipeline every call goes through
//! (docs/DESIGN.md, "The collective pipeline"): a front end builds a `Call` (call.rs: what was
//! asked, checked); `begin_call` reports earlier errors (error_word.rs) and unmaps what peers
//! released (peer/retire.rs); `prepare` turns the call into a `Plan` (plan.rs: the kernel from
//! algo.rs, its shape (vectors or elements, grid) from shape.rs (the fused call's: fused_shape.rs),
//! the buffers from place.rs, the descriptor of desc.rs, the segment exchange of exchange.rs);
//! `launch` enqueues it (launch.rs; host_reduce.rs and host_norm.rs on the host backend).
//! `kernels.rs` and `kernel_args.rs` are what the host shares with the kernels (the generated
//! kernels/instances.cu and kernels/symm_constants.cuh come from them); `streams.rs` orders calls
//! across streams; `convert.rs` holds the number formats.
//!
//! Owns `Collectives` (the communicator's `coll`): the staging scratch, the error words and the
//! sticky error, the stream order, the host backend's epoch, the kernels looked up in the
//! module. Reads the communicator's `settings` (group/init.rs) and `peer` parts.
//!
//! Invariants: every rank calls collectives in the same order with symmetric buffers; every
//! decision of a plan reads only values equal on every rank, so every rank runs the same kernel
//! on the same grid; the segments a kernel touches are exchanged with the peers before it is
//! enqueued; the kernels of a communicator run one after another on each rank, whatever streams
//! the calls name; an error a kernel reports surfaces at the next call (a fatal one at every
//! later call: the communicator is then broken and must be destroyed).

pub mod algo;
pub mod call;
pub mod convert;
pub(in crate::comm) mod desc;
pub(in crate::comm) mod error_word;
pub(in crate::comm) mod exchange;
pub mod fused_shape;
pub mod host_norm;
pub mod host_reduce;
pub mod kernel_args;
mod kernel_id;
pub mod kernels;
mod launch;
mod place;
mod plan;
pub mod shape;
/// The stream order moved to the execution layer, which applies it to every launch.
pub use crate::comm::exec::streams;

use crate::comm::Communicator;
use crate::error::{Error, Result, Status};
use algo::{Algo, DType, ReduceOp};
use call::{Call, Coll, Rms};
use error_word::ErrorWords;
use std::collections::HashSet;

/// What the collectives keep between calls: the error words kernels report into and the error
/// that broke the communicator, the host backend's barrier epoch, the scratch, and AUTO's
/// choices already reported. (The stream order, the kernels and their occupancy are the
/// executor's: comm/exec/.)
pub(in crate::comm) struct Collectives {
    pub errors: ErrorWords,
    /// A fatal error: every later call reports it (the communicator must be destroyed).
    pub sticky: Option<Error>,
    /// The host backend's barrier epoch (host_reduce.rs).
    pub host_epoch: u32,
    /// The staging scratch (address, size; place.rs).
    pub scratch: Option<(u64, u64)>,
    /// Message sizes AUTO has chosen for already (kept only under SYMMALLOC_DEBUG=INFO).
    pub auto_seen: HashSet<u64>,
}

impl Collectives {
    /// Nothing looked up or made yet; kernels report into `errors`.
    pub fn new(errors: ErrorWords) -> Self {
        Collectives {
            errors,
            sticky: None,
            host_epoch: 0,
            scratch: None,
            auto_seen: HashSet::new(),
        }
    }
}

impl Communicator {
    /// What every call does first: report a kernel's error, then unmap the peer segments
    /// released since the last call (peer/retire.rs).
    pub(in crate::comm) fn begin_call(&mut self, stream: u64) -> Result<()> {
        self.check_error_word()?;
        self.retire_released(stream)
    }

    /// One collective call through the pipeline: report earlier errors, plan, launch.
    /// A call with nothing to do returns at once (earlier errors wait for the next call that
    /// does something); a call's own arguments are checked next (they need no peer, so a bad one
    /// is reported as such whatever the peers did since); then earlier errors, then the plan.
    fn collective(&mut self, call: Call) -> Result<()> {
        if call.is_empty() {
            return Ok(());
        }
        let ext = call.check(self.rank, self.world)?;
        self.begin_call(call.stream)
            .and_then(|()| self.prepare(&call, ext))
            .and_then(|plan| self.launch(&plan))
            .map_err(|e| self.name_ranks(e))
    }

    /// All-reduce of `count` elements, in place when `send == recv`.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &mut self,
        algo: Algo,
        send: u64,
        recv: u64,
        count: u64,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<()> {
        self.collective(Call {
            coll: Coll::AllReduce(algo),
            send,
            recv,
            count,
            dtype,
            op,
            stream,
        })
    }

    /// Reduce-scatter: rank r gets elements [r * recv_count, (r + 1) * recv_count) of the
    /// reduction of every rank's `send` (world * recv_count elements).
    pub fn reduce_scatter(
        &mut self,
        send: u64,
        recv: u64,
        recv_count: u64,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<()> {
        self.collective(Call {
            coll: Coll::ReduceScatter,
            send,
            recv,
            count: recv_count,
            dtype,
            op,
            stream,
        })
    }

    /// All-gather: rank r's `send_count` elements land at r * send_count of every `recv`.
    pub fn all_gather(
        &mut self,
        send: u64,
        recv: u64,
        send_count: u64,
        dtype: DType,
        stream: u64,
    ) -> Result<()> {
        self.collective(Call {
            coll: Coll::AllGather,
            send,
            recv,
            count: send_count,
            dtype,
            op: ReduceOp::Sum,
            stream,
        })
    }

    /// All-reduce of `x` ([tokens, hidden]) + residual, then RMSNorm: `residual` is updated in
    /// place and `out = rms_norm(residual) * weight` (kernels/rms_norm.cuh). Only `x` is read
    /// by peers; `residual`, `weight` and `out` are this rank's own.
    pub fn all_reduce_add_rms_norm(
        &mut self,
        x: u64,
        rms: Rms,
        dtype: DType,
        stream: u64,
    ) -> Result<()> {
        self.collective(Call {
            coll: Coll::AddRmsNorm(rms),
            send: x,
            recv: 0,
            count: rms.tokens.saturating_mul(rms.hidden),
            dtype,
            op: ReduceOp::Sum,
            stream,
        })
    }

    /// All ranks meet; stream-ordered on CUDA (a kernel), immediate on the host backend.
    pub fn barrier(&mut self, stream: u64) -> Result<()> {
        self.collective(Call {
            coll: Coll::Barrier,
            send: 0,
            recv: 0,
            count: 0,
            dtype: DType::Fp32,
            op: ReduceOp::Sum,
            stream,
        })
    }

    /// Names the processes behind rank numbers in a child's peer and timeout errors.
    pub(in crate::comm) fn name_ranks(&self, mut e: Error) -> Error {
        if matches!(e.status, Status::ErrPeer | Status::ErrTimeout) {
            match &self.group.lineage {
                Some(l) => {
                    e.message = format!(
                        "{} (in a communicator of {} ranks split from another: {l})",
                        e.message, self.world
                    )
                }
                None => {
                    let pids: Vec<u32> = self.group.members.iter().map(|m| m.pid).collect();
                    e.message =
                        format!("{} (ranks 0..{} are pids {pids:?})", e.message, self.world);
                }
            }
        }
        e
    }
}
