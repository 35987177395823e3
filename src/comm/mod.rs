//! The communicator: any number per (process, device) of a single-node job, up to
//! `registry::MAX_COMMS_PER_DEVICE`. Owns the bootstrap mesh, its arena of the device heap
//! (arena.rs), the signal pad (a symmetric internal block, in the arena, or for a child in a
//! split slot of its parent's: slots.rs), the kernels' error words and the staging scratch;
//! shares the peer heaps with the process's other communicators (peers.rs); runs the
//! collectives. `split` (split.rs) makes children over a parent's ranks.
//!
//! Every collective goes through one pipeline (docs/DESIGN.md, "The collective pipeline"): a
//! front end below builds a `Call` (call.rs: what was asked, checked), `prepare` turns it into a
//! `Plan` (plan.rs: buffers, staging, kernel and grid from algo.rs and shape.rs, the segment
//! exchange), and `launch` enqueues it (launch.rs; host_reduce.rs on the host backend).
//!
//! Other files: `init` (bootstrap and agreement), `internal` (the internal block made, or
//! carved from a parent's split slot: `slots`), `arena` (the arena's agreement,
//! `symm_comm_malloc`), `peers` (peer heaps shared by communicators), `registry` (live
//! communicators per device, MemPool slots), `split` (children), `exchange` (lazy segment exchange), `desc` (call
//! descriptors and their digests), `retire` (unmapping segments peers released), `streams` (order across
//! streams), `error_word` (what kernels report), `kernels` (the kernel-id table and the
//! generated kernel sources), `kernel_args` (what the host shares with the kernels),
//! `mc_window` (multicast windows), `windows` (peer windows), `p2p` (rendezvous, peer
//! pointers, put/signal/wait), `signal_pad` (the p2p signal pads) and `device_comm` (what device
//! code sees of a communicator).
//!
//! Invariants: every rank has the same collective settings (LL slot and grid, AUTO thresholds,
//! symmetry checking: read once at init and compared there); every rank calls collectives in
//! the same order with symmetric buffers; the kernels of a communicator run one after another
//! on each rank, whatever streams the calls name (streams.rs); segments a collective touches
//! are shared with the peers (exchanged once per segment generation) before any kernel reads
//! them; an error a kernel reports surfaces at the next call (a fatal one at every later call:
//! the communicator is then broken and must be destroyed).

pub mod algo;
mod arena;
pub mod call;
pub mod convert;
mod desc;
pub mod device_comm;
mod error_word;
mod exchange;
pub mod host_norm;
pub mod host_reduce;
mod init;
mod internal;
pub mod kernel_args;
pub mod kernels;
mod launch;
pub mod mc_window;
pub mod p2p;
pub mod peers;
mod plan;
pub mod registry;
mod retire;
pub mod shape;
pub mod signal_pad;
mod slots;
mod split;
pub mod streams;
pub mod windows;

use crate::cuda;
use crate::error::{Error, Result};
use crate::heap::Allocator;
use crate::ipc::Mesh;
use algo::{Algo, DType, Kernel, ReduceOp};
use call::{Call, Coll, Rms};
use error_word::ErrorWords;
use kernel_args::*;
use std::collections::HashMap;
use std::time::Duration;
use streams::StreamOrder;
use windows::PeerWindows;

pub struct Communicator {
    pub rank: usize,
    pub world: usize,
    pub device: i32,
    alloc: &'static Allocator,
    host: bool,
    mesh: Mesh,
    windows: PeerWindows,
    /// Signal pad, epochs, abort word and LL buffers: `internal_bytes(world, ll_slot)` bytes
    /// (kernel_args.rs has the layout).
    internal: u64,
    /// The offset of the segment that holds `internal` (the same on every rank): a peer that
    /// releases it has destroyed its communicator (retire.rs).
    internal_seg: u64,
    /// Bytes per sender slot of the LL buffers (`SYMMALLOC_LL_BYTES`, equal on all ranks).
    ll_slot: u64,
    /// The LL kernel's (blocks, threads), fixed for the communicator's life.
    ll_grid: (u32, u32),
    /// AUTO's thresholds and `SYMMALLOC_CHECK_SYMMETRY`: read at init, equal on all ranks.
    auto: algo::AutoThresholds,
    check_symmetry: bool,
    errors: ErrorWords,
    /// The previous call's stream, to order a call on another stream after it.
    streams: StreamOrder,
    host_epoch: u32,
    scratch: Option<(u64, u64)>,
    timeout: Duration,
    sticky: Option<Error>,
    sms: u32,
    /// Every rank's GPU runs thread-block clusters (sm_90+): the fused call may split wide rows
    /// over a cluster (plan.rs). Equal on every rank: read from every rank's device.
    clusters: bool,
    /// The fewest SMs of any rank's GPU: an LL grid must be resident at once on every rank
    /// (shape.rs, `fit_resident`). Equal on every rank, as `clusters`.
    fewest_sms: u32,
    /// Blocks per SM of a fused LL kernel at a block size, by (algo, dtype, threads): the
    /// driver's occupancy answer, asked once (plan.rs, `resident_blocks`); by output format too
    /// (an FP8 instance may hold more registers).
    resident: HashMap<(Kernel, DType, u32, Option<algo::Quant>), u32>,
    /// The peers' release logs: their segments given back, to unmap here (retire.rs).
    releases: retire::PeerReleases,
    /// Each rank's signal pad in this process's address space (fixed after init).
    pads: Vec<u64>,
    /// Message sizes AUTO has chosen for already (kept only under SYMMALLOC_DEBUG=INFO).
    auto_seen: std::collections::HashSet<u64>,
    /// Multicast windows by segment offset (MULTIMEM only; empty unless the gate allowed it).
    mc: HashMap<u64, mc_window::McWindow>,
    /// Kernels already looked up in the device's module, so a call does no name formatting,
    /// module lock or hash of a string.
    kernels: HashMap<(Kernel, DType, ReduceOp, bool), cuda::module::Function>,
    /// Rendezvoused ranges, signal pads and p2p kernels (p2p.rs).
    p2p: p2p::P2p,
    /// This communicator's arena of the device heap (arena.rs): its own buffers and
    /// `symm_comm_malloc` memory, at the same offsets on every rank.
    arena: u64,
    /// Its place among the process's live communicators (registry.rs).
    claim: registry::Claim,
    /// Every rank's process and device.
    members: Vec<peers::PeerIdent>,
    /// A child's ranks as its parent's, for errors that name a rank (split.rs).
    lineage: Option<String>,
    /// The fused kernels' FP8-output instances already looked up (as `kernels`).
    quant_kernels: HashMap<(Kernel, DType, algo::Quant), cuda::module::Function>,
    /// Whose memory `internal` and the p2p pad are: its own blocks (with split slots for its
    /// children, when made by init) or a slot of its parent's block (slots.rs).
    block: slots::Internal,
}

impl Communicator {
    /// What every call does first: report a kernel's error, then unmap the peer segments
    /// released since the last call (retire.rs).
    fn begin_call(&mut self, stream: u64) -> Result<()> {
        self.check_error_word()?;
        self.retire_released(stream)
    }

    /// Reports what a kernel of this communicator wrote into the error words since the last
    /// call; a fatal error stays and is reported by every later call.
    fn check_error_word(&mut self) -> Result<()> {
        if let Some(e) = &self.sticky {
            return Err(e.clone());
        }
        match self.errors.take(self.rank, self.timeout) {
            None => Ok(()),
            Some(r) => {
                if r.fatal {
                    self.sticky = Some(r.error.clone());
                }
                Err(r.error)
            }
        }
    }

    /// The scratch a call staging `bytes` makes: None when the current one holds them, else
    /// its size (a power of two, at least 1 MiB; the same on every rank for the same call).
    fn scratch_to_make(&self, bytes: u64) -> Option<u64> {
        match self.scratch {
            Some((_, size)) if size >= bytes => None,
            _ => Some(bytes.next_power_of_two().max(1 << 20)),
        }
    }

    fn ensure_scratch(&mut self, bytes: u64) -> Result<u64> {
        let Some(size) = self.scratch_to_make(bytes) else {
            return Ok(self.scratch.expect("it holds them").0);
        };
        if let Some((p, old)) = self.scratch {
            self.alloc.free(p, old, self.device, 0)?;
            self.scratch = None;
        }
        let p = self.own_malloc(size)?;
        self.scratch = Some((p, size));
        Ok(p)
    }

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

    /// Copies a caller's input from outside the heap into the scratch (stream-ordered) and
    /// counts the call in `staged_collectives`.
    fn stage_in(&self, scratch: u64, src: u64, bytes: u64, stream: u64) -> Result<()> {
        self.copy(scratch, src, bytes, stream)?;
        self.alloc.heap(self.device)?.stats.staged_collectives += 1;
        Ok(())
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

    /// Orders this call's work on `stream` after the communicator's previous call, when that
    /// was on another stream (streams.rs). The host backend runs calls synchronously.
    fn order_streams(&mut self, stream: u64) -> Result<()> {
        if self.host {
            return Ok(());
        }
        self.streams.before_launch(self.device, stream)
    }

    /// Gives back the peer mappings, windows, internal buffers and the device claim.
    pub fn destroy(mut self: Box<Self>) -> Result<()> {
        crate::info!(
            "rank {}/{}: communicator on device {} destroyed",
            self.rank,
            self.world,
            self.device
        );
        if !self.host {
            // Kernels in flight still use the pad and the peers' mappings.
            let _ = cuda::mem::sync_device(self.device);
            self.destroy_multicast_windows();
        }
        self.windows.destroy(self.alloc);
        if let Some((p, size)) = self.scratch.take() {
            let _ = self.alloc.free(p, size, self.device, 0);
        }
        match std::mem::replace(&mut self.block, slots::Internal::Own) {
            slots::Internal::Own => {
                if self.internal != 0 {
                    let _ = self.alloc.free(
                        self.internal,
                        internal_bytes(self.world, self.ll_slot),
                        self.device,
                        0,
                    );
                }
            }
            // The block goes with the last of this communicator and its carved children.
            slots::Internal::WithSlots(block) => drop(block),
            slots::Internal::Carved { hold, generation } => {
                // What the peers' copies see as this rank's destroy (retire.rs); then the slot
                // is free here (a split reuses it once it is free on every parent rank).
                if let Ok(mut heap) = self.alloc.heap(self.device) {
                    heap.record_given_back(self.internal_seg, generation);
                }
                drop(hold);
                // The pad is part of the slot.
                self.p2p.pad = 0;
            }
        }
        if self.p2p.pad != 0 {
            let _ = self.alloc.free(
                self.p2p.pad,
                device_comm::SYMM_SIGNAL_PAD_BYTES,
                self.device,
                0,
            );
        }
        // Its free segments go now (the peers see the internal block's and stop using this
        // communicator); `symm_comm_malloc` blocks still live keep theirs until freed.
        let _ = self.alloc.release_arena(self.device, self.arena);
        Ok(())
    }

    /// Open connections (for tests counting descriptors).
    pub fn connection_count(&self) -> usize {
        self.mesh.fds().len()
    }
}
