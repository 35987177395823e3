//! Groups on the host backend, one process per rank (real shared memory, sockets and fd
//! passing): several communicators per device (the world, TP pairs and EP halves split from
//! it, a child without rank 0, independent pairs from their own ids), every collective against
//! a float64 reference on each, buffers from each communicator's arena allocated in different
//! orders and sizes per group, two threads driving two communicators at once, a bad color,
//! the limit of communicators per device, split/destroy cycles without leaks, destroy orders,
//! a dead rank, the same ranks on two devices, and the child's reuse of its parent's mappings
//! (tests/groups_slots_host.rs has the split slots children are carved from).

use crate::common;
use common::*;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::time::{Duration, Instant};
use symmalloc::ffi::groups::*;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

fn info(comm: Comm) -> symm_comm_info_t {
    let mut i = symm_comm_info_t::default();
    ok(
        symm_comm_info(comm, &mut i, std::mem::size_of::<symm_comm_info_t>()),
        "symm_comm_info",
    );
    i
}

fn id_from_hex(hex: &str) -> symm_unique_id_t {
    let mut id = symm_unique_id_t { internal: [0; 128] };
    for (i, b) in id.internal.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as _;
    }
    id
}

fn init_with(world: i32, rank: i32, device: i32, hex: &str) -> (symm_status_t, Comm) {
    let mut comm = null_mut();
    let st = symm_comm_init(&mut comm, world, rank, device, &id_from_hex(hex));
    (st, comm)
}

fn cmalloc(comm: Comm, bytes: usize) -> *mut u8 {
    let p = symm_comm_malloc(comm, bytes, null_mut()) as *mut u8;
    assert!(!p.is_null(), "symm_comm_malloc({bytes}): {}", err());
    p
}

fn cfree(comm: Comm, p: *mut u8, bytes: usize) {
    symm_comm_free(comm, p as *mut c_void, bytes, null_mut());
    assert!(err().is_empty(), "symm_comm_free: {}", err());
}

/// Every rank's `v`, through the communicator's all-gather (the bits travel as two fp32).
fn gather_u64(comm: Comm, v: u64) -> Vec<u64> {
    let n = info(comm).world_size as usize;
    let send = cmalloc(comm, 8) as *mut u64;
    let recv = cmalloc(comm, 8 * n) as *mut u64;
    // SAFETY: send and recv are live blocks of 8 and 8n bytes of host memory.
    unsafe { send.write(v) };
    ok(
        symm_all_gather(comm, send as _, recv as _, 2, SYMM_FP32, null_mut()),
        "all_gather",
    );
    // SAFETY: as above.
    let out = (0..n).map(|r| unsafe { recv.add(r).read() }).collect();
    cfree(comm, send as _, 8);
    cfree(comm, recv as _, 8 * n);
    out
}

fn rel(got: &[f64], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += (g - w) * (g - w);
        den += w * w;
    }
    (num / den.max(1e-30)).sqrt()
}

/// Every collective of `comm` against a float64 reference, buffers from its arena (poisoned
/// before each call): all-reduce by every algorithm, reduce-scatter, all-gather (exact) and
/// the fused all-reduce + RMSNorm. `label` names the group in failures.
fn check_collectives(comm: Comm, seed: u64, label: &str) {
    let i = info(comm);
    let (rank, world) = (i.rank, i.world_size);
    let w = world as usize;
    let none = null_mut();
    let mut case = 0u64;
    for &count in &[1usize, 9, 1031, 4099] {
        for (dtype, es) in dtypes() {
            case += 1;
            let s = seed.wrapping_add(case * 7919);
            let bytes = count * es;
            let a = cmalloc(comm, bytes);
            let b = cmalloc(comm, bytes);
            for algo in [
                SYMM_ALGO_AUTO,
                SYMM_ALGO_ONE_SHOT,
                SYMM_ALGO_TWO_SHOT,
                SYMM_ALGO_ONE_SHOT_LL,
            ] {
                // SAFETY: a and b are live blocks of `bytes` bytes of host memory.
                unsafe {
                    for k in 0..count {
                        write_elem(a, dtype, k, input(s, rank, k));
                    }
                    std::ptr::write_bytes(b, 0xFF, bytes);
                }
                ok(
                    symm_all_reduce_algo(comm, algo, a as _, b as _, count, dtype, SYMM_SUM, none),
                    label,
                );
                let want: Vec<f64> = (0..count)
                    .map(|k| (0..world).map(|r| rounded(dtype, input(s, r, k))).sum())
                    .collect();
                // SAFETY: as above.
                let got: Vec<f64> = (0..count)
                    .map(|k| unsafe { read_elem(b, dtype, k) } as f64)
                    .collect();
                let e = rel(&got, &want);
                assert!(
                    e <= tolerance(dtype),
                    "{label}: all-reduce algo {algo} dtype {dtype} count {count}: error {e}"
                );
            }
            cfree(comm, a, bytes);
            cfree(comm, b, bytes);
            // Reduce-scatter (max) and all-gather.
            let big = cmalloc(comm, bytes * w);
            let small = cmalloc(comm, bytes);
            // SAFETY: big holds world * count elements, small count.
            unsafe {
                for k in 0..count * w {
                    write_elem(big, dtype, k, input(s ^ 5, rank, k));
                }
                std::ptr::write_bytes(small, 0xFF, bytes);
            }
            ok(
                symm_reduce_scatter(comm, big as _, small as _, count, dtype, SYMM_MAX, none),
                label,
            );
            for k in 0..count {
                let at = rank as usize * count + k;
                let want = (0..world)
                    .map(|r| rounded(dtype, input(s ^ 5, r, at)))
                    .fold(f64::MIN, f64::max);
                // SAFETY: as above.
                let got = unsafe { read_elem(small, dtype, k) } as f64;
                assert_eq!(got, want, "{label}: reduce-scatter element {k}");
            }
            // SAFETY: as above.
            unsafe {
                for k in 0..count {
                    write_elem(small, dtype, k, input(s ^ 9, rank, k));
                }
                std::ptr::write_bytes(big, 0xFF, bytes * w);
            }
            ok(
                symm_all_gather(comm, small as _, big as _, count, dtype, none),
                label,
            );
            for r in 0..world {
                for k in 0..count {
                    // SAFETY: as above.
                    let got = unsafe { read_elem(big, dtype, r as usize * count + k) } as f64;
                    assert_eq!(
                        got,
                        rounded(dtype, input(s ^ 9, r, k)),
                        "{label}: all-gather rank {r} element {k}"
                    );
                }
            }
            cfree(comm, big, bytes * w);
            cfree(comm, small, bytes);
        }
    }
    // The fused call, bf16, 3 tokens of 64.
    let (tokens, hidden, eps) = (3usize, 64usize, 1e-5f32);
    let n = tokens * hidden;
    let s = seed ^ 0xabc;
    let x = cmalloc(comm, n * 2);
    let res = cmalloc(comm, n * 2);
    let out = cmalloc(comm, n * 2);
    let wt = cmalloc(comm, hidden * 2);
    // SAFETY: the blocks hold n, n, n and hidden bf16 elements.
    unsafe {
        for k in 0..n {
            write_elem(x, SYMM_BF16, k, input(s, rank, k));
            write_elem(res, SYMM_BF16, k, input(s ^ 1, 100, k));
            write_elem(out, SYMM_BF16, k, f32::NAN);
        }
        for j in 0..hidden {
            write_elem(wt, SYMM_BF16, j, 0.5 + input(s ^ 2, 200, j).abs() / 4.0);
        }
    }
    ok(
        symm_all_reduce_add_rms_norm(
            comm, x as _, res as _, wt as _, out as _, tokens, hidden, eps, SYMM_BF16, none,
        ),
        label,
    );
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for t in 0..tokens {
        let r: Vec<f64> = (0..hidden)
            .map(|j| {
                let k = t * hidden + j;
                (0..world)
                    .map(|q| rounded(SYMM_BF16, input(s, q, k)))
                    .sum::<f64>()
                    + rounded(SYMM_BF16, input(s ^ 1, 100, k))
            })
            .collect();
        let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / hidden as f64 + eps as f64).sqrt();
        for (j, rv) in r.iter().enumerate() {
            want.push(rv * inv * rounded(SYMM_BF16, 0.5 + input(s ^ 2, 200, j).abs() / 4.0));
            // SAFETY: as above.
            got.push(unsafe { read_elem(out, SYMM_BF16, t * hidden + j) } as f64);
        }
    }
    let e = rel(&got, &want);
    assert!(e <= tolerance(SYMM_BF16), "{label}: fused call error {e}");
    for (p, len) in [(x, n * 2), (res, n * 2), (out, n * 2), (wt, hidden * 2)] {
        cfree(comm, p, len);
    }
}

// ---- The world, TP, EP, a child without rank 0, independent pairs -------------------------

/// The pair of independent communicators rank `r` of `world` joins: (pair index, its rank in
/// the pair). Pairs are (1, 2), (3, 4), ..., (world - 1, 0).
fn pair_of(r: i32, world: i32) -> (usize, i32) {
    if r % 2 == 1 {
        ((r as usize - 1) / 2, 0)
    } else {
        (((r + world - 2) % world) as usize / 2, 1)
    }
}

fn groups_rank(c: Child) {
    let mut args = c.arg.split(',');
    let seed: u64 = args.next().unwrap().parse().unwrap();
    let pair_ids: Vec<&str> = args.collect();
    let world = init(&c);
    // Device-level memory that differs between ranks: arenas must not care.
    let junk = symm_malloc((c.rank as usize + 1) * (3 << 20), c.device, null_mut());
    assert!(!junk.is_null(), "{}", err());
    let tp = split(world, c.rank / 2, c.rank);
    let ep = split(world, c.rank % 2, -c.rank); // reversed keys
    let no0 = split(
        world,
        if c.rank == 0 { SYMM_SPLIT_NOCOLOR } else { 0 },
        c.rank,
    );
    let (k, pr) = pair_of(c.rank, c.world);
    let (st, pair) = init_with(2, pr, c.device, pair_ids[k]);
    ok(st, "init of the independent pair");

    // Ranks and sizes as the split orders them.
    let ti = info(tp);
    assert_eq!((ti.rank, ti.world_size), (c.rank % 2, 2));
    let ei = info(ep);
    let n_parity = (c.world - c.rank % 2 + 1) / 2;
    assert_eq!(
        (ei.rank, ei.world_size),
        (n_parity - 1 - c.rank / 2, n_parity)
    );
    if c.rank > 0 {
        let ni = info(no0);
        assert_eq!((ni.rank, ni.world_size), (c.rank - 1, c.world - 1));
    }
    assert_eq!(info(world).comms_on_device, 4 + (c.rank > 0) as i32);

    // Arenas at one offset on every rank of each communicator.
    let mut comms = vec![("world", world), ("tp", tp), ("ep", ep), ("pair", pair)];
    if c.rank > 0 {
        comms.push(("no-rank-0", no0));
    }
    for &(name, comm) in &comms {
        let offs = gather_u64(comm, info(comm).arena_offset);
        assert!(
            offs.iter().all(|&o| o == offs[0]),
            "{name}: arena offsets {offs:?}"
        );
    }

    // Groups allocate in different orders and sizes (and so does the device), then every
    // collective on every group, each with buffers from its arena.
    let mut kept = Vec::new();
    let order: Vec<usize> = if c.rank % 2 == 0 {
        (0..comms.len()).collect()
    } else {
        (0..comms.len()).rev().collect()
    };
    for (step, &g) in order.iter().enumerate() {
        let (_, comm) = comms[g];
        let i = info(comm);
        // The same sizes on every rank of the group, different between groups.
        let bytes = (g + 1) * 40_000 + i.world_size as usize * 512;
        kept.push((comm, cmalloc(comm, bytes), bytes));
        let dev = symm_malloc(
            (step + 1) * (c.rank as usize + 2) * 8192,
            c.device,
            null_mut(),
        );
        assert!(!dev.is_null());
    }
    for &(name, comm) in &comms {
        check_collectives(comm, seed ^ name.len() as u64, name);
    }
    for (comm, p, bytes) in kept {
        cfree(comm, p, bytes);
    }
    // Destroyed in a mixed order: the world first.
    destroy(world);
    check_collectives(tp, seed, "tp after the world's destroy");
    destroy(ep);
    destroy(tp);
    if c.rank > 0 {
        destroy(no0);
    }
    destroy(pair);
}

#[test]
fn groups_of_4_6_and_8_ranks() {
    if let Some(c) = child() {
        return groups_rank(c);
    }
    let seed = seed();
    for world in [4, 6, 8] {
        let ids: Vec<String> = (0..world / 2).map(|_| new_id_hex()).collect();
        let arg = format!("{seed},{}", ids.join(","));
        assert_all_ok(&run_ranks(
            "groups_of_4_6_and_8_ranks",
            world,
            &[HOST, SMALL_LL],
            &arg,
        ));
    }
}

// ---- Two threads, two communicators ----------------------------------------------------

struct Send(Comm);
// SAFETY: each communicator is used by one thread at a time (the one it is moved to).
unsafe impl std::marker::Send for Send {}

/// 300 all-reduces on `comm`, each on a fresh block of its arena whose size the group's
/// ranks draw alike.
fn drive(comm: Comm, seed: u64, label: &str) {
    let i = info(comm);
    let mut sizes = Rng::new(seed);
    for call in 0..300u64 {
        let count = 1 + sizes.below(3000) as usize;
        let bytes = count * 4;
        let p = cmalloc(comm, bytes);
        let s = seed.wrapping_add(call);
        // SAFETY: p holds count fp32.
        unsafe {
            for k in 0..count {
                write_elem(p, SYMM_FP32, k, input(s, i.rank, k));
            }
        }
        ok(
            symm_all_reduce(comm, p as _, p as _, count, SYMM_FP32, SYMM_SUM, null_mut()),
            label,
        );
        for k in (0..count).step_by(97) {
            let want: f64 = (0..i.world_size).map(|r| input(s, r, k) as f64).sum();
            // SAFETY: as above.
            let got = unsafe { read_elem(p, SYMM_FP32, k) } as f64;
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{label} call {call}"
            );
        }
        cfree(comm, p, bytes);
    }
}

fn threads_rank(c: Child) {
    let seed: u64 = c.arg.parse().unwrap();
    let world = init(&c);
    let tp = Send(split(world, c.rank / 2, c.rank));
    let ep = Send(split(world, c.rank % 2, c.rank));
    let (tc, ec) = ((c.rank / 2) as u64, (c.rank % 2) as u64);
    let a = std::thread::spawn(move || {
        let tp = tp;
        drive(tp.0, seed ^ (tc << 8), "tp");
        tp
    });
    let b = std::thread::spawn(move || {
        let ep = ep;
        drive(ep.0, seed ^ (ec << 16) ^ 1, "ep");
        ep
    });
    let (tp, ep) = (a.join().unwrap(), b.join().unwrap());
    check_collectives(world, seed, "world after the threads");
    destroy(tp.0);
    destroy(ep.0);
    destroy(world);
}

#[test]
fn two_threads_drive_two_communicators_at_once() {
    if let Some(c) = child() {
        return threads_rank(c);
    }
    let seed = seed();
    assert_all_ok(&run_ranks(
        "two_threads_drive_two_communicators_at_once",
        4,
        &[HOST, SMALL_LL],
        &seed.to_string(),
    ));
}

// ---- A bad color -----------------------------------------------------------------------

fn bad_color_rank(c: Child) {
    let world = init(&c);
    let color = if c.rank == 1 { -5 } else { 0 };
    let mut child = null_mut();
    let t = Instant::now();
    assert_eq!(
        symm_comm_split(world, color, 0, &mut child),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    let e = err();
    assert!(
        e.contains("rank 1: color -5 is not accepted") && child.is_null(),
        "{e}"
    );
    // The parent stays usable, and a good split works after.
    check_collectives(world, 7, "parent after a bad color");
    let ch = split(world, 0, -c.rank);
    check_collectives(ch, 8, "child after a bad color");
    destroy(ch);
    // Split of a destroyed communicator, and other bad input.
    destroy(world);
    assert_eq!(
        symm_comm_split(world, 0, 0, &mut child),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("not a live communicator"), "{}", err());
    assert_eq!(
        symm_comm_split(null_mut(), 0, 0, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(symm_comm_malloc(world, 64, null_mut()).is_null());
    assert!(err().contains("not a live communicator"), "{}", err());
}

#[test]
fn a_bad_color_fails_the_split_on_every_rank_naming_it() {
    if let Some(c) = child() {
        return bad_color_rank(c);
    }
    assert_all_ok(&run_ranks(
        "a_bad_color_fails_the_split_on_every_rank_naming_it",
        3,
        &[HOST, SMALL_LL],
        "",
    ));
}

// ---- Memory of one communicator --------------------------------------------------------

fn comm_memory_rank(c: Child) {
    let world = init(&c);
    let tp = split(world, 0, c.rank);
    // Another communicator's block, a device-level block, a pointer inside a block, a wrong
    // size: refused, nothing freed.
    let a = cmalloc(world, 4096);
    let b = cmalloc(tp, 4096);
    let d = symm_malloc(4096, c.device, null_mut());
    for (p, size) in [(a, 4096), (d as *mut u8, 4096), (b.wrapping_add(512), 512)] {
        symm_comm_free(tp, p as _, size, null_mut());
        assert!(
            err().contains("not returned by symm_comm_malloc of this communicator"),
            "{}",
            err()
        );
    }
    symm_comm_free(tp, b as _, 100, null_mut());
    assert!(err().contains("allocated with size 4096"), "{}", err());
    assert!(symm_comm_malloc(tp, 0, null_mut()).is_null() && err().is_empty());
    symm_comm_free(tp, null_mut(), 0, null_mut());
    assert!(err().is_empty());
    // Still intact: a collective on both blocks works.
    check_collectives(tp, 3, "tp after bad frees");
    cfree(tp, b, 4096);
    cfree(world, a, 4096);
    symm_free(d, 4096, c.device, null_mut());
    // A block outlives its communicator: freed after the destroy, through symm_free.
    let late = cmalloc(tp, 1 << 20);
    destroy(tp);
    symm_free(late as _, 1 << 20, c.device, null_mut());
    assert!(err().is_empty(), "{}", err());
    // The info struct's size is checked.
    let mut i = symm_comm_info_t::default();
    assert_eq!(
        symm_comm_info(world, &mut i, 2),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(symm_comm_info(world, &mut i, 12), OK);
    assert_eq!((i.rank, i.world_size, i.arena_bytes), (c.rank, c.world, 0));
    destroy(world);
}

#[test]
fn communicator_memory_refuses_foreign_blocks() {
    if let Some(c) = child() {
        return comm_memory_rank(c);
    }
    assert_all_ok(&run_ranks(
        "communicator_memory_refuses_foreign_blocks",
        2,
        &[HOST, SMALL_LL],
        "",
    ));
}

// ---- Limits, cycles, destroy orders, dead ranks ----------------------------------------

fn limit_rank(c: Child) {
    let world = init(&c);
    // Rank 0 holds one more communicator than the others (a world of its own).
    let extra = if c.rank == 0 {
        let (st, comm) = init_with(1, 0, c.device, &new_id_hex());
        ok(st, "a communicator of one rank");
        comm
    } else {
        null_mut()
    };
    let mut children = Vec::new();
    let failed_at = loop {
        let mut child = null_mut();
        let t = Instant::now();
        let st = symm_comm_split(world, 0, 0, &mut child);
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "a refusal must not wait"
        );
        if st != OK {
            assert_eq!(st, symm_status_t::SYMM_ERR_INVALID_ARGUMENT, "{}", err());
            let e = err();
            assert!(
                e.contains("rank 0: device 0 already has 16 live communicators")
                    && !e.contains("rank 1:"),
                "{e}"
            );
            break children.len();
        }
        children.push(child);
        assert!(children.len() < 20, "no limit reached");
    };
    // Rank 0 reached the limit: it holds the world, its own and 14 children. Every rank
    // failed at the same split.
    assert_eq!(failed_at, SYMM_MAX_COMMS_PER_DEVICE as usize - 2);
    check_collectives(world, 1, "parent at the limit");
    destroy(children.pop().unwrap());
    let again = split(world, 0, 0);
    check_collectives(again, 2, "a child after one went");
    destroy(again);
    for ch in children {
        destroy(ch);
    }
    if !extra.is_null() {
        destroy(extra);
    }
    destroy(world);
}

#[test]
fn the_limit_of_communicators_is_reached_on_every_rank_alike() {
    if let Some(c) = child() {
        return limit_rank(c);
    }
    assert_all_ok(&run_ranks(
        "the_limit_of_communicators_is_reached_on_every_rank_alike",
        3,
        &[HOST, SMALL_LL],
        "",
    ));
}

fn cycles_rank(c: Child) {
    let cycles: usize = c.arg.parse().unwrap();
    let world = init(&c);
    let buf = symm_malloc(1 << 16, c.device, null_mut());
    let mut base = None;
    for i in 0..cycles {
        let ch = split(world, c.rank / 2, c.rank);
        if i % 10 == 0 {
            ok(
                symm_all_reduce(ch, buf, buf, 1024, SYMM_FP32, SYMM_SUM, null_mut()),
                "child all-reduce",
            );
        }
        destroy(ch);
        // Once every rank has passed a barrier after its destroy, the next call of the world
        // sees every peer's release (retire.rs).
        ok(symm_barrier(world, null_mut()), "barrier");
        ok(symm_barrier(world, null_mut()), "barrier");
        if i == 50 {
            let s = stats(c.device);
            base = Some((open_fds(), s.peer_mappings, s.segments, s.reserved_bytes));
        }
    }
    ok(symm_barrier(world, null_mut()), "barrier");
    let s = stats(c.device);
    let end = (open_fds(), s.peer_mappings, s.segments, s.reserved_bytes);
    assert!(
        base == Some(end),
        "(fds, peer mappings, segments, reserved bytes) after 50 cycles {base:?}, at the end \
         {end:?}"
    );
    destroy(world);
}

#[test]
fn split_and_destroy_a_thousand_times_without_leaks() {
    if let Some(c) = child() {
        return cycles_rank(c);
    }
    assert_all_ok(&run_ranks(
        "split_and_destroy_a_thousand_times_without_leaks",
        4,
        &[HOST, SMALL_LL],
        "1000",
    ));
}

fn orders_rank(c: Child) {
    let world = init(&c);
    // The parent goes first: the child and its own child keep working.
    let tp = split(world, c.rank / 2, c.rank);
    let ep = split(world, c.rank % 2, c.rank);
    destroy(world);
    check_collectives(tp, 1, "tp without its parent");
    let grand = split(tp, 0, -c.rank);
    destroy(tp);
    check_collectives(grand, 2, "a grandchild without its ancestors");
    destroy(grand);
    // The child goes first: the parent keeps working.
    let ch = split(ep, 0, 0);
    destroy(ch);
    check_collectives(ep, 3, "ep after its child");
    // A peer destroys its child: this rank's copy reports it, naming the peer; the parent
    // stays usable.
    let pair = split(ep, 0, c.rank);
    if info(pair).rank == 1 {
        destroy(pair);
    }
    ok(symm_barrier(ep, null_mut()), "barrier");
    if info(ep).rank == 0 {
        let buf = cmalloc(ep, 4096);
        let st = symm_barrier(pair, null_mut());
        assert_eq!(st, symm_status_t::SYMM_ERR_PEER, "{}", err());
        assert!(
            err().contains("rank 1 destroyed its communicator"),
            "{}",
            err()
        );
        assert!(err().contains("split from another"), "{}", err());
        // Splitting the broken communicator fails at once (its peer is gone), nothing made.
        let mut x = null_mut();
        let t = Instant::now();
        assert_ne!(symm_comm_split(pair, 0, 0, &mut x), OK);
        assert!(
            x.is_null() && t.elapsed() < Duration::from_secs(5),
            "{}",
            err()
        );
        cfree(ep, buf, 4096);
        destroy(pair);
    }
    check_collectives(ep, 4, "ep after a child's peer left");
    destroy(ep);
}

#[test]
fn communicators_are_destroyed_in_any_order() {
    if let Some(c) = child() {
        return orders_rank(c);
    }
    assert_all_ok(&run_ranks(
        "communicators_are_destroyed_in_any_order",
        4,
        &[HOST, SMALL_LL],
        "",
    ));
}

fn dead_rank(c: Child) {
    let world = init(&c);
    let tp = split(world, c.rank / 2, c.rank);
    let ep = split(world, c.rank % 2, c.rank);
    let pids = gather_u64(world, std::process::id() as u64);
    ok(symm_barrier(world, null_mut()), "barrier");
    if c.rank == 3 {
        std::process::exit(0);
    }
    let dead = pids[3].to_string();
    let buf = cmalloc(world, 4096);
    let named = |comm: Comm, what: &str| {
        let st = symm_all_reduce(
            comm,
            buf as _,
            buf as _,
            16,
            SYMM_FP32,
            SYMM_SUM,
            null_mut(),
        );
        assert!(
            st == symm_status_t::SYMM_ERR_TIMEOUT || st == symm_status_t::SYMM_ERR_PEER,
            "{what}: {st:?} {}",
            err()
        );
        assert!(
            err().contains(&dead),
            "{what} does not name pid {dead}: {}",
            err()
        );
    };
    named(world, "world");
    // TP pairs: (0, 1) works, (2, 3) reports; EP halves: evens work, odds report.
    if c.rank == 2 {
        named(tp, "tp");
    } else {
        check_collectives(tp, 5, "tp without the dead rank");
    }
    if c.rank % 2 == 1 {
        named(ep, "ep");
    } else {
        check_collectives(ep, 6, "ep without the dead rank");
    }
    destroy(tp);
    destroy(ep);
    destroy(world);
}

#[test]
fn a_dead_rank_is_named_by_every_communicator_it_belongs_to() {
    if let Some(c) = child() {
        return dead_rank(c);
    }
    let outs = run_ranks(
        "a_dead_rank_is_named_by_every_communicator_it_belongs_to",
        4,
        &[HOST, SMALL_LL, ("SYMMALLOC_TIMEOUT_S", "2")],
        "",
    );
    assert_all_ok(&outs);
}

fn two_devices_rank(c: Child) {
    let world = init(&c);
    let (st, other) = init_with(c.world, c.rank, c.device + 2, &c.arg);
    assert_eq!(st, symm_status_t::SYMM_ERR_INVALID_ARGUMENT, "{}", err());
    assert!(other.is_null());
    let e = err();
    assert!(
        e.contains("is already in a live communicator") && e.contains("on device"),
        "{e}"
    );
    check_collectives(world, 9, "the world after the refusal");
    destroy(world);
}

#[test]
fn the_same_ranks_on_two_devices_are_refused() {
    if let Some(c) = child() {
        return two_devices_rank(c);
    }
    assert_all_ok(&run_ranks(
        "the_same_ranks_on_two_devices_are_refused",
        2,
        &[HOST, SMALL_LL],
        &new_id_hex(),
    ));
}

// ---- Reuse of the parent's mappings, and what creation costs ----------------------------

fn reuse_rank(c: Child) {
    let world = init(&c);
    let buf = symm_malloc(1 << 20, c.device, null_mut());
    ok(
        symm_all_reduce(world, buf, buf, 4096, SYMM_FP32, SYMM_SUM, null_mut()),
        "world",
    );
    let before = stats(c.device).peer_mappings;
    let tp = split(world, c.rank / 2, c.rank);
    // The child's internal block is carved from a split slot of the world's, which its peer
    // mapped at init (comm/group/slots.rs): nothing new to map.
    assert_eq!(stats(c.device).peer_mappings, before);
    ok(
        symm_all_reduce(tp, buf, buf, 4096, SYMM_FP32, SYMM_SUM, null_mut()),
        "tp",
    );
    assert_eq!(
        stats(c.device).peer_mappings,
        before,
        "the child mapped memory its parent had mapped"
    );
    // A fresh communicator over the same pair finds the same peer heaps: only its new blocks
    // are mapped (the internal block with its split slots, a large segment, and the signal
    // pad, a small one).
    let (k, pr) = (c.rank as usize / 2, c.rank % 2);
    let ids: Vec<&str> = c.arg.split(',').collect();
    let (st, fresh) = init_with(2, pr, c.device, ids[k]);
    ok(st, "fresh init");
    ok(
        symm_all_reduce(fresh, buf, buf, 4096, SYMM_FP32, SYMM_SUM, null_mut()),
        "fresh",
    );
    assert_eq!(stats(c.device).peer_mappings, before + 2);
    destroy(fresh);
    destroy(tp);
    destroy(world);
}

#[test]
fn a_child_maps_nothing_its_parent_mapped() {
    if let Some(c) = child() {
        return reuse_rank(c);
    }
    let ids = [new_id_hex(), new_id_hex()];
    assert_all_ok(&run_ranks(
        "a_child_maps_nothing_its_parent_mapped",
        4,
        &[HOST, SMALL_LL, ("SYMMALLOC_SPLIT_SLOTS", "2")],
        &ids.join(","),
    ));
}
