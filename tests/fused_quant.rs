//! The fused all-reduce + residual + RMSNorm with an FP8 e4m3 output
//! (`symm_all_reduce_add_rms_norm_quant`, kernels/quant.cuh), one process per rank: the host
//! backend on CI (2 and 3 ranks), GPUs with `--include-ignored` (every GPU, or
//! `SYMM_TEST_RANKS=N` ranks sharing them).
//!
//! For bf16 and fp16, the three modes (STATIC, PER_TOKEN, PER_GROUP_128) and shapes that reach
//! every fused kernel, on fresh random data with the outputs poisoned first:
//! - every e4m3 byte equals, or is one e4m3 step from, the float64 reference's
//!   `e4m3(clamp(y / s, +-448))` (RNE, as torch's float8_e4m3fn cast), with the call's own
//!   scale `s`;
//! - a written scale is within 8 fp32 ulps (2^-20 relative) of `max(amax / 448, FLT_MIN)` of
//!   the float64 reference: the fp32 RMSNorm itself (a sum of squares in fp32, `rsqrtf`)
//!   differs from float64 by a few ulps, so one ulp cannot be promised against float64;
//! - the unfused path as a second reference: the bf16/fp16 fused call on the same inputs, its
//!   output quantized with the same scale, one e4m3 step at most; its residual bit for bit;
//! - every rank's bytes are the same (each rank prints a hash, the parent compares).
//!
//! A static scale that is not finite and > 0 gives an all-NaN output (and the residual
//! update). The bad inputs the issue lists are refused, each naming the argument, and the
//! communicator stays usable. On GPUs also: a captured graph replayed with a static scale that
//! changes between replays quantizes with each replay's scale.

mod common;
use common::*;
use std::ffi::c_void;
use std::ptr::null_mut;
use symmalloc::comm::convert::{e4m3_to_f32, f32_to_e4m3};
use symmalloc::cuda::util;
use symmalloc::ffi::quant::symm_all_reduce_add_rms_norm_quant;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

const EPS: f32 = 1e-5;

fn on_host() -> bool {
    symmalloc::heap::global().unwrap().backend().name() == "host"
}

/// A buffer of the test: in the symmetric heap, or outside it (a host vector on the host
/// backend, cuMemAlloc memory on a GPU).
struct Buf {
    p: u64,
    len: usize,
    heap: bool,
    _host: Vec<u128>,
}

fn alloc(c: &Child, len: usize, heap: bool) -> Buf {
    let len = len.max(16);
    if heap {
        let p = symm_malloc(len, c.device, null_mut()) as u64;
        assert!(p != 0, "{}", err());
        return Buf {
            p,
            len,
            heap,
            _host: Vec::new(),
        };
    }
    if on_host() {
        let mut v = vec![0u128; len.div_ceil(16)];
        let p = v.as_mut_ptr() as u64;
        return Buf {
            p,
            len,
            heap,
            _host: v,
        };
    }
    let p = util::raw_alloc(c.device, len).unwrap();
    Buf {
        p,
        len,
        heap,
        _host: Vec::new(),
    }
}

fn free(c: &Child, b: Buf) {
    if b.heap {
        symm_free(b.p as _, b.len, c.device, null_mut());
    } else if !on_host() {
        util::raw_free(c.device, b.p).unwrap();
    }
}

fn put(c: &Child, dst: u64, bytes: &[u8]) {
    if on_host() {
        // SAFETY: dst is a live host buffer of at least bytes.len() bytes.
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
        // SAFETY: src is a live host buffer of at least len bytes.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), len) };
    } else {
        symmalloc::cuda::mem::sync_device(c.device).unwrap();
        util::dtoh(c.device, &mut out, src).unwrap();
    }
    out
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn float_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// An e4m3 code's place on the number line: neighbouring values differ by 1 (+-0 are 0).
fn ord(q: u8) -> i32 {
    let m = (q & 0x7f) as i32;
    if q & 0x80 != 0 {
        -m
    } else {
        m
    }
}

/// torch's `(v).clamp(-448, 448).to(torch.float8_e4m3fn)` of a float64 value.
fn e4m3_ref(v: f64) -> u8 {
    f32_to_e4m3(v.clamp(-448.0, 448.0) as f32)
}

const MODES: [(symm_quant_t, &str); 3] = [
    (SYMM_QUANT_FP8_STATIC, "static"),
    (SYMM_QUANT_FP8_PER_TOKEN, "per-token"),
    (SYMM_QUANT_FP8_PER_GROUP_128, "per-group"),
];

/// One case's data, the same on every rank but x.
struct Data {
    x: Vec<u8>,
    res: Vec<u8>,
    w: Vec<u8>,
    /// float64 reference: the new residual and y = r * rsqrt(mean(r^2) + eps) * w.
    r: Vec<f64>,
    y: Vec<f64>,
}

fn data(c: &Child, s: u64, tokens: usize, hidden: usize, dtype: u32) -> Data {
    let n = tokens * hidden;
    let all: Vec<Vec<f32>> = (0..c.world).map(|r| inputs(s, r, n, dtype)).collect();
    let rs = inputs(s ^ 1, 100, n, dtype);
    let ws: Vec<f32> = inputs(s ^ 2, 200, hidden, dtype)
        .iter()
        .map(|v| 0.5 + v.abs() / 4.0)
        .collect();
    let w_enc = encode(dtype, &ws);
    let wr = decode(dtype, &w_enc);
    let (mut r, mut y) = (vec![0f64; n], vec![0f64; n]);
    for t in 0..tokens {
        let row = t * hidden..(t + 1) * hidden;
        for i in row.clone() {
            r[i] = all.iter().map(|v| v[i] as f64).sum::<f64>() + rs[i] as f64;
        }
        let ms = r[row.clone()].iter().map(|v| v * v).sum::<f64>() / hidden as f64;
        let inv = 1.0 / (ms + EPS as f64).sqrt();
        for i in row {
            y[i] = r[i] * inv * wr[i - t * hidden] as f64;
        }
    }
    Data {
        x: encode(dtype, &all[c.rank as usize]),
        res: encode(dtype, &rs),
        w: w_enc,
        r,
        y,
    }
}

/// The scales a mode's reference has: max(amax / 448, FLT_MIN) per row or per 128 elements.
fn ref_scales(y: &[f64], tokens: usize, hidden: usize, mode: symm_quant_t) -> Vec<f64> {
    let group = match mode {
        SYMM_QUANT_FP8_PER_TOKEN => hidden,
        _ => 128,
    };
    (0..tokens * hidden / group)
        .map(|g| {
            let amax = y[g * group..(g + 1) * group]
                .iter()
                .fold(0f64, |m, v| m.max(v.abs()));
            (amax / 448.0).max(f32::MIN_POSITIVE as f64)
        })
        .collect()
}

/// The fused FP8 call on one case; returns (out_q, scales, residual) bytes.
#[allow(clippy::too_many_arguments)]
fn run_quant(
    c: &Child,
    comm: *mut symm_comm_t,
    d: &Data,
    (tokens, hidden, dtype): (usize, usize, u32),
    mode: symm_quant_t,
    static_scale: f32,
    staged: bool,
) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let n = tokens * hidden;
    let nscale = match mode {
        SYMM_QUANT_FP8_STATIC => 1,
        SYMM_QUANT_FP8_PER_TOKEN => tokens,
        _ => n / 128,
    };
    let x = alloc(c, n * 2, !staged);
    let res = alloc(c, n * 2, false);
    let w = alloc(c, hidden * 2, false);
    let out = alloc(c, n, false);
    let scale = alloc(c, nscale * 4, false);
    put(c, x.p, &d.x);
    put(c, res.p, &d.res);
    put(c, w.p, &d.w);
    put(c, out.p, &vec![0xA5; n]); // poisoned: an unwritten byte reads as -0.1015625
    if mode == SYMM_QUANT_FP8_STATIC {
        put(c, scale.p, &static_scale.to_le_bytes());
    } else {
        put(c, scale.p, &vec![0xFF; nscale * 4]); // NaN until written
    }
    let st = symm_all_reduce_add_rms_norm_quant(
        comm,
        x.p as _,
        res.p as _,
        w.p as _,
        out.p as _,
        scale.p as _,
        tokens,
        hidden,
        EPS,
        dtype,
        mode,
        null_mut(),
    );
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    let got = (
        get(c, out.p, n),
        get(c, scale.p, nscale * 4),
        get(c, res.p, n * 2),
    );
    for b in [x, res, w, out, scale] {
        free(c, b);
    }
    got
}

/// The bf16/fp16 fused call on the same case (the unfused path's first half): (out, residual).
fn run_plain(
    c: &Child,
    comm: *mut symm_comm_t,
    d: &Data,
    (tokens, hidden, dtype): (usize, usize, u32),
) -> (Vec<u8>, Vec<u8>) {
    let n = tokens * hidden;
    let [x, res, w, out] = [n * 2, n * 2, hidden * 2, n * 2].map(|l| alloc(c, l, true));
    put(c, x.p, &d.x);
    put(c, res.p, &d.res);
    put(c, w.p, &d.w);
    put(c, out.p, &vec![0xFF; n * 2]);
    let st = symm_all_reduce_add_rms_norm(
        comm,
        x.p as _,
        res.p as _,
        w.p as _,
        out.p as _,
        tokens,
        hidden,
        EPS,
        dtype,
        null_mut(),
    );
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    let got = (get(c, out.p, n * 2), get(c, res.p, n * 2));
    for b in [x, res, w, out] {
        free(c, b);
    }
    got
}

/// Every byte of `q` within one e4m3 step of `want(i)`; returns how many were equal.
fn within_a_step(what: &str, q: &[u8], want: impl Fn(usize) -> u8) -> usize {
    let mut equal = 0;
    for (i, &g) in q.iter().enumerate() {
        let w = want(i);
        assert!(
            (ord(g) - ord(w)).abs() <= 1,
            "{what}: element {i} is {g:#04x} ({}), expected {w:#04x} ({}) or a neighbour",
            e4m3_to_f32(g),
            e4m3_to_f32(w)
        );
        equal += (g == w) as usize;
    }
    equal
}

fn cases_rank(c: Child) {
    let comm = init(&c);
    let seed: u64 = c.arg.parse().unwrap();
    let mut hash = 0xcbf29ce484222325u64;
    let mut case = 0u64;
    // Host: a few shapes. GPUs: every fused kernel (one vector per thread up to hidden 6144,
    // clusters of 2-8 for rows wider than 3072 with few tokens: [2, 4096] four blocks of 128
    // threads, [40, 4096] one block per row; four vectors per thread, the barrier kernel above
    // the LL threshold), widths that are not multiples of 128 (no group mode).
    let shapes: &[(usize, usize)] = if on_host() {
        &[(1, 128), (3, 1032), (5, 4096)]
    } else {
        &[
            (1, 1024),
            (2, 4096),
            (2, 4088),
            (1, 6144),
            (2, 5120),
            (2, 6136),
            (1, 8192),
            (32, 8192),
            (33, 8192),
            (40, 4096),
            (3, 16384),
            (17, 16384),
            (33, 16384),
            (138, 4096),
            (2048, 8192),
        ]
    };
    let (mut equal, mut total) = (0usize, 0usize);
    for dtype in [SYMM_BF16, SYMM_FP16] {
        for &(tokens, hidden) in shapes {
            case += 1;
            let s = seed.wrapping_add(case * 104_729);
            let d = data(&c, s, tokens, hidden, dtype);
            let shape = (tokens, hidden, dtype);
            let (plain_out, plain_res) = run_plain(&c, comm, &d, shape);
            let plain = decode(dtype, &plain_out);
            let amax = d.y.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (mode, name) in MODES {
                if mode == SYMM_QUANT_FP8_PER_GROUP_128 && hidden % 128 != 0 {
                    continue;
                }
                let staged = case % 2 == 0;
                // Static: some cases saturate (the scale puts the largest |y| at 1.3 x 448).
                let factor = if case % 2 == 0 { 1.3 } else { 0.8 };
                let sstatic = (amax / 448.0 / factor) as f32;
                let what = format!(
                    "rank {} dtype {dtype} [{tokens}, {hidden}] {name} staged {staged}",
                    c.rank
                );
                let (q, sb, res) = run_quant(&c, comm, &d, shape, mode, sstatic, staged);
                // The residual: the bf16 call's bits, and the float64 sum.
                assert!(
                    res == plain_res,
                    "{what}: residual differs from the bf16 call's"
                );
                let e = rel_err(&decode(dtype, &res), &d.r);
                assert!(e <= tol(dtype), "{what}: residual error {e}");
                // The scales.
                let scales: Vec<f32> = if mode == SYMM_QUANT_FP8_STATIC {
                    vec![sstatic]
                } else {
                    let got = floats(&sb);
                    let want = ref_scales(&d.y, tokens, hidden, mode);
                    for (g, (&gs, &ws)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            ((gs as f64) - ws).abs() <= ws * (1.0 / (1 << 20) as f64),
                            "{what}: scale {g} is {gs:e}, float64 reference {ws:e}"
                        );
                    }
                    got
                };
                let group = match mode {
                    SYMM_QUANT_FP8_STATIC => usize::MAX,
                    SYMM_QUANT_FP8_PER_TOKEN => hidden,
                    _ => 128,
                };
                let s_of =
                    |i: usize| scales[if group == usize::MAX { 0 } else { i / group }] as f64;
                // Against float64, then against the unfused path, with the call's scales.
                equal += within_a_step(&format!("{what} (float64)"), &q, |i| {
                    e4m3_ref(d.y[i] / s_of(i))
                });
                total += q.len();
                within_a_step(&format!("{what} (unfused)"), &q, |i| {
                    e4m3_ref(plain[i] as f64 / s_of(i))
                });
                if mode == SYMM_QUANT_FP8_STATIC && factor > 1.0 {
                    assert!(
                        q.iter().any(|&b| b & 0x7f == 0x7e),
                        "{what}: no value saturated to 448"
                    );
                }
                for b in q.iter().chain(&sb).chain(&res) {
                    hash = (hash ^ *b as u64).wrapping_mul(0x100000001b3);
                }
            }
            // A static scale that is not finite and > 0: every byte NaN, the residual updated.
            for bad in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
                let (q, _, res) = run_quant(&c, comm, &d, shape, SYMM_QUANT_FP8_STATIC, bad, false);
                assert!(
                    q.iter().all(|&b| b & 0x7f == 0x7f),
                    "rank {}: static scale {bad}: expected every byte NaN",
                    c.rank
                );
                assert!(res == plain_res, "static scale {bad}: residual not updated");
            }
        }
    }
    println!(
        "rank {}: {equal} of {total} e4m3 bytes equal the float64 reference's, the rest one step \
         apart",
        c.rank
    );
    bad_inputs(&c, comm);
    if !on_host() {
        graph_replays(&c, comm, seed);
    }
    destroy(comm);
    println!("rank {}: outputs hash {hash:016x}", c.rank);
}

/// The bad inputs, each refused with a message naming the argument; then a good call.
fn bad_inputs(c: &Child, comm: *mut symm_comm_t) {
    let (tokens, hidden) = (2usize, 256usize);
    let n = tokens * hidden;
    let [x, res, w, out, scale] = [n * 2, n * 2, hidden * 2, n, 64].map(|l| alloc(c, l, true));
    put(c, x.p, &encode(SYMM_BF16, &inputs(1, c.rank, n, SYMM_BF16)));
    put(c, res.p, &encode(SYMM_BF16, &inputs(2, 100, n, SYMM_BF16)));
    put(c, w.p, &encode(SYMM_BF16, &vec![1.0; hidden]));
    put(c, scale.p, &float_bytes(&[0.05; 16]));
    let call = |out: u64, scale: u64, hidden: usize, dtype: u32, quant: u32| {
        symm_all_reduce_add_rms_norm_quant(
            comm,
            x.p as *const c_void,
            res.p as _,
            w.p as *const c_void,
            out as _,
            scale as _,
            tokens,
            hidden,
            EPS,
            dtype,
            quant,
            null_mut(),
        )
    };
    let refused = |st: symm_status_t, want: symm_status_t, words: &[&str]| {
        assert_eq!(st, want, "{}", err());
        let e = err();
        for w in words {
            assert!(e.contains(w), "{e:?} does not name {w:?}");
        }
    };
    use symm_status_t::*;
    refused(
        call(out.p, 0, hidden, SYMM_BF16, SYMM_QUANT_FP8_STATIC),
        SYMM_ERR_INVALID_ARGUMENT,
        &["scale 0x0", "non-NULL"],
    );
    refused(
        call(out.p, scale.p, hidden, SYMM_BF16, 7),
        SYMM_ERR_INVALID_ARGUMENT,
        &["quant 7", "SYMM_QUANT_FP8_STATIC"],
    );
    refused(
        call(out.p, scale.p, hidden, SYMM_FP32, SYMM_QUANT_FP8_PER_TOKEN),
        SYMM_ERR_UNSUPPORTED,
        &["fp32 is not supported"],
    );
    refused(
        call(x.p, scale.p, hidden, SYMM_BF16, SYMM_QUANT_FP8_PER_TOKEN),
        SYMM_ERR_INVALID_ARGUMENT,
        &["out_q", "overlaps x"],
    );
    refused(
        call(
            res.p + 64,
            scale.p,
            hidden,
            SYMM_BF16,
            SYMM_QUANT_FP8_STATIC,
        ),
        SYMM_ERR_INVALID_ARGUMENT,
        &["out_q", "overlaps residual"],
    );
    refused(
        call(
            out.p,
            out.p + 256,
            hidden,
            SYMM_BF16,
            SYMM_QUANT_FP8_PER_TOKEN,
        ),
        SYMM_ERR_INVALID_ARGUMENT,
        &["scale", "overlaps out_q"],
    );
    refused(
        call(out.p + 4, scale.p, hidden, SYMM_BF16, SYMM_QUANT_FP8_STATIC),
        SYMM_ERR_INVALID_ARGUMENT,
        &["out_q", "8-byte aligned"],
    );
    refused(
        call(out.p, scale.p, 136, SYMM_BF16, SYMM_QUANT_FP8_PER_GROUP_128),
        SYMM_ERR_INVALID_ARGUMENT,
        &["hidden 136", "multiple of 128"],
    );
    // Still usable: a good call of every mode.
    for (mode, name) in MODES {
        assert_eq!(
            call(out.p, scale.p, hidden, SYMM_BF16, mode),
            SYMM_SUCCESS,
            "{name}: {}",
            err()
        );
    }
    let q = get(c, out.p, n);
    assert!(
        q.iter().all(|&b| b & 0x7f != 0x7f),
        "NaN after the refusals"
    );
    for b in [x, res, w, out, scale] {
        free(c, b);
    }
}

/// A captured graph of the static call, replayed with the scale changed between replays (and
/// the residual reset): each replay quantizes with its own scale.
fn graph_replays(c: &Child, comm: *mut symm_comm_t, seed: u64) {
    let (tokens, hidden, dtype) = (4usize, 4096usize, SYMM_BF16);
    let n = tokens * hidden;
    let d = data(c, seed ^ 0x9e37, tokens, hidden, dtype);
    let stream = util::stream_create(c.device).unwrap();
    let [x, res, w, out, scale] = [n * 2, n * 2, hidden * 2, n, 4].map(|l| alloc(c, l, true));
    put(c, x.p, &d.x);
    put(c, w.p, &d.w);
    put(c, scale.p, &1f32.to_le_bytes());
    let call = || {
        let st = symm_all_reduce_add_rms_norm_quant(
            comm,
            x.p as _,
            res.p as _,
            w.p as _,
            out.p as _,
            scale.p as _,
            tokens,
            hidden,
            EPS,
            dtype,
            SYMM_QUANT_FP8_STATIC,
            stream as _,
        );
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    };
    call(); // eager first: the segments are exchanged outside the capture
    util::stream_sync(c.device, stream).unwrap();
    util::capture_begin(c.device, stream).unwrap();
    call();
    let graph = util::capture_end(c.device, stream).unwrap();
    let amax = d.y.iter().fold(0f64, |m, v| m.max(v.abs()));
    for (k, f) in [1.0f64, 0.5, 2.0, 0.25, 1.0].iter().enumerate() {
        let s = (amax / 448.0 / f) as f32;
        util::htod_async(c.device, res.p, &d.res, stream).unwrap();
        util::htod_async(c.device, scale.p, &s.to_le_bytes(), stream).unwrap();
        util::htod_async(c.device, out.p, &vec![0xA5; n], stream).unwrap();
        graph.launch(stream).unwrap();
        util::stream_sync(c.device, stream).unwrap();
        let q = get(c, out.p, n);
        within_a_step(
            &format!("rank {} replay {k} (scale {s:e})", c.rank),
            &q,
            |i| e4m3_ref(d.y[i] / s as f64),
        );
    }
    for b in [x, res, w, out, scale] {
        free(c, b);
    }
}

fn run(name: &str, world: i32, env: &[(&str, &str)]) {
    let seed = seed();
    let outs = run_ranks(name, world, env, &seed.to_string());
    assert_all_ok(&outs);
    assert_same_output_hash(&outs);
    for o in &outs {
        for l in String::from_utf8_lossy(&o.stdout).lines() {
            if l.contains("e4m3 bytes") {
                println!("{world} ranks: {l}");
            }
        }
    }
}

#[test]
fn host_fused_fp8_matches_references_and_is_identical_on_every_rank() {
    if let Some(c) = child() {
        return cases_rank(c);
    }
    for world in [2, 3] {
        run(
            "host_fused_fp8_matches_references_and_is_identical_on_every_rank",
            world,
            &[HOST],
        );
    }
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_fused_fp8_matches_references_and_is_identical_on_every_rank() {
    if let Some(c) = child() {
        return cases_rank(c);
    }
    let name = "gpu_fused_fp8_matches_references_and_is_identical_on_every_rank";
    run(name, gpu_world(name), &[]);
}
