//! What the C++ allocator's memory history reads from the library (src/ffi/torch_alloc.rs), on
//! the host backend: reads never make a heap on a device the process did not allocate on, the
//! segment event log (segments made, grown in place, given back: PyTorch's SEGMENT_ALLOC,
//! SEGMENT_MAP, SEGMENT_FREE), a live block's request by address, and the exact peak of the
//! reserved bytes over both size classes (PyTorch's `max_memory_reserved`). Its own test binary:
//! the segment log is process-wide; each test uses a device of its own.

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

fn ok(st: symm_status_t) {
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
}

fn stats(device: i32) -> DeviceStats {
    let mut s = DeviceStats::default();
    ok(symm_device_stats(
        device,
        &mut s,
        std::mem::size_of::<DeviceStats>(),
    ));
    s
}

fn alloc(size: usize, device: i32) -> *mut c_void {
    let mut p = null_mut();
    ok(symm_malloc_checked(size, device, null_mut(), &mut p));
    p
}

fn events(device: i32) -> Vec<symm_segment_event_t> {
    let mut out = Vec::new();
    loop {
        let mut buf = [symm_segment_event_t::default(); 4];
        let mut n = 0;
        ok(symm_segment_events(
            device,
            buf.as_mut_ptr(),
            buf.len(),
            &mut n,
        ));
        out.extend_from_slice(&buf[..n]);
        if n < buf.len() {
            return out;
        }
    }
}

#[test]
fn reads_never_make_a_heap() {
    host();
    let d = 7;
    let heap = symmalloc::heap::global().unwrap();
    assert!(!heap.heap_made(d));
    let s = stats(d);
    assert_eq!(s.reserved_bytes[AGGREGATE].current, 0);
    assert_eq!(s.max_split_size, -1);
    ok(symm_reset_peak_stats(d));
    ok(symm_reset_accumulated_stats(d));
    let mut largest = 1;
    ok(symm_cache_info(d, &mut largest));
    assert_eq!(largest, 0);
    let mut n = 1;
    ok(symm_heap_blocks(d, 1, 0, 0, null_mut(), 0, &mut n));
    assert_eq!(n, 0);
    let mut uses = 1;
    ok(symm_pool_uses(d, 0, 5, &mut uses));
    assert_eq!(uses, 0);
    assert!(events(d).is_empty());
    assert!(
        !heap.heap_made(d),
        "statistics, resets, cacheInfo, blocks, pool uses and segment events made no heap"
    );
    // A device that does not exist is still refused, by name.
    assert_eq!(
        symm_device_stats(99, &mut DeviceStats::default(), 976),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("device 99"), "{}", err());
    let p = alloc(4096, d);
    assert!(heap.heap_made(d), "an allocation makes the heap");
    ok(symm_free_block(p));
}

#[test]
fn segment_events_name_made_grown_and_freed_ranges() {
    host();
    let d = 2;
    let pool = (0u64, 9090u64);
    ok(symm_segment_log(1));
    symm_begin_pool(d, pool.0, pool.1);
    // 12 MiB: a segment of its own; freed, then 14 MiB grows it in place by 2 MiB.
    let a = alloc(12 << 20, d);
    ok(symm_free_block(a));
    let b = alloc(14 << 20, d);
    assert_eq!(b, a, "the grown segment serves the request at its start");
    symm_end_pool(d, pool.0, pool.1);
    ok(symm_free_block(b));
    symm_release_pool(d, pool.0, pool.1);
    let seg = a as u64;
    let got: Vec<_> = events(d)
        .into_iter()
        .map(|e| {
            assert_eq!(e.device, d);
            assert_eq!((e.pool_first, e.pool_second), pool);
            (e.kind, e.address, e.size, e.segment_address)
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (SYMM_SEGMENT_MADE, seg, 12 << 20, seg),
            (SYMM_SEGMENT_MAPPED, seg + (12 << 20), 2 << 20, seg),
            (SYMM_SEGMENT_FREED, seg, 14 << 20, seg),
        ]
    );
    // A trim before growth (device_heap/release.rs) is a segment given back too: an idle 24
    // MiB segment too small for 30 MiB goes back (heap_trim.rs's first case), on an allocator
    // of its own (in this test, not beside it: trims wait while any pool is open).
    {
        use symmalloc::heap::device_stats::SegmentEvent;
        use symmalloc::heap::{host_backend::HostBackend, pools, Allocator};
        const MIB: u64 = 1 << 20;
        let a = Allocator::new(Box::new(HostBackend)).unwrap();
        let (dp, s) = (pools::DEFAULT_POOL, 0x1000);
        let live = a.malloc_in(100 * MIB, 0, s, dp).unwrap();
        let x = a.malloc_in(20 * MIB, 0, s, dp).unwrap();
        let y = a.malloc_in(24 * MIB, 0, s, dp).unwrap();
        let w = a.malloc_in(56 * MIB, 0, s, dp).unwrap();
        a.free(x, 20 * MIB, 0, s).unwrap();
        a.free(y, 24 * MIB, 0, s).unwrap();
        let _ = a.segment_events(Some(0), usize::MAX).unwrap();
        let z = a.malloc_in(30 * MIB, 0, s, dp).unwrap();
        let got: Vec<_> = a
            .segment_events(Some(0), usize::MAX)
            .unwrap()
            .into_iter()
            .map(|(d, e, base)| {
                assert_eq!(d, 0);
                match e {
                    SegmentEvent::Freed { offset, size, .. } => ("freed", base + offset, size),
                    SegmentEvent::Made { offset, size, .. } => ("made", base + offset, size),
                    other => panic!("unexpected {other:?}"),
                }
            })
            .collect();
        assert_eq!(
            got,
            vec![("freed", y, 24 * MIB), ("made", z, 30 * MIB)],
            "the trimmed segment's free, then the new one"
        );
        for (p, n) in [(live, 100 * MIB), (w, 56 * MIB), (z, 30 * MIB)] {
            a.free(p, n, 0, s).unwrap();
        }
    }
    // Off: nothing more is logged.
    ok(symm_segment_log(0));
    let c = alloc(16 << 20, d);
    ok(symm_free_block(c));
    symm_empty_cache();
    assert!(events(d).is_empty());
    // Bad arguments are refused by name and write nothing.
    assert_eq!(
        symm_segment_events(d, null_mut(), 4, &mut 0),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("out is NULL"), "{}", err());
    assert_eq!(
        symm_segment_events(d, null_mut(), 0, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        symm_segment_events(42, null_mut(), 0, &mut 0),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
}

#[test]
fn a_block_is_found_by_address_without_a_walk() {
    host();
    let d = 4;
    let p = alloc(1000, d);
    let (mut dev, mut req, mut stream) = (-1, 0u64, std::ptr::dangling_mut::<CUstream_st>());
    ok(symm_block_request(p, &mut dev, &mut req, &mut stream));
    assert_eq!((dev, req, stream), (d, 1000, null_mut()));
    ok(symm_free_block(p));
    let (mut dev, mut req) = (-1, 7u64);
    assert_eq!(
        symm_block_request(p, &mut dev, &mut req, &mut stream),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT,
        "a freed block is not live"
    );
    assert_eq!((dev, req), (-1, 7), "nothing written on failure");
    assert_eq!(
        symm_block_request(8usize as *mut c_void, &mut dev, &mut req, &mut stream),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("not returned by symm_malloc"), "{}", err());
    assert_eq!(
        symm_block_request(p, null_mut(), &mut req, &mut stream),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
}

#[test]
fn max_reserved_is_the_peak_of_the_total() {
    host();
    let d = 3;
    let small = alloc(1000, d); // a 2 MiB small segment
    let large = alloc(5 << 20, d); // a 20 MiB large one, while the small one is held
    ok(symm_free_block(small));
    symm_empty_cache(); // the small segment goes back
    let s = stats(d);
    assert_eq!(s.reserved_bytes[AGGREGATE].current, 20 << 20);
    assert_eq!(s.reserved_bytes[SMALL].peak, 2 << 20);
    assert_eq!(s.reserved_bytes[LARGE].peak, 20 << 20);
    assert_eq!(
        s.reserved_bytes[AGGREGATE].peak,
        22 << 20,
        "both were held at once: max_memory_reserved is 22 MiB, not the larger class's 20"
    );
    assert_eq!(s.segment[AGGREGATE].peak, 2);
    ok(symm_free_block(large));
}
