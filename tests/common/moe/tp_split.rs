//! The throughput mode's split halves (docs/moe.md, "Split halves" and "Throughput mode"):
//! `symm_moe_dispatch_send` / `_recv` and `symm_moe_combine_send` / `_recv` on a throughput
//! object give what the one-call forms give, checked the same way (the receive buffers exactly
//! against every rank's inputs, y bit for bit against the contract's sum and within bf16
//! rounding of float64), with other work between the halves (a barrier on the communicator,
//! rank-dependent host work), mixed with the one-call forms, over bf16, the caller's FP8, bf16
//! quantized in the dispatch (column-major scales) and a grid of one block; two objects' calls
//! interleaved (two-batch overlap); repeated split combines of one dispatch; a call between the
//! halves refused on its rank; a send half one rank refuses named by every peer's receive half,
//! the object usable after. Run by tests/moe_tp_host.rs and tests/gpu_moe.rs.

use super::quant::{grid, QS};
use super::tp::*;
use super::tp_quant::{tp_q_case_with, tp_qcreate};
use super::{experts, rank_inputs, Buf, Case, Dev, Inputs, Route, Shape, INVALID};
use crate::common::{err, Comm, OK};
use std::ffi::c_void;
use std::ptr::null_mut;
use symmalloc::ffi::moe_calls::*;
use symmalloc::ffi::types::*;

/// What goes between two halves.
#[derive(Clone, Copy, Debug)]
pub enum Between {
    Nothing,
    /// A barrier on the communicator (another collective).
    Barrier,
    /// Rank-dependent host work (the ranks reach the receive half at different times).
    Sleep,
}

fn between(comm: Comm, o: &Tp, b: Between) {
    match b {
        Between::Nothing => {}
        Between::Barrier => {
            let st = symmalloc::ffi::symm_barrier(comm, o.dev.s());
            assert_eq!(st, OK, "rank {}: barrier between halves: {}", o.rank, err());
        }
        Between::Sleep => {
            std::thread::sleep(std::time::Duration::from_millis((o.rank as u64 * 3) % 7))
        }
    }
}

/// A dispatch through the halves, `b` between them; the receive half's status, or the send
/// half's when it failed (a failed send completes the call).
fn split_dispatch(
    comm: Comm,
    b: Between,
) -> impl Fn(&Tp, [*mut c_void; 4], u32, usize, u32) -> symm_status_t {
    move |o, p, it, n, k| {
        let st =
            symm_moe_dispatch_send(o.moe, p[0], p[1] as _, p[2], it, p[3] as _, n, k, o.dev.s());
        if st != OK {
            return st;
        }
        between(comm, o, b);
        symm_moe_dispatch_recv(o.moe, o.dev.s())
    }
}

/// A combine through the halves, `b` between them.
fn split_combine(
    comm: Comm,
    b: Between,
) -> impl Fn(&Tp, *mut c_void, *mut c_void) -> symm_status_t {
    move |o, eo, y| {
        let st = symm_moe_combine_send(o.moe, eo, y, o.dev.s());
        if st != OK {
            return st;
        }
        between(comm, o, b);
        symm_moe_combine_recv(o.moe, o.dev.s())
    }
}

/// One case: dispatch and combine through `d` and `cmb`, each checked; returns y's bits.
fn case_with(o: &Tp, c: &Case, what: &str, d: DispatchCall, cmb: CombineCall) -> Vec<u16> {
    let all: Vec<Inputs> = (0..o.w).map(|r| rank_inputs(&o.s, c, o.w, r)).collect();
    let mut bufs = Vec::new();
    let st = tp_dispatch_with(o, &all[o.rank], c.k, c.idx64, &mut bufs, d);
    o.dev.sync();
    assert_eq!(st, OK, "rank {} {what}: dispatch: {}", o.rank, err());
    let want = check_tp_recv(o, &all, what);
    tp_combine_checked_with(o, &all, &want, 0, what, cmb)
}

/// Over bf16, the caller's FP8 and a grid of one block, several routings, index types and
/// ragged counts: the halves (something between them), then both mixes with the one-call
/// forms, each checked, every y the same bits. Then bf16 quantized in the dispatch with
/// column-major scales through the halves. Returns the cases run.
pub fn tp_split_matches_one_call(comm: Comm, dev: Dev, w: usize, seed: u64) -> usize {
    let mut capped = Shape::new(8, 128, 4, (4 * w) as u32, false);
    capped.num_sms = 1;
    let shapes = [
        Shape::new(16, 128, 4, (4 * w) as u32, false),
        Shape::new(8, 256, 2, experts(w, 8), true),
        capped,
    ];
    let routes = [Route::Random, Route::Holes, Route::Sparse, Route::Hot(1)];
    let betweens = [Between::Barrier, Between::Sleep, Between::Nothing];
    let mut cases = 0;
    for (si, &s) in shapes.iter().enumerate() {
        let o = tp_create(comm, s, dev);
        for (ri, &route) in routes.iter().enumerate() {
            let i = si * routes.len() + ri;
            let mut c = Case::new(seed ^ ((i as u64) << 20) ^ 0x7a1, s.t, s.topk, route);
            c.idx64 = i % 2 == 1;
            c.ragged = i % 3 == 2;
            let b = betweens[i % betweens.len()];
            let what = format!("{s:?} {c:?} ({b:?} between)");
            let y1 = case_with(&o, &c, &format!("{what} one call"), &one_call, &one_combine);
            let (sd, sc) = (split_dispatch(comm, b), split_combine(comm, b));
            let y2 = case_with(&o, &c, &format!("{what} split"), &sd, &sc);
            let y3 = case_with(&o, &c, &format!("{what} split dispatch"), &sd, &one_combine);
            let y4 = case_with(&o, &c, &format!("{what} split combine"), &one_call, &sc);
            assert!(
                y2 == y1 && y3 == y1 && y4 == y1,
                "rank {} {what}: a y of the halves differs from the one-call y",
                o.rank
            );
            cases += 1;
        }
    }
    // bf16 x quantized in the dispatch, column-major UE8M0 scales, through the halves.
    let q = QS[3];
    let o = tp_qcreate(comm, dev, Shape::new(7, 384, 4, experts(w, 16), true), q);
    let g = grid();
    for (i, b) in betweens.into_iter().enumerate() {
        let c = Case::new(seed ^ 0x9e1 ^ i as u64, 7, 4, Route::Random);
        let (r, _) = tp_q_case_with(&o, q, &c, &g, &split_dispatch(comm, b));
        assert!(r > 0 || w > 1, "no rows arrived");
        cases += 1;
    }
    cases
}

/// Two objects' calls interleaved, as two micro-batches overlap: send A, send B, receive A,
/// receive B, then the combines the same way, `rounds` times; every result checked.
pub fn tp_two_batch_overlap(comm: Comm, dev: Dev, w: usize, seed: u64, rounds: u64) -> u64 {
    let s = Shape::new(8, 128, 4, (4 * w) as u32, false);
    let (a, b) = (tp_create(comm, s, dev), tp_create(comm, s, dev));
    let mut made = 0;
    for i in 0..rounds {
        let objs = [&a, &b];
        let cases: Vec<Case> = (0..2u64)
            .map(|j| {
                Case::new(
                    seed ^ (i << 16) ^ (j << 8),
                    s.t - (i as usize % 3),
                    4,
                    Route::Random,
                )
            })
            .collect();
        let all: Vec<Vec<Inputs>> = cases
            .iter()
            .map(|c| (0..w).map(|r| rank_inputs(&s, c, w, r)).collect())
            .collect();
        let mut bufs = Vec::new();
        let sent: Vec<_> = (0..2)
            .map(|j| {
                let o = objs[j];
                let send = |o: &Tp, p: [*mut c_void; 4], it: u32, n: usize, k: u32| {
                    symm_moe_dispatch_send(
                        o.moe,
                        p[0],
                        p[1] as _,
                        p[2],
                        it,
                        p[3] as _,
                        n,
                        k,
                        o.dev.s(),
                    )
                };
                tp_dispatch_with(o, &all[j][o.rank], 4, false, &mut bufs, &send)
            })
            .collect();
        for (j, st) in sent.into_iter().enumerate() {
            assert_eq!(
                st,
                OK,
                "rank {} round {i}: dispatch_send {j}: {}",
                a.rank,
                err()
            );
        }
        for (j, o) in objs.iter().enumerate() {
            let st = symm_moe_dispatch_recv(o.moe, o.dev.s());
            o.dev.sync();
            assert_eq!(
                st,
                OK,
                "rank {} round {i}: dispatch_recv {j}: {}",
                o.rank,
                err()
            );
        }
        let wants: Vec<Want> = (0..2)
            .map(|j| check_tp_recv(objs[j], &all[j], &format!("round {i} batch {j}")))
            .collect();
        // The combines: both sends, then both receives.
        let ys: Vec<(Buf, Buf, usize)> = (0..2)
            .map(|j| {
                let o = objs[j];
                let n = all[j][o.rank].n;
                let eo = tp_expert_out(o, &all[j], &wants[j], j);
                let y = Buf::new(o.dev, (n * s.h * 2).max(16));
                let st = symm_moe_combine_send(o.moe, eo.ptr(), y.ptr(), o.dev.s());
                assert_eq!(
                    st,
                    OK,
                    "rank {} round {i}: combine_send {j}: {}",
                    o.rank,
                    err()
                );
                (eo, y, n)
            })
            .collect();
        for (j, (_, y, n)) in ys.iter().enumerate() {
            let o = objs[j];
            let st = symm_moe_combine_recv(o.moe, o.dev.s());
            o.dev.sync();
            assert_eq!(
                st,
                OK,
                "rank {} round {i}: combine_recv {j}: {}",
                o.rank,
                err()
            );
            let got: Vec<u16> = o
                .dev
                .get(y.p, n * s.h * 2)
                .chunks(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect();
            assert!(
                got == want_y(o, &all[j], j),
                "rank {} round {i}: batch {j}'s y differs from the contract's",
                o.rank
            );
            made += 1;
        }
    }
    made
}

fn expect(o: &Tp, st: symm_status_t, needle: &str, what: &str) {
    let e = err();
    assert_eq!(st, INVALID, "rank {} {what}: {e}", o.rank);
    assert!(
        e.contains(needle),
        "rank {} {what}: {e:?} lacks {needle:?}",
        o.rank
    );
}

/// Repeated split combines of one dispatch (each checked bit for bit, with a different expert);
/// a call between the halves refused on its rank, nothing submitted; a receive half with no
/// send refused; a send half the last rank refuses (expert_out NULL), which every peer's
/// receive half names, then a good split case. Every rank runs every call.
pub fn tp_split_misuse(comm: Comm, dev: Dev, w: usize, seed: u64) {
    let s = Shape::new(8, 128, 4, (4 * w) as u32, false);
    let o = tp_create(comm, s, dev);
    let c = Case::new(seed ^ 0x51, 8, 4, Route::Random);
    let all: Vec<Inputs> = (0..w).map(|r| rank_inputs(&s, &c, w, r)).collect();
    let mut bufs = Vec::new();
    let st = tp_dispatch_with(
        &o,
        &all[o.rank],
        4,
        false,
        &mut bufs,
        &split_dispatch(comm, Between::Nothing),
    );
    o.dev.sync();
    assert_eq!(st, OK, "rank {}: split dispatch: {}", o.rank, err());
    let want = check_tp_recv(&o, &all, "split misuse");
    let sc = split_combine(comm, Between::Nothing);
    let first = tp_combine_checked_with(&o, &all, &want, 0, "split combine 0", &sc);
    for shift in [1, 2, 0] {
        let y = tp_combine_checked_with(
            &o,
            &all,
            &want,
            shift,
            &format!("split combine {shift}"),
            &sc,
        );
        assert!(
            shift != 0 || y == first,
            "rank {}: the same split combine twice differs",
            o.rank
        );
    }
    // No send: the receive halves are refused.
    let st = symm_moe_dispatch_recv(o.moe, dev.s());
    expect(&o, st, "no dispatch was sent", "dispatch_recv alone");
    let st = symm_moe_combine_recv(o.moe, dev.s());
    expect(&o, st, "no combine was sent", "combine_recv alone");
    // A call between the halves: refused, nothing submitted; then the receive half.
    let eo = tp_expert_out(&o, &all, &want, 0);
    let y = Buf::new(dev, (all[o.rank].n * s.h * 2).max(16));
    assert_eq!(
        symm_moe_combine_send(o.moe, eo.ptr(), y.ptr(), dev.s()),
        OK,
        "{}",
        err()
    );
    let st = symm_moe_combine(o.moe, eo.ptr(), y.ptr(), dev.s());
    expect(
        &o,
        st,
        "symm_moe_combine_send was called and its receive half was not",
        "combine between",
    );
    assert_eq!(symm_moe_combine_recv(o.moe, dev.s()), OK, "{}", err());
    // The last rank refuses its send half (expert_out NULL): it names its argument, its peers'
    // receive halves name it.
    let last = w - 1;
    let p = if o.rank == last { null_mut() } else { eo.ptr() };
    let mut st = symm_moe_combine_send(o.moe, p, y.ptr(), dev.s());
    if st == OK {
        st = symm_moe_combine_recv(o.moe, dev.s());
        if st == OK && dev.gpu {
            dev.sync();
            st = symm_moe_check(o.moe);
        }
    }
    let needle = if o.rank == last {
        "expert_out is NULL".to_string()
    } else {
        format!("rank {last} refused the combine")
    };
    expect(&o, st, &needle, "a refused combine_send");
    // Usable after: the refused combine retried through the halves, then a new split case.
    tp_combine_checked_with(&o, &all, &want, 1, "the retried split combine", &sc);
    case_with(
        &o,
        &Case::new(seed ^ 0x52, 8, 4, Route::Holes),
        "after the refusal",
        &split_dispatch(comm, Between::Sleep),
        &split_combine(comm, Between::Barrier),
    );
    // A one-call case last: a receive half is a call of its own, and a peer that already
    // finished could destroy its communicator before this rank's receive half begins.
    tp_case(
        &o,
        &Case::new(seed ^ 0x53, 8, 4, Route::Random),
        "last, one call",
    );
}
