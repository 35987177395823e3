//! Peer grants (device_heap/peers.rs, `Allocator::grant_peer_access`, `symm_grant_peer_access`)
//! on host memory: a grant reaches every chunk of the heap now and every chunk mapped later (a
//! new segment, a segment grown in place, segments made again after a trim or `empty_cache`),
//! once per chunk and peer; a grant for a heap not made yet makes none; bad device or peer
//! numbers are named and change nothing; a grant that fails part way leaves every allocation as
//! it was and a retry finishes it; a new chunk that cannot be granted is not kept. The host
//! backend's grants are bookkeeping: a recording backend here counts the calls that are
//! `cuMemSetAccess` on CUDA, and the heap's validator checks every chunk carries every grant.
//! (Copies and kernels across two real GPUs are a multi-GPU check, not run here.)

mod common;
use common::{check_host, err, fill_host};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use symmalloc::error::{Error, Result, Status};
use symmalloc::heap::backend::{Backend, Phys, Stream};
use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::pools::{PoolId, DEFAULT_POOL};
use symmalloc::heap::Allocator;

const MIB: u64 = 1 << 20;
const POOL: PoolId = PoolId(7, 1);
const S: Stream = 0x10;

/// A grant as the backend saw it: (device, peer, address, size).
type Grant = (i32, i32, u64, u64);

/// Host memory that records every grant (device, peer, address, size) and fails the grant
/// that finds `fail_in` at 1 (counting down at each grant; 0 or less: never).
#[derive(Clone, Default)]
struct Recorder {
    grants: Arc<Mutex<Vec<Grant>>>,
    fail_in: Arc<AtomicI64>,
}

impl Recorder {
    fn calls(&self) -> Vec<Grant> {
        self.grants.lock().unwrap().clone()
    }
    fn fail_at(&self, n: i64) {
        self.fail_in.store(n, Ordering::SeqCst);
    }
}

struct RecordingBackend {
    host: HostBackend,
    rec: Recorder,
}

impl Backend for RecordingBackend {
    fn name(&self) -> &'static str {
        "host-recording"
    }
    fn device_count(&self) -> Result<i32> {
        self.host.device_count()
    }
    fn granularity(&self, device: i32) -> Result<u64> {
        self.host.granularity(device)
    }
    fn default_heap_size(&self, device: i32) -> Result<u64> {
        self.host.default_heap_size(device)
    }
    fn reserve(&self, device: i32, size: u64) -> Result<u64> {
        self.host.reserve(device, size)
    }
    fn unreserve(&self, device: i32, base: u64, size: u64) -> Result<()> {
        self.host.unreserve(device, base, size)
    }
    fn create(&self, device: i32, size: u64) -> Result<Phys> {
        self.host.create(device, size)
    }
    fn map(&self, device: i32, addr: u64, size: u64, phys: &Phys) -> Result<()> {
        self.host.map(device, addr, size, phys)
    }
    fn unmap(&self, device: i32, addr: u64, size: u64) -> Result<()> {
        self.host.unmap(device, addr, size)
    }
    fn check_peer(&self, device: i32, peer: i32) -> Result<()> {
        self.host.check_peer(device, peer)
    }
    fn grant(&self, device: i32, peer: i32, addr: u64, size: u64) -> Result<()> {
        if self.rec.fail_in.fetch_sub(1, Ordering::SeqCst) == 1 {
            return Err(Error::new(
                Status::ErrCuda,
                "injected cuMemSetAccess failure",
            ));
        }
        self.host.grant(device, peer, addr, size)?;
        self.rec
            .grants
            .lock()
            .unwrap()
            .push((device, peer, addr, size));
        Ok(())
    }
    fn release(&self, phys: Phys) -> Result<()> {
        self.host.release(phys)
    }
    fn export(&self, device: i32, phys: &Phys) -> Result<OwnedFd> {
        self.host.export(device, phys)
    }
    fn import(&self, device: i32, fd: OwnedFd) -> Result<Phys> {
        self.host.import(device, fd)
    }
    fn free_bytes(&self, device: i32) -> Option<u64> {
        self.host.free_bytes(device)
    }
    fn order(&self, device: i32, waiter: Stream, on: Stream) -> Result<()> {
        self.host.order(device, waiter, on)
    }
    fn is_capturing(&self, device: i32, stream: Stream) -> Result<bool> {
        self.host.is_capturing(device, stream)
    }
    fn synchronize(&self, device: i32) -> Result<()> {
        self.host.synchronize(device)
    }
}

fn recording() -> (Allocator, Recorder) {
    let rec = Recorder::default();
    let be = RecordingBackend {
        host: HostBackend,
        rec: rec.clone(),
    };
    (Allocator::new(Box::new(be)).unwrap(), rec)
}

/// The peers each chunk of the segment holding `ptr` (device `d`) was granted to.
fn grants(a: &Allocator, d: i32, ptr: u64) -> Vec<Vec<i32>> {
    a.heap(d)
        .unwrap()
        .chunk_grants(ptr)
        .expect("ptr is in a segment")
}

/// (address, size) of the segment holding `ptr` on device `d`.
fn segment(a: &Allocator, d: i32, ptr: u64) -> (u64, u64) {
    let (off, size, _) = a.segment_span(d, ptr).unwrap().expect("in a segment");
    (a.heap(d).unwrap().base() + off, size)
}

#[test]
fn a_grant_before_the_heap_exists_makes_none_and_reaches_its_first_segment() {
    let (a, rec) = recording();
    a.grant_peer_access(3, 1).unwrap();
    a.grant_peer_access(3, 1).unwrap();
    assert!(!a.has_heap(3), "the grant made a heap on an unused device");
    assert!(!a.has_heap(1), "the grant made a heap on the peer");
    assert_eq!(a.peers_of(3).unwrap(), vec![1]);
    assert!(rec.calls().is_empty(), "nothing to map yet");
    let x = a.malloc_in(MIB, 3, S, DEFAULT_POOL).unwrap();
    assert_eq!(grants(&a, 3, x), vec![vec![1]]);
    let (addr, size) = segment(&a, 3, x);
    assert_eq!(rec.calls(), vec![(3, 1, addr, size)]);
    assert_eq!(a.heap(3).unwrap().peers(), &[1]);
    a.validate(3).unwrap();
    assert!(!a.has_heap(1));
}

#[test]
fn a_grant_reaches_every_present_segment_once_and_is_idempotent() {
    let (a, rec) = recording();
    // A small, a large, a huge segment and one of a private pool; a heap with no grant yet.
    let blocks = [
        (a.malloc_in(4096, 0, S, DEFAULT_POOL).unwrap(), 4096),
        (a.malloc_in(3 * MIB, 0, S, DEFAULT_POOL).unwrap(), 3 * MIB),
        (a.malloc_in(30 * MIB, 0, S, DEFAULT_POOL).unwrap(), 30 * MIB),
        (a.malloc_in(5 * MIB, 0, S, POOL).unwrap(), 5 * MIB),
    ];
    for (i, &(p, n)) in blocks.iter().enumerate() {
        fill_host(p, n, i as u8 + 1);
        assert_eq!(grants(&a, 0, p), vec![Vec::<i32>::new()]);
    }
    a.validate(0).unwrap();
    a.grant_peer_access(0, 2).unwrap();
    let mut want: Vec<_> = blocks
        .iter()
        .map(|&(p, _)| {
            let (addr, size) = segment(&a, 0, p);
            (0, 2, addr, size)
        })
        .collect();
    want.sort();
    let mut got = rec.calls();
    got.sort();
    assert_eq!(got, want, "one grant per segment");
    for &(p, _) in &blocks {
        assert_eq!(grants(&a, 0, p), vec![vec![2]]);
    }
    // Again, and to the device itself: nothing more.
    a.grant_peer_access(0, 2).unwrap();
    a.grant_peer_access(0, 0).unwrap();
    assert_eq!(rec.calls().len(), 4);
    assert_eq!(a.peers_of(0).unwrap(), vec![2]);
    // A second peer joins the first on every chunk.
    a.grant_peer_access(0, 5).unwrap();
    assert_eq!(rec.calls().len(), 8);
    for (i, &(p, n)) in blocks.iter().enumerate() {
        assert_eq!(grants(&a, 0, p), vec![vec![2, 5]]);
        check_host(p, n, i as u8 + 1);
    }
    assert_eq!(a.peers_of(0).unwrap(), vec![2, 5]);
    a.validate(0).unwrap();
    // A new segment after the grants carries both.
    let q = a.malloc_in(40 * MIB, 0, S, DEFAULT_POOL).unwrap();
    assert_eq!(grants(&a, 0, q), vec![vec![2, 5]]);
    let (addr, size) = segment(&a, 0, q);
    assert_eq!(
        rec.calls()[8..].to_vec(),
        vec![(0, 2, addr, size), (0, 5, addr, size)]
    );
    a.validate(0).unwrap();
}

#[test]
fn a_segment_grown_in_place_maps_its_new_chunk_for_every_peer() {
    let (a, rec) = recording();
    let x = a.malloc_in(3 * MIB, 0, S, POOL).unwrap();
    a.grant_peer_access(0, 1).unwrap();
    a.grant_peer_access(0, 4).unwrap();
    assert_eq!(rec.calls().len(), 2);
    // 30 MiB more: the 20 MiB segment grows in place by 14 MiB (heap_grow.rs).
    let y = a.malloc_in(30 * MIB, 0, S, POOL).unwrap();
    assert_eq!(a.heap(0).unwrap().grown_in_place(), 1);
    assert_eq!(grants(&a, 0, y), vec![vec![1, 4], vec![1, 4]]);
    let (addr, size) = segment(&a, 0, x);
    assert_eq!(size, 34 * MIB);
    let chunk = (addr + 20 * MIB, 14 * MIB);
    assert_eq!(
        rec.calls()[2..].to_vec(),
        vec![(0, 1, chunk.0, chunk.1), (0, 4, chunk.0, chunk.1)]
    );
    a.validate(0).unwrap();
    // A peer granted after the growth reaches both chunks.
    a.grant_peer_access(0, 6).unwrap();
    assert_eq!(grants(&a, 0, y), vec![vec![1, 4, 6], vec![1, 4, 6]]);
    assert_eq!(rec.calls().len(), 6);
    a.validate(0).unwrap();
}

#[test]
fn segments_made_again_after_a_trim_or_empty_cache_are_granted() {
    let (a, _rec) = recording();
    a.grant_peer_access(0, 1).unwrap();
    let dp = DEFAULT_POOL;
    // heap_trim.rs's first case: the 24 MiB idle segment goes back before a 30 MiB one is made.
    let live = a.malloc_in(100 * MIB, 0, S, dp).unwrap();
    let x = a.malloc_in(20 * MIB, 0, S, dp).unwrap();
    let y = a.malloc_in(24 * MIB, 0, S, dp).unwrap();
    let w = a.malloc_in(56 * MIB, 0, S, dp).unwrap();
    a.free(x, 20 * MIB, 0, S).unwrap();
    a.free(y, 24 * MIB, 0, S).unwrap();
    let released = a.stats(0).unwrap().physical_releases;
    let z = a.malloc_in(30 * MIB, 0, S, dp).unwrap();
    assert_eq!(
        a.stats(0).unwrap().physical_releases,
        released + 1,
        "trimmed"
    );
    assert_eq!(grants(&a, 0, z), vec![vec![1]]);
    a.validate(0).unwrap();
    for (p, n) in [(w, 56 * MIB), (z, 30 * MIB), (live, 100 * MIB)] {
        a.free(p, n, 0, S).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes, 0);
    // Every segment made again carries the grant.
    for n in [4096, 3 * MIB, 64 * MIB] {
        let p = a.malloc_in(n, 0, S, dp).unwrap();
        assert_eq!(grants(&a, 0, p), vec![vec![1]], "{n} bytes");
    }
    assert_eq!(a.peers_of(0).unwrap(), vec![1]);
    a.validate(0).unwrap();
}

#[test]
fn bad_device_or_peer_numbers_are_named_and_change_nothing() {
    let (a, rec) = recording();
    let p = a.malloc_in(3 * MIB, 0, S, DEFAULT_POOL).unwrap();
    fill_host(p, 3 * MIB, 0xa5);
    for (device, peer, named) in [
        (8, 0, "device 8 does not exist; expected 0..8"),
        (-1, 0, "device -1 does not exist"),
        (0, 8, "peer 8 does not exist; expected 0..8"),
        (0, -3, "peer -3 does not exist"),
        (i32::MAX, i32::MIN, "device 2147483647 does not exist"),
    ] {
        let e = a.grant_peer_access(device, peer).unwrap_err();
        assert_eq!(e.status, Status::ErrInvalidArgument, "{e}");
        assert!(e.message.contains(named), "{e}");
    }
    assert!(rec.calls().is_empty());
    assert_eq!(a.peers_of(0).unwrap(), Vec::<i32>::new());
    assert_eq!(grants(&a, 0, p), vec![Vec::<i32>::new()]);
    for d in 1..8 {
        assert!(!a.has_heap(d), "a bad grant made a heap on device {d}");
        assert_eq!(a.peers_of(d).unwrap(), Vec::<i32>::new());
    }
    check_host(p, 3 * MIB, 0xa5);
    a.validate(0).unwrap();
    a.free(p, 3 * MIB, 0, S).unwrap();
    a.validate(0).unwrap();
}

#[test]
fn a_grant_that_fails_part_way_changes_no_allocation_and_a_retry_finishes_it() {
    let (a, rec) = recording();
    let blocks = [
        (a.malloc_in(3 * MIB, 0, S, DEFAULT_POOL).unwrap(), 3 * MIB),
        (a.malloc_in(30 * MIB, 0, S, DEFAULT_POOL).unwrap(), 30 * MIB),
        (a.malloc_in(4096, 0, S, DEFAULT_POOL).unwrap(), 4096),
    ];
    for (i, &(p, n)) in blocks.iter().enumerate() {
        fill_host(p, n, 0x30 + i as u8);
    }
    let before = a.stats(0).unwrap();
    rec.fail_at(2); // the second chunk's grant fails
    let e = a.grant_peer_access(0, 1).unwrap_err();
    assert_eq!(e.status, Status::ErrCuda, "{e}");
    assert!(e.message.contains("injected"), "{e}");
    assert_eq!(a.peers_of(0).unwrap(), Vec::<i32>::new(), "not a peer");
    assert_eq!(rec.calls().len(), 1, "the first chunk was granted");
    let granted: usize = blocks
        .iter()
        .filter(|&&(p, _)| grants(&a, 0, p) == vec![vec![1]])
        .count();
    assert_eq!(granted, 1);
    let after = a.stats(0).unwrap();
    assert_eq!(
        (after.reserved_bytes, after.allocated_bytes, after.segments),
        (
            before.reserved_bytes,
            before.allocated_bytes,
            before.segments
        )
    );
    for (i, &(p, n)) in blocks.iter().enumerate() {
        check_host(p, n, 0x30 + i as u8);
    }
    a.validate(0).unwrap();
    // The retry grants the two chunks left, not the first again.
    a.grant_peer_access(0, 1).unwrap();
    assert_eq!(rec.calls().len(), 3);
    for &(p, _) in &blocks {
        assert_eq!(grants(&a, 0, p), vec![vec![1]]);
    }
    assert_eq!(a.peers_of(0).unwrap(), vec![1]);
    a.validate(0).unwrap();
}

#[test]
fn a_new_chunk_that_cannot_be_granted_is_not_kept() {
    let (a, rec) = recording();
    let keep = a.malloc_in(3 * MIB, 0, S, DEFAULT_POOL).unwrap();
    fill_host(keep, 3 * MIB, 0x77);
    a.grant_peer_access(0, 2).unwrap();
    let before = a.stats(0).unwrap();
    rec.fail_at(1);
    let e = a.malloc_in(64 * MIB, 0, S, DEFAULT_POOL).unwrap_err();
    assert_eq!(e.status, Status::ErrCuda, "{e}");
    let after = a.stats(0).unwrap();
    assert_eq!(
        (after.reserved_bytes, after.segments, after.allocated_bytes),
        (
            before.reserved_bytes,
            before.segments,
            before.allocated_bytes
        ),
        "the chunk went back"
    );
    a.validate(0).unwrap();
    check_host(keep, 3 * MIB, 0x77);
    // The same request succeeds once grants do.
    let p = a.malloc_in(64 * MIB, 0, S, DEFAULT_POOL).unwrap();
    assert_eq!(grants(&a, 0, p), vec![vec![2]]);
    fill_host(p, 64 * MIB, 0x11);
    a.validate(0).unwrap();
}

/// The C entry point over the process's allocator (host backend): arguments named in
/// `symm_last_error()`, no heap made for a grant, and the grant reaching the heap made later.
#[test]
fn the_c_entry_point_names_bad_numbers_and_makes_no_heap() {
    // SAFETY: the only test of this binary that uses the process's allocator, and it sets the
    // variable before its first call.
    unsafe { std::env::set_var("SYMMALLOC_BACKEND", "host") };
    use symmalloc::ffi::types::symm_status_t::*;
    use symmalloc::ffi::{peer_access::symm_grant_peer_access, symm_free, symm_malloc};
    let w = symm_malloc(8192, 0, std::ptr::null_mut()) as u64;
    assert_ne!(w, 0, "{}", err());
    fill_host(w, 8192, 0x5c);
    assert_eq!(symm_grant_peer_access(6, 0), SYMM_SUCCESS, "{}", err());
    assert_eq!(err(), "");
    let g = symmalloc::heap::global().unwrap();
    assert!(!g.has_heap(6), "the grant made a heap on device 6");
    assert_eq!(g.peers_of(6).unwrap(), vec![0]);
    for (device, peer, named) in [(99, 0, "device 99"), (0, 99, "peer 99"), (0, -1, "peer -1")] {
        assert_eq!(
            symm_grant_peer_access(device, peer),
            SYMM_ERR_INVALID_ARGUMENT
        );
        let e = err();
        assert!(
            e.contains("SYMM_ERR_INVALID_ARGUMENT")
                && e.contains(&format!(
                    "symm_grant_peer_access(device={device}, peer={peer})"
                ))
                && e.contains(named),
            "{e}"
        );
    }
    check_host(w, 8192, 0x5c);
    assert_eq!(symm_grant_peer_access(0, 3), SYMM_SUCCESS, "{}", err());
    assert_eq!(grants(g, 0, w), vec![vec![3]]);
    let p = symm_malloc(4096, 6, std::ptr::null_mut()) as u64;
    assert_ne!(p, 0, "{}", err());
    assert_eq!(grants(g, 6, p), vec![vec![0]]);
    g.validate(6).unwrap();
    g.validate(0).unwrap();
    symm_free(p as *mut _, 4096, 6, std::ptr::null_mut());
    symm_free(w as *mut _, 8192, 0, std::ptr::null_mut());
    assert_eq!(err(), "");
}
