//! Trimming before growth (device_heap/release.rs): idle segments too small for a request go
//! back before the heap grows, while reserved memory would pass 1.05x what is allocated, and
//! never while a pool is open. A test binary of its own: the pool gate is process-wide, and
//! other tests open pools.

use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::pools::{self, PoolId};
use symmalloc::heap::Allocator;

fn allocator() -> Allocator {
    Allocator::new(Box::new(HostBackend)).unwrap()
}

/// Before the heap grows, idle segments too small for the request go back while reserved
/// memory would otherwise exceed 1.05x what is allocated (device_heap/release.rs): varying
/// large sizes no longer leave them idle for good. Segments that could still serve stay.
#[test]
fn growing_gives_back_idle_segments_too_small_for_the_request() {
    let a = allocator();
    let (dp, s) = (pools::DEFAULT_POOL, 0x1000);
    const MIB: u64 = 1 << 20;
    let live = a.malloc_in(100 * MIB, 0, s, dp).unwrap();
    let x = a.malloc_in(20 * MIB, 0, s, dp).unwrap();
    let y = a.malloc_in(24 * MIB, 0, s, dp).unwrap();
    a.free(x, 20 * MIB, 0, s).unwrap();
    a.free(y, 24 * MIB, 0, s).unwrap();
    let before = a.stats(0).unwrap();
    assert_eq!(before.reserved_bytes, 144 * MIB);
    // 30 MiB fits neither: growing to 174 MiB reserved for 130 allocated would pass 1.05x, so
    // the 24 MiB and then the 20 MiB segment go back first.
    let z = a.malloc_in(30 * MIB, 0, s, dp).unwrap();
    let after = a.stats(0).unwrap();
    assert_eq!(after.physical_releases, before.physical_releases + 2);
    assert_eq!(after.reserved_bytes, 130 * MIB);
    a.validate(0).unwrap();
    // While a pool is open anywhere (PyTorch opens one around each graph capture), the heap
    // never waits for the device on its own: it grows instead. Closed, it trims again.
    let v = a.malloc_in(10 * MIB, 0, s, dp).unwrap();
    a.free(v, 10 * MIB, 0, s).unwrap(); // an idle 10 MiB segment (from 10 MiB: one per block)
    pools::begin(0, PoolId(9, 9)).unwrap();
    let big = a.malloc_in(12 * MIB, 0, s, dp).unwrap(); // 152 > 1.05 x 142: would trim
    pools::end(0, PoolId(9, 9)).unwrap();
    assert_eq!(
        a.stats(0).unwrap().physical_releases,
        after.physical_releases,
        "nothing trimmed"
    );
    a.free(big, 12 * MIB, 0, s).unwrap(); // idle 10 and 12 MiB segments, 152 reserved
    let q = a.malloc_in(14 * MIB, 0, s, dp).unwrap();
    let closed = a.stats(0).unwrap();
    assert_eq!(
        closed.physical_releases,
        after.physical_releases + 2,
        "both went back"
    );
    assert_eq!(closed.reserved_bytes, 144 * MIB);
    a.free(q, 14 * MIB, 0, s).unwrap();
    a.validate(0).unwrap();
    // A smaller request is served by what is cached: nothing is given back.
    a.free(z, 30 * MIB, 0, s).unwrap();
    let w = a.malloc_in(12 * MIB, 0, s, dp).unwrap();
    let s2 = a.stats(0).unwrap();
    assert_eq!(s2.physical_releases, closed.physical_releases);
    for (p, n) in [(w, 12 * MIB), (live, 100 * MIB)] {
        a.free(p, n, 0, s).unwrap();
    }
    a.empty_cache().unwrap();
    a.validate(0).unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes, 0);
}
