//! Size classes: how a request is rounded, and which segments serve it (small blocks from
//! small segments, large from large ones, huge requests a segment of their own). The heap's
//! placement (device_heap/) and its statistics (device_stats.rs) both read these, so they live
//! below both.
//!
//! The constants are policy (policy.rs).
//!
//! Invariants: `round_request` is a multiple of `ROUND` and at least `ROUND`; `class_of` is
//! `Small` exactly for rounded sizes up to `SMALL_MAX`.

pub use super::policy::{HUGE_MIN, LARGE_SEGMENT, ROUND, SMALL_MAX, SMALL_SEGMENT};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Small,
    Large,
}

pub fn round_request(size: u64) -> u64 {
    size.div_ceil(ROUND).max(1) * ROUND
}

/// The size of the segment the growth ladder makes for a request of `rounded` bytes of `class`
/// on a heap mapped in `gran` units: a small segment, a large one, or (from `HUGE_MIN`) one of
/// its own. The ladder (device_heap/placement.rs), the donors (donors.rs) and the trim before
/// growing (release.rs) read it; it lives here so none of them calls into another for it.
pub fn segment_size(class: Class, rounded: u64, gran: u64) -> u64 {
    let s = match class {
        Class::Small => SMALL_SEGMENT,
        Class::Large if rounded < HUGE_MIN => LARGE_SEGMENT,
        Class::Large => rounded,
    };
    s.next_multiple_of(gran)
}

pub fn class_of(rounded: u64) -> Class {
    if rounded <= SMALL_MAX {
        Class::Small
    } else {
        Class::Large
    }
}
