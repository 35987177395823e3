//! Determinism as a guarantee (docs/DESIGN.md, "Determinism"): results are bitwise identical on
//! every rank, and independent of the algorithm, of the message they travel in and of the
//! fused call's row count.
//!
//! Each rank reduces the same elements (fresh random data, never zeros) with every all-reduce
//! algorithm (AUTO, one-shot, two-shot, one-shot LL), alone and at an offset inside a call four
//! times larger, in place and out of place, and checks that every result has the same bits.
//! The fused all-reduce + residual + RMSNorm (bf16 and fp16, hidden 1024-16384, including
//! widths whose vector count is not a multiple of 32) runs over the first 1, 3, 8, ... 2048 rows
//! of one set of rows and over single rows alone, and every row must have the same bits in every
//! call: the kernels add a row's sum of squares in one canonical order whatever their block,
//! cluster or row count (kernels/rms_norm.cuh). The GPU test runs three times, with the default
//! LL threshold, 64 KiB and 0 (so the same rows go through the LL, one-vector, cluster and
//! barrier kernels), and the fused rows' hash must be the same in every run and on every rank.
//! The FP8 outputs of the fused call (static, per-token and per-group scales) are held to the
//! same: their bytes, the residual and the scales a row gets do not depend on the call.
//! Each rank prints a hash of all its bits; the parent checks every rank printed the
//! same. The host backend runs on CI at 2 and 3 ranks; the GPU test (`--include-ignored`) on
//! every GPU, or at `SYMM_TEST_RANKS=N` ranks sharing them.

mod common;
use common::*;
use std::ptr::null_mut;
use symmalloc::cuda::util;
use symmalloc::ffi::quant::symm_all_reduce_add_rms_norm_quant;
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
    if len == 0 {
        return out;
    }
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

/// The fused call's rows for one dtype and `hidden`, with a bf16/fp16 output (`quant` None) or
/// an FP8 one (`symm_all_reduce_add_rms_norm_quant` in that mode; a static scale of 0.01): every
/// rank uploads `max` rows of its x, and the same residual and weight on every rank; a call over
/// the first `tokens` rows (each count of `counts`) and a call over one row `r` alone (each of
/// `alone`, at that row's offset) must give every row the bits it has in the call over all
/// `max` rows: `out`, the new residual and the row's scales alike. Returns those bits.
#[allow(clippy::too_many_arguments)]
fn fused_rows(
    c: &Child,
    comm: *mut symm_comm_t,
    seed: u64,
    dtype: u32,
    hidden: usize,
    counts: &[usize],
    alone: &[usize],
    quant: Option<symm_quant_t>,
) -> Vec<u8> {
    let max = *counts.iter().max().unwrap();
    let row = hidden * esize(dtype);
    let bytes = max * row;
    // Per row: output bytes, and scale bytes written (none for a bf16 output or a static scale).
    let out_row = if quant.is_some() { hidden } else { row };
    let scale_row = match quant {
        Some(SYMM_QUANT_FP8_PER_TOKEN) => 4,
        Some(SYMM_QUANT_FP8_PER_GROUP_128) => hidden / 128 * 4,
        _ => 0,
    };
    let [x, res, out, w, scale] = [bytes, bytes, max * out_row, row, max * scale_row + 16]
        .map(|b| symm_malloc(b, c.device, null_mut()) as u64);
    assert!([x, res, out, w, scale].iter().all(|&p| p != 0), "{}", err());
    let seed = seed ^ (hidden as u64) << 20;
    put(c, x, &data(seed, c.rank, max * hidden, dtype));
    let rv = data(seed ^ 8, 100, max * hidden, dtype);
    put(c, w, &data(seed ^ 2, 200, hidden, dtype));
    // Rows t0 .. t0 + tokens as their own call (residual fresh, out and scales poisoned): their
    // out, new residual and scale bits.
    let call = |t0: usize, tokens: usize| {
        let (at, n) = ((t0 * row) as u64, tokens * row);
        let (oat, on) = ((t0 * out_row) as u64, tokens * out_row);
        let (sat, sn) = ((t0 * scale_row) as u64, tokens * scale_row);
        put(c, res + at, &rv[t0 * row..t0 * row + n]);
        put(c, out + oat, &vec![0xFF; on]);
        let what = format!(
            "fused rows {t0}..{} of [{max}, {hidden}] dtype {dtype} quant {quant:?}",
            t0 + tokens
        );
        let st = match quant {
            None => symm_all_reduce_add_rms_norm(
                comm,
                (x + at) as _,
                (res + at) as _,
                w as _,
                (out + oat) as _,
                tokens,
                hidden,
                1e-6,
                dtype,
                null_mut(),
            ),
            Some(q) => {
                if q == SYMM_QUANT_FP8_STATIC {
                    put(c, scale, &0.01f32.to_le_bytes());
                } else {
                    put(c, scale + sat, &vec![0xFF; sn]);
                }
                symm_all_reduce_add_rms_norm_quant(
                    comm,
                    (x + at) as _,
                    (res + at) as _,
                    w as _,
                    (out + oat) as _,
                    (scale + if q == SYMM_QUANT_FP8_STATIC { 0 } else { sat }) as _,
                    tokens,
                    hidden,
                    1e-6,
                    dtype,
                    q,
                    null_mut(),
                )
            }
        };
        ok(st, &what);
        [
            get(c, out + oat, on),
            get(c, res + at, n),
            get(c, scale + sat, sn),
        ]
    };
    let all = call(0, max);
    let same = |t0: usize, tokens: usize, got: [Vec<u8>; 3]| {
        let sizes = [out_row, row, scale_row];
        for (k, what) in ["out", "residual", "scale"].iter().enumerate() {
            let per = sizes[k];
            let want = &all[k][t0 * per..(t0 + tokens) * per];
            if let Some(i) = (0..got[k].len()).find(|&i| got[k][i] != want[i]) {
                panic!(
                    "rank {}: fused dtype {dtype} hidden {hidden} quant {quant:?}: row {} of a \
                     call over rows {t0}..{} has other {what} bits than in the call over {max} \
                     rows ({} of {} bytes differ)",
                    c.rank,
                    t0 + i / per,
                    t0 + tokens,
                    differing(&got[k], want),
                    want.len()
                );
            }
        }
    };
    for &t in counts.iter().filter(|&&t| t != max) {
        same(0, t, call(0, t));
    }
    for &r in alone {
        same(r, 1, call(r, 1));
    }
    for (p, b) in [
        (x, bytes),
        (res, bytes),
        (out, max * out_row),
        (w, row),
        (scale, max * scale_row + 16),
    ] {
        symm_free(p as _, b, c.device, null_mut());
    }
    all.concat()
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
    // The fused call: widths from 1024 to 16384 with vector counts that are not multiples of
    // 32 (2056, 5000, 7176, 16376); row counts from 1 to 2048 (a tenth of the work on the host
    // backend, which sums a row the same way whatever the call). Counts up to 64 take the LL
    // kernels (one vector or four per thread, clusters of 2-8 on sm_90), larger ones the
    // barrier kernel, and the parent runs the whole test again with the LL threshold lowered
    // (64 KiB) and at 0 (every call on the barrier kernel).
    let (hiddens, counts): (&[usize], &[usize]) = if on_host() {
        (&[1024, 2056, 8192, 16376], &[1, 3, 64, 130])
    } else {
        (
            &[
                1024, 2056, 4096, 5000, 6144, 7176, 8192, 12288, 16376, 16384,
            ],
            &[1, 3, 8, 33, 64, 129, 300, 2048],
        )
    };
    let mut fused = Vec::new();
    let max = *counts.iter().max().unwrap();
    let alone = [0, 1, 37, max / 2 + 1, max - 1];
    for dtype in [SYMM_BF16, SYMM_FP16] {
        for &hidden in hiddens {
            fused.extend(fused_rows(
                &c, comm, seed, dtype, hidden, counts, &alone, None,
            ));
        }
        // The FP8 outputs (kernels/quant.cuh): the same rows, every mode, at widths that are
        // multiples of 128 (on GPUs four of them: one vector per thread, clusters of 4 blocks
        // of 128 threads or one block per row, clusters of 3, and clusters of 8 or four vectors
        // per thread).
        let fp8_widths: &[usize] = if on_host() {
            &[1024, 8192]
        } else {
            &[1024, 4096, 6144, 16384]
        };
        for &hidden in fp8_widths {
            for q in [
                SYMM_QUANT_FP8_STATIC,
                SYMM_QUANT_FP8_PER_TOKEN,
                SYMM_QUANT_FP8_PER_GROUP_128,
            ] {
                fused.extend(fused_rows(
                    &c,
                    comm,
                    seed,
                    dtype,
                    hidden,
                    counts,
                    &alone,
                    Some(q),
                ));
            }
        }
    }
    all.extend(&fused);
    println!("rank {}: fused hash {:016x}", c.rank, fnv(&fused));
    println!("rank {}: outputs hash {:016x}", c.rank, fnv(&all));
    destroy(comm);
}

/// Every rank's line `rank R: fused hash H` of every run: one H (the fused rows' bits do not
/// depend on the kernel the thresholds of a run send them to).
fn assert_same_fused_hash(runs: &[Vec<std::process::Output>]) {
    let hashes: Vec<String> = runs
        .iter()
        .flatten()
        .map(|o| {
            let out = String::from_utf8_lossy(&o.stdout);
            let l = out
                .lines()
                .find(|l| l.contains("fused hash"))
                .expect("a rank printed no fused hash");
            l.split("fused hash ").nth(1).unwrap().to_string()
        })
        .collect();
    assert!(
        hashes.iter().all(|h| *h == hashes[0]),
        "the fused rows' bits differ between runs or ranks: {hashes:?}"
    );
}

fn run(test: &str, world: i32, env: &[(&str, &str)], seed: u64) -> Vec<std::process::Output> {
    let outs = run_ranks(test, world, env, &seed.to_string());
    assert_all_ok(&outs);
    assert_same_output_hash(&outs);
    outs
}

#[test]
fn host_results_are_bitwise_identical_across_ranks_algorithms_and_sizes() {
    if let Some(c) = child() {
        return bitwise_rank(c);
    }
    let seed = seed();
    let runs: Vec<_> = [2, 3]
        .iter()
        .map(|&world| {
            run(
                "host_results_are_bitwise_identical_across_ranks_algorithms_and_sizes",
                world,
                &[HOST],
                seed,
            )
        })
        .collect();
    // Only within a world: another world adds other addends.
    for r in &runs {
        assert_same_fused_hash(std::slice::from_ref(r));
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
    // Default thresholds: the fused calls up to 64 rows take an LL kernel; 64 KiB sends the
    // wider ones to the barrier kernel, 0 every one. Same seed: same rows, same bits.
    let seed = seed();
    let runs: Vec<_> = ["", "64K", "0"]
        .iter()
        .map(|&ll| {
            let env: &[(&str, &str)] = if ll.is_empty() {
                &[]
            } else {
                &[("SYMMALLOC_LL_MAX_BYTES", ll)]
            };
            run(name, world, env, seed)
        })
        .collect();
    assert_same_fused_hash(&runs);
}
