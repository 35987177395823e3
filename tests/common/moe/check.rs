//! One checked dispatch + expert + combine (`run_case`): the receive buffers against every
//! rank's inputs (`check_recv`), `y` bit for bit against the contract's fixed-order fp32 sum and
//! within bf16 rounding of the float64 one (`check_y`); and what a rank learns of a failed call
//! (`outcome`: at the call, or on CUDA from `symm_moe_check` once the stream ran).

use super::*;
use crate::common::{err, fnv, OK};
use std::ffi::c_void;
use std::ptr::null_mut;
use symmalloc::comm::convert::bf16_to_f32;
use symmalloc::ffi::moe::*;
use symmalloc::ffi::moe_calls::*;
use symmalloc::ffi::types::*;

/// A rank's receive buffers as a dispatch left them.
pub struct Recv {
    pub counts: Vec<i32>,
    pub src: Vec<i32>,
    pub x: Vec<u8>,
    pub scales: Vec<u8>,
}

pub fn read_recv(o: &Obj) -> Recv {
    let (l, r, s) = (o.l, o.r, &o.s);
    let d = &o.dev;
    Recv {
        counts: i32s(&d.get(o.lay.recv_counts as u64, l * 4)),
        src: i32s(&d.get(o.lay.recv_src as u64, l * r * 4)),
        x: d.get(o.lay.recv_x as u64, l * r * s.row()),
        scales: d.get(o.lay.recv_scales as u64, l * r * s.sc() * 4),
    }
}

/// Poisons every receive buffer (before a dispatch: no peer writes into them before this rank
/// calls it).
pub fn poison_recv(o: &Obj) {
    let (l, r, s, d) = (o.l, o.r, &o.s, &o.dev);
    d.fill(o.lay.recv_counts as u64, l * 4, POISON);
    d.fill(o.lay.recv_src as u64, l * r * 4, POISON);
    d.fill(o.lay.recv_x as u64, l * r * s.row(), POISON);
    d.fill(o.lay.recv_scales as u64, l * r * s.sc() * 4, POISON);
}

/// After a dispatch that failed: no rows counted and nothing written (docs/moe.md, "Errors").
pub fn assert_nothing_landed(o: &Obj, what: &str) {
    let got = read_recv(o);
    assert!(
        got.counts.iter().all(|&c| c == 0),
        "rank {} {what}: recv_counts {:?}",
        o.rank,
        got.counts
    );
    assert!(
        got.x.iter().all(|&b| b == POISON),
        "rank {} {what}: recv_x written",
        o.rank
    );
    assert!(
        got.src.iter().all(|&v| v == -1),
        "rank {} {what}: recv_src written",
        o.rank
    );
}

/// A dispatch's arguments (pointers into staged buffers, changeable by error tests).
#[derive(Clone, Copy, Debug)]
pub struct Args {
    pub x: *const c_void,
    pub sc: *const f32,
    pub idx: *const c_void,
    pub it: u32,
    pub w: *const f32,
    pub n: usize,
    pub k: u32,
}

/// Inputs copied where the backend reads them, and the arguments naming them (NULL when the
/// rank has no token, which is allowed).
pub struct Staged {
    _bufs: Vec<Buf>,
    pub a: Args,
}

pub fn stage(o: &Obj, inp: &Inputs, k: u32, idx64: bool) -> Staged {
    let d = o.dev;
    let bufs = vec![
        Buf::with(d, &inp.x),
        Buf::with(d, &f32_bytes(&inp.scales)),
        Buf::with(d, &inp.idx_bytes(idx64)),
        Buf::with(d, &f32_bytes(&inp.w)),
    ];
    let p = |i: usize| {
        if inp.n == 0 {
            null_mut()
        } else {
            bufs[i].ptr()
        }
    };
    let a = Args {
        x: p(0),
        sc: if o.s.fp8 { p(1) as _ } else { null_mut() },
        idx: p(2),
        it: if idx64 {
            SYMM_INDEX_INT64
        } else {
            SYMM_INDEX_INT32
        },
        w: p(3) as _,
        n: inp.n,
        k,
    };
    Staged { _bufs: bufs, a }
}

pub fn dispatch(o: &Obj, a: &Args) -> symm_status_t {
    symm_moe_dispatch(o.moe, a.x, a.sc, a.idx, a.it, a.w, a.n, a.k, o.dev.s())
}

/// What this rank learns of a call that returned `st`: its own error, or on CUDA (where the
/// kernels record what they find) what `symm_moe_check` reports once the stream ran. An error
/// is reported once; a rank that refused at the call may see its refusal again from the
/// kernel, naming itself.
pub fn outcome(o: &Obj, st: symm_status_t) -> (symm_status_t, String) {
    let own = (st, if st == OK { String::new() } else { err() });
    if !o.dev.gpu {
        if st == INVALID {
            assert_eq!(
                symm_moe_check(o.moe),
                OK,
                "the host backend records nothing: {}",
                err()
            );
        }
        return own;
    }
    o.dev.sync();
    let later = symm_moe_check(o.moe);
    let msg = if later == OK { String::new() } else { err() };
    if later == INVALID {
        assert_eq!(symm_moe_check(o.moe), OK, "reported once: {}", err());
    }
    if st != OK {
        let me = format!("rank {}", o.rank);
        assert!(
            later == OK || msg.contains(&me),
            "rank {} refused, then: {msg}",
            o.rank
        );
        return own;
    }
    (later, msg)
}

/// Asserts what this rank learns of a call: `want`, with every needle in the message.
pub fn expect(o: &Obj, st: symm_status_t, want: symm_status_t, needles: &[String], what: &str) {
    let (got, msg) = outcome(o, st);
    assert_eq!(got, want, "rank {} {what}: {msg}", o.rank);
    for n in needles {
        assert!(
            msg.contains(n.as_str()),
            "rank {} {what}: {msg:?} lacks {n:?}",
            o.rank
        );
    }
}

pub fn expect_ok(o: &Obj, st: symm_status_t, what: &str) {
    expect(o, st, OK, &[], what);
}

/// A dispatch that went through: every rank's inputs, this rank's staged ones, what landed.
pub struct Dispatched {
    pub all: Vec<Inputs>,
    pub staged: Staged,
    pub recv: Recv,
}

fn sleep_ms(ms: u64) {
    if ms > 0 {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Checks a rank's receive buffers against every rank's inputs: per local expert the rows of
/// (source rank, token) in that order, their codes, their bytes and scales.
pub fn check_recv(o: &Obj, c: &Case, all: &[Inputs], recv: &Recv, what: &str) {
    let (s, me) = (o.s, o.rank);
    let (row, sc, k) = (s.row(), s.sc(), c.k as usize);
    for le in 0..o.l {
        let e = (me * o.l + le) as i64;
        let mut rows = Vec::new();
        for (src, inp) in all.iter().enumerate() {
            for t in 0..inp.n {
                rows.extend(
                    (0..k)
                        .filter(|&j| inp.idx[t * k + j] == e)
                        .map(|j| (src, t, j)),
                );
            }
        }
        assert!(rows.len() <= o.r, "{what}: the case overflows expert {e}");
        assert_eq!(
            recv.counts[le] as usize,
            rows.len(),
            "{what}: recv_counts[{le}]"
        );
        for (i, &(src, t, j)) in rows.iter().enumerate() {
            let slot = le * o.r + i;
            let code = ((src * s.t + t) * s.topk as usize + j) as i32;
            let at = format!("{what}: expert {e} row {i} (rank {src} token {t} slot {j})");
            assert_eq!(recv.src[slot], code, "{at}: recv_src");
            let got = &recv.x[slot * row..(slot + 1) * row];
            assert!(got == &all[src].x[t * row..(t + 1) * row], "{at}: recv_x");
            let want = f32_bytes(&all[src].scales[t * sc..(t + 1) * sc]);
            assert!(
                recv.scales[slot * sc * 4..(slot + 1) * sc * 4] == want[..],
                "{at}: scales"
            );
        }
    }
}

/// Dispatches a case (after `delay_ms`) and checks what landed (`check_recv`).
pub fn dispatch_checked(o: &Obj, c: &Case, delay_ms: u64) -> Dispatched {
    let (s, w, me) = (o.s, o.w, o.rank);
    let what = format!("rank {me}/{w} {s:?} {c:?}");
    let all: Vec<Inputs> = (0..w).map(|r| rank_inputs(&s, c, w, r)).collect();
    let staged = stage(o, &all[me], c.k, c.idx64);
    poison_recv(o);
    sleep_ms(delay_ms);
    expect_ok(o, dispatch(o, &staged.a), &format!("dispatch {what}"));
    let recv = read_recv(o);
    check_recv(o, c, &all, &recv, &what);
    Dispatched { all, staged, recv }
}

/// What the expert gives for every row that landed (bf16 `[L][R][H]`); rows past the counts
/// stay poisoned (a combine that read them would produce NaNs).
pub fn expert_out(o: &Obj, kind: Expert, recv: &Recv) -> Vec<u8> {
    let (s, row, sc) = (o.s, o.s.row(), o.s.sc());
    let mut out = vec![POISON; o.l * o.r * s.h * 2];
    for le in 0..o.l {
        let e = o.rank * o.l + le;
        for i in 0..recv.counts[le] as usize {
            let slot = le * o.r + i;
            let scales: Vec<f32> = recv.scales[slot * sc * 4..(slot + 1) * sc * 4]
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let y = expert_row(kind, &s, e, &recv.x[slot * row..(slot + 1) * row], &scales);
            let dst = &mut out[slot * s.h * 2..(slot + 1) * s.h * 2];
            for (d, v) in dst.chunks_mut(2).zip(y) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    out
}

/// Checks `y` (bf16 bytes of this rank's tokens) against the contract: per element, the fp32
/// `fmaf` sum over k in increasing order rounded to bf16 once, bit for bit, and within bf16
/// rounding of the float64 sum; a token with no expert gives +0.
pub fn check_y(o: &Obj, c: &Case, kind: Expert, inp: &Inputs, y: &[u8], what: &str) {
    let (s, k, row, sc) = (o.s, inp.k, o.s.row(), o.s.sc());
    for t in 0..inp.n {
        let mut acc = vec![0f32; s.h];
        let mut exact = vec![0f64; s.h];
        let mut mag = vec![0f64; s.h];
        for j in 0..k {
            let e = inp.idx[t * k + j];
            if e < 0 {
                continue;
            }
            let wt = inp.w[t * k + j];
            let x = &inp.x[t * row..(t + 1) * row];
            let out = expert_row(kind, &s, e as usize, x, &inp.scales[t * sc..(t + 1) * sc]);
            for (i, v) in out.iter().enumerate() {
                let v = bf16_to_f32(*v);
                acc[i] = wt.mul_add(v, acc[i]);
                exact[i] += wt as f64 * v as f64;
                mag[i] += (wt as f64 * v as f64).abs();
            }
        }
        for i in 0..s.h {
            let got = u16::from_le_bytes([y[(t * s.h + i) * 2], y[(t * s.h + i) * 2 + 1]]);
            let at = format!("rank {} {what} {c:?}: y[{t}][{i}]", o.rank);
            assert_eq!(
                got,
                bf16(acc[i]),
                "{at}: {} vs fmaf order {}",
                bf16_to_f32(got),
                acc[i]
            );
            let err = (bf16_to_f32(got) as f64 - exact[i]).abs();
            assert!(
                err <= mag[i] / 256.0,
                "{at}: {} vs float64 {}",
                bf16_to_f32(got),
                exact[i]
            );
        }
    }
}

/// What one case left: this rank's y and a hash of its receive buffers' filled rows.
#[derive(Debug, PartialEq, Eq)]
pub struct Out {
    pub y: Vec<u8>,
    pub recv: u64,
}

/// One checked dispatch + expert + combine (module header). `delay_ms`: sleeps before the
/// dispatch and before the combine (another arrival order).
pub fn run_case(o: &Obj, c: &Case, kind: Expert, delay_ms: [u64; 2]) -> Out {
    let d = dispatch_checked(o, c, delay_ms[0]);
    let me = &d.all[o.rank];
    let eo = Buf::with(o.dev, &expert_out(o, kind, &d.recv));
    let y = Buf::new(o.dev, me.n * o.s.h * 2);
    o.dev.fill(y.p, y.bytes, POISON);
    sleep_ms(delay_ms[1]);
    let yp = if me.n == 0 { null_mut() } else { y.ptr() };
    let st = symm_moe_combine(o.moe, eo.ptr(), yp, o.dev.s());
    expect_ok(o, st, &format!("combine {c:?}"));
    let yb = y.get();
    check_y(o, c, kind, me, &yb, "combine");
    let mut h = Vec::new();
    for le in 0..o.l {
        let n = d.recv.counts[le] as usize;
        let (a, b) = (le * o.r, le * o.r + n);
        h.extend_from_slice(&d.recv.counts[le].to_le_bytes());
        h.extend(d.recv.src[a..b].iter().flat_map(|v| v.to_le_bytes()));
        h.extend_from_slice(&d.recv.x[a * o.s.row()..b * o.s.row()]);
        h.extend_from_slice(&d.recv.scales[a * o.s.sc() * 4..b * o.s.sc() * 4]);
    }
    Out {
        y: yb,
        recv: fnv(&h),
    }
}
