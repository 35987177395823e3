//! Other devices of the process granted access to the heap (`grant_peer`): PyTorch's
//! `enablePeerAccess(dev, dev_to_access)` grants every segment of `dev_to_access`'s heap to
//! `dev`, present and future, so copies and kernels across GPUs of one process reach it (its
//! expandable segments' `addPeerAccess`). A grant maps every chunk mapped now for the peer
//! (`Backend::grant`, `cuMemSetAccess` on CUDA) and is remembered, so every chunk mapped later
//! (a new segment, a segment grown in place, one made again after a trim) is granted too,
//! before it is used (placement.rs, `new_chunk`).
//!
//! Invariants (checked by `validate_grants`): `peers` holds each peer once, never the heap's
//! own device; every chunk's `granted` holds every peer of `peers` (a chunk may carry more:
//! a grant that failed part way is not listed in `peers`, and the chunks it reached keep it,
//! which a retry then skips). On the host backend the grants are this bookkeeping alone.

use super::*;

impl DeviceHeap {
    /// The peer devices granted access to every segment, in the order granted.
    pub fn peers(&self) -> &[i32] {
        &self.peers
    }

    /// Peers granted before the heap existed (the allocator keeps them until then): the heap
    /// has no chunk yet, so they are bookkeeping only, applied to every chunk it maps.
    pub fn adopt_peers(&mut self, peers: &[i32]) {
        debug_assert!(self.segments.is_empty(), "peers adopted by a heap in use");
        for &p in peers {
            if p != self.device && !self.peers.contains(&p) {
                self.peers.push(p);
            }
        }
    }

    /// Grants `peer` access to every chunk of the heap, now and later. Idempotent: a peer
    /// already granted, or a chunk that already carries it, costs nothing. On failure `peer` is
    /// not a peer of the heap (chunks it reached keep the grant) and no allocation changes.
    /// The heap's own device needs no grant.
    pub fn grant_peer(&mut self, backend: &dyn Backend, peer: i32) -> Result<()> {
        if peer == self.device || self.peers.contains(&peer) {
            return Ok(());
        }
        backend.check_peer(self.device, peer)?;
        for seg in self.segments.values_mut() {
            for c in seg.chunks.iter_mut().filter(|c| !c.granted.contains(&peer)) {
                backend.grant(self.device, peer, self.base + c.off, c.len)?;
                c.granted.push(peer);
            }
        }
        self.peers.push(peer);
        crate::info!(
            "device {}: heap granted to device {peer} (peers {:?})",
            self.device,
            self.peers
        );
        Ok(())
    }

    /// Grants a chunk just mapped at `off` to every peer of the heap: its `granted` list.
    pub(super) fn grant_new_chunk(
        &self,
        backend: &dyn Backend,
        off: u64,
        len: u64,
    ) -> Result<Vec<i32>> {
        for &peer in &self.peers {
            backend.grant(self.device, peer, self.base + off, len)?;
        }
        Ok(self.peers.clone())
    }

    /// The peers each chunk of the segment holding `ptr` was granted to, in address order.
    pub fn chunk_grants(&self, ptr: u64) -> Option<Vec<Vec<i32>>> {
        let off = ptr.wrapping_sub(self.base);
        let (&soff, s) = self.segments.range(..=off).next_back()?;
        (off < soff + s.size).then(|| s.chunks.iter().map(|c| c.granted.clone()).collect())
    }

    /// The module header's invariants.
    pub(super) fn validate_grants(&self) -> std::result::Result<(), String> {
        for (i, &p) in self.peers.iter().enumerate() {
            if p == self.device || self.peers[..i].contains(&p) {
                return Err(format!(
                    "peers {:?} of device {} list the device itself or a peer twice",
                    self.peers, self.device
                ));
            }
        }
        for (&soff, s) in &self.segments {
            for c in &s.chunks {
                if let Some(p) = self.peers.iter().find(|p| !c.granted.contains(p)) {
                    return Err(format!(
                        "chunk {:#x}+{:#x} of segment {soff:#x} is not granted to peer device \
                         {p} (granted {:?}, heap peers {:?})",
                        c.off, c.len, c.granted, self.peers
                    ));
                }
            }
        }
        Ok(())
    }
}
