//! The communicator: any number per (process, device) of a single-node job, up to
//! `group::registry::MAX_COMMS_PER_DEVICE`. Its work is in four stages, a folder each:
//!
//! - `group/`: making communicators (`init`, `split`) and what several on a device share
//!   (arenas, split slots, the registry);
//! - `collective/`: the collectives, one pipeline per call (front end, call, plan, exchange,
//!   launch; the host backend's CPU collectives);
//! - `p2p/`: symmetric memory the user programs (rendezvous, peer pointers, put, signal, wait)
//!   and what device code sees of a communicator;
//! - `peer/`: the peers' memory as seen here (peer heaps shared by the process's communicators,
//!   this communicator's windows, releases, multicast windows).
//!
//! Each folder's header says what it owns and its invariants. This file holds the
//! `Communicator` (its parts, owned by the stages) and its `destroy`. Calls point down:
//! `group` -> `p2p` -> `collective` -> `peer`.
//!
//! Invariants: every rank has the same collective settings (read once at init and compared
//! there); every rank calls collectives in the same order with symmetric buffers; segments a
//! call touches are shared with the peers (once per segment generation) before any kernel
//! reads them; `destroy` waits for the device's queued work before it unmaps anything.

pub mod collective;
pub mod group;
pub mod p2p;
pub mod peer;

// What the other layers (ffi) and the tests and tools use, under the names they know.
pub use collective::{algo, call, convert, kernel_args, kernels};
pub use group::registry;
pub use p2p::{device_comm, signal_pad};

use crate::cuda;
use crate::error::{Error, Result};
use crate::heap::Allocator;
use crate::ipc::Mesh;
use algo::{DType, Kernel, ReduceOp};
use collective::error_word::ErrorWords;
use collective::streams::StreamOrder;
use group::slots;
use kernel_args::*;
use peer::windows::PeerWindows;
use peer::{mc_window, peers, retire};
use std::collections::HashMap;
use std::time::Duration;

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
    /// Rendezvoused ranges, signal pads and p2p kernels (p2p/).
    p2p: p2p::P2p,
    /// This communicator's arena of the device heap (arena.rs): its own buffers and
    /// `symm_comm_malloc` memory, at the same offsets on every rank.
    arena: u64,
    /// Its place among the process's live communicators (registry.rs).
    claim: registry::Claim,
    /// Every rank's process and device.
    members: Vec<peers::PeerIdent>,
    /// A child's ranks as its parent's, for errors that name a rank (group/split.rs).
    lineage: Option<String>,
    /// The fused kernels' FP8-output instances already looked up (as `kernels`).
    quant_kernels: HashMap<(Kernel, DType, algo::Quant), cuda::module::Function>,
    /// Whose memory `internal` and the p2p pad are: its own blocks (with split slots for its
    /// children, when made by init) or a slot of its parent's block (slots.rs).
    block: slots::Internal,
}

impl Communicator {
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
