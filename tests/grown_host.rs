//! A segment that grew in place (device_heap/placement.rs, `grow_in_place`) under a
//! communicator, one process per rank on the host backend: a buffer that spans both chunks of
//! the segment all-reduces correctly (every peer maps each chunk), a buffer inside one chunk
//! maps nothing new, and when the pool is released every chunk goes back and every peer unmaps
//! both at its next call.

mod common;
use common::*;
use std::ptr::null_mut;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

const MIB: usize = 1 << 20;
const POOL: (u64, u64) = (11, 1);

fn grown_rank(c: Child) {
    let comm = init(&c);
    let m0 = stats(c.rank).peer_mappings;
    let released = stats(c.rank).physical_releases;
    // A MemPool's allocations: 3 MiB makes a 20 MiB segment, 30 MiB then grows it by 14.
    symm_begin_pool(c.rank, POOL.0, POOL.1);
    let x = symm_malloc(3 * MIB, c.rank, null_mut());
    let y = symm_malloc(30 * MIB, c.rank, null_mut());
    symm_end_pool(c.rank, POOL.0, POOL.1);
    assert!(!x.is_null() && !y.is_null(), "rank {}: {}", c.rank, err());
    let span = symmalloc::heap::global()
        .unwrap()
        .segment_span(c.rank, y as u64)
        .unwrap();
    assert_eq!(span.map(|s| (s.1, s.2)), Some((34 * MIB as u64, 2)));
    let run = |p: *mut std::ffi::c_void, bytes: usize, round: i32| {
        let n = bytes / 4;
        // SAFETY: p is a live block of at least `bytes` bytes of host memory.
        let v = unsafe { std::slice::from_raw_parts_mut(p as *mut f32, n) };
        v.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (c.rank + round) as f32 + (i % 7) as f32);
        let st = symm_all_reduce(comm, p, p, n, SYMM_FP32, SYMM_SUM, null_mut());
        assert_eq!(
            st,
            symm_status_t::SYMM_SUCCESS,
            "rank {}: {}",
            c.rank,
            err()
        );
        let w = c.world as f32;
        let base = (0..c.world).map(|r| (r + round) as f32).sum::<f32>();
        if let Some(i) = v
            .iter()
            .enumerate()
            .position(|(i, &x)| x != base + w * (i % 7) as f32)
        {
            panic!("rank {}: element {i} of {n} is {}", c.rank, v[i]);
        }
    };
    // Across the chunks' border: each peer's two chunks mapped here.
    run(y, 30 * MIB, 0);
    assert_eq!(
        stats(c.rank).peer_mappings,
        m0 + 2 * (c.world as u64 - 1),
        "rank {}",
        c.rank
    );
    // Inside the first chunk: nothing new to map.
    run(x, 3 * MIB, 1);
    assert_eq!(stats(c.rank).peer_mappings, m0 + 2 * (c.world as u64 - 1));
    symm_free(x, 3 * MIB, c.rank, null_mut());
    symm_free(y, 30 * MIB, c.rank, null_mut());
    symm_release_pool(c.rank, POOL.0, POOL.1);
    assert_eq!(stats(c.rank).physical_releases, released + 2, "both chunks");
    for _ in 0..2 {
        // Every rank has released before anyone passes the first; the second retires the
        // peers' chunks on every rank.
        let st = symm_barrier(comm, null_mut());
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    }
    assert_eq!(
        stats(c.rank).peer_mappings,
        m0,
        "rank {}: a peer's released chunk is still mapped",
        c.rank
    );
    destroy(comm);
}

#[test]
fn a_grown_segment_is_shared_and_released_chunk_by_chunk() {
    if let Some(c) = child() {
        return grown_rank(c);
    }
    for world in [2, 3] {
        assert_all_ok(&run_ranks(
            "a_grown_segment_is_shared_and_released_chunk_by_chunk",
            world,
            &[HOST],
            "",
        ));
    }
}
