//! One device's symmetric heap: segments placed at deterministic offsets of a reserved range,
//! blocks split from and merged back into segments, free lists per pool (best fit, the
//! requesting stream's blocks first), stream-ordered reuse and statistics.
//!
//! A block is live (handed out), free (listed for best fit, split and merged) or parked (freed
//! whole onto the fast path of `parked.rs`, for the next request of its size on its stream).
//!
//! Invariants (checked by `validate`):
//! - the blocks of a segment tile it exactly, in address order, and carry its pool; no two
//!   neighbouring free blocks of a segment wait on the same set of streams (those are merged on
//!   free; blocks with different pending streams stay apart, so stream sets never grow by
//!   merging);
//! - every free block is in its pool's `free_any` and `free_by_stream` sets, under its first
//!   stream, and nothing else is; every parked block waits on exactly one stream and is in the
//!   parked LIFO of (pool, that stream, its last rounded request), and nothing else is;
//! - `segment.live` counts the segment's live and parked blocks (so a segment with parked
//!   blocks is never released before they are drained); stats equal the sums over live blocks
//!   and segments;
//! - a pool being released has no parked blocks; `releasing_pools` counts the pools being
//!   released;
//! - segments and the range allocator's free ranges partition the heap.
//!
//! Determinism: a placement decision reads only the call sequence (sizes, pools, which calls
//! used the same stream, capture state), never the clock or the progress of the GPU.

use super::backend::{Backend, Phys, Stream};
use super::parked::Parked;
use super::pools::PoolId;
use super::ranges::Ranges;
use super::stats::Stats;
use crate::error::{Error, Result, Status};
use std::collections::{BTreeMap, BTreeSet};

/// Requests are rounded up to this (keeps every block 512-byte aligned).
pub const ROUND: u64 = 512;
/// Requests up to this size come from small segments.
pub const SMALL_MAX: u64 = 1 << 20;
pub const SMALL_SEGMENT: u64 = 2 << 20;
pub const LARGE_SEGMENT: u64 = 20 << 20;
/// Requests from this size get a segment of their own (rounded to the granularity).
pub const HUGE_MIN: u64 = 10 << 20;
/// A large block is split only when the remainder is bigger than this.
const LARGE_SPLIT_MIN: u64 = SMALL_MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Small,
    Large,
}

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
    /// The segment's pool (copied here so the fast path needs no segment lookup).
    pool: PoolId,
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

#[derive(Debug)]
struct Segment {
    size: u64,
    pool: PoolId,
    class: Class,
    generation: u64,
    phys: Phys,
    live: u64,
}

#[derive(Default, Debug)]
struct Pool {
    free_any: BTreeSet<(Class, u64, u64)>,
    free_by_stream: BTreeSet<(Class, Stream, u64, u64)>,
    segments: u64,
    releasing: bool,
}

/// What peers need to know about the segment that holds an address.
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
    blocks: BTreeMap<u64, Block>,
    pools: BTreeMap<PoolId, Pool>,
    parked: Parked,
    releasing_pools: usize,
    next_generation: u64,
    pub stats: Stats,
}

pub fn round_request(size: u64) -> u64 {
    size.div_ceil(ROUND).max(1) * ROUND
}

pub fn class_of(rounded: u64) -> Class {
    if rounded <= SMALL_MAX {
        Class::Small
    } else {
        Class::Large
    }
}

fn segment_size(class: Class, rounded: u64, gran: u64) -> u64 {
    let s = match class {
        Class::Small => SMALL_SEGMENT,
        Class::Large if rounded < HUGE_MIN => LARGE_SEGMENT,
        Class::Large => rounded,
    };
    s.next_multiple_of(gran)
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
            blocks: BTreeMap::new(),
            pools: BTreeMap::new(),
            parked: Parked::default(),
            releasing_pools: 0,
            next_generation: 1,
            stats: Stats {
                heap_bytes: size,
                ..Stats::default()
            },
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

    /// Allocates `size` bytes for `stream` in `pool`; returns the address.
    pub fn malloc(
        &mut self,
        backend: &dyn Backend,
        size: u64,
        stream: Stream,
        pool: PoolId,
    ) -> Result<u64> {
        if size > self.size() {
            return Err(Error::invalid(format!(
                "size {size} exceeds the heap of device {} ({} bytes; set SYMMALLOC_HEAP_SIZE)",
                self.device,
                self.size()
            )));
        }
        let rounded = round_request(size);
        if let Some(off) = self.parked.pop(&(pool, stream, rounded)) {
            self.unpark_live(off, size);
            return Ok(self.base + off);
        }
        let class = class_of(rounded);
        self.set_releasing(pool, false);
        if class == Class::Large {
            // Large sizes vary (sequence lengths, packing): give best fit every large parked
            // block of the pool, merged, rather than splitting fresh memory around them.
            self.drain_parked(Some(pool), |r| class_of(r) == Class::Large);
        }
        let mut found = self.find_free(backend, pool, class, rounded, stream)?;
        if found.is_none() && self.drain_parked(Some(pool), |_| true) > 0 {
            // Parked blocks merged back with their neighbours may fit now.
            found = self.find_free(backend, pool, class, rounded, stream)?;
        }
        let off = match found {
            Some(off) => {
                self.stats.cache_hits += 1;
                off
            }
            None => {
                self.stats.cache_misses += 1;
                self.new_segment(backend, pool, class, rounded, size)?
            }
        };
        self.take(backend, off, rounded, size, stream)?;
        Ok(self.base + off)
    }

    /// The fast path's hit: the parked block at `off` (which waits only on the requesting
    /// stream) becomes live for `requested` bytes.
    fn unpark_live(&mut self, off: u64, requested: u64) {
        let b = self.blocks.get_mut(&off).expect("parked block exists");
        debug_assert_eq!(b.state, State::Parked);
        b.state = State::Live(requested);
        let size = b.size;
        self.count_live(size, requested);
        self.stats.cache_hits += 1;
    }

    fn count_live(&mut self, size: u64, requested: u64) {
        self.stats.allocated_bytes += size;
        self.stats.requested_bytes += requested;
        self.stats.active_blocks += 1;
        self.stats.peak_allocated_bytes = self
            .stats
            .peak_allocated_bytes
            .max(self.stats.allocated_bytes);
    }

    /// Returns the parked blocks of `pool` (all pools with `None`) to the free lists, merged
    /// with their free neighbours; returns how many there were.
    fn drain_parked(&mut self, pool: Option<PoolId>, sizes: impl Fn(u64) -> bool) -> usize {
        if self.parked.is_empty() {
            return 0;
        }
        let offs = self.parked.drain(pool, sizes);
        for &off in &offs {
            let b = self.blocks.get_mut(&off).expect("parked block exists");
            debug_assert_eq!(b.state, State::Parked);
            b.state = State::Free;
            let seg = b.segment;
            self.segments.get_mut(&seg).expect("segment").live -= 1;
            let merged = self.merge_neighbours(off);
            self.list_free(merged);
        }
        offs.len()
    }

    fn set_releasing(&mut self, pool: PoolId, releasing: bool) {
        let p = self.pools.entry(pool).or_default();
        if p.releasing != releasing {
            p.releasing = releasing;
            if releasing {
                self.releasing_pools += 1;
            } else {
                self.releasing_pools -= 1;
            }
        }
    }

    fn remove_pool(&mut self, pool: PoolId) {
        if self.pools.remove(&pool).is_some_and(|p| p.releasing) {
            self.releasing_pools -= 1;
        }
    }

    /// Best fit among the pool's free blocks of the class: the requesting stream's first, then
    /// any stream's. A block used by other streams is taken only when ordering is possible
    /// (nothing involved is being captured into a graph).
    fn find_free(
        &self,
        backend: &dyn Backend,
        pool: PoolId,
        class: Class,
        rounded: u64,
        stream: Stream,
    ) -> Result<Option<u64>> {
        let Some(p) = self.pools.get(&pool) else {
            return Ok(None);
        };
        let mut capturing: Option<bool> = None;
        let mut usable = |off: u64| -> Result<bool> {
            let b = &self.blocks[&off];
            if b.streams.iter().all(|&s| s == stream) {
                return Ok(true);
            }
            if capturing.is_none() {
                capturing = Some(backend.is_capturing(self.device, stream)?);
            }
            if capturing == Some(true) {
                return Ok(false);
            }
            for &s in &b.streams {
                if s != stream && backend.is_capturing(self.device, s)? {
                    return Ok(false);
                }
            }
            Ok(true)
        };
        let own = (class, stream, rounded, 0)..=(class, stream, u64::MAX, u64::MAX);
        for &(_, _, _, off) in p.free_by_stream.range(own) {
            if usable(off)? {
                return Ok(Some(off));
            }
        }
        for &(c, _, off) in p.free_any.range((class, rounded, 0)..) {
            if c != class {
                break;
            }
            if usable(off)? {
                return Ok(Some(off));
            }
        }
        Ok(None)
    }

    fn new_segment(
        &mut self,
        backend: &dyn Backend,
        pool: PoolId,
        class: Class,
        rounded: u64,
        requested: u64,
    ) -> Result<u64> {
        let len = segment_size(class, rounded, self.gran);
        match self.try_new_segment(backend, pool, class, len) {
            Err(e) if e.status == Status::ErrOutOfMemory => {
                // Give every cached segment back and try once more.
                self.empty_cache(backend)?;
                self.try_new_segment(backend, pool, class, len)
                    .map_err(|e2| {
                        Error::oom(format!(
                            "out of memory on device {}: requested {requested} bytes (segment of \
                         {len}); allocated {} bytes, reserved {} bytes, device free {}; {}",
                            self.device,
                            self.stats.allocated_bytes,
                            self.stats.reserved_bytes,
                            backend
                                .free_bytes(self.device)
                                .map_or("unknown".into(), |f| f.to_string()),
                            if e2.status == Status::ErrOutOfMemory {
                                e.message
                            } else {
                                e2.message
                            }
                        ))
                    })
            }
            other => other,
        }
    }

    fn try_new_segment(
        &mut self,
        backend: &dyn Backend,
        pool: PoolId,
        class: Class,
        len: u64,
    ) -> Result<u64> {
        let off = self.ranges.alloc(len).ok_or_else(|| {
            Error::oom(format!(
                "heap address space of device {} exhausted: no free range of {len} bytes \
                 ({} of {} bytes unused; raise SYMMALLOC_HEAP_SIZE)",
                self.device,
                self.ranges.free_bytes(),
                self.size()
            ))
        })?;
        let phys = match backend.create(self.device, len) {
            Ok(p) => p,
            Err(e) => {
                self.ranges.free(off, len);
                return Err(e);
            }
        };
        if let Err(e) = backend.map(self.device, self.base + off, len, &phys) {
            let _ = backend.release(phys);
            self.ranges.free(off, len);
            return Err(e);
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        self.segments.insert(
            off,
            Segment {
                size: len,
                pool,
                class,
                generation,
                phys,
                live: 0,
            },
        );
        self.blocks.insert(
            off,
            Block {
                size: len,
                segment: off,
                pool,
                state: State::Free,
                streams: vec![],
            },
        );
        let p = self.pools.entry(pool).or_default();
        p.segments += 1;
        p.free_any.insert((class, len, off));
        p.free_by_stream.insert((class, 0, len, off));
        self.stats.physical_creates += 1;
        self.stats.segments += 1;
        self.stats.reserved_bytes += len;
        Ok(off)
    }

    fn free_key(&self, off: u64) -> (PoolId, Class, Stream, u64) {
        let b = &self.blocks[&off];
        let seg = &self.segments[&b.segment];
        (
            seg.pool,
            seg.class,
            b.streams.first().copied().unwrap_or(0),
            b.size,
        )
    }

    fn unlist_free(&mut self, off: u64) {
        let (pool, class, stream, size) = self.free_key(off);
        let p = self.pools.get_mut(&pool).expect("pool of a segment exists");
        p.free_any.remove(&(class, size, off));
        p.free_by_stream.remove(&(class, stream, size, off));
    }

    fn list_free(&mut self, off: u64) {
        let (pool, class, stream, size) = self.free_key(off);
        let p = self.pools.get_mut(&pool).expect("pool of a segment exists");
        p.free_any.insert((class, size, off));
        p.free_by_stream.insert((class, stream, size, off));
    }

    /// Turns the free block at `off` into a live one of `rounded` bytes for `stream`.
    fn take(
        &mut self,
        backend: &dyn Backend,
        off: u64,
        rounded: u64,
        requested: u64,
        stream: Stream,
    ) -> Result<()> {
        // Order the new user after every other stream that used the memory. On error the
        // block stays free and listed.
        let waits: Vec<Stream> = self.blocks[&off]
            .streams
            .iter()
            .copied()
            .filter(|&s| s != stream)
            .collect();
        for s in waits {
            backend.order(self.device, stream, s)?;
        }
        self.unlist_free(off);
        let block = self.blocks.get_mut(&off).expect("free block exists");
        let class = self.segments[&block.segment].class;
        let rest = block.size - rounded;
        let split = match class {
            Class::Small => rest >= ROUND,
            Class::Large => rest > LARGE_SPLIT_MIN,
        };
        if split {
            let streams = block.streams.clone();
            block.size = rounded;
            let (segment, pool) = (block.segment, block.pool);
            self.blocks.insert(
                off + rounded,
                Block {
                    size: rest,
                    segment,
                    pool,
                    state: State::Free,
                    streams,
                },
            );
            self.list_free(off + rounded);
        }
        let block = self.blocks.get_mut(&off).expect("block exists");
        let size = block.size;
        block.state = State::Live(requested);
        block.streams.clear();
        block.streams.push(stream);
        let seg = block.segment;
        self.segments.get_mut(&seg).expect("segment exists").live += 1;
        self.count_live(size, requested);
        Ok(())
    }

    /// The offset and requested size of the live block at `ptr`.
    fn live_block(&self, ptr: u64, what: &str) -> Result<(u64, u64)> {
        let off = ptr.wrapping_sub(self.base);
        match self.blocks.get(&off) {
            Some(b) => match b.requested() {
                Some(r) => Ok((off, r)),
                None => Err(Error::invalid(format!(
                    "{what}({ptr:#x}): double free or use after free: the block is already free"
                ))),
            },
            None => Err(Error::invalid(format!(
                "{what}({ptr:#x}): pointer was not returned by symm_malloc on device {}",
                self.device
            ))),
        }
    }

    /// Frees the block at `ptr`; `size` must be the size it was allocated with.
    pub fn free(
        &mut self,
        backend: &dyn Backend,
        ptr: u64,
        size: u64,
        stream: Stream,
    ) -> Result<()> {
        let (off, requested) = self.live_block(ptr, "symm_free")?;
        if requested != size {
            return Err(Error::invalid(format!(
                "symm_free({ptr:#x}, size={size}): the block was allocated with size \
                 {requested}; expected the same size"
            )));
        }
        let block = self.blocks.get_mut(&off).expect("live block");
        let bsize = block.size;
        self.stats.allocated_bytes -= bsize;
        self.stats.requested_bytes -= requested;
        self.stats.active_blocks -= 1;
        let pool_releasing =
            self.releasing_pools > 0 && self.pools.get(&block.pool).is_some_and(|p| p.releasing);
        if !pool_releasing && block.streams.iter().all(|&s| s == stream) {
            // Fast path: only this stream used the block, so its next user on this stream
            // needs no ordering. Keep it whole for the next request of the same size.
            block.state = State::Parked;
            block.streams.clear();
            block.streams.push(stream);
            let key = (block.pool, stream, round_request(requested));
            self.parked.push(key, off);
            return Ok(());
        }
        block.state = State::Free;
        let mut streams = vec![stream];
        streams.extend(block.streams.iter().copied().filter(|&s| s != stream));
        block.streams = streams;
        let seg = block.segment;
        let segment = self.segments.get_mut(&seg).expect("segment");
        segment.live -= 1;
        let (seg_live, pool) = (segment.live, segment.pool);
        let merged = self.merge_neighbours(off);
        self.list_free(merged);
        if seg_live == 0 && self.pools.get(&pool).is_some_and(|p| p.releasing) {
            self.release_segment(backend, seg)?;
        }
        Ok(())
    }

    /// Merges the free block at `off` with free neighbours in its segment that wait on the same
    /// streams; returns the offset of the merged block (not yet listed as free).
    fn merge_neighbours(&mut self, mut off: u64) -> u64 {
        let seg = self.blocks[&off].segment;
        // Never-used memory (no streams) merges with anything; used memory only with memory
        // that waits on the same streams.
        let same = |a: &[Stream], b: &[Stream]| {
            a.is_empty() || b.is_empty() || (a.len() == b.len() && a.iter().all(|s| b.contains(s)))
        };
        if let Some((&prev, pb)) = self.blocks.range(..off).next_back() {
            if pb.segment == seg && pb.is_free() && same(&pb.streams, &self.blocks[&off].streams) {
                self.unlist_free(prev);
                let b = self.blocks.remove(&off).expect("block");
                let p = self.blocks.get_mut(&prev).expect("prev");
                p.size += b.size;
                let mut streams = b.streams;
                for &s in &p.streams {
                    if !streams.contains(&s) {
                        streams.push(s);
                    }
                }
                p.streams = streams;
                off = prev;
            }
        }
        let next = off + self.blocks[&off].size;
        let mine = self.blocks[&off].streams.clone();
        if self
            .blocks
            .get(&next)
            .is_some_and(|n| n.segment == seg && n.is_free() && same(&n.streams, &mine))
        {
            self.unlist_free(next);
            let n = self.blocks.remove(&next).expect("next");
            let b = self.blocks.get_mut(&off).expect("block");
            b.size += n.size;
            for s in n.streams {
                if !b.streams.contains(&s) {
                    b.streams.push(s);
                }
            }
        }
        off
    }

    fn release_segment(&mut self, backend: &dyn Backend, seg: u64) -> Result<()> {
        let s = &self.segments[&seg];
        debug_assert_eq!(s.live, 0);
        let (len, pool) = (s.size, s.pool);
        // A free segment may still hold several free blocks (different pending streams).
        let offs: Vec<u64> = self.blocks.range(seg..seg + len).map(|(&o, _)| o).collect();
        backend.unmap(self.device, self.base + seg, len)?;
        for o in offs {
            self.unlist_free(o);
            self.blocks.remove(&o);
        }
        let s = self.segments.remove(&seg).expect("segment");
        backend.release(s.phys)?;
        self.ranges.free(seg, len);
        let p = self.pools.get_mut(&pool).expect("pool");
        p.segments -= 1;
        if p.segments == 0 && p.releasing {
            self.remove_pool(pool);
        }
        self.stats.segments -= 1;
        self.stats.reserved_bytes -= len;
        self.stats.physical_releases += 1;
        Ok(())
    }

    fn release_free_segments(&mut self, backend: &dyn Backend, pool: Option<PoolId>) -> Result<()> {
        let idle: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| s.live == 0 && pool.is_none_or(|p| s.pool == p))
            .map(|(&o, _)| o)
            .collect();
        for seg in idle {
            self.release_segment(backend, seg)?;
        }
        Ok(())
    }

    /// Returns every segment without live blocks to the backend.
    pub fn empty_cache(&mut self, backend: &dyn Backend) -> Result<()> {
        self.drain_parked(None, |_| true);
        self.release_free_segments(backend, None)
    }

    /// Marks `pool` released: its free segments go now, the others when their last block is
    /// freed. Allocating into the pool again revives it.
    pub fn release_pool(&mut self, backend: &dyn Backend, pool: PoolId) -> Result<()> {
        if !self.pools.contains_key(&pool) {
            return Ok(());
        }
        self.drain_parked(Some(pool), |_| true);
        self.set_releasing(pool, true);
        self.release_free_segments(backend, Some(pool))?;
        if self.pools.get(&pool).is_some_and(|p| p.segments == 0) {
            self.remove_pool(pool);
        }
        Ok(())
    }

    /// The next reuse of the block at `ptr` also waits for `stream`'s work.
    pub fn record_stream(&mut self, ptr: u64, stream: Stream) -> Result<()> {
        let (off, _) = self.live_block(ptr, "symm_record_stream")?;
        let b = self.blocks.get_mut(&off).expect("live block");
        if !b.streams.contains(&stream) {
            b.streams.push(stream);
        }
        Ok(())
    }

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

    /// Checks every invariant in the module header; `Err` names the first one broken.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.ranges.validate()?;
        let mut st = Stats {
            heap_bytes: self.stats.heap_bytes,
            ..Stats::default()
        };
        let mut free_count: BTreeMap<PoolId, usize> = BTreeMap::new();
        let mut parked_seen = 0;
        for (&soff, s) in &self.segments {
            if !self.ranges.is_free(soff, s.size) {
                st.segments += 1;
                st.reserved_bytes += s.size;
            } else {
                return Err(format!("segment {soff:#x} lies in a free address range"));
            }
            let mut at = soff;
            let mut live = 0;
            let mut prev_free: Option<&Vec<Stream>> = None;
            for (&boff, b) in self.blocks.range(soff..soff + s.size) {
                if boff != at || b.segment != soff || b.size == 0 || b.pool != s.pool {
                    return Err(format!(
                        "blocks of segment {soff:#x} do not tile it at {boff:#x}"
                    ));
                }
                at += b.size;
                match b.state {
                    State::Live(req) => {
                        live += 1;
                        st.allocated_bytes += b.size;
                        st.requested_bytes += req;
                        st.active_blocks += 1;
                        prev_free = None;
                    }
                    State::Parked => {
                        live += 1;
                        parked_seen += 1;
                        prev_free = None;
                    }
                    State::Free => {
                        if let Some(p) = prev_free {
                            let q = &b.streams;
                            if p.is_empty()
                                || q.is_empty()
                                || (p.len() == q.len() && p.iter().all(|s| q.contains(s)))
                            {
                                return Err(format!(
                                    "free neighbours not merged at {boff:#x} (streams {p:?} and {q:?})"
                                ));
                            }
                        }
                        prev_free = Some(&b.streams);
                        *free_count.entry(s.pool).or_default() += 1;
                        let p = self.pools.get(&s.pool).ok_or("segment's pool is missing")?;
                        let stream = b.streams.first().copied().unwrap_or(0);
                        if !p.free_any.contains(&(s.class, b.size, boff))
                            || !p.free_by_stream.contains(&(s.class, stream, b.size, boff))
                        {
                            return Err(format!("free block {boff:#x} is not in its free lists"));
                        }
                    }
                }
            }
            if at != soff + s.size {
                return Err(format!("blocks of segment {soff:#x} end at {at:#x}"));
            }
            if live != s.live {
                return Err(format!(
                    "segment {soff:#x} counts {} live blocks, has {live}",
                    s.live
                ));
            }
        }
        let mut parked_listed = 0;
        for (&(pool, stream, rounded), off) in self.parked.entries() {
            parked_listed += 1;
            let b = self
                .blocks
                .get(&off)
                .ok_or(format!("parked offset {off:#x} is not a block"))?;
            let class = self.segments[&b.segment].class;
            if b.state != State::Parked
                || b.pool != pool
                || b.streams != [stream]
                || rounded > b.size
                || class_of(rounded) != class
            {
                return Err(format!(
                    "parked block {off:#x} ({b:?}) does not match its key \
                     ({pool:?}, stream {stream:#x}, {rounded} bytes)"
                ));
            }
            if self.pools.get(&pool).is_none_or(|p| p.releasing) {
                return Err(format!(
                    "block {off:#x} is parked in pool {pool:?}, which is released"
                ));
            }
        }
        if parked_listed != parked_seen || self.parked.len() != parked_seen {
            return Err(format!(
                "{parked_seen} blocks are parked, the LIFOs hold {parked_listed} (count {})",
                self.parked.len()
            ));
        }
        let releasing = self.pools.values().filter(|p| p.releasing).count();
        if releasing != self.releasing_pools {
            return Err(format!(
                "{releasing} pools are being released, counted {}",
                self.releasing_pools
            ));
        }
        for (id, p) in &self.pools {
            let n = free_count.get(id).copied().unwrap_or(0);
            if p.free_any.len() != n || p.free_by_stream.len() != n {
                return Err(format!(
                    "pool {id:?} lists {} free blocks, has {n}",
                    p.free_any.len()
                ));
            }
        }
        if self.ranges.free_bytes() + st.reserved_bytes != self.size() {
            return Err("segments and free ranges do not partition the heap".into());
        }
        let s = &self.stats;
        if (
            s.allocated_bytes,
            s.requested_bytes,
            s.active_blocks,
            s.segments,
            s.reserved_bytes,
        ) != (
            st.allocated_bytes,
            st.requested_bytes,
            st.active_blocks,
            st.segments,
            st.reserved_bytes,
        ) {
            return Err(format!("stats {s:?} disagree with the blocks ({st:?})"));
        }
        Ok(())
    }
}
