//! Donors: whole free segments taken from other pools before a pool grows (`adopt_segment`,
//! rung 4 of the growth ladder: placement.rs, `place`).
//!
//! Before a pool grows, it takes a whole free segment (no live or parked block) cached by a
//! donor: the default pool, or a pool being released (its free segments stay only while the
//! device could not be waited for, e.g. during a capture). Never the internal pool (the
//! communicator's own, which neither gives nor takes), never a live user pool (a captured graph
//! replays into its pool's free blocks; a MemPool keeps what it holds). For a small request the
//! donors' parked blocks are drained first (large ones never park).
//! Rule: best fit by (size, offset) among donor segments of the request's class whose size is
//! at least the rounded request and at most the size a new segment would have plus
//! `LARGE_SEGMENT` (larger ones stay with the donor: a segment moved into a live pool comes
//! back only when that pool is released). The segment keeps its offset, size, generation and
//! physical memory (peers' mappings stay valid); its blocks are merged into one free block of
//! the taker that waits on every stream they waited on, so `take` orders the requesting stream
//! after each (`cuStreamWaitEvent`).
//! Under capture, a segment qualifies only if none of its blocks waits on a stream other than
//! the capturing one (an eager stream cannot be joined into a capture, and polling it is not
//! allowed); outside capture, only if none of those streams is capturing. The choice reads
//! the call sequence only.
//!
//! Invariants kept (mod.rs lists them all): a segment moves only whole and free, from a donor
//! to another pool, neither of them reserved (the internal pool, an arena's); its blocks become
//! the taker's one free block (`NO_PREV`), listed once in its free lists under its first
//! stream; `Pool::segments` counts each pool's segments (a pool being released goes when its
//! last one does).

use super::*;
use crate::heap::pools;

impl DeviceHeap {
    /// Whether `donor`'s whole free segments may move to `taker` (the module header's donors).
    pub(super) fn is_donor(&self, donor: PoolId, taker: PoolId) -> bool {
        donor != taker
            && !pools::is_reserved(donor)
            && !pools::is_reserved(taker)
            && (donor == DEFAULT_POOL || self.pools.get(&donor).is_some_and(|p| p.releasing))
    }

    /// Before `pool` grows for `rounded` bytes of `class` on `stream`: moves the best-fitting
    /// whole free segment of a donor pool into `pool` (the module header states the rule) and
    /// returns its offset, now one free block of `pool`; `None` when no donor segment qualifies.
    pub(super) fn adopt_segment(
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
        let donors: Vec<PoolId> = self
            .pools
            .keys()
            .copied()
            .filter(|&d| self.is_donor(d, pool))
            .collect();
        if donors.is_empty() {
            return Ok(None);
        }
        if class == Class::Small {
            // (Large blocks are never parked.)
            for &d in &donors {
                self.drain_parked(Some(d));
            }
        }
        let most = match class {
            Class::Small => segment_size(class, rounded, self.gran),
            Class::Large => segment_size(class, rounded, self.gran) + LARGE_SEGMENT,
        };
        let mut fits: Vec<(u64, u64)> = self
            .segments
            .iter()
            .filter(|(_, s)| {
                s.live == 0
                    && s.class == class
                    && (rounded..=most).contains(&s.size)
                    && donors.contains(&s.pool)
            })
            .map(|(&o, s)| (s.size, o))
            .collect();
        fits.sort_unstable();
        let mut capturing = None;
        for (size, seg) in fits {
            let mut ok = true;
            for (_, b) in self.segment_blocks(seg) {
                if !self.reusable(backend, &b.streams, stream, &mut capturing)? {
                    ok = false;
                    break;
                }
            }
            if ok {
                crate::trace!(
                    "device {}: pool {} takes the free segment of {size} bytes at {seg:#x} \
                     of pool {} for {rounded} bytes",
                    self.device,
                    pool,
                    self.segments[&seg].pool
                );
                self.move_segment(seg, pool);
                return Ok(Some(seg));
            }
        }
        Ok(None)
    }

    /// Moves the free segment at `seg` (no live or parked block) to `taker`, as one free block
    /// that waits on every stream its blocks waited on (in address order, first seen first).
    fn move_segment(&mut self, seg: u64, taker: PoolId) {
        let (len, donor) = {
            let s = &self.segments[&seg];
            debug_assert_eq!(s.live, 0);
            (s.size, s.pool)
        };
        let offs: Vec<u64> = self.segment_blocks(seg).map(|(o, _)| o).collect();
        debug_assert_eq!(offs.iter().map(|o| self.blocks[o].size).sum::<u64>(), len);
        let class = self.segments[&seg].class;
        self.counters.blocks[slot(class)] -= offs.len() as i64 - 1;
        let mut streams: Vec<Stream> = Vec::new();
        for &o in &offs {
            self.unlist_free(o);
            let b = self.blocks.remove(&o).expect("block of the segment");
            debug_assert!(b.is_free());
            for s in b.streams {
                if !streams.contains(&s) {
                    streams.push(s);
                }
            }
        }
        self.blocks.insert(
            seg,
            Block {
                size: len,
                segment: seg,
                pool: taker,
                class,
                prev: NO_PREV,
                state: State::Free,
                streams,
            },
        );
        self.segments.get_mut(&seg).expect("segment").pool = taker;
        let d = self.pools.get_mut(&donor).expect("donor pool exists");
        d.segments -= 1;
        if d.segments == 0 && d.releasing {
            self.remove_pool(donor);
        }
        self.pools.entry(taker).or_default().segments += 1;
        self.list_free(seg);
        self.adopted_segments += 1;
    }
}
