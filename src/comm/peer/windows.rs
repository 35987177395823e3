//! Peer windows, as one communicator sees them: for every peer, the shared peer heap
//! (peers.rs: a reservation as large as the heap in which the peer's segments are mapped at
//! their own offsets, so peer address = window[peer] + offset), and which of this rank's own
//! segments the communicator has shared with its peers.
//!
//! Invariants: `bases[r]` is rank r's heap in this process (this rank's own heap for itself)
//! and never changes while the communicator lives; `shared` names own segments (offset,
//! generation) that every peer of this communicator has mapped, and their mappings stay while
//! the communicator holds its peer heaps (a child inherits its parent's record for that
//! reason: its peers hold the very heaps the parent's exchanges filled). A mapping goes when
//! the peer's segment is replaced (a new generation), released (retire.rs) or the last
//! communicator holding the peer heap is destroyed.

use super::peers::PeerHeap;
use crate::error::Result;
use crate::heap::device_heap::SegmentInfo;
use crate::heap::Allocator;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

pub struct PeerWindows {
    rank: usize,
    /// bases[r]: where rank r's heap appears in this process (own rank: the heap itself).
    pub bases: Vec<u64>,
    /// Every peer's heap (None for this rank).
    pub peers: Vec<Option<Arc<PeerHeap>>>,
    /// Own segments already shared with the peers: offset -> generation.
    shared: HashMap<u64, u64>,
}

impl PeerWindows {
    /// The windows over `peers` (entry `rank` is None: this rank's heap is at `own_base`).
    pub fn new(rank: usize, own_base: u64, peers: Vec<Option<Arc<PeerHeap>>>) -> Self {
        let bases = peers
            .iter()
            .map(|p| p.as_ref().map_or(own_base, |p| p.base))
            .collect();
        PeerWindows {
            rank,
            bases,
            peers,
            shared: HashMap::new(),
        }
    }

    /// Where an address of this rank's heap (`own`) appears for every rank: the same offset in
    /// each rank's window (the heap is symmetric), in rank order.
    pub fn at_every_rank(&self, own: u64) -> Vec<u64> {
        let offset = own - self.bases[self.rank];
        self.bases.iter().map(|b| b + offset).collect()
    }

    /// A child's windows: the parent's ranks `members` (in the child's order), the parent's
    /// peer heaps and record of shared segments (see the module header).
    pub fn subset(&self, members: &[usize]) -> Self {
        let rank = members
            .iter()
            .position(|&m| m == self.rank)
            .expect("a child includes its own rank");
        PeerWindows {
            rank,
            bases: members.iter().map(|&m| self.bases[m]).collect(),
            peers: members.iter().map(|&m| self.peers[m].clone()).collect(),
            shared: self.shared.clone(),
        }
    }

    pub fn needs_sharing(&self, seg: &SegmentInfo) -> bool {
        self.shared.get(&seg.offset) != Some(&seg.generation)
    }

    pub fn mark_shared(&mut self, seg: &SegmentInfo) {
        self.shared.insert(seg.offset, seg.generation);
    }

    /// Unmaps `peer`'s segment at `offset` if this process maps exactly that `generation` of
    /// it (the peer released it); true when it did.
    pub fn unmap_released(
        &mut self,
        _alloc: &Allocator,
        peer: usize,
        offset: u64,
        generation: u64,
    ) -> bool {
        self.peers[peer]
            .as_ref()
            .is_some_and(|p| p.unmap_released(offset, generation))
    }

    /// The generation of `peer`'s segment at `offset` as mapped here, if it is mapped.
    pub fn mapped_generation(&self, peer: usize, offset: u64) -> Option<u64> {
        self.peers[peer]
            .as_ref()
            .and_then(|p| p.generation_at(offset))
    }

    /// Maps `peer`'s segment `seg` (memory passed as `fd`) into the peer's window, unless it is
    /// mapped already.
    pub fn import(
        &mut self,
        _alloc: &Allocator,
        peer: usize,
        seg: SegmentInfo,
        fd: OwnedFd,
    ) -> Result<()> {
        match &self.peers[peer] {
            Some(p) => p.import(seg, fd),
            None => Ok(()),
        }
    }

    /// Lets go of the peer heaps (the last communicator holding one unmaps it: peers.rs).
    pub fn destroy(&mut self, _alloc: &Allocator) {
        for p in self.peers.iter_mut() {
            *p = None;
        }
        self.shared.clear();
    }
}
