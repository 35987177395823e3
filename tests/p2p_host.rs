//! Symmetric memory you program yourself, on the host backend (CI, no GPU), through the C ABI:
//! rendezvous and peer views, `symm_comm_device`, put/signal/wait ordering around a ring, a slot
//! reused 10^4 times, a wait on a dead peer (bounded, naming slot and peer), and every bad input
//! (pointer outside the heap, range not rendezvoused, peer out of range, slot past
//! the pad, a put leaving the range, asymmetric rendezvous on every rank, segments released
//! after the rendezvous), each leaving the communicator usable.

use crate::common;
use common::*;
use std::ffi::c_void;
use std::ptr::null_mut;
use symmalloc::comm::device_comm::*;
use symmalloc::ffi::p2p::*;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

const OK: symm_status_t = symm_status_t::SYMM_SUCCESS;
const INVALID: symm_status_t = symm_status_t::SYMM_ERR_INVALID_ARGUMENT;

fn ok(st: symm_status_t, c: &Child, what: &str) {
    assert_eq!(st, OK, "rank {} {what}: {}", c.rank, err());
}

fn refused(st: symm_status_t, want: symm_status_t, needle: &str, c: &Child, what: &str) {
    let e = err();
    assert_eq!(st, want, "rank {} {what}: {e}", c.rank);
    assert!(
        e.contains(needle),
        "rank {} {what}: {e:?} lacks {needle:?}",
        c.rank
    );
}

fn barrier(comm: *mut symm_comm_t, c: &Child) {
    ok(symm_barrier(comm, null_mut()), c, "barrier");
}

fn peer_ptr(comm: *mut symm_comm_t, p: *mut c_void, peer: i32) -> (symm_status_t, u64) {
    let mut out: *mut c_void = 1 as _;
    let st = symm_peer_ptr(comm, p, peer, &mut out);
    (st, out as u64)
}

fn device_view(comm: *mut symm_comm_t, c: &Child) -> DeviceComm {
    let mut d = DeviceComm::default();
    ok(
        symm_comm_device(comm, &mut d, std::mem::size_of::<DeviceComm>()),
        c,
        "symm_comm_device",
    );
    d
}

/// A checked all-reduce: the communicator still works.
fn still_usable(comm: *mut symm_comm_t, c: &Child) {
    let n = 256;
    let p = symm_malloc(n * 4, c.device, null_mut()) as *mut f32;
    // SAFETY: p holds n floats of host memory (host backend).
    unsafe { (0..n).for_each(|i| p.add(i).write(c.rank as f32 + i as f32)) };
    ok(
        symm_all_reduce(comm, p as _, p as _, n, SYMM_FP32, SYMM_SUM, null_mut()),
        c,
        "all-reduce after the refusals",
    );
    let base: f32 = (0..c.world).map(|r| r as f32).sum();
    for i in 0..n {
        // SAFETY: as above.
        let v = unsafe { p.add(i).read() };
        assert_eq!(v, base + (c.world as f32) * i as f32, "element {i}");
    }
    symm_free(p as _, n * 4, c.device, null_mut());
}

/// Rendezvous, then every rank reads every peer's data through its peer pointer, and the
/// device view agrees with the peer pointers.
fn views(c: &Child, comm: *mut symm_comm_t) {
    let n = 3000usize; // 12000 bytes: not a whole number of pages
    let p = symm_malloc(n * 4, c.device, null_mut()) as *mut f32;
    // SAFETY: n floats of host memory.
    unsafe { (0..n).for_each(|i| p.add(i).write(input(7, c.rank, i))) };
    ok(symm_rendezvous(comm, p as _, n * 4), c, "rendezvous");
    ok(
        symm_rendezvous(comm, p as _, n * 4),
        c,
        "rendezvous again (idempotent)",
    );
    barrier(comm, c);
    let d = device_view(comm, c);
    assert_eq!((d.world, d.rank), (c.world, c.rank));
    assert_eq!(d.version, SYMM_DEVICE_COMM_VERSION);
    assert_eq!(d.struct_size, SYMM_DEVICE_COMM_V1_SIZE as u64);
    assert_eq!(d.signal_slots, SYMM_SIGNAL_SLOTS);
    let own = d.heap_bases[c.rank as usize];
    let heap_bytes = stats(c.device).heap_bytes;
    assert!(
        own <= p as u64 && (p as u64) < own + heap_bytes,
        "own heap base {own:#x}"
    );
    assert!(d.heap_bases[c.world as usize..].iter().all(|&b| b == 0));
    assert!(d.signal_pads[..c.world as usize].iter().all(|&b| b != 0));
    assert!(d.timeout_ns > 0 && d.abort_word != 0);
    for r in 0..c.world {
        let (st, q) = peer_ptr(comm, p as _, r);
        ok(st, c, "peer_ptr");
        // The device helpers' formula gives the same address.
        assert_eq!(
            q,
            d.heap_bases[r as usize] + (p as u64 - d.heap_bases[c.rank as usize])
        );
        if r == c.rank {
            assert_eq!(q, p as u64);
        }
        for i in (0..n).step_by(97).chain([n - 1]) {
            // SAFETY: q is rank r's mapped buffer of n floats (peer view).
            let v = unsafe { (q as *const f32).add(i).read_volatile() };
            assert_eq!(
                v,
                input(7, r, i),
                "rank {r} element {i} through the peer view"
            );
        }
        // The last byte of the range works; one past it does not.
        let (st, _) = peer_ptr(comm, (p as u64 + n as u64 * 4 - 1) as _, r);
        ok(st, c, "peer_ptr of the last byte");
    }
    barrier(comm, c);
    symm_free(p as _, n * 4, c.device, null_mut());
}

#[test]
fn rendezvous_gives_peer_views_and_the_device_view() {
    if let Some(c) = child() {
        let comm = init(&c);
        views(&c, comm);
        destroy(comm);
        return;
    }
    for world in [1, 2, 3] {
        assert_all_ok(&run_ranks(
            "rendezvous_gives_peer_views_and_the_device_view",
            world,
            &[HOST],
            "",
        ));
    }
}

/// Around a ring, 200 rounds: rank r puts fresh data into rank r+1's buffer (slice r), signals
/// slot r with the round; r+1 waits for it, checks every element, and acknowledges on slot 64 +
/// r+1 before r may overwrite the data.
fn ring(c: &Child, comm: *mut symm_comm_t) {
    let (w, me) = (c.world as usize, c.rank as usize);
    let n = 4099usize;
    let bytes = n * 4 * w;
    let buf = symm_malloc(bytes, c.device, null_mut()) as *mut f32;
    ok(symm_rendezvous(comm, buf as _, bytes), c, "rendezvous");
    let (next, prev) = ((me + 1) % w, (me + w - 1) % w);
    let mut mine = vec![0f32; n];
    for round in 1..=200u64 {
        mine.iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = input(round, me as i32, i));
        // SAFETY: slice `me` of buf holds n floats.
        let dst = unsafe { buf.add(me * n) };
        let st = symm_put(
            comm,
            next as i32,
            dst as _,
            mine.as_ptr() as _,
            n * 4,
            null_mut(),
        );
        ok(st, c, "put");
        ok(
            symm_signal(comm, next as i32, me as u32, round, null_mut()),
            c,
            "signal",
        );
        ok(symm_wait(comm, prev as u32, round, null_mut()), c, "wait");
        for i in 0..n {
            // SAFETY: slice `prev` of this rank's own buffer, written by prev's put.
            let v = unsafe { buf.add(prev * n + i).read_volatile() };
            assert_eq!(v, input(round, prev as i32, i), "round {round} element {i}");
        }
        ok(
            symm_signal(comm, prev as i32, 64 + me as u32, round, null_mut()),
            c,
            "ack",
        );
        ok(
            symm_wait(comm, 64 + next as u32, round, null_mut()),
            c,
            "wait for the ack",
        );
    }
    barrier(comm, c);
    symm_free(buf as _, bytes, c.device, null_mut());
}

#[test]
fn put_signal_wait_keep_their_order_around_a_ring() {
    if let Some(c) = child() {
        let comm = init(&c);
        ring(&c, comm);
        destroy(comm);
        return;
    }
    for world in [2, 3] {
        assert_all_ok(&run_ranks(
            "put_signal_wait_keep_their_order_around_a_ring",
            world,
            &[HOST],
            "",
        ));
    }
}

#[test]
fn a_slot_reused_ten_thousand_times() {
    if let Some(c) = child() {
        let comm = init(&c);
        let word = symm_malloc(8, c.device, null_mut()) as *mut u64;
        ok(symm_rendezvous(comm, word as _, 8), &c, "rendezvous");
        for k in 1..=10_000u64 {
            if c.rank == 0 {
                let st = symm_put(comm, 1, word as _, &k as *const u64 as _, 8, null_mut());
                ok(st, &c, "put");
                ok(symm_signal(comm, 1, 7, k, null_mut()), &c, "signal");
                ok(symm_wait(comm, 8, k, null_mut()), &c, "wait");
            } else {
                ok(symm_wait(comm, 7, k, null_mut()), &c, "wait");
                // SAFETY: the 8-byte word rank 0 put into before its signal.
                assert_eq!(unsafe { word.read_volatile() }, k, "use {k} of slot 7");
                ok(symm_signal(comm, 0, 8, k, null_mut()), &c, "signal");
            }
        }
        println!("rank {}: slot 7 and 8 reused 10000 times", c.rank);
        destroy(comm);
        return;
    }
    let outs = run_ranks("a_slot_reused_ten_thousand_times", 2, &[HOST], "");
    assert_all_ok(&outs);
    for o in &outs {
        let s = String::from_utf8_lossy(&o.stdout);
        assert!(s.contains("reused 10000 times"), "{s}");
    }
}

#[test]
fn a_wait_on_a_dead_peer_times_out_naming_slot_and_peer() {
    if let Some(c) = child() {
        let comm = init(&c);
        if c.rank == 1 {
            ok(symm_signal(comm, 0, 5, 1, null_mut()), &c, "signal");
            // Dies: no destroy, no exit handlers.
            // SAFETY: ends this process at once.
            unsafe { libc::_exit(0) };
        }
        ok(
            symm_wait(comm, 5, 1, null_mut()),
            &c,
            "the signal that came",
        );
        let t0 = std::time::Instant::now();
        let st = symm_wait(comm, 5, 2, null_mut());
        let took = t0.elapsed();
        refused(
            st,
            symm_status_t::SYMM_ERR_TIMEOUT,
            "signal slot 5 stayed at 1, below the awaited 2",
            &c,
            "wait on the dead peer",
        );
        assert!(err().contains("rank 1 raised it last"), "{}", err());
        assert!(took.as_secs_f64() < 5.0, "the wait took {took:?}");
        // The communicator is broken: the next call says so again.
        let st = symm_signal(comm, 0, 1, 1, null_mut());
        refused(
            st,
            symm_status_t::SYMM_ERR_TIMEOUT,
            "signal slot 5",
            &c,
            "next call",
        );
        destroy(comm);
        return;
    }
    let outs = run_ranks(
        "a_wait_on_a_dead_peer_times_out_naming_slot_and_peer",
        2,
        &[HOST, ("SYMMALLOC_TIMEOUT_S", "1")],
        "",
    );
    assert_all_ok(&outs);
}

fn bad_inputs(c: &Child, comm: *mut symm_comm_t) {
    let n = 1024usize;
    let p = symm_malloc(n * 4, c.device, null_mut()) as *mut f32;
    let q = symm_malloc(n * 4, c.device, null_mut()) as *mut f32;
    let outside = vec![0f32; n];
    let w = c.world;

    // Before any rendezvous: refused, not a fault.
    let (st, out) = peer_ptr(comm, p as _, 0);
    refused(
        st,
        INVALID,
        "not in a range rendezvoused",
        c,
        "peer_ptr before rendezvous",
    );
    assert_eq!(out, 0, "a refused peer_ptr leaves NULL");
    ok(symm_rendezvous(comm, p as _, n * 4), c, "rendezvous");
    // A pointer outside the heap, named.
    let (st, _) = peer_ptr(comm, outside.as_ptr() as _, 0);
    let name = format!("{:#x}", outside.as_ptr() as u64);
    refused(st, INVALID, &name, c, "peer_ptr outside the heap");
    assert!(err().contains("outside the symmetric heap"), "{}", err());
    // A range of the heap never rendezvoused.
    let (st, _) = peer_ptr(comm, q as _, 0);
    refused(
        st,
        INVALID,
        "not in a range rendezvoused",
        c,
        "peer_ptr of q",
    );
    let st = symm_put(comm, 0, q as _, outside.as_ptr() as _, 4, null_mut());
    refused(st, INVALID, "not in a range rendezvoused", c, "put into q");
    // Peers out of range.
    for peer in [-1, w, 1000] {
        let (st, _) = peer_ptr(comm, p as _, peer);
        refused(
            st,
            INVALID,
            &format!("peer {peer} is out of range"),
            c,
            "peer_ptr",
        );
        let st = symm_put(comm, peer, p as _, outside.as_ptr() as _, 4, null_mut());
        refused(
            st,
            INVALID,
            &format!("peer {peer} is out of range"),
            c,
            "put",
        );
        let st = symm_signal(comm, peer, 0, 1, null_mut());
        refused(
            st,
            INVALID,
            &format!("peer {peer} is out of range"),
            c,
            "signal",
        );
    }
    // Slots past the pad.
    for slot in [SYMM_SIGNAL_SLOTS, u32::MAX] {
        let st = symm_signal(comm, 0, slot, 1, null_mut());
        refused(
            st,
            INVALID,
            &format!("slot {slot} is past the signal pad"),
            c,
            "signal",
        );
        let st = symm_wait(comm, slot, 1, null_mut());
        refused(
            st,
            INVALID,
            &format!("slot {slot} is past the signal pad"),
            c,
            "wait",
        );
    }
    // A put whose destination leaves the rendezvoused range (and the peer's mapped segments).
    let last = w - 1;
    let st = symm_put(
        comm,
        last,
        p as _,
        outside.as_ptr() as _,
        n * 4 + 4,
        null_mut(),
    );
    refused(
        st,
        INVALID,
        "leaves the rendezvoused range",
        c,
        "put past the end",
    );
    // SAFETY: p + n - 1 is the last float of p's block.
    let tail = unsafe { p.add(n - 1) };
    let st = symm_put(comm, last, tail as _, outside.as_ptr() as _, 8, null_mut());
    refused(
        st,
        INVALID,
        "leaves the rendezvoused range",
        c,
        "put across the end",
    );
    let st = symm_put(comm, last, p as _, null_mut(), 4, null_mut());
    refused(st, INVALID, "src is NULL", c, "put from NULL");
    ok(
        symm_put(comm, last, p as _, null_mut(), 0, null_mut()),
        c,
        "a put of 0 bytes",
    );
    // Rendezvous of a range that is not all allocated: refused on this rank (INVALID, named)
    // and NOT_SYMMETRIC on the others, whichever rank passed it.
    let bad_rank = w - 1;
    let (ptr, len) = if c.rank == bad_rank {
        (outside.as_ptr() as *const c_void, n * 4)
    } else {
        (p as *const c_void, n * 4)
    };
    let st = symm_rendezvous(comm, ptr, len);
    if c.rank == bad_rank {
        refused(
            st,
            INVALID,
            "not inside the symmetric heap",
            c,
            "rendezvous outside",
        );
    } else {
        refused(
            st,
            symm_status_t::SYMM_ERR_NOT_SYMMETRIC,
            "passed an invalid range",
            c,
            "rendezvous against an invalid rank",
        );
    }
    // Other offsets on one rank: NOT_SYMMETRIC on every rank, naming the ranks.
    let st = if c.rank == 0 {
        // SAFETY: p + 128 lies inside p's block.
        symm_rendezvous(comm, unsafe { p.add(128) } as _, 512)
    } else {
        symm_rendezvous(comm, p as _, 512)
    };
    refused(
        st,
        symm_status_t::SYMM_ERR_NOT_SYMMETRIC,
        "rank 0",
        c,
        "asymmetric offsets",
    );
    // Other sizes on one rank.
    let st = symm_rendezvous(comm, p as _, if c.rank == 0 { 1024 } else { 2048 });
    refused(
        st,
        symm_status_t::SYMM_ERR_NOT_SYMMETRIC,
        "every rank",
        c,
        "asymmetric sizes",
    );
    // 0 bytes, and a range running past the block's end into unallocated memory.
    let st = symm_rendezvous(comm, p as _, 0);
    refused(st, INVALID, "bytes is 0", c, "rendezvous of 0 bytes");
    // The device view: bad sizes and NULL are refused and write nothing.
    let mut d = DeviceComm::default();
    for size in [
        0,
        8,
        SYMM_DEVICE_COMM_V1_SIZE - 8,
        SYMM_DEVICE_COMM_V1_SIZE + 4,
        4096,
    ] {
        let st = symm_comm_device(comm, &mut d, size);
        refused(st, INVALID, &format!("size {size}"), c, "symm_comm_device");
        assert_eq!(d, DeviceComm::default(), "a refused symm_comm_device wrote");
    }
    let st = symm_comm_device(comm, null_mut(), SYMM_DEVICE_COMM_V1_SIZE);
    refused(st, INVALID, "out is NULL", c, "symm_comm_device(NULL)");
    let st = symm_peer_ptr(comm, p as _, 0, null_mut());
    refused(st, INVALID, "out is NULL", c, "peer_ptr(NULL)");
    // A stale communicator pointer.
    let st = symm_signal(1usize as _, 0, 0, 1, null_mut());
    refused(
        st,
        INVALID,
        "not a live communicator",
        c,
        "signal on a bogus comm",
    );

    // Still usable: the earlier rendezvous holds, a put and a signal work, collectives work.
    let next = (c.rank + 1) % w;
    let v = [c.rank as f32 + 0.5];
    ok(
        symm_put(comm, next, p as _, v.as_ptr() as _, 4, null_mut()),
        c,
        "put",
    );
    ok(symm_signal(comm, next, 3, 1, null_mut()), c, "signal");
    ok(symm_wait(comm, 3, 1, null_mut()), c, "wait");
    let prev = (c.rank + w - 1) % w;
    // SAFETY: p's first float, written by prev's put before its signal.
    assert_eq!(unsafe { p.read_volatile() }, prev as f32 + 0.5);
    barrier(comm, c);
    still_usable(comm, c);
    symm_free(p as _, n * 4, c.device, null_mut());
    symm_free(q as _, n * 4, c.device, null_mut());
}

#[test]
fn bad_inputs_are_refused_and_leave_the_communicator_usable() {
    if let Some(c) = child() {
        let comm = init(&c);
        bad_inputs(&c, comm);
        destroy(comm);
        return;
    }
    for world in [2, 3] {
        assert_all_ok(&run_ranks(
            "bad_inputs_are_refused_and_leave_the_communicator_usable",
            world,
            &[HOST],
            "",
        ));
    }
}

/// A segment given back after the rendezvous: by every rank (the range's own segment is gone)
/// and by the peer alone (its release log says so); the peer pointers are refused, never
/// dangling, and a new rendezvous of new memory works.
fn released(c: &Child, comm: *mut symm_comm_t) {
    let big = 12usize << 20; // a segment of its own
    let p = symm_malloc(big, c.device, null_mut());
    ok(symm_rendezvous(comm, p, big), c, "rendezvous");
    let peer = 1 - c.rank;
    let (st, q) = peer_ptr(comm, p, peer);
    ok(st, c, "peer_ptr");
    // SAFETY: rank `peer`'s mapped 12 MiB.
    unsafe { (q as *const u8).read_volatile() };
    barrier(comm, c);
    // Rank 1 alone releases its segment.
    if c.rank == 1 {
        symm_free(p, big, c.device, null_mut());
        symm_empty_cache();
    }
    barrier(comm, c);
    if c.rank == 0 {
        let (st, out) = peer_ptr(comm, p, 1);
        refused(
            st,
            symm_status_t::SYMM_ERR_PEER,
            "rank 1 released its segment",
            c,
            "peer_ptr",
        );
        assert_eq!(out, 0);
        let one = [1u8];
        let st = symm_put(comm, 1, p, one.as_ptr() as _, 1, null_mut());
        refused(
            st,
            symm_status_t::SYMM_ERR_PEER,
            "rank 1 released",
            c,
            "put",
        );
        let (st, _) = peer_ptr(comm, p, 0);
        ok(st, c, "own pointer still valid");
        symm_free(p, big, c.device, null_mut());
        symm_empty_cache();
    } else {
        // This rank's own segment is gone: its pointers into it are refused for every rank.
        for r in [0, 1] {
            let (st, _) = peer_ptr(comm, p, r);
            refused(
                st,
                INVALID,
                "lost its segment",
                c,
                "peer_ptr after own release",
            );
        }
    }
    barrier(comm, c);
    // New memory, a new rendezvous: works.
    let p2 = symm_malloc(big, c.device, null_mut());
    ok(
        symm_rendezvous(comm, p2, big),
        c,
        "rendezvous of new memory",
    );
    let (st, q2) = peer_ptr(comm, p2, peer);
    ok(st, c, "peer_ptr of new memory");
    // SAFETY: the peer's new mapped 12 MiB.
    unsafe { (q2 as *mut u8).add(big - 1).write_volatile(7) };
    barrier(comm, c);
    symm_free(p2, big, c.device, null_mut());
    still_usable(comm, c);
}

#[test]
fn segments_released_after_rendezvous_refuse_their_peer_pointers() {
    if let Some(c) = child() {
        let comm = init(&c);
        released(&c, comm);
        destroy(comm);
        return;
    }
    assert_all_ok(&run_ranks(
        "segments_released_after_rendezvous_refuse_their_peer_pointers",
        2,
        &[HOST],
        "",
    ));
}
