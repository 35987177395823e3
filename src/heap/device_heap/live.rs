//! A live block's life in the heap: the accounting when a block becomes live (placed or taken
//! from the parked fast path), its free (parked whole for its stream, or listed free and merged
//! with its neighbours, and the segment released if its pool is being released) and
//! `record_stream` (the streams a reuse waits on).
//!
//! Invariants kept here (checked by `validate`, mod.rs lists them): a freed block is parked only
//! if it passes `parks`, waits on its freeing stream alone and its pool is not being released;
//! a block freed to the lists waits on the freeing stream first; `segment.live` and the stats
//! change with every block that becomes live or stops being live; `free` and `record_stream`
//! refuse a block lent to a thread cache (tracked.rs).

use super::*;

impl DeviceHeap {
    /// The fast path's hit: the parked block at `off` (which waits only on the requesting
    /// stream) becomes live for `requested` bytes.
    pub(super) fn unpark_live(&mut self, off: u64, requested: u64) {
        let b = self.blocks.get_mut(&off).expect("parked block exists");
        debug_assert_eq!(b.state, State::Parked);
        b.state = State::Live(requested);
        let size = b.size;
        self.count_live(size, requested);
        self.stats.cache_hits += 1;
    }

    pub(super) fn count_live(&mut self, size: u64, requested: u64) {
        self.stats.allocated_bytes += size;
        self.stats.requested_bytes += requested;
        self.stats.active_blocks += 1;
        self.stats.peak_allocated_bytes = self
            .stats
            .peak_allocated_bytes
            .max(self.stats.allocated_bytes);
        self.working_set = self.working_set.max(self.stats.allocated_bytes);
    }

    /// The offset and requested size of the live block at `ptr`.
    pub(super) fn live_block(&self, ptr: u64, what: &str) -> Result<(u64, u64)> {
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
        self.refuse_tracked(off, "symm_free")?;
        crate::trace!("free {size} at {off:#x} stream {stream:#x}");
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
        if !pool_releasing
            && block.streams.iter().all(|&s| s == stream)
            && parks(round_request(requested))
        {
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
        // The freeing stream first, the others after it in their order.
        match block.streams.iter().position(|&s| s == stream) {
            Some(i) => block.streams[..=i].rotate_right(1),
            None => block.streams.insert(0, stream),
        }
        let seg = block.segment;
        let segment = self.segments.get_mut(&seg).expect("segment");
        segment.live -= 1;
        let (seg_live, pool) = (segment.live, segment.pool);
        if seg_live == 0 {
            let w = &mut self.counters.whole_free[slot(segment.class)];
            w.0 += 1;
            w.1 += segment.size as i64;
        }
        let merged = self.merge_neighbours(off);
        self.list_free(merged);
        if seg_live == 0 && self.pools.get(&pool).is_some_and(|p| p.releasing) {
            self.release_segment(backend, seg)?;
        }
        Ok(())
    }

    /// The next reuse of the block at `ptr` also waits for `stream`'s work.
    pub fn record_stream(&mut self, ptr: u64, stream: Stream) -> Result<()> {
        let (off, _) = self.live_block(ptr, "symm_record_stream")?;
        self.refuse_tracked(off, "symm_record_stream")?;
        let b = self.blocks.get_mut(&off).expect("live block");
        if !b.streams.contains(&stream) {
            b.streams.push(stream);
        }
        Ok(())
    }
}
