//! Making communicators, and what several on one device share: `init` (the bootstrap mesh, the
//! agreement on devices, heap sizes, backend and collective settings) and `split` (children
//! over a parent's ranks) both end in `build` (init.rs); `arena` (each communicator's arena of
//! the device heap, agreed at one offset on every rank; `symm_comm_malloc`), `internal` (the
//! internal block: signal pad, epochs, abort word, LL buffers; made, or carved from a parent's
//! split slot), `slots` (the split slots a communicator made by init reserves for its
//! children), `registry` (the live communicators per device and the MemPool slots).
//!
//! Owns `Group` (the communicator's `group`: the mesh's membership, that is every rank's process
//! and device and a child's lineage; the registry claim; the arena; the internal block and whose
//! memory it is). `build` (init.rs) makes every part of a communicator, `CollSettings` (its
//! `settings`) among them.
//!
//! Invariants: every rank has the same collective settings (read once at init and compared
//! there: a rank whose settings differ fails every rank alike); a communicator's arena and
//! internal block are at the same offsets on every rank; a refusal on one rank (a setting, the
//! registry's limit, no common arena offset) fails every rank alike, naming the ranks.

pub(in crate::comm) mod arena;
pub(in crate::comm) mod init;
mod internal;
pub mod registry;
pub(in crate::comm) mod slots;
mod split;

use crate::comm::peer::peers::PeerIdent;
use registry::Claim;
use slots::Internal;

/// A communicator's place among its ranks and the process's communicators, and the memory it
/// owns in the heap.
pub(in crate::comm) struct Group {
    /// Signal pad, epochs, abort word and LL buffers: `internal_bytes(world, ll_slot)` bytes
    /// (collective/kernel_args.rs has the layout).
    pub internal: u64,
    /// The offset of the segment that holds `internal` (the same on every rank): a peer that
    /// releases it has destroyed its communicator (peer/retire.rs).
    pub internal_seg: u64,
    /// This communicator's arena of the device heap (arena.rs): its own buffers and
    /// `symm_comm_malloc` memory, at the same offsets on every rank.
    pub arena: u64,
    /// Its place among the process's live communicators (registry.rs).
    pub claim: Claim,
    /// Every rank's process and device.
    pub members: Vec<PeerIdent>,
    /// A child's ranks as its parent's, for errors that name a rank (split.rs).
    pub lineage: Option<String>,
    /// Whose memory `internal` and the p2p pad are: its own blocks (with split slots for its
    /// children, when made by init) or a slot of its parent's block (slots.rs).
    pub block: Internal,
}
