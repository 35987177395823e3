//! The communicator's calls: the collectives' front ends (`all_reduce`, `reduce_scatter`,
//! `all_gather`, `all_reduce_add_rms_norm`, `barrier`), the p2p ones (`rendezvous`, `peer_ptr`,
//! `put`, `signal`, `wait`, `device_view`), what every call does first (`begin_call`: the error
//! words, then the peers' released segments) and the views the stages work on (`ctx`:
//! collective/ `Ctx`; `p2p_view`: p2p/ `View`). A call: check (collective/call.rs),
//! begin, plan (collective/plan.rs), launch (collective/launch.rs, through the executor:
//! comm/exec/).
//!
//! Invariants: every operation of a communicator (collective, p2p, MoE) begins with
//! `begin_call`, so an error a kernel recorded surfaces at the next call and released peer
//! segments are unmapped before anything maps or launches; a call with nothing to do returns
//! before it (earlier errors wait for the next call that does something).

use crate::comm::collective::algo::{Algo, DType, ReduceOp};
use crate::comm::collective::call::{Call, Coll, Rms};
use crate::comm::collective::Ctx;
use crate::comm::p2p::{self, device_comm::DeviceComm, signal_pad::SignalVia, signal_pad::WaitVia};
use crate::comm::Communicator;
use crate::error::{Error, Result, Status};

impl Communicator {
    /// Begins a call on `stream` (`begin_call`) and returns the view its stages build plans
    /// in, with the executor they submit them to: every operation that launches (collectives,
    /// p2p, MoE) reaches the executor through here, so none skips the error words or the
    /// retirement of released peer segments (the executor adds the stream order).
    pub(in crate::comm) fn begin(&mut self, stream: u64) -> Result<Ctx<'_>> {
        self.begin_call(stream)?;
        Ok(self.ctx())
    }

    /// `begin` for p2p's view.
    fn begin_p2p(&mut self, stream: u64) -> Result<p2p::View<'_>> {
        self.begin_call(stream)?;
        Ok(self.p2p_view())
    }

    /// The collective pipeline's view of this communicator (collective/, `Ctx`), without
    /// beginning a call: for making a communicator (group/internal.rs exchanges its internal
    /// block before any call).
    pub(in crate::comm) fn ctx(&mut self) -> Ctx<'_> {
        self.views().0
    }

    /// p2p's view of this communicator (p2p/, `View`).
    fn p2p_view(&mut self) -> p2p::View<'_> {
        let internal_seg = self.group.internal_seg;
        let (c, p2p) = self.views();
        p2p::View {
            c,
            p2p,
            internal_seg,
        }
    }

    /// The collective view and the p2p state, borrowed apart.
    fn views(&mut self) -> (Ctx<'_>, &mut p2p::P2p) {
        (
            Ctx {
                rank: self.rank,
                world: self.world,
                device: self.device,
                alloc: self.alloc,
                mesh: &self.mesh,
                settings: &self.settings,
                exec: &mut *self.exec,
                coll: &mut self.coll,
                peer: &mut self.peer,
                internal: self.group.internal,
                arena: self.group.arena,
            },
            &mut self.p2p,
        )
    }

    /// What every call does first: report a kernel's error, then unmap the peer segments
    /// released since the last call (peer/retire.rs; when none was, one load per peer).
    fn begin_call(&mut self, stream: u64) -> Result<()> {
        self.coll
            .check_error_word(self.rank, self.settings.timeout)?;
        if !self.peer.releases_pending() {
            return Ok(());
        }
        let who = crate::comm::peer::Who {
            rank: self.rank,
            world: self.world,
            device: self.device,
            alloc: self.alloc,
            mesh: &self.mesh,
        };
        let segs = (self.group.internal_seg, self.p2p.pad_seg);
        self.peer
            .retire_released(&who, &*self.exec, stream, segs, &mut self.coll.sticky)
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
        self.begin(call.stream)
            .and_then(|mut ctx| {
                let plan = ctx.prepare(&call, ext)?;
                ctx.launch(&plan)
            })
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

    /// `symm_rendezvous`: collective. Every rank passes the same offset and size; maps every
    /// peer's segments under the range and records it. Idempotent.
    pub fn rendezvous(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        self.begin_p2p(0)?.rendezvous(ptr, bytes)
    }

    /// `symm_peer_ptr`: local; the address, in this process, of `ptr`'s offset in `peer`'s heap.
    pub fn peer_ptr(&mut self, ptr: u64, peer: i64) -> Result<u64> {
        self.p2p_view().peer_ptr(ptr, peer)
    }

    /// `symm_put`: after the stream's earlier work, copies `bytes` from `src` into `peer`'s
    /// buffer at `dst`'s offset (copy engine; on the host backend, now).
    pub fn put(&mut self, peer: i64, dst: u64, src: u64, bytes: u64, stream: u64) -> Result<()> {
        let peer = p2p::check_peer("symm_put", peer, self.world)?;
        if bytes == 0 {
            return Ok(());
        }
        p2p::check_src(src, bytes)?;
        self.begin_p2p(stream)?.put(peer, dst, src, bytes, stream)
    }

    /// `symm_signal`: after the stream's earlier work (puts included), stores `value` into
    /// `peer`'s slot `slot`.
    pub fn signal(&mut self, peer: i64, slot: u32, value: u64, stream: u64) -> Result<()> {
        self.signal_via(p2p::signal_pad::DEFAULT_SIGNAL, peer, slot, value, stream)
    }

    /// `signal` by a chosen mechanism (the benchmark compares them).
    pub fn signal_via(
        &mut self,
        via: SignalVia,
        peer: i64,
        slot: u32,
        value: u64,
        stream: u64,
    ) -> Result<()> {
        let peer = p2p::check_peer("symm_signal", peer, self.world)?;
        p2p::check_slot("symm_signal", slot)?;
        self.begin_p2p(stream)?
            .signal_via(via, peer, slot, value, stream)
    }

    /// `symm_wait`: holds the stream until this rank's slot `slot` is >= `value`. Bounded: past
    /// the timeout the stream goes on and the next call reports a timeout naming the slot and
    /// the rank that raised it last (on the host backend, this call does).
    pub fn wait(&mut self, slot: u32, value: u64, stream: u64) -> Result<()> {
        self.wait_via(WaitVia::Kernel, slot, value, stream)
    }

    /// `wait` by a chosen mechanism; `StreamWait` is unbounded (benchmark only).
    pub fn wait_via(&mut self, via: WaitVia, slot: u32, value: u64, stream: u64) -> Result<()> {
        p2p::check_slot("symm_wait", slot)?;
        self.begin_p2p(stream)?.wait_via(via, slot, value, stream)
    }

    /// `symm_comm_device`: the communicator as device code sees it (`struct_size` left for the
    /// caller's layer to set).
    pub fn device_view(&mut self) -> DeviceComm {
        self.p2p_view().device_view()
    }

    /// Rendezvoused ranges held (for tests).
    pub fn rendezvoused_ranges(&self) -> usize {
        self.p2p.ranges()
    }
}
