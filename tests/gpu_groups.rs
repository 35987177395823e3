//! Groups on a GPU (run on the device machine; GPU tests are ignored elsewhere): a TP and an EP
//! communicator split from the world, driven by two threads on two streams at once through the
//! real kernels (LL, one-shot, two-shot, AUTO and the fused all-reduce + RMSNorm), buffers
//! from each communicator's arena, every result against a float64 reference (outputs poisoned
//! first); that each split was carved from its parent's split slot (no new device memory),
//! printing what a split and a fresh init cost. The targets (a split's cost, a child's
//! all-reduce against a standalone communicator's) are bench/groups.rs's. With one GPU:
//! `SYMM_TEST_RANKS=4 SYMMALLOC_SHARED_GPU=1` (scripts/device-run.sh groups).

mod common;
use common::*;
use std::ptr::null_mut;
use std::time::Instant;
use symmalloc::cuda::util;
use symmalloc::ffi::groups::*;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

fn info(comm: Comm) -> symm_comm_info_t {
    let mut i = symm_comm_info_t::default();
    assert_eq!(
        symm_comm_info(comm, &mut i, std::mem::size_of::<symm_comm_info_t>()),
        OK
    );
    i
}

struct Send(Comm);
// SAFETY: each communicator is used by the one thread it is moved to.
unsafe impl std::marker::Send for Send {}

/// One all-reduce case on `comm` and `stream`: arena buffers, fresh inputs, poisoned output,
/// float64 reference. True when right.
fn all_reduce_case(
    comm: Comm,
    device: i32,
    stream: u64,
    seed: u64,
    n: usize,
    dtype: u32,
    algo: u32,
) -> bool {
    let i = info(comm);
    let es = esize(dtype);
    let a = symm_comm_malloc(comm, n * es, stream as _) as u64;
    let b = symm_comm_malloc(comm, n * es, stream as _) as u64;
    assert!(a != 0 && b != 0, "{}", err());
    util::htod_async(
        device,
        a,
        &encode(dtype, &inputs(seed, i.rank, n, dtype)),
        stream,
    )
    .unwrap();
    util::htod_async(device, b, &vec![0xFF; n * es], stream).unwrap();
    let st = symm_all_reduce_algo(comm, algo, a as _, b as _, n, dtype, SYMM_SUM, stream as _);
    assert_eq!(st, OK, "rank {} algo {algo} n {n}: {}", i.rank, err());
    util::stream_sync(device, stream).unwrap();
    let mut out = vec![0u8; n * es];
    util::dtoh(device, &mut out, b).unwrap();
    let e = rel_err(
        &decode(dtype, &out),
        &reference(seed, i.world_size, n, dtype, SYMM_SUM),
    );
    symm_comm_free(comm, a as _, n * es, stream as _);
    symm_comm_free(comm, b as _, n * es, stream as _);
    if e > tol(dtype) {
        eprintln!(
            "rank {} algo {algo} n {n} dtype {dtype}: rel err {e}",
            i.rank
        );
    }
    e <= tol(dtype)
}

/// The fused all-reduce + residual + RMSNorm, bf16, on `comm` and `stream`. True when right.
fn fused_case(
    comm: Comm,
    device: i32,
    stream: u64,
    seed: u64,
    tokens: usize,
    hidden: usize,
) -> bool {
    let i = info(comm);
    let n = tokens * hidden;
    let eps = 1e-5f32;
    let bufs: Vec<u64> = [n, n, n, hidden]
        .iter()
        .map(|&k| symm_comm_malloc(comm, k * 2, stream as _) as u64)
        .collect();
    let (x, res, out, w) = (bufs[0], bufs[1], bufs[2], bufs[3]);
    let xs = inputs(seed, i.rank, n, SYMM_BF16);
    let rs = inputs(seed ^ 1, 100, n, SYMM_BF16);
    let ws: Vec<f32> = inputs(seed ^ 2, 200, hidden, SYMM_BF16)
        .iter()
        .map(|v| 0.5 + v.abs() / 4.0)
        .collect();
    let ws = decode(SYMM_BF16, &encode(SYMM_BF16, &ws));
    util::htod_async(device, x, &encode(SYMM_BF16, &xs), stream).unwrap();
    util::htod_async(device, res, &encode(SYMM_BF16, &rs), stream).unwrap();
    util::htod_async(device, w, &encode(SYMM_BF16, &ws), stream).unwrap();
    util::htod_async(device, out, &vec![0xFF; n * 2], stream).unwrap();
    let st = symm_all_reduce_add_rms_norm(
        comm,
        x as _,
        res as _,
        w as _,
        out as _,
        tokens,
        hidden,
        eps,
        SYMM_BF16,
        stream as _,
    );
    assert_eq!(st, OK, "rank {} fused: {}", i.rank, err());
    util::stream_sync(device, stream).unwrap();
    let mut got = vec![0u8; n * 2];
    util::dtoh(device, &mut got, out).unwrap();
    let got = decode(SYMM_BF16, &got);
    let all: Vec<Vec<f32>> = (0..i.world_size)
        .map(|r| inputs(seed, r, n, SYMM_BF16))
        .collect();
    let mut want = Vec::with_capacity(n);
    for t in 0..tokens {
        let r: Vec<f64> = (0..hidden)
            .map(|j| {
                let k = t * hidden + j;
                all.iter().map(|v| v[k] as f64).sum::<f64>() + rs[k] as f64
            })
            .collect();
        let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / hidden as f64 + eps as f64).sqrt();
        want.extend(r.iter().zip(&ws).map(|(v, w)| v * inv * *w as f64));
    }
    for (b, k) in bufs.iter().zip([n, n, n, hidden]) {
        symm_comm_free(comm, *b as _, k * 2, stream as _);
    }
    let e = rel_err(&got, &want);
    if e > tol(SYMM_BF16) {
        eprintln!("rank {} fused {tokens}x{hidden}: rel err {e}", i.rank);
    }
    e <= tol(SYMM_BF16)
}

/// Every kernel on `comm`, `rounds` times, on a stream of its own; (cases, wrong).
fn drive(comm: Comm, device: i32, seed: u64, rounds: u64) -> (u64, u64) {
    let stream = util::stream_create(device).unwrap();
    let (mut cases, mut wrong) = (0, 0);
    for round in 0..rounds {
        for (k, &(n, dtype, algo)) in [
            (4096usize, SYMM_BF16, SYMM_ALGO_ONE_SHOT_LL),
            (100_000, SYMM_BF16, SYMM_ALGO_ONE_SHOT_LL),
            (3000, SYMM_FP32, SYMM_ALGO_ONE_SHOT),
            (1 << 20, SYMM_BF16, SYMM_ALGO_TWO_SHOT),
            (77_777, SYMM_FP16, SYMM_ALGO_AUTO),
        ]
        .iter()
        .enumerate()
        {
            let s = seed.wrapping_add(round * 131 + k as u64);
            cases += 1;
            wrong += !all_reduce_case(comm, device, stream, s, n, dtype, algo) as u64;
        }
        for (k, &tokens) in [1usize, 8].iter().enumerate() {
            cases += 1;
            wrong += !fused_case(
                comm,
                device,
                stream,
                seed ^ (round * 7 + k as u64),
                tokens,
                4096,
            ) as u64;
        }
    }
    (cases, wrong)
}

fn two_streams_rank(c: Child) {
    let seed: u64 = c.arg.parse().unwrap();
    let world = init(&c);
    let tp = Send(split(world, c.rank / 2, c.rank));
    let ep = Send(split(world, c.rank % 2, -c.rank));
    let rounds = reps(30);
    assert_eq!(symm_barrier(world, null_mut()), OK);
    util::stream_sync(c.device, 0).unwrap();
    let (d, tc, ec) = (c.device, (c.rank / 2) as u64, (c.rank % 2) as u64);
    let a = std::thread::spawn(move || {
        let tp = tp;
        let r = drive(tp.0, d, seed ^ (tc << 20), rounds);
        (tp, r)
    });
    let b = std::thread::spawn(move || {
        let ep = ep;
        let r = drive(ep.0, d, seed ^ (ec << 24) ^ 1, rounds);
        (ep, r)
    });
    let ((tp, (tn, tw)), (ep, (en, ew))) = (a.join().unwrap(), b.join().unwrap());
    println!(
        "rank {}: tp {tw} wrong of {tn}, ep {ew} wrong of {en} (two streams, two threads at once)",
        c.rank
    );
    assert_eq!((tw, ew), (0, 0), "wrong results");
    for comm in [tp.0, ep.0, world] {
        destroy(comm);
    }
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_tp_and_ep_on_two_streams_at_once() {
    if let Some(c) = child() {
        return two_streams_rank(c);
    }
    let world = gpu_world("gpu_tp_and_ep_on_two_streams_at_once");
    assert!(
        world >= 4 && world % 2 == 0,
        "needs 4 or more ranks (SYMM_TEST_RANKS=4)"
    );
    let outs = run_ranks(
        "gpu_tp_and_ep_on_two_streams_at_once",
        world,
        // Both children carved from the world's split slots: the kernels on carved pads and LL
        // buffers, two streams at once.
        &[("SYMMALLOC_SPLIT_SLOTS", "2")],
        &seed().to_string(),
    );
    assert_all_ok(&outs);
    for o in &outs {
        print!(
            "{}",
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.contains(" wrong of "))
                .collect::<Vec<_>>()
                .join("\n")
        );
        println!();
    }
}

fn cost_rank(c: Child) {
    let ids: Vec<&str> = c.arg.split(',').collect();
    let world = init(&c);
    let (mut inits, mut splits) = (Vec::new(), Vec::new());
    for hex in &ids {
        let mut id = symm_unique_id_t { internal: [0; 128] };
        for (i, b) in id.internal.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as _;
        }
        assert_eq!(symm_barrier(world, null_mut()), OK);
        util::stream_sync(c.device, 0).unwrap();
        let t = Instant::now();
        let mut fresh = null_mut();
        assert_eq!(
            symm_comm_init(&mut fresh, c.world, c.rank, c.device, &id),
            OK,
            "{}",
            err()
        );
        inits.push(t.elapsed().as_secs_f64());
        assert_eq!(symm_barrier(world, null_mut()), OK);
        util::stream_sync(c.device, 0).unwrap();
        let t = Instant::now();
        let ch = split(world, 0, c.rank);
        splits.push(t.elapsed().as_secs_f64());
        destroy(ch);
        destroy(fresh);
    }
    inits.sort_by(f64::total_cmp);
    splits.sort_by(f64::total_cmp);
    let (i, s) = (inits[inits.len() / 2], splits[splits.len() / 2]);
    println!(
        "rank {}: {} ranks on the GPU: fresh init {:.0} us, split {:.0} us (median of {}); split / init = {:.3}",
        c.rank,
        c.world,
        i * 1e6,
        s * 1e6,
        ids.len(),
        s / i
    );
    destroy(world);
}

/// Every split of the world is carved from its split slot and every init reserves its slots;
/// prints what a split and a fresh init of the same ranks cost (the target is bench/groups.rs's).
#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_split_and_init_cost() {
    if let Some(c) = child() {
        return cost_rank(c);
    }
    let world = gpu_world("gpu_split_and_init_cost");
    let ids: Vec<String> = (0..10).map(|_| new_id_hex()).collect();
    let outs = run_ranks(
        "gpu_split_and_init_cost",
        world,
        // 2 split slots (the default, named here so the test keeps its meaning if that changes).
        &[("SYMMALLOC_DEBUG", "INFO"), ("SYMMALLOC_SPLIT_SLOTS", "2")],
        &ids.join(","),
    );
    assert_all_ok(&outs);
    for o in &outs {
        let s = String::from_utf8_lossy(&o.stdout);
        println!(
            "{}",
            s.lines()
                .find(|l| l.contains("split / init"))
                .unwrap_or("?")
        );
    }
    // Where rank 0's creations spent their time (SYMMALLOC_DEBUG=INFO).
    let e = String::from_utf8_lossy(&outs[0].stderr);
    for l in e.lines().filter(|l| l.contains("arena claimed in")).take(8) {
        let kind = if l.contains("split from") {
            "split"
        } else {
            "init"
        };
        println!("rank 0 {kind}: {}", l.rsplit("; ").next().unwrap_or(""));
    }
    // Every split was carved from the world's split slot (each child is destroyed before the
    // next split): no device memory made or imported (comm/group/slots.rs); every init reserved
    // its slots.
    for (r, o) in outs.iter().enumerate() {
        let e = String::from_utf8_lossy(&o.stderr);
        let made: Vec<&str> = e
            .lines()
            .filter(|l| l.contains("arena claimed in"))
            .collect();
        let (splits, inits): (Vec<&str>, Vec<&str>) =
            made.iter().partition(|l| l.contains("split from"));
        assert_eq!(splits.len(), ids.len(), "rank {r}: {made:#?}");
        assert!(
            splits
                .iter()
                .all(|l| l.contains("carved from split slot 0 of its parent's")),
            "rank {r}: a split made its own block: {splits:#?}"
        );
        assert!(
            inits.iter().all(|l| l.contains("split slot(s) of")),
            "rank {r}: an init reserved no split slot: {inits:#?}"
        );
    }
}
