//! The throughput mode's scenarios (docs/moe.md, "Throughput mode"), run by tests/moe_tp_host.rs
//! on the host backend and tests/gpu_moe.rs on CUDA: every rank regenerates every rank's inputs
//! from the case's seed (`rank_inputs`), builds the receive buffers it must get (one row per (token, this rank), by
//! source rank then token; local top-k ids, weights, counts, CSR) and checks them exactly; the
//! experts' per-row sums are a pure function of the inputs, so each rank also knows every other
//! rank's combine input and checks `y` bit for bit against the contract's sum (destination
//! ranks in increasing order, fp32, rounded once) and within bf16 rounding of a float64 one.
//! The error scenarios: tp_errors.rs.

use super::POISON;
use super::{
    bf16, expert_row, experts, probe_in_order, probe_read, rank_inputs, Buf, Case, Dev, Expert,
    Inputs, Route, Shape, INVALID,
};
use crate::common::{err, Comm, OK};
use std::ffi::c_void;
use std::ptr::null_mut;
use symmalloc::comm::convert::bf16_to_f32;
use symmalloc::ffi::moe::*;
use symmalloc::ffi::moe_calls::*;
use symmalloc::ffi::types::*;

/// A throughput-mode object and its layout; destroyed on drop.
pub struct Tp {
    pub moe: *mut symm_moe_t,
    pub s: Shape,
    pub w: usize,
    pub rank: usize,
    pub l: usize,
    pub lay: symm_moe_tp_layout_t,
    pub dev: Dev,
}

impl Drop for Tp {
    fn drop(&mut self) {
        self.dev.sync();
        let st = symm_moe_destroy(self.moe);
        if !std::thread::panicking() {
            assert_eq!(st, OK, "symm_moe_destroy: {}", err());
        }
    }
}

pub fn tp_config(s: &Shape) -> symm_moe_config_t {
    let mut c = s.config();
    c.mode = SYMM_MOE_THROUGHPUT;
    c
}

/// `symm_moe_tp_layout` into a fresh struct.
pub fn tp_layout_of(moe: *const symm_moe_t) -> (symm_status_t, symm_moe_tp_layout_t) {
    // SAFETY: an all-zero symm_moe_tp_layout_t is valid (integers and NULL pointers).
    let mut l: symm_moe_tp_layout_t = unsafe { std::mem::zeroed() };
    l.version = SYMM_MOE_TP_LAYOUT_VERSION;
    l.size = std::mem::size_of::<symm_moe_tp_layout_t>() as u32;
    let st = symm_moe_tp_layout(moe, &mut l);
    (st, l)
}

/// Creates a throughput-mode object and checks its layout's fields.
pub fn tp_create(comm: Comm, s: Shape, dev: Dev) -> Tp {
    tp_create_with(comm, s, dev, tp_config(&s))
}

/// As `tp_create`, with the configuration `cfg` (`tp_config(&s)` changed).
pub fn tp_create_with(comm: Comm, s: Shape, dev: Dev, cfg: symm_moe_config_t) -> Tp {
    let mut moe = null_mut();
    let st = symm_moe_create_config(comm, &cfg, &mut moe);
    assert_eq!(
        st,
        OK,
        "symm_moe_create_config (throughput) {s:?}: {}",
        err()
    );
    let (st, lay) = tp_layout_of(moe);
    assert_eq!(st, OK, "symm_moe_tp_layout: {}", err());
    let w = lay.world as usize;
    let l = s.e as usize / w;
    let want = (
        (w * s.t) as u64,
        l as u64,
        lay.rank as u64 * l as u64,
        s.h as u64,
        s.t as u64,
    );
    let got = (
        lay.max_rows,
        lay.local_experts,
        lay.first_expert,
        lay.hidden,
        lay.max_tokens_per_rank,
    );
    assert_eq!(got, want, "tp layout of {s:?}");
    assert_eq!(
        (lay.topk, lay.num_experts, lay.dtype),
        (s.topk, s.e, s.dtype())
    );
    let rows = (w * s.t) as u64;
    assert!(lay.buffer_bytes >= rows * s.row() as u64, "{lay:?}");
    for p in [
        lay.recv_x as u64,
        lay.recv_topk_idx as u64,
        lay.expert_rows as u64,
    ] {
        assert!(p != 0 && p % 16 == 0, "{lay:?}");
    }
    assert_eq!(lay.recv_scales.is_null(), !s.fp8, "{lay:?}");
    Tp {
        moe,
        s,
        w,
        rank: lay.rank as usize,
        l,
        lay,
        dev,
    }
}

/// What rank `me` must receive: per row (source, token, local top-k ids, weights).
pub struct Want {
    pub rows: Vec<(usize, usize, Vec<i32>, Vec<f32>)>,
    pub per_expert: Vec<i32>,
}

/// The rows rank `me` receives from every rank's inputs (module header).
pub fn want_recv(o: &Tp, all: &[Inputs], me: usize) -> Want {
    let (kk, l) = (o.s.topk as usize, o.l as i64);
    let mut rows = Vec::new();
    let mut per_expert = vec![0i32; o.l];
    for (s, inp) in all.iter().enumerate() {
        for t in 0..inp.n {
            let mut ids = vec![-1i32; kk];
            let mut ws = vec![0f32; kk];
            for j in 0..inp.k {
                let e = inp.idx[t * inp.k + j];
                if e >= 0 && e / l == me as i64 {
                    ids[j] = (e % l) as i32;
                    ws[j] = inp.w[t * inp.k + j];
                    per_expert[(e % l) as usize] += 1;
                }
            }
            if ids.iter().any(|&v| v >= 0) {
                rows.push((s, t, ids, ws));
            }
        }
    }
    Want { rows, per_expert }
}

/// The caller's combine input for a received row: the weighted sum over this rank's experts
/// of `Expert::Scale` outputs (expert id shifted by `shift * 16`), fma in increasing slot
/// order, rounded to bf16: a pure function of the inputs, so every rank can compute any rank's.
pub fn row_out(s: &Shape, inp: &Inputs, t: usize, dest: usize, l: usize, shift: usize) -> Vec<u16> {
    let mut acc = vec![0f32; s.h];
    let x = &inp.x[t * s.row()..(t + 1) * s.row()];
    let sc = &inp.scales[t * s.sc()..(t + 1) * s.sc()];
    for j in 0..inp.k {
        let e = inp.idx[t * inp.k + j];
        if e < 0 || e as usize / l != dest {
            continue;
        }
        let out = expert_row(Expert::Scale, s, e as usize + 16 * shift, x, sc);
        let wt = inp.w[t * inp.k + j];
        for (a, v) in acc.iter_mut().zip(out) {
            *a = wt.mul_add(bf16_to_f32(v), *a);
        }
    }
    acc.into_iter().map(bf16).collect()
}

fn i32s(b: &[u8]) -> Vec<i32> {
    super::i32s(b)
}

fn f32s(b: &[u8]) -> Vec<u32> {
    i32s(b).into_iter().map(|v| v as u32).collect()
}

/// Dispatches this rank's inputs (the status, unchecked).
/// How a test issues a dispatch: `symm_moe_dispatch`'s arguments (`x`, `x_scales`, `topk_idx`,
/// `topk_weights` as pointers, then the index type, the token count and k) to the one-call form
/// (`one_call`) or to the split halves (tp_split.rs).
pub type DispatchCall<'a> = &'a dyn Fn(&Tp, [*mut c_void; 4], u32, usize, u32) -> symm_status_t;
/// How a test issues a combine: `expert_out` and `y` to the one-call form (`one_combine`) or to
/// the split halves.
pub type CombineCall<'a> = &'a dyn Fn(&Tp, *mut c_void, *mut c_void) -> symm_status_t;

pub fn one_call(o: &Tp, p: [*mut c_void; 4], it: u32, n: usize, k: u32) -> symm_status_t {
    symm_moe_dispatch(o.moe, p[0], p[1] as _, p[2], it, p[3] as _, n, k, o.dev.s())
}

pub fn one_combine(o: &Tp, eo: *mut c_void, y: *mut c_void) -> symm_status_t {
    symm_moe_combine(o.moe, eo, y, o.dev.s())
}

pub fn tp_dispatch(
    o: &Tp,
    inp: &Inputs,
    k: u32,
    idx64: bool,
    bufs: &mut Vec<Buf>,
) -> symm_status_t {
    tp_dispatch_with(o, inp, k, idx64, bufs, &one_call)
}

/// `tp_dispatch` through `call`.
pub fn tp_dispatch_with(
    o: &Tp,
    inp: &Inputs,
    k: u32,
    idx64: bool,
    bufs: &mut Vec<Buf>,
    call: DispatchCall,
) -> symm_status_t {
    let d = o.dev;
    let x = Buf::with(d, &inp.x);
    let sc = Buf::with(d, &super::f32_bytes(&inp.scales));
    let idx = Buf::with(d, &inp.idx_bytes(idx64));
    let wt = Buf::with(d, &super::f32_bytes(&inp.w));
    let it = if idx64 {
        SYMM_INDEX_INT64
    } else {
        SYMM_INDEX_INT32
    };
    let scales = if o.s.fp8 {
        sc.ptr() as *const f32
    } else {
        null_mut()
    };
    let st = call(
        o,
        [x.ptr(), scales as *mut c_void, idx.ptr(), wt.ptr()],
        it,
        inp.n,
        k,
    );
    bufs.extend([x, sc, idx, wt]);
    st
}

/// Checks the receive buffers after a dispatch of `all` (every rank's inputs).
pub fn check_tp_recv(o: &Tp, all: &[Inputs], what: &str) -> Want {
    let (d, lay, kk) = (o.dev, &o.lay, o.s.topk as usize);
    let want = want_recv(o, all, o.rank);
    let n = want.rows.len();
    let got_n = i32s(&d.get(lay.num_recv as u64, 4))[0];
    assert_eq!(got_n as usize, n, "rank {} {what}: num_recv", o.rank);
    let per = i32s(&d.get(lay.num_recv_tokens_per_expert as u64, 4 * o.l));
    assert_eq!(per, want.per_expert, "rank {} {what}: per expert", o.rank);
    let offs = i32s(&d.get(lay.expert_offsets as u64, 4 * (o.l + 1)));
    let mut sum = 0;
    for (off, cnt) in offs.iter().zip(&want.per_expert) {
        assert_eq!(*off, sum, "rank {} {what}: offsets", o.rank);
        sum += cnt;
    }
    assert_eq!(offs[o.l], sum);
    let src = i32s(&d.get(lay.recv_src as u64, 4 * n));
    let ids = i32s(&d.get(lay.recv_topk_idx as u64, 4 * n * kk));
    let ws = f32s(&d.get(lay.recv_topk_weights as u64, 4 * n * kk));
    let xs = d.get(lay.recv_x as u64, n * o.s.row());
    let scs = d.get(lay.recv_scales as u64, 4 * n * o.s.sc());
    let er = i32s(&d.get(lay.expert_rows as u64, 4 * sum as usize));
    let mut csr = vec![Vec::new(); o.l];
    for (r, (s, t, wid, ww)) in want.rows.iter().enumerate() {
        let at = format!("rank {} {what}: row {r} (rank {s} token {t})", o.rank);
        assert_eq!(src[r] as usize, s * o.s.t + t, "{at}: recv_src");
        assert_eq!(&ids[r * kk..(r + 1) * kk], &wid[..], "{at}: recv_topk_idx");
        let wb: Vec<u32> = ww.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            &ws[r * kk..(r + 1) * kk],
            &wb[..],
            "{at}: recv_topk_weights"
        );
        let row = o.s.row();
        let inp = &all[*s];
        assert!(
            xs[r * row..(r + 1) * row] == inp.x[t * row..(t + 1) * row],
            "{at}: recv_x"
        );
        let sc = o.s.sc();
        let want_sc = super::f32_bytes(&inp.scales[t * sc..(t + 1) * sc]);
        assert!(
            scs[r * sc * 4..(r + 1) * sc * 4] == want_sc[..],
            "{at}: scales"
        );
        for (j, &le) in wid.iter().enumerate() {
            if le >= 0 {
                csr[le as usize].push((r * kk + j) as i32);
            }
        }
    }
    assert_eq!(er, csr.concat(), "rank {} {what}: expert_rows", o.rank);
    want
}

/// The combine's input for this rank's received rows (`want`), rows past them poisoned.
pub fn tp_expert_out(o: &Tp, all: &[Inputs], want: &Want, shift: usize) -> Buf {
    let (rows, h) = (o.w * o.s.t, o.s.h);
    let mut b = vec![POISON; rows * h * 2];
    for (r, (s, t, _, _)) in want.rows.iter().enumerate() {
        let v = row_out(&o.s, &all[*s], *t, o.rank, o.l, shift);
        for (i, x) in v.iter().enumerate() {
            b[(r * h + i) * 2..(r * h + i) * 2 + 2].copy_from_slice(&x.to_le_bytes());
        }
    }
    Buf::with(o.dev, &b)
}

/// `y` of this rank's tokens: bits per the contract, and the float64 sum with its tolerance.
pub fn want_y(o: &Tp, all: &[Inputs], shift: usize) -> Vec<u16> {
    let inp = &all[o.rank];
    let mut y = Vec::with_capacity(inp.n * o.s.h);
    for t in 0..inp.n {
        let mut acc = vec![0f32; o.s.h];
        for dest in 0..o.w {
            let goes = (0..inp.k).any(|j| {
                let e = inp.idx[t * inp.k + j];
                e >= 0 && e as usize / o.l == dest
            });
            if goes {
                let v = row_out(&o.s, inp, t, dest, o.l, shift);
                for (a, x) in acc.iter_mut().zip(v) {
                    *a += bf16_to_f32(x);
                }
            }
        }
        y.extend(acc.into_iter().map(bf16));
    }
    y
}

/// The float64 check: every element within bf16 rounding (three roundings) of the exact sum.
fn check_f64(o: &Tp, inp: &Inputs, y: &[u16], shift: usize, what: &str) {
    let s = &o.s;
    for t in 0..inp.n {
        let x = &inp.x[t * s.row()..(t + 1) * s.row()];
        let sc = &inp.scales[t * s.sc()..(t + 1) * s.sc()];
        let mut exact = vec![0f64; s.h];
        let mut mag = vec![0f64; s.h];
        for j in 0..inp.k {
            let e = inp.idx[t * inp.k + j];
            if e < 0 {
                continue;
            }
            let f = 1.0 + (e as f64 + 16.0 * shift as f64) / 16.0;
            for i in 0..s.h {
                let v = if s.fp8 {
                    super::e4m3(x[i]) as f64 * sc[i / 128] as f64
                } else {
                    bf16_to_f32(u16::from_le_bytes([x[2 * i], x[2 * i + 1]])) as f64
                };
                let term = inp.w[t * inp.k + j] as f64 * v * f;
                exact[i] += term;
                mag[i] += term.abs();
            }
        }
        for i in 0..s.h {
            let got = bf16_to_f32(y[t * s.h + i]) as f64;
            let tol = 4.0 * mag[i] / 256.0 + 1e-30;
            assert!(
                (got - exact[i]).abs() <= tol,
                "rank {} {what}: y[{t}][{i}] = {got}, float64 {} (tolerance {tol})",
                o.rank,
                exact[i]
            );
        }
    }
}

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// One combine of the last dispatch with expert `shift`; returns y's bits (checked).
pub fn tp_combine_checked(
    o: &Tp,
    all: &[Inputs],
    want: &Want,
    shift: usize,
    what: &str,
) -> Vec<u16> {
    tp_combine_checked_with(o, all, want, shift, what, &one_combine)
}

/// `tp_combine_checked` through `call`.
pub fn tp_combine_checked_with(
    o: &Tp,
    all: &[Inputs],
    want: &Want,
    shift: usize,
    what: &str,
    call: CombineCall,
) -> Vec<u16> {
    let n = all[o.rank].n;
    let eo = tp_expert_out(o, all, want, shift);
    let y = Buf::new(o.dev, (n * o.s.h * 2).max(16));
    o.dev.fill(y.p, n * o.s.h * 2, POISON);
    let st = call(o, eo.ptr(), y.ptr());
    o.dev.sync();
    assert_eq!(st, OK, "rank {} {what}: combine: {}", o.rank, err());
    let got = u16s(&o.dev.get(y.p, n * o.s.h * 2));
    let exp = want_y(o, all, shift);
    if let Some(i) = (0..got.len()).find(|&i| got[i] != exp[i]) {
        panic!(
            "rank {} {what}: y[{}][{}] = {:#06x}, expected {:#06x} (the contract's fp32 sum)",
            o.rank,
            i / o.s.h,
            i % o.s.h,
            got[i],
            exp[i]
        );
    }
    check_f64(o, &all[o.rank], &got, shift, what);
    got
}

/// One checked dispatch + combine of a case; returns y's bits.
pub fn tp_case(o: &Tp, c: &Case, what: &str) -> Vec<u16> {
    let all: Vec<Inputs> = (0..o.w).map(|r| rank_inputs(&o.s, c, o.w, r)).collect();
    let mut bufs = Vec::new();
    let st = tp_dispatch(o, &all[o.rank], c.k, c.idx64, &mut bufs);
    o.dev.sync();
    assert_eq!(st, OK, "rank {} {what}: dispatch: {}", o.rank, err());
    let want = check_tp_recv(o, &all, what);
    tp_combine_checked(o, &all, &want, 0, what)
}

/// Slot j of token t: experts 0..4 of rank 0 (every token to rank 0; E = 4W).
fn to_first(_w: usize, _r: usize, t: usize, j: usize) -> i64 {
    if j < 4 {
        ((t + j) % 4) as i64
    } else {
        -1
    }
}

/// Every token to the last rank, several of its experts (sent once).
fn to_last(w: usize, _r: usize, t: usize, j: usize) -> i64 {
    if j < 4 {
        ((w - 1) * 4 + (t + j) % 4) as i64
    } else {
        -1
    }
}

/// Token t's experts all on rank t % W, except slot 3 on rank (t + 1) % W.
fn clustered(w: usize, _r: usize, t: usize, j: usize) -> i64 {
    match j {
        0..=2 => ((t % w) * 4 + j) as i64,
        3 => (((t + 1) % w) * 4 + 3) as i64,
        _ => -1,
    }
}

pub fn fnv(h: &mut u64, v: &[u16]) {
    for x in v {
        for b in x.to_le_bytes() {
            *h = (*h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
}

/// The sweep: shapes, uniform and skewed routings, ragged and zero token counts, int64 ids,
/// FP8 payloads, each case twice (the same y bit for bit). Returns (cases, hash of the y of
/// the cases where every rank passes the same inputs: the same on every rank).
pub fn tp_sweep(comm: Comm, dev: Dev, w: usize, seed: u64) -> (usize, u64) {
    let mut cases = 0;
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let e4 = (4 * w) as u32;
    let shapes = [
        Shape::new(16, 128, 4, e4, false),
        Shape::new(8, 256, 8, experts(w, 16), false),
        Shape::new(8, 256, 2, e4, true),
    ];
    for (si, s) in shapes.into_iter().enumerate() {
        let o = tp_create(comm, s, dev);
        let mut list = vec![
            Case::new(seed, s.t, s.topk.min(4), Route::Random),
            Case::new(seed ^ 1, s.t - 3, s.topk.min(3), Route::Holes).i64(),
            Case::new(seed ^ 2, s.t, s.topk, Route::Sparse),
            Case::new(seed ^ 3, s.t, s.topk, Route::Random).ragged(),
            Case::new(seed ^ 4, 0, 1, Route::Random),
            Case::new(seed ^ 5, s.t, s.topk.min(2), Route::Hot(1)),
        ];
        if s.e == e4 {
            list.push(Case::new(seed ^ 6, s.t, s.topk, Route::Table(to_first)));
            list.push(Case::new(seed ^ 7, s.t, s.topk, Route::Table(to_last)).i64());
            list.push(Case::new(seed ^ 8, s.t, s.topk, Route::Table(clustered)));
        }
        let mut same = Case::new(seed ^ 9, s.t, s.topk, Route::Random);
        same.same = true;
        list.push(same);
        for (ci, c) in list.iter().enumerate() {
            let what = format!("shape {si} {s:?} case {ci} {:?}", c.route);
            let y1 = tp_case(&o, c, &what);
            let y2 = tp_case(&o, c, &format!("{what} (again)"));
            assert!(
                y1 == y2,
                "rank {}: {what}: y differs between two runs",
                o.rank
            );
            if c.same {
                fnv(&mut hash, &y1);
            }
            cases += 1;
        }
    }
    (cases, hash)
}

/// Grids of 1, 2 and 3 blocks: the routing and the CSR in one block (its grid barriers pass at
/// once), then spread over two and three blocks with uneven chunks of tokens and rows; on a GPU
/// also 64 and 132 blocks (as many as it has), most of them with no tokens or rows, where the
/// CSR's per-expert scan takes its grid-barrier path (above `MOE_TP_CSR_DIRECT_G`, 48 blocks);
/// the host backend's one SM makes those grids of one. Returns how many cases ran.
pub fn tp_grids(comm: Comm, dev: Dev, w: usize, seed: u64) -> usize {
    let mut ran = 0;
    for num_sms in [1u32, 2, 3, 64, 132] {
        let mut s = Shape::new(16, 128, 4, experts(w, 8), false);
        s.num_sms = num_sms;
        let o = tp_create(comm, s, dev);
        let routes = [Route::Random, Route::Sparse, Route::Hot(0)];
        for (i, route) in routes.into_iter().enumerate() {
            let c = Case::new(
                seed ^ ((num_sms as u64) << 40) ^ i as u64,
                s.t,
                s.topk,
                route,
            );
            tp_case(&o, &c, &format!("num_sms {num_sms} case {i} {:?}", c.route));
            ran += 1;
        }
    }
    ran
}

/// Several combines of one dispatch back to back (different expert outputs, then the first
/// again): each y its own; `rounds` dispatches.
pub fn tp_repeated(comm: Comm, dev: Dev, w: usize, seed: u64, rounds: u64) -> usize {
    let s = Shape::new(8, 128, 4, (4 * w) as u32, false);
    let o = tp_create(comm, s, dev);
    let mut made = 0;
    for i in 0..rounds {
        let route = if i % 2 == 0 {
            Route::Random
        } else {
            Route::Table(clustered)
        };
        let c = Case::new(seed ^ (i << 8), s.t - (i as usize % 3), 4, route);
        let all: Vec<Inputs> = (0..w).map(|r| rank_inputs(&s, &c, w, r)).collect();
        let mut bufs = Vec::new();
        let st = tp_dispatch(&o, &all[o.rank], c.k, false, &mut bufs);
        assert_eq!(st, OK, "rank {}: {}", o.rank, err());
        let want = check_tp_recv(&o, &all, "repeated");
        let first = tp_combine_checked(&o, &all, &want, 0, "combine 0");
        for shift in [1, 2, 0] {
            let y = tp_combine_checked(&o, &all, &want, shift, &format!("combine {shift}"));
            if shift == 0 {
                assert!(
                    y == first,
                    "rank {}: the same combine twice differs",
                    o.rank
                );
            }
            made += 1;
        }
        made += 1;
    }
    made
}

/// The clock probe of a throughput-mode object: refused on a plain one; with the probe on, two
/// checked dispatch + combine pairs, each leaving its words in phase order (block 0 records
/// start, routed, wait done, pulled and scanned, the grid's last block staged, published and
/// sorted; combine: block 0 start and wait done, the last block pushed and summed), its epochs,
/// and the receive starts 0 (the mode has no halves).
pub fn tp_probe_words(comm: Comm, dev: Dev, w: usize, seed: u64) {
    let s = Shape::new(16, 256, 4, experts(w, 8), false);
    {
        let mut out = [0u64; SYMM_MOE_PROBE_WORDS as usize];
        let plain = tp_create(comm, s, dev);
        let st = symm_moe_probe(plain.moe, out.as_mut_ptr(), out.len());
        assert!(
            st == INVALID && err().contains("the clock probe is off"),
            "probe of a plain throughput object: {st:?} {}",
            err()
        );
    }
    let mut cfg = tp_config(&s);
    cfg.flags = SYMM_MOE_FLAG_PROBE;
    let o = tp_create_with(comm, s, dev, cfg);
    for i in 0..2u64 {
        let c = Case::new(seed ^ 0x7b0 ^ i, s.t, s.topk, Route::Random);
        tp_case(&o, &c, &format!("probe call {i}"));
        let out = probe_read(o.moe, o.dev, &format!("rank {} call {i}", o.rank));
        let what = format!("rank {} call {i}: {out:?}", o.rank);
        // Block 0 may see its own rank's row (and end its wait) before the publishing block
        // stamps "published", so the wait follows "staged", not "published".
        let chain = |ws: &[usize]| probe_in_order(&out, ws);
        assert!(
            chain(&[0, 1, 2, 3]) && chain(&[2, 5, 6, 14, 15]),
            "dispatch: {what}"
        );
        assert!(chain(&[8, 9, 12]) && chain(&[8, 11, 12]), "combine: {what}");
        assert!(out[15] <= out[8], "the combine after the dispatch: {what}");
        assert_eq!(
            (out[4], out[10], out[7], out[13]),
            (0, 0, i + 1, i + 1),
            "{what}"
        );
    }
}
