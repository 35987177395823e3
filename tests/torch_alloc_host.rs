//! The C ABI behind the C++ allocator for PyTorch (src/ffi/torch_alloc.rs), on the host
//! backend: PyTorch's statistics as the heap's counters give them (exact current values, peaks,
//! resets, inactive split memory), the memory cap and out of memory, the largest cached block,
//! a free by address alone, the block listing of snapshots, and a pool put back to a
//! checkpoint. Each test uses a device of its own (statistics are per device).

mod common;
use common::err;
use std::ffi::c_void;
use std::ptr::null_mut;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;
use symmalloc::heap::device_stats::{DeviceStats, AGGREGATE, LARGE, SMALL};

fn host() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: set before any other thread of this test binary touches the library.
    ONCE.call_once(|| unsafe { std::env::set_var("SYMMALLOC_BACKEND", "host") });
}

fn stats(device: i32) -> DeviceStats {
    let mut s = DeviceStats::default();
    let st = symm_device_stats(device, &mut s, std::mem::size_of::<DeviceStats>());
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    s
}

fn alloc(size: usize, device: i32) -> *mut c_void {
    let mut p = null_mut();
    let st = symm_malloc_checked(size, device, null_mut(), &mut p);
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    assert!(!p.is_null());
    p
}

fn blocks(device: i32, pool: Option<(u64, u64)>) -> Vec<symm_block_info_t> {
    let (all, f, s) = match pool {
        Some((f, s)) => (0, f, s),
        None => (1, 0, 0),
    };
    let mut n = 0usize;
    assert_eq!(
        symm_heap_blocks(device, all, f, s, null_mut(), 0, &mut n),
        symm_status_t::SYMM_SUCCESS
    );
    let mut v = vec![symm_block_info_t::default(); n];
    let mut m = 0usize;
    assert_eq!(
        symm_heap_blocks(device, all, f, s, v.as_mut_ptr(), n, &mut m),
        symm_status_t::SYMM_SUCCESS
    );
    assert_eq!(m, n);
    v
}

#[test]
fn statistics_follow_allocations_exactly() {
    host();
    let d = 1;
    let before = stats(d);
    assert_eq!(before.allocation[AGGREGATE].current, 0);
    let a = alloc(1000, d); // small: 1024-byte block
    let b = alloc(3 << 20, d); // large: a 20 MiB segment
    let s = stats(d);
    assert_eq!(s.allocation[AGGREGATE].current, 2);
    assert_eq!(s.allocation[SMALL].current, 1);
    assert_eq!(s.allocation[LARGE].current, 1);
    assert_eq!(s.allocated_bytes[SMALL].current, 1024);
    assert_eq!(s.allocated_bytes[LARGE].current, 3 << 20);
    assert_eq!(s.requested_bytes[AGGREGATE].current, 1000 + (3 << 20));
    assert_eq!(
        s.active_bytes, s.allocated_bytes,
        "active is allocated in symmalloc"
    );
    assert_eq!(s.segment[SMALL].current, 1);
    assert_eq!(s.segment[LARGE].current, 1);
    assert_eq!(s.reserved_bytes[SMALL].current, 2 << 20);
    assert_eq!(s.reserved_bytes[LARGE].current, 20 << 20);
    // Both segments are split: what users do not hold there is inactive split memory.
    assert_eq!(s.inactive_split_bytes[SMALL].current, (2 << 20) - 1024);
    assert_eq!(s.inactive_split_bytes[LARGE].current, (17 << 20));
    assert_eq!(s.inactive_split[AGGREGATE].current, 2);
    assert_eq!(s.num_device_alloc, before.num_device_alloc + 2);
    assert_eq!(s.max_split_size, -1);

    symm_free(a, 1000, d, null_mut());
    symm_free(b, 3 << 20, d, null_mut());
    assert_eq!(err(), "");
    let s = stats(d);
    assert_eq!(s.allocation[AGGREGATE].current, 0);
    assert_eq!(s.allocated_bytes[AGGREGATE].current, 0);
    assert_eq!(s.allocated_bytes[AGGREGATE].peak, 1024 + (3 << 20));
    assert_eq!(s.allocation[AGGREGATE].allocated, 2);
    assert_eq!(s.allocation[AGGREGATE].freed, 2);
    assert_eq!(s.requested_bytes[AGGREGATE].current, 0);

    // Resets: peaks to current, accumulated to zero; current values stay.
    let c = alloc(512, d);
    assert_eq!(symm_reset_peak_stats(d), symm_status_t::SYMM_SUCCESS);
    assert_eq!(symm_reset_accumulated_stats(d), symm_status_t::SYMM_SUCCESS);
    let s = stats(d);
    assert_eq!(s.allocated_bytes[AGGREGATE].peak, 512);
    assert_eq!(s.allocated_bytes[AGGREGATE].current, 512);
    assert_eq!(s.allocation[AGGREGATE].allocated, 0);
    assert_eq!(s.allocation[AGGREGATE].freed, 0);
    assert_eq!(s.num_device_alloc, 0);
    assert_eq!(symm_free_block(c), symm_status_t::SYMM_SUCCESS, "{}", err());
    assert_eq!(stats(d).allocation[AGGREGATE].freed, 1);
}

#[test]
fn stats_sizes_and_null_are_refused() {
    host();
    let mut s = DeviceStats::default();
    assert_eq!(
        symm_device_stats(2, &mut s, 8),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("size 8"), "{}", err());
    assert_eq!(
        symm_device_stats(2, null_mut(), std::mem::size_of::<DeviceStats>()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        symm_device_stats(99, &mut s, std::mem::size_of::<DeviceStats>()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("device 99"), "{}", err());
    assert_eq!(
        symm_cache_info(2, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        symm_malloc_checked(64, 2, null_mut(), null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
}

#[test]
fn out_of_memory_is_its_own_status_and_counted() {
    host();
    let d = 3;
    let keep = alloc(4096, d);
    // SAFETY: a live block of 4096 bytes of host memory.
    unsafe { std::ptr::write_bytes(keep as *mut u8, 0x5A, 4096) };
    let before = stats(d).num_ooms;
    // Larger than the heap.
    let mut p = std::ptr::dangling_mut::<c_void>();
    assert_eq!(
        symm_malloc_checked(1 << 50, d, null_mut(), &mut p),
        symm_status_t::SYMM_ERR_OUT_OF_MEMORY
    );
    assert!(p.is_null());
    assert!(err().contains("out of memory"), "{}", err());
    // Past the cap: 8 MiB held at most, so a 20 MiB segment cannot be made.
    assert_eq!(
        symm_set_memory_limit(d, 8 << 20),
        symm_status_t::SYMM_SUCCESS
    );
    assert_eq!(
        symm_malloc_checked(12 << 20, d, null_mut(), &mut p),
        symm_status_t::SYMM_ERR_OUT_OF_MEMORY
    );
    let e = err();
    assert!(e.contains("memory limit") && e.contains("8388608"), "{e}");
    let s = stats(d);
    assert_eq!(s.num_ooms, before + 2);
    assert!(
        s.num_alloc_retries >= 1,
        "the cache was emptied and the request tried again"
    );
    // Within the cap still works, and the cap can be lifted.
    let small = alloc(1 << 20, d);
    assert_eq!(symm_set_memory_limit(d, 0), symm_status_t::SYMM_SUCCESS);
    let big = alloc(12 << 20, d);
    // SAFETY: as above.
    let kept = unsafe { std::slice::from_raw_parts(keep as *const u8, 4096) };
    assert!(
        kept.iter().all(|&b| b == 0x5A),
        "a failed request disturbed a live block"
    );
    for q in [keep, small, big] {
        assert_eq!(symm_free_block(q), symm_status_t::SYMM_SUCCESS, "{}", err());
    }
}

#[test]
fn free_by_address_uses_the_allocation_and_refuses_twice() {
    host();
    let d = 4;
    let s = stats(d);
    let p = alloc(777, d);
    assert_eq!(symm_free_block(p), symm_status_t::SYMM_SUCCESS, "{}", err());
    assert_eq!(
        stats(d).allocation[AGGREGATE].current,
        s.allocation[AGGREGATE].current
    );
    // The same block again: double free, named; a foreign pointer: named.
    assert_ne!(symm_free_block(p), symm_status_t::SYMM_SUCCESS);
    assert!(err().contains("free"), "{}", err());
    let mut x = 0u64;
    assert_eq!(
        symm_free_block(&mut x as *mut u64 as *mut c_void),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("not returned by symm_malloc"), "{}", err());
    assert_eq!(symm_free_block(null_mut()), symm_status_t::SYMM_SUCCESS);
}

#[test]
fn cache_info_and_snapshot_blocks() {
    host();
    let d = 5;
    let a = alloc(5 << 20, d);
    let b = alloc(2048, d);
    symm_free(a, 5 << 20, d, null_mut());
    let mut largest = 0u64;
    assert_eq!(
        symm_cache_info(d, &mut largest),
        symm_status_t::SYMM_SUCCESS
    );
    assert_eq!(
        largest,
        20 << 20,
        "the large segment is one free block again"
    );
    let all = blocks(d, None);
    let live: Vec<_> = all.iter().filter(|x| x.state == SYMM_BLOCK_LIVE).collect();
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].address, b as u64);
    assert_eq!(live[0].requested, 2048);
    assert_eq!(live[0].is_large, 0);
    // Blocks tile their segments.
    for w in all.windows(2) {
        if w[0].segment_address == w[1].segment_address {
            assert_eq!(w[0].address + w[0].size, w[1].address);
        }
    }
    // A freed small block is kept by this thread's cache: free to users, shown so.
    symm_free(b, 2048, d, null_mut());
    let after = blocks(d, None);
    assert!(
        after.iter().all(|x| x.state != SYMM_BLOCK_LIVE),
        "{after:?}"
    );
    assert!(after
        .iter()
        .any(|x| x.address == b as u64
            && (x.state == SYMM_BLOCK_KEPT || x.state == SYMM_BLOCK_PARKED)));
}

#[test]
fn a_pool_goes_back_to_its_checkpoint() {
    host();
    let d = 6;
    let pool = (0u64, 4242u64);
    assert_eq!(
        symm_pool_hold(d, pool.0, pool.1),
        symm_status_t::SYMM_SUCCESS
    );
    let mut uses = 0;
    assert_eq!(
        symm_pool_uses(d, pool.0, pool.1, &mut uses),
        symm_status_t::SYMM_SUCCESS
    );
    assert_eq!(uses, 1);
    symm_begin_pool(d, pool.0, pool.1);
    let x = alloc(3 << 20, d);
    let y = alloc(4 << 20, d);
    let z = alloc(1000, d);
    symm_end_pool(d, pool.0, pool.1);
    let checkpoint = blocks(d, Some(pool));
    let live: Vec<_> = checkpoint
        .iter()
        .copied()
        .filter(|b| b.state == SYMM_BLOCK_LIVE)
        .collect();
    assert_eq!(live.len(), 3);
    // After the checkpoint: y and z die, w is born.
    assert_eq!(symm_free_block(y), symm_status_t::SYMM_SUCCESS);
    assert_eq!(symm_free_block(z), symm_status_t::SYMM_SUCCESS);
    symm_begin_pool(d, pool.0, pool.1);
    let w = alloc(2 << 20, d);
    symm_end_pool(d, pool.0, pool.1);
    assert!(blocks(d, Some(pool))
        .iter()
        .any(|b| b.address == w as u64 && b.state == SYMM_BLOCK_LIVE));
    let n_before = stats(d).allocation[AGGREGATE].current;
    assert_eq!(
        symm_pool_restore(d, pool.0, pool.1, live.as_ptr(), live.len()),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
    let now: Vec<_> = blocks(d, Some(pool))
        .into_iter()
        .filter(|b| b.state == SYMM_BLOCK_LIVE)
        .map(|b| (b.address, b.size, b.requested))
        .collect();
    let want: Vec<_> = live
        .iter()
        .map(|b| (b.address, b.size, b.requested))
        .collect();
    assert_eq!(
        now, want,
        "x, y and z live again, at their addresses; w freed"
    );
    // x and w were freed (2), x, y, z allocated (3).
    assert_eq!(stats(d).allocation[AGGREGATE].current, n_before - 2 + 3);
    // A checkpoint block that is not free memory of the pool is refused, by name.
    assert_eq!(
        symm_pool_restore(d, 0, 777, live.as_ptr(), 1),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("checkpoint block"), "{}", err());
    for p in [x, y, z] {
        assert_eq!(symm_free_block(p), symm_status_t::SYMM_SUCCESS, "{}", err());
    }
    symm_release_pool(d, pool.0, pool.1);
    assert_eq!(stats(d).allocation[AGGREGATE].current, n_before - 2);
}
