//! Reads never make a heap (host memory): statistics and a pool release on a device the process
//! never allocated on answer as an empty heap and leave it unmade, so that on CUDA no context is
//! made on another rank's GPU; a device that does not exist is still named.

use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::pools::PoolId;
use symmalloc::heap::stats::Stats;
use symmalloc::heap::Allocator;

#[test]
fn statistics_and_a_release_on_an_unused_device_make_no_heap() {
    let a = Allocator::new(Box::new(HostBackend)).unwrap();
    assert!(
        a.device_count() >= 2,
        "the host backend exposes several devices"
    );
    let p = a.malloc(1 << 20, 0, 0).unwrap();
    assert!(a.has_heap(0));
    assert!(!a.has_heap(1));
    assert_eq!(a.stats(1).unwrap(), Stats::default());
    a.release_pool(1, PoolId(3, 4)).unwrap();
    assert!(!a.has_heap(1), "a read made device 1's heap");
    let s0 = a.stats(0).unwrap();
    assert!(s0.allocated_bytes >= 1 << 20 && s0.reserved_bytes >= s0.allocated_bytes);
    let bad = a.stats(a.device_count()).unwrap_err().to_string();
    assert!(
        bad.contains(&format!("device {}", a.device_count())),
        "{bad}"
    );
    a.free(p, 1 << 20, 0, 0).unwrap();
    assert_eq!(a.stats(0).unwrap().allocated_bytes, 0);
}
