//! Free segments moving between pools (device_heap/donors.rs, `adopt_segment`) and what
//! `empty_cache` gives back (device_heap/release.rs), on real host memory: a pool about to grow
//! takes a whole free segment of the default pool or of a released pool; live user pools and
//! the internal pool never give one; under capture only segments no other stream used move,
//! and no call orders a capturing stream or waits for the device; the same call sequence gives
//! the same offsets whatever the timing.
//!
//! A test binary of its own: no test here opens a pool with `pools::begin` (the open-pool gate
//! is process-wide); pools are named with `malloc_in`.

use crate::capture_backend;
use crate::common;
use capture_backend::capture_backend;
use common::{check_host, fill_host, Rng};
use symmalloc::heap::backend::Stream;
use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::pools::{PoolId, DEFAULT_POOL, INTERNAL_POOL};
use symmalloc::heap::Allocator;

const MIB: u64 = 1 << 20;

fn host() -> Allocator {
    Allocator::new(Box::new(HostBackend)).unwrap()
}

fn adopted(a: &Allocator) -> u64 {
    a.heap(0).unwrap().adopted_segments()
}

/// The (offset, size) of the segment holding `ptr`.
fn segment(a: &Allocator, ptr: u64) -> (u64, u64) {
    let (off, size, _) = a
        .segment_span(0, ptr)
        .unwrap()
        .expect("ptr is in a segment");
    (off, size)
}

/// A pool about to grow takes the default pool's whole free segments (small and large) instead
/// of creating memory; the default pool then grows for itself, and never takes back the live
/// pool's free segments.
#[test]
fn pools_take_the_default_pools_free_segments_and_never_a_live_pools() {
    let (a, seen) = capture_backend();
    let (s, pool) = (0x1000, PoolId(3, 1));
    let small = a.malloc_in(4096, 0, s, DEFAULT_POOL).unwrap();
    let large = a.malloc_in(3 * MIB, 0, s, DEFAULT_POOL).unwrap();
    let (seg_small, seg_large) = (segment(&a, small), segment(&a, large));
    a.free(small, 4096, 0, s).unwrap();
    a.free(large, 3 * MIB, 0, s).unwrap();
    let before = a.stats(0).unwrap();
    // Another stream too: the move orders it after the segment's last user.
    let p = a.malloc_in(8192, 0, 0x2000, pool).unwrap();
    let q = a.malloc_in(5 * MIB, 0, s, pool).unwrap();
    assert_eq!(segment(&a, p), seg_small);
    assert_eq!(segment(&a, q), seg_large);
    assert_eq!(
        seen.lock().unwrap().orders,
        [(0x2000, s)],
        "stream-ordered after the segment's last user"
    );
    let after = a.stats(0).unwrap();
    assert_eq!(
        after.physical_creates, before.physical_creates,
        "no new memory"
    );
    assert_eq!(after.reserved_bytes, before.reserved_bytes);
    assert_eq!(adopted(&a), 2);
    a.validate(0).unwrap();
    // The pool is live: its freed blocks stay its own. The default pool grows instead.
    a.free(p, 8192, 0, 0x2000).unwrap();
    a.free(q, 5 * MIB, 0, s).unwrap();
    let d = a.malloc_in(4096, 0, s, DEFAULT_POOL).unwrap();
    let e = a.malloc_in(3 * MIB, 0, s, DEFAULT_POOL).unwrap();
    assert_ne!(segment(&a, d), seg_small);
    assert_ne!(segment(&a, e), seg_large);
    assert_eq!(
        a.stats(0).unwrap().physical_creates,
        before.physical_creates + 2
    );
    assert_eq!(adopted(&a), 2);
    // empty_cache leaves the live pool's free segments alone (a graph may replay into them).
    a.free(d, 4096, 0, s).unwrap();
    a.free(e, 3 * MIB, 0, s).unwrap();
    a.empty_cache().unwrap();
    let s1 = a.stats(0).unwrap();
    assert_eq!(s1.reserved_bytes, seg_small.1 + seg_large.1, "{s1:?}");
    // Released, the pool's segments go back.
    a.release_pool(0, pool).unwrap();
    let s2 = a.stats(0).unwrap();
    assert_eq!((s2.reserved_bytes, s2.segments), (0, 0), "{s2:?}");
    assert_eq!(s2.physical_releases, s1.physical_releases + 2);
    a.validate(0).unwrap();
}

/// The rule for large requests: best fit by (size, offset) among donor segments at least the
/// request and at most a new segment's size + 20 MiB; larger ones stay with the donor.
#[test]
fn donor_segments_are_chosen_best_fit_by_size_then_offset() {
    let a = host();
    let s = 0x1000;
    let sizes = [40 * MIB, 20 * MIB, 12 * MIB, 20 * MIB, 64 * MIB];
    let ptrs: Vec<u64> = sizes
        .iter()
        .map(|&n| a.malloc_in(n, 0, s, DEFAULT_POOL).unwrap())
        .collect();
    let segs: Vec<(u64, u64)> = ptrs.iter().map(|&p| segment(&a, p)).collect();
    for (&p, &n) in ptrs.iter().zip(&sizes) {
        a.free(p, n, 0, s).unwrap();
    }
    let pool = PoolId(8, 8);
    let creates = a.stats(0).unwrap().physical_creates;
    // 11 MiB (a new segment would be 12 MiB): the 12 MiB one.
    let x = a.malloc_in(11 * MIB, 0, s, pool).unwrap();
    assert_eq!(segment(&a, x), segs[2]);
    // 3 MiB: the first 20 MiB one by offset, then the second.
    let y = a.malloc_in(3 * MIB, 0, s, pool).unwrap();
    assert_eq!(segment(&a, y), segs[1].min(segs[3]));
    let z = a.malloc_in(19 * MIB, 0, s, pool).unwrap();
    assert_eq!(segment(&a, z), segs[1].max(segs[3]));
    // 30 MiB: 40 MiB fits (30 + 20 >= 40); 64 MiB would not.
    let w = a.malloc_in(30 * MIB, 0, s, pool).unwrap();
    assert_eq!(segment(&a, w), segs[0]);
    assert_eq!(a.stats(0).unwrap().physical_creates, creates);
    // 18 MiB (more than the pool's largest free block, 17 MiB): only the 64 MiB segment is
    // left, too large for it (18 MiB -> an 18 MiB segment, + 20 MiB).
    let v = a.malloc_in(18 * MIB, 0, s, pool).unwrap();
    assert_ne!(segment(&a, v), segs[4]);
    assert_eq!(a.stats(0).unwrap().physical_creates, creates + 1);
    assert_eq!(adopted(&a), 4);
    a.validate(0).unwrap();
    for (p, n) in [(x, 11), (y, 3), (z, 19), (w, 30), (v, 18)] {
        a.free(p, n * MIB, 0, s).unwrap();
    }
    a.release_pool(0, pool).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes, 0);
}

/// A pool released while a capture made waiting for the device impossible keeps its free
/// segments; another pool (or the default pool) takes them, under capture only if no other
/// stream used them; `empty_cache` gives back what is left once the capture is over. Nothing
/// orders a capturing stream or waits for the device meanwhile.
#[test]
fn released_pools_give_their_segments_and_capture_takes_only_its_streams() {
    let (a, seen) = capture_backend();
    let (cap, eager) = (0xca9, 0x1000);
    let old = PoolId(1, 1);
    // The old pool's memory: one segment last used by the capture stream, one by an eager one.
    let m1 = a.malloc_in(3 * MIB, 0, cap, old).unwrap();
    // A small segment right after seg1, so that seg1 cannot grow in place (heap_grow.rs).
    let fence = a.malloc_in(4096, 0, eager, DEFAULT_POOL).unwrap();
    let m2 = a.malloc_in(3 * MIB, 0, eager, old).unwrap();
    let m3 = a.malloc_in(19 * MIB, 0, eager, old).unwrap(); // a 20 MiB segment of its own
    let (seg1, seg3) = (segment(&a, m1), segment(&a, m3));
    assert_eq!(segment(&a, m2), seg1, "m1 and m2 share a 20 MiB segment");
    a.free(m3, 19 * MIB, 0, eager).unwrap();
    seen.lock().unwrap().capturing.insert(cap);
    a.free(m1, 3 * MIB, 0, cap).unwrap();
    a.free(m2, 3 * MIB, 0, eager).unwrap();
    a.release_pool(0, old).unwrap(); // cannot wait for the device: both stay, released
    let s = a.stats(0).unwrap();
    assert_eq!(
        (s.segments, s.physical_releases),
        (3, 0),
        "with the fence's: {s:?}"
    );
    a.validate(0).unwrap();
    // The capture's pool: the segment with eager-stream blocks may not move (it would need
    // ordering); neither may seg3. It grows instead.
    let graph = PoolId(2, 2);
    let g1 = a.malloc_in(3 * MIB, 0, cap, graph).unwrap();
    let gs = segment(&a, g1);
    assert!(gs != seg1 && gs != seg3);
    assert_eq!(adopted(&a), 0);
    // A released pool's segment that only the capture stream used does move into it.
    let old2 = PoolId(4, 4);
    let m4 = a.malloc_in(19 * MIB, 0, cap, old2).unwrap();
    let seg4 = segment(&a, m4);
    a.free(m4, 19 * MIB, 0, cap).unwrap();
    a.release_pool(0, old2).unwrap();
    assert_eq!(a.stats(0).unwrap().physical_releases, 0);
    let g2 = a.malloc_in(19 * MIB, 0, cap, graph).unwrap();
    assert_eq!(
        segment(&a, g2),
        seg4,
        "the capture takes a segment of its own stream"
    );
    assert_eq!(adopted(&a), 1);
    // Outside the capture an eager stream takes the eager segments, ordered after their users;
    // the one that waits on the capturing stream stays.
    let d = a.malloc_in(19 * MIB, 0, eager, DEFAULT_POOL).unwrap();
    assert_eq!(segment(&a, d), seg3);
    let d2 = a.malloc_in(3 * MIB, 0, 0x2000, DEFAULT_POOL).unwrap();
    assert_ne!(segment(&a, d2), seg1, "seg1 waits on the capturing stream");
    assert_eq!(adopted(&a), 2);
    assert!(
        seen.lock().unwrap().broken.is_empty(),
        "{:?}",
        seen.lock().unwrap().broken
    );
    a.validate(0).unwrap();
    // empty_cache during the capture does not wait for the device (that would break the
    // capture): nothing goes. After it, the released pool's free segment goes.
    a.empty_cache().unwrap();
    assert_eq!(a.stats(0).unwrap().physical_releases, 0);
    seen.lock().unwrap().capturing.clear();
    a.empty_cache().unwrap();
    let s = a.stats(0).unwrap();
    // Left: seg3 (live d), d2's segment, the graph pool's two segments (live pool).
    assert_eq!(
        s.physical_releases, 1,
        "seg1, released and free, went: {s:?}"
    );
    for (p, n, st) in [(d, 19 * MIB, eager), (d2, 3 * MIB, 0x2000)] {
        a.free(p, n, 0, st).unwrap();
    }
    for (p, n) in [(g1, 3 * MIB), (g2, 19 * MIB)] {
        a.free(p, n, 0, cap).unwrap();
    }
    a.free(fence, 4096, 0, eager).unwrap();
    a.release_pool(0, graph).unwrap();
    a.empty_cache().unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.segments), (0, 0), "{s:?}");
    a.validate(0).unwrap();
    assert!(seen.lock().unwrap().broken.is_empty());
}

/// Capture on one stream while another stream frees into the same pool: the freed block waits
/// on the eager stream, so the capture never gets it (nor its segment); nothing orders the
/// capturing stream, and what each side holds stays intact.
#[test]
fn capture_never_takes_what_another_stream_freed_into_its_pool() {
    let (a, seen) = capture_backend();
    let (cap, eager) = (0xca9, 0x1000);
    let pool = PoolId(6, 6);
    let b = a.malloc_in(MIB, 0, eager, pool).unwrap();
    let keep = a.malloc_in(4096, 0, eager, pool).unwrap();
    fill_host(keep, 4096, 0x5a);
    seen.lock().unwrap().capturing.insert(cap);
    a.free(b, MIB, 0, eager).unwrap();
    let c = a.malloc_in(MIB, 0, cap, pool).unwrap();
    assert_ne!(c, b);
    fill_host(c, MIB, 0xc3);
    check_host(keep, 4096, 0x5a);
    // And the default pool's segments used by the eager stream do not move into it either.
    let e = a.malloc_in(3 * MIB, 0, eager, DEFAULT_POOL).unwrap();
    let seg_e = segment(&a, e);
    a.free(e, 3 * MIB, 0, eager).unwrap();
    let g = a.malloc_in(3 * MIB, 0, cap, pool).unwrap();
    assert_ne!(segment(&a, g), seg_e);
    assert_eq!(adopted(&a), 0);
    assert!(
        seen.lock().unwrap().broken.is_empty(),
        "{:?}",
        seen.lock().unwrap().broken
    );
    a.validate(0).unwrap();
    seen.lock().unwrap().capturing.clear();
    for (p, n, st) in [(c, MIB, cap), (g, 3 * MIB, cap), (keep, 4096, eager)] {
        a.free(p, n, 0, st).unwrap();
    }
    a.release_pool(0, pool).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes, 0);
}

/// release_pool of a pool whose segments came from the default pool: they are its own now,
/// and go back to the backend like the rest (the free one at once, the other at its last
/// free); its live block stays intact meanwhile. Freeing into a released pool from a capturing
/// stream keeps the segment (no wait for the device) until empty_cache.
#[test]
fn released_pool_gives_back_the_segments_it_took() {
    let (a, seen) = capture_backend();
    let s = 0x1000;
    let x = a.malloc_in(3 * MIB, 0, s, DEFAULT_POOL).unwrap();
    let y = a.malloc_in(19 * MIB, 0, s, DEFAULT_POOL).unwrap();
    a.free(x, 3 * MIB, 0, s).unwrap();
    a.free(y, 19 * MIB, 0, s).unwrap();
    let pool = PoolId(9, 1);
    let p = a.malloc_in(3 * MIB, 0, s, pool).unwrap();
    let q = a.malloc_in(19 * MIB, 0, s, pool).unwrap();
    assert_eq!(adopted(&a), 2);
    fill_host(q, 4096, 0x77);
    a.free(p, 3 * MIB, 0, s).unwrap();
    a.release_pool(0, pool).unwrap();
    let st = a.stats(0).unwrap();
    assert_eq!((st.segments, st.physical_releases), (1, 1), "{st:?}");
    check_host(q, 4096, 0x77);
    seen.lock().unwrap().capturing.insert(0xca9);
    a.free(q, 19 * MIB, 0, 0xca9).unwrap();
    assert_eq!(
        a.stats(0).unwrap().segments,
        1,
        "kept: the free was captured"
    );
    seen.lock().unwrap().capturing.clear();
    a.empty_cache().unwrap();
    let st = a.stats(0).unwrap();
    assert_eq!((st.segments, st.reserved_bytes), (0, 0), "{st:?}");
    assert!(
        seen.lock().unwrap().broken.is_empty(),
        "{:?}",
        seen.lock().unwrap().broken
    );
    a.validate(0).unwrap();
}

/// The communicator's internal pool neither gives nor takes segments.
#[test]
fn internal_pool_neither_gives_nor_takes() {
    let a = host();
    let s = 0;
    let i = a.malloc_in(3 * MIB, 0, s, INTERNAL_POOL).unwrap();
    let seg_i = segment(&a, i);
    a.free(i, 3 * MIB, 0, s).unwrap();
    let d = a.malloc_in(3 * MIB, 0, s, DEFAULT_POOL).unwrap();
    let seg_d = segment(&a, d);
    assert_ne!(seg_d, seg_i);
    a.free(d, 3 * MIB, 0, s).unwrap();
    let j = a.malloc_in(5 * MIB, 0, s, INTERNAL_POOL).unwrap();
    assert_eq!(segment(&a, j), seg_i, "its own free segment");
    let k = a.malloc_in(17 * MIB, 0, s, INTERNAL_POOL).unwrap();
    assert_ne!(segment(&a, k), seg_d, "not the default pool's");
    assert_eq!(adopted(&a), 0);
    for (p, n) in [(j, 5 * MIB), (k, 17 * MIB)] {
        a.free(p, n, 0, s).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(
        a.stats(0).unwrap().reserved_bytes,
        0,
        "internal free segments go too"
    );
}

/// One operation of a replayed sequence.
#[derive(Clone, Copy, Debug)]
enum Op {
    Malloc {
        size: u64,
        pool: usize,
        stream: usize,
    },
    Free {
        nth: usize,
        stream: usize,
    },
    Release {
        pool: usize,
    },
    EmptyCache,
}

fn sequence(seed: u64, n: usize) -> Vec<Op> {
    let mut rng = Rng::new(seed);
    let mut live = 0usize;
    let mut ops = Vec::new();
    for _ in 0..n {
        let op = match rng.below(100) {
            0..=49 => {
                live += 1;
                Op::Malloc {
                    size: match rng.below(4) {
                        0 => 1 + rng.below(64 << 10),
                        1 => 512 << 10,
                        2 => MIB + rng.below(9 * MIB),
                        _ => 10 * MIB + rng.below(30 * MIB),
                    },
                    pool: rng.below(4) as usize,
                    stream: rng.below(3) as usize,
                }
            }
            50..=89 if live > 0 => {
                live -= 1;
                Op::Free {
                    nth: rng.below(live as u64 + 1) as usize,
                    stream: rng.below(3) as usize,
                }
            }
            90..=96 => Op::Release {
                pool: 1 + rng.below(3) as usize,
            },
            _ => Op::EmptyCache,
        };
        ops.push(op);
    }
    ops
}

/// Runs `ops` on a fresh allocator, sleeping `jitter` between some calls; returns each
/// malloc's offset from the heap's base, the segments adopted and the final stats.
fn replay(ops: &[Op], jitter: u64) -> (Vec<u64>, u64, u64) {
    let a = host();
    let pools = [DEFAULT_POOL, PoolId(1, 1), PoolId(2, 2), PoolId(3, 3)];
    let streams: [Stream; 3] = [0, 0x1000, 0x2000];
    let mut rng = Rng::new(jitter);
    let mut live: Vec<(u64, u64)> = Vec::new();
    let mut offsets = Vec::new();
    let base = a.heap(0).unwrap().base();
    for (i, &op) in ops.iter().enumerate() {
        if jitter > 0 && rng.below(8) == 0 {
            std::thread::sleep(std::time::Duration::from_micros(rng.below(300)));
        }
        match op {
            Op::Malloc { size, pool, stream } => {
                let p = a.malloc_in(size, 0, streams[stream], pools[pool]).unwrap();
                offsets.push(p - base);
                live.push((p, size));
            }
            Op::Free { nth, stream } => {
                let (p, size) = live.remove(nth);
                a.free(p, size, 0, streams[stream]).unwrap();
            }
            Op::Release { pool } => a.release_pool(0, pools[pool]).unwrap(),
            Op::EmptyCache => a.empty_cache().unwrap(),
        }
        a.validate(0)
            .unwrap_or_else(|e| panic!("step {i} ({op:?}): {e}"));
    }
    let adopted = adopted(&a);
    let creates = a.stats(0).unwrap().physical_creates;
    (offsets, adopted, creates)
}

/// Two ranks given the same call sequence with different timing place every block at the same
/// offset, segments taken from donors included.
#[test]
fn same_sequence_different_timing_same_offsets() {
    let seed = common::seed();
    let ops = sequence(seed, 1500);
    let ranks: Vec<_> = [1u64, 2]
        .into_iter()
        .map(|j| {
            let ops = ops.clone();
            std::thread::spawn(move || replay(&ops, seed ^ j))
        })
        .collect();
    let got: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(got[0].1 > 0, "the sequence moved no segment (seed {seed})");
    assert_eq!(got[0].1, got[1].1, "adopted segments differ (seed {seed})");
    assert_eq!(got[0].2, got[1].2, "physical creates differ (seed {seed})");
    if let Some(i) = (0..got[0].0.len()).find(|&i| got[0].0[i] != got[1].0[i]) {
        panic!(
            "malloc {i}: offset {:#x} on one rank, {:#x} on the other (seed {seed})",
            got[0].0[i], got[1].0[i]
        );
    }
}

/// empty_cache returns every free segment of the default pool and of released pools (reserved
/// memory drops, physical releases grow), and the memory comes back on the next request.
#[test]
fn empty_cache_returns_free_segments() {
    let a = host();
    let s = 0x1000;
    let ptrs: Vec<(u64, u64)> = [4096, 3 * MIB, 24 * MIB, 512 << 10]
        .into_iter()
        .map(|n| (a.malloc_in(n, 0, s, DEFAULT_POOL).unwrap(), n))
        .collect();
    let held = a.malloc_in(4096, 0, s, DEFAULT_POOL).unwrap();
    for &(p, n) in &ptrs {
        a.free(p, n, 0, s).unwrap();
    }
    let before = a.stats(0).unwrap();
    a.empty_cache().unwrap();
    let after = a.stats(0).unwrap();
    // The small segment holds `held`; the 20 MiB and 24 MiB segments go.
    assert_eq!(
        after.reserved_bytes,
        before.reserved_bytes - 44 * MIB,
        "{after:?}"
    );
    assert_eq!(after.physical_releases, before.physical_releases + 2);
    assert_eq!(after.segments, 1);
    a.free(held, 4096, 0, s).unwrap();
    a.empty_cache().unwrap();
    let end = a.stats(0).unwrap();
    assert_eq!((end.reserved_bytes, end.segments), (0, 0), "{end:?}");
    assert_eq!(end.physical_creates, end.physical_releases);
    a.validate(0).unwrap();
}
