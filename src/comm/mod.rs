//! The communicator: one per (process, device) of a single-node job. Owns the bootstrap mesh,
//! the peer windows, the signal pad (a symmetric internal block), the kernels' error words and
//! the staging scratch; runs all-reduce and barrier.
//!
//! Files: `init` (bootstrap and agreement), `exchange` (lazy segment exchange, call
//! descriptors), `retire` (unmapping segments peers released), `launch` (grid and kernel
//! launch), `streams` (order across streams), `error_word` (what kernels report), `algo`
//! (AUTO), `host_reduce` (the host backend).
//!
//! Invariants: every rank has the same collective settings (LL slot and grid, AUTO thresholds,
//! symmetry checking: read once at init and compared there); every rank calls collectives in
//! the same order with symmetric buffers; the kernels of a communicator run one after another
//! on each rank, whatever streams the calls name (streams.rs); segments a collective touches
//! are shared with the peers (exchanged once per segment generation) before any kernel reads
//! them; an error a kernel reports surfaces at the next call (a fatal one at every later call:
//! the communicator is then broken and must be destroyed).

pub mod algo;
pub mod convert;
mod error_word;
mod exchange;
pub mod host_reduce;
mod init;
pub mod kernel_args;
pub mod kernels;
mod launch;
pub mod mc_window;
pub mod multicast;
mod retire;
pub mod rms_norm;
mod scatter_gather;
pub mod streams;
pub mod windows;

use crate::cuda;
use crate::error::{Error, Result};
use crate::heap::{pools::INTERNAL_POOL, Allocator};
use crate::ipc::Mesh;
use algo::{Algo, DType, ReduceOp};
use error_word::ErrorWords;
use exchange::CallDesc;
use kernel_args::*;
use std::collections::HashMap;
use std::time::Duration;
use streams::StreamOrder;
use windows::PeerWindows;

pub use launch::ll_threads;

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
    /// over a cluster (rms_norm.rs). Equal on every rank: read from every rank's device.
    clusters: bool,
    /// The fewest SMs of any rank's GPU: an LL grid must be resident at once on every rank
    /// (rms_norm.rs, `fit_resident`). Equal on every rank, as `clusters`.
    fewest_sms: u32,
    /// Blocks per SM of a fused LL kernel at a block size, by (algo, dtype, threads): the
    /// driver's occupancy answer, asked once (rms_norm.rs, `resident_blocks`).
    resident: HashMap<(Algo, DType, u32), u32>,
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
    kernels: HashMap<(Algo, DType, ReduceOp, bool), cuda::module::Function>,
}

/// Collective buffers must be non-NULL and aligned to their element.
fn check_pointers(send: u64, recv: u64, dtype: DType) -> Result<()> {
    if send == 0 || recv == 0 {
        return Err(Error::invalid(format!(
            "send ({send:#x}) and recv ({recv:#x}) must not be NULL when count > 0"
        )));
    }
    let esize = dtype.size() as u64;
    if send % esize != 0 || recv % esize != 0 {
        return Err(Error::invalid(format!(
            "send {send:#x} / recv {recv:#x} are not aligned to the {}-byte {} element",
            esize,
            dtype.name()
        )));
    }
    Ok(())
}

/// `count * esize * times` bytes, or an error naming the count that overflows.
fn byte_size(count: u64, esize: u64, times: u64) -> Result<u64> {
    count
        .checked_mul(esize)
        .and_then(|b| b.checked_mul(times))
        .ok_or_else(|| Error::invalid(format!("count {count} overflows the byte size")))
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

    fn ensure_scratch(&mut self, bytes: u64) -> Result<u64> {
        if let Some((p, size)) = self.scratch {
            if size >= bytes {
                return Ok(p);
            }
            self.alloc.free(p, size, self.device, 0)?;
            self.scratch = None;
        }
        let size = bytes.next_power_of_two().max(1 << 20);
        let p = self.alloc.malloc_in(size, self.device, 0, INTERNAL_POOL)?;
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

    /// The TRACE line of one collective call (formats nothing unless SYMMALLOC_DEBUG=TRACE).
    fn trace_call(
        &self,
        what: std::fmt::Arguments<'_>,
        desc: &CallDesc,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
        staged: bool,
    ) {
        crate::trace!(
            "rank {}/{}: {what} {} x {} {} send +{:#x} recv +{:#x} stream {stream:#x}{}",
            self.rank,
            self.world,
            desc.count,
            dtype.name(),
            op.name(),
            desc.send_off,
            desc.recv_off,
            if staged { " (staged)" } else { "" }
        );
    }

    /// Copies a caller's input from outside the heap into the scratch (stream-ordered) and
    /// counts the call in `staged_collectives`.
    fn stage_in(&self, scratch: u64, src: u64, bytes: u64, stream: u64) -> Result<()> {
        self.copy(scratch, src, bytes, stream)?;
        self.alloc.heap(self.device)?.stats.staged_collectives += 1;
        Ok(())
    }

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
        self.begin_call(stream)?;
        if count == 0 {
            return Ok(());
        }
        check_pointers(send, recv, dtype)?;
        let bytes = byte_size(count, dtype.size() as u64, 1)?;
        let asked = algo;
        let algo = algo::choose(algo, bytes, self.world, self.ll_slot, &self.auto)?;
        if asked == Algo::Auto
            && crate::debug::enabled(crate::debug::Level::Info)
            && self.auto_seen.insert(bytes)
        {
            crate::info!(
                "rank {}/{}: AUTO chose {} for {bytes} bytes",
                self.rank,
                self.world,
                algo.name()
            );
        }
        if algo == Algo::Multimem {
            let supports = !self.host && cuda::driver()?.device(self.device)?.multicast;
            multicast::multicast_gate_from_env(supports)
                .map_err(|why| Error::unsupported(format!("SYMM_ALGO_MULTIMEM refused: {why}")))?;
            mc_window::check_call(send, recv, count, dtype, op)?;
        }
        let in_send = self.locate(send, bytes)?;
        let in_recv = self.locate(recv, bytes)?;
        // The segments the kernel touches, output last (no allocation per call).
        let (work_send, work_recv, staged, seg_pair, nsegs) = match (in_send, in_recv) {
            (Some(a), Some(b)) => (send, recv, false, [a, b], 2),
            _ => {
                let s = self.ensure_scratch(bytes)?;
                let seg = self.locate(s, bytes)?.expect("scratch is in the heap");
                (s, s, true, [seg, seg], 1)
            }
        };
        let segs = &seg_pair[..nsegs];
        let base = self.windows.bases[self.rank];
        let desc = CallDesc {
            send_off: work_send - base,
            recv_off: work_recv - base,
            count,
            dtype: dtype as u64,
            op: op as u64,
            algo: algo as u64,
        };
        self.exchange(segs, desc, self.check_symmetry)?;
        // Before the call's first work on the stream: the staged copy uses the scratch.
        self.order_streams(stream)?;
        if staged {
            self.stage_in(work_send, send, bytes, stream)?;
        }
        let mc_out = if algo == Algo::Multimem {
            // Past the gate: the output segment's multicast window (built collectively once).
            let seg = *segs.last().expect("the output's segment");
            self.multicast_window(seg)? + (work_recv - base - seg.offset)
        } else {
            0
        };
        self.trace_call(
            format_args!("all_reduce {}", algo.name()),
            &desc,
            dtype,
            op,
            stream,
            staged,
        );
        self.run(algo, desc, dtype, op, stream, mc_out)?;
        if staged {
            self.copy(recv, work_recv, bytes, stream)?;
        }
        Ok(())
    }

    /// Orders this call's work on `stream` after the communicator's previous call, when that
    /// was on another stream (streams.rs). The host backend runs calls synchronously.
    fn order_streams(&mut self, stream: u64) -> Result<()> {
        if self.host {
            return Ok(());
        }
        self.streams.before_launch(self.device, stream)
    }

    /// All ranks meet; stream-ordered on CUDA (a kernel), immediate on the host backend.
    pub fn barrier(&mut self, stream: u64) -> Result<()> {
        self.begin_call(stream)?;
        let desc = CallDesc {
            send_off: 0,
            recv_off: 0,
            count: 0,
            dtype: 0,
            op: 0,
            algo: u64::MAX,
        };
        if self.check_symmetry {
            self.exchange(&[], desc, true)?;
        }
        self.order_streams(stream)?;
        self.run(Algo::OneShot, desc, DType::Fp32, ReduceOp::Sum, stream, 0)
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
        let _ = self.alloc.free(
            self.internal,
            internal_bytes(self.world, self.ll_slot),
            self.device,
            0,
        );
        let _ = self.alloc.release_pool(self.device, INTERNAL_POOL);
        init::release_device(self.device);
        Ok(())
    }

    /// Open connections (for tests counting descriptors).
    pub fn connection_count(&self) -> usize {
        self.mesh.fds().len()
    }
}
