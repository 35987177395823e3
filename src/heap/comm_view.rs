//! The heap as the communicator layer sees it: the few operations a collective needs (where a
//! buffer lies, the segments to share with peers, the staged-call count), each one hold of the
//! device heap's spin lock. comm reaches DeviceHeap's lock through here for its collective path.
//!
//! Invariants: every method takes the lock once and releases it before returning; nothing here
//! allocates or frees heap memory. `locate_pair`'s stamp is the lock's count of ended holds
//! after its own: equal to `Allocator::heap_releases` later exactly when nobody held the heap
//! since, so its answer still stands.

use super::device_heap::SegmentInfo;
use super::spin_lock::SpinGuard;
use super::Allocator;
use crate::error::{Error, Result};
use std::os::fd::OwnedFd;

/// A narrow view of one device's heap for comm.
pub struct CommView<'a> {
    alloc: &'a Allocator,
    device: i32,
}

pub use super::device_heap::Located;

impl<'a> CommView<'a> {
    pub fn new(alloc: &'a Allocator, device: i32) -> Self {
        Self { alloc, device }
    }

    /// Where `ptr..ptr+bytes` lies: `None` when `ptr` is outside the heap, an error when it is
    /// inside the heap but not inside one live block.
    pub fn locate(&self, ptr: u64, bytes: u64) -> Result<Located> {
        self.alloc.heap(self.device)?.locate(ptr, bytes)
    }

    /// `locate` for two buffers under one hold of the lock, with what the lock's count of
    /// ended holds (`Allocator::heap_releases`) reads once this hold ends: while it still reads
    /// that, the answer stands.
    pub fn locate_pair(&self, a: (u64, u64), b: (u64, u64)) -> Result<(Located, Located, u64)> {
        let heap = self.alloc.heap(self.device)?;
        let (x, y) = heap.locate_pair(a, b)?;
        Ok((x, y, SpinGuard::releases_after(&heap)))
    }

    /// `locate` for the scratch of a staged call, counting the call in `staged_collectives`
    /// under the same hold of the lock.
    pub fn locate_staged(&self, ptr: u64, bytes: u64) -> Result<Vec<SegmentInfo>> {
        let mut heap = self.alloc.heap(self.device)?;
        let segs = heap.locate(ptr, bytes)?.ok_or_else(|| {
            Error::invalid(format!("scratch {ptr:#x} is outside the symmetric heap"))
        })?;
        heap.stats.staged_collectives += 1;
        Ok(segs)
    }

    /// Counts one peer segment mapped (`delta` 1) or unmapped (`delta` -1) in `peer_mappings`.
    pub fn count_peer_mapping(&self, delta: i64) -> Result<()> {
        let mut heap = self.alloc.heap(self.device)?;
        if delta >= 0 {
            heap.stats.peer_mappings += delta as u64;
        } else {
            heap.stats.peer_mappings -= delta.unsigned_abs();
        }
        Ok(())
    }

    /// Records in this rank's release log that the segment at `offset` of `generation` went
    /// back (what peers see as this rank's destroy of a carved communicator).
    pub fn record_given_back(&self, offset: u64, generation: u64) -> Result<()> {
        self.alloc
            .heap(self.device)?
            .record_given_back(offset, generation);
        Ok(())
    }

    /// The heap's base address (made on first use, as every method here).
    pub fn base(&self) -> Result<u64> {
        Ok(self.alloc.heap(self.device)?.base())
    }

    /// The heap's size in bytes.
    pub fn size(&self) -> Result<u64> {
        Ok(self.alloc.heap(self.device)?.size())
    }

    /// The heap's mapping granularity.
    pub fn granularity(&self) -> Result<u64> {
        Ok(self.alloc.heap(self.device)?.granularity())
    }

    /// The heap's free ranges (offset, length), for the arena agreement.
    pub fn free_ranges(&self) -> Result<Vec<(u64, u64)>> {
        Ok(self.alloc.heap(self.device)?.free_ranges())
    }

    /// A generation no segment of this heap has had.
    pub fn fresh_generation(&self) -> Result<u64> {
        Ok(self.alloc.heap(self.device)?.fresh_generation())
    }

    /// The file descriptor of this heap's release log, for peers to map.
    pub fn release_log_fd(&self) -> Result<OwnedFd> {
        self.alloc.heap(self.device)?.release_log_fd()
    }

    /// The CUDA physical-memory handle of the segment at `offset` (multicast binding).
    pub fn segment_cuda_handle(&self, offset: u64) -> Result<u64> {
        self.alloc.heap(self.device)?.segment_cuda_handle(offset)
    }

    /// File descriptors for the segments at `offsets`, to send to peers.
    pub fn export_segments(&self, offsets: impl Iterator<Item = u64>) -> Result<Vec<OwnedFd>> {
        let heap = self.alloc.heap(self.device)?;
        offsets
            .map(|off| heap.export_segment(self.alloc.backend(), off))
            .collect()
    }
}
