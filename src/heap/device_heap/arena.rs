//! Communicator arenas: a range of the heap's address space that one communicator's ranks agree
//! on (comm/group/arena.rs), reserved at the same offset on each of them, in which only that
//! communicator's two pools place segments (`pools::arena_pool`: what `symm_comm_malloc` hands
//! out, and the communicator's own buffers). A placement inside an arena reads only the arena's
//! own call sequence, so its blocks sit at the same offset on every rank of the communicator
//! whatever else the device holds (other communicators, other threads, device-level pools).
//!
//! Invariants (checked by `validate_arenas`): arenas are disjoint, aligned ranges taken out of
//! the heap's range allocator; an arena's segments lie inside it and belong to one of its two
//! pools, and its own range allocator and its segments partition it; `Arena::segments` counts
//! its segments. An arena's pools are never donors or takers of whole segments, are never
//! trimmed and keep their free segments (as live user pools do) until the arena is released;
//! then its free segments go (now, or at a later `empty_cache` where a capture forbade waiting),
//! the others at their last free, and the range returns to the heap with the last segment.
//! Nothing allocates into a released arena. Thread caches never hold arena blocks
//! (heap/mod.rs): their drains depend on other pools' traffic.

use super::*;
use crate::heap::pools::{arena_of, arena_pool};

pub(super) struct Arena {
    /// Heap offset and length.
    off: u64,
    len: u64,
    /// Free ranges, relative to `off`.
    ranges: Ranges,
    segments: u64,
    released: bool,
}

impl DeviceHeap {
    /// The heap's free address ranges, (offset, length), for an arena agreement.
    pub fn free_ranges(&self) -> Vec<(u64, u64)> {
        self.ranges.free_list()
    }

    /// The heap's allocation granularity (arena offsets and lengths are multiples of it).
    pub fn granularity(&self) -> u64 {
        self.gran
    }

    /// Reserves `[off, off + len)` as a new arena; its id, or `None` when the range is not free
    /// (or not aligned).
    pub fn claim_arena(&mut self, off: u64, len: u64) -> Option<u64> {
        if !self.ranges.take_at(off, len) {
            return None;
        }
        let id = self.next_arena;
        self.next_arena += 1;
        self.arenas.insert(
            id,
            Arena {
                off,
                len,
                ranges: Ranges::new(len, self.gran),
                segments: 0,
                released: false,
            },
        );
        Some(id)
    }

    /// (offset, length) of a live (not released) arena.
    pub fn arena_bounds(&self, id: u64) -> Option<(u64, u64)> {
        self.arenas
            .get(&id)
            .filter(|a| !a.released)
            .map(|a| (a.off, a.len))
    }

    /// Gives arena `id` back: no allocation goes to it any more; its free segments are released
    /// now (or at a later `empty_cache` while a capture forbids waiting), the others at their
    /// last free; its range returns to the heap with its last segment.
    pub fn release_arena(&mut self, backend: &dyn Backend, id: u64) -> Result<()> {
        let Some(a) = self.arenas.get_mut(&id) else {
            return Ok(());
        };
        a.released = true;
        for internal in [false, true] {
            let pool = arena_pool(id, internal);
            if self.pools.contains_key(&pool) {
                self.release_pool(backend, pool)?;
            }
        }
        self.drop_arena_if_empty(id);
        Ok(())
    }

    fn drop_arena_if_empty(&mut self, id: u64) {
        if self
            .arenas
            .get(&id)
            .is_some_and(|a| a.released && a.segments == 0)
        {
            let a = self.arenas.remove(&id).expect("checked");
            self.ranges.free(a.off, a.len);
        }
    }

    /// The pool of the live block that starts at `ptr`.
    pub fn pool_of(&self, ptr: u64) -> Option<PoolId> {
        self.blocks
            .get(&ptr.wrapping_sub(self.base))
            .filter(|b| b.requested().is_some())
            .map(|b| b.pool)
    }

    /// Refuses an allocation into an arena's pool whose arena is not live.
    pub(super) fn check_arena_pool(&self, pool: PoolId) -> Result<()> {
        match arena_of(pool) {
            Some(id) if self.arena_bounds(id).is_none() => Err(Error::invalid(format!(
                "the communicator arena {id} of device {} was released (its communicator was \
                 destroyed); allocate from a live communicator",
                self.device
            ))),
            _ => Ok(()),
        }
    }

    /// Address space for a new segment of `len` bytes of `pool`: inside its arena for an
    /// arena's pool, anywhere in the heap otherwise: lowest offset first, or with `roomy` at the
    /// start of the largest free range (a segment that may grow in place: grow.rs).
    pub(super) fn range_alloc(&mut self, pool: PoolId, len: u64, roomy: bool) -> Result<u64> {
        let Some(id) = arena_of(pool) else {
            let got = if roomy {
                self.ranges.alloc_roomy(len)
            } else {
                self.ranges.alloc(len)
            };
            return got.ok_or_else(|| {
                Error::oom(format!(
                    "heap address space of device {} exhausted: no free range of {len} bytes \
                     ({} of {} bytes unused; raise SYMMALLOC_HEAP_SIZE)",
                    self.device,
                    self.ranges.free_bytes(),
                    self.size()
                ))
            });
        };
        let a = self
            .arenas
            .get_mut(&id)
            .expect("checked by check_arena_pool");
        match a.ranges.alloc(len) {
            Some(rel) => {
                a.segments += 1;
                Ok(a.off + rel)
            }
            None => Err(Error::oom(format!(
                "communicator arena of device {} exhausted: no free range of {len} bytes in its \
                 {} bytes ({} unused); raise SYMMALLOC_COMM_ARENA_SIZE",
                self.device,
                a.len,
                a.ranges.free_bytes()
            ))),
        }
    }

    /// Returns a segment's address space (see `range_alloc`).
    pub(super) fn range_free(&mut self, pool: PoolId, off: u64, len: u64) {
        let Some(id) = arena_of(pool) else {
            self.ranges.free(off, len);
            return;
        };
        let a = self
            .arenas
            .get_mut(&id)
            .expect("an arena segment's arena exists");
        a.ranges.free(off - a.off, len);
        a.segments -= 1;
        self.drop_arena_if_empty(id);
    }

    /// Before an arena's pool gives up for want of address space: its own free segments go
    /// back (a step of the arena's own call sequence, so every rank takes it alike). True when
    /// one did.
    pub(super) fn release_arena_free_segments(
        &mut self,
        backend: &dyn Backend,
        pool: PoolId,
    ) -> Result<bool> {
        let Some(id) = arena_of(pool) else {
            return Ok(false);
        };
        let before = self.arenas.get(&id).map_or(0, |a| a.segments);
        for internal in [false, true] {
            let p = arena_pool(id, internal);
            self.drain_parked(Some(p));
            self.release_free_segments(backend, Some(p))?;
        }
        Ok(self.arenas.get(&id).map_or(0, |a| a.segments) < before)
    }

    /// Whether `[off, off + len)` is free address space of `pool`'s range allocator.
    pub(super) fn range_is_free(&self, pool: PoolId, off: u64, len: u64) -> bool {
        match arena_of(pool).and_then(|id| self.arenas.get(&id)) {
            Some(a) => off >= a.off && a.ranges.is_free(off - a.off, len),
            None => self.ranges.is_free(off, len),
        }
    }

    /// Bytes of address space held by arenas (their segments and their free ranges).
    pub(super) fn arena_free_bytes(&self) -> u64 {
        self.arenas.values().map(|a| a.ranges.free_bytes()).sum()
    }

    /// The arenas' invariants (the module header).
    pub(super) fn validate_arenas(&self) -> std::result::Result<(), String> {
        for (&id, a) in &self.arenas {
            a.ranges.validate()?;
            if a.off % self.gran != 0 || a.len % self.gran != 0 || a.off + a.len > self.size() {
                return Err(format!(
                    "arena {id} at {:#x}+{:#x} is misaligned",
                    a.off, a.len
                ));
            }
            if self
                .ranges
                .free_list()
                .iter()
                .any(|&(o, l)| o < a.off + a.len && a.off < o + l)
            {
                return Err(format!("arena {id} overlaps a free range of the heap"));
            }
            let mut n = 0;
            let mut bytes = 0;
            for (&soff, s) in &self.segments {
                let inside = soff >= a.off && soff < a.off + a.len;
                let mine = arena_of(s.pool) == Some(id);
                if inside != mine || (mine && soff + s.size > a.off + a.len) {
                    return Err(format!(
                        "segment {soff:#x} of pool {:?} and arena {id} at {:#x}+{:#x} disagree",
                        s.pool, a.off, a.len
                    ));
                }
                if mine {
                    n += 1;
                    bytes += s.size;
                }
            }
            if n != a.segments || bytes + a.ranges.free_bytes() != a.len {
                return Err(format!(
                    "arena {id}: {n} segments of {bytes} bytes, counted {}; free {} of {}",
                    a.segments,
                    a.ranges.free_bytes(),
                    a.len
                ));
            }
        }
        Ok(())
    }
}
