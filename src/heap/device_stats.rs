//! PyTorch's allocator statistics (`c10::CachingDeviceAllocator::DeviceStats`) kept by the
//! heap: the `symm_device_stats_t` of the C ABI, which the C++ allocator for PyTorch
//! (python/symmalloc/csrc) copies field by field into PyTorch's struct.
//!
//! Two owners, no walk over blocks on a read:
//! - `UserCounters` (per device, atomics): what users hold, counted where a block is handed
//!   out or given back (`Allocator::malloc_in` / `free`), whether the heap or a thread cache
//!   served it: allocations, their block bytes and requested bytes, per size class.
//! - `HeapCounters` (inside `DeviceHeap`, under its lock): segments and reserved bytes per
//!   class, the heap's blocks per class, the segments that are one whole free block, retries,
//!   out-of-memory failures and device synchronisations.
//!
//! Derived on a read: `active` equals `allocation` (symmalloc orders reuse by stream, with no
//! pending-event state between "allocated" and "free"); `inactive_split` is the memory of
//! segments that are not wholly free minus what users hold (bytes: reserved - wholly free -
//! active; blocks: heap blocks - wholly free segments - active), so blocks kept by thread
//! caches and parked blocks count there, as PyTorch counts its cached split blocks. Its peak
//! is the highest value a read has seen.
//!
//! Invariants (`HeapCounters::check`, from `validate`): every heap counter equals its sum over
//! the segments and blocks.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

/// One statistic as PyTorch keeps it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    /// Added since the last reset of accumulated statistics.
    pub allocated: i64,
    /// Taken away since that reset.
    pub freed: i64,
}

/// Index into a `StatArray`: all pools, then small (blocks up to 1 MiB) and large.
pub const AGGREGATE: usize = 0;
pub const SMALL: usize = 1;
pub const LARGE: usize = 2;

pub type StatArray = [Stat; 3];

/// PyTorch's `DeviceStats`, field for field (c10/core/CachingDeviceAllocator.h, torch 2.11).
/// Fields are only ever appended (`symm_device_stats` takes the caller's size).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    pub allocation: StatArray,
    pub segment: StatArray,
    pub active: StatArray,
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    pub requested_bytes: StatArray,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub oversize_allocations: Stat,
    pub oversize_segments: Stat,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    /// -1: symmalloc splits blocks of any size (PyTorch reports SIZE_MAX so).
    pub max_split_size: i64,
}

/// A counter that only goes up and one that only goes down; current = ups - downs.
#[derive(Debug, Default)]
struct Track {
    ups: AtomicI64,
    downs: AtomicI64,
    peak: AtomicI64,
    base_ups: AtomicI64,
    base_downs: AtomicI64,
}

impl Track {
    fn up(&self, n: i64) {
        let cur = self.ups.fetch_add(n, Relaxed) + n - self.downs.load(Relaxed);
        if cur > self.peak.load(Relaxed) {
            self.peak.fetch_max(cur, Relaxed);
        }
    }
    fn down(&self, n: i64) {
        self.downs.fetch_add(n, Relaxed);
    }
    fn read(&self) -> Stat {
        let (u, d) = (self.ups.load(Relaxed), self.downs.load(Relaxed));
        Stat {
            current: u - d,
            peak: self.peak.load(Relaxed).max(u - d),
            allocated: u - self.base_ups.load(Relaxed),
            freed: d - self.base_downs.load(Relaxed),
        }
    }
    fn reset_peak(&self) {
        self.peak
            .store(self.ups.load(Relaxed) - self.downs.load(Relaxed), Relaxed);
    }
    fn reset_accumulated(&self) {
        self.base_ups.store(self.ups.load(Relaxed), Relaxed);
        self.base_downs.store(self.downs.load(Relaxed), Relaxed);
    }
}

/// The class index of a block of `rounded` bytes.
pub fn class_index(rounded: u64) -> usize {
    if rounded <= super::size_class::SMALL_MAX {
        SMALL
    } else {
        LARGE
    }
}

/// What users hold on one device (module header). Lock-free: updated on every handed-out and
/// given-back block.
#[derive(Debug, Default)]
pub struct UserCounters {
    /// [count, block bytes, requested bytes] x [aggregate, small, large].
    t: [[Track; 3]; 3],
}

impl UserCounters {
    /// A block of `bsize` bytes (class by `bsize`) handed out for `requested` bytes.
    pub fn alloc(&self, bsize: u64, requested: u64) {
        let c = class_index(bsize);
        for i in [AGGREGATE, c] {
            self.t[0][i].up(1);
            self.t[1][i].up(bsize as i64);
            self.t[2][i].up(requested as i64);
        }
    }
    pub fn free(&self, bsize: u64, requested: u64) {
        let c = class_index(bsize);
        for i in [AGGREGATE, c] {
            self.t[0][i].down(1);
            self.t[1][i].down(bsize as i64);
            self.t[2][i].down(requested as i64);
        }
    }
    /// (allocations, block bytes, requested bytes), each per class.
    fn read(&self) -> [StatArray; 3] {
        std::array::from_fn(|k| std::array::from_fn(|i| self.t[k][i].read()))
    }
    fn each(&self, f: impl Fn(&Track)) {
        self.t.iter().flatten().for_each(f);
    }
}

/// A heap-side statistic under the heap's lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Plain(pub Stat);

impl Plain {
    pub fn up(&mut self, n: i64) {
        self.0.current += n;
        self.0.allocated += n;
        self.0.peak = self.0.peak.max(self.0.current);
    }
    pub fn down(&mut self, n: i64) {
        self.0.current -= n;
        self.0.freed += n;
    }
}

/// The heap's own counters (module header). Indexed by class: 0 small, 1 large.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeapCounters {
    pub segment: [Plain; 2],
    pub reserved_bytes: [Plain; 2],
    /// Blocks of the heap (live, parked, free), per class.
    pub blocks: [i64; 2],
    /// Segments without a live or parked block (one free block each, or a few that wait on
    /// different streams) and their bytes.
    pub whole_free: [(i64, i64); 2],
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    /// Highest inactive_split (count, bytes) per aggregate/small/large seen by a read.
    pub split_peak: [(i64, i64); 3],
}

/// Class slot of `HeapCounters` (0 small, 1 large).
pub fn slot(class: super::size_class::Class) -> usize {
    match class {
        super::size_class::Class::Small => 0,
        super::size_class::Class::Large => 1,
    }
}

impl HeapCounters {
    pub fn reset_peak(&mut self, users: &UserCounters) {
        for p in self
            .segment
            .iter_mut()
            .chain(self.reserved_bytes.iter_mut())
        {
            p.0.peak = p.0.current;
        }
        self.split_peak = [(0, 0); 3];
        users.each(Track::reset_peak);
    }

    pub fn reset_accumulated(&mut self, users: &UserCounters) {
        for p in self
            .segment
            .iter_mut()
            .chain(self.reserved_bytes.iter_mut())
        {
            p.0.allocated = 0;
            p.0.freed = 0;
        }
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        users.each(Track::reset_accumulated);
    }

    /// PyTorch's statistics from these counters and the users' (module header).
    pub fn read(&mut self, users: &UserCounters) -> DeviceStats {
        let [count, bytes, requested] = users.read();
        let agg = |a: &[Plain; 2]| {
            let (s, l) = (a[0].0, a[1].0);
            [
                Stat {
                    current: s.current + l.current,
                    // The aggregate's own peak is not kept: the larger class peak is a floor.
                    peak: (s.peak.max(l.peak)).max(s.current + l.current),
                    allocated: s.allocated + l.allocated,
                    freed: s.freed + l.freed,
                },
                s,
                l,
            ]
        };
        let segment = agg(&self.segment);
        let reserved = agg(&self.reserved_bytes);
        let mut split = [Stat::default(); 3];
        let mut split_bytes = [Stat::default(); 3];
        for i in [SMALL, LARGE] {
            let c = i - 1;
            let n = (self.blocks[c] - self.whole_free[c].0 - count[i].current).max(0);
            let b = (reserved[i].current - self.whole_free[c].1 - bytes[i].current).max(0);
            split[i].current = n;
            split_bytes[i].current = b;
        }
        split[AGGREGATE].current = split[SMALL].current + split[LARGE].current;
        split_bytes[AGGREGATE].current = split_bytes[SMALL].current + split_bytes[LARGE].current;
        for i in 0..3 {
            let p = &mut self.split_peak[i];
            p.0 = p.0.max(split[i].current);
            p.1 = p.1.max(split_bytes[i].current);
            split[i].peak = p.0;
            split_bytes[i].peak = p.1;
        }
        DeviceStats {
            allocation: count,
            segment,
            active: count,
            inactive_split: split,
            allocated_bytes: bytes,
            reserved_bytes: reserved,
            active_bytes: bytes,
            inactive_split_bytes: split_bytes,
            requested_bytes: requested,
            num_alloc_retries: self.num_alloc_retries,
            num_ooms: self.num_ooms,
            oversize_allocations: Stat::default(),
            oversize_segments: Stat::default(),
            num_sync_all_streams: self.num_sync_all_streams,
            num_device_alloc: self.num_device_alloc,
            num_device_free: self.num_device_free,
            max_split_size: -1,
        }
    }

    /// The counters that `validate` recomputes from the structures: (segments, reserved bytes,
    /// blocks, wholly free segments and their bytes) per class.
    pub fn check(&self, want: [(i64, i64, i64, i64, i64); 2]) -> Result<(), String> {
        for (c, w) in want.iter().enumerate() {
            let have = (
                self.segment[c].0.current,
                self.reserved_bytes[c].0.current,
                self.blocks[c],
                self.whole_free[c].0,
                self.whole_free[c].1,
            );
            if have != *w {
                return Err(format!(
                    "device statistics of class {c}: counters (segments, reserved, blocks, whole \
                     free, their bytes) {have:?}; the structures give {w:?}"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_pytorchs() {
        // 9 arrays of 3 stats of 4 int64, 2 counts, 2 stats, 4 counts: DeviceStats of torch 2.11.
        assert_eq!(
            std::mem::size_of::<DeviceStats>(),
            (9 * 3 * 4 + 2 + 2 * 4 + 4) * 8
        );
        assert_eq!(std::mem::size_of::<DeviceStats>(), 976);
    }

    #[test]
    fn user_counters_track_current_peak_and_accumulated() {
        let u = UserCounters::default();
        u.alloc(512, 100);
        u.alloc(2 << 20, 2 << 20);
        u.free(512, 100);
        let [n, b, r] = u.read();
        assert_eq!(n[AGGREGATE].current, 1);
        assert_eq!(n[AGGREGATE].peak, 2);
        assert_eq!(n[SMALL].allocated, 1);
        assert_eq!(n[SMALL].freed, 1);
        assert_eq!(b[LARGE].current, 2 << 20);
        assert_eq!(r[AGGREGATE].peak, 100 + (2 << 20));
        let mut h = HeapCounters::default();
        h.reset_peak(&u);
        h.reset_accumulated(&u);
        let [n, b, _] = u.read();
        assert_eq!(n[AGGREGATE].peak, 1);
        assert_eq!((n[AGGREGATE].allocated, n[AGGREGATE].freed), (0, 0));
        assert_eq!(
            b[AGGREGATE].current,
            2 << 20,
            "current survives both resets"
        );
    }

    #[test]
    fn inactive_split_is_what_split_segments_hold_beyond_users() {
        let u = UserCounters::default();
        let mut h = HeapCounters::default();
        // One small segment of 2 MiB split into a live 512-byte block and a free rest.
        h.segment[0].up(1);
        h.reserved_bytes[0].up(2 << 20);
        h.blocks[0] = 2;
        u.alloc(512, 512);
        let s = h.read(&u);
        assert_eq!(s.inactive_split[SMALL].current, 1);
        assert_eq!(s.inactive_split_bytes[SMALL].current, (2 << 20) - 512);
        assert_eq!(s.inactive_split_bytes[AGGREGATE].current, (2 << 20) - 512);
        // Freed and merged: the segment is wholly free, nothing is split.
        u.free(512, 512);
        h.blocks[0] = 1;
        h.whole_free[0] = (1, 2 << 20);
        let s = h.read(&u);
        assert_eq!(s.inactive_split[SMALL].current, 0);
        assert_eq!(s.inactive_split_bytes[SMALL].current, 0);
        assert_eq!(s.inactive_split_bytes[SMALL].peak, (2 << 20) - 512);
        assert_eq!(s.max_split_size, -1);
    }
}
