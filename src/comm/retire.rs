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

use super::Communicator;
use crate::cuda;
use crate::error::{Error, Result};
use crate::heap::release_log::ReleaseView;

/// Each peer's release log (None for this rank) and how many of its records were handled.
#[derive(Default)]
pub(super) struct PeerReleases {
    pub views: Vec<Option<ReleaseView>>,
    pub seen: Vec<u64>,
}

impl Communicator {
    /// Unmaps the peer segments released since the last call (see the module comment).
    pub(super) fn retire_released(&mut self, stream: u64) -> Result<()> {
        let pending = self
            .releases
            .views
            .iter()
            .zip(&self.releases.seen)
            .any(|(v, &seen)| v.as_ref().is_some_and(|v| v.count() != seen));
        if !pending {
            return Ok(());
        }
        if !self.host {
            if cuda::driver::is_capturing(self.device, stream)? {
                return Ok(()); // a later, uncaptured call retires them
            }
            cuda::mem::sync_device(self.device)?;
        }
        let mut records = Vec::new();
        let mut broken = None;
        for peer in 0..self.world {
            let Some(view) = &self.releases.views[peer] else {
                continue;
            };
            records.clear();
            self.releases.seen[peer] = view.read_since(self.releases.seen[peer], &mut records);
            for &(offset, generation) in &records {
                if offset == self.internal_seg || offset == self.p2p.pad_seg {
                    // The peer gave back its signal pads and LL buffers (or its p2p signal
                    // pad): it destroyed its
                    // communicator. Nothing may touch its window any more (a collective would
                    // read unmapped memory): the communicator is broken from now on.
                    let e = Error::peer(format!(
                        "rank {peer} destroyed its communicator (its signal pads and LL buffers \
                         were released); rank {} cannot run collectives with it any more: \
                         destroy this communicator",
                        self.rank
                    ));
                    self.sticky = Some(e.clone());
                    broken = Some(e);
                }
                if self
                    .windows
                    .unmap_released(self.alloc, peer, offset, generation)
                {
                    crate::trace!(
                        "rank {}: unmapped rank {peer}'s released segment at {offset:#x} \
                         (generation {generation})",
                        self.rank
                    );
                }
            }
        }
        broken.map_or(Ok(()), Err)
    }
}
