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
//! The aggregate (all classes) of segments and reserved bytes is kept as a statistic of its own,
//! so its peak is the highest total ever held (PyTorch's `max_memory_reserved`), not the larger
//! of the two class peaks (which misses a peak held by both classes at once).
//!
//! Segment events: while `set_segment_log(true)` (the C++ allocator's memory history and trace
//! trackers), every segment made, grown in place or given back is also written to its heap's
//! log, which `take_events` drains (PyTorch's SEGMENT_ALLOC, SEGMENT_MAP and SEGMENT_FREE trace
//! entries). A log holds at most `LOG_CAP` events: past that the oldest go, counted in one
//! `SegmentEvent::Lost` at the front.
//!
//! Invariants (`HeapCounters::check`, from `validate`): every heap counter equals its sum over
//! the segments and blocks; the aggregates equal the sums of the classes' current values.

use super::pools::PoolId;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};

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

/// What happened to a segment (module header): offsets are from the heap's base.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentEvent {
    /// A new segment of `size` bytes at `offset`.
    Made {
        offset: u64,
        size: u64,
        pool: PoolId,
    },
    /// The segment at `segment` grew in place: `size` bytes mapped at `offset`.
    Grown {
        segment: u64,
        offset: u64,
        size: u64,
        pool: PoolId,
    },
    /// The segment at `offset`, `size` bytes in all (its grown chunks too), given back whole.
    Freed {
        offset: u64,
        size: u64,
        pool: PoolId,
    },
    /// This many events before the next ones were dropped (the log was full).
    Lost { count: u64 },
}

/// Whether segment events are logged (module header); off until the C++ allocator asks.
static SEGMENT_LOG: AtomicBool = AtomicBool::new(false);
/// Events logged and not yet taken, over every heap of the process: lets a drain with nothing
/// to take return without a lock.
static PENDING: AtomicU64 = AtomicU64::new(0);
/// Events a heap's log holds at most.
pub const LOG_CAP: usize = 1 << 16;

/// Turns the segment event log on or off for every heap (events already logged stay).
pub fn set_segment_log(on: bool) {
    SEGMENT_LOG.store(on, Relaxed);
}

/// Whether any heap holds segment events not yet taken.
pub fn events_pending() -> bool {
    PENDING.load(Relaxed) > 0
}

/// The heap's own counters (module header). Indexed by class: 0 small, 1 large.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeapCounters {
    /// Per class; changed only through `segment_made`, `segment_grown` and `segment_freed`,
    /// which keep the aggregates beside them.
    segment: [Plain; 2],
    reserved_bytes: [Plain; 2],
    /// The aggregates (all classes), with their own peaks.
    segment_all: Plain,
    reserved_all: Plain,
    /// The segment event log (module header) and the events dropped from its front.
    events: std::collections::VecDeque<SegmentEvent>,
    lost: u64,
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
    /// A new segment of class slot `k`: `len` bytes at `offset` for `pool`.
    pub fn segment_made(&mut self, k: usize, offset: u64, len: u64, pool: PoolId) {
        self.segment[k].up(1);
        self.segment_all.up(1);
        self.reserved_up(k, len);
        self.log(SegmentEvent::Made {
            offset,
            size: len,
            pool,
        });
    }

    /// The segment at `segment` (class slot `k`) grew in place by `len` bytes at `offset`.
    pub fn segment_grown(&mut self, k: usize, segment: u64, offset: u64, len: u64, pool: PoolId) {
        self.reserved_up(k, len);
        self.log(SegmentEvent::Grown {
            segment,
            offset,
            size: len,
            pool,
        });
    }

    /// The segment at `offset` (class slot `k`, `len` bytes in all) was given back.
    pub fn segment_freed(&mut self, k: usize, offset: u64, len: u64, pool: PoolId) {
        self.segment[k].down(1);
        self.segment_all.down(1);
        self.reserved_bytes[k].down(len as i64);
        self.reserved_all.down(len as i64);
        self.log(SegmentEvent::Freed {
            offset,
            size: len,
            pool,
        });
    }

    fn reserved_up(&mut self, k: usize, len: u64) {
        self.reserved_bytes[k].up(len as i64);
        self.reserved_all.up(len as i64);
    }

    fn log(&mut self, e: SegmentEvent) {
        if !SEGMENT_LOG.load(Relaxed) {
            return;
        }
        if self.events.len() >= LOG_CAP {
            self.events.pop_front();
            self.lost += 1;
        } else {
            PENDING.fetch_add(1, Relaxed);
        }
        self.events.push_back(e);
    }

    /// Takes up to `max` of the logged segment events, oldest first (a `Lost` first when some
    /// were dropped; it counts as one of the `max`).
    pub fn take_events(&mut self, max: usize) -> Vec<SegmentEvent> {
        let mut out = Vec::new();
        if max > 0 && self.lost > 0 {
            out.push(SegmentEvent::Lost { count: self.lost });
            self.lost = 0;
        }
        let n = (max - out.len()).min(self.events.len());
        out.extend(self.events.drain(..n));
        PENDING.fetch_sub(n as u64, Relaxed);
        out
    }

    pub fn reset_peak(&mut self, users: &UserCounters) {
        for p in self
            .segment
            .iter_mut()
            .chain(self.reserved_bytes.iter_mut())
            .chain([&mut self.segment_all, &mut self.reserved_all])
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
            .chain([&mut self.segment_all, &mut self.reserved_all])
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
        let agg = |all: &Plain, a: &[Plain; 2]| [all.0, a[0].0, a[1].0];
        let segment = agg(&self.segment_all, &self.segment);
        let reserved = agg(&self.reserved_all, &self.reserved_bytes);
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
        let sums = (
            self.segment[0].0.current + self.segment[1].0.current,
            self.reserved_bytes[0].0.current + self.reserved_bytes[1].0.current,
        );
        let all = (self.segment_all.0.current, self.reserved_all.0.current);
        if sums != all {
            return Err(format!(
                "device statistics: aggregate (segments, reserved) {all:?}; the classes sum to \
                 {sums:?}"
            ));
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
        h.segment_made(0, 0, 2 << 20, PoolId(0, 0));
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

    #[test]
    fn max_reserved_is_the_highest_total_not_the_larger_class_peak() {
        let u = UserCounters::default();
        let mut h = HeapCounters::default();
        let pool = PoolId(0, 0);
        // 2 MiB small, then 20 MiB large while the small one is held: 22 MiB at once; then the
        // small segment goes back.
        h.segment_made(0, 0, 2 << 20, pool);
        h.segment_made(1, 2 << 20, 20 << 20, pool);
        h.segment_freed(0, 0, 2 << 20, pool);
        let s = h.read(&u);
        assert_eq!(s.reserved_bytes[AGGREGATE].current, 20 << 20);
        assert_eq!(s.reserved_bytes[SMALL].peak, 2 << 20);
        assert_eq!(s.reserved_bytes[LARGE].peak, 20 << 20);
        assert_eq!(
            s.reserved_bytes[AGGREGATE].peak,
            22 << 20,
            "both classes were held at once: the peak is their sum then"
        );
        assert_eq!(s.segment[AGGREGATE].peak, 2);
        assert_eq!(s.segment[AGGREGATE].current, 1);
        assert_eq!(
            (
                s.reserved_bytes[AGGREGATE].allocated,
                s.reserved_bytes[AGGREGATE].freed
            ),
            (22 << 20, 2 << 20)
        );
        // Growth in place counts in the aggregate too; a reset brings the peak to the current.
        h.segment_grown(1, 2 << 20, 22 << 20, 4 << 20, pool);
        assert_eq!(h.read(&u).reserved_bytes[AGGREGATE].peak, 24 << 20);
        h.segment_freed(1, 2 << 20, 24 << 20, pool);
        h.reset_peak(&u);
        let s = h.read(&u);
        assert_eq!(s.reserved_bytes[AGGREGATE].peak, 0);
        assert_eq!(s.segment[AGGREGATE].peak, 0);
        h.reset_accumulated(&u);
        assert_eq!(h.read(&u).reserved_bytes[AGGREGATE].allocated, 0);
    }

    #[test]
    fn segment_events_are_logged_in_order_while_on_and_drained() {
        let mut h = HeapCounters::default();
        let pool = PoolId(0, 7);
        set_segment_log(true);
        h.segment_made(1, 0, 20 << 20, pool);
        h.segment_grown(1, 0, 20 << 20, 2 << 20, pool);
        h.segment_freed(1, 0, 22 << 20, pool);
        let first = h.take_events(2);
        let rest = h.take_events(10);
        assert_eq!(
            first,
            vec![
                SegmentEvent::Made {
                    offset: 0,
                    size: 20 << 20,
                    pool
                },
                SegmentEvent::Grown {
                    segment: 0,
                    offset: 20 << 20,
                    size: 2 << 20,
                    pool
                },
            ]
        );
        assert_eq!(
            rest,
            vec![SegmentEvent::Freed {
                offset: 0,
                size: 22 << 20,
                pool
            }]
        );
        assert!(h.take_events(10).is_empty());
        // A full log drops its oldest events and says how many.
        for i in 0..LOG_CAP as u64 + 3 {
            h.segment_made(0, i << 21, 2 << 20, pool);
        }
        let all = h.take_events(usize::MAX);
        assert_eq!(all[0], SegmentEvent::Lost { count: 3 });
        assert_eq!(all.len(), LOG_CAP + 1);
        assert_eq!(
            all[1],
            SegmentEvent::Made {
                offset: 3 << 21,
                size: 2 << 20,
                pool
            }
        );
    }
}
