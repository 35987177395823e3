//! All-reduce correctness on real GPUs, one process per GPU (run on the device machine; skips
//! with a visible reason without two GPUs). Fresh random inputs for every case, outputs
//! poisoned first, compared with a float64 reference, and bitwise across ranks; eager and
//! 1,000 graph replays; steady state; a killed rank; asymmetric buffers.

mod common;
use common::*;
use std::io::Write;
use std::ptr::null_mut;
use symmalloc::comm::convert::bf16_to_f32;
use symmalloc::cuda::{mem, util};
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

fn out_file(c: &Child) -> std::fs::File {
    let dir = std::env::var("SYMM_TEST_OUT").unwrap();
    std::fs::File::create(format!("{dir}/rank{}.txt", c.rank)).unwrap()
}

/// One case: upload fresh inputs, poison the output, reduce, check; returns the output hash.
#[allow(clippy::too_many_arguments)]
fn run_case(
    c: &Child,
    comm: *mut symm_comm_t,
    stream: u64,
    seed: u64,
    n: usize,
    dtype: u32,
    op: u32,
    algo: u32,
    in_place: bool,
    misalign: bool,
) -> u64 {
    let es = esize(dtype);
    let off = if misalign { es } else { 0 };
    let bytes = n * es + off;
    let a = symm_malloc(bytes, c.device, stream as _) as u64;
    let b = symm_malloc(bytes, c.device, stream as _) as u64;
    assert!(a != 0 && b != 0, "{}", err());
    let (send, recv) = (
        a + off as u64,
        if in_place {
            a + off as u64
        } else {
            b + off as u64
        },
    );
    let x = encode(dtype, &inputs(seed, c.rank, n, dtype));
    let poison = vec![0xFFu8; n * es]; // NaN in every dtype
                                       // Stream-ordered uploads: the collective on the same stream sees them.
    util::htod_async(c.device, send, &x, stream).unwrap();
    if !in_place {
        util::htod_async(c.device, recv, &poison, stream).unwrap();
    }
    let st = symm_all_reduce_algo(comm, algo, send as _, recv as _, n, dtype, op, stream as _);
    assert_eq!(
        st,
        symm_status_t::SYMM_SUCCESS,
        "rank {} n {n} dtype {dtype} op {op} algo {algo}: {}",
        c.rank,
        err()
    );
    util::stream_sync(c.device, stream).unwrap();
    let mut out = vec![0u8; n * es];
    util::dtoh(c.device, &mut out, recv).unwrap();
    let got = decode(dtype, &out);
    let want = reference(seed, c.world, n, dtype, op);
    let e = rel_err(&got, &want);
    assert!(e <= tol(dtype), "rank {} n {n} dtype {dtype} op {op} algo {algo} in_place {in_place} misalign {misalign}: rel err {e}", c.rank);
    // Stream-ordered frees: the next case may reuse the blocks.
    symm_free(a as _, bytes, c.device, stream as _);
    symm_free(b as _, bytes, c.device, stream as _);
    fnv(&out)
}

/// The LL kernel's capacity in a world of `world` ranks (the children run with the default
/// SYMMALLOC_LL_BYTES, or the one the caller set, and it is 1 MiB at 3-4 ranks).
fn ll_max(world: i32) -> usize {
    symmalloc::config::ll_bytes(world as usize).unwrap() as usize
}

/// An explicit ONE_SHOT_LL over its capacity is refused with a message, on every rank alike.
fn expect_ll_refusal(c: &Child, comm: *mut symm_comm_t, n: usize, dtype: u32) {
    let p = symm_malloc(n * esize(dtype), c.device, null_mut());
    let st = symm_all_reduce_algo(
        comm,
        SYMM_ALGO_ONE_SHOT_LL,
        p,
        p,
        n,
        dtype,
        SYMM_SUM,
        null_mut(),
    );
    assert_eq!(st, symm_status_t::SYMM_ERR_INVALID_ARGUMENT);
    assert!(
        err().contains("ONE_SHOT_LL takes messages up to"),
        "{}",
        err()
    );
    symm_free(p, n * esize(dtype), c.device, null_mut());
}

fn sweep_rank(c: Child) {
    // SAFETY: single-threaded child process.
    let comm = init(&c);
    let stream = util::stream_create(c.device).unwrap();
    let seed: u64 = c.arg.parse().unwrap();
    let mut f = out_file(&c);
    let mut case = 0u64;
    let counts = [
        1usize,
        2,
        7,
        8,
        9,
        31,
        127,
        1000,
        4097,
        65_537,
        (1 << 20) + 3,
        1 << 22,
    ];
    for &n in &counts {
        for dtype in [SYMM_BF16, SYMM_FP16, SYMM_FP32] {
            for op in [SYMM_SUM, SYMM_MAX, SYMM_MIN] {
                for algo in [
                    SYMM_ALGO_AUTO,
                    SYMM_ALGO_ONE_SHOT_LL,
                    SYMM_ALGO_ONE_SHOT,
                    SYMM_ALGO_TWO_SHOT,
                ] {
                    for in_place in [true, false] {
                        case += 1;
                        if algo == SYMM_ALGO_ONE_SHOT_LL && n * esize(dtype) > ll_max(c.world) {
                            expect_ll_refusal(&c, comm, n, dtype);
                            continue;
                        }
                        let h = run_case(
                            &c,
                            comm,
                            stream,
                            seed + case,
                            n,
                            dtype,
                            op,
                            algo,
                            in_place,
                            case % 5 == 0,
                        );
                        writeln!(f, "{case} {h:016x}").unwrap();
                    }
                }
            }
        }
    }
    // The largest size the issue names: 2^27 bf16 elements (256 MiB), sum, both big algorithms.
    for algo in [SYMM_ALGO_AUTO, SYMM_ALGO_TWO_SHOT] {
        case += 1;
        let h = run_case(
            &c,
            comm,
            stream,
            seed + case,
            1 << 27,
            SYMM_BF16,
            SYMM_SUM,
            algo,
            true,
            false,
        );
        writeln!(f, "{case} {h:016x}").unwrap();
    }
    destroy(comm);
    println!("rank {}: {case} cases within tolerance", c.rank);
}

fn compare_rank_files(dir: &std::path::Path, world: i32) {
    let files: Vec<String> = (0..world)
        .map(|r| std::fs::read_to_string(dir.join(format!("rank{r}.txt"))).unwrap())
        .collect();
    assert!(!files[0].is_empty());
    for r in 1..world as usize {
        assert_eq!(
            files[r], files[0],
            "rank {r}'s outputs differ bitwise from rank 0's"
        );
    }
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("symm-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs test `name` on every GPU, each rank writing a file of output hashes, and checks all
/// ranks' files are identical (bitwise-equal results). Returns the ranks' outputs.
fn run_and_compare(name: &str, world: i32) -> Vec<std::process::Output> {
    let dir = tmpdir(name);
    let outs = run_ranks(
        name,
        world,
        &[("SYMM_TEST_OUT", dir.to_str().unwrap())],
        &seed().to_string(),
    );
    assert_all_ok(&outs);
    compare_rank_files(&dir, world);
    outs
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_all_reduce_sweep_matches_reference_and_is_bitwise_equal() {
    if let Some(c) = child() {
        return sweep_rank(c);
    }
    let world = gpu_world("gpu_all_reduce_sweep");
    let outs = run_and_compare(
        "gpu_all_reduce_sweep_matches_reference_and_is_bitwise_equal",
        world,
    );
    for o in &outs {
        print!(
            "{}",
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.find("rank ").map(|i| &l[i..]))
                .collect::<Vec<_>>()
                .join("\n")
        );
        println!();
    }
}

fn graph_rank(c: Child) {
    let comm = init(&c);
    let stream = util::stream_create(c.device).unwrap();
    let mut f = out_file(&c);
    let seed: u64 = c.arg.parse().unwrap();
    for (n, algo, in_place) in [
        (4099usize, SYMM_ALGO_ONE_SHOT, true),
        (4099, SYMM_ALGO_ONE_SHOT, false),
        (4099, SYMM_ALGO_ONE_SHOT_LL, true),
        (65_531, SYMM_ALGO_ONE_SHOT_LL, false),
        (1 << 20, SYMM_ALGO_TWO_SHOT, true),
        (1 << 20, SYMM_ALGO_TWO_SHOT, false),
    ] {
        let bytes = n * 2;
        let a = symm_malloc(bytes, c.device, stream as _) as u64;
        let b = symm_malloc(bytes, c.device, stream as _) as u64;
        let recv = if in_place { a } else { b };
        util::capture_begin(c.device, stream).unwrap();
        let st = symm_all_reduce_algo(
            comm,
            algo,
            a as _,
            recv as _,
            n,
            SYMM_BF16,
            SYMM_SUM,
            stream as _,
        );
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "capture: {}", err());
        let graph = util::capture_end(c.device, stream).unwrap();
        let poison = vec![0xFFu8; bytes];
        for replay in 0..reps(1000) {
            let s = seed ^ (replay << 20) ^ n as u64;
            // Stream-ordered uploads: the replay on the same stream sees them.
            let x = encode(SYMM_BF16, &inputs(s, c.rank, n, SYMM_BF16));
            util::htod_async(c.device, a, &x, stream).unwrap();
            if !in_place {
                util::htod_async(c.device, b, &poison, stream).unwrap();
            }
            graph.launch(stream).unwrap();
            util::stream_sync(c.device, stream).unwrap();
            let mut out = vec![0u8; bytes];
            util::dtoh(c.device, &mut out, recv).unwrap();
            let e = rel_err(
                &decode(SYMM_BF16, &out),
                &reference(s, c.world, n, SYMM_BF16, SYMM_SUM),
            );
            assert!(
                e <= tol(SYMM_BF16),
                "replay {replay} n {n} algo {algo}: rel err {e}"
            );
            writeln!(f, "{n} {algo} {in_place} {replay} {:016x}", fnv(&out)).unwrap();
        }
        drop(graph);
        // Eager calls still work after graph replays (epochs stayed in step).
        let st = symm_all_reduce_algo(
            comm,
            algo,
            a as _,
            recv as _,
            n,
            SYMM_BF16,
            SYMM_SUM,
            stream as _,
        );
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
        util::stream_sync(c.device, stream).unwrap();
        symm_free(a as _, bytes, c.device, stream as _);
        symm_free(b as _, bytes, c.device, stream as _);
    }
    destroy(comm);
    println!("rank {}: 6 x {} graph replays correct", c.rank, reps(1000));
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_graph_replays_are_correct() {
    if let Some(c) = child() {
        return graph_rank(c);
    }
    let world = gpu_world("gpu_graph_replays_are_correct");
    run_and_compare("gpu_graph_replays_are_correct", world);
}

fn steady_rank(c: Child) {
    let comm = init(&c);
    let stream = util::stream_create(c.device).unwrap();
    let mut warm = None;
    let t0 = std::time::Instant::now();
    let iters = reps(10_000);
    for it in 0..iters {
        let p = symm_malloc(64 << 10, c.device, stream as _);
        let st = symm_all_reduce(comm, p, p, 32 << 10, SYMM_BF16, SYMM_SUM, stream as _);
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
        symm_free(p, 64 << 10, c.device, stream as _);
        if it == 1 {
            let s = stats(c.device);
            warm = Some((s.peer_mappings, s.physical_creates));
        }
    }
    util::stream_sync(c.device, stream).unwrap();
    let s = stats(c.device);
    assert_eq!(
        Some((s.peer_mappings, s.physical_creates)),
        warm,
        "new mappings or segments after warm-up"
    );
    destroy(comm);
    println!(
        "rank {}: {iters} iterations in {:.2} s, no new mappings or segments",
        c.rank,
        t0.elapsed().as_secs_f64()
    );
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_steady_state_creates_no_new_mappings_or_segments() {
    if let Some(c) = child() {
        return steady_rank(c);
    }
    let world = gpu_world("gpu_steady_state");
    assert_all_ok(&run_ranks(
        "gpu_steady_state_creates_no_new_mappings_or_segments",
        world,
        &[],
        "",
    ));
}

fn killed_rank(c: Child) {
    // The waiting kernel: the barrier one-shot or the LL kernel (no barrier, it waits for data).
    let algo: u32 = c.arg.parse().unwrap();
    let comm = init(&c);
    let stream = util::stream_create(c.device).unwrap();
    let p = symm_malloc(1 << 20, c.device, stream as _);
    assert_eq!(
        symm_all_reduce_algo(comm, algo, p, p, 1024, SYMM_FP32, SYMM_SUM, stream as _),
        symm_status_t::SYMM_SUCCESS
    );
    util::stream_sync(c.device, stream).unwrap();
    if c.rank == 1 {
        // SAFETY: killing ourselves, as a crashed rank would die.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let t0 = std::time::Instant::now();
    // The kernel launches, waits for rank 1 at its barrier, gives up after the timeout and
    // sets the error word; this call or the next one reports it.
    let st = symm_all_reduce_algo(comm, algo, p, p, 1024, SYMM_FP32, SYMM_SUM, stream as _);
    util::stream_sync(c.device, stream).unwrap();
    let st2 = symm_all_reduce_algo(comm, algo, p, p, 1024, SYMM_FP32, SYMM_SUM, stream as _);
    assert!(
        st == symm_status_t::SYMM_ERR_TIMEOUT || st2 == symm_status_t::SYMM_ERR_TIMEOUT,
        "{:?} {:?} {}",
        st,
        st2,
        err()
    );
    let e = err();
    assert!(e.contains("rank 1"), "{e}");
    assert!(t0.elapsed().as_secs_f64() < 20.0, "took {:?}", t0.elapsed());
    destroy(comm);
    println!("rank {}: dead peer reported: {e}", c.rank);
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_killed_rank_is_reported_within_the_timeout() {
    if let Some(c) = child() {
        return killed_rank(c);
    }
    gpu_world("gpu_killed_rank");
    for algo in [SYMM_ALGO_ONE_SHOT, SYMM_ALGO_ONE_SHOT_LL] {
        let outs = run_ranks(
            "gpu_killed_rank_is_reported_within_the_timeout",
            2,
            &[("SYMMALLOC_TIMEOUT_S", "5")],
            &algo.to_string(),
        );
        assert_all_ok(&outs[..1]);
    }
}

fn asymmetric_rank(c: Child) {
    let comm = init(&c);
    let (extra, p) = expect_exchange_asymmetry(&c, comm);
    let q = symm_malloc(4096, c.device, null_mut());
    let r = symm_malloc(4096, c.device, null_mut());
    let buf = if c.rank == 0 { q } else { r };
    let one_shot = |p: *mut std::ffi::c_void| {
        symm_all_reduce_algo(
            comm,
            SYMM_ALGO_ONE_SHOT,
            p,
            p,
            16,
            SYMM_FP32,
            SYMM_SUM,
            null_mut(),
        )
    };
    // Same segment, other offsets: the kernel's first barrier catches it; reported next call.
    let st = one_shot(buf);
    mem::sync_device(c.device).unwrap();
    let st2 = one_shot(q);
    assert!(
        st == symm_status_t::SYMM_ERR_NOT_SYMMETRIC || st2 == symm_status_t::SYMM_ERR_NOT_SYMMETRIC,
        "{st:?} {st2:?} {}",
        err()
    );
    let st3 = one_shot(q);
    assert_eq!(
        st3,
        symm_status_t::SYMM_SUCCESS,
        "usable after the report: {}",
        err()
    );
    mem::sync_device(c.device).unwrap();
    // The LL kernel checks descriptors too (block 0 exchanges them). A peer that ran another
    // call may have left words in the LL buffers, so the communicator stays broken.
    let ll = |p: *mut std::ffi::c_void| {
        symm_all_reduce_algo(
            comm,
            SYMM_ALGO_ONE_SHOT_LL,
            p,
            p,
            16,
            SYMM_FP32,
            SYMM_SUM,
            null_mut(),
        )
    };
    // Memory outside the communicator's own buffers must come through the fatal report intact.
    let sentinel = symm_malloc(4096, c.device, null_mut());
    let pattern: Vec<u8> = (0..4096u32)
        .map(|i| (i * 7 + c.rank as u32) as u8)
        .collect();
    util::htod(c.device, sentinel as u64, &pattern).unwrap();
    let st = ll(buf);
    mem::sync_device(c.device).unwrap();
    let st2 = ll(q);
    assert!(
        st == symm_status_t::SYMM_ERR_NOT_SYMMETRIC || st2 == symm_status_t::SYMM_ERR_NOT_SYMMETRIC,
        "LL: {st:?} {st2:?} {}",
        err()
    );
    assert_eq!(ll(q), symm_status_t::SYMM_ERR_NOT_SYMMETRIC);
    assert!(err().contains("unusable"), "{}", err());
    mem::sync_device(c.device).unwrap();
    let mut back = vec![0u8; 4096];
    util::dtoh(c.device, &mut back, sentinel as u64).unwrap();
    assert!(
        back == pattern,
        "rank {}: the fatal report lost user data",
        c.rank
    );
    if !extra.is_null() {
        symm_free(extra, 3 << 20, 0, null_mut());
    }
    symm_free(p, 8 << 20, c.device, null_mut());
    destroy(comm);
    // The way back: close it and make a new one (another id: the key's first byte flipped on
    // every rank alike), which runs collectives again.
    let mut id = c.id;
    id[8] ^= 0x5a;
    let again = Child {
        rank: c.rank,
        world: c.world,
        device: c.device,
        id,
        arg: String::new(),
    };
    let comm = init(&again);
    let ones: Vec<u8> = (0..16).flat_map(|_| 1f32.to_le_bytes()).collect();
    util::htod(c.device, q as u64, &ones).unwrap();
    let st = symm_all_reduce(comm, q, q, 16, SYMM_FP32, SYMM_SUM, null_mut());
    assert_eq!(
        st,
        symm_status_t::SYMM_SUCCESS,
        "a new communicator: {}",
        err()
    );
    mem::sync_device(c.device).unwrap();
    let mut out = vec![0u8; 64];
    util::dtoh(c.device, &mut out, q as u64).unwrap();
    let want: Vec<u8> = (0..16)
        .flat_map(|_| (c.world as f32).to_le_bytes())
        .collect();
    assert_eq!(out, want, "rank {}: the new communicator's sum", c.rank);
    symm_free(sentinel, 4096, c.device, null_mut());
    destroy(comm);
    println!("rank {}: asymmetry reported on every rank", c.rank);
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_asymmetric_buffers_fail_on_every_rank() {
    if let Some(c) = child() {
        return asymmetric_rank(c);
    }
    gpu_world("gpu_asymmetric");
    assert_all_ok(&run_ranks(
        "gpu_asymmetric_buffers_fail_on_every_rank",
        2,
        &[("SYMMALLOC_TIMEOUT_S", "10")],
        "",
    ));
}

/// bf16 inputs with all-ones elements (a NaN, and the LL kernel's "not arrived" word) and
/// negative zeros, reduced by the LL kernel and by two-shot.
fn ll_special_rank(c: Child) {
    let comm = init(&c);
    let stream = util::stream_create(c.device).unwrap();
    let n = 10_007usize;
    let mut x = encode(SYMM_BF16, &inputs(seed(), c.rank, n, SYMM_BF16));
    for i in 0..n {
        match i % 5 {
            0 if c.rank == 0 => x[2 * i..2 * i + 2].copy_from_slice(&[0xff, 0xff]),
            1 => x[2 * i..2 * i + 2].copy_from_slice(&0x8000u16.to_le_bytes()),
            _ => {}
        }
    }
    let bytes = 2 * n;
    let (a, b) = (
        symm_malloc(bytes, c.device, stream as _) as u64,
        symm_malloc(bytes, c.device, stream as _) as u64,
    );
    let mut results = Vec::new();
    for algo in [SYMM_ALGO_ONE_SHOT_LL, SYMM_ALGO_TWO_SHOT] {
        util::htod_async(c.device, a, &x, stream).unwrap();
        util::htod_async(c.device, b, &vec![0x5au8; bytes], stream).unwrap();
        let st = symm_all_reduce_algo(
            comm,
            algo,
            a as _,
            b as _,
            n,
            SYMM_BF16,
            SYMM_SUM,
            stream as _,
        );
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
        util::stream_sync(c.device, stream).unwrap();
        let mut out = vec![0u8; bytes];
        util::dtoh(c.device, &mut out, b).unwrap();
        results.push(out);
    }
    let word = |o: &[u8], i: usize| u16::from_le_bytes([o[2 * i], o[2 * i + 1]]);
    for i in 0..n {
        let (ll, two) = (word(&results[0], i), word(&results[1], i));
        let nan = |w: u16| bf16_to_f32(w).is_nan();
        match i % 5 {
            0 => assert!(nan(ll) && nan(two), "element {i}: {ll:#x} / {two:#x}"),
            1 => assert_eq!((ll, two), (0x8000, 0x8000), "element {i}: -0 + -0 is -0"),
            _ => assert_eq!(ll, two, "element {i}: LL and two-shot differ"),
        }
    }
    symm_free(a as _, bytes, c.device, stream as _);
    symm_free(b as _, bytes, c.device, stream as _);
    destroy(comm);
    println!("rank {}: LL special values match two-shot", c.rank);
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_ll_all_ones_and_negative_zero_inputs() {
    if let Some(c) = child() {
        return ll_special_rank(c);
    }
    let world = gpu_world("gpu_ll_special_values");
    assert_all_ok(&run_ranks(
        "gpu_ll_all_ones_and_negative_zero_inputs",
        world,
        &[],
        "",
    ));
}

/// One communicator, two streams, no ordering by the caller: each stream reduces its own
/// inputs into a fresh output per call, issued back to back and alternating between the
/// streams, with no synchronization between them. Without the library's ordering
/// (src/comm/collective/streams.rs) kernels of both streams would run at once on one rank and share
/// barrier epochs, LL counters, LL buffers and the staging scratch: a wrong sum or a wait that
/// never ends. Every output is checked against the float64 reference.
fn two_streams_rank(c: Child) {
    let comm = init(&c);
    let streams = [
        util::stream_create(c.device).unwrap(),
        util::stream_create(c.device).unwrap(),
    ];
    let seed: u64 = c.arg.parse().unwrap();
    let mut f = out_file(&c);
    const CALLS: usize = 12;
    let ll = ll_max(c.world) / 2; // bf16 elements that fit the LL kernel
                                  // (algorithm on each stream, elements, stream 0's input outside the heap = staged)
    let phases = [
        (
            [SYMM_ALGO_ONE_SHOT_LL, SYMM_ALGO_ONE_SHOT_LL],
            65_531.min(ll),
            false,
        ),
        ([SYMM_ALGO_ONE_SHOT, SYMM_ALGO_TWO_SHOT], 300_007, false),
        ([SYMM_ALGO_AUTO, SYMM_ALGO_TWO_SHOT], 262_147, true),
    ];
    let mut checked = 0;
    for (phase, &(algos, n, staged)) in phases.iter().enumerate() {
        let bytes = n * 2;
        let alloc = |j: usize| -> u64 {
            if staged && j == 0 {
                util::raw_alloc(c.device, bytes).unwrap()
            } else {
                let p = symm_malloc(bytes, c.device, null_mut()) as u64;
                assert!(p != 0, "{}", err());
                p
            }
        };
        let ins: Vec<[u64; 2]> = (0..CALLS).map(|_| [alloc(0), alloc(1)]).collect();
        let outs: Vec<[u64; 2]> = (0..CALLS)
            .map(|_| {
                let p = [0, 1].map(|_| symm_malloc(bytes, c.device, null_mut()) as u64);
                assert!(p[0] != 0 && p[1] != 0, "{}", err());
                p
            })
            .collect();
        for round in 0..3u64 {
            let sd = |k: usize, j: usize| {
                seed ^ (phase as u64) << 40 ^ round << 32 ^ (k as u64) << 8 ^ j as u64
            };
            // Inputs and poisoned outputs first, so the collectives below go back to back.
            for k in 0..CALLS {
                for j in 0..2 {
                    let x = encode(SYMM_BF16, &inputs(sd(k, j), c.rank, n, SYMM_BF16));
                    util::htod(c.device, ins[k][j], &x).unwrap();
                    util::htod(c.device, outs[k][j], &vec![0xFFu8; bytes]).unwrap();
                }
            }
            mem::sync_device(c.device).unwrap();
            for k in 0..CALLS {
                for j in 0..2 {
                    let st = symm_all_reduce_algo(
                        comm,
                        algos[j],
                        ins[k][j] as _,
                        outs[k][j] as _,
                        n,
                        SYMM_BF16,
                        SYMM_SUM,
                        streams[j] as _,
                    );
                    assert_eq!(
                        st,
                        symm_status_t::SYMM_SUCCESS,
                        "phase {phase} call {k} stream {j}: {}",
                        err()
                    );
                }
            }
            for s in streams {
                util::stream_sync(c.device, s).unwrap();
            }
            for (k, pair) in outs.iter().enumerate() {
                for (j, &o) in pair.iter().enumerate() {
                    let mut out = vec![0u8; bytes];
                    util::dtoh(c.device, &mut out, o).unwrap();
                    let e = rel_err(
                        &decode(SYMM_BF16, &out),
                        &reference(sd(k, j), c.world, n, SYMM_BF16, SYMM_SUM),
                    );
                    assert!(
                        e <= tol(SYMM_BF16),
                        "phase {phase} round {round} call {k} stream {j} ({}): rel err {e}",
                        algos[j]
                    );
                    writeln!(f, "{phase} {round} {k} {j} {:016x}", fnv(&out)).unwrap();
                    checked += 1;
                }
            }
        }
        for k in 0..CALLS {
            for j in 0..2 {
                if !(staged && j == 0) {
                    symm_free(ins[k][j] as _, bytes, c.device, null_mut());
                }
                symm_free(outs[k][j] as _, bytes, c.device, null_mut());
            }
        }
    }
    destroy(comm);
    println!(
        "rank {}: {checked} outputs of two unordered streams correct",
        c.rank
    );
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_two_streams_one_communicator_never_mix() {
    if let Some(c) = child() {
        return two_streams_rank(c);
    }
    let world = gpu_world("gpu_two_streams");
    run_and_compare("gpu_two_streams_one_communicator_never_mix", world);
}

/// A graph of 20 collectives replayed after a peer died: the first kernel's wait times out and
/// aborts the communicator (the abort word, device memory), so the other 19 kernels return at
/// once instead of each waiting out the timeout; the next call names the dead rank.
fn killed_graph_rank(c: Child) {
    let algo: u32 = c.arg.parse().unwrap();
    let comm = init(&c);
    let stream = util::stream_create(c.device).unwrap();
    let p = symm_malloc(1 << 20, c.device, stream as _);
    util::capture_begin(c.device, stream).unwrap();
    for _ in 0..20 {
        let st = symm_all_reduce_algo(comm, algo, p, p, 4096, SYMM_FP32, SYMM_SUM, stream as _);
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "capture: {}", err());
    }
    let graph = util::capture_end(c.device, stream).unwrap();
    graph.launch(stream).unwrap();
    util::stream_sync(c.device, stream).unwrap();
    if c.rank == 1 {
        // SAFETY: killing ourselves, as a crashed rank would die.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let t0 = std::time::Instant::now();
    graph.launch(stream).unwrap();
    util::stream_sync(c.device, stream).unwrap();
    let replay = t0.elapsed().as_secs_f64();
    // SYMMALLOC_TIMEOUT_S=3: one timeout, not twenty.
    assert!(
        (2.5..9.0).contains(&replay),
        "the replay took {replay:.2} s"
    );
    let st = symm_all_reduce_algo(comm, algo, p, p, 4096, SYMM_FP32, SYMM_SUM, stream as _);
    assert_eq!(st, symm_status_t::SYMM_ERR_TIMEOUT, "{}", err());
    let e = err();
    assert!(e.contains("for rank 1"), "{e}");
    drop(graph);
    destroy(comm);
    println!("rank {}: replay stopped after {replay:.2} s: {e}", c.rank);
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_dead_peer_stops_a_replayed_graph_after_one_timeout() {
    if let Some(c) = child() {
        return killed_graph_rank(c);
    }
    gpu_world("gpu_killed_graph");
    for algo in [SYMM_ALGO_ONE_SHOT, SYMM_ALGO_ONE_SHOT_LL] {
        let outs = run_ranks(
            "gpu_dead_peer_stops_a_replayed_graph_after_one_timeout",
            2,
            &[("SYMMALLOC_TIMEOUT_S", "3")],
            &algo.to_string(),
        );
        assert_all_ok(&outs[..1]);
    }
}

/// A segment freed and emptied on every rank gives its memory back to the driver on every GPU
/// once each peer's next call has unmapped its import; the same offsets then come back as a
/// new segment that collectives use correctly (a kernel never touches the unmapped one).
fn release_rank(c: Child) {
    let comm = init(&c);
    let stream = util::stream_create(c.device).unwrap();
    let call = |what: &str| {
        let st = symm_barrier(comm, stream as _);
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{what}: {}", err());
        util::stream_sync(c.device, stream).unwrap();
    };
    call("warm-up");
    symm_empty_cache();
    let free = || symmalloc::cuda::driver::mem_info(c.device).unwrap().0;
    let free0 = free();
    // Ranks that share a GPU (SYMMALLOC_SHARED_GPU) see each other's memory in mem_info: no rank
    // allocates before every rank has measured.
    call("measured");
    let (big, n) = (1usize << 30, 1usize << 20); // a 1 GiB segment; 1M bf16 elements reduced
    let mut first = 0;
    for round in 0..3i32 {
        let p = symm_malloc(big, c.device, stream as _);
        assert!(!p.is_null(), "{}", err());
        if round == 0 {
            first = p as u64;
        }
        assert_eq!(p as u64, first, "the offset comes back");
        let v = (c.rank + 1 + round) as f32;
        util::htod_async(c.device, p as u64, &encode(SYMM_BF16, &vec![v; n]), stream).unwrap();
        let st = symm_all_reduce(comm, p, p, n, SYMM_BF16, SYMM_SUM, stream as _);
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
        let mut got = vec![0u8; 2 * n];
        util::stream_sync(c.device, stream).unwrap();
        util::dtoh(c.device, &mut got, p as u64).unwrap();
        let want: f32 = (0..c.world).map(|r| (r + 1 + round) as f32).sum();
        assert!(
            decode(SYMM_BF16, &got).iter().all(|&x| x == want),
            "round {round}: wrong sum"
        );
        let held = free0.saturating_sub(free()) >> 20;
        assert!(
            held >= 1000,
            "round {round}: the segment holds only {held} MiB"
        );
        symm_free(p, big, c.device, stream as _);
        util::stream_sync(c.device, stream).unwrap();
        symm_empty_cache();
        call("after the release"); // every rank released before launching this one
        call("the next call"); // whose start unmaps the peers' segments here
        let held = free0.saturating_sub(free()) >> 20;
        assert!(
            held <= 64,
            "rank {}, round {round}: {held} MiB of device memory did not come back",
            c.rank
        );
        call("measured");
    }
    destroy(comm);
    println!(
        "rank {}: 3 rounds of a 1 GiB segment reduced, released and returned to the driver on every GPU",
        c.rank
    );
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_released_segments_return_to_the_driver_on_every_rank() {
    if let Some(c) = child() {
        return release_rank(c);
    }
    let world = gpu_world("gpu_released_segments");
    assert_all_ok(&run_ranks(
        "gpu_released_segments_return_to_the_driver_on_every_rank",
        world,
        &[],
        "",
    ));
}

/// A rank's process uses its own GPU only: no primary context on any other GPU (each costs
/// about 500 MiB of that GPU's memory; retaining every device's at start-up put one on every GPU
/// for every rank, the 0.51 GiB per GPU of bench/ddp_memory.py).
fn contexts_rank(c: Child) {
    let comm = init(&c);
    let stream = util::stream_create(c.device).unwrap();
    let p = symm_malloc(1 << 20, c.device, stream as _);
    let st = symm_all_reduce(comm, p, p, 1 << 18, SYMM_BF16, SYMM_SUM, stream as _);
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    util::stream_sync(c.device, stream).unwrap();
    let drv = symmalloc::cuda::driver::driver().unwrap();
    for d in 0..drv.devices.len() as i32 {
        let active = drv.primary_context_active(d).unwrap();
        assert_eq!(
            active,
            d == c.device,
            "rank {}: device {d}'s primary context active: {active}",
            c.rank
        );
    }
    symm_free(p, 1 << 20, c.device, stream as _);
    destroy(comm);
    println!("rank {}: a context on its own GPU only", c.rank);
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_ranks_make_no_context_on_other_gpus() {
    if let Some(c) = child() {
        return contexts_rank(c);
    }
    let world = gpu_world("gpu_ranks_make_no_context_on_other_gpus");
    assert_all_ok(&run_ranks(
        "gpu_ranks_make_no_context_on_other_gpus",
        world,
        &[],
        "",
    ));
}
