//! Segments that grow in place. When a pool that keeps its segments (a capture's private
//! pool, a MemPool: `grows_in_place`) would make a new large segment, it first grows one of its
//! large segments whose last block is free (and usable by the requesting stream, as best fit
//! requires) and whose next address range is free: a new chunk of physical memory, of what the
//! request lacks rounded up to the granularity, is mapped right after the segment, and the free
//! tail and the chunk become one free block. Among several, the largest free tail wins, then
//! the lowest offset. So that there is room to grow into, such a pool's new large segments are
//! placed at the start of the largest free address range (`Ranges::alloc_roomy`), not in the
//! lowest gap that fits, where the next segment would close it (first-fit placement left a GPU
//! capture after other work without room: python/tests/global_capture_check.py). This is
//! PyTorch's expandable segments in the small: a capture's pieces just under the next request
//! no longer force a whole new segment (bench/NOTES.md, "The allocator": the ResNet-50
//! capture's private pool with and without growth, its request trace replayed on host memory).
//! Peers map a grown segment chunk by chunk; a segment
//! goes back whole, every chunk with it. Under capture only `cuMemCreate` and `cuMemMap` run, as
//! for a new segment: no stream is touched.
//!
//! Invariants kept (mod.rs lists them all): the chunks of a segment tile it in address order;
//! the grown tail stays one free block, listed once, under its first stream; the range
//! allocator gives up exactly the chunk's range; the choice reads the call sequence only.

use super::*;
use crate::heap::pools;

/// Whether `pool`'s large segments grow in place (`grow_in_place`): pools other than the
/// default one and symmalloc's own, i.e. a graph capture's private pool or a MemPool, which keep
/// their segments for the life of their graphs or until released. The default pool's eager
/// cache gives segments back one at a time (`empty_cache`, trimming), and a grown segment goes
/// back only whole; an arena's range is bounded and agreed between ranks.
pub fn grows_in_place(pool: PoolId) -> bool {
    pool != DEFAULT_POOL && !pools::is_reserved(pool)
}

impl DeviceHeap {
    /// Before `pool` makes a new segment for `rounded` bytes of `class` on `stream`: grows one
    /// of its segments in place instead (the module header's rule), mapping a new chunk of
    /// what the request lacks (rounded up to the granularity) right after the segment's free
    /// tail, and returns the offset of that tail, now one free block large enough. `None` when
    /// no segment qualifies or the backend is out of memory (the caller then makes a segment,
    /// emptying the cache first if it must).
    pub(super) fn grow_in_place(
        &mut self,
        backend: &dyn Backend,
        req: &Request,
    ) -> Result<Option<u64>> {
        let Request {
            pool,
            class,
            rounded,
            stream,
            ..
        } = *req;
        if class != Class::Large || !grows_in_place(pool) {
            return Ok(None);
        }
        let mut capturing = None;
        // (free tail, tail offset, segment offset) of the best candidate.
        let mut best: Option<(u64, u64, u64)> = None;
        for (&soff, seg) in &self.segments {
            if seg.pool != pool || seg.class != Class::Large {
                continue;
            }
            let end = soff + seg.size;
            let Some((toff, t)) = self.segment_blocks(soff).last() else {
                continue;
            };
            if !t.is_free()
                || t.size >= rounded
                || best.is_some_and(|(size, _, _)| size >= t.size)
                || !self
                    .ranges
                    .is_free(end, (rounded - t.size).next_multiple_of(self.gran))
                || !self.reusable(backend, &t.streams, stream, &mut capturing)?
            {
                continue;
            }
            best = Some((t.size, toff, soff));
        }
        let Some((tail, toff, soff)) = best else {
            return Ok(None);
        };
        let end = soff + self.segments[&soff].size;
        let len = (rounded - tail).next_multiple_of(self.gran);
        let taken = self.ranges.take_at(end, len);
        debug_assert!(taken, "the range after the segment was checked free");
        let chunk = match self.new_chunk(backend, pool, end, len) {
            Ok(c) => c,
            Err(e) if e.status == Status::ErrOutOfMemory => return Ok(None),
            Err(e) => return Err(e),
        };
        self.unlist_free(toff);
        self.blocks.get_mut(&toff).expect("the free tail").size += len;
        let seg = self.segments.get_mut(&soff).expect("segment");
        seg.size += len;
        seg.chunks.push(chunk);
        let k = slot(seg.class);
        if seg.live == 0 {
            self.counters.whole_free[k].1 += len as i64;
        }
        self.counters.segment_grown(k, soff, end, len, pool);
        self.counters.num_device_alloc += 1;
        self.list_free(toff);
        self.grown_in_place += 1;
        self.stats.physical_creates += 1;
        self.stats.reserved_bytes += len;
        crate::trace!(
            "device {}: segment at {soff:#x} of pool {} grew in place by {len} bytes (free tail \
             {tail}) for {rounded} bytes; reserved {}",
            self.device,
            pool,
            self.stats.reserved_bytes
        );
        Ok(Some(toff))
    }
}
