//! Reduce-scatter, all-gather and the fused all-reduce + residual + RMSNorm on real GPUs, one process per GPU (run on the device machine;
//! fails without two GPUs, and is #[ignore]d so `cargo test` lists it as not run). Fresh random
//! inputs for every case, outputs poisoned first; reduce-scatter against a float64 reference,
//! all-gather bit for bit; odd and even counts up to 2^20 + 3, every type and op, apart, in place
//! (NCCL's rule) and staged from outside the heap; then 200 graph replays of each on fresh data.

mod common;
use common::*;
use symmalloc::cuda::util;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

const GATHER: u32 = u32::MAX; // in the op column: all-gather

#[derive(Clone, Copy, PartialEq, Debug)]
enum Layout {
    Apart,
    Same,
    Staged,
    OwnOdd,
}

/// Rank r's slice of the collective's result, as every rank computes it from the seeds.
fn expected(seed: u64, world: i32, rank: usize, n: usize, dtype: u32, op: u32) -> Vec<f64> {
    if op == GATHER {
        (0..world)
            .flat_map(|r| inputs(seed, r, n, dtype).into_iter().map(|v| v as f64))
            .collect()
    } else {
        reference(seed, world, world as usize * n, dtype, op)[rank * n..(rank + 1) * n].to_vec()
    }
}

/// One call; returns the output bytes.
#[allow(clippy::too_many_arguments)]
fn run_case(
    c: &Child,
    comm: *mut symm_comm_t,
    stream: u64,
    seed: u64,
    n: usize,
    dtype: u32,
    op: u32,
    layout: Layout,
) -> Vec<u8> {
    let (es, world, rank) = (esize(dtype), c.world as usize, c.rank as usize);
    let big = world * n * es;
    let heap = symm_malloc(big, c.device, stream as _) as u64;
    let other = symm_malloc(big, c.device, stream as _) as u64;
    assert!(heap != 0 && other != 0, "{}", err());
    let outside = util::raw_alloc(c.device, big).unwrap();
    let gather = op == GATHER;
    let slot = (rank * n * es) as u64;
    let (send, recv) = match (layout, gather) {
        (Layout::Apart, _) => (heap, other),
        (Layout::Same, false) => (heap, heap + slot),
        (Layout::Same, true) => (heap + slot, heap),
        (Layout::Staged, _) => (outside, other),
        // The buffer only this rank touches one element off 16-byte alignment on odd ranks:
        // ranks must still pick one kernel (the shared buffer decides), or they would wait for
        // each other until the timeout.
        (Layout::OwnOdd, false) => (heap, other + (rank % 2 * es) as u64),
        (Layout::OwnOdd, true) => (other + (rank % 2 * es) as u64, heap),
    };
    let (send_n, recv_n) = if gather {
        (n, world * n)
    } else {
        (world * n, n)
    };
    let x = encode(dtype, &inputs(seed, c.rank, send_n, dtype));
    let poison = vec![0xFFu8; recv_n * es];
    if layout != Layout::Same {
        util::htod_async(c.device, recv, &poison, stream).unwrap();
    }
    util::htod_async(c.device, send, &x, stream).unwrap();
    let st = if gather {
        symm_all_gather(comm, send as _, recv as _, n, dtype, stream as _)
    } else {
        symm_reduce_scatter(comm, send as _, recv as _, n, dtype, op, stream as _)
    };
    assert_eq!(
        st,
        symm_status_t::SYMM_SUCCESS,
        "n {n} dtype {dtype} op {op} {layout:?}: {}",
        err()
    );
    util::stream_sync(c.device, stream).unwrap();
    let mut out = vec![0u8; recv_n * es];
    util::dtoh(c.device, &mut out, recv).unwrap();
    symm_free(heap as _, big, c.device, stream as _);
    symm_free(other as _, big, c.device, stream as _);
    util::raw_free(c.device, outside).unwrap();
    out
}

fn check(c: &Child, out: &[u8], seed: u64, n: usize, dtype: u32, op: u32, what: &str) {
    let want = expected(seed, c.world, c.rank as usize, n, dtype, op);
    let got = decode(dtype, out);
    if op == GATHER || op != SYMM_SUM {
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(*g as f64 == *w, "{what}: element {i}: {g} vs {w}");
        }
    } else {
        let e = rel_err(&got, &want);
        assert!(e <= tol(dtype), "{what}: rel err {e}");
    }
}

fn sweep_rank(c: Child) {
    let comm = init(&c);
    let stream = util::stream_create(c.device).unwrap();
    let seed: u64 = c.arg.parse().unwrap();
    let mut case = 0u64;
    // 8, 4096 and 1 << 20 are whole 16-byte vectors within the LL threshold: the reduce-scatter
    // LL kernel; the others the barrier kernel.
    for &n in &[1usize, 7, 8, 9, 1031, 4096, 65_537, (1 << 20) + 3, 1 << 20] {
        for dtype in [SYMM_BF16, SYMM_FP16, SYMM_FP32] {
            for op in [SYMM_SUM, SYMM_MAX, SYMM_MIN, GATHER] {
                for layout in [Layout::Apart, Layout::Same, Layout::Staged, Layout::OwnOdd] {
                    if n > 65_537 && (layout != Layout::Apart || (op != SYMM_SUM && op != GATHER)) {
                        continue; // the large counts: the two main shapes, not every variant
                    }
                    case += 1;
                    let s = seed.wrapping_add(case * 7919);
                    let out = run_case(&c, comm, stream, s, n, dtype, op, layout);
                    let what = format!("rank {} n {n} dtype {dtype} op {op} {layout:?}", c.rank);
                    check(&c, &out, s, n, dtype, op, &what);
                }
            }
        }
    }
    // Graphs: one capture of each, 200 replays on fresh inputs uploaded in stream order.
    // (4096: the reduce-scatter LL kernel, whose call counters must stay in step over replays.)
    for (op, n) in [(SYMM_SUM, 4099usize), (GATHER, 4099), (SYMM_SUM, 4096)] {
        let (dtype, es, world) = (SYMM_BF16, 2usize, c.world as usize);
        let (send_n, recv_n) = if op == GATHER {
            (n, world * n)
        } else {
            (world * n, n)
        };
        let send = symm_malloc(send_n * es, c.device, stream as _) as u64;
        let recv = symm_malloc(recv_n * es, c.device, stream as _) as u64;
        util::capture_begin(c.device, stream).unwrap();
        let st = if op == GATHER {
            symm_all_gather(comm, send as _, recv as _, n, dtype, stream as _)
        } else {
            symm_reduce_scatter(comm, send as _, recv as _, n, dtype, op, stream as _)
        };
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "capture: {}", err());
        let graph = util::capture_end(c.device, stream).unwrap();
        for replay in 0..200u64 {
            let s = seed ^ (replay << 24) ^ op as u64;
            util::htod_async(
                c.device,
                send,
                &encode(dtype, &inputs(s, c.rank, send_n, dtype)),
                stream,
            )
            .unwrap();
            util::htod_async(c.device, recv, &vec![0xFFu8; recv_n * es], stream).unwrap();
            graph.launch(stream).unwrap();
            util::stream_sync(c.device, stream).unwrap();
            let mut out = vec![0u8; recv_n * es];
            util::dtoh(c.device, &mut out, recv).unwrap();
            check(
                &c,
                &out,
                s,
                n,
                dtype,
                op,
                &format!("rank {} replay {replay} op {op}", c.rank),
            );
        }
        drop(graph);
        symm_free(send as _, send_n * es, c.device, stream as _);
        symm_free(recv as _, recv_n * es, c.device, stream as _);
    }
    destroy(comm);
    println!(
        "rank {}: {case} cases and 2 x 200 graph replays correct",
        c.rank
    );
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_reduce_scatter_and_all_gather_match_reference() {
    if let Some(c) = child() {
        return sweep_rank(c);
    }
    let world = gpu_world("gpu_reduce_scatter_and_all_gather");
    assert_all_ok(&run_ranks(
        "gpu_reduce_scatter_and_all_gather_match_reference",
        world,
        &[],
        &seed().to_string(),
    ));
}

/// The fused call for tokens x hidden, bf16/fp16, on fresh random data: residual and out against
/// a float64 reference; outputs hashed so the parent can compare ranks bit for bit. Also 200
/// graph replays of one shape.
fn rms_rank(c: Child) {
    let comm = init(&c);
    let stream = util::stream_create(c.device).unwrap();
    let seed: u64 = c.arg.parse().unwrap();
    let mut hash = 0xcbf29ce484222325u64;
    let mut case = 0u64;
    // Up to 4 MiB of x the LL kernels: on sm_90, rows wider than 3072 split over a cluster of
    // C = 2-8 blocks while every row gets one ([1, 4096] four blocks of 128 threads, [2, 4088]
    // the same with a partial warp, [2, 5120] and [2, 6136] with partial blocks and warps,
    // [2, 16376] a last block one vector short, [16, 16384] the whole LL grid; fewer, wider
    // blocks when the grid is short: [33, 8192] clusters of 3, [64, 8192] of 2, [17, 16384] of
    // 7), otherwise one row per block (a vector per thread up to hidden 6144: [1, 2048],
    // [40, 4096]; four at [33, 16384], and every wide row on a GPU without clusters); above
    // 4 MiB the barrier kernel.
    let shapes = [
        (1usize, 2048usize),
        (1, 4096),
        (2, 4088),
        (2, 5120),
        (2, 6136),
        (1, 8192),
        (2, 6400),
        (32, 8192),
        (33, 8192),
        (64, 8192),
        (40, 4096),
        (6, 6144),
        (138, 4096),
        (2048, 8192),
        (3, 16384),
        (2, 16376),
        (16, 16384),
        (17, 16384),
        (33, 16384),
        (4096, 2048),
    ];
    for dtype in [SYMM_BF16, SYMM_FP16] {
        for &(tokens, hidden) in &shapes {
            case += 1;
            let s = seed.wrapping_add(case * 104_729);
            let (n, es) = (tokens * hidden, 2usize);
            let bytes = n * es;
            let x = symm_malloc(bytes, c.device, stream as _) as u64;
            let res = util::raw_alloc(c.device, bytes).unwrap(); // this rank's own: anywhere
            let out = util::raw_alloc(c.device, bytes).unwrap();
            let w = util::raw_alloc(c.device, hidden * es).unwrap();
            let xs = inputs(s, c.rank, n, dtype);
            let rs = inputs(s ^ 1, 100, n, dtype);
            let ws: Vec<f32> = inputs(s ^ 2, 200, hidden, dtype)
                .iter()
                .map(|v| 0.5 + v.abs() / 4.0)
                .collect();
            util::htod_async(c.device, x, &encode(dtype, &xs), stream).unwrap();
            util::htod_async(c.device, res, &encode(dtype, &rs), stream).unwrap();
            util::htod_async(c.device, w, &encode(dtype, &ws), stream).unwrap();
            util::htod_async(c.device, out, &vec![0xFFu8; bytes], stream).unwrap();
            let st = symm_all_reduce_add_rms_norm(
                comm,
                x as _,
                res as _,
                w as _,
                out as _,
                tokens,
                hidden,
                1e-5,
                dtype,
                stream as _,
            );
            assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
            util::stream_sync(c.device, stream).unwrap();
            let (mut got_r, mut got_o) = (vec![0u8; bytes], vec![0u8; bytes]);
            util::dtoh(c.device, &mut got_r, res).unwrap();
            util::dtoh(c.device, &mut got_o, out).unwrap();
            let all: Vec<Vec<f32>> = (0..c.world).map(|r| inputs(s, r, n, dtype)).collect();
            let wr: Vec<f64> = encode_decode(dtype, &ws);
            let (mut want_r, mut want_o) = (vec![0f64; n], vec![0f64; n]);
            for t in 0..tokens {
                let row = t * hidden..(t + 1) * hidden;
                for i in row.clone() {
                    want_r[i] = all.iter().map(|v| v[i] as f64).sum::<f64>() + rs[i] as f64;
                }
                let ms = want_r[row.clone()].iter().map(|v| v * v).sum::<f64>() / hidden as f64;
                let inv = 1.0 / (ms + 1e-5).sqrt();
                for i in row {
                    want_o[i] = want_r[i] * inv * wr[i - t * hidden];
                }
            }
            let what = format!("rank {} dtype {dtype} {tokens} x {hidden}", c.rank);
            let (er, eo) = (
                rel_err(&decode(dtype, &got_r), &want_r),
                rel_err(&decode(dtype, &got_o), &want_o),
            );
            assert!(
                er <= tol(dtype) && eo <= tol(dtype),
                "{what}: residual {er}, out {eo}"
            );
            hash = got_r
                .iter()
                .chain(&got_o)
                .fold(hash, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3));
            symm_free(x as _, bytes, c.device, stream as _);
            for p in [res, out, w] {
                util::raw_free(c.device, p).unwrap();
            }
        }
    }
    // 200 graph replays on fresh x, residual re-uploaded each time (hidden 8192: the cluster
    // kernel on sm_90).
    let (tokens, hidden, dtype) = (6usize, 8192usize, SYMM_BF16);
    let bytes = tokens * hidden * 2;
    let x = symm_malloc(bytes, c.device, stream as _) as u64;
    let res = util::raw_alloc(c.device, bytes).unwrap();
    let out = util::raw_alloc(c.device, bytes).unwrap();
    let w = util::raw_alloc(c.device, hidden * 2).unwrap();
    util::htod(c.device, w, &encode(dtype, &vec![1.0f32; hidden])).unwrap();
    util::capture_begin(c.device, stream).unwrap();
    let st = symm_all_reduce_add_rms_norm(
        comm,
        x as _,
        res as _,
        w as _,
        out as _,
        tokens,
        hidden,
        1e-5,
        dtype,
        stream as _,
    );
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "capture: {}", err());
    // An LL all-reduce between fused calls: the fused LL kernel shares the LL buffers and call
    // counters, which must stay in step across both kinds of call.
    let y = symm_malloc(bytes, c.device, stream as _) as u64;
    let st = symm_all_reduce_algo(
        comm,
        SYMM_ALGO_ONE_SHOT_LL,
        x as _,
        y as _,
        tokens * hidden,
        dtype,
        SYMM_SUM,
        stream as _,
    );
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "capture: {}", err());
    // And one of the first row alone: 16 KiB runs on 16 blocks where the calls above run on 96
    // (LL calls run on the blocks that have items; every block's counter must still move once
    // per call, or a later call's blocks would disagree on the buffer).
    let z = symm_malloc(hidden * 2, c.device, stream as _) as u64;
    let st = symm_all_reduce_algo(
        comm,
        SYMM_ALGO_ONE_SHOT_LL,
        x as _,
        z as _,
        hidden,
        dtype,
        SYMM_SUM,
        stream as _,
    );
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "capture: {}", err());
    let graph = util::capture_end(c.device, stream).unwrap();
    for replay in 0..200u64 {
        let s = seed ^ (replay << 30);
        let n = tokens * hidden;
        util::htod_async(
            c.device,
            x,
            &encode(dtype, &inputs(s, c.rank, n, dtype)),
            stream,
        )
        .unwrap();
        util::htod_async(c.device, res, &vec![0u8; bytes], stream).unwrap();
        graph.launch(stream).unwrap();
        util::stream_sync(c.device, stream).unwrap();
        let mut got = vec![0u8; bytes];
        util::dtoh(c.device, &mut got, res).unwrap();
        let e = rel_err(
            &decode(dtype, &got),
            &reference(s, c.world, n, dtype, SYMM_SUM),
        );
        assert!(e <= tol(dtype), "replay {replay}: residual rel err {e}");
        util::dtoh(c.device, &mut got, y).unwrap();
        let e = rel_err(
            &decode(dtype, &got),
            &reference(s, c.world, n, dtype, SYMM_SUM),
        );
        assert!(
            e <= tol(dtype),
            "replay {replay}: LL all-reduce rel err {e}"
        );
        let mut row = vec![0u8; hidden * 2];
        util::dtoh(c.device, &mut row, z).unwrap();
        let e = rel_err(
            &decode(dtype, &row),
            &reference(s, c.world, n, dtype, SYMM_SUM)[..hidden],
        );
        assert!(
            e <= tol(dtype),
            "replay {replay}: one-row all-reduce rel err {e}"
        );
    }
    drop(graph);
    symm_free(x as _, bytes, c.device, stream as _);
    symm_free(y as _, bytes, c.device, stream as _);
    symm_free(z as _, hidden * 2, c.device, stream as _);
    destroy(comm);
    println!(
        "rank {}: outputs hash {hash:016x}; {case} fused cases (LL and barrier kernels) and 200 replays of fused + LL all-reduce correct",
        c.rank
    );
}

fn encode_decode(dtype: u32, v: &[f32]) -> Vec<f64> {
    decode(dtype, &encode(dtype, v))
        .into_iter()
        .map(|x| x as f64)
        .collect()
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_fused_rms_norm_matches_reference_on_every_rank() {
    if let Some(c) = child() {
        return rms_rank(c);
    }
    let world = gpu_world("gpu_fused_rms_norm");
    let outs = run_ranks(
        "gpu_fused_rms_norm_matches_reference_on_every_rank",
        world,
        &[],
        &seed().to_string(),
    );
    assert_all_ok(&outs);
    assert_same_output_hash(&outs);
    println!(
        "{}",
        String::from_utf8_lossy(&outs[0].stdout)
            .lines()
            .filter(|l| l.contains("rank "))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
