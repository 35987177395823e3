//! Peer segments that went back: at the start of every call, a communicator reads its peers'
//! release logs (heap/release_log.rs, shared memory mapped at init) and unmaps its mappings of
//! the segments they released, so their physical memory returns to the driver on every rank no
//! later than this rank's next `symm_comm_*` call.
//!
//! Invariants: a mapping is unmapped only when its peer recorded releasing exactly that
//! (offset, generation), so it can no longer be part of any collective: a call naming that
//! memory again would find a new segment (a new generation, exchanged and mapped before any
//! kernel runs) or fail the exchange. On CUDA the device is synchronized first, so no kernel
//! of an earlier call still reads what is unmapped; during a stream capture nothing is retired
//! (a synchronization there would break the capture) and the records wait for a later call.
//! Reading the logs when nothing changed costs one load per peer. A peer that released the
//! segment of its internal block (pads, LL buffers) destroyed its communicator: this one is
//! then broken (a sticky SYMM_ERR_PEER naming the peer), so no later call touches that window.
//! A child whose internal block was carved from its parent's split slot (group/slots.rs) frees no
//! segment at destroy: its rank records the block's offset under a generation of its own,
//! which the child's round told every peer (group/internal.rs), and that record counts the same.

use super::{PeerView, Who};
use crate::comm::exec::Executor;
use crate::error::{Error, Result};

/// How many of each peer's release-log records this communicator handled (the logs are the
/// shared peer heaps', peers.rs), and the peer's generation of the segment that holds this
/// communicator's internal block there (its release means the peer destroyed this
/// communicator; an older record of the same offset does not).
#[derive(Default)]
pub(in crate::comm) struct PeerReleases {
    pub seen: Vec<u64>,
    pub internal_gens: Vec<u64>,
    /// The same for the segment that holds its p2p signal pad (p2p/).
    pub pad_gens: Vec<u64>,
}

impl PeerReleases {
    /// Starts at every peer's current record count (earlier records name segments this
    /// communicator never mapped).
    pub fn starting_now(peers: &[Option<std::sync::Arc<super::peers::PeerHeap>>]) -> Self {
        PeerReleases {
            seen: peers
                .iter()
                .map(|p| p.as_ref().map_or(0, |p| p.log.count()))
                .collect(),
            internal_gens: vec![0; peers.len()],
            pad_gens: vec![0; peers.len()],
        }
    }
}

impl PeerView {
    /// Whether `peer` recorded giving back this communicator's internal block (its destroy)
    /// since the last call: for checks between calls (p2p/).
    /// `internal_seg`: the offset of the segment that holds the internal block.
    pub(in crate::comm) fn internal_released_by(&self, peer: usize, internal_seg: u64) -> bool {
        let Some(heap) = &self.windows.peers[peer] else {
            return false;
        };
        let mut records = Vec::new();
        heap.log.read_since(self.releases.seen[peer], &mut records);
        records.contains(&(internal_seg, self.releases.internal_gens[peer]))
    }

    /// Whether a peer recorded a release since the last call: one load per peer (the check
    /// every call makes first; `retire_released` runs only when it says so).
    pub(in crate::comm) fn releases_pending(&self) -> bool {
        self.windows
            .peers
            .iter()
            .zip(&self.releases.seen)
            .any(|(p, &seen)| p.as_ref().is_some_and(|p| p.log.count() != seen))
    }

    /// Unmaps the peer segments released since the last call (see the module comment); the
    /// caller asked `releases_pending` first. `segs`: the offsets of the segments of the
    /// internal block and of the p2p signal pad (a peer's release of either is its destroy,
    /// which breaks the communicator: `sticky`).
    pub(in crate::comm) fn retire_released(
        &mut self,
        who: &Who,
        exec: &dyn Executor,
        stream: u64,
        (internal_seg, pad_seg): (u64, u64),
        sticky: &mut Option<Error>,
    ) -> Result<()> {
        if !exec.quiesce(stream)? {
            return Ok(()); // capturing: a later, uncaptured call retires them
        }
        let mut records = Vec::new();
        let mut broken = None;
        for peer in 0..who.world {
            let Some(heap) = self.windows.peers[peer].clone() else {
                continue;
            };
            records.clear();
            self.releases.seen[peer] = heap.log.read_since(self.releases.seen[peer], &mut records);
            for &(offset, generation) in &records {
                if (offset == internal_seg && generation == self.releases.internal_gens[peer])
                    || (offset == pad_seg && generation == self.releases.pad_gens[peer])
                {
                    // The peer gave back its signal pads and LL buffers (or its p2p signal
                    // pad): it destroyed its
                    // communicator. Nothing may touch its window any more (a collective would
                    // read unmapped memory): the communicator is broken from now on.
                    let e = Error::peer(format!(
                        "rank {peer} destroyed its communicator (its signal pads and LL buffers \
                         were released); rank {} cannot run collectives with it any more: \
                         destroy this communicator",
                        who.rank
                    ));
                    *sticky = Some(e.clone());
                    broken = Some(e);
                }
                if self
                    .windows
                    .unmap_released(who.alloc, peer, offset, generation)
                {
                    crate::trace!(
                        "rank {}: unmapped rank {peer}'s released segment at {offset:#x} \
                         (generation {generation})",
                        who.rank
                    );
                }
            }
        }
        broken.map_or(Ok(()), Err)
    }
}
