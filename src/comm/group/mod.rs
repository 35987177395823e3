//! Making communicators, and what several on one device share: `init` (the bootstrap mesh, the
//! agreement on devices, heap sizes, backend and collective settings) and `split` (children
//! over a parent's ranks) both end in `build` (init.rs); `arena` (each communicator's arena of
//! the device heap, agreed at one offset on every rank; `symm_comm_malloc`), `internal` (the
//! internal block: signal pad, epochs, abort word, LL buffers; made, or carved from a parent's
//! split slot), `slots` (the split slots a communicator made by init reserves for its
//! children), `registry` (the live communicators per device and the MemPool slots).
//!
//! Owns (in the communicator): the mesh's membership (every rank's process and device, a
//! child's lineage), the registry claim, the arena, the internal block and whose memory it is.
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
