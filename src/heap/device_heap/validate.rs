//! The validator: every invariant of the layer's header (mod.rs), checked over the whole
//! structure. Run after every operation in debug builds (heap/mod.rs) and by the tests.

use super::*;
use crate::heap::device_stats::slot;

impl DeviceHeap {
    /// In debug builds, checks every invariant after an operation that changed the heap (the
    /// allocator calls it under the heap's lock, whatever the operation returned); a broken
    /// invariant is a bug of this layer, and panics naming it. Free in release builds.
    #[inline]
    pub fn debug_validate(&self) {
        #[cfg(debug_assertions)]
        if let Err(e) = self.validate() {
            panic!("heap invariant broken on device {}: {e}", self.device);
        }
    }

    /// Checks every invariant in the module header; `Err` names the first one broken.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.ranges.validate()?;
        let mut st = Stats {
            heap_bytes: self.stats.heap_bytes,
            ..Stats::default()
        };
        let mut free_count: BTreeMap<PoolId, usize> = BTreeMap::new();
        let mut seg_count: BTreeMap<PoolId, u64> = BTreeMap::new();
        let mut parked_seen = 0;
        let mut blocks_walked = 0;
        // (segments, reserved, blocks, whole free, their bytes) per class: device_stats.rs.
        let mut counted = [(0i64, 0i64, 0i64, 0i64, 0i64); 2];
        for (&soff, s) in &self.segments {
            let k = &mut counted[slot(s.class)];
            k.0 += 1;
            k.1 += s.size as i64;
            if s.live == 0 {
                k.3 += 1;
                k.4 += s.size as i64;
            }
            if !self.range_is_free(s.pool, soff, s.size) {
                st.segments += 1;
                st.reserved_bytes += s.size;
            } else {
                return Err(format!("segment {soff:#x} lies in a free address range"));
            }
            let mut at = soff;
            for c in &s.chunks {
                if c.off != at || c.len == 0 || c.len % self.gran != 0 {
                    return Err(format!(
                        "chunks of segment {soff:#x} do not tile it at {:#x}+{:#x}",
                        c.off, c.len
                    ));
                }
                at += c.len;
            }
            if s.chunks.is_empty() || at != soff + s.size {
                return Err(format!("chunks of segment {soff:#x} end at {at:#x}"));
            }
            *seg_count.entry(s.pool).or_default() += 1;
            if !self.pools.contains_key(&s.pool) {
                return Err(format!(
                    "segment {soff:#x} belongs to pool {:?}, which is not listed",
                    s.pool
                ));
            }
            let mut at = soff;
            let mut live = 0;
            let mut prev_free: Option<&Vec<Stream>> = None;
            let mut prev = NO_PREV;
            let walked_before = blocks_walked;
            for (boff, b) in self.segment_blocks(soff) {
                if boff != at
                    || b.segment != soff
                    || b.size == 0
                    || b.pool != s.pool
                    || b.class != s.class
                {
                    return Err(format!(
                        "blocks of segment {soff:#x} do not tile it at {boff:#x}"
                    ));
                }
                if b.prev != prev {
                    return Err(format!(
                        "block {boff:#x} links back to {:#x}, the block before it is {prev:#x}",
                        b.prev
                    ));
                }
                prev = boff;
                at += b.size;
                blocks_walked += 1;
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
                        let stream = b.streams.first().copied().unwrap_or(UNUSED);
                        if !p.free.contains(s.class, stream, b.size, boff) {
                            return Err(format!("free block {boff:#x} is not in its free lists"));
                        }
                    }
                }
            }
            counted[slot(s.class)].2 += (blocks_walked - walked_before) as i64;
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
        if blocks_walked != self.blocks.len() {
            return Err(format!(
                "{} blocks are listed, the segments' walks reach {blocks_walked}",
                self.blocks.len()
            ));
        }
        self.counters.check(counted)?;
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
            if !parks(rounded) {
                return Err(format!(
                    "parked block {off:#x} of {rounded} bytes is large; large blocks are merged \
                     at once (parks)"
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
            if p.releasing && p.uses > 0 {
                return Err(format!(
                    "pool {id:?} is being released with {} uses",
                    p.uses
                ));
            }
            let segs = seg_count.get(id).copied().unwrap_or(0);
            if p.segments != segs {
                return Err(format!(
                    "pool {id:?} counts {} segments, has {segs}",
                    p.segments
                ));
            }
            let n = free_count.get(id).copied().unwrap_or(0);
            p.free.validate()?;
            if p.free.len() != n {
                return Err(format!(
                    "pool {id:?} lists {} free blocks, has {n}",
                    p.free.len()
                ));
            }
        }
        for &off in self.tracked.keys() {
            if self.blocks.get(&off).and_then(Block::requested).is_none() {
                return Err(format!(
                    "block {off:#x} is lent to a thread cache but not live"
                ));
            }
        }
        self.validate_arenas()?;
        self.validate_grants()?;
        if self.ranges.free_bytes() + self.arena_free_bytes() + st.reserved_bytes != self.size() {
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

impl DeviceHeap {
    /// One line per pool for `SYMMALLOC_DEBUG=TRACE` (where memory sits, for diagnosing what a
    /// workload keeps): segments, reserved bytes, bytes in live blocks (thread caches' count as
    /// live), in parked blocks, in free blocks, and the largest free block, all in MiB.
    pub(super) fn pools_summary(&self) -> String {
        #[derive(Default)]
        struct Sum {
            segments: u64,
            reserved: u64,
            live: u64,
            parked: u64,
            free: u64,
            largest_free: u64,
        }
        let mut by_pool: BTreeMap<PoolId, Sum> = BTreeMap::new();
        for s in self.segments.values() {
            let e = by_pool.entry(s.pool).or_default();
            e.segments += 1;
            e.reserved += s.size;
        }
        for b in self.blocks.values() {
            let e = by_pool.entry(b.pool).or_default();
            match b.state {
                State::Live(_) => e.live += b.size,
                State::Parked => e.parked += b.size,
                State::Free => {
                    e.free += b.size;
                    e.largest_free = e.largest_free.max(b.size);
                }
            }
        }
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let mut out = format!(
            "device {}: reserved {:.1} MiB, allocated {:.1} MiB;",
            self.device,
            mib(self.stats.reserved_bytes),
            mib(self.stats.allocated_bytes)
        );
        for (p, s) in by_pool {
            out.push_str(&format!(
                " pool {}: {} segments, {:.1} reserved, {:.1} live, {:.1} parked, {:.1} free \
                 (largest {:.1});",
                p,
                s.segments,
                mib(s.reserved),
                mib(s.live),
                mib(s.parked),
                mib(s.free),
                mib(s.largest_free)
            ));
        }
        out
    }
}
