//! FP8 quantized inside the dispatch (docs/moe.md, "FP8 inside the dispatch"): bf16 `x`, e4m3
//! rows and fp32 scales (one per 128 elements) out, in both scale layouts (row-major and
//! column-major TMA-aligned), with and without UE8M0 scales; and the pre-quantized FP8 path in
//! the column-major layout. Every rank checks its receive buffers against every rank's inputs
//! regenerated from the seed:
//! - each scale is exactly the float64 reference's, `f32(max(amax / 448, FLT_MIN))` (UE8M0:
//!   `2^ceil(log2(s))`), at the layout's index formula, read back through the strides the
//!   layout query reports;
//! - each e4m3 byte is exactly `e4m3_rne(f32(x * f32(1 / s)))` (the kernels' arithmetic,
//!   kernels/quant.cuh: the host backend and the GPU give the same bytes), and equals the float64
//!   reference `e4m3_rne(x / s)`, or is one step from it only where `x / s` lies within 2^-21
//!   (relative) of a rounding midpoint (the reciprocal's rounding); with UE8M0 always equal.
//!
//! Also the create refusals of the new fields (naming the value), a version 2 config and a
//! version 1 layout query still served, and `x_scales` given to a quantizing object refused on
//! that rank and named on every other one. tests/moe_host.rs runs these on the host backend,
//! tests/gpu_moe.rs on GPUs.

use super::errors::refuse;
use super::*;
use crate::common::{err, Comm, Rng, OK};
use std::ptr::null_mut;
use symmalloc::comm::convert::bf16_to_f32;
use symmalloc::ffi::moe::*;
use symmalloc::ffi::moe_calls::*;
use symmalloc::ffi::types::*;

/// What a quantization case configures (FP8 payload always).
#[derive(Clone, Copy, Debug)]
pub struct Q {
    /// bf16 x quantized in the dispatch (else: pre-quantized x with the caller's scales).
    pub quantize: bool,
    pub col: bool,
    pub ue8m0: bool,
}

/// The configurations every run covers.
pub const QS: [Q; 5] = [
    Q {
        quantize: true,
        col: false,
        ue8m0: false,
    },
    Q {
        quantize: true,
        col: true,
        ue8m0: false,
    },
    Q {
        quantize: true,
        col: false,
        ue8m0: true,
    },
    Q {
        quantize: true,
        col: true,
        ue8m0: true,
    },
    Q {
        quantize: false,
        col: true,
        ue8m0: false,
    },
];

pub fn qconfig(s: &Shape, q: Q) -> symm_moe_config_t {
    let mut c = s.config();
    c.input = if q.quantize {
        SYMM_MOE_INPUT_BF16
    } else {
        SYMM_MOE_INPUT_PAYLOAD
    };
    c.scale_layout = if q.col {
        SYMM_MOE_SCALES_COL_TMA
    } else {
        SYMM_MOE_SCALES_ROW_MAJOR
    };
    c.scale_ue8m0 = q.ue8m0 as u32;
    c
}

/// `[S][R4]` per expert (column-major, R4 = R rounded up to 4) or `[R][S]` (row-major): the
/// strides (expert, row, group) in fp32 elements, as docs/moe.md gives them.
pub fn want_strides(q: Q, r: usize, groups: usize) -> [u64; 3] {
    let r4 = r.div_ceil(4) * 4;
    if q.col {
        [(groups * r4) as u64, 1, r4 as u64]
    } else {
        [(r * groups) as u64, groups as u64, 1]
    }
}

/// Creates a quantizing (or pre-quantized) FP8 object and checks what the layout query says
/// of it, in version 2 and in version 1.
pub fn qcreate(comm: Comm, dev: Dev, s: Shape, q: Q) -> Obj {
    assert!(s.fp8);
    let mut moe = null_mut();
    let st = symm_moe_create_config(comm, &qconfig(&s, q), &mut moe);
    assert_eq!(st, OK, "symm_moe_create_config {s:?} {q:?}: {}", err());
    let (st, lay) = layout_of(moe, SYMM_MOE_LAYOUT_VERSION, layout_size());
    assert_eq!(st, OK, "symm_moe_layout: {}", err());
    let w = lay.world as usize;
    let l = s.e as usize / w;
    let r = if s.max_recv == 0 {
        w * s.t
    } else {
        s.max_recv as usize
    };
    assert_eq!(
        (lay.input, lay.scale_layout, lay.scale_ue8m0, lay.reserved2),
        (
            q.quantize as u32,
            if q.col {
                SYMM_MOE_SCALES_COL_TMA
            } else {
                SYMM_MOE_SCALES_ROW_MAJOR
            },
            q.ue8m0 as u32,
            0
        ),
        "{lay:?}"
    );
    let st3 = [
        lay.scale_stride_expert,
        lay.scale_stride_row,
        lay.scale_stride_group,
    ];
    assert_eq!(st3, want_strides(q, r, s.h / 128), "{s:?} {q:?}");
    assert!(lay.recv_scales as u64 % 16 == 0 && !lay.recv_scales.is_null());
    // The column-major layout's scales of one expert fit the block (with the payload).
    let scale_bytes = (st3[0] as usize * l * 4) as u64;
    assert!(lay.buffer_bytes >= (l * r * s.h) as u64 + scale_bytes);
    // A version 1 query is still served: the fields before `input`, nothing after.
    let v1 = std::mem::offset_of!(symm_moe_layout_t, input) as u32;
    // SAFETY: an all-0xFF layout is valid (integers and pointers, never dereferenced here).
    let mut old: symm_moe_layout_t = unsafe { std::mem::transmute([0xFFu8; 152]) };
    old.version = 1;
    old.size = v1;
    assert_eq!(symm_moe_layout(moe, &mut old), OK, "{}", err());
    assert_eq!(
        (old.recv_x, old.buffer_bytes),
        (lay.recv_x, lay.buffer_bytes)
    );
    assert_eq!(
        (old.input, old.scale_stride_group),
        (u32::MAX, u64::MAX),
        "a version 1 query got fields past its size"
    );
    Obj {
        moe,
        s,
        w,
        rank: lay.rank as usize,
        l,
        r,
        lay,
        dev,
    }
}

/// A rank's bf16 rows (bits): each 128-element group of a kind drawn from the seed: ordinary
/// values, zeros, tiny ones (the scale clamps to FLT_MIN), huge ones, values spread over 2^±40
/// (e4m3 subnormals and zeros after scaling), and e4m3 grid values times a power of two (ties
/// after scaling). A negative zero now and then.
pub fn bf16_rows(seed: u64, rank: usize, n: usize, h: usize) -> Vec<u16> {
    let mut g = Rng::new(seed ^ ((rank as u64 + 1) << 36) ^ 0x51_7cc1_b727);
    let mut out = Vec::with_capacity(n * h);
    for _ in 0..n * h / 128 {
        let kind = g.below(6);
        let p2 = 2f32.powi(g.below(30) as i32 - 15);
        for _ in 0..128 {
            let u = g.unit();
            let v = match kind {
                0 => u * 4.0,
                1 => 0.0,
                2 => u * 2f32.powi(-128),
                3 => u * 2f32.powi(110),
                4 => u * 2f32.powi(g.below(80) as i32 - 40),
                _ => {
                    let b = g.below(0x7f) as u8;
                    e4m3(b) * p2 * if u < 0.0 { -1.0 } else { 1.0 }
                }
            };
            let b = if g.below(97) == 0 { 0x8000 } else { bf16(v) };
            out.push(b);
        }
    }
    out
}

/// The e4m3 values of codes 0..=0x7e (increasing).
pub fn grid() -> Vec<f64> {
    (0u8..=0x7e).map(|b| e4m3(b) as f64).collect()
}

/// `v` in e4m3: round to nearest even, saturated to +-448 (no NaN is generated here). Also
/// whether `|v|` lies within 2^-21 (relative) of a midpoint of two neighbours.
pub fn e4m3_rne(grid: &[f64], v: f64) -> (u8, bool) {
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    if a >= 448.0 {
        return (sign | 0x7e, false);
    }
    let i = grid.partition_point(|&g| g <= a) - 1;
    if grid[i] == a {
        return (sign | i as u8, false);
    }
    let mid = (grid[i] + grid[i + 1]) / 2.0;
    let near = (a - mid).abs() <= a * 2f64.powi(-21);
    let q = if a < mid || (a == mid && i % 2 == 0) {
        i
    } else {
        i + 1
    };
    (sign | q as u8, near)
}

/// A row's reference: per group the scale (float64, rounded once to fp32) and per element the
/// kernels' byte, the float64 byte and whether they may differ.
pub struct RowRef {
    pub scales: Vec<f32>,
    pub bytes: Vec<u8>,
    pub f64_bytes: Vec<u8>,
    pub near: Vec<bool>,
}

pub fn quant_ref(grid: &[f64], row: &[u16], ue8m0: bool) -> RowRef {
    let mut r = RowRef {
        scales: Vec::new(),
        bytes: Vec::new(),
        f64_bytes: Vec::new(),
        near: Vec::new(),
    };
    for grp in row.chunks(128) {
        let xs: Vec<f64> = grp.iter().map(|&b| bf16_to_f32(b) as f64).collect();
        let amax = xs.iter().fold(0f64, |m, v| m.max(v.abs()));
        let mut s = (amax / 448.0).max(f32::MIN_POSITIVE as f64) as f32;
        if ue8m0 {
            s = 2f64.powf((s as f64).log2().ceil()) as f32;
        }
        let inv = 1.0f32 / s;
        for &x in &xs {
            r.bytes.push(e4m3_rne(grid, (x as f32 * inv) as f64).0);
            let (q, near) = e4m3_rne(grid, x / s as f64);
            r.f64_bytes.push(q);
            r.near.push(near);
        }
        r.scales.push(s);
    }
    r
}

/// One received row of a quantizing dispatch against the bf16 row it came from (module header):
/// the scales exactly, each byte the kernels' arithmetic's and the float64 reference's or one
/// step from it at a midpoint (never with UE8M0). Returns the bytes one step from float64.
pub fn check_quantized_row(
    grid: &[f64],
    row: &[u16],
    got: &[u8],
    got_s: &[f32],
    ue8m0: bool,
    what: &str,
) -> usize {
    let want = quant_ref(grid, row, ue8m0);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(got_s), bits(&want.scales), "{what}: scales");
    let mut steps = 0;
    for (i, &b) in got.iter().enumerate() {
        assert_eq!(
            b,
            want.bytes[i],
            "{what}: element {i} (x {}) is {b:#x}, the kernels' arithmetic gives {:#x}",
            bf16_to_f32(row[i]),
            want.bytes[i]
        );
        if b != want.f64_bytes[i] {
            assert!(
                !ue8m0 && want.near[i] && one_step(b, want.f64_bytes[i]),
                "{what}: element {i} is {b:#x}, the float64 reference {:#x}",
                want.f64_bytes[i]
            );
            steps += 1;
        }
    }
    steps
}

/// Whether e4m3 codes `a` and `b` of the same sign are neighbours.
fn one_step(a: u8, b: u8) -> bool {
    a & 0x80 == b & 0x80 && (a & 0x7f).abs_diff(b & 0x7f) == 1
}

/// One rank's inputs of a quantization case: bf16 rows (or, pre-quantized, e4m3 bytes and
/// scales from rank_inputs), routing and weights.
struct QIn {
    rows: Vec<u16>,
    inp: Inputs,
}

fn q_inputs(o: &Obj, q: Q, c: &Case, rank: usize) -> QIn {
    let inp = rank_inputs(&o.s, c, o.w, rank);
    let rows = if q.quantize {
        bf16_rows(c.seed, rank, inp.n, o.s.h)
    } else {
        Vec::new()
    };
    QIn { rows, inp }
}

/// One dispatch of case `c` on a quantization object, checked as the module header says.
/// Returns (rows checked, bytes one step from the float64 reference).
pub fn q_case(o: &Obj, q: Q, c: &Case, grid: &[f64]) -> (usize, usize) {
    let (h, g) = (o.s.h, o.s.h / 128);
    let all: Vec<QIn> = (0..o.w).map(|r| q_inputs(o, q, c, r)).collect();
    let me = &all[o.rank];
    let x: Vec<u8> = if q.quantize {
        me.rows.iter().flat_map(|b| b.to_le_bytes()).collect()
    } else {
        me.inp.x.clone()
    };
    let bufs = [
        Buf::with(o.dev, &x),
        Buf::with(o.dev, &f32_bytes(&me.inp.scales)),
        Buf::with(o.dev, &me.inp.idx_bytes(c.idx64)),
        Buf::with(o.dev, &f32_bytes(&me.inp.w)),
    ];
    let n = me.inp.n;
    let p = |i: usize| if n == 0 { null_mut() } else { bufs[i].ptr() };
    let scales_bytes = o.lay.scale_stride_expert as usize * o.l * 4;
    o.dev.fill(o.lay.recv_x as u64, o.l * o.r * h, POISON);
    o.dev.fill(o.lay.recv_scales as u64, scales_bytes, POISON);
    let it = if c.idx64 {
        SYMM_INDEX_INT64
    } else {
        SYMM_INDEX_INT32
    };
    let sc = if q.quantize { null_mut() } else { p(1) };
    let st = symm_moe_dispatch(o.moe, p(0), sc as _, p(2), it, p(3) as _, n, c.k, o.dev.s());
    expect_ok(o, st, &format!("{q:?} {c:?}"));
    let counts = i32s(&o.dev.get(o.lay.recv_counts as u64, o.l * 4));
    let src = i32s(&o.dev.get(o.lay.recv_src as u64, o.l * o.r * 4));
    let rx = o.dev.get(o.lay.recv_x as u64, o.l * o.r * h);
    let rs = o.dev.get(o.lay.recv_scales as u64, scales_bytes);
    let scale_at =
        |i: u64| f32::from_le_bytes(rs[4 * i as usize..4 * i as usize + 4].try_into().unwrap());
    let [se, sr, sg] = [
        o.lay.scale_stride_expert,
        o.lay.scale_stride_row,
        o.lay.scale_stride_group,
    ];
    let first = o.rank * o.l;
    let (mut rows, mut steps) = (0, 0);
    for le in 0..o.l {
        let mut row = 0usize;
        for (s, qin) in all.iter().enumerate() {
            let (kk, n_s) = (c.k as usize, qin.inp.n);
            for t in 0..n_s {
                let Some(j) = (0..kk).find(|&j| qin.inp.idx[t * kk + j] == (first + le) as i64)
                else {
                    continue;
                };
                let what = format!("rank {} {q:?} {c:?}: expert {le} row {row}", o.rank);
                let code = ((s * o.s.t + t) * o.s.topk as usize + j) as i32;
                assert_eq!(src[le * o.r + row], code, "{what}: recv_src");
                let got = &rx[(le * o.r + row) * h..(le * o.r + row + 1) * h];
                let got_s: Vec<f32> = (0..g as u64)
                    .map(|gi| scale_at(le as u64 * se + row as u64 * sr + gi * sg))
                    .collect();
                if q.quantize {
                    let row = &qin.rows[t * h..(t + 1) * h];
                    steps += check_quantized_row(grid, row, got, &got_s, q.ue8m0, &what);
                } else {
                    assert_eq!(got, &qin.inp.x[t * h..(t + 1) * h], "{what}: payload");
                    assert_eq!(got_s, &qin.inp.scales[t * g..(t + 1) * g], "{what}: scales");
                }
                row += 1;
                rows += 1;
            }
        }
        assert_eq!(
            counts[le], row as i32,
            "rank {} {q:?}: recv_counts[{le}]",
            o.rank
        );
    }
    (rows, steps)
}

/// Every configuration of `QS` over cases of several token counts, routings, index types and
/// three dispatches per object (both parities of the staged rows). R is `W * T - 1` (7 at world
/// 1): never a multiple of 4 at these worlds, so the column-major layout pads it. Returns (rows checked,
/// bytes one step from float64).
pub fn quantized(comm: Comm, dev: Dev, w: usize, seed: u64) -> (usize, usize) {
    let grid = grid();
    let (mut rows, mut steps) = (0, 0);
    for (i, q) in QS.iter().enumerate() {
        // H = 384: three groups, a row of 48 vectors (a warp's second pass is half full).
        // R = W * T - 1 (at world 1, W * T = 7): an expert overflows only if every token of
        // every rank picks it (4 of 16 experts each).
        let mut s = Shape::new(7, 384, 4, experts(w, 16), true);
        s.max_recv = if w > 1 { (w * 7 - 1) as u64 } else { 0 };
        let o = qcreate(comm, dev, s, *q);
        for (j, c) in [
            Case::new(seed + 10 * i as u64, 7, 4, Route::Random),
            Case::new(seed + 10 * i as u64 + 1, 6, 2, Route::Holes).i64(),
            Case::new(seed + 10 * i as u64 + 2, 7, 3, Route::Random).ragged(),
        ]
        .iter()
        .enumerate()
        {
            let (r, st) = q_case(&o, *q, c, &grid);
            assert!(r > 0 || j == 2, "{q:?} {c:?}: no rows arrived");
            rows += r;
            steps += st;
        }
    }
    (rows, steps)
}

/// The new create fields' refusals (every rank alike, naming the value), a mismatch between
/// ranks, a version 2 config (the new fields past its size unread), and `x_scales` given to a
/// quantizing object: that rank names it, every other rank names that rank; then a good
/// dispatch passes.
pub fn quant_errors(comm: Comm, dev: Dev, w: usize, rank: usize, seed: u64) {
    let s = Shape::new(4, 256, 2, experts(w, 4), true);
    let q = QS[0];
    let with = |f: &dyn Fn(&mut symm_moe_config_t)| {
        let mut c = qconfig(&s, q);
        f(&mut c);
        Some(c)
    };
    let bf = Shape::new(4, 256, 2, experts(w, 4), false);
    let cases: Vec<(Shape, Option<symm_moe_config_t>, &str)> = vec![
        (s, with(&|c| c.input = 2), "input 2 is not an input kind"),
        (
            s,
            with(&|c| c.scale_layout = 2),
            "scale_layout 2 is not a scale layout",
        ),
        (
            s,
            with(&|c| c.scale_ue8m0 = 2),
            "scale_ue8m0 2; expected 0 or 1",
        ),
        (
            s,
            with(&|c| {
                c.input = SYMM_MOE_INPUT_PAYLOAD;
                c.scale_ue8m0 = 1
            }),
            "scale_ue8m0 1 without quantization",
        ),
        (
            bf,
            with(&|c| c.dtype = SYMM_MOE_BF16),
            "input 1 (SYMM_MOE_INPUT_BF16: quantize bf16 x in the dispatch) with dtype 0",
        ),
        (
            bf,
            with(&|c| {
                c.dtype = SYMM_MOE_BF16;
                c.input = 0;
                c.scale_layout = SYMM_MOE_SCALES_COL_TMA
            }),
            "scale_layout 1 (SYMM_MOE_SCALES_COL_TMA) with dtype 0",
        ),
        (s, with(&|c| c.reserved3 = 1), "reserved3 0x1; expected 0"),
    ];
    let invalid = symm_status_t::SYMM_ERR_INVALID_ARGUMENT;
    for (sh, cfg, needle) in &cases {
        refuse(comm, *sh, *cfg, invalid, &[needle.to_string()]);
    }
    if w > 1 {
        let mine = with(&|c| c.scale_layout = (rank == 0) as u32);
        let ns = symm_status_t::SYMM_ERR_NOT_SYMMETRIC;
        let both = ["scale_layout 1".to_string(), "scale_layout 0".to_string()];
        refuse(comm, s, mine, ns, &both);
    }
    // Version 2: the fields from `input` on are past its size, never read.
    let mut v2 = qconfig(&s, q);
    v2.version = 2;
    v2.size = std::mem::offset_of!(symm_moe_config_t, input) as u32;
    v2.input = 9;
    let mut m = null_mut();
    assert_eq!(
        symm_moe_create_config(comm, &v2, &mut m),
        OK,
        "v2: {}",
        err()
    );
    let (st, lay) = layout_of(m, SYMM_MOE_LAYOUT_VERSION, layout_size());
    assert_eq!((st, lay.input), (OK, SYMM_MOE_INPUT_PAYLOAD));
    assert_eq!(symm_moe_destroy(m), OK, "{}", err());
    // x_scales given to a quantizing object, on the last rank.
    let o = qcreate(comm, dev, s, q);
    let bad = w - 1;
    // Every expert gets rows from every rank (the last check below asserts this rank received
    // some: with random routing a rank of 8 got none in about 1 run of 100).
    let c = Case::new(
        seed,
        3,
        2,
        Route::Table(|w, r, t, j| ((r + 2 * t + j) % experts(w, 4) as usize) as i64),
    );
    let inp = rank_inputs(&o.s, &c, w, rank);
    let x = Buf::with(dev, &vec![0u8; inp.n * s.h * 2]);
    let sc = Buf::with(dev, &f32_bytes(&inp.scales));
    let idx = Buf::with(dev, &inp.idx_bytes(false));
    let wt = Buf::with(dev, &f32_bytes(&inp.w));
    let scales = if rank == bad {
        sc.ptr() as *const f32
    } else {
        null_mut()
    };
    let st = symm_moe_dispatch(
        o.moe,
        x.ptr(),
        scales,
        idx.ptr(),
        SYMM_INDEX_INT32,
        wt.ptr() as _,
        inp.n,
        2,
        dev.s(),
    );
    let needle = if rank == bad {
        format!(
            "x_scales {:#x} given, but this object quantizes bf16 x itself",
            sc.p
        )
    } else {
        format!("rank {bad} refused the dispatch")
    };
    expect(
        &o,
        st,
        INVALID,
        &[needle],
        "x_scales on a quantizing object",
    );
    let (r, _) = q_case(&o, q, &c, &grid());
    assert!(r > 0);
}
