//! What peers need of a segment: the chunks under a live block (offset, size, generation:
//! the whole segment unless it grew in place), a chunk's CUDA allocation handle, and its
//! physical memory as a file descriptor, and the generations peers match their mappings by (a
//! chunk's, or a fresh one for memory given back inside a live segment). Peers map, check and
//! unmap chunk by chunk.

use super::blocks::info;
use super::*;

impl DeviceHeap {
    /// The segment that holds `ptr`, anywhere in it: (offset, size, number of chunks).
    pub fn segment_span(&self, ptr: u64) -> Option<(u64, u64, usize)> {
        let off = ptr.wrapping_sub(self.base);
        let (&soff, s) = self.segments.range(..=off).next_back()?;
        (off < soff + s.size).then_some((soff, s.size, s.chunks.len()))
    }

    /// The chunk that starts at `offset`, if the heap holds one now.
    fn chunk_at(&self, offset: u64) -> Option<&Chunk> {
        let (_, s) = self.segments.range(..=offset).next_back()?;
        s.chunks.iter().find(|c| c.off == offset)
    }

    /// The chunk that starts at `offset`, if the heap holds one now (a p2p rendezvous checks
    /// that what it mapped is still the same generation).
    pub fn segment_info(&self, offset: u64) -> Option<SegmentInfo> {
        self.chunk_at(offset).map(info)
    }

    /// The CUDA allocation handle of the chunk at `offset` (for binding it to a multicast
    /// object); an error on the host backend.
    pub fn segment_cuda_handle(&self, offset: u64) -> Result<u64> {
        match self.chunk_at(offset).map(|c| &c.phys) {
            Some(Phys::Cuda(h)) => Ok(*h),
            Some(Phys::Host(_)) => Err(Error::unsupported(
                "multicast needs CUDA memory; this heap uses the host backend",
            )),
            None => Err(Error::internal(format!("no segment at offset {offset:#x}"))),
        }
    }

    /// Exports the physical memory of the chunk at `offset` as a file descriptor.
    pub fn export_segment(
        &self,
        backend: &dyn Backend,
        offset: u64,
    ) -> Result<std::os::fd::OwnedFd> {
        let c = self
            .chunk_at(offset)
            .ok_or_else(|| Error::internal(format!("no segment at offset {offset:#x}")))?;
        backend.export(self.device, &c.phys)
    }

    /// A generation no segment of this heap has or will have, for a record that names memory
    /// given back inside a live segment (comm/group/slots.rs: a child's carved internal block).
    pub fn fresh_generation(&mut self) -> u64 {
        let g = self.next_generation;
        self.next_generation += 1;
        g
    }

    /// Records in the release log that what lies at `offset` of generation `generation` (from
    /// `fresh_generation`) was given back, for the peers' communicators to read; no segment
    /// goes, and no peer mapping matches the record (mappings carry segment generations).
    pub fn record_given_back(&mut self, offset: u64, generation: u64) {
        debug_assert!(generation < self.next_generation);
        self.release_log.record(offset, generation);
    }
}
