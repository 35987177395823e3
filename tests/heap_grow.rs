//! Segments that grow in place (device_heap/grow.rs, `grow_in_place`), on real host
//! memory: a pool that keeps its segments (a capture's, a MemPool) maps what a request lacks
//! right after a segment's free tail instead of making a whole new segment; the default pool
//! and symmalloc's own pools never do; growth needs the next address range free, takes only a
//! tail the requesting stream may use (under capture: nothing another stream used), picks the
//! largest tail, and reads only the call sequence; a grown segment goes back whole, every chunk
//! with it.
//!
//! A test binary of its own: no test here opens a pool with `pools::begin` (the open-pool gate
//! is process-wide); pools are named with `malloc_in`.

use crate::capture_backend;
use crate::common;
use capture_backend::capture_backend;
use common::{check_host, fill_host};
use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::pools::{PoolId, DEFAULT_POOL};
use symmalloc::heap::Allocator;

const MIB: u64 = 1 << 20;
const POOL: PoolId = PoolId(7, 1);

fn host() -> Allocator {
    Allocator::new(Box::new(HostBackend)).unwrap()
}

fn grown(a: &Allocator) -> u64 {
    a.heap(0).unwrap().grown_in_place()
}

/// (offset, size, chunks) of the segment holding `ptr`.
fn span(a: &Allocator, ptr: u64) -> (u64, u64, usize) {
    a.segment_span(0, ptr)
        .unwrap()
        .expect("ptr is in a segment")
}

/// 3 MiB makes a 20 MiB segment (17 MiB free after it); 30 MiB then needs 13 more: the segment
/// grows by 14 MiB (the granularity is 2 MiB) and the 30 MiB block spans both chunks.
#[test]
fn a_pool_grows_its_segment_by_what_the_request_lacks() {
    let a = host();
    let s = 0x10;
    let x = a.malloc_in(3 * MIB, 0, s, POOL).unwrap();
    let (seg, size, chunks) = span(&a, x);
    assert_eq!((size, chunks), (20 * MIB, 1));
    let y = a.malloc_in(30 * MIB, 0, s, POOL).unwrap();
    assert_eq!(y, x + 3 * MIB, "the free tail, then the new chunk");
    assert_eq!(span(&a, y), (seg, 34 * MIB, 2));
    let st = a.stats(0).unwrap();
    assert_eq!(
        (st.reserved_bytes, st.segments, st.physical_creates),
        (34 * MIB, 1, 2),
        "{st:?}"
    );
    assert_eq!(grown(&a), 1);
    // Peers see two chunks under the block, each its own generation.
    let (chunks, start, len) = a.segment_of(0, y).unwrap();
    // 17 + 14 MiB: a large block is split only when more than 1 MiB would be left.
    assert_eq!((start, len), (y, 31 * MIB));
    assert_eq!(chunks.len(), 2);
    assert_eq!(
        (chunks[1].offset, chunks[1].size),
        (seg + 20 * MIB, 14 * MIB)
    );
    assert_ne!(chunks[0].generation, chunks[1].generation);
    // The memory is one range: writes across the chunks' border stay.
    fill_host(x, 3 * MIB, 0x5a);
    fill_host(y, 30 * MIB, 0xa5);
    check_host(x, 3 * MIB, 0x5a);
    check_host(y, 30 * MIB, 0xa5);
    a.validate(0).unwrap();
    // Freed, the pool keeps it (a live user pool); released, both chunks go back.
    a.free(x, 3 * MIB, 0, s).unwrap();
    a.free(y, 30 * MIB, 0, s).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes, 34 * MIB);
    // The merged 34 MiB serve a 34 MiB request without growing.
    let z = a.malloc_in(34 * MIB, 0, s, POOL).unwrap();
    assert_eq!((z, grown(&a)), (x, 1));
    a.free(z, 34 * MIB, 0, s).unwrap();
    a.release_pool(0, POOL).unwrap();
    let st = a.stats(0).unwrap();
    assert_eq!(
        (st.reserved_bytes, st.segments, st.physical_releases),
        (0, 0, 2),
        "{st:?}"
    );
    a.validate(0).unwrap();
}

/// The same requests in the default pool make a second segment: its eager cache gives segments
/// back one at a time, and a grown one would go back only whole.
#[test]
fn the_default_pool_never_grows_in_place() {
    let a = host();
    let s = 0x10;
    let x = a.malloc_in(3 * MIB, 0, s, DEFAULT_POOL).unwrap();
    let y = a.malloc_in(30 * MIB, 0, s, DEFAULT_POOL).unwrap();
    assert_ne!(span(&a, x).0, span(&a, y).0);
    assert_eq!(span(&a, y), (span(&a, x).0 + 20 * MIB, 30 * MIB, 1));
    assert_eq!(grown(&a), 0);
    a.free(x, 3 * MIB, 0, s).unwrap();
    a.free(y, 30 * MIB, 0, s).unwrap();
    a.validate(0).unwrap();
}

/// A segment grows only into a free address range: with another segment right after it, the
/// request gets a segment of its own. A tail still in use does not grow either.
#[test]
fn growth_needs_a_free_tail_and_the_next_range_free() {
    let a = host();
    let s = 0x10;
    let x = a.malloc_in(3 * MIB, 0, s, POOL).unwrap();
    let fence = a.malloc_in(4096, 0, s, DEFAULT_POOL).unwrap();
    assert_eq!(span(&a, fence).0, span(&a, x).0 + 20 * MIB);
    let y = a.malloc_in(30 * MIB, 0, s, POOL).unwrap();
    assert_eq!(span(&a, y).2, 1);
    assert_ne!(span(&a, y).0, span(&a, x).0);
    // y's segment ends in y itself (30 MiB exactly): no free tail, so 18 MiB (more than x's
    // segment has free) is a segment of its own although the range after y's is free.
    let z = a.malloc_in(18 * MIB, 0, s, POOL).unwrap();
    assert_eq!(span(&a, z), (span(&a, y).0 + 30 * MIB, 18 * MIB, 1));
    assert_eq!(grown(&a), 0);
    for (p, n) in [(x, 3 * MIB), (y, 30 * MIB), (z, 18 * MIB)] {
        a.free(p, n, 0, s).unwrap();
    }
    a.free(fence, 4096, 0, s).unwrap();
    a.release_pool(0, POOL).unwrap();
    a.validate(0).unwrap();
}

/// Among segments that could grow, the one with the largest free tail does (least new memory),
/// though another lies lower.
#[test]
fn the_largest_free_tail_grows() {
    let a = host();
    let s = 0x10;
    // S1: 20 MiB, 9 live + 11 free (f1 fills it while S2 is made); a 2 MiB fence (given back
    // below); S2: 20 MiB, 8 live + 12 free.
    let x1 = a.malloc_in(9 * MIB, 0, s, POOL).unwrap();
    let f1 = a.malloc_in(9 * MIB, 0, s, POOL).unwrap();
    let fence = a.malloc_in(4096, 0, s, DEFAULT_POOL).unwrap();
    let x2 = a.malloc_in(8 * MIB, 0, s, POOL).unwrap();
    let (s1, s2) = (span(&a, x1).0, span(&a, x2).0);
    assert_eq!(
        (span(&a, f1).0, span(&a, fence).0, s2),
        (s1, s1 + 20 * MIB, s1 + 22 * MIB)
    );
    a.free(f1, 9 * MIB, 0, s).unwrap();
    a.free(fence, 4096, 0, s).unwrap();
    a.empty_cache().unwrap();
    // 12.5 MiB fits neither tail; both could grow by 2 MiB; S2's tail is the larger.
    let y = a.malloc_in(12 * MIB + MIB / 2, 0, s, POOL).unwrap();
    assert_eq!(y, x2 + 8 * MIB);
    assert_eq!(span(&a, y), (s2, 22 * MIB, 2));
    assert_eq!(span(&a, x1), (s1, 20 * MIB, 1));
    assert_eq!(a.stats(0).unwrap().reserved_bytes, 42 * MIB);
    for (p, n) in [(x1, 9 * MIB), (x2, 8 * MIB), (y, 12 * MIB + MIB / 2)] {
        a.free(p, n, 0, s).unwrap();
    }
    a.release_pool(0, POOL).unwrap();
    a.validate(0).unwrap();
}

/// Under capture a tail that another stream freed cannot be taken (ordering would join an
/// eager stream into the capture), so it does not grow; a tail of the capturing stream's own
/// does. No call orders the capturing stream or waits for the device.
#[test]
fn under_capture_only_a_tail_of_the_capturing_stream_grows() {
    let (a, seen) = capture_backend();
    let (cap, eager) = (0xca9, 0x1000);
    // S1's free tail was last used by the eager stream.
    let e = a.malloc_in(3 * MIB, 0, eager, POOL).unwrap();
    let e2 = a.malloc_in(10 * MIB - MIB / 2, 0, eager, POOL).unwrap();
    a.free(e2, 10 * MIB - MIB / 2, 0, eager).unwrap();
    let s1 = span(&a, e).0;
    seen.lock().unwrap().capturing.insert(cap);
    let c = a.malloc_in(24 * MIB, 0, cap, POOL).unwrap();
    assert_ne!(span(&a, c).0, s1, "the eager tail stays apart");
    assert_eq!(span(&a, c).2, 1);
    assert_eq!(grown(&a), 0);
    // c's own segment (24 MiB, no tail) cannot grow; c2 makes a 20 MiB one whose 11 MiB tail
    // was never used (it waits on no stream): that one grows for 25 MiB.
    let c2 = a.malloc_in(9 * MIB, 0, cap, POOL).unwrap();
    let s3 = span(&a, c2).0;
    let c3 = a.malloc_in(25 * MIB, 0, cap, POOL).unwrap();
    assert_eq!(c3, c2 + 9 * MIB);
    assert_eq!(span(&a, c3), (s3, 34 * MIB, 2));
    assert_eq!(grown(&a), 1);
    let seen_now = seen.lock().unwrap();
    assert!(seen_now.broken.is_empty(), "{:?}", seen_now.broken);
    assert!(
        seen_now.orders.iter().all(|&(w, o)| w != cap && o != cap),
        "{:?}",
        seen_now.orders
    );
    drop(seen_now);
    a.validate(0).unwrap();
    for (p, n) in [(c, 24 * MIB), (c2, 9 * MIB), (c3, 25 * MIB)] {
        a.free(p, n, 0, cap).unwrap();
    }
    a.free(e, 3 * MIB, 0, eager).unwrap();
    seen.lock().unwrap().capturing.clear();
    a.release_pool(0, POOL).unwrap();
    let st = a.stats(0).unwrap();
    assert_eq!((st.reserved_bytes, st.segments), (0, 0), "{st:?}");
    a.validate(0).unwrap();
}

/// The same call sequence gives the same offsets and the same growth in two heaps, whatever
/// else the process did between the calls.
#[test]
fn growth_reads_only_the_call_sequence() {
    let run = |noise: bool| {
        let a = host();
        let mut offs = Vec::new();
        let mut live = Vec::new();
        for i in 0..40u64 {
            let n = (1 + (i * 7919) % 37) * MIB + (i % 3) * 4096;
            let p = a.malloc_in(n, 0, 0x10, POOL).unwrap();
            offs.push(p - a.heap(0).unwrap().base());
            live.push((p, n));
            if noise {
                std::thread::sleep(std::time::Duration::from_micros(50 * (i % 4)));
            }
            if i % 3 == 2 {
                let (q, m) = live.remove((i as usize * 13) % live.len());
                a.free(q, m, 0, 0x10).unwrap();
            }
        }
        a.validate(0).unwrap();
        let r = (offs, grown(&a), a.stats(0).unwrap().reserved_bytes);
        for (p, n) in live {
            a.free(p, n, 0, 0x10).unwrap();
        }
        a.release_pool(0, POOL).unwrap();
        r
    };
    let (a, b) = (run(false), run(true));
    assert!(a.1 > 0, "the sequence grows segments in place");
    assert_eq!(a, b);
}

/// A large segment of a pool that grows in place is placed at the start of the largest free
/// range, not in the lowest gap that fits (where the next segment would stop its growth): with
/// a 20 MiB gap low in the heap, 3 MiB then 30 MiB make one segment of 34 MiB. (On a GPU, the
/// same capture after other work grew reserved memory by 50 MiB with first-fit placement:
/// python/tests/global_capture_check.py, `grown_segments`.)
#[test]
fn a_growable_segment_goes_where_it_can_grow() {
    let a = host();
    let s = 0x10;
    let d: Vec<u64> = (0..3)
        .map(|_| a.malloc_in(20 * MIB, 0, s, DEFAULT_POOL).unwrap())
        .collect();
    a.free(d[1], 20 * MIB, 0, s).unwrap();
    a.empty_cache().unwrap(); // a 20 MiB gap between d[0] and d[2]
    let x = a.malloc_in(3 * MIB, 0, s, POOL).unwrap();
    assert_eq!(span(&a, x).0, span(&a, d[2]).0 + 20 * MIB, "not in the gap");
    let y = a.malloc_in(30 * MIB, 0, s, POOL).unwrap();
    assert_eq!(span(&a, y), (span(&a, x).0, 34 * MIB, 2));
    // The default pool still fills the lowest gap first.
    let e = a.malloc_in(20 * MIB, 0, s, DEFAULT_POOL).unwrap();
    assert_eq!(span(&a, e).0, span(&a, d[0]).0 + 20 * MIB);
    for (p, n) in [(d[0], 20 * MIB), (d[2], 20 * MIB), (e, 20 * MIB)] {
        a.free(p, n, 0, s).unwrap();
    }
    a.free(x, 3 * MIB, 0, s).unwrap();
    a.free(y, 30 * MIB, 0, s).unwrap();
    a.release_pool(0, POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes, 0);
    a.validate(0).unwrap();
}
