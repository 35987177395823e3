//! Trimming before growth (device_heap/release.rs): idle segments too small for a request go
//! back before the heap grows, while reserved memory would pass 1.05x the working set, and
//! never while a pool is open. A test binary of its own: the pool gate is process-wide, and
//! other tests open pools.

use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::pools::{self, PoolId};
use symmalloc::heap::Allocator;

fn allocator() -> Allocator {
    Allocator::new(Box::new(HostBackend)).unwrap()
}

/// Before the heap grows, idle segments too small for the request go back while reserved
/// memory would otherwise exceed 1.05x the working set: the most allocated since the last
/// `empty_cache`, or what is allocated with the request if more (device_heap/release.rs).
/// Varying large sizes no longer leave them idle for good, and a step's own fall between its
/// peaks gives back nothing it needs again. Segments that could still serve stay.
#[test]
fn growing_gives_back_idle_segments_too_small_for_the_request() {
    let a = allocator();
    let (dp, s) = (pools::DEFAULT_POOL, 0x1000);
    const MIB: u64 = 1 << 20;
    let stats = |a: &Allocator| a.stats(0).unwrap();
    // A working set of 200 MiB; x and y go idle, w stays: 156 allocated, 200 reserved.
    let live = a.malloc_in(100 * MIB, 0, s, dp).unwrap();
    let x = a.malloc_in(20 * MIB, 0, s, dp).unwrap();
    let y = a.malloc_in(24 * MIB, 0, s, dp).unwrap();
    let w = a.malloc_in(56 * MIB, 0, s, dp).unwrap();
    a.free(x, 20 * MIB, 0, s).unwrap();
    a.free(y, 24 * MIB, 0, s).unwrap();
    let before = stats(&a);
    assert_eq!(before.reserved_bytes, 200 * MIB);
    // 30 MiB fits neither idle segment. Growing to 230 MiB would pass 1.05 x 200 = 210: the
    // 24 MiB segment goes back (206 MiB then), and no more: the working set may need the 20
    // MiB one again. (Against what is allocated now, 186 MiB, both would have gone.)
    let z = a.malloc_in(30 * MIB, 0, s, dp).unwrap();
    let after = stats(&a);
    assert_eq!(after.physical_releases, before.physical_releases + 1);
    assert_eq!(after.reserved_bytes, 206 * MIB);
    a.validate(0).unwrap();
    // empty_cache gives back every idle segment and starts the working set again.
    for (p, n) in [(w, 56 * MIB), (z, 30 * MIB)] {
        a.free(p, n, 0, s).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).reserved_bytes, 100 * MIB);
    let x = a.malloc_in(20 * MIB, 0, s, dp).unwrap();
    a.free(x, 20 * MIB, 0, s).unwrap(); // idle 20 MiB, working set 120
                                        // While a pool is open anywhere (PyTorch opens one around each graph capture), the heap
                                        // never waits for the device on its own: it grows instead. Closed, it trims again.
    let released = stats(&a).physical_releases;
    pools::begin(0, PoolId(9, 9)).unwrap();
    let big = a.malloc_in(24 * MIB, 0, s, dp).unwrap(); // 144 > 1.05 x 124: would trim
    pools::end(0, PoolId(9, 9)).unwrap();
    assert_eq!(stats(&a).physical_releases, released, "nothing trimmed");
    a.free(big, 24 * MIB, 0, s).unwrap(); // idle 20 and 24 MiB segments, 144 reserved
    let q = a.malloc_in(30 * MIB, 0, s, dp).unwrap(); // 174, then 150 > 1.05 x 130
    let closed = stats(&a);
    assert_eq!(closed.physical_releases, released + 2, "both went back");
    assert_eq!(closed.reserved_bytes, 130 * MIB);
    a.validate(0).unwrap();
    // A smaller request is served by what is cached: nothing is given back.
    a.free(q, 30 * MIB, 0, s).unwrap();
    let v = a.malloc_in(12 * MIB, 0, s, dp).unwrap();
    assert_eq!(stats(&a).physical_releases, closed.physical_releases);
    for (p, n) in [(v, 12 * MIB), (live, 100 * MIB)] {
        a.free(p, n, 0, s).unwrap();
    }
    a.empty_cache().unwrap();
    a.validate(0).unwrap();
    assert_eq!(stats(&a).reserved_bytes, 0);
}
