//! The sequence that crashed global mode (bench/global_memory.py: a ResNet-50 step captured,
//! then graphs sharing one pool, replayed into unmapped memory), on the host backend at the
//! heap level: PyTorch's capture routes allocations by stream (`Allocator::begin_pool` with a
//! filter), and the backward allocates from the autograd thread. Its temporaries must belong to
//! the graph's pool: never handed to eager work afterwards, never given back by `empty_cache`,
//! and a pool shared by two graphs keeps its memory until both are released.
//!
//! A test binary of its own: routes are process-wide (heap/pools.rs), so the tests here take a
//! lock and run one at a time.

use std::sync::Mutex;
use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::pools::{self, PoolId, DEFAULT_POOL};
use symmalloc::heap::Allocator;

const MIB: u64 = 1 << 20;
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn host() -> Allocator {
    Allocator::new(Box::new(HostBackend)).unwrap()
}

fn fill(ptr: u64, n: u64, v: u8) {
    // SAFETY: ptr..ptr+n lies in a live block of host memory returned by the allocator.
    unsafe { std::ptr::write_bytes(ptr as *mut u8, v, n as usize) };
}

fn holds(ptr: u64, n: u64, v: u8) -> bool {
    // SAFETY: as fill().
    let s = unsafe { std::slice::from_raw_parts(ptr as *const u8, n as usize) };
    s.iter().all(|&b| b == v)
}

/// A capture on stream `cap`: PyTorch's filter accepts that stream from any thread.
fn begin_capture(a: &Allocator, pool: PoolId, cap: u64) {
    a.begin_pool(0, pool, Some(Box::new(move |s| s == cap)))
        .unwrap();
}

/// One captured step: a forward buffer on the capturing thread, the backward's temporaries on
/// another thread (the autograd engine's), all on the capturing stream; the temporaries are
/// freed inside the capture (their memory is what the graph writes at every replay). Returns
/// the addresses the graph uses.
fn captured_step(a: &'static Allocator, cap: u64, sizes: &[u64]) -> Vec<(u64, u64)> {
    let fwd = a.malloc(8 * MIB, 0, cap).unwrap();
    let sizes = sizes.to_vec();
    let temps = std::thread::spawn(move || {
        let t: Vec<(u64, u64)> = sizes
            .iter()
            .map(|&n| (a.malloc(n, 0, cap).unwrap(), n))
            .collect();
        for &(p, n) in &t {
            a.free(p, n, 0, cap).unwrap();
        }
        t
    })
    .join()
    .unwrap();
    let mut used = vec![(fwd, 8 * MIB)];
    used.extend(temps);
    used
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

#[test]
fn backward_temporaries_stay_in_the_graphs_pool() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let a: &'static Allocator = Box::leak(Box::new(host()));
    let (cap, eager) = (0x100, 0x200);
    let pool = PoolId(1, 0);
    // Eager work first: the default pool caches segments, then empty_cache (torch.cuda.graph
    // calls it before capturing).
    let warm: Vec<(u64, u64)> = [24 * MIB, 3 * MIB, 512 << 10]
        .iter()
        .map(|&n| (a.malloc(n, 0, eager).unwrap(), n))
        .collect();
    for &(p, n) in &warm {
        a.free(p, n, 0, eager).unwrap();
    }
    a.empty_cache().unwrap();

    begin_capture(a, pool, cap);
    let graph = captured_step(a, cap, &[24 * MIB, 3 * MIB, 512 << 10, 4096]);
    pools::end(0, pool).unwrap();
    // "Replay": the graph writes its memory. Then eager work of the same sizes on another
    // stream, and empty_cache, must leave it alone.
    for &(p, n) in &graph {
        fill(p, n, 0xab);
    }
    let others: Vec<(u64, u64)> = [24 * MIB, 3 * MIB, 512 << 10, 4096, 24 * MIB]
        .iter()
        .map(|&n| (a.malloc(n, 0, eager).unwrap(), n))
        .collect();
    for &o in &others {
        for &g in &graph {
            assert!(
                !overlaps(o, g),
                "eager block {o:?} reuses the graph's memory {g:?}: the backward's temporaries \
                 were not in the graph's pool"
            );
        }
        fill(o.0, o.1, 0x11);
    }
    for &(p, n) in &others {
        a.free(p, n, 0, eager).unwrap();
    }
    let before = a.stats(0).unwrap();
    a.empty_cache().unwrap();
    for &(p, n) in &graph {
        assert!(
            holds(p, n, 0xab),
            "the graph's memory at {p:#x} changed or went back"
        );
    }
    // The pool's segments are still mapped: only the default pool's went.
    let after = a.stats(0).unwrap();
    assert!(
        after.reserved_bytes >= 8 * MIB + 24 * MIB,
        "{before:?} -> {after:?}"
    );
    a.validate(0).unwrap();
}

#[test]
fn shared_pool_keeps_its_memory_until_every_graph_is_released() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let a: &'static Allocator = Box::leak(Box::new(host()));
    let cap = 0x300;
    let pool = PoolId(2, 0);
    let mut graphs = Vec::new();
    for sizes in [&[24 * MIB, 3 * MIB][..], &[12 * MIB, MIB][..]] {
        begin_capture(a, pool, cap); // each capture into the shared pool takes a use
        graphs.push(captured_step(a, cap, sizes));
        pools::end(0, pool).unwrap();
    }
    let second = graphs.pop().unwrap();
    for &(p, n) in &second {
        fill(p, n, 0x5a);
    }
    // The first graph is deleted: PyTorch releases the pool once.
    let s0 = a.stats(0).unwrap();
    a.release_pool(0, pool).unwrap();
    a.empty_cache().unwrap();
    let s1 = a.stats(0).unwrap();
    assert_eq!(
        s1.physical_releases, s0.physical_releases,
        "the shared pool gave memory back while a graph still replays into it"
    );
    for &(p, n) in &second {
        assert!(
            holds(p, n, 0x5a),
            "the second graph's memory at {p:#x} changed"
        );
    }
    a.validate(0).unwrap();
    // The last graph deleted: its outputs (the forward buffers) are freed by their owner, and
    // the pool's memory goes.
    for g in graphs.iter().chain([&second]) {
        let (p, n) = g[0];
        a.free(p, n, 0, cap).unwrap();
    }
    a.release_pool(0, pool).unwrap();
    let s2 = a.stats(0).unwrap();
    assert!(
        s2.physical_releases > s1.physical_releases,
        "{s1:?} -> {s2:?}"
    );
    a.validate(0).unwrap();
    // Other pools and the default one serve as before.
    let p = a.malloc_in(4096, 0, cap, DEFAULT_POOL).unwrap();
    a.free(p, 4096, 0, cap).unwrap();
}
