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
//!   this communicator's windows, releases, multicast windows);
//! - `moe/`: expert parallelism (MoE dispatch and combine), objects made over a communicator
//!   and kept by their C handles, not by the communicator;
//! - `exec/`: the execution seam under all of them: the stages build plans (kernel, grid,
//!   arguments, copies, CPU twin) and the communicator's executor (CUDA, or the CPU on the host
//!   backend; chosen at init from the heap's backend) runs them, with the stream order and the
//!   one kernel cache. Nothing else asks which backend runs.
//!
//! Each folder's header says what it owns and its invariants. This file holds the
//! `Communicator` and its `destroy`; calls.rs its collective front ends, `begin_call` and the
//! collective pipeline's view (`ctx`). A communicator is its rank, world, device, allocator,
//! executor and bootstrap mesh, and one part per stage: `settings` (`CollSettings`, what shapes
//! every collective, built by group/init.rs), `group` (`Group`), `peer` (`PeerView`), `coll`
//! (`Collectives`) and `p2p` (`P2p`), each defined by its stage. Imports between the stages
//! point one way: `group` -> `p2p` -> `collective` -> `peer` -> `exec`; `p2p`, `collective`,
//! `peer` and `exec` never see the `Communicator` (they work on views: `p2p::View`,
//! `collective::Ctx`, `peer::Who`, `exec::Plan`); `group` makes communicators, and `moe` builds
//! its objects over one.
//!
//! Invariants: every rank has the same collective settings (read once at init and compared
//! there); every rank calls collectives in the same order with symmetric buffers; segments a
//! call touches are shared with the peers (once per segment generation) before any kernel
//! reads them; `destroy` waits for the device's queued work before it unmaps anything.

mod calls;
pub mod collective;
pub mod exec;
pub mod group;
pub mod moe;
pub mod p2p;
pub mod peer;

// What the other layers (ffi) and the tests and tools use, under the names they know.
pub use collective::{algo, call, convert, kernel_args, kernels};
pub use group::registry;
pub use p2p::{device_comm, signal_pad};

use crate::error::Result;
use crate::heap::Allocator;
use crate::ipc::Mesh;
use collective::CollSettings;
use collective::Collectives;
use group::{slots, Group};
use kernel_args::*;
use peer::PeerView;

pub struct Communicator {
    pub rank: usize,
    pub world: usize,
    pub device: i32,
    alloc: &'static Allocator,
    /// What runs its plans: the GPU, or the CPU on the host backend (exec/).
    exec: Box<dyn exec::Executor>,
    /// The bootstrap connections to every rank (ipc/).
    mesh: Mesh,
    /// What shapes every collective, fixed at init (group/init.rs builds it).
    settings: CollSettings,
    /// Its place among the ranks and the process's communicators, and its own memory (group/).
    group: Group,
    /// The peers' memory as seen here (peer/).
    peer: PeerView,
    /// What the collectives keep between calls (collective/).
    coll: Collectives,
    /// Rendezvoused ranges, signal pads and p2p kernels (p2p/).
    p2p: p2p::P2p,
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
        // Kernels in flight still use the pad and the peers' mappings.
        let _ = self.exec.sync();
        self.peer.destroy_multicast_windows(self.device);
        self.peer.windows.destroy(self.alloc);
        if let Some((p, size)) = self.coll.scratch.take() {
            let _ = self.alloc.free(p, size, self.device, 0);
        }
        match std::mem::replace(&mut self.group.block, slots::Internal::Own) {
            slots::Internal::Own => {
                if self.group.internal != 0 {
                    let _ = self.alloc.free(
                        self.group.internal,
                        internal_bytes(self.world, self.settings.ll_slot),
                        self.device,
                        0,
                    );
                }
            }
            // The block goes with the last of this communicator and its carved children.
            slots::Internal::WithSlots(block) => drop(block),
            slots::Internal::Carved { hold, generation } => {
                // What the peers' copies see as this rank's destroy (peer/retire.rs); then the slot
                // is free here (a split reuses it once it is free on every parent rank).
                let _ = crate::heap::comm_view::CommView::new(self.alloc, self.device)
                    .record_given_back(self.group.internal_seg, generation);
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
        let _ = self.alloc.release_arena(self.device, self.group.arena);
        Ok(())
    }

    /// Open connections (for tests counting descriptors).
    pub fn connection_count(&self) -> usize {
        self.mesh.fds().len()
    }
}
