//! Allocator properties on real memory (host backend on CI; the same core runs on CUDA):
//! random operation sequences never overlap live blocks, stats equal the live blocks, every
//! invariant holds after each step, and everything returns to zero after release.

use crate::common;
use common::Rng;
use std::collections::HashMap;
use symmalloc::heap::backend::Stream;
use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::pools::{self, PoolId};
use symmalloc::heap::Allocator;

fn allocator() -> Allocator {
    Allocator::new(Box::new(HostBackend)).unwrap()
}

struct Live {
    size: u64,
    device: i32,
    pattern: u8,
}

/// The bytes of a block that get a pattern: its first and last 4 KiB (the whole of a small one).
fn edges(ptr: u64, size: u64) -> [(u64, u64); 2] {
    let n = size.min(4096);
    [(ptr, n), (ptr + size - n, n)]
}

fn fill(ptr: u64, size: u64, pattern: u8) {
    for (p, n) in edges(ptr, size) {
        // SAFETY: p..p+n lies in a live block of host memory returned by the allocator.
        unsafe { std::ptr::write_bytes(p as *mut u8, pattern, n as usize) };
    }
}

fn check(ptr: u64, size: u64, pattern: u8) {
    for (p, n) in edges(ptr, size) {
        // SAFETY: as fill().
        let s = unsafe { std::slice::from_raw_parts(p as *const u8, n as usize) };
        if let Some(i) = s.iter().position(|&b| b != pattern) {
            panic!(
                "block {ptr:#x}+{size}: byte at {:#x} is {:#x}, expected {pattern:#x}",
                p + i as u64,
                s[i]
            );
        }
    }
}

/// Exact check that no two live blocks overlap.
fn assert_disjoint(live: &HashMap<u64, Live>) {
    let mut v: Vec<(u64, u64)> = live.iter().map(|(&p, l)| (p, l.size)).collect();
    v.sort();
    for w in v.windows(2) {
        assert!(
            w[0].0 + w[0].1 <= w[1].0,
            "blocks {:#x}+{} and {:#x} overlap",
            w[0].0,
            w[0].1,
            w[1].0
        );
    }
}

/// Repeated sizes (the fast path's parked blocks) mixed with random ones of every class.
fn random_size(rng: &mut Rng) -> u64 {
    const COMMON: [u64; 5] = [512, 4096, 65536, 3 << 20, 12 << 20];
    match rng.below(10) {
        0..=2 => COMMON[rng.below(COMMON.len() as u64) as usize],
        3..=5 => 1 + rng.below(64 << 10),
        6..=8 => (1 << 20) + rng.below(9 << 20),
        _ => (10 << 20) + rng.below(24 << 20),
    }
}

#[test]
fn random_sequences_keep_blocks_disjoint_and_stats_exact() {
    let seed = common::seed();
    let mut rng = Rng::new(seed);
    let a = allocator();
    let streams: [Stream; 3] = [0, 0x1000, 0x2000];
    let pool_ids = [pools::DEFAULT_POOL, PoolId(1, 1), PoolId(2, 5)];
    let mut live: HashMap<u64, Live> = HashMap::new();
    for step in 0..3000 {
        match rng.below(100) {
            0..=54 => {
                let size = random_size(&mut rng);
                let device = rng.below(2) as i32;
                let pool = pool_ids[rng.below(3) as usize];
                let stream = streams[rng.below(3) as usize];
                let ptr = a.malloc_in(size, device, stream, pool).unwrap();
                let pattern = (step % 251) as u8 + 1;
                fill(ptr, size, pattern);
                assert!(live
                    .insert(
                        ptr,
                        Live {
                            size,
                            device,
                            pattern
                        }
                    )
                    .is_none());
            }
            55..=89 if !live.is_empty() => {
                let k = *live
                    .keys()
                    .nth(rng.below(live.len() as u64) as usize)
                    .unwrap();
                let l = live.remove(&k).unwrap();
                check(k, l.size, l.pattern);
                a.free(k, l.size, l.device, streams[rng.below(3) as usize])
                    .unwrap();
            }
            90..=94 if !live.is_empty() => {
                let k = *live
                    .keys()
                    .nth(rng.below(live.len() as u64) as usize)
                    .unwrap();
                a.record_stream(k, streams[rng.below(3) as usize]).unwrap();
            }
            95..=97 => a.empty_cache().unwrap(),
            _ => {
                let device = rng.below(2) as i32;
                a.release_pool(device, pool_ids[1 + rng.below(2) as usize])
                    .unwrap();
            }
        }
        assert_disjoint(&live);
        if step % 50 == 0 {
            for (&p, l) in &live {
                check(p, l.size, l.pattern);
            }
        }
        for d in 0..2 {
            a.validate(d)
                .unwrap_or_else(|e| panic!("step {step}, device {d}: {e}"));
            let s = a.stats(d).unwrap();
            let mine: Vec<&Live> = live.values().filter(|l| l.device == d).collect();
            assert_eq!(s.active_blocks, mine.len() as u64, "step {step}");
            assert_eq!(
                s.requested_bytes,
                mine.iter().map(|l| l.size).sum::<u64>(),
                "step {step}"
            );
            assert!(s.peak_allocated_bytes >= s.allocated_bytes);
            assert!(s.reserved_bytes >= s.allocated_bytes);
        }
    }
    for (p, l) in live.drain() {
        a.free(p, l.size, l.device, 0).unwrap();
    }
    for id in pool_ids {
        for d in 0..2 {
            a.release_pool(d, id).unwrap();
        }
    }
    a.empty_cache().unwrap();
    for d in 0..2 {
        let s = a.stats(d).unwrap();
        assert_eq!(
            (
                s.allocated_bytes,
                s.reserved_bytes,
                s.active_blocks,
                s.segments
            ),
            (0, 0, 0, 0),
            "device {d} did not return to zero: {s:?}"
        );
        assert_eq!(s.physical_creates, s.physical_releases);
        a.validate(d).unwrap();
    }
}

#[test]
fn cache_reuses_and_splits_and_merges() {
    let a = allocator();
    let dp = pools::DEFAULT_POOL;
    let p1 = a.malloc_in(1000, 0, 0, dp).unwrap();
    let p2 = a.malloc_in(1000, 0, 0, dp).unwrap();
    assert_eq!(
        p2 - p1,
        1024,
        "small blocks are 512-byte rounded and packed"
    );
    let s = a.stats(0).unwrap();
    assert_eq!(
        (s.segments, s.physical_creates, s.cache_hits, s.cache_misses),
        (1, 1, 1, 1)
    );
    // Fill the rest of the 2 MiB small segment.
    let q1 = a.malloc_in(1 << 20, 0, 0, dp).unwrap();
    let q2 = a.malloc_in((1 << 20) - 2048, 0, 0, dp).unwrap();
    assert_eq!(a.stats(0).unwrap().segments, 1);
    // The fast path: a freed block comes back whole for the same size on the same stream.
    a.free(p2, 1000, 0, 0).unwrap();
    a.validate(0).unwrap();
    assert_eq!(a.malloc_in(900, 0, 0, dp).unwrap(), p2, "same rounded size");
    a.free(p2, 900, 0, 0).unwrap();
    a.free(p1, 1000, 0, 0).unwrap();
    a.validate(0).unwrap();
    // A request nothing listed fits merges the parked blocks back: p1 and p2 make 2 KiB.
    let p3 = a.malloc_in(2048, 0, 0, dp).unwrap();
    assert_eq!(p3, p1);
    assert_eq!(a.stats(0).unwrap().physical_creates, 1);
    a.validate(0).unwrap();
    for (p, n) in [(p3, 2048), (q1, 1 << 20), (q2, (1 << 20) - 2048)] {
        a.free(p, n, 0, 0).unwrap();
    }
    // Large and huge requests get large (20 MiB) and dedicated segments.
    let l = a.malloc_in(3 << 20, 0, 0, dp).unwrap();
    let h = a.malloc_in(33 << 20, 0, 0, dp).unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!(s.reserved_bytes, (2 << 20) + (20 << 20) + (34 << 20));
    a.free(l, 3 << 20, 0, 0).unwrap();
    a.free(h, 33 << 20, 0, 0).unwrap();
    a.validate(0).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes, 0);
    a.validate(0).unwrap();
}

#[test]
fn parked_blocks_stay_with_their_stream_and_pool() {
    let a = allocator();
    let dp = pools::DEFAULT_POOL;
    let (s1, s2) = (0x1000, 0x2000);
    let p = a.malloc_in(4096, 0, s1, dp).unwrap();
    a.free(p, 4096, 0, s1).unwrap();
    // Another stream does not take the parked block (it would need ordering).
    let q = a.malloc_in(4096, 0, s2, dp).unwrap();
    assert_ne!(q, p);
    // A block freed on another stream than it was allocated on is not parked: it waits on
    // both streams and is listed for best fit with ordering.
    a.free(q, 4096, 0, s1).unwrap();
    a.validate(0).unwrap();
    // record_stream also keeps a block off the fast path.
    let r = a.malloc_in(4096, 0, s1, dp).unwrap();
    assert_eq!(r, p, "the parked block comes back to its stream");
    a.record_stream(r, s2).unwrap();
    a.free(r, 4096, 0, s1).unwrap();
    a.validate(0).unwrap();
    // A large request of another size drains the parked large blocks first: best fit reuses
    // the freed memory instead of splitting fresh memory beside it.
    let l1 = a.malloc_in(3 << 20, 0, s1, dp).unwrap();
    a.free(l1, 3 << 20, 0, s1).unwrap();
    let creates = a.stats(0).unwrap().physical_creates;
    let l2 = a.malloc_in((3 << 20) + 4096, 0, s1, dp).unwrap();
    assert_eq!(l2, l1);
    assert_eq!(a.stats(0).unwrap().physical_creates, creates);
    a.free(l2, (3 << 20) + 4096, 0, s1).unwrap();
    a.validate(0).unwrap();
    // Releasing a pool drains its parked blocks and gives its segments back.
    let pool = PoolId(5, 5);
    pools::begin(0, pool).unwrap();
    let x = a.malloc(1 << 20, 0, s1).unwrap();
    pools::end(0, pool).unwrap();
    let segments = a.stats(0).unwrap().segments;
    a.free(x, 1 << 20, 0, s1).unwrap();
    a.release_pool(0, pool).unwrap();
    assert_eq!(a.stats(0).unwrap().segments, segments - 1);
    a.validate(0).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes, 0);
    a.validate(0).unwrap();
}

#[test]
fn pools_keep_their_blocks_and_release_when_free() {
    let a = allocator();
    let pool = PoolId(42, 7);
    pools::begin(0, pool).unwrap();
    let p = a.malloc(4096, 0, 0).unwrap();
    let q = a.malloc(4096, 0, 0).unwrap();
    pools::end(0, pool).unwrap();
    a.free(p, 4096, 0, 0).unwrap();
    // The default pool must not reuse the private pool's freed block.
    let d = a.malloc(4096, 0, 0).unwrap();
    assert_ne!(d, p);
    assert_eq!(a.stats(0).unwrap().segments, 2);
    a.release_pool(0, pool).unwrap();
    assert_eq!(
        a.stats(0).unwrap().segments,
        2,
        "pool segment still has a live block"
    );
    a.free(q, 4096, 0, 0).unwrap();
    assert_eq!(
        a.stats(0).unwrap().segments,
        1,
        "released pool's segment goes with its last block"
    );
    a.free(d, 4096, 0, 0).unwrap();
    a.validate(0).unwrap();
}

#[test]
fn eight_threads_random_malloc_free() {
    let secs: f64 = std::env::var("SYMMALLOC_STRESS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10.0);
    let a = std::sync::Arc::new(allocator());
    let seed = common::seed();
    let end = std::time::Instant::now() + std::time::Duration::from_secs_f64(secs);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut rng = Rng::new(seed + t);
                let mut mine: Vec<(u64, u64, u8)> = Vec::new();
                let mut ops = 0u64;
                while std::time::Instant::now() < end {
                    if mine.len() < 64 && (mine.is_empty() || rng.below(2) == 0) {
                        let cap = if rng.below(8) == 0 { 4 << 20 } else { 16 << 10 };
                        let size = 1 + rng.below(cap);
                        let p = a
                            .malloc_in(size, (t % 2) as i32, t * 16, pools::DEFAULT_POOL)
                            .unwrap();
                        let pat = (ops % 255) as u8 + 1;
                        fill(p, size.min(4096), pat);
                        mine.push((p, size, pat));
                    } else {
                        let i = rng.below(mine.len() as u64) as usize;
                        let (p, size, pat) = mine.swap_remove(i);
                        check(p, size.min(4096), pat);
                        a.free(p, size, (t % 2) as i32, t * 16).unwrap();
                    }
                    ops += 1;
                }
                for (p, size, pat) in mine {
                    check(p, size.min(4096), pat);
                    a.free(p, size, (t % 2) as i32, 0).unwrap();
                }
                ops
            })
        })
        .collect();
    let ops: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    eprintln!("{ops} operations in {secs} s on 8 threads");
    for d in 0..2 {
        a.validate(d).unwrap();
        let s = a.stats(d).unwrap();
        assert_eq!((s.allocated_bytes, s.active_blocks), (0, 0), "{s:?}");
    }
    assert!(ops > 1000);
}

/// `f` on a thread of its own (which then exits), its result back.
fn elsewhere<T: Send + 'static>(
    a: &std::sync::Arc<Allocator>,
    f: impl FnOnce(&Allocator) -> T + Send + 'static,
) -> T {
    let a = a.clone();
    std::thread::spawn(move || f(&a)).join().unwrap()
}

/// Thread caches (heap/tcache.rs): a thread's freed block comes back to it for the same size
/// and stream and counts as free meanwhile; other threads, other streams, `record_stream`,
/// pools being released and exited threads all hand blocks back to the heap; errors name the
/// double free and leave everything intact; the heap and the caches agree after every step.
#[test]
fn thread_caches_keep_blocks_for_their_thread_and_give_them_back() {
    let a = std::sync::Arc::new(allocator());
    let dp = pools::DEFAULT_POOL;
    let s1 = 0x1000;
    // What another thread gets for `size` on s1, freed again there by `free` or `free_block`.
    let taken_elsewhere = |size: u64, by_block: bool| {
        elsewhere(&a, move |a| {
            let q = a.malloc_in(size, 0, s1, dp).unwrap();
            if by_block {
                a.free_block(q).unwrap();
            } else {
                a.free(q, size, 0, s1).unwrap();
            }
            q
        })
    };
    let p = a.malloc_in(4096, 0, s1, dp).unwrap();
    a.free(p, 4096, 0, s1).unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!(
        (s.allocated_bytes, s.active_blocks, s.requested_bytes),
        (0, 0, 0),
        "kept counts as free"
    );
    // Kept for this thread: another thread asking for the same size and stream gets another
    // block (without thread caches, the heap's parked path would hand it p).
    let other = taken_elsewhere(4096, false);
    assert_eq!(other != p, symmalloc::config::thread_cache().unwrap());
    a.validate(0).unwrap();
    // A second free of the kept block is a double free, and changes nothing.
    let e = a.free(p, 4096, 0, s1).unwrap_err();
    assert!(e.message.contains("double free"), "{}", e.message);
    let hits = a.stats(0).unwrap().cache_hits;
    assert_eq!(
        a.malloc_in(4000, 0, s1, dp).unwrap(),
        p,
        "same rounded size, same stream"
    );
    let s = a.stats(0).unwrap();
    assert_eq!((s.requested_bytes, s.cache_hits), (4000, hits + 1));
    // A wrong size is refused by the heap, with the block still live at its request.
    assert!(a
        .free(p, 4096, 0, s1)
        .unwrap_err()
        .message
        .contains("allocated with size 4000"));
    assert_eq!(a.stats(0).unwrap().requested_bytes, 4000);
    a.validate(0).unwrap();
    // Freed by another thread: the heap takes it (the wrong-size free above took it back from
    // the cache), nothing is lost.
    elsewhere(&a, move |a| a.free(p, 4000, 0, s1).unwrap());
    a.validate(0).unwrap();
    assert_eq!(a.stats(0).unwrap().active_blocks, 0);
    // A block handed out by this thread's cache and freed by another thread (autograd's backward
    // frees what the forward allocated): the lending cache keeps it for its own thread.
    let r = a.malloc_in(6000, 0, s1, dp).unwrap();
    elsewhere(&a, move |a| a.free(r, 6000, 0, s1).unwrap());
    a.validate(0).unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!(
        (s.active_blocks, s.allocated_bytes),
        (0, 0),
        "kept counts as free"
    );
    let tc = symmalloc::config::thread_cache().unwrap();
    // Kept by this thread's cache, not parked in the heap: a third thread gets another block.
    let third = taken_elsewhere(6000, false);
    assert_eq!(
        third != r,
        tc,
        "the remotely freed block waits for its lending thread"
    );
    let hits = a.stats(0).unwrap().cache_hits;
    let p2 = a.malloc_in(6000, 0, s1, dp).unwrap();
    assert_eq!(
        (p2 == r, a.stats(0).unwrap().cache_hits == hits + 1),
        (true, tc),
        "a block freed on another thread comes back to the lending thread from its cache"
    );
    // The same through `free_block` (PyTorch's raw_delete, which knows only the address).
    let before = a.stats(0).unwrap();
    let r2 = a.malloc_in(7000, 0, s1, dp).unwrap();
    elsewhere(&a, move |a| a.free_block(r2).unwrap());
    a.validate(0).unwrap();
    let third = taken_elsewhere(7000, true);
    assert_eq!(third != r2, tc, "free_block: kept for the lending thread");
    if tc {
        // Kept already: a second free from yet another thread is a double free, named.
        let e = elsewhere(&a, move |a| a.free_block(r2).unwrap_err());
        assert!(e.message.contains("double free"), "{}", e.message);
        a.validate(0).unwrap();
    }
    assert_eq!(a.malloc_in(7000, 0, s1, dp).unwrap(), r2);
    a.free_block(r2).unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!(
        (s.active_blocks, s.allocated_bytes, s.requested_bytes),
        (
            before.active_blocks,
            before.allocated_bytes,
            before.requested_bytes
        ),
        "{s:?}"
    );
    // Remote frees keep at most KEEP_REMOTE_BYTES in the lending cache (what an idle lending
    // thread keeps cannot serve the freeing thread): 16 MiB blocks, the third goes to the heap.
    let big: Vec<u64> = (0..3)
        .map(|_| a.malloc_in(16 << 20, 0, s1, dp).unwrap())
        .collect();
    let big2 = big.clone();
    elsewhere(&a, move |a| {
        for p in big2 {
            a.free(p, 16 << 20, 0, s1).unwrap();
        }
    });
    a.validate(0).unwrap();
    let kept_big = a
        .walk(0, None)
        .unwrap()
        .iter()
        .filter(|b| b.state == 3 && big.contains(&b.address))
        .count();
    let most = symmalloc::heap::tcache::KEEP_REMOTE_BYTES / (16 << 20);
    assert_eq!(
        kept_big as u64,
        if tc { most } else { 0 },
        "kept for the lending thread"
    );
    a.empty_cache().unwrap();
    // ... but not on another stream than its own: the heap takes it then, nothing is lost.
    elsewhere(&a, move |a| a.free(p2, 6000, 0, 0x5000).unwrap());
    a.validate(0).unwrap();
    assert_eq!(a.stats(0).unwrap().active_blocks, 0);
    // A block whose lending thread has exited goes to the heap when another thread frees it
    // (nobody would take it from the orphaned cache).
    let orphaned = elsewhere(&a, move |a| a.malloc_in(4096, 0, s1, dp).unwrap());
    a.free(orphaned, 4096, 0, s1).unwrap();
    a.validate(0).unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!((s.active_blocks, s.allocated_bytes), (0, 0), "{s:?}");
    // record_stream takes the block back from the cache: its free then waits on both streams.
    let q = a.malloc_in(8192, 0, s1, dp).unwrap();
    a.record_stream(q, 0x2000).unwrap();
    a.free(q, 8192, 0, s1).unwrap();
    a.validate(0).unwrap();
    assert_eq!(a.stats(0).unwrap().active_blocks, 0);
    // A thread that exits leaves its kept blocks behind; empty_cache takes them back.
    let a3 = a.clone();
    std::thread::spawn(move || {
        let r = a3.malloc_in(3 << 20, 0, 0x3000, dp).unwrap();
        a3.free(r, 3 << 20, 0, 0x3000).unwrap();
    })
    .join()
    .unwrap();
    a.validate(0).unwrap();
    assert_eq!(a.stats(0).unwrap().allocated_bytes, 0);
    a.empty_cache().unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.segments), (0, 0), "{s:?}");
    a.validate(0).unwrap();
    // A pool being released: its kept blocks go back, and later frees are not kept.
    let pool = PoolId(7, 1);
    let b1 = a.malloc_in(1 << 20, 0, s1, pool).unwrap();
    let b2 = a.malloc_in(1 << 20, 0, s1, pool).unwrap();
    a.free(b1, 1 << 20, 0, s1).unwrap();
    a.release_pool(0, pool).unwrap();
    a.free(b2, 1 << 20, 0, s1).unwrap();
    a.validate(0).unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!(
        (s.allocated_bytes, s.reserved_bytes),
        (0, 0),
        "the released pool's segment went back: {s:?}"
    );
    // Memory grows only once what caches keep cannot serve a request: a block kept by this
    // thread is merged back rather than a new segment made.
    let c: Vec<u64> = (0..4)
        .map(|_| a.malloc_in(512 << 10, 0, s1, dp).unwrap())
        .collect();
    assert_eq!(
        a.stats(0).unwrap().segments,
        1,
        "four 512 KiB blocks fill a small segment"
    );
    a.free(c[1], 512 << 10, 0, s1).unwrap();
    a.free(c[2], 512 << 10, 0, s1).unwrap();
    let creates = a.stats(0).unwrap().physical_creates;
    let d = a.malloc_in(1 << 20, 0, s1, dp).unwrap();
    assert_eq!(d, c[1], "the two kept neighbours, merged");
    assert_eq!(
        a.stats(0).unwrap().physical_creates,
        creates,
        "no new segment"
    );
    for (p, n) in [(d, 1 << 20), (c[0], 512 << 10), (c[3], 512 << 10)] {
        a.free(p, n, 0, s1).unwrap();
    }
    a.empty_cache().unwrap();
    a.validate(0).unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes, 0);
}
