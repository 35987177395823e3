//! Determinism as a guarantee (docs/DESIGN.md, "Determinism"): results are bitwise identical on
//! every rank, and independent of the algorithm, of the message they travel in and of the
//! fused call's row count.
//!
//! Each rank reduces the same elements (fresh random data, never zeros) with every all-reduce
//! algorithm (AUTO, one-shot, two-shot, one-shot LL), alone and at an offset inside a call four
//! times larger, in place and out of place, and checks that every result has the same bits.
//! The fused all-reduce + residual + RMSNorm computes the same row alone, inside 8 rows and
//! inside 64 rows; every rank must get the same bits for all three (hashed). Whether the row's
//! bits are also the same across the three calls depends on the kernel each call takes: the
//! host backend sums a row in one order whatever the call (asserted, on CI); on a GPU the LL,
//! cluster and barrier kernels split a row's sum of squares differently (blocks, clusters of
//! 2-8), so a row may differ in its last bits between calls that take different kernels
//! (measured: fp16 [64, 8192] against [1, 8192] at 2 ranks, clusters of 2 against 4). The GPU
//! test reports those rows and does not assert them (docs/DESIGN.md, "Determinism", states
//! the limit). Each rank prints a hash of its bits; the parent checks every rank printed the
//! same. The host backend runs on CI at 2 and 3 ranks; the GPU test (`--include-ignored`) on
//! every GPU, or at `SYMM_TEST_RANKS=N` ranks sharing them.

mod common;
use common::*;
use std::ptr::null_mut;
use symmalloc::cuda::util;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

fn on_host() -> bool {
    symmalloc::heap::global().unwrap().backend().name() == "host"
}

fn put(c: &Child, dst: u64, bytes: &[u8]) {
    if on_host() {
        // SAFETY: dst is a live host-backend block of at least bytes.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst as *mut u8, bytes.len()) };
    } else {
        util::htod(c.device, dst, bytes).unwrap();
    }
}

fn get(c: &Child, src: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    if on_host() {
        // SAFETY: src is a live host-backend block of at least len bytes.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), len) };
    } else {
        symmalloc::cuda::mem::sync_device(c.device).unwrap();
        util::dtoh(c.device, &mut out, src).unwrap();
    }
    out
}

fn ok(st: symm_status_t, what: &str) {
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{what}: {}", err());
}

/// Random elements of a type (never zeros), as bytes.
fn data(seed: u64, rank: i32, n: usize, dtype: u32) -> Vec<u8> {
    encode(dtype, &inputs(seed, rank, n, dtype))
}

/// The bits of `n` elements all-reduced with `algo`: alone (`embed` false) or at element `n`
/// of a call of 4n elements whose other elements are random too.
#[allow(clippy::too_many_arguments)]
fn reduce(
    c: &Child,
    comm: *mut symm_comm_t,
    seed: u64,
    n: usize,
    dtype: u32,
    algo: u32,
    embed: bool,
    in_place: bool,
) -> Vec<u8> {
    let es = esize(dtype);
    let total = if embed { 4 * n } else { n };
    let at = if embed { n * es } else { 0 };
    let send = symm_malloc(total * es, c.device, null_mut()) as u64;
    let recv = symm_malloc(total * es, c.device, null_mut()) as u64;
    assert!(send != 0 && recv != 0, "{}", err());
    let mut x = data(seed ^ 0x5eed, c.rank, total, dtype);
    x[at..at + n * es].copy_from_slice(&data(seed, c.rank, n, dtype));
    put(c, send, &x);
    put(c, recv, &vec![0xFF; total * es]);
    let dst = if in_place { send } else { recv };
    ok(
        symm_all_reduce_algo(
            comm,
            algo,
            send as _,
            dst as _,
            total,
            dtype,
            SYMM_SUM,
            null_mut(),
        ),
        &format!("all_reduce algo {algo} n {total} dtype {dtype}"),
    );
    let bits = get(c, dst + at as u64, n * es);
    symm_free(send as _, total * es, c.device, null_mut());
    symm_free(recv as _, total * es, c.device, null_mut());
    bits
}

/// Row `row` (of `hidden`) of the fused call over `tokens` rows, where that row's x, residual
/// and the weight are the same whatever `tokens` is: its `out` and new `residual` bits.
fn fused_row(
    c: &Child,
    comm: *mut symm_comm_t,
    seed: u64,
    tokens: usize,
    row: usize,
    hidden: usize,
    dtype: u32,
) -> Vec<u8> {
    let (n, es) = (tokens * hidden, esize(dtype));
    let bytes = n * es;
    let [x, res, out, w] =
        [bytes, bytes, bytes, hidden * es].map(|b| symm_malloc(b, c.device, null_mut()) as u64);
    let mut xv = data(seed ^ 7, c.rank, n, dtype);
    let mut rv = data(seed ^ 8, 100, n, dtype);
    let r = row * hidden * es..(row + 1) * hidden * es;
    xv[r.clone()].copy_from_slice(&data(seed, c.rank, hidden, dtype));
    rv[r.clone()].copy_from_slice(&data(seed ^ 1, 100, hidden, dtype));
    put(c, x, &xv);
    put(c, res, &rv);
    put(c, w, &data(seed ^ 2, 200, hidden, dtype));
    put(c, out, &vec![0xFF; bytes]);
    ok(
        symm_all_reduce_add_rms_norm(
            comm,
            x as _,
            res as _,
            w as _,
            out as _,
            tokens,
            hidden,
            1e-6,
            dtype,
            null_mut(),
        ),
        &format!("fused [{tokens}, {hidden}] dtype {dtype}"),
    );
    let mut bits = get(c, out + r.start as u64, hidden * es);
    bits.extend(get(c, res + r.start as u64, hidden * es));
    for (p, b) in [(x, bytes), (res, bytes), (out, bytes), (w, hidden * es)] {
        symm_free(p as _, b, c.device, null_mut());
    }
    bits
}

fn differing(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count()
}

fn bitwise_rank(c: Child) {
    let comm = init(&c);
    let seed: u64 = c.arg.parse().unwrap();
    let mut all = Vec::new();
    for (dtype, _) in dtypes() {
        // An odd count: a vector tail, and every algorithm's element path.
        let n = 4096 + 3;
        let alone = reduce(&c, comm, seed, n, dtype, SYMM_ALGO_AUTO, false, true);
        for algo in [
            SYMM_ALGO_AUTO,
            SYMM_ALGO_ONE_SHOT,
            SYMM_ALGO_TWO_SHOT,
            SYMM_ALGO_ONE_SHOT_LL,
        ] {
            for embed in [false, true] {
                for in_place in [true, false] {
                    let got = reduce(&c, comm, seed, n, dtype, algo, embed, in_place);
                    assert!(
                        got == alone,
                        "rank {}: dtype {dtype} algo {algo} embed {embed} in place {in_place}: \
                         the bits differ from AUTO's on the message alone",
                        c.rank
                    );
                }
            }
        }
        all.extend(alone);
    }
    for dtype in [SYMM_BF16, SYMM_FP16] {
        // 4096: one block per row; 8192: clusters on sm_90; 1 row, 8 and 64 rows; 64 rows of
        // 8192 stay within the LL threshold at 2 ranks, and a lowered threshold (the test's
        // environment) sends the wider calls to the barrier kernel.
        for hidden in [4096, 8192] {
            let one = fused_row(&c, comm, seed, 1, 0, hidden, dtype);
            for (tokens, row) in [(8, 5), (64, 37)] {
                let got = fused_row(&c, comm, seed, tokens, row, hidden, dtype);
                if got != one {
                    let what = format!(
                        "rank {}: fused dtype {dtype} hidden {hidden}: row {row} of {tokens} \
                         differs from the row alone",
                        c.rank
                    );
                    // The host backend sums a row in one order whatever the call; GPU kernels
                    // of different shapes do not (the module header).
                    assert!(!on_host(), "{what}");
                    println!("{what} ({} of {} bytes)", differing(&got, &one), got.len());
                }
                all.extend(got);
            }
            all.extend(one);
        }
    }
    println!("rank {}: outputs hash {:016x}", c.rank, fnv(&all));
    destroy(comm);
}

fn run(test: &str, world: i32, env: &[(&str, &str)]) {
    let seed = seed();
    let outs = run_ranks(test, world, env, &seed.to_string());
    assert_all_ok(&outs);
    assert_same_output_hash(&outs);
}

#[test]
fn host_results_are_bitwise_identical_across_ranks_algorithms_and_sizes() {
    if let Some(c) = child() {
        return bitwise_rank(c);
    }
    for world in [2, 3] {
        run(
            "host_results_are_bitwise_identical_across_ranks_algorithms_and_sizes",
            world,
            &[HOST],
        );
    }
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_results_are_bitwise_identical_across_ranks_algorithms_and_sizes() {
    if let Some(c) = child() {
        return bitwise_rank(c);
    }
    let name = "gpu_results_are_bitwise_identical_across_ranks_algorithms_and_sizes";
    let world = gpu_world(name);
    // Default thresholds: every fused call here takes an LL kernel; 64 KiB sends the wider
    // ones to the barrier kernel.
    run(name, world, &[]);
    run(name, world, &[("SYMMALLOC_LL_MAX_BYTES", "64K")]);
}
