//! Size classes: how a request is rounded, and which segments serve it (small blocks from
//! small segments, large from large ones, huge requests a segment of their own). The heap's
//! placement (device_heap/) and its statistics (device_stats.rs) both read these, so they live
//! below both.
//!
//! Invariants: `round_request` is a multiple of `ROUND` and at least `ROUND`; `class_of` is
//! `Small` exactly for rounded sizes up to `SMALL_MAX`.

/// Requests are rounded up to this (keeps every block 512-byte aligned).
pub const ROUND: u64 = 512;
/// Requests up to this size come from small segments.
pub const SMALL_MAX: u64 = 1 << 20;
pub const SMALL_SEGMENT: u64 = 2 << 20;
pub const LARGE_SEGMENT: u64 = 20 << 20;
/// Requests from this size get a segment of their own (rounded to the granularity).
pub const HUGE_MIN: u64 = 10 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Small,
    Large,
}

pub fn round_request(size: u64) -> u64 {
    size.div_ceil(ROUND).max(1) * ROUND
}

pub fn class_of(rounded: u64) -> Class {
    if rounded <= SMALL_MAX {
        Class::Small
    } else {
        Class::Large
    }
}
