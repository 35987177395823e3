//! A segment that grew in place (device_heap/grow.rs) under a communicator, one process per
//! rank, on the host backend (CI) and on GPUs (`gpu_`, ignored without them): a buffer that
//! spans both chunks of the segment all-reduces correctly (every peer maps each chunk), a
//! buffer inside one chunk maps nothing new, and when the pool is released every chunk goes
//! back and every peer unmaps both at its next call.

mod common;
use common::*;
use std::ptr::null_mut;
use symmalloc::cuda::util;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

const MIB: usize = 1 << 20;
const POOL: (u64, u64) = (11, 1);

fn grown_rank(c: Child) {
    let comm = init(&c);
    let m0 = stats(c.device).peer_mappings;
    let released = stats(c.device).physical_releases;
    // A MemPool's allocations: 3 MiB makes a 20 MiB segment, 30 MiB then grows it by 14.
    symm_begin_pool(c.device, POOL.0, POOL.1);
    let x = symm_malloc(3 * MIB, c.device, null_mut());
    let y = symm_malloc(30 * MIB, c.device, null_mut());
    symm_end_pool(c.device, POOL.0, POOL.1);
    assert!(!x.is_null() && !y.is_null(), "rank {}: {}", c.rank, err());
    let span = symmalloc::heap::global()
        .unwrap()
        .segment_span(c.device, y as u64)
        .unwrap();
    assert_eq!(span.map(|s| (s.1, s.2)), Some((34 * MIB as u64, 2)));
    let gpu = c.arg == "gpu";
    let run = |p: *mut std::ffi::c_void, bytes: usize, round: i32| {
        let n = bytes / 4;
        let mut host = vec![0f32; n];
        let v: &mut [f32] = if gpu {
            &mut host
        } else {
            // SAFETY: p is a live block of at least `bytes` bytes of host memory.
            unsafe { std::slice::from_raw_parts_mut(p as *mut f32, n) }
        };
        v.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (c.rank + round) as f32 + (i % 7) as f32);
        // (Kept until the stream is synchronized below: the copy is asynchronous.)
        let up = gpu.then(|| encode(SYMM_FP32, v));
        if let Some(up) = &up {
            util::htod_async(c.device, p as u64, up, 0).unwrap();
        }
        let st = symm_all_reduce(comm, p, p, n, SYMM_FP32, SYMM_SUM, null_mut());
        assert_eq!(
            st,
            symm_status_t::SYMM_SUCCESS,
            "rank {}: {}",
            c.rank,
            err()
        );
        if gpu {
            util::stream_sync(c.device, 0).unwrap();
            let mut down = vec![0u8; bytes];
            util::dtoh(c.device, &mut down, p as u64).unwrap();
            v.copy_from_slice(&decode(SYMM_FP32, &down));
        }
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
        stats(c.device).peer_mappings,
        m0 + 2 * (c.world as u64 - 1),
        "rank {}",
        c.rank
    );
    // Inside the first chunk: nothing new to map.
    run(x, 3 * MIB, 1);
    assert_eq!(stats(c.device).peer_mappings, m0 + 2 * (c.world as u64 - 1));
    symm_free(x, 3 * MIB, c.device, null_mut());
    symm_free(y, 30 * MIB, c.device, null_mut());
    symm_release_pool(c.device, POOL.0, POOL.1);
    assert_eq!(
        stats(c.device).physical_releases,
        released + 2,
        "both chunks"
    );
    for _ in 0..2 {
        // Every rank has released before anyone passes the first; the second retires the
        // peers' chunks on every rank.
        let st = symm_barrier(comm, null_mut());
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
        if gpu {
            // A GPU barrier is a kernel: this host passes it once it has run.
            util::stream_sync(c.device, 0).unwrap();
        }
    }
    assert_eq!(
        stats(c.device).peer_mappings,
        m0,
        "rank {}: a peer's released chunk is still mapped",
        c.rank
    );
    destroy(comm);
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_a_grown_segment_is_shared_and_released_chunk_by_chunk() {
    if let Some(c) = child() {
        return grown_rank(c);
    }
    let world = gpu_world("gpu_a_grown_segment");
    assert_all_ok(&run_ranks(
        "gpu_a_grown_segment_is_shared_and_released_chunk_by_chunk",
        world,
        &[],
        "gpu",
    ));
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
