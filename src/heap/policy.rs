//! The allocator's policy constants, in one place: how requests are rounded and classed, how
//! big the segments the growth ladder makes are, when a block is split, when the heap trims
//! before growing, and how much a thread cache keeps. Each was measured (bench/NOTES.md, "The
//! allocator" and "Global mode's host cost"); changing one changes placement, which
//! tests/heap_ladder.rs pins. The rules that read them: size_class.rs (classes),
//! device_heap/placement.rs (the ladder, splitting), device_heap/release.rs (trimming),
//! tcache.rs (what threads keep). Data-structure tuning that never changes placement (spin
//! counts, free-list representation thresholds, the release log's capacity) stays with its
//! structure.

/// Requests are rounded up to this (keeps every block 512-byte aligned, as PyTorch's).
pub const ROUND: u64 = 512;
/// Requests up to this size (rounded) are small and come from small segments.
pub const SMALL_MAX: u64 = 1 << 20;
/// The size of a small segment (PyTorch's `kSmallBuffer`).
pub const SMALL_SEGMENT: u64 = 2 << 20;
/// The size of a large segment, for large requests under `HUGE_MIN` (PyTorch's `kLargeBuffer`).
pub const LARGE_SEGMENT: u64 = 20 << 20;
/// Requests from this size get a segment of their own (rounded to the granularity).
pub const HUGE_MIN: u64 = 10 << 20;
/// A large block is split only when the remainder is bigger than this (a small one whenever
/// at least `ROUND` is left).
pub const LARGE_SPLIT_MIN: u64 = SMALL_MAX;
/// Reserved memory a growing heap keeps below, relative to its working set (the most allocated
/// since the last `empty_cache`), by giving back idle segments too small for the request
/// (device_heap/release.rs, `trim_before_growing`).
pub const TRIM_RATIO: f64 = 1.05;

/// Most blocks a thread keeps per device.
pub const KEEP_BLOCKS: usize = 64;
/// Most blocks a thread keeps when the block is another pool's than the default one (a graph
/// capture's, a MemPool's), small ones only (`keeps_whole`). 16, as before KEEP_BLOCKS grew: the
/// ResNet-50 capture of bench/global_memory.py added the least memory with 16 small ones
/// (bench/history/RESULTS-session-18-and-before.md, "Global mode's memory").
pub const KEEP_POOL_BLOCKS: usize = 16;
/// Most bytes a thread keeps per device.
pub const KEEP_BYTES: u64 = 256 << 20;
/// Most bytes a cache may keep, counting the block, when the block comes back from another
/// thread's free (`keep_remote`). Lower than KEEP_BYTES: while the lending thread is idle (the
/// main thread during autograd's backward), what it keeps cannot serve the freeing thread's own
/// requests, and the heap would grow for them instead (by at most this much per lending thread).
pub const KEEP_REMOTE_BYTES: u64 = 32 << 20;
