//! One device's symmetric heap: segments placed at deterministic offsets of a reserved range,
//! blocks split from and merged back into segments, free lists per pool (best fit, the
//! requesting stream's blocks and never-used memory first), stream-ordered reuse and
//! statistics.
//!
//! A block is live (handed out), free (listed for best fit, split and merged) or parked (a small
//! block freed whole onto the fast path of `parked.rs`, for the next request of its size on its
//! stream: `parks`).
//!
//! Invariants (checked by `validate`):
//! - the chunks of a segment tile it exactly, in address order, each a multiple of the
//!   granularity with its own generation (a segment has more than one only if it grew in
//!   place: grow.rs);
//! - the blocks of a segment tile it exactly, in address order, and carry its pool and class;
//!   each links back to the block before it (`prev`; `NO_PREV` for the first), and every block
//!   listed is reached by walking its segment; no two
//!   neighbouring free blocks of a segment wait on the same set of streams (those are merged on
//!   free; blocks with different pending streams stay apart, so stream sets never grow by
//!   merging);
//! - every free block is in its pool's free lists (free_lists.rs), under its class and first
//!   stream (under `UNUSED` when it has never been used), and nothing else is; every parked block waits on exactly one stream and is in the
//!   parked LIFO of (pool, that stream, its last rounded request), and nothing else is; its
//!   size passes `parks` (small);
//! - `segment.live` counts the segment's live and parked blocks (so a segment with parked
//!   blocks is never released before they are drained); stats equal the sums over live blocks
//!   and segments;
//! - a pool being released has no parked blocks and no uses left (a pool is released at its
//!   last use's `release_pool`); `releasing_pools` counts the pools being released;
//! - every segment's pool is listed in `pools`, and `Pool::segments` counts its segments; a
//!   segment changes pool only whole and free (no live or parked block), from a donor (the
//!   default pool or a pool being released) to another pool, neither of them reserved (the
//!   internal pool, an arena's: donors.rs, `adopt_segment`); live user pools never give one;
//! - `empty_cache` gives back the free segments of the default and internal pools and of pools
//!   being released; a live user pool keeps its own (a captured graph replays into its pool's
//!   free blocks), as PyTorch's `empty_cache` does;
//! - segments and the range allocator's free ranges partition the heap;
//! - every chunk is granted to every peer device the heap was granted to (peers.rs).
//!
//! Determinism: a placement decision reads only the call sequence (sizes, pools, which calls
//! used the same stream, capture state), never the clock or the progress of the GPU; so does
//! the choice of a donor's segment (best fit by size, then offset).
//!
//! Capture: a block or donor segment used by another stream than a capturing one is never
//! given to it (ordering would join an eager stream into the capture); memory goes back to the
//! backend only after waiting for the device, which is never tried on a capturing stream (the
//! segment then stays cached until a later `empty_cache`).
//!
//! The layer's jobs, a file each: this file holds the structures and the allocation path;
//! `live.rs` a live block's accounting, its free and stream reuse (`record_stream`); `placement.rs`
//! where a block comes from (best fit over the free sets, splitting, new segments at
//! deterministic offsets, merging on free); `donors.rs` whole free segments taken from donor
//! pools; `grow.rs` segments that grow in place by a chunk;
//! `release.rs` memory going back (parked drains, segment release, `empty_cache`, pools);
//! `export.rs` what peers need of a segment (its chunks); `peers.rs` other devices of the process
//! granted access to every chunk; `validate.rs` the check of every
//! invariant above; `tracked.rs` live blocks lent to thread caches; `free_lists.rs` a pool's
//! free blocks ordered for best fit; `blocks.rs` the way through a segment's blocks. Each released chunk is
//! recorded in the heap's `ReleaseLog` (shared memory its peers read, to unmap their mappings
//! of it). Statistics are the `Stats` of `stats.rs`, kept here as blocks change state.

mod arena;
mod blocks;
mod donors;
mod export;
mod free_lists;
mod grow;
mod inspect;
mod live;
mod peers;
mod placement;
mod release;
mod tracked;
mod validate;

use super::backend::{Backend, Phys, Stream};
use super::device_stats::{slot, HeapCounters};
use super::parked::Parked;
use super::pools::{PoolId, DEFAULT_POOL, INTERNAL_POOL};
use super::ranges::Ranges;
use super::release_log::ReleaseLog;
use super::stats::Stats;
use crate::error::{Error, Result, Status};
pub use blocks::Located;
pub use inspect::BlockView;
use std::collections::BTreeMap;

pub use super::size_class::{
    class_of, round_request, segment_size, Class, HUGE_MIN, LARGE_SEGMENT, ROUND, SMALL_MAX,
    SMALL_SEGMENT,
};
/// `Block::prev` of a segment's first block.
const NO_PREV: u64 = u64::MAX;
use super::policy::LARGE_SPLIT_MIN;
/// The free lists' stream of never-used memory, which waits on no stream (no CUDA stream
/// handle has this value; the legacy default stream is 0).
pub const UNUSED: Stream = u64::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Handed out; holds the requested size.
    Live(u64),
    /// Listed in its pool's free sets.
    Free,
    /// Kept whole in the parked LIFO of its last rounded request.
    Parked,
}

#[derive(Debug)]
struct Block {
    size: u64,
    segment: u64,
    /// The segment's pool and class (copied here so the paths need no segment lookup).
    pool: PoolId,
    class: Class,
    /// The offset of the block before it in its segment; `NO_PREV` for the segment's first.
    /// (The one after it starts at `offset + size`, when that is still inside the segment.)
    prev: u64,
    state: State,
    /// Streams whose work must finish before the memory is reused; the first is the stream of
    /// the last allocation or free.
    streams: Vec<Stream>,
}

impl Block {
    fn is_free(&self) -> bool {
        self.state == State::Free
    }
    fn requested(&self) -> Option<u64> {
        match self.state {
            State::Live(r) => Some(r),
            _ => None,
        }
    }
}

/// One physical allocation mapped into a segment. A segment starts as one chunk and may grow
/// in place by more, mapped right after its end (grow.rs); blocks span
/// chunks freely. A chunk is what peers map, unmap and read in the release log (`SegmentInfo`).
#[derive(Debug)]
struct Chunk {
    /// Heap offset of its first byte.
    off: u64,
    len: u64,
    generation: u64,
    phys: Phys,
    /// The peer devices granted access to it (peers.rs): every grant of the heap, at least.
    granted: Vec<i32>,
}

#[derive(Debug)]
struct Segment {
    size: u64,
    pool: PoolId,
    class: Class,
    /// In address order, tiling `[offset, offset + size)`; never empty.
    chunks: Vec<Chunk>,
    live: u64,
}

#[derive(Default, Debug)]
struct Pool {
    /// Free blocks by (class, first stream), best fit first (free_lists.rs).
    free: free_lists::FreeLists,
    segments: u64,
    releasing: bool,
    /// Routes begun to the pool and not yet released (`hold_pool`, `unhold_pool`).
    uses: u64,
}

/// What peers need to know about one chunk of a segment (the whole segment unless it grew in
/// place): where it lies, how long it is, and which generation of that memory it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    pub offset: u64,
    pub size: u64,
    pub generation: u64,
}

pub struct DeviceHeap {
    device: i32,
    base: u64,
    ranges: Ranges,
    gran: u64,
    segments: BTreeMap<u64, Segment>,
    /// Every block by offset. A segment's blocks are reached in address order from its offset
    /// (`segment_blocks`), a block's neighbours through `prev` and `offset + size`: no ordered
    /// map on the allocation and free paths (bench/NOTES.md, "Global mode's host cost").
    blocks: crate::heap::addr_map::AddrMap<Block>,
    pools: BTreeMap<PoolId, Pool>,
    parked: Parked,
    releasing_pools: usize,
    next_generation: u64,
    /// Every segment given back, for the peers that mapped it (release_log.rs).
    release_log: ReleaseLog,
    /// Live blocks lent to thread caches: offset -> cache id (tracked.rs).
    tracked: crate::heap::addr_map::AddrMap<u64>,
    /// Whole free segments moved from a donor pool to another pool (donors.rs).
    adopted_segments: u64,
    /// Segments grown in place by a chunk (grow.rs).
    grown_in_place: u64,
    /// Communicator arenas by id (arena.rs).
    arenas: BTreeMap<u64, arena::Arena>,
    next_arena: u64,
    pub stats: Stats,
    /// PyTorch's statistics kept by the heap (device_stats.rs).
    pub counters: HeapCounters,
    /// Most bytes the heap may hold in segments (`symm_set_memory_limit`); 0: no limit.
    limit: u64,
    /// The most allocated since the last `empty_cache` (release.rs, `trim_before_growing`); not
    /// reset with the statistics' peaks, so a statistics call never changes placement.
    working_set: u64,
    /// Peer devices granted access to every segment, present and future (peers.rs), in the
    /// order granted.
    peers: Vec<i32>,
}

/// One allocation request as the growth ladder (placement.rs, `place`) and its rungs see it:
/// the pool it is routed to, its size class, the request rounded to `ROUND`, the request itself
/// and the stream it is for.
#[derive(Clone, Copy, Debug)]
pub(super) struct Request {
    pub pool: PoolId,
    pub class: Class,
    pub rounded: u64,
    pub size: u64,
    pub stream: Stream,
}

/// Where the placement ladder found a request's memory.
pub(super) enum Placed {
    /// A parked block kept whole for this (pool, stream, size): live at once.
    Parked(u64),
    /// A free block (found, adopted, grown or new) that `take` splits and makes live.
    Free(u64),
}

/// The rungs of the ladder (placement.rs, `place`) that take blocks back from the thread
/// caches in front of the heap, which only the allocator reaches (heap/caches.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reclaim {
    /// Before the heap takes new memory: this thread's kept blocks (and exited threads').
    OwnCaches,
    /// Out of memory: every thread's kept blocks.
    AllCaches,
}

/// The allocator's hook for those rungs: takes blocks back from caches into the heap and says
/// how many went back.
pub type Reclaimer<'a> = &'a mut dyn FnMut(&mut DeviceHeap, Reclaim) -> Result<usize>;

/// Whether a freed block of `rounded` bytes of `pool` may be kept whole for the next request of
/// its size (parked here, or kept by a thread cache) rather than merged with its free neighbours
/// at once. Not for large blocks of a pool other than the default one (a graph capture's, a
/// MemPool's): reusing the block of the same size leaves its free neighbours apart, where
/// merging lets a larger request fit, and such a pool keeps its footprint for the life of its
/// graphs. Merged at once and placed by best fit, as PyTorch's allocator places them, the first
/// capture of `bench/global_memory.py`'s ten shared-pool graphs made as much memory as PyTorch's
/// allocator; kept whole, more (its request trace replayed on the host backend, `alloc_bench
/// --replay`; bench/NOTES.md, "The allocator").
pub fn keeps_whole(pool: PoolId, rounded: u64) -> bool {
    pool == DEFAULT_POOL || class_of(rounded) == Class::Small
}

/// Whether the heap parks a block of `rounded` bytes freed whole on its only stream (rather than
/// merging it with its free neighbours at once): small ones only. A thread cache keeps large
/// blocks whole (`keeps_whole`); what reaches the heap of them was merged back by the next large
/// request's miss anyway (which gives best fit every large block, merged), so parking only added
/// a push and a drain per block: of the recorded ResNet-50 step's 12,540 large requests over six
/// repetitions, 59 found a parked block, 9,609 missed (`step_replay`; bench/NOTES.md).
pub fn parks(rounded: u64) -> bool {
    class_of(rounded) == Class::Small
}

impl DeviceHeap {
    pub fn new(backend: &dyn Backend, device: i32, size: u64) -> Result<Self> {
        let gran = backend.granularity(device)?;
        let size = size.next_multiple_of(gran);
        let base = backend.reserve(device, size)?;
        Ok(DeviceHeap {
            device,
            base,
            ranges: Ranges::new(size, gran),
            gran,
            segments: BTreeMap::new(),
            blocks: Default::default(),
            pools: BTreeMap::new(),
            parked: Parked::default(),
            releasing_pools: 0,
            next_generation: 1,
            release_log: ReleaseLog::new()?,
            tracked: Default::default(),
            adopted_segments: 0,
            grown_in_place: 0,
            arenas: BTreeMap::new(),
            next_arena: 1,
            stats: Stats {
                heap_bytes: size,
                ..Stats::default()
            },
            counters: HeapCounters::default(),
            limit: 0,
            working_set: 0,
            peers: Vec::new(),
        })
    }

    pub fn base(&self) -> u64 {
        self.base
    }
    pub fn size(&self) -> u64 {
        self.ranges.size()
    }
    pub fn contains(&self, ptr: u64) -> bool {
        ptr >= self.base && ptr < self.base + self.size()
    }

    /// Caps the bytes the heap holds in segments at `bytes` (0: no cap): a request that would
    /// need more fails with out of memory, as PyTorch's `set_per_process_memory_fraction` does.
    pub fn set_limit(&mut self, bytes: u64) {
        self.limit = bytes;
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The block size of the live block at `ptr` (the request rounded, or the whole free block
    /// when the rest was too small to split).
    pub fn block_size(&self, ptr: u64) -> Option<u64> {
        self.blocks
            .get(&ptr.wrapping_sub(self.base))
            .map(|b| b.size)
    }

    /// The largest free block of the default pool, in bytes (PyTorch's `cacheInfo`, which
    /// cuDNN's benchmark mode reads to size its workspace).
    pub fn largest_free_block(&self) -> u64 {
        let free = self
            .pools
            .get(&DEFAULT_POOL)
            .map_or(0, |p| p.free.largest());
        let parked = self
            .parked
            .entries()
            .filter(|((pool, _, _), _)| *pool == DEFAULT_POOL)
            .map(|(_, off)| self.blocks[&off].size)
            .max()
            .unwrap_or(0);
        free.max(parked)
    }

    /// How many whole free segments pools have taken from donor pools so far.
    pub fn adopted_segments(&self) -> u64 {
        self.adopted_segments
    }

    /// How many times a segment grew in place by a chunk so far.
    pub fn grown_in_place(&self) -> u64 {
        self.grown_in_place
    }

    /// Whether a pool of this heap is being released (its blocks then go back whole).
    pub fn releasing_any(&self) -> bool {
        self.releasing_pools > 0
    }

    /// A descriptor of the release log, for a communicator to hand its peers.
    pub fn release_log_fd(&self) -> Result<std::os::fd::OwnedFd> {
        self.release_log.export()
    }

    /// Allocates `size` bytes for `stream` in `pool`; returns the address. With `caches`, the
    /// ladder takes blocks back from the thread caches at its two rungs for them (placement.rs,
    /// `place`); without, it never does (a communicator arena's blocks, which caches never hold).
    pub fn malloc(
        &mut self,
        backend: &dyn Backend,
        size: u64,
        stream: Stream,
        pool: PoolId,
        caches: Option<Reclaimer<'_>>,
    ) -> Result<u64> {
        if size > self.size() {
            // Out of memory: the caches' blocks go back as for any other (no use to this one).
            if let Some(reclaim) = caches {
                reclaim(self, Reclaim::AllCaches)?;
            }
            return Err(Error::oom(format!(
                "out of memory: size {size} exceeds the heap of device {} ({} bytes; set \
                 SYMMALLOC_HEAP_SIZE)",
                self.device,
                self.size()
            )));
        }
        self.check_arena_pool(pool)?;
        let rounded = round_request(size);
        let req = Request {
            pool,
            class: class_of(rounded),
            rounded,
            size,
            stream,
        };
        let off = self.place(backend, &req, caches)?;
        Ok(self.base + off)
    }
}
