//! The growth ladder's placement, pinned: a seeded sequence of 6,000 requests and frees over
//! every step of the ladder (parked blocks, best fit, the thread caches' blocks taken back, a
//! donor's whole segment, growth in place, trimming, new segments, out of memory under a
//! limit, capturing streams, a communicator arena, exited threads' caches), replayed on host
//! memory, gives the same offsets, segments, block layout and reserved bytes as the ladder did
//! before it was one function (its digest was taken at 14a3c78, 2026-12-05, on the host
//! backend; placement reads only the call sequence, so host memory answers for the GPU's).
//!
//! A placement change shows here first. When one is meant, say so in the commit, measure it
//! (bench/NOTES.md, "The allocator") and set `DIGEST` to the value the failure prints.
//!
//! A test binary of its own: it reads the allocator's counters, which nothing else may move.

use crate::capture_backend;
use crate::common;
use capture_backend::capture_backend;
use common::Rng;
use symmalloc::heap::backend::Stream;
use symmalloc::heap::pools::{self, PoolId, DEFAULT_POOL};

const MIB: u64 = 1 << 20;
/// The digest of `run()` at 14a3c78 (the ladder split between heap/mod.rs and placement.rs):
/// 4,124.0 MiB reserved, 220 segments, 297 made / 58 given back, 21 grown, 14 adopted.
const DIGEST: u64 = 0xbae5_a559_af64_b964;

struct Fnv(u64);

impl Fnv {
    fn add(&mut self, v: u64) {
        for b in v.to_le_bytes() {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }
}

fn size(r: &mut Rng) -> u64 {
    match r.below(10) {
        0..=4 => 1 + r.below(MIB),                          // small
        5..=7 => MIB + 1 + r.below(9 * MIB),                // large
        8 => 10 * MIB + r.below(60 * MIB),                  // huge: a segment of its own
        _ => [512, 2 * MIB, 20 * MIB][r.below(3) as usize], // exact boundaries
    }
}

/// Replays the sequence; returns the digest and a summary (reserved MiB, segments, made,
/// given back) for the failure message.
fn run() -> (u64, String) {
    let (a, seen) = capture_backend();
    let heap_base = a.heap(0).unwrap().base();
    let arena = {
        let mut h = a.heap(0).unwrap();
        let off = 4096 * MIB;
        h.claim_arena(off, 256 * MIB)
            .expect("the arena's range is free")
    };
    let pools_of = [
        DEFAULT_POOL,
        DEFAULT_POOL,
        PoolId(7, 1), // grows in place
        PoolId(9, 2),
        pools::arena_pool(arena, false),
    ];
    let streams: [Stream; 3] = [0x10, 0x20, 0x30];
    let mut r = Rng::new(0x5eed_1adde7);
    let mut d = Fnv(0xcbf2_9ce4_8422_2325);
    let mut live: Vec<(u64, u64, Stream)> = Vec::new();
    for i in 0..6000u64 {
        let op = r.below(100);
        match op {
            0..=54 => {
                let n = size(&mut r);
                let pool = pools_of[r.below(pools_of.len() as u64) as usize];
                let s = streams[r.below(3) as usize];
                match a.malloc_in(n, 0, s, pool) {
                    Ok(p) => {
                        d.add(p - heap_base);
                        live.push((p, n, s));
                    }
                    Err(e) => {
                        d.add(u64::MAX - e.status as u64);
                    }
                }
            }
            55..=94 if !live.is_empty() => {
                let k = r.below(live.len() as u64) as usize;
                let (p, n, s) = live.swap_remove(k);
                // Mostly on its own stream; sometimes another stream used it too.
                if r.below(8) == 0 {
                    a.record_stream(p, streams[r.below(3) as usize]).unwrap();
                }
                a.free(p, n, 0, s).unwrap();
            }
            95 => a.empty_cache().unwrap(),
            96 => {
                // A thread that allocates, frees and exits: its cache is an orphan's.
                let blocks: Vec<(u64, u64)> = (0..4).map(|_| (size(&mut r), 0x40)).collect();
                let got = std::thread::scope(|sc| {
                    sc.spawn(|| {
                        let got: Vec<_> = blocks
                            .iter()
                            .map(|&(n, s)| a.malloc_in(n, 0, s, DEFAULT_POOL))
                            .collect();
                        for (p, &(n, s)) in got.iter().zip(&blocks) {
                            if let Ok(p) = p {
                                a.free(*p, n, 0, s).unwrap();
                            }
                        }
                        got
                    })
                    .join()
                    .unwrap()
                });
                for p in got {
                    d.add(match p {
                        Ok(p) => p - heap_base,
                        Err(e) => u64::MAX - e.status as u64,
                    });
                }
            }
            97 => {
                // A memory limit for a while (out of memory, retries), or none.
                let limit = if r.below(2) == 0 {
                    0
                } else {
                    a.stats(0).unwrap().reserved_bytes + r.below(64) * MIB
                };
                a.heap(0).unwrap().set_limit(limit);
            }
            98 => {
                // A stream starts or stops capturing.
                let s = streams[1 + r.below(2) as usize];
                let mut seen = seen.lock().unwrap();
                if !seen.capturing.remove(&s) {
                    seen.capturing.insert(s);
                }
            }
            _ => {
                let pool = PoolId(9, 2);
                a.release_pool(0, pool).unwrap();
            }
        }
        if i % 100 == 99 {
            let h = a.heap(0).unwrap();
            for b in h.walk(None) {
                for v in [
                    b.address - heap_base,
                    b.size,
                    b.requested,
                    b.state as u64,
                    b.segment_address - heap_base,
                    b.segment_size,
                    b.pool.0,
                    b.pool.1,
                    b.stream,
                ] {
                    d.add(v);
                }
            }
            for (off, len) in h.free_ranges() {
                d.add(off);
                d.add(len);
            }
            let st = h.stats;
            let c = &h.counters;
            for v in [
                st.allocated_bytes,
                st.reserved_bytes,
                st.segments,
                st.physical_creates,
                st.physical_releases,
                st.cache_hits,
                st.cache_misses,
                h.grown_in_place(),
                h.adopted_segments(),
                c.num_alloc_retries as u64,
                c.num_ooms as u64,
                c.num_device_alloc as u64,
                c.num_device_free as u64,
            ] {
                d.add(v);
            }
        }
    }
    let st = a.stats(0).unwrap();
    let (grown, adopted) = {
        let h = a.heap(0).unwrap();
        (h.grown_in_place(), h.adopted_segments())
    };
    let summary = format!(
        "{:.1} MiB reserved, {} segments, {} made / {} given back, {} grown, {} adopted, hits {} \
         misses {}, {} live blocks",
        st.reserved_bytes as f64 / MIB as f64,
        st.segments,
        st.physical_creates,
        st.physical_releases,
        grown,
        adopted,
        st.cache_hits,
        st.cache_misses,
        live.len()
    );
    a.validate(0).unwrap();
    (d.0, summary)
}

#[test]
fn the_ladder_places_the_seeded_sequence_as_before() {
    let (digest, summary) = run();
    println!("digest {digest:#x}: {summary}");
    assert_eq!(
        digest, DIGEST,
        "placement changed: digest {digest:#x} ({summary}); expected {DIGEST:#x}"
    );
}

#[test]
fn the_sequence_is_deterministic() {
    assert_eq!(run().0, run().0);
}
