//! Where a pool's large blocks go once freed (device_heap/mod.rs, `keeps_whole`): in a pool
//! other than the default one they merge with their free neighbours at once and the next
//! request takes the best fit, neither parked in the heap nor kept by the thread cache for the
//! next request of the same size. The sequence below is the one that cost the first capture of
//! `bench/global_memory.py`'s ten shared-pool graphs 420 MiB: reusing a freed block of the same
//! size where it sat left its free neighbour apart, and a larger request then needed a new
//! segment. The default pool keeps its blocks whole (the eager fast path).
//!
//! And where never-used memory stands in best fit: with the requesting stream's own blocks, on
//! every stream (it waits on none), not only on the legacy default stream 0. And best fit in a
//! pool fragmented past a free-list set's vector form.

use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::pools::{PoolId, DEFAULT_POOL};
use symmalloc::heap::Allocator;

const MIB: u64 = 1 << 20;

fn host() -> Allocator {
    Allocator::new(Box::new(HostBackend)).unwrap()
}

/// The (offset, size) of the segment holding `ptr`.
fn segment(a: &Allocator, ptr: u64) -> (u64, u64) {
    let (off, size, _) = a
        .segment_span(0, ptr)
        .unwrap()
        .expect("ptr is in a segment");
    (off, size)
}

/// Segment S1 of 124 MiB holds a 98 MiB block P and 26 MiB free; S2 holds E, exactly 98 MiB.
/// E and then P are freed; then 98 MiB and 122.5 MiB are asked for. Returns where the 98 went,
/// whether the heap grew for the 122.5, and S1's and S2's offsets.
fn scenario(a: &Allocator, pool: PoolId) -> (u64, bool, u64, u64) {
    let (d, s) = (0, 0x11);
    let big = a.malloc_in(124 * MIB, d, s, pool).unwrap();
    let s1 = segment(a, big).0;
    // A small segment right after S1, so that S1 cannot grow in place (heap_grow.rs).
    let fence = a.malloc_in(4096, d, s, DEFAULT_POOL).unwrap();
    assert_eq!(segment(a, fence).0, s1 + 124 * MIB);
    a.free(big, 124 * MIB, d, s).unwrap();
    let p = a.malloc_in(98 * MIB, d, s, pool).unwrap();
    assert_eq!(segment(a, p), (s1, 124 * MIB), "P is carved from S1");
    let e = a.malloc_in(98 * MIB, d, s, pool).unwrap();
    let s2 = segment(a, e).0;
    assert_ne!(s1, s2);
    a.free(e, 98 * MIB, d, s).unwrap();
    a.free(p, 98 * MIB, d, s).unwrap();
    let creates = a.stats(d).unwrap().physical_creates;
    let again = a.malloc_in(98 * MIB, d, s, pool).unwrap();
    let larger = 122 * MIB + MIB / 2;
    let q = a.malloc_in(larger, d, s, pool).unwrap();
    let grew = a.stats(d).unwrap().physical_creates > creates;
    a.validate(d).unwrap();
    let at = segment(a, again).0;
    a.free(q, larger, d, s).unwrap();
    a.free(again, 98 * MIB, d, s).unwrap();
    a.free(fence, 4096, d, s).unwrap();
    (at, grew, s1, s2)
}

#[test]
fn a_pools_large_blocks_merge_at_once_and_go_by_best_fit() {
    let a = host();
    let (again, grew, _s1, s2) = scenario(&a, PoolId(1, 3));
    assert_eq!(
        again, s2,
        "the 98 MiB request takes the exact free segment S2"
    );
    assert!(!grew, "the 122.5 MiB request fits in S1, merged whole");
    a.release_pool(0, PoolId(1, 3)).unwrap();
    a.validate(0).unwrap();
}

#[test]
fn the_default_pool_keeps_its_large_blocks_whole() {
    let a = host();
    let (again, grew, s1, _s2) = scenario(&a, DEFAULT_POOL);
    // The last freed block of the size (P, in S1) comes back whole: the eager fast path.
    assert_eq!(again, s1, "the 98 MiB request reuses P where it sat");
    assert!(
        grew,
        "S1 then holds only 26 MiB free: the 122.5 MiB request needs a segment"
    );
}

/// Where a long-lived 9 MiB block goes on `stream` when a freed 100 MiB block of that stream
/// and 17 MiB of never-used memory (the rest of a 20 MiB segment) are both free; returns the
/// size of its segment and what the heap keeps after `empty_cache`.
fn never_used_memory_on(a: &Allocator, stream: u64) -> (u64, u64) {
    let (d, dp) = (0, DEFAULT_POOL);
    let small = a.malloc_in(3 * MIB, d, stream, dp).unwrap(); // a 20 MiB segment, 17 never used
    let act = a.malloc_in(100 * MIB, d, stream, dp).unwrap(); // an activation's own segment
    a.free(act, 100 * MIB, d, stream).unwrap();
    let state = a.malloc_in(9 * MIB, d, stream, dp).unwrap(); // optimizer state, kept
    a.free(small, 3 * MIB, d, stream).unwrap();
    a.validate(d).unwrap();
    let seg = segment(a, state).1;
    a.empty_cache().unwrap();
    let kept = a.stats(d).unwrap().reserved_bytes;
    a.free(state, 9 * MIB, d, stream).unwrap();
    a.empty_cache().unwrap();
    (seg, kept)
}

/// Never-used memory waits on no stream, so best fit weighs it with the requesting stream's
/// own free blocks whatever the stream (device_heap/placement.rs, `find_free`). It was listed
/// under stream 0, the legacy default stream, so on any other stream the 9 MiB went into the
/// freed 100 MiB block of its own stream, and `empty_cache` kept that whole segment for it. Replaying
/// the capture-memory targets' ResNet-50 trace with its eager stream as a non-zero id, the default
/// pool kept 656 MiB after `torch.cuda.graph`'s `empty_cache` against 440 on stream 0.
#[test]
fn never_used_memory_is_a_best_fit_candidate_on_every_stream() {
    for stream in [0, 0x21] {
        let a = host();
        let (seg, kept) = never_used_memory_on(&a, stream);
        assert_eq!(
            seg,
            20 * MIB,
            "stream {stream:#x}: the 9 MiB takes the never-used 17 MiB"
        );
        assert_eq!(
            kept,
            20 * MIB,
            "stream {stream:#x}: empty_cache returns the 100 MiB segment"
        );
    }
}

/// A pool fragmented into more free blocks than a free-list set holds as a sorted vector
/// (device_heap/free_lists.rs: a B-tree past 256 entries, a vector again under 64): the
/// validator checks each set's form after every step, best fit still takes the lowest-addressed
/// block of the smallest size, and the set comes back to a vector as the blocks merge.
#[test]
fn a_fragmented_pool_spills_its_free_list_and_comes_back() {
    let a = host();
    let (d, s, dp) = (0, 0x31, DEFAULT_POOL);
    let n = 1200;
    let blocks: Vec<u64> = (0..n)
        .map(|_| a.malloc_in(512, d, s, dp).unwrap())
        .collect();
    // Every other block freed: 600 free blocks, none next to another.
    for &p in blocks.iter().step_by(2) {
        a.free(p, 512, d, s).unwrap();
    }
    // The thread cache's and the heap's parked blocks go to the free lists (the segments hold
    // live blocks, so nothing is given back).
    a.empty_cache().unwrap();
    a.validate(d).unwrap();
    let free_before = a.stats(d).unwrap().reserved_bytes;
    let again = a.malloc_in(512, d, s, dp).unwrap();
    let lowest = *blocks.iter().step_by(2).min().unwrap();
    assert_eq!(
        again, lowest,
        "best fit: the smallest size, then the lowest offset"
    );
    assert_eq!(
        a.stats(d).unwrap().reserved_bytes,
        free_before,
        "no new segment"
    );
    a.validate(d).unwrap();
    a.free(again, 512, d, s).unwrap();
    // The rest freed: the free blocks merge, the set shrinks back under the bound.
    for (i, &p) in blocks.iter().enumerate().skip(1).step_by(2) {
        a.free(p, 512, d, s).unwrap();
        if i % 97 == 1 {
            a.empty_cache().unwrap();
            a.validate(d).unwrap();
        }
    }
    a.empty_cache().unwrap();
    a.validate(d).unwrap();
    assert_eq!(
        a.stats(d).unwrap().reserved_bytes,
        0,
        "every segment given back"
    );
}
