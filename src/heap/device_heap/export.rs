//! What peers need of a segment: the segment that holds an address (offset, size,
//! generation), its CUDA allocation handle, and its physical memory as a file descriptor.

use super::*;

impl DeviceHeap {
    /// The segment holding `ptr` (which must lie inside a live block) and the block's bounds.
    pub fn segment_of(&self, ptr: u64) -> Result<(SegmentInfo, u64, u64)> {
        let off = ptr.wrapping_sub(self.base);
        let (&boff, b) = self
            .blocks
            .range(..=off)
            .next_back()
            .filter(|(&o, b)| off < o + b.size && b.requested().is_some())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "address {ptr:#x} is not inside a live symm_malloc block"
                ))
            })?;
        let s = &self.segments[&b.segment];
        Ok((
            SegmentInfo {
                offset: b.segment,
                size: s.size,
                generation: s.generation,
            },
            self.base + boff,
            b.size,
        ))
    }

    /// The segment that starts at `offset`, if the heap holds one now (a p2p rendezvous checks
    /// that what it mapped is still the same generation).
    pub fn segment_info(&self, offset: u64) -> Option<SegmentInfo> {
        self.segments.get(&offset).map(|s| SegmentInfo {
            offset,
            size: s.size,
            generation: s.generation,
        })
    }

    /// The CUDA allocation handle of the segment at `offset` (for binding it to a multicast
    /// object); an error on the host backend.
    pub fn segment_cuda_handle(&self, offset: u64) -> Result<u64> {
        match self.segments.get(&offset).map(|s| &s.phys) {
            Some(Phys::Cuda(h)) => Ok(*h),
            Some(Phys::Host(_)) => Err(Error::unsupported(
                "multicast needs CUDA memory; this heap uses the host backend",
            )),
            None => Err(Error::internal(format!("no segment at offset {offset:#x}"))),
        }
    }

    /// Exports the physical memory of the segment at `offset` as a file descriptor.
    pub fn export_segment(
        &self,
        backend: &dyn Backend,
        offset: u64,
    ) -> Result<std::os::fd::OwnedFd> {
        let s = self
            .segments
            .get(&offset)
            .ok_or_else(|| Error::internal(format!("no segment at offset {offset:#x}")))?;
        backend.export(self.device, &s.phys)
    }
}
