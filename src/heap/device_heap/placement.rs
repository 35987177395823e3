//! Where a block comes from: the growth ladder (`place`, every rung of a request in one walk,
//! the thread caches' rungs through the allocator's hook), best fit over a pool's free sets (the requesting stream's blocks
//! and never-used memory first), splitting what is left, new segments at deterministic offsets
//! of the reserved range (or segments grown in place: grow.rs), and merging a freed block with
//! free neighbours that wait on the same streams.
//! Whole free segments taken from donor pools: donors.rs.
//!
//! Invariants kept (mod.rs lists them all): the blocks of a segment tile it in address order,
//! each linked back to the one before it; a free block is listed once in its pool's free lists,
//! under its class and first stream (`UNUSED` if it has none); neighbours waiting on the same
//! streams never stay apart; `Pool::segments` counts each pool's segments.

use super::*;

impl DeviceHeap {
    /// The growth ladder: where a request's memory comes from, each rung tried only when the
    /// ones before found nothing, walked once per request.
    /// 1. the parked block kept whole for (pool, stream, rounded size) (small requests: `parks`);
    /// 2. best fit over the pool's free blocks (then, if nothing fit, again after every parked
    ///    block of the pool is merged back);
    /// 3. (with `caches`) this thread's and exited threads' cached blocks back to the heap,
    ///    then 1 and 2 again when any came back;
    /// 4. a whole free segment adopted from a donor pool (donors.rs);
    /// 5. a segment of the pool grown in place by what the request lacks (grow.rs);
    /// 6. idle segments of the pool trimmed (release.rs), then a new segment (which, out of
    ///    memory, empties the cache and tries once more);
    /// 7. (with `caches`) out of memory there: every thread's cached blocks back, and 1, 2, 4,
    ///    5 and 6 once more.
    ///
    /// Other threads' blocks go back only at rung 7: taking every thread's blocks at each
    /// growth made them all miss next, and their misses grew the heap in turn. Reads only the
    /// call sequence (determinism: mod.rs). Returns the offset of the block, live (split off a
    /// free block by `take`, or a parked one made live).
    pub(super) fn place(
        &mut self,
        backend: &dyn Backend,
        req: &Request,
        caches: Option<Reclaimer<'_>>,
    ) -> Result<u64> {
        let Request {
            pool,
            rounded,
            size,
            stream,
            ..
        } = *req;
        match self.ladder(backend, req, caches)? {
            Placed::Parked(off) => {
                crate::trace!("malloc {size} at {off:#x} pool {pool} stream {stream:#x} (parked)");
                self.unpark_live(off, size);
                Ok(off)
            }
            Placed::Free(off) => {
                self.take(backend, off, rounded, size, stream)?;
                crate::trace!("malloc {size} at {off:#x} pool {pool} stream {stream:#x}");
                Ok(off)
            }
        }
    }

    /// The rungs of `place`, in its order.
    fn ladder(
        &mut self,
        backend: &dyn Backend,
        req: &Request,
        mut caches: Option<Reclaimer<'_>>,
    ) -> Result<Placed> {
        if let Some(p) = self.parked_or_free(backend, req)? {
            return Ok(p);
        }
        if let Some(reclaim) = caches.as_mut() {
            if reclaim(self, Reclaim::OwnCaches)? > 0 {
                if let Some(p) = self.parked_or_free(backend, req)? {
                    return Ok(p);
                }
            }
        }
        match (self.grow_rungs(backend, req), caches) {
            (Err(e), Some(reclaim)) if e.status == Status::ErrOutOfMemory => {
                reclaim(self, Reclaim::AllCaches)?;
                match self.parked_or_free(backend, req)? {
                    Some(p) => Ok(p),
                    None => self.grow_rungs(backend, req).map(Placed::Free),
                }
            }
            (r, _) => r.map(Placed::Free),
        }
    }

    /// Rungs 1 and 2 of the ladder: memory the pool already holds.
    fn parked_or_free(&mut self, backend: &dyn Backend, req: &Request) -> Result<Option<Placed>> {
        let Request {
            pool,
            rounded,
            stream,
            ..
        } = *req;
        // Only what `parks` admits is ever parked: a large request has no parked block to find.
        if parks(rounded) {
            if let Some(off) = self.parked.pop(&(pool, stream, rounded)) {
                return Ok(Some(Placed::Parked(off)));
            }
        }
        self.set_releasing(pool, false);
        let mut found = self.find_free(backend, req)?;
        if found.is_none() && self.drain_parked(Some(pool)) > 0 {
            // Parked blocks merged back with their neighbours may fit now.
            found = self.find_free(backend, req)?;
        }
        Ok(found.map(|off| {
            self.stats.cache_hits += 1;
            Placed::Free(off)
        }))
    }

    /// Rungs 4 to 6 of the ladder: a donor's segment, growth in place, a new segment.
    fn grow_rungs(&mut self, backend: &dyn Backend, req: &Request) -> Result<u64> {
        if let Some(off) = self.adopt_segment(backend, req)? {
            // A donor's cached segment: no new physical memory.
            self.stats.cache_hits += 1;
            return Ok(off);
        }
        self.stats.cache_misses += 1;
        if let Some(off) = self.grow_in_place(backend, req)? {
            return Ok(off);
        }
        self.trim_before_growing(backend, req)?;
        self.new_segment(backend, req)
    }

    /// Best fit among the pool's free blocks of the class: first among the requesting stream's
    /// and never-used ones (neither needs ordering), then among any stream's. A block used by
    /// other streams is taken only when ordering is possible (nothing involved is being
    /// captured into a graph).
    ///
    /// Never-used memory belongs to the first search whatever the stream: it used to be listed
    /// under stream 0, the legacy default stream, so a request on any other stream took a
    /// worse-fitting block of its own (a 9 MiB optimizer state in a freed 100 MiB activation
    /// segment, which `empty_cache` then could not return) before a never-used exact fit, and
    /// placement depended on whether the stream handle was 0 (tests/heap_placement.rs).
    pub(super) fn find_free(&self, backend: &dyn Backend, req: &Request) -> Result<Option<u64>> {
        let Request {
            pool,
            class,
            rounded,
            stream,
            ..
        } = *req;
        let Some(p) = self.pools.get(&pool) else {
            return Ok(None);
        };
        let mut capturing: Option<bool> = None;
        let mut usable =
            |off: u64| self.reusable(backend, &self.blocks[&off].streams, stream, &mut capturing);
        let mut best: Option<(u64, u64)> = None;
        for (size, off) in p.free.fits(class, stream, rounded) {
            if usable(off)? {
                best = Some((size, off));
                break;
            }
        }
        if let Some((size, off)) = p.free.fits(class, UNUSED, rounded).next() {
            // Waits on no stream: usable by any, capturing or not.
            if best.is_none_or(|b| (size, off) < b) {
                best = Some((size, off));
            }
        }
        if let Some((_, off)) = best {
            return Ok(Some(off));
        }
        // Then any stream's: the best fit over all of them is the best of each stream's first
        // usable fit (streams are few).
        for s in p.free.streams(class) {
            if s == stream || s == UNUSED {
                continue;
            }
            for (size, off) in p.free.fits(class, s, rounded) {
                if best.is_some_and(|b| b < (size, off)) {
                    break;
                }
                if usable(off)? {
                    best = Some((size, off));
                    break;
                }
            }
        }
        Ok(best.map(|(_, off)| off))
    }

    /// Whether memory that waits on `streams` may go to `stream` now: at once when only `stream`
    /// (or nothing) used it; otherwise through ordering, which is possible only when nothing
    /// involved is being captured. `capturing` caches whether `stream` is.
    pub(super) fn reusable(
        &self,
        backend: &dyn Backend,
        streams: &[Stream],
        stream: Stream,
        capturing: &mut Option<bool>,
    ) -> Result<bool> {
        if streams.iter().all(|&s| s == stream) {
            return Ok(true);
        }
        if capturing.is_none() {
            *capturing = Some(backend.is_capturing(self.device, stream)?);
        }
        if *capturing == Some(true) {
            return Ok(false);
        }
        for &s in streams {
            if s != stream && backend.is_capturing(self.device, s)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    pub(super) fn new_segment(&mut self, backend: &dyn Backend, req: &Request) -> Result<u64> {
        let Request {
            pool,
            class,
            rounded,
            size: requested,
            ..
        } = *req;
        let len = segment_size(class, rounded, self.gran);
        match self.try_new_segment(backend, pool, class, len) {
            Err(e) if e.status == Status::ErrOutOfMemory => {
                // Give every cached segment back and try once more.
                self.counters.num_alloc_retries += 1;
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

    /// Physical memory of `len` bytes mapped at `off`, whose address range `pool` has taken
    /// (`range_alloc`, or `Ranges::take_at` for a segment that grows): a chunk with a fresh
    /// generation, granted to the heap's peers (peers.rs). On failure nothing is left: the
    /// memory goes back and the range is freed.
    pub(super) fn new_chunk(
        &mut self,
        backend: &dyn Backend,
        pool: PoolId,
        off: u64,
        len: u64,
    ) -> Result<Chunk> {
        if self.limit > 0 && self.stats.reserved_bytes + len > self.limit {
            self.range_free(pool, off, len);
            return Err(Error::oom(format!(
                "the memory limit of device {} ({} bytes, set_per_process_memory_fraction) \
                 leaves no room for {len} more bytes (reserved {})",
                self.device, self.limit, self.stats.reserved_bytes
            )));
        }
        let phys = match backend.create(self.device, len) {
            Ok(p) => p,
            Err(e) => {
                self.range_free(pool, off, len);
                return Err(e);
            }
        };
        if let Err(e) = backend.map(self.device, self.base + off, len, &phys) {
            let _ = backend.release(phys);
            self.range_free(pool, off, len);
            return Err(e);
        }
        let granted = match self.grant_new_chunk(backend, off, len) {
            Ok(g) => g,
            Err(e) => {
                let _ = backend.unmap(self.device, self.base + off, len);
                let _ = backend.release(phys);
                self.range_free(pool, off, len);
                return Err(e);
            }
        };
        Ok(Chunk {
            off,
            len,
            generation: self.fresh_generation(),
            phys,
            granted,
        })
    }

    pub(super) fn try_new_segment(
        &mut self,
        backend: &dyn Backend,
        pool: PoolId,
        class: Class,
        len: u64,
    ) -> Result<u64> {
        // A segment that may grow in place goes where the most room is left after it.
        let roomy = class == Class::Large && super::grow::grows_in_place(pool);
        let off = match self.range_alloc(pool, len, roomy) {
            Ok(off) => off,
            // An arena out of address space first gives back its own free segments.
            Err(e) if self.release_arena_free_segments(backend, pool)? => {
                self.range_alloc(pool, len, roomy).map_err(|_| e)?
            }
            Err(e) => return Err(e),
        };
        let chunk = self.new_chunk(backend, pool, off, len)?;
        self.segments.insert(
            off,
            Segment {
                size: len,
                pool,
                class,
                chunks: vec![chunk],
                live: 0,
            },
        );
        self.blocks.insert(
            off,
            Block {
                size: len,
                segment: off,
                pool,
                class,
                prev: NO_PREV,
                state: State::Free,
                streams: vec![],
            },
        );
        let p = self.pools.entry(pool).or_default();
        p.segments += 1;
        p.free.insert(class, UNUSED, len, off);
        self.stats.physical_creates += 1;
        self.stats.segments += 1;
        self.stats.reserved_bytes += len;
        let k = slot(class);
        self.counters.segment_made(k, off, len, pool);
        self.counters.blocks[k] += 1;
        self.counters.whole_free[k].0 += 1;
        self.counters.whole_free[k].1 += len as i64;
        self.counters.num_device_alloc += 1;
        crate::trace!(
            "device {}: new segment of {len} bytes at {off:#x} for pool {}, {class:?}; \
             reserved {}",
            self.device,
            pool,
            self.stats.reserved_bytes
        );
        Ok(off)
    }

    pub(super) fn free_key(&self, off: u64) -> (PoolId, Class, Stream, u64) {
        let b = &self.blocks[&off];
        (
            b.pool,
            b.class,
            b.streams.first().copied().unwrap_or(UNUSED),
            b.size,
        )
    }

    pub(super) fn unlist_free(&mut self, off: u64) {
        let (pool, class, stream, size) = self.free_key(off);
        let p = self.pools.get_mut(&pool).expect("pool of a segment exists");
        p.free.remove(class, stream, size, off);
    }

    pub(super) fn list_free(&mut self, off: u64) {
        let (pool, class, stream, size) = self.free_key(off);
        let p = self.pools.get_mut(&pool).expect("pool of a segment exists");
        p.free.insert(class, stream, size, off);
    }

    /// Turns the free block at `off` into a live one of `rounded` bytes for `stream`.
    pub(super) fn take(
        &mut self,
        backend: &dyn Backend,
        off: u64,
        rounded: u64,
        requested: u64,
        stream: Stream,
    ) -> Result<()> {
        self.take_split(backend, off, rounded, requested, stream, false)
    }

    /// As `take`, leaving exactly `size` bytes live: the rest is split off whatever its size
    /// (a checkpoint restored puts blocks back at their recorded bounds: inspect.rs).
    pub(super) fn take_exact(
        &mut self,
        backend: &dyn Backend,
        off: u64,
        size: u64,
        requested: u64,
        stream: Stream,
    ) -> Result<()> {
        self.take_split(backend, off, size, requested, stream, true)
    }

    fn take_split(
        &mut self,
        backend: &dyn Backend,
        off: u64,
        rounded: u64,
        requested: u64,
        stream: Stream,
        exact: bool,
    ) -> Result<()> {
        // One lookup of the block, of its pool and of its segment: this runs at every request
        // the thread caches miss (bench/NOTES.md, "Global mode's host cost").
        let device = self.device;
        let block = self.blocks.get_mut(&off).expect("free block exists");
        // Order the new user after every other stream that used the memory. On error the
        // block stays free and listed.
        for &s in block.streams.iter().filter(|&&s| s != stream) {
            backend.order(device, stream, s)?;
        }
        let (class, seg, pool) = (block.class, block.segment, block.pool);
        let first = block.streams.first().copied().unwrap_or(UNUSED);
        let free = &mut self
            .pools
            .get_mut(&pool)
            .expect("pool of a segment exists")
            .free;
        free.remove(class, first, block.size, off);
        let rest = block.size - rounded;
        let split = match class {
            _ if exact => rest > 0,
            Class::Small => rest >= ROUND,
            Class::Large => rest > LARGE_SPLIT_MIN,
        };
        let remainder = split.then(|| {
            block.size = rounded;
            Block {
                size: rest,
                segment: seg,
                pool,
                class,
                prev: off,
                state: State::Free,
                streams: block.streams.clone(),
            }
        });
        let size = block.size;
        block.state = State::Live(requested);
        block.streams.clear();
        block.streams.push(stream);
        let segment = self.segments.get_mut(&seg).expect("segment exists");
        if segment.live == 0 {
            let w = &mut self.counters.whole_free[slot(class)];
            w.0 -= 1;
            w.1 -= segment.size as i64;
        }
        segment.live += 1;
        if let Some(r) = remainder {
            // Listed under the same pool, class and first stream as the block it came from.
            free.insert(class, first, rest, off + rounded);
            self.counters.blocks[slot(class)] += 1;
            self.blocks.insert(off + rounded, r);
            self.relink_next(off + rounded);
        }
        self.count_live(size, requested);
        Ok(())
    }

    /// Merges the free block at `off` with free neighbours in its segment that wait on the same
    /// streams; returns the offset of the merged block (not yet listed as free).
    pub(super) fn merge_neighbours(&mut self, mut off: u64) -> u64 {
        // Never-used memory (no streams) merges with anything; used memory only with memory
        // that waits on the same streams.
        let same = |a: &[Stream], b: &[Stream]| {
            a.is_empty() || b.is_empty() || (a.len() == b.len() && a.iter().all(|s| b.contains(s)))
        };
        let (k, prev) = {
            let b = &self.blocks[&off];
            (slot(b.class), b.prev)
        };
        if prev != NO_PREV {
            let pb = &self.blocks[&prev];
            if pb.is_free() && same(&pb.streams, &self.blocks[&off].streams) {
                self.unlist_free(prev);
                let b = self.blocks.remove(&off).expect("block");
                self.counters.blocks[k] -= 1;
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
                self.relink_next(off);
            }
        }
        if let Some(next) = self.next_block(off) {
            let (n, b) = (&self.blocks[&next], &self.blocks[&off]);
            if n.is_free() && same(&n.streams, &b.streams) {
                self.unlist_free(next);
                let n = self.blocks.remove(&next).expect("next");
                self.counters.blocks[k] -= 1;
                let b = self.blocks.get_mut(&off).expect("block");
                b.size += n.size;
                for s in n.streams {
                    if !b.streams.contains(&s) {
                        b.streams.push(s);
                    }
                }
                self.relink_next(off);
            }
        }
        off
    }
}
