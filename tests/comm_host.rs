//! Communicator tests with one process per rank on the host backend (real shared memory,
//! real sockets and fd passing): correctness against a float64 reference, steady state without
//! new mappings, killed ranks, asymmetric allocations, intruders, descriptors.

use crate::common;
use common::*;
use std::ptr::null_mut;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

fn correctness_rank(c: Child) {
    let comm = init(&c);
    let before = stats(c.rank);
    let seed: u64 = c.arg.parse().unwrap();
    let mut case = 0u64;
    for &count in &[1usize, 7, 8, 9, 100, 1031, 4099] {
        for (dtype, esize) in dtypes() {
            for op in [SYMM_SUM, SYMM_MAX, SYMM_MIN] {
                // (The host backend runs ONE_SHOT_LL with one-shot data movement: the API
                // path, capacity check and descriptor are the same.)
                for algo in [
                    SYMM_ALGO_AUTO,
                    SYMM_ALGO_ONE_SHOT,
                    SYMM_ALGO_TWO_SHOT,
                    SYMM_ALGO_ONE_SHOT_LL,
                ] {
                    for in_place in [true, false] {
                        case += 1;
                        let s = seed.wrapping_add(case * 7919);
                        // Offset by 2 bytes within the block: not 16-byte aligned.
                        let off = if case % 3 == 0 { esize } else { 0 };
                        let bytes = count * esize + off;
                        let a = symm_malloc(bytes, c.rank, null_mut()) as *mut u8;
                        let b = symm_malloc(bytes, c.rank, null_mut()) as *mut u8;
                        assert!(!a.is_null() && !b.is_null(), "{}", err());
                        // SAFETY: a and b are live blocks of `bytes` bytes of host memory.
                        unsafe {
                            let (send, recv) =
                                (a.add(off), if in_place { a.add(off) } else { b.add(off) });
                            std::ptr::write_bytes(b, 0xFF, bytes); // poison (NaN patterns)
                            for i in 0..count {
                                write_elem(send, dtype, i, input(s, c.rank, i));
                            }
                            if std::env::var("SYMM_TEST_DEBUG").is_ok() {
                                eprintln!("case {case} count {count} dtype {dtype} op {op} algo {algo} in_place {in_place} off {off}");
                            }
                            let st = symm_all_reduce_algo(
                                comm,
                                algo,
                                send as _,
                                recv as _,
                                count,
                                dtype,
                                op,
                                null_mut(),
                            );
                            assert_eq!(
                                st,
                                symm_status_t::SYMM_SUCCESS,
                                "rank {}: {}",
                                c.rank,
                                err()
                            );
                            let (mut num, mut den) = (0f64, 0f64);
                            for i in 0..count {
                                let vals: Vec<f64> = (0..c.world)
                                    .map(|r| rounded(dtype, input(s, r, i)))
                                    .collect();
                                let want = match op {
                                    SYMM_SUM => vals.iter().sum::<f64>(),
                                    SYMM_MAX => vals.iter().cloned().fold(f64::MIN, f64::max),
                                    _ => vals.iter().cloned().fold(f64::MAX, f64::min),
                                };
                                let got = read_elem(recv, dtype, i) as f64;
                                assert!(
                                    got.is_finite(),
                                    "rank {}: element {i} not written ({got})",
                                    c.rank
                                );
                                num += (got - want) * (got - want);
                                den += want * want;
                            }
                            let rel = (num / den.max(1e-30)).sqrt();
                            assert!(rel <= tolerance(dtype), "rank {} count {count} dtype {dtype} op {op} algo {algo} in_place {in_place}: rel err {rel}", c.rank);
                        }
                        symm_free(a as _, bytes, c.rank, null_mut());
                        symm_free(b as _, bytes, c.rank, null_mut());
                    }
                }
            }
        }
    }
    // A buffer outside the heap is staged and still correct.
    let mut outside = vec![1.5f32; 33];
    let st = symm_all_reduce(
        comm,
        outside.as_ptr() as _,
        outside.as_mut_ptr() as _,
        33,
        SYMM_FP32,
        SYMM_SUM,
        null_mut(),
    );
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    assert!(
        outside.iter().all(|&x| x == 1.5 * c.world as f32),
        "{outside:?}"
    );
    assert!(stats(c.rank).staged_collectives > before.staged_collectives);
    destroy(comm);
    println!("rank {}: {case} cases correct", c.rank);
}

#[test]
fn all_reduce_matches_reference_on_2_to_4_ranks() {
    if let Some(c) = child() {
        return correctness_rank(c);
    }
    let seed = seed();
    for world in 2..=4 {
        assert_all_ok(&run_ranks(
            "all_reduce_matches_reference_on_2_to_4_ranks",
            world,
            &[HOST],
            &seed.to_string(),
        ));
    }
}

fn steady_rank(c: Child) {
    // The heap (and its release log's descriptor) exists before counting: a read makes none, so
    // an allocation makes it, and empty_cache gives its segment's descriptor back.
    let p = symm_malloc(4096, c.rank, null_mut());
    assert!(!p.is_null(), "{}", err());
    symm_free(p, 4096, c.rank, null_mut());
    symm_empty_cache();
    assert_eq!(stats(c.rank).segments, 0);
    let fds_before = open_fds();
    let comm = init(&c);
    let iters: usize = c.arg.parse().unwrap();
    let mut warm = None;
    for it in 0..iters {
        let p = symm_malloc(4096, c.rank, null_mut());
        // SAFETY: p is 4096 bytes of host memory.
        let v = unsafe { std::slice::from_raw_parts_mut(p as *mut f32, 1024) };
        v.iter_mut().for_each(|x| *x = (c.rank + 1) as f32);
        let st = symm_all_reduce(comm, p, p, 1024, SYMM_FP32, SYMM_SUM, null_mut());
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
        let want = (c.world * (c.world + 1) / 2) as f32;
        assert!(v.iter().all(|&x| x == want));
        symm_free(p, 4096, c.rank, null_mut());
        if it == 1 {
            let s = stats(c.rank);
            warm = Some((s.peer_mappings, s.physical_creates));
        }
    }
    let s = stats(c.rank);
    assert_eq!(
        Some((s.peer_mappings, s.physical_creates)),
        warm,
        "new mappings or segments after warm-up"
    );
    destroy(comm);
    let s = stats(c.rank);
    assert_eq!(s.peer_mappings, 0, "destroy unmaps every peer segment");
    assert_eq!(s.active_blocks, 0);
    symm_empty_cache(); // cached host segments are memfds
    assert_eq!(stats(c.rank).segments, 0);
    assert_eq!(open_fds(), fds_before, "destroy closes every descriptor");
}

/// A steady call (the same buffers, nothing allocated or freed since) finds its buffers in the
/// placement cache: no hold of the heap's lock, no lookup, no exchange; anything the heap's
/// lock guards that changes in between makes the next call look again, and every result is
/// right throughout.
fn placement_cache_rank(c: Child) {
    let comm = init(&c);
    // (Fetched once: fetching it holds the lock.)
    let count = symmalloc::heap::global()
        .unwrap()
        .heap_releases(c.rank)
        .unwrap();
    let holds = || count.load(std::sync::atomic::Ordering::Acquire);
    let n = 1024usize;
    let want = (c.world * (c.world + 1) / 2) as f32;
    let run = |p: *mut std::ffi::c_void, q: *mut std::ffi::c_void, round: usize| {
        // SAFETY (each slice below): p and q are live blocks of n floats of host memory, and
        // each slice is dropped before the next is made (p == q in place).
        let out = || unsafe { std::slice::from_raw_parts_mut(q as *mut f32, n) };
        out().iter_mut().for_each(|x| *x = f32::NAN); // poisoned, then the input
        let input = unsafe { std::slice::from_raw_parts_mut(p as *mut f32, n) };
        input.iter_mut().for_each(|x| *x = (c.rank + 1) as f32);
        let st = symm_all_reduce(comm, p, q, n, SYMM_FP32, SYMM_SUM, null_mut());
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "round {round}: {}", err());
        assert!(
            out().iter().all(|&x| x == want),
            "round {round}: wrong result"
        );
    };
    let a = symm_malloc(n * 4, c.rank, null_mut());
    let b = symm_malloc(n * 4, c.rank, null_mut());
    assert!(!a.is_null() && !b.is_null(), "{}", err());
    run(a, b, 0); // looks up and exchanges
    run(a, b, 1); // looks up again (the exchange held the lock), nothing new to share
    let before = holds();
    for round in 2..50 {
        run(a, b, round);
    }
    assert_eq!(holds(), before, "a steady all-reduce held the heap's lock");
    // Another buffer pair: looked up (one hold), then steady again.
    run(b, a, 50);
    let looked = holds();
    assert_eq!(
        looked,
        before + 1,
        "a new pair of buffers is looked up in one hold"
    );
    run(b, a, 51);
    assert_eq!(holds(), looked);
    // Anything under the heap's lock in between (here a block bigger than any cached one,
    // allocated and freed) makes the next call look again, and it is right.
    let big = 8usize << 20;
    let x = symm_malloc(big, c.rank, null_mut());
    assert!(!x.is_null(), "{}", err());
    symm_free(x, big, c.rank, null_mut());
    let changed = holds();
    assert!(changed > looked);
    run(b, a, 52);
    assert_eq!(
        holds(),
        changed + 1,
        "the heap changed: the call looked again"
    );
    // A block that is no longer live is refused as before, although the cache held it: the
    // free (through the thread cache and empty_cache) held the heap's lock. (`b` keeps the
    // segment, so `a` stays inside the heap.)
    run(a, a, 53);
    run(a, a, 54);
    symm_free(a, n * 4, c.rank, null_mut());
    symm_empty_cache();
    let st = symm_all_reduce(comm, a, a, n, SYMM_FP32, SYMM_SUM, null_mut());
    assert_eq!(
        st,
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT,
        "a freed block was taken"
    );
    assert!(
        err().contains("not inside a live symm_malloc block"),
        "{}",
        err()
    );
    run(b, b, 55);
    symm_free(b, n * 4, c.rank, null_mut());
    destroy(comm);
}

#[test]
fn a_steady_call_takes_no_heap_lock_and_a_changed_heap_is_looked_up_again() {
    if let Some(c) = child() {
        return placement_cache_rank(c);
    }
    for world in [2, 3] {
        assert_all_ok(&run_ranks(
            "a_steady_call_takes_no_heap_lock_and_a_changed_heap_is_looked_up_again",
            world,
            &[HOST],
            "",
        ));
    }
}

/// A segment released on every rank is unmapped by the peers at their next call, and the same
/// memory comes back as a new segment that collectives use correctly.
fn release_rank(c: Child) {
    let comm = init(&c);
    let big = 12usize << 20; // a segment of its own
    let run = |p: *mut std::ffi::c_void, round: i32| {
        let n = big / 4;
        // SAFETY: p is `big` bytes of host memory.
        let v = unsafe { std::slice::from_raw_parts_mut(p as *mut f32, n) };
        v.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (c.rank + round) as f32 + (i % 7) as f32);
        let st = symm_all_reduce(comm, p, p, n, SYMM_FP32, SYMM_SUM, null_mut());
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
        let w = c.world as f32;
        let base = (0..c.world).map(|r| (r + round) as f32).sum::<f32>();
        assert!(v
            .iter()
            .enumerate()
            .all(|(i, &x)| x == base + w * (i % 7) as f32));
    };
    let barrier = || {
        let st = symm_barrier(comm, null_mut());
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    };
    let m0 = stats(c.rank).peer_mappings;
    let p = symm_malloc(big, c.rank, null_mut());
    run(p, 0);
    let mapped = stats(c.rank).peer_mappings;
    assert_eq!(
        mapped,
        m0 + (c.world as u64 - 1),
        "each peer's segment mapped here"
    );
    let released = stats(c.rank).physical_releases;
    symm_free(p, big, c.rank, null_mut());
    symm_empty_cache();
    assert_eq!(stats(c.rank).physical_releases, released + 1);
    barrier(); // every rank has released before anyone passes this one
    barrier(); // and this call, on every rank, retires the peers' segments
    assert_eq!(
        stats(c.rank).peer_mappings,
        m0,
        "rank {}: the peers' released segments are still mapped",
        c.rank
    );
    // The same offsets again: a new generation, exchanged and mapped before the kernel runs.
    let q = symm_malloc(big, c.rank, null_mut());
    assert_eq!(q, p, "deterministic placement reuses the offset");
    run(q, 1);
    assert_eq!(stats(c.rank).peer_mappings, mapped);
    symm_free(q, big, c.rank, null_mut());
    destroy(comm);
}

#[test]
fn released_segments_are_unmapped_by_every_peer_at_its_next_call() {
    if let Some(c) = child() {
        return release_rank(c);
    }
    for world in [2, 3] {
        assert_all_ok(&run_ranks(
            "released_segments_are_unmapped_by_every_peer_at_its_next_call",
            world,
            &[HOST],
            "",
        ));
    }
}

#[test]
fn steady_state_creates_no_new_mappings_or_segments() {
    if let Some(c) = child() {
        return steady_rank(c);
    }
    assert_all_ok(&run_ranks(
        "steady_state_creates_no_new_mappings_or_segments",
        2,
        &[HOST],
        "10000",
    ));
    assert_all_ok(&run_ranks(
        "steady_state_creates_no_new_mappings_or_segments",
        3,
        &[HOST],
        "300",
    ));
}

fn killed_rank(c: Child) {
    let during_collective = c.arg == "collective";
    if c.rank == 2 && !during_collective {
        // Arrive late, so rank 1 is still inside init (waiting for us) when it is killed.
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    if c.rank == 1 && !during_collective {
        // Killed during init: its listener is up and rank 0 has connected to it.
        std::thread::spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(100));
            // SAFETY: killing this very process, as an OOM killer or a crash would.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        });
    }
    let mut id = symm_unique_id_t { internal: [0; 128] };
    id.internal
        .iter_mut()
        .zip(c.id)
        .for_each(|(d, s)| *d = s as _);
    let mut comm = null_mut();
    let t0 = std::time::Instant::now();
    let st = symm_comm_init(&mut comm, c.world, c.rank, c.rank, &id);
    if c.rank == 1 && !during_collective {
        std::thread::sleep(std::time::Duration::from_secs(60)); // the SIGKILL lands first
    }
    if !during_collective {
        assert_ne!(st, symm_status_t::SYMM_SUCCESS);
        let e = err();
        assert!(
            e.contains("rank 1"),
            "error must name the missing rank: {e}"
        );
        assert!(t0.elapsed().as_secs_f64() < 10.0);
        println!("rank {}: init failed as expected: {e}", c.rank);
        return;
    }
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    let p = symm_malloc(1 << 16, c.rank, null_mut());
    assert_eq!(
        symm_all_reduce(comm, p, p, 1024, SYMM_FP32, SYMM_SUM, null_mut()),
        symm_status_t::SYMM_SUCCESS
    );
    println!("READY");
    if c.rank == 1 {
        std::thread::sleep(std::time::Duration::from_secs(60)); // killed by the parent
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    let st = symm_all_reduce(comm, p, p, 1024, SYMM_FP32, SYMM_SUM, null_mut());
    assert_eq!(st, symm_status_t::SYMM_ERR_TIMEOUT, "{}", err());
    let e = err();
    assert!(e.contains("rank 1"), "error must name the dead rank: {e}");
    assert!(t0.elapsed().as_secs_f64() < 10.0);
    destroy(comm);
    println!("rank {}: collective failed as expected: {e}", c.rank);
}

#[test]
fn killed_rank_is_reported_by_name_within_the_timeout() {
    if let Some(c) = child() {
        return killed_rank(c);
    }
    let env = [HOST, ("SYMMALLOC_TIMEOUT_S", "3")];
    // During init: rank 1 dies before connecting.
    let outs = run_ranks(
        "killed_rank_is_reported_by_name_within_the_timeout",
        3,
        &env,
        "init",
    );
    assert_all_ok(&[outs[0].clone(), outs[2].clone()]);
    // During a collective: rank 1 is SIGKILLed after the first all-reduce.
    let mut kids = spawn_ranks(
        "killed_rank_is_reported_by_name_within_the_timeout",
        2,
        &env,
        "collective",
    );
    let mut out1 = kids[1].stdout.take().unwrap();
    let mut buf = [0u8; 4096];
    let mut seen = String::new();
    while !seen.contains("READY") {
        let n = std::io::Read::read(&mut out1, &mut buf).unwrap();
        assert!(n > 0, "rank 1 exited before READY");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(kids[1].id() as i32, libc::SIGKILL) };
    let outs = wait_all(kids);
    assert_all_ok(&outs[..1]);
}

fn asymmetric_rank(c: Child) {
    let comm = init(&c);
    let (extra, p) = expect_exchange_asymmetry(&c, comm);
    // Same segment, different offsets inside it: caught at the collective's barrier.
    let q = symm_malloc(4096, c.rank, null_mut());
    let r = symm_malloc(4096, c.rank, null_mut());
    let buf = if c.rank == 0 { q } else { r };
    let st = symm_all_reduce(comm, buf, buf, 16, SYMM_FP32, SYMM_SUM, null_mut());
    assert_eq!(
        st,
        symm_status_t::SYMM_ERR_NOT_SYMMETRIC,
        "rank {}: {}",
        c.rank,
        err()
    );
    // The communicator stays usable with symmetric buffers.
    let st = symm_all_reduce(comm, q, q, 16, SYMM_FP32, SYMM_SUM, null_mut());
    assert_eq!(
        st,
        symm_status_t::SYMM_SUCCESS,
        "rank {}: {}",
        c.rank,
        err()
    );
    for x in [extra, p] {
        if !x.is_null() {
            let size = if x == extra { 3 << 20 } else { 8 << 20 };
            symm_free(x, size, c.rank, null_mut());
        }
    }
    destroy(comm);
    println!("rank {}: asymmetry reported on every rank", c.rank);
}

#[test]
fn asymmetric_allocations_fail_on_every_rank() {
    if let Some(c) = child() {
        return asymmetric_rank(c);
    }
    assert_all_ok(&run_ranks(
        "asymmetric_allocations_fail_on_every_rank",
        2,
        &[HOST, ("SYMMALLOC_TIMEOUT_S", "10")],
        "",
    ));
}

/// Each case: a variable, its value on rank 0 and on rank 1 ("" leaves it unset).
const SETTING_CASES: [(&str, &str, &str); 5] = [
    ("SYMMALLOC_LL_MAX_BYTES", "64K", ""),
    ("SYMMALLOC_ONE_SHOT_MAX_BYTES", "", "1M"),
    ("SYMMALLOC_CHECK_SYMMETRY", "1", ""),
    ("SYMMALLOC_LL_BYTES", "1M", "2M"),
    ("SYMMALLOC_SHARED_GPU", "1", ""),
];

fn settings_rank(c: Child) {
    let (name, ..) = SETTING_CASES[c.arg.parse::<usize>().unwrap()];
    let (st, comm) = try_init(&c);
    let msg = err();
    assert_eq!(
        st,
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT,
        "rank {}: {msg}",
        c.rank
    );
    assert!(comm.is_null(), "rank {}: a communicator came back", c.rank);
    assert!(
        msg.contains("set them alike on every rank") && msg.matches(name).count() == 2,
        "rank {}: the message must name {name} for both ranks: {msg}",
        c.rank
    );
    // Nothing was left claimed: the same rank can still allocate.
    let p = symm_malloc(4096, c.rank, null_mut());
    assert!(!p.is_null(), "rank {}: {}", c.rank, err());
    symm_free(p, 4096, c.rank, null_mut());
    println!("rank {}: refused: {msg}", c.rank);
}

#[test]
fn init_refuses_ranks_whose_collective_settings_differ() {
    if let Some(c) = child() {
        return settings_rank(c);
    }
    for (case, &(name, v0, v1)) in SETTING_CASES.iter().enumerate() {
        let outs = wait_all(spawn_ranks_with(
            "init_refuses_ranks_whose_collective_settings_differ",
            2,
            |r| {
                let v = if r == 0 { v0 } else { v1 };
                let mut env = vec![HOST, ("SYMMALLOC_TIMEOUT_S", "10")];
                if !v.is_empty() {
                    env.push((name, v));
                }
                env
            },
            &case.to_string(),
        ));
        assert_all_ok(&outs);
    }
}

#[test]
fn an_ll_threshold_above_the_slot_is_refused_at_init() {
    if let Some(c) = child() {
        let (st, comm) = try_init(&c);
        let msg = err();
        assert_eq!(st, symm_status_t::SYMM_ERR_INVALID_ARGUMENT, "{msg}");
        assert!(comm.is_null());
        assert!(
            msg.contains("SYMMALLOC_LL_MAX_BYTES=2097152 exceeds the LL slot of 1048576"),
            "{msg}"
        );
        return;
    }
    assert_all_ok(&run_ranks(
        "an_ll_threshold_above_the_slot_is_refused_at_init",
        2,
        &[
            HOST,
            ("SYMMALLOC_TIMEOUT_S", "10"),
            ("SYMMALLOC_LL_BYTES", "1M"),
            ("SYMMALLOC_LL_MAX_BYTES", "2M"),
        ],
        "",
    ));
}

/// Ranks on one device: refused by default, naming both ranks and the opt-in; with
/// `SYMMALLOC_SHARED_GPU=1` every algorithm reduces correctly (what the one-GPU protocol runs
/// on the device machine rely on).
fn shared_device_rank(c: Child) {
    assert_eq!(c.device, 0);
    let (st, comm) = try_init(&c);
    if c.arg == "refuse" {
        let msg = err();
        assert_eq!(st, symm_status_t::SYMM_ERR_INVALID_ARGUMENT, "{msg}");
        assert!(comm.is_null());
        assert!(
            msg.contains("both use device 0") && msg.contains("SYMMALLOC_SHARED_GPU=1"),
            "rank {}: {msg}",
            c.rank
        );
        return;
    }
    assert_eq!(
        st,
        symm_status_t::SYMM_SUCCESS,
        "rank {}: {}",
        c.rank,
        err()
    );
    let n = 1031;
    let p = symm_malloc(2 * n * 4, 0, null_mut()) as *mut f32;
    assert!(!p.is_null(), "{}", err());
    for (k, algo) in [
        SYMM_ALGO_AUTO,
        SYMM_ALGO_ONE_SHOT,
        SYMM_ALGO_TWO_SHOT,
        SYMM_ALGO_ONE_SHOT_LL,
    ]
    .into_iter()
    .enumerate()
    {
        let v = |r: i32, i: usize| (r * 1000 + (i * 7 + k) as i32 % 997) as f32;
        // SAFETY: p holds 2n f32 of host memory; recv = p + n is poisoned first.
        unsafe {
            for i in 0..n {
                p.add(i).write(v(c.rank, i));
                p.add(n + i).write(f32::NAN);
            }
        }
        let st = symm_all_reduce_algo(
            comm,
            algo,
            p as _,
            // SAFETY: in bounds of the block.
            unsafe { p.add(n) } as _,
            n,
            SYMM_FP32,
            SYMM_SUM,
            null_mut(),
        );
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "algo {algo}: {}", err());
        for i in 0..n {
            let want: f32 = (0..c.world).map(|r| v(r, i)).sum();
            // SAFETY: as above.
            let got = unsafe { p.add(n + i).read() };
            assert_eq!(got, want, "rank {} algo {algo} element {i}", c.rank);
        }
    }
    symm_free(p as _, 2 * n * 4, 0, null_mut());
    destroy(comm);
    println!(
        "rank {}: four algorithms correct on a shared device",
        c.rank
    );
}

#[test]
fn ranks_share_a_device_only_when_asked() {
    if let Some(c) = child() {
        return shared_device_rank(c);
    }
    let refused = [
        HOST,
        ("SYMMALLOC_TIMEOUT_S", "10"),
        ("SYMM_TEST_DEVICE", "0"),
    ];
    let name = "ranks_share_a_device_only_when_asked";
    assert_all_ok(&run_ranks(name, 2, &refused, "refuse"));
    let shared = [
        HOST,
        ("SYMMALLOC_TIMEOUT_S", "10"),
        ("SYMM_TEST_DEVICE", "0"),
        ("SYMMALLOC_SHARED_GPU", "1"),
    ];
    assert_all_ok(&run_ranks(name, 3, &shared, "share"));
}

fn intruder_rank(c: Child) {
    let comm = init(&c);
    let p = symm_malloc(4096, c.rank, null_mut());
    // SAFETY: 4096 bytes of host memory.
    unsafe { (p as *mut f32).write(1.0) };
    assert_eq!(
        symm_all_reduce(comm, p, p, 1, SYMM_FP32, SYMM_SUM, null_mut()),
        symm_status_t::SYMM_SUCCESS
    );
    // SAFETY: as above.
    assert_eq!(unsafe { (p as *const f32).read() }, c.world as f32);
    destroy(comm);
}

#[test]
fn connection_without_the_secret_is_refused() {
    if let Some(c) = child() {
        if c.rank == 0 {
            // Rank 0 listens; an intruder that knows the socket name but not the secret
            // connects first and must be refused without disturbing the job.
            let id = symmalloc::ipc::UniqueId::from_bytes(&c.id).unwrap();
            let name = id.socket_name(0);
            std::thread::spawn(move || {
                use std::os::linux::net::SocketAddrExt;
                let addr =
                    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
                for _ in 0..2000 {
                    if let Ok(s) = std::os::unix::net::UnixStream::connect_addr(&addr) {
                        let mut hello = b"SYMMHELO".to_vec();
                        hello.extend_from_slice(&1u32.to_le_bytes());
                        hello.extend_from_slice(&2u32.to_le_bytes());
                        hello.extend_from_slice(&[0u8; 32]);
                        let _ = symmalloc::ipc::socket::send_frame(&s, &hello, &[]);
                        std::thread::sleep(std::time::Duration::from_millis(200));
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
        } else {
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        intruder_rank(c);
        return;
    }
    let outs = run_ranks("connection_without_the_secret_is_refused", 2, &[HOST], "");
    assert_all_ok(&outs);
    let log = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        log.contains("refused a connection") && log.contains("wrong secret"),
        "rank 0 log: {log}"
    );
}
