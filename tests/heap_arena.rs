//! Communicator arenas in the heap (heap/device_heap/arena.rs), on real host memory, with two
//! private allocators standing for two ranks: the same sequence of arena calls gives the same
//! offsets whatever else each heap does (different device-level traffic, thread caches on),
//! arena segments never move to other pools, a released arena takes no new block and goes
//! back to the heap with its last segment, and an arena out of address space first gives back
//! its own free segments, then fails naming SYMMALLOC_COMM_ARENA_SIZE.

use crate::common;
use common::Rng;
use symmalloc::error::Status;
use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::pools::{arena_pool, DEFAULT_POOL};
use symmalloc::heap::Allocator;

const MIB: u64 = 1 << 20;

fn allocator() -> Allocator {
    Allocator::new(Box::new(HostBackend)).unwrap()
}

/// The highest offset where `len` bytes are free in both heaps (what the ranks agree on).
fn common_offset(a: &Allocator, b: &Allocator, len: u64) -> u64 {
    let (la, lb) = (
        a.heap(0).unwrap().free_ranges(),
        b.heap(0).unwrap().free_ranges(),
    );
    let gran = a.heap(0).unwrap().granularity();
    let mut best = None;
    for &(oa, na) in &la {
        for &(ob, nb) in &lb {
            let (lo, hi) = (oa.max(ob), (oa + na).min(ob + nb));
            if hi >= lo + len {
                let at = (hi - len) / gran * gran;
                if at >= lo {
                    best = best.max(Some(at));
                }
            }
        }
    }
    best.expect("a common free range")
}

/// A rank's device-level traffic: different per rank (seeded by `seed`).
fn noise(a: &Allocator, g: &mut Rng, live: &mut Vec<(u64, u64)>) {
    if live.len() > 4 || (g.below(3) == 0 && !live.is_empty()) {
        let (p, s) = live.remove(g.below(live.len() as u64) as usize);
        a.free(p, s, 0, 0).unwrap();
    } else {
        let s = [4096, 300_000, 3 * MIB, 12 * MIB][g.below(4) as usize] + g.below(5000);
        live.push((a.malloc_in(s, 0, g.below(2), DEFAULT_POOL).unwrap(), s));
    }
}

#[test]
fn the_same_arena_calls_give_the_same_offsets_whatever_else_the_heap_does() {
    let ranks = [allocator(), allocator()];
    // Different histories before the arena exists.
    let mut before = Vec::new();
    for (r, a) in ranks.iter().enumerate() {
        for k in 0..(r + 1) * 3 {
            before.push((
                r,
                a.malloc_in((k as u64 + 1) * MIB, 0, 0, DEFAULT_POOL)
                    .unwrap(),
            ));
        }
    }
    let len = 256 * MIB;
    let off = common_offset(&ranks[0], &ranks[1], len);
    let ids: Vec<u64> = ranks
        .iter()
        .map(|a| a.heap(0).unwrap().claim_arena(off, len).unwrap())
        .collect();
    let bases: Vec<u64> = ranks.iter().map(|a| a.heap(0).unwrap().base()).collect();
    let mut noise_rng = [Rng::new(11), Rng::new(97)];
    let mut noise_live: [Vec<(u64, u64)>; 2] = [Vec::new(), Vec::new()];
    // The arena's calls, drawn once, replayed by both ranks with different noise between.
    let mut g = Rng::new(5);
    let mut live: Vec<Vec<(u64, u64)>> = vec![Vec::new(), Vec::new()];
    for step in 0..400 {
        let free = live[0].len() > 12 || (!live[0].is_empty() && g.below(5) < 2);
        let pick = if free {
            g.below(live[0].len() as u64) as usize
        } else {
            0
        };
        let size = [512, 70_000, MIB, 3 * MIB, 11 * MIB][g.below(5) as usize] + g.below(4096);
        let stream = g.below(3);
        let internal = g.below(8) == 0;
        for r in 0..2 {
            noise(&ranks[r], &mut noise_rng[r], &mut noise_live[r]);
            let a = &ranks[r];
            if free {
                let (p, s) = live[r].remove(pick);
                a.free(p, s, 0, stream).unwrap();
            } else {
                let p = a
                    .malloc_in(size, 0, stream, arena_pool(ids[r], internal))
                    .unwrap();
                live[r].push((p, size));
            }
            a.validate(0).unwrap();
        }
        let offs: Vec<Vec<u64>> = (0..2)
            .map(|r| live[r].iter().map(|&(p, _)| p - bases[r]).collect())
            .collect();
        assert_eq!(
            offs[0], offs[1],
            "step {step}: the ranks' arena blocks differ"
        );
        for &o in &offs[0] {
            assert!(
                (off..off + len).contains(&o),
                "block at {o:#x} outside the arena"
            );
        }
    }
    // A released arena takes nothing new; it goes back to the heap with its last segment.
    for r in 0..2 {
        let a = &ranks[r];
        a.release_arena(0, ids[r]).unwrap();
        let e = a
            .malloc_in(4096, 0, 0, arena_pool(ids[r], false))
            .unwrap_err();
        assert!(e.message.contains("was released"), "{}", e.message);
        assert!(a.heap(0).unwrap().arena_bounds(ids[r]).is_none());
        for (p, s) in live[r].drain(..) {
            a.free(p, s, 0, 0).unwrap();
            a.validate(0).unwrap();
        }
        assert!(
            a.heap(0)
                .unwrap()
                .free_ranges()
                .iter()
                .any(|&(o, l)| o <= off && off + len <= o + l),
            "the arena's range went back to the heap"
        );
        for (p, s) in noise_live[r].drain(..) {
            a.free(p, s, 0, 0).unwrap();
        }
        a.validate(0).unwrap();
    }
    // The device-level blocks made before the arena are intact.
    for (r, p) in before {
        assert!(ranks[r].heap(0).unwrap().pool_of(p) == Some(DEFAULT_POOL));
    }
}

#[test]
fn arena_segments_stay_in_their_arena() {
    let a = allocator();
    let len = 64 * MIB;
    let off = {
        let h = a.heap(0).unwrap();
        let top = h.free_ranges().last().copied().unwrap();
        top.0 + top.1 - len
    };
    let id = a.heap(0).unwrap().claim_arena(off, len).unwrap();
    // A free arena segment is never given to another pool, nor given back by empty_cache.
    let p = a.malloc_in(3 * MIB, 0, 0, arena_pool(id, false)).unwrap();
    a.free(p, 3 * MIB, 0, 0).unwrap();
    let before = a.stats(0).unwrap().segments;
    a.empty_cache().unwrap();
    assert_eq!(
        a.stats(0).unwrap().segments,
        before,
        "empty_cache gave an arena segment back"
    );
    let q = a.malloc_in(3 * MIB, 0, 0, DEFAULT_POOL).unwrap();
    assert!(!(off..off + len).contains(&(q - a.heap(0).unwrap().base())));
    assert_eq!(a.heap(0).unwrap().adopted_segments(), 0);
    a.free(q, 3 * MIB, 0, 0).unwrap();
    // Out of address space: the arena first gives back its own free segments (the 20 MiB one
    // above), then fails naming the variable.
    let big = a.malloc_in(50 * MIB, 0, 0, arena_pool(id, false)).unwrap();
    a.validate(0).unwrap();
    let e = a
        .malloc_in(20 * MIB, 0, 0, arena_pool(id, false))
        .unwrap_err();
    assert_eq!(e.status, Status::ErrOutOfMemory);
    assert!(
        e.message.contains("communicator arena") && e.message.contains("SYMMALLOC_COMM_ARENA_SIZE"),
        "{}",
        e.message
    );
    a.free(big, 50 * MIB, 0, 0).unwrap();
    // A claim over used address space is refused.
    assert!(a.heap(0).unwrap().claim_arena(off, len).is_none());
    a.release_arena(0, id).unwrap();
    assert!(
        a.heap(0).unwrap().claim_arena(off, len).is_some(),
        "the range came back"
    );
    a.validate(0).unwrap();
}
