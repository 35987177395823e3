//! Memory statistics of one device, the `symm_memory_stats_t` of the C ABI.
//! Fields are only ever appended.

/// Counters of one device. All sizes are in bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes in live blocks (after rounding).
    pub allocated_bytes: u64,
    /// Bytes of physical memory held in segments.
    pub reserved_bytes: u64,
    /// Highest `allocated_bytes` seen by the heap (blocks threads keep for reuse count as
    /// allocated there: at most 256 MiB per thread and device; see `SYMMALLOC_THREAD_CACHE`).
    pub peak_allocated_bytes: u64,
    /// Live blocks.
    pub active_blocks: u64,
    /// Segments currently held.
    pub segments: u64,
    /// Physical allocations made (`cuMemCreate` calls) since start.
    pub physical_creates: u64,
    /// Allocations served from the cache.
    pub cache_hits: u64,
    /// Allocations that needed a new segment.
    pub cache_misses: u64,
    /// Peer segments currently imported and mapped by communicators on this device.
    pub peer_mappings: u64,
    /// Collectives that had to copy because a buffer was outside the heap.
    pub staged_collectives: u64,
    /// Bytes requested by live blocks (before rounding).
    pub requested_bytes: u64,
    /// Physical allocations given back since start.
    pub physical_releases: u64,
    /// Virtual size of the heap.
    pub heap_bytes: u64,
}
