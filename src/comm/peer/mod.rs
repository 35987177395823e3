//! The peers' memory as this communicator sees it: the peer heaps, shared by every communicator
//! of the process (peers.rs: each peer process's heap imported once, mapped segment by
//! segment), this communicator's windows onto them (windows.rs: which segments it shared and
//! mapped, at which generation), the unmapping of segments peers released (retire.rs) and,
//! for MULTIMEM, the multicast windows (mc_window.rs).
//!
//! Owns `PeerView` (the communicator's `peer`): the windows, the records of the peers' release
//! logs already handled, each rank's signal pad here, the multicast windows. Its calls take the
//! rest of what they read as arguments (`Who`: rank, world, device, allocator, mesh), never the
//! communicator.
//!
//! Invariants: a peer's buffer is `windows.bases[peer] + (ptr - own base)`, at the same offset
//! as this rank's; a segment is mapped here only after its owner shared it in a segment
//! exchange (collective/exchange.rs) and unmapped only after its owner recorded releasing that
//! generation (retire.rs), so no kernel reads a dangling mapping.

pub mod mc_window;
pub mod peers;
pub(in crate::comm) mod retire;
pub mod windows;

use crate::heap::Allocator;
use crate::ipc::Mesh;
use mc_window::McWindow;
use retire::PeerReleases;
use std::collections::HashMap;
use windows::PeerWindows;

/// The peers' memory as this communicator sees it.
pub(in crate::comm) struct PeerView {
    pub windows: PeerWindows,
    /// The peers' release logs: their segments given back, to unmap here (retire.rs).
    pub releases: PeerReleases,
    /// Each rank's signal pad in this process's address space (fixed after init).
    pub pads: Vec<u64>,
    /// Multicast windows by segment offset (MULTIMEM only; empty unless the gate allowed it).
    pub mc: HashMap<u64, McWindow>,
}

/// What the peer stage reads of its communicator besides its `PeerView`: its place and its
/// bootstrap connections.
pub(in crate::comm) struct Who<'a> {
    pub rank: usize,
    pub world: usize,
    pub device: i32,
    pub alloc: &'static Allocator,
    pub mesh: &'a Mesh,
}
