//! Where a block comes from: best fit over a pool's free sets (the requesting stream's blocks
//! first), splitting what is left, new segments at deterministic offsets of the reserved range,
//! and merging a freed block with free neighbours that wait on the same streams.
//!
//! Invariants kept (mod.rs lists them all): the blocks of a segment tile it in address order;
//! a free block is listed once in `free_any` and once in `free_by_stream`, under its first
//! stream; neighbours waiting on the same streams never stay apart.

use super::*;

pub(super) fn segment_size(class: Class, rounded: u64, gran: u64) -> u64 {
    let s = match class {
        Class::Small => SMALL_SEGMENT,
        Class::Large if rounded < HUGE_MIN => LARGE_SEGMENT,
        Class::Large => rounded,
    };
    s.next_multiple_of(gran)
}

impl DeviceHeap {
    /// Best fit among the pool's free blocks of the class: the requesting stream's first, then
    /// any stream's. A block used by other streams is taken only when ordering is possible
    /// (nothing involved is being captured into a graph).
    pub(super) fn find_free(
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

    pub(super) fn new_segment(
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

    pub(super) fn try_new_segment(
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

    pub(super) fn free_key(&self, off: u64) -> (PoolId, Class, Stream, u64) {
        let b = &self.blocks[&off];
        let seg = &self.segments[&b.segment];
        (
            seg.pool,
            seg.class,
            b.streams.first().copied().unwrap_or(0),
            b.size,
        )
    }

    pub(super) fn unlist_free(&mut self, off: u64) {
        let (pool, class, stream, size) = self.free_key(off);
        let p = self.pools.get_mut(&pool).expect("pool of a segment exists");
        p.free_any.remove(&(class, size, off));
        p.free_by_stream.remove(&(class, stream, size, off));
    }

    pub(super) fn list_free(&mut self, off: u64) {
        let (pool, class, stream, size) = self.free_key(off);
        let p = self.pools.get_mut(&pool).expect("pool of a segment exists");
        p.free_any.insert((class, size, off));
        p.free_by_stream.insert((class, stream, size, off));
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

    /// Merges the free block at `off` with free neighbours in its segment that wait on the same
    /// streams; returns the offset of the merged block (not yet listed as free).
    pub(super) fn merge_neighbours(&mut self, mut off: u64) -> u64 {
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
}
