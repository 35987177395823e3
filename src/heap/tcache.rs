//! Per-thread caches in front of the device heaps. A block that a thread frees whole, on the
//! stream it was allocated on, stays with that thread for its next request of the same rounded
//! size, pool and stream, without the heap's lock (mimalloc's thread-local free lists; PyTorch
//! keeps its blocks per stream); large blocks of pools other than the default one are not kept
//! (`device_heap::keeps_whole` says why). A block freed whole on its stream by another thread
//! than the one whose cache lent it (PyTorch's backward frees on autograd's thread what the
//! forward allocated) goes back to the lending cache for that thread's next request
//! (`Allocator::keep_remote`, mimalloc's delayed free; up to KEEP_REMOTE_BYTES), not to the
//! heap: bench/RESULTS.md, "Frees on another thread". Under eight threads on their own streams the shared lock was
//! the whole tail, waiters queueing behind a holder that takes the lock again and again
//! (bench/NOTES.md, "The allocator").
//!
//! Each thread has one cache per (allocator, device), found through thread-local storage and
//! registered with its allocator, which drains the caches for `empty_cache` and `release_pool`,
//! drains a thread's own cache (and exited threads') before the heap grows for that thread,
//! every cache when growing fails, and reads them for statistics. (Draining every thread's
//! cache at each growth made all of them miss next, and their misses grew the heap in turn:
//! bench/NOTES.md, "The allocator".) Blocks a cache holds are
//! live to the heap (device_heap/tracked.rs), so the heap never reuses them; the cache keeps
//! the accounting that makes the kept ones count as free in the statistics. A thread that exits
//! leaves its cache behind, marked orphaned; the next drain returns its blocks and drops it.
//!
//! Invariants (checked by `Allocator::validate`): every block the heap lends is in exactly one
//! cache, either handed out (`lent`, by address, with its current request) or kept for reuse
//! (`kept`: at most KEEP_BLOCKS blocks and KEEP_BYTES bytes, each waiting only on its key's
//! stream); the heap's size and recorded request of each match the cache's. Lock order: a
//! heap, then the registry, then one cache; the fast paths take only their own cache's lock,
//! which nobody else takes but a drain, statistics, validation or another thread's free of a
//! block this cache lent (under the heap's lock, as the order says).

use super::addr_map::AddrMap;
use super::backend::Stream;
use super::device_heap::keeps_whole;
use super::pools::{PoolId, DEFAULT_POOL};
use super::stats::Stats;

/// Blocks handed out by a cache, by address. The most recently handed out (at most
/// RECENT_LENT) sit in a small array searched first: a block is usually freed soon after it was
/// taken, and a scan of a few addresses costs less than a hash insert and remove (which were a
/// quarter of a cached pair). Older ones move to the map. Every address is in one place only.
#[derive(Debug, Default)]
struct LentSet {
    recent: Vec<(u64, Lent)>,
    older: AddrMap<Lent>,
}

/// Handed-out blocks kept in `LentSet::recent` before older ones move to the map.
const RECENT_LENT: usize = 16;

impl LentSet {
    fn insert(&mut self, ptr: u64, l: Lent) {
        if self.recent.len() == RECENT_LENT {
            let (p, old) = self.recent.swap_remove(0);
            self.older.insert(p, old);
        }
        self.recent.push((ptr, l));
    }

    fn remove(&mut self, ptr: u64) -> Option<Lent> {
        match self.recent.iter().rposition(|e| e.0 == ptr) {
            Some(i) => Some(self.recent.swap_remove(i).1),
            None => self.older.remove(&ptr),
        }
    }

    fn get(&self, ptr: u64) -> Option<&Lent> {
        match self.recent.iter().rposition(|e| e.0 == ptr) {
            Some(i) => Some(&self.recent[i].1),
            None => self.older.get(&ptr),
        }
    }

    fn contains(&self, ptr: u64) -> bool {
        self.recent.iter().any(|e| e.0 == ptr) || self.older.contains_key(&ptr)
    }

    fn is_empty(&self) -> bool {
        self.recent.is_empty() && self.older.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = (u64, &Lent)> {
        self.recent
            .iter()
            .map(|(p, l)| (*p, l))
            .chain(self.older.iter().map(|(&p, l)| (p, l)))
    }
}

/// What a kept block is kept for: (pool, stream, rounded size).
pub type Key = (PoolId, Stream, u64);

/// How much a thread keeps: policy.rs.
pub use super::policy::{KEEP_BLOCKS, KEEP_BYTES, KEEP_POOL_BLOCKS, KEEP_REMOTE_BYTES};

#[derive(Debug)]
pub struct Kept {
    pub key: Key,
    pub ptr: u64,
    /// The block's size in the heap.
    pub size: u64,
    /// The request the heap recorded when it lent the block.
    pub recorded: u64,
}

#[derive(Debug)]
struct Lent {
    key: Key,
    size: u64,
    recorded: u64,
    /// What the current user asked for (the stats' requested bytes).
    requested: u64,
}

/// A free through the cache: kept, or the heap's to do.
#[derive(Debug, PartialEq, Eq)]
pub enum Keep {
    Kept,
    /// Not handed out by this cache, or not keepable (another size or stream, the cache full,
    /// a pool being released): the allocator takes it back and frees it in the heap.
    ToHeap,
}

/// What the cache knew of a block the heap said it lent.
#[derive(Debug, PartialEq, Eq)]
pub enum Reclaim {
    /// Handed out: taken back, with its user's request.
    Lent(u64),
    /// Kept: the user already freed it.
    Kept,
    Missing,
}

#[derive(Debug)]
pub struct ThreadCache {
    pub id: u64,
    pub device: i32,
    /// Its thread has exited: drain it and let it go.
    pub orphan: bool,
    kept: Vec<Kept>,
    lent: LentSet,
    kept_bytes: u64,
    /// Sum of kept blocks' recorded requests.
    kept_recorded: u64,
    /// Sum over lent blocks of (requested - recorded).
    lent_delta: i64,
    hits: u64,
}

impl ThreadCache {
    pub fn new(id: u64, device: i32) -> Self {
        ThreadCache {
            id,
            device,
            orphan: false,
            kept: Vec::new(),
            lent: LentSet::default(),
            kept_bytes: 0,
            kept_recorded: 0,
            lent_delta: 0,
            hits: 0,
        }
    }

    /// The newest kept block for `key`, handed out for `requested` bytes.
    pub fn take(&mut self, key: Key, requested: u64) -> Option<u64> {
        self.take_sized(key, requested).map(|(p, _)| p)
    }

    /// As `take`, with the block's size: (address, size).
    pub fn take_sized(&mut self, key: Key, requested: u64) -> Option<(u64, u64)> {
        let i = self.kept.iter().rposition(|k| k.key == key)?;
        let k = self.kept.swap_remove(i);
        self.kept_bytes -= k.size;
        self.kept_recorded -= k.recorded;
        self.lent_delta += requested as i64 - k.recorded as i64;
        self.hits += 1;
        self.lent.insert(
            k.ptr,
            Lent {
                key,
                size: k.size,
                recorded: k.recorded,
                requested,
            },
        );
        Some((k.ptr, k.size))
    }

    /// Records a block the heap just lent this cache for its first user.
    pub fn lend(&mut self, ptr: u64, key: Key, size: u64, recorded: u64) {
        self.lent.insert(
            ptr,
            Lent {
                key,
                size,
                recorded,
                requested: recorded,
            },
        );
    }

    /// A free of `ptr` (`size` bytes, on `stream`) by this cache's thread.
    pub fn keep(&mut self, ptr: u64, size: u64, stream: Stream, allowed: bool) -> Keep {
        match self.keep_sized(ptr, size, stream, allowed) {
            Some(_) => Keep::Kept,
            None => Keep::ToHeap,
        }
    }

    /// As `keep`; the kept block's size when it is kept.
    pub fn keep_sized(
        &mut self,
        ptr: u64,
        size: u64,
        stream: Stream,
        allowed: bool,
    ) -> Option<u64> {
        self.keep_within(ptr, size, stream, allowed, KEEP_BYTES)
    }

    /// As `keep_sized`, keeping at most `most_bytes` in all (KEEP_REMOTE_BYTES for a block
    /// another thread frees).
    pub fn keep_within(
        &mut self,
        ptr: u64,
        size: u64,
        stream: Stream,
        allowed: bool,
        most_bytes: u64,
    ) -> Option<u64> {
        let l = self.lent.remove(ptr)?;
        let most = if l.key.0 == DEFAULT_POOL {
            KEEP_BLOCKS
        } else {
            KEEP_POOL_BLOCKS
        };
        if !allowed
            || !keeps_whole(l.key.0, l.key.2)
            || l.requested != size
            || l.key.1 != stream
            || self.kept.len() >= most
            || self.kept_bytes + l.size > most_bytes.min(KEEP_BYTES)
        {
            self.lent.insert(ptr, l); // still lent: the heap takes it back from here
            return None;
        }
        self.lent_delta -= l.requested as i64 - l.recorded as i64;
        self.kept_bytes += l.size;
        self.kept_recorded += l.recorded;
        self.kept.push(Kept {
            key: l.key,
            ptr,
            size: l.size,
            recorded: l.recorded,
        });
        Some(l.size)
    }

    /// Takes back a block the heap lent this cache (for a free or `record_stream` the heap
    /// does itself).
    pub fn reclaim(&mut self, ptr: u64) -> Reclaim {
        if let Some(l) = self.lent.remove(ptr) {
            self.lent_delta -= l.requested as i64 - l.recorded as i64;
            return Reclaim::Lent(l.requested);
        }
        if self.kept.iter().any(|k| k.ptr == ptr) {
            Reclaim::Kept
        } else {
            Reclaim::Missing
        }
    }

    /// Removes and returns the kept blocks `which` selects.
    pub fn drain(&mut self, which: impl Fn(&Key) -> bool) -> Vec<Kept> {
        if !self.kept.iter().any(|k| which(&k.key)) {
            // The common case of a large request's miss (mod.rs): nothing of the class kept.
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.kept.len() {
            if which(&self.kept[i].key) {
                // In order: the kept blocks' order is the heap's order of frees (determinism).
                let k = self.kept.remove(i);
                self.kept_bytes -= k.size;
                self.kept_recorded -= k.recorded;
                out.push(k);
            } else {
                i += 1;
            }
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.kept.is_empty() && self.lent.is_empty()
    }

    /// The heap's statistics, with this cache's kept blocks counted as free and its lent
    /// blocks at their users' requests.
    pub fn adjust(&self, s: &mut Stats) {
        s.allocated_bytes -= self.kept_bytes;
        s.active_blocks -= self.kept.len() as u64;
        s.requested_bytes =
            (s.requested_bytes as i64 - self.kept_recorded as i64 + self.lent_delta) as u64;
        s.cache_hits += self.hits;
    }

    /// The current user's request and the allocation stream of a block this cache lent.
    pub fn lent_info(&self, ptr: u64) -> Option<(u64, Stream)> {
        self.lent.get(ptr).map(|l| (l.requested, l.key.1))
    }

    /// Addresses of the blocks this cache keeps (free to their users, live to the heap).
    pub fn kept_ptrs(&self) -> impl Iterator<Item = u64> + '_ {
        self.kept.iter().map(|k| k.ptr)
    }

    /// The largest block this cache keeps for `pool`.
    pub fn largest_kept(&self, pool: PoolId) -> u64 {
        self.kept
            .iter()
            .filter(|k| k.key.0 == pool)
            .map(|k| k.size)
            .max()
            .unwrap_or(0)
    }

    /// Every block this cache holds: (address, size, recorded request).
    pub fn blocks(&self) -> Vec<(u64, u64, u64)> {
        self.kept
            .iter()
            .map(|k| (k.ptr, k.size, k.recorded))
            .chain(self.lent.iter().map(|(p, l)| (p, l.size, l.recorded)))
            .collect()
    }

    /// The cache's own invariants (the counters equal their sums, the caps hold).
    pub fn validate(&self) -> Result<(), String> {
        let bytes: u64 = self.kept.iter().map(|k| k.size).sum();
        let rec: u64 = self.kept.iter().map(|k| k.recorded).sum();
        let delta: i64 = self
            .lent
            .iter()
            .map(|(_, l)| l.requested as i64 - l.recorded as i64)
            .sum();
        let r = &self.lent.recent;
        if r.len() > RECENT_LENT
            || r.iter().enumerate().any(|(i, e)| {
                self.lent.older.contains_key(&e.0) || r[..i].iter().any(|o| o.0 == e.0)
            })
        {
            return Err(format!(
                "thread cache {}: a lent block is listed twice, or the recent list overflowed",
                self.id
            ));
        }
        if (bytes, rec, delta) != (self.kept_bytes, self.kept_recorded, self.lent_delta) {
            return Err(format!(
                "thread cache {}: counters ({}, {}, {}) disagree with its blocks ({bytes}, {rec}, {delta})",
                self.id, self.kept_bytes, self.kept_recorded, self.lent_delta
            ));
        }
        if self.kept.len() > KEEP_BLOCKS || bytes > KEEP_BYTES {
            return Err(format!("thread cache {} keeps more than its caps", self.id));
        }
        if self.kept.iter().any(|k| self.lent.contains(k.ptr)) {
            return Err(format!(
                "thread cache {}: a block is both kept and lent",
                self.id
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::pools::DEFAULT_POOL;

    #[test]
    fn a_block_is_kept_only_for_its_size_stream_and_user() {
        let mut c = ThreadCache::new(1, 0);
        let key = (DEFAULT_POOL, 7, 1024);
        c.lend(0x1000, key, 1024, 1000);
        assert_eq!(c.keep(0x1000, 999, 7, true), Keep::ToHeap, "wrong size");
        assert_eq!(
            c.keep(0x1000, 1000, 8, true),
            Keep::ToHeap,
            "another stream"
        );
        assert_eq!(
            c.keep(0x1000, 1000, 7, false),
            Keep::ToHeap,
            "a pool is being released"
        );
        assert_eq!(c.keep(0x2000, 1000, 7, true), Keep::ToHeap, "not lent here");
        assert_eq!(c.keep(0x1000, 1000, 7, true), Keep::Kept);
        assert_eq!(c.reclaim(0x1000), Reclaim::Kept, "a second free");
        assert_eq!(
            c.take((DEFAULT_POOL, 8, 1024), 1000),
            None,
            "another stream"
        );
        assert_eq!(c.take(key, 900), Some(0x1000));
        let mut s = Stats {
            allocated_bytes: 1024,
            requested_bytes: 1000,
            active_blocks: 1,
            ..Stats::default()
        };
        c.adjust(&mut s);
        assert_eq!(
            (s.allocated_bytes, s.requested_bytes, s.cache_hits),
            (1024, 900, 1)
        );
        assert_eq!(c.reclaim(0x1000), Reclaim::Lent(900));
        assert!(c.is_empty());
        c.validate().unwrap();
    }

    #[test]
    fn lent_blocks_past_the_recent_list_move_to_the_map_and_come_back() {
        let mut c = ThreadCache::new(1, 0);
        let key = (DEFAULT_POOL, 7, 4096);
        let n = RECENT_LENT as u64 * 3;
        for i in 0..n {
            c.lend(0x10_0000 + i * 0x1000, key, 4096, 4000);
        }
        assert_eq!(c.lent.recent.len(), RECENT_LENT);
        assert_eq!(c.lent.older.len(), n as usize - RECENT_LENT);
        c.validate().unwrap();
        // Freed in another order than lent: every one is found, once.
        for i in (0..n).rev().step_by(2).chain((0..n).step_by(2)) {
            assert_eq!(
                c.reclaim(0x10_0000 + i * 0x1000),
                Reclaim::Lent(4000),
                "block {i}"
            );
            assert_eq!(
                c.reclaim(0x10_0000 + i * 0x1000),
                Reclaim::Missing,
                "block {i}"
            );
        }
        assert!(c.is_empty());
        c.validate().unwrap();
    }

    #[test]
    fn the_caps_hold_and_drains_select() {
        let mut c = ThreadCache::new(1, 0);
        for i in 0..KEEP_BLOCKS as u64 + 2 {
            let key = (DEFAULT_POOL, i % 2, 512);
            c.lend(0x1000 * (i + 1), key, 512, 512);
            let kept = c.keep(0x1000 * (i + 1), 512, i % 2, true);
            assert_eq!(kept == Keep::Kept, (i as usize) < KEEP_BLOCKS, "block {i}");
        }
        let mut s = Stats {
            allocated_bytes: 512 * (KEEP_BLOCKS as u64 + 2),
            requested_bytes: 512 * (KEEP_BLOCKS as u64 + 2),
            active_blocks: KEEP_BLOCKS as u64 + 2,
            ..Stats::default()
        };
        c.adjust(&mut s);
        assert_eq!(
            (s.allocated_bytes, s.active_blocks),
            (1024, 2),
            "two still lent"
        );
        let odd = c.drain(|k| k.1 == 1);
        assert_eq!(odd.len(), KEEP_BLOCKS / 2);
        c.validate().unwrap();
        let big = (DEFAULT_POOL, 0, KEEP_BYTES);
        c.lend(0x9_0000_0000, big, KEEP_BYTES, KEEP_BYTES);
        assert_eq!(
            c.keep(0x9_0000_0000, KEEP_BYTES, 0, true),
            Keep::ToHeap,
            "bytes cap"
        );
    }

    #[test]
    fn another_pools_blocks_have_the_smaller_cap() {
        let mut c = ThreadCache::new(1, 0);
        let pool = PoolId(3, 1);
        for i in 0..KEEP_POOL_BLOCKS as u64 + 1 {
            c.lend(0x1000 * (i + 1), (pool, 7, 512), 512, 512);
            let kept = c.keep(0x1000 * (i + 1), 512, 7, true);
            assert_eq!(
                kept == Keep::Kept,
                (i as usize) < KEEP_POOL_BLOCKS,
                "block {i}"
            );
        }
        // The default pool's blocks still fit, up to KEEP_BLOCKS in all.
        c.lend(0x100_0000, (DEFAULT_POOL, 7, 512), 512, 512);
        assert_eq!(c.keep(0x100_0000, 512, 7, true), Keep::Kept);
        c.validate().unwrap();
    }

    #[test]
    fn another_pools_large_blocks_are_not_kept() {
        let mut c = ThreadCache::new(1, 0);
        let big = 4 << 20;
        c.lend(0x1000, (PoolId(3, 1), 7, big), big, big);
        assert_ne!(
            c.keep(0x1000, big, 7, true),
            Keep::Kept,
            "a capture pool's 4 MiB block"
        );
        c.lend(0x2000_0000, (DEFAULT_POOL, 7, big), big, big);
        assert_eq!(
            c.keep(0x2000_0000, big, 7, true),
            Keep::Kept,
            "the default pool's"
        );
        c.validate().unwrap();
    }
}
