//! Memory going back: parked blocks drained to the free lists, segments without live blocks
//! returned to the backend (`empty_cache`), and pools released (now for their free segments,
//! at the last free for the others).
//!
//! What `empty_cache` gives back: every free segment of the default pool, of the internal pool
//! and of pools being released (their peers unmap theirs through the release log). A live user
//! pool keeps its free segments, as in PyTorch: a captured graph replays into its pool's free
//! blocks, and a MemPool keeps what it holds until `release_pool`.
//!
//! The release log also carries records of memory given back inside a live segment (a carved
//! child's internal block: comm/group/slots.rs), under a generation drawn like a segment's
//! (`fresh_generation`), so that it names no segment any peer maps.
//!
//! Invariants kept: a segment with live or parked blocks is never released; a pool being
//! released has no parked blocks, and `releasing_pools` counts the pools being released; the
//! device is never waited for from a capturing stream (the wait would break the capture; the
//! segment stays cached instead).

use super::*;

use crate::heap::policy::TRIM_RATIO;

impl DeviceHeap {
    /// Returns the parked blocks of `pool` (all pools with `None`) to the free lists, merged
    /// with their free neighbours; returns how many there were.
    pub(super) fn drain_parked(&mut self, pool: Option<PoolId>) -> usize {
        if self.parked.is_empty() {
            return 0;
        }
        let offs = self.parked.drain(pool);
        for &off in &offs {
            let b = self.blocks.get_mut(&off).expect("parked block exists");
            debug_assert_eq!(b.state, State::Parked);
            b.state = State::Free;
            let seg = b.segment;
            let s = self.segments.get_mut(&seg).expect("segment");
            s.live -= 1;
            if s.live == 0 {
                let w = &mut self.counters.whole_free[slot(s.class)];
                w.0 += 1;
                w.1 += s.size as i64;
            }
            let merged = self.merge_neighbours(off);
            self.list_free(merged);
        }
        offs.len()
    }

    pub(super) fn set_releasing(&mut self, pool: PoolId, releasing: bool) {
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

    pub(super) fn remove_pool(&mut self, pool: PoolId) {
        if self.pools.remove(&pool).is_some_and(|p| p.releasing) {
            self.releasing_pools -= 1;
        }
    }

    /// Gives the segment's memory back, after the device's work has finished (its free blocks
    /// may still be in use by work queued on their streams; `cuMemUnmap` and `cuMemRelease` do
    /// not wait for it). While a capture makes that wait impossible, the segment stays cached
    /// and goes at a later `empty_cache`.
    pub(super) fn release_segment(&mut self, backend: &dyn Backend, seg: u64) -> Result<()> {
        if self.wait_for_device(backend) {
            self.release_now(backend, seg)?;
        }
        Ok(())
    }

    /// Whether a stream that uses this heap's memory is being captured (or cannot be asked).
    /// Every stream a block waits on or was last used by is asked once: a capture that has
    /// allocated or freed anything here is seen (one that has not touched the heap yet is not).
    /// Read only where the heap is about to wait for the device, never on the fast paths.
    fn capture_underway(&self, backend: &dyn Backend) -> bool {
        let mut streams: Vec<Stream> = Vec::new();
        for b in self.blocks.values() {
            for &s in &b.streams {
                if !streams.contains(&s) {
                    streams.push(s);
                }
            }
        }
        streams
            .into_iter()
            .any(|s| backend.is_capturing(self.device, s).unwrap_or(true))
    }

    /// Waits for all work queued on the device; false (and segments stay) while it cannot, or
    /// while a stream that uses the heap is being captured (cuCtxSynchronize during a capture
    /// in CUDA's global mode invalidates that capture).
    fn wait_for_device(&mut self, backend: &dyn Backend) -> bool {
        if self.capture_underway(backend) {
            crate::info!(
                "device {}: segments kept: a stream is being captured",
                self.device
            );
            return false;
        }
        match backend.synchronize(self.device) {
            Ok(()) => {
                self.counters.num_sync_all_streams += 1;
                true
            }
            Err(e) => {
                crate::info!(
                    "device {}: segments kept: cannot wait for the device's work ({})",
                    self.device,
                    e.message
                );
                false
            }
        }
    }

    /// Gives the segment back; the caller has waited for the device's work.
    fn release_now(&mut self, backend: &dyn Backend, seg: u64) -> Result<()> {
        let s = &self.segments[&seg];
        debug_assert_eq!(s.live, 0);
        let (len, pool) = (s.size, s.pool);
        // A free segment may still hold several free blocks (different pending streams).
        let offs: Vec<u64> = self.segment_blocks(seg).map(|(o, _)| o).collect();
        let offs_len = offs.len() as i64;
        // Chunk by chunk: each was mapped on its own (a segment that grew in place has several).
        for c in &s.chunks {
            backend.unmap(self.device, self.base + c.off, c.len)?;
        }
        for o in offs {
            self.unlist_free(o);
            self.blocks.remove(&o);
        }
        let k = slot(self.segments[&seg].class);
        self.counters.blocks[k] -= offs_len;
        let s = self.segments.remove(&seg).expect("segment");
        let chunks = s.chunks.len() as u64;
        self.counters.segment_freed(k, seg, len, pool);
        self.counters.whole_free[k].0 -= 1;
        self.counters.whole_free[k].1 -= len as i64;
        self.counters.num_device_free += chunks as i64;
        for c in s.chunks {
            // Peers that mapped it unmap theirs at their communicator's next call
            // (comm/peer/retire.rs).
            self.release_log.record(c.off, c.generation);
            backend.release(c.phys)?;
        }
        self.range_free(pool, seg, len);
        let p = self.pools.get_mut(&pool).expect("pool");
        p.segments -= 1;
        if p.segments == 0 && p.releasing {
            self.remove_pool(pool);
        }
        self.stats.segments -= 1;
        self.stats.reserved_bytes -= len;
        self.stats.physical_releases += chunks;
        crate::trace!(
            "device {}: released the segment of {len} bytes at {seg:#x} of pool {}; \
             reserved {}",
            self.device,
            pool,
            self.stats.reserved_bytes
        );
        Ok(())
    }

    pub(super) fn release_free_segments(
        &mut self,
        backend: &dyn Backend,
        pool: Option<PoolId>,
    ) -> Result<()> {
        let idle: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| {
                s.live == 0
                    && match pool {
                        Some(p) => s.pool == p,
                        None => self.is_cache_pool(s.pool),
                    }
            })
            .map(|(&o, _)| o)
            .collect();
        if !idle.is_empty() && self.wait_for_device(backend) {
            for seg in idle {
                self.release_now(backend, seg)?;
            }
        }
        Ok(())
    }

    /// Before the heap grows by a segment for `rounded` bytes of `class`: when reserved memory
    /// would then exceed `TRIM_RATIO` times the working set (the most allocated since the last
    /// `empty_cache`, or what is allocated with this request, if more), gives back idle segments
    /// of the pool and class that are too small for the request (largest first) until it would
    /// not. Varying large sizes otherwise leave such segments idle for good (the trace replay's
    /// reserved/allocated went from 1.17 to 1.07). Measured against what is allocated at the
    /// moment instead, a training step's own rise and fall made it give back segments each
    /// step needs again: the recorded ResNet-50 step gave back 210 and made 290 over its first
    /// 20 steps, each given back after a wait for the device (bench/NOTES.md, "Global mode's
    /// host cost"). It waits once for the device's work before it
    /// releases (release_segment says why), so it runs only where memory would otherwise be
    /// wasted.
    pub(super) fn trim_before_growing(
        &mut self,
        backend: &dyn Backend,
        req: &Request,
    ) -> Result<()> {
        let Request {
            pool,
            class,
            rounded,
            stream,
            ..
        } = *req;
        let len = segment_size(class, rounded, self.gran);
        let wanted = |h: &DeviceHeap| {
            let working_set = (h.stats.allocated_bytes + rounded).max(h.working_set);
            (h.stats.reserved_bytes + len) as f64 > TRIM_RATIO * working_set as f64
        };
        // Never while a pool is open (PyTorch opens one around each graph capture) or this
        // stream is capturing: waiting for the device there would break the capture.
        if class != Class::Large
            || crate::heap::pools::arena_of(pool).is_some()
            || !wanted(self)
            || super::super::pools::any_open()
            || backend.is_capturing(self.device, stream)?
        {
            return Ok(());
        }
        let mut idle: Vec<(u64, u64)> = self
            .segments
            .iter()
            .filter(|(_, s)| s.live == 0 && s.pool == pool && s.class == class && s.size < len)
            .map(|(&o, s)| (s.size, o))
            .collect();
        idle.sort_unstable_by(|a, b| b.cmp(a));
        if idle.is_empty() || !self.wait_for_device(backend) {
            return Ok(()); // (during a capture: grow instead)
        }
        for (_, seg) in idle {
            if !wanted(self) {
                break;
            }
            self.release_now(backend, seg)?;
        }
        Ok(())
    }

    /// Whether `pool`'s free segments are the cache's to give back (the module header): the
    /// default and internal pools and pools being released, not live user pools.
    pub(super) fn is_cache_pool(&self, pool: PoolId) -> bool {
        pool == DEFAULT_POOL
            || pool == INTERNAL_POOL
            || self.pools.get(&pool).is_some_and(|p| p.releasing)
    }

    /// Returns every free segment of the default and internal pools and of pools being
    /// released to the backend (live user pools keep theirs: the module header says why).
    pub fn empty_cache(&mut self, backend: &dyn Backend) -> Result<()> {
        let cached: Vec<PoolId> = self
            .pools
            .keys()
            .copied()
            .filter(|&p| self.is_cache_pool(p))
            .collect();
        for p in cached {
            self.drain_parked(Some(p));
        }
        self.release_free_segments(backend, None)?;
        self.working_set = self.stats.allocated_bytes;
        crate::trace!("empty_cache: {}", self.pools_summary());
        Ok(())
    }

    /// A route to `pool` was begun: one more use, and a pool being released lives again.
    pub fn hold_pool(&mut self, pool: PoolId) {
        self.pools.entry(pool).or_default().uses += 1;
        self.set_releasing(pool, false);
    }

    /// Gives back one use of `pool`; true when none is left (or the pool was never begun), so
    /// that the caller releases it.
    pub fn unhold_pool(&mut self, pool: PoolId) -> bool {
        match self.pools.get_mut(&pool) {
            Some(p) if p.uses > 1 => {
                p.uses -= 1;
                false
            }
            Some(p) => {
                p.uses = 0;
                true
            }
            None => true,
        }
    }

    /// Marks `pool` released, whatever uses it had: its free segments go now, the others when
    /// their last block is freed. Allocating into the pool again revives it.
    pub fn release_pool(&mut self, backend: &dyn Backend, pool: PoolId) -> Result<()> {
        let Some(p) = self.pools.get_mut(&pool) else {
            return Ok(());
        };
        p.uses = 0;
        self.drain_parked(Some(pool));
        self.set_releasing(pool, true);
        self.release_free_segments(backend, Some(pool))?;
        if self.pools.get(&pool).is_some_and(|p| p.segments == 0) {
            self.remove_pool(pool);
        }
        crate::trace!("release_pool {}: {}", pool, self.pools_summary());
        Ok(())
    }
}
