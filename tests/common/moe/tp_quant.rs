//! The throughput mode's FP8 options (docs/moe.md, "Throughput mode"): bf16 `x` quantized
//! inside the dispatch (row-major and column-major TMA-aligned scales, with and without UE8M0)
//! and the caller's FP8 payload with column-major scales; run by tests/moe_tp_host.rs on the
//! host backend and tests/gpu_moe.rs on CUDA. Every rank regenerates every rank's bf16 rows and
//! routing from the seed and checks each received row (by source rank, then token) exactly:
//! each scale is the float64 reference's rounded once to fp32 (quant.rs `quant_ref`), read at
//! the strides the layout query reports; each e4m3 byte is the kernels' arithmetic's, and the
//! float64 reference's or one step from it at a midpoint (never with UE8M0). Also the layout
//! query's new fields and a version 1 query still served, `x_scales` given to a quantizing
//! object (that rank names it, every other rank names that rank, the object usable after), and a
//! combine after a quantizing dispatch (the payload does not enter it: y bit for bit).

use super::quant::{bf16_rows, check_quantized_row, grid, qconfig, want_strides, Q, QS};
use super::tp::*;
use super::POISON;
use super::{experts, f32_bytes, i32s, rank_inputs, Buf, Case, Dev, Route, Shape, INVALID};
use crate::common::{err, Comm, OK};
use std::ptr::null_mut;
use symmalloc::ffi::moe::*;
use symmalloc::ffi::moe_calls::*;

/// A throughput object with FP8 option `q`; checks the layout query's version 2 fields and
/// that a version 1 query gets the fields before them only.
pub fn tp_qcreate(comm: Comm, dev: Dev, s: Shape, q: Q) -> Tp {
    let mut cfg = qconfig(&s, q);
    cfg.mode = SYMM_MOE_THROUGHPUT;
    let o = tp_create_with(comm, s, dev, cfg);
    let lay = &o.lay;
    let col = if q.col {
        SYMM_MOE_SCALES_COL_TMA
    } else {
        SYMM_MOE_SCALES_ROW_MAJOR
    };
    assert_eq!(
        (lay.input, lay.scale_layout, lay.scale_ue8m0, lay.reserved2),
        (q.quantize as u32, col, q.ue8m0 as u32, 0),
        "{lay:?}"
    );
    let [_, sr, sg] = want_strides(q, o.w * s.t, s.h / 128);
    assert_eq!(
        (lay.scale_stride_row, lay.scale_stride_group),
        (sr, sg),
        "{s:?} {q:?}"
    );
    // A version 1 query: the fields before `input`, nothing after.
    let v1 = std::mem::offset_of!(symm_moe_tp_layout_t, input) as u32;
    // SAFETY: an all-0xFF layout is valid (integers and pointers, never dereferenced here).
    let mut old: symm_moe_tp_layout_t =
        unsafe { std::mem::transmute([0xFFu8; std::mem::size_of::<symm_moe_tp_layout_t>()]) };
    old.version = 1;
    old.size = v1;
    assert_eq!(symm_moe_tp_layout(o.moe, &mut old), OK, "{}", err());
    assert_eq!(
        (old.recv_x, old.recv_scales, old.buffer_bytes),
        (lay.recv_x, lay.recv_scales, lay.buffer_bytes)
    );
    assert_eq!(
        (old.input, old.scale_stride_group),
        (u32::MAX, u64::MAX),
        "a version 1 query got fields past its size"
    );
    o
}

/// One dispatch of case `c`, checked as the module header says. Returns (rows checked, bytes
/// one step from the float64 reference).
pub fn tp_q_case(o: &Tp, q: Q, c: &Case, grid: &[f64]) -> (usize, usize) {
    tp_q_case_with(o, q, c, grid, &one_call)
}

/// `tp_q_case` through `call` (the one-call form or the split halves).
pub fn tp_q_case_with(o: &Tp, q: Q, c: &Case, grid: &[f64], call: DispatchCall) -> (usize, usize) {
    let (h, g, d) = (o.s.h, o.s.h / 128, o.dev);
    let all: Vec<_> = (0..o.w).map(|r| rank_inputs(&o.s, c, o.w, r)).collect();
    let rows: Vec<Vec<u16>> = (0..o.w)
        .map(|r| {
            if q.quantize {
                bf16_rows(c.seed, r, all[r].n, h)
            } else {
                Vec::new()
            }
        })
        .collect();
    let me = &all[o.rank];
    let x: Vec<u8> = if q.quantize {
        rows[o.rank].iter().flat_map(|b| b.to_le_bytes()).collect()
    } else {
        me.x.clone()
    };
    let bufs = [
        Buf::with(d, &x),
        Buf::with(d, &f32_bytes(&me.scales)),
        Buf::with(d, &me.idx_bytes(c.idx64)),
        Buf::with(d, &f32_bytes(&me.w)),
    ];
    let n = me.n;
    let p = |i: usize| if n == 0 { null_mut() } else { bufs[i].ptr() };
    let r_all = o.w * o.s.t;
    let scale_elems = if q.col {
        g * r_all.div_ceil(4) * 4
    } else {
        g * r_all
    };
    d.fill(o.lay.recv_x as u64, r_all * h, POISON);
    d.fill(o.lay.recv_scales as u64, 4 * scale_elems, POISON);
    let it = if c.idx64 {
        SYMM_INDEX_INT64
    } else {
        SYMM_INDEX_INT32
    };
    let sc = if q.quantize { null_mut() } else { p(1) };
    let st = call(o, [p(0), sc, p(2), p(3)], it, n, c.k);
    assert_eq!(st, OK, "rank {} {q:?} {c:?}: {}", o.rank, err());
    if d.gpu {
        // The kernels record what only the routing or a peer shows.
        d.sync();
        let st = symm_moe_check(o.moe);
        assert_eq!(st, OK, "rank {} {q:?} {c:?}: {}", o.rank, err());
    }
    let want = want_recv(o, &all, o.rank);
    let got_n = i32s(&d.get(o.lay.num_recv as u64, 4))[0];
    assert_eq!(got_n as usize, want.rows.len(), "rank {}: num_recv", o.rank);
    let src = i32s(&d.get(o.lay.recv_src as u64, 4 * r_all));
    let rx = d.get(o.lay.recv_x as u64, r_all * h);
    let rs = d.get(o.lay.recv_scales as u64, 4 * scale_elems);
    let scale_at =
        |i: u64| f32::from_le_bytes(rs[4 * i as usize..4 * i as usize + 4].try_into().unwrap());
    let (sr, sg) = (o.lay.scale_stride_row, o.lay.scale_stride_group);
    let mut steps = 0;
    for (r, (s, t, _, _)) in want.rows.iter().enumerate() {
        let (s, t) = (*s, *t);
        let what = format!("rank {} {q:?} {c:?}: row {r} (rank {s} token {t})", o.rank);
        assert_eq!(src[r] as usize, s * o.s.t + t, "{what}: recv_src");
        let got = &rx[r * h..(r + 1) * h];
        let got_s: Vec<f32> = (0..g as u64)
            .map(|gi| scale_at(r as u64 * sr + gi * sg))
            .collect();
        if !q.quantize {
            assert_eq!(got, &all[s].x[t * h..(t + 1) * h], "{what}: payload");
            assert_eq!(got_s, &all[s].scales[t * g..(t + 1) * g], "{what}: scales");
            continue;
        }
        let row = &rows[s][t * h..(t + 1) * h];
        steps += check_quantized_row(grid, row, got, &got_s, q.ue8m0, &what);
    }
    (want.rows.len(), steps)
}

/// Every configuration of `QS` over three dispatches per object (both parities of the staged
/// rows), several token counts, routings and index types, then a combine of the last one (bit
/// for bit against the contract's sum: the payload does not enter it). W*T = 7 at world 1: the
/// column-major layout pads it. Returns (rows checked, bytes one step from float64).
pub fn tp_quantized(comm: Comm, dev: Dev, w: usize, seed: u64) -> (usize, usize) {
    let grid = grid();
    let (mut rows, mut steps) = (0, 0);
    for (i, q) in QS.iter().enumerate() {
        // H = 384: three groups, a row of 48 vectors (a warp's second pass is half full).
        let s = Shape::new(7, 384, 4, experts(w, 16), true);
        let o = tp_qcreate(comm, dev, s, *q);
        let base = seed + 10 * i as u64;
        let cases = [
            Case::new(base, 7, 4, Route::Random),
            Case::new(base + 1, 6, 2, Route::Holes).i64(),
            Case::new(base + 2, 7, 3, Route::Random).ragged(),
        ];
        for (j, c) in cases.iter().enumerate() {
            let (r, st) = tp_q_case(&o, *q, c, &grid);
            assert!(r > 0 || j == 2, "{q:?} {c:?}: no rows arrived");
            rows += r;
            steps += st;
        }
        // The combine of the last dispatch: y from the rows' expert outputs, as tp.rs checks it.
        let all: Vec<_> = (0..o.w)
            .map(|r| rank_inputs(&o.s, &cases[2], o.w, r))
            .collect();
        let want = want_recv(&o, &all, o.rank);
        let y = tp_combine_checked(&o, &all, &want, 0, &format!("{q:?} combine"));
        assert_eq!(y.len(), all[o.rank].n * s.h);
    }
    (rows, steps)
}

/// `x_scales` given to a quantizing object on the last rank: that rank names the pointer, every
/// other rank names that rank; then a good dispatch passes.
pub fn tp_quant_errors(comm: Comm, dev: Dev, w: usize, seed: u64) {
    let s = Shape::new(4, 256, 2, experts(w, 4), true);
    let q = QS[0];
    let o = tp_qcreate(comm, dev, s, q);
    let (me, bad) = (o.rank, w - 1);
    let c = Case::new(seed, 3, 2, Route::Random);
    let inp = rank_inputs(&s, &c, w, me);
    let x = Buf::with(dev, &vec![0u8; inp.n * s.h * 2]);
    let sc = Buf::with(dev, &f32_bytes(&inp.scales));
    let idx = Buf::with(dev, &inp.idx_bytes(false));
    let wt = Buf::with(dev, &f32_bytes(&inp.w));
    let scales = if me == bad {
        sc.ptr() as *const f32
    } else {
        null_mut()
    };
    let mut st = symm_moe_dispatch(
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
    if st == OK && dev.gpu {
        dev.sync();
        st = symm_moe_check(o.moe);
    }
    let needle = if me == bad {
        format!(
            "x_scales {:#x} given, but this object quantizes bf16 x itself",
            sc.p
        )
    } else {
        format!("rank {bad} refused the dispatch")
    };
    let e = err();
    assert_eq!(
        st, INVALID,
        "rank {me}: x_scales on a quantizing object: {e}"
    );
    assert!(e.contains(&needle), "rank {me}: {e:?} lacks {needle:?}");
    let (r, _) = tp_q_case(&o, q, &Case::new(seed ^ 1, 4, 2, Route::Random), &grid());
    assert!(r > 0 || w > 1, "no rows after the refusal");
}
