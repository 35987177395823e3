//! The collectives' pipeline (docs/DESIGN.md, "The collective pipeline"), over a view of the
//! communicator (`Ctx`, built per call by comm/calls.rs, where the front ends `all_reduce`,
//! `reduce_scatter`, `all_gather`, `all_reduce_add_rms_norm` and `barrier` are): a front end
//! builds a `Call` (call.rs: what was asked, checked); `begin_call` reports earlier errors
//! (error_word.rs) and unmaps what peers released (peer/retire.rs); `prepare` turns the call
//! into a `Plan` (plan.rs: the kernel from algo.rs, its shape (vectors or elements, grid) from
//! plan.rs's `shape` (the fused call's: fused_shape.rs), the buffers from place.rs, the
//! segment exchange and the comparison of descriptors of exchange.rs, the descriptor being
//! launch.rs's `CallDesc`); `launch` hands it to the executor as a comm/exec/ plan
//! (launch.rs: kernel id, grid, argument struct, copies, and the CPU twin host_reduce.rs /
//! host_norm.rs). `kernels.rs` and `kernel_args.rs` are what the host
//! shares with the kernels (the generated kernels/instances.cu and kernels/symm_constants.cuh
//! come from them); `convert.rs` holds the number formats.
//!
//! Owns `CollSettings` (the communicator's `settings`: what shapes every collective, built at
//! init) and `Collectives` (the communicator's `coll`): the staging scratch, the error words and
//! the sticky error, the host backend's epoch, AUTO's choices already reported. Reads, through
//! `Ctx`, the peers' memory (peer/) and the executor (exec/); never the communicator.
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
pub(in crate::comm) mod error_word;
pub(in crate::comm) mod exchange;
pub mod fused_shape;
pub mod host_norm;
pub mod host_reduce;
pub mod kernel_args;
pub mod kernels;
pub(in crate::comm) mod launch;
pub(in crate::comm) mod place;
mod plan;

use crate::comm::exec::Executor;
use crate::comm::peer::PeerView;
use crate::error::Error;
use crate::heap::Allocator;
use crate::ipc::Mesh;
use error_word::ErrorWords;
use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// What shapes every collective of a communicator, fixed at init (group/init.rs, `build`): the settings every
/// rank agreed on (read at init and compared there; a split's child reads its own and compares
/// them too) and what the ranks' GPUs hold.
pub(in crate::comm) struct CollSettings {
    /// Bytes per sender slot of the LL buffers (`SYMMALLOC_LL_BYTES`, equal on all ranks).
    pub ll_slot: u64,
    /// The LL kernel's (blocks, threads), fixed for the communicator's life.
    pub ll_grid: (u32, u32),
    /// AUTO's thresholds and `SYMMALLOC_CHECK_SYMMETRY`: read at init, equal on all ranks.
    pub auto: algo::AutoThresholds,
    pub check_symmetry: bool,
    /// `SYMMALLOC_TIMEOUT_S`: every wait's bound.
    pub timeout: Duration,
    /// This rank's GPU's SMs (the barrier kernels' grid).
    pub sms: u32,
    /// Every rank's GPU runs thread-block clusters (sm_90+): the fused call may split wide rows
    /// over a cluster (plan.rs). Equal on every rank: read from every rank's device.
    pub clusters: bool,
    /// The fewest SMs of any rank's GPU: an LL grid must be resident at once on every rank
    /// (fused_shape.rs, `fit_resident`). Equal on every rank, as `clusters`.
    pub fewest_sms: u32,
    /// The executor's plans carry a kernel grid (`Executor::grids`): plan.rs works one out.
    pub grids: bool,
    /// The ranks meet before one makes or shares a segment (`Executor::meets`: the CPU's
    /// collectives; place.rs).
    pub meets: bool,
}

/// What the collectives keep between calls: the error words kernels report into and the error
/// that broke the communicator, the host backend's barrier epoch, the scratch, and AUTO's
/// choices already reported. (The stream order, the kernels and their occupancy are the
/// executor's: comm/exec/.)
pub(in crate::comm) struct Collectives {
    pub errors: ErrorWords,
    /// `errors.device_ptr()`, read once: what every kernel gets in `SymmArgs::error_word`
    /// (launch.rs reads it here, so a launch does not go back to error_word.rs).
    pub error_word: u64,
    /// A fatal error: every later call reports it (the communicator must be destroyed).
    pub sticky: Option<Error>,
    /// The host backend's barrier epoch (host_reduce.rs).
    pub host_epoch: u32,
    /// The staging scratch (address, size; place.rs).
    pub scratch: Option<(u64, u64)>,
    /// Message sizes AUTO has chosen for already (kept only under SYMMALLOC_DEBUG=INFO).
    pub auto_seen: HashSet<u64>,
    /// The device heap lock's count of ended holds (`Allocator::heap_releases`): the
    /// placement cache's test that the heap is as it was (place.rs).
    pub heap_releases: &'static AtomicU64,
    /// The placement cache (place.rs, `Located`): the last call's buffers' segments.
    pub located: Option<place::Located>,
}

impl Collectives {
    /// Nothing looked up or made yet; kernels report into `errors`; `heap_releases` is the
    /// communicator's device heap's (`Allocator::heap_releases`).
    pub fn new(errors: ErrorWords, heap_releases: &'static AtomicU64) -> Self {
        Collectives {
            error_word: errors.device_ptr(),
            errors,
            sticky: None,
            host_epoch: 0,
            scratch: None,
            auto_seen: HashSet::new(),
            heap_releases,
            located: None,
        }
    }
}

/// What the collective pipeline reads and writes of its communicator, borrowed for one call
/// (the communicator builds it: comm/calls.rs, `ctx`): its place, settings and bootstrap
/// connections, its executor, the collectives' state, the peers' memory, and where its own
/// blocks are. The pipeline's steps (plan.rs, place.rs, exchange.rs, launch.rs) are its
/// methods; nothing here sees the communicator itself.
pub(in crate::comm) struct Ctx<'a> {
    pub rank: usize,
    pub world: usize,
    pub device: i32,
    pub alloc: &'static Allocator,
    pub mesh: &'a Mesh,
    pub settings: &'a CollSettings,
    pub exec: &'a mut dyn Executor,
    pub coll: &'a mut Collectives,
    pub peer: &'a mut PeerView,
    /// The internal block (call counters, epochs: `SymmArgs::counters`).
    pub internal: u64,
    /// The communicator's arena (the scratch is one of its own blocks there).
    pub arena: u64,
}
