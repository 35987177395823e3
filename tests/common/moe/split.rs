//! The split API (docs/moe.md, "Split halves"), the scenarios both backends run: the halves
//! give what the one-call forms give, bit for bit (receive buffers and y), with other work
//! between them (a barrier on the communicator, a second moe object's whole micro-batch
//! interleaved with the first: two-batch overlap), mixed with the one-call forms, and with
//! repeated combines; every out-of-order call refused on every rank naming what was expected,
//! the object usable after; a send one rank refuses (its peers' receive halves name it); the
//! clock probe's words in phase order.

use super::repeat::{check_all, prepare, KINDS};
use super::*;
use crate::common::{err, Comm, OK};
use std::ptr::null_mut;
use symmalloc::ffi::moe::*;
use symmalloc::ffi::moe_calls::*;
use symmalloc::ffi::types::*;

pub fn dispatch_send(o: &Obj, a: &Args) -> symm_status_t {
    symm_moe_dispatch_send(o.moe, a.x, a.sc, a.idx, a.it, a.w, a.n, a.k, o.dev.s())
}

pub fn dispatch_recv(o: &Obj) -> symm_status_t {
    symm_moe_dispatch_recv(o.moe, o.dev.s())
}

fn y_ptr(y: &Buf, n: usize) -> *mut std::ffi::c_void {
    if n == 0 {
        null_mut()
    } else {
        y.ptr()
    }
}

/// The filled rows of a rank's receive buffers (counts, codes, rows, scales): what two
/// dispatches of one case must leave alike.
fn filled(o: &Obj, r: &Recv) -> Vec<u8> {
    let mut h = Vec::new();
    for le in 0..o.l {
        let n = r.counts[le] as usize;
        let (a, b) = (le * o.r, le * o.r + n);
        h.extend_from_slice(&r.counts[le].to_le_bytes());
        h.extend(r.src[a..b].iter().flat_map(|v| v.to_le_bytes()));
        h.extend_from_slice(&r.x[a * o.s.row()..b * o.s.row()]);
        h.extend_from_slice(&r.scales[a * o.s.sc() * 4..b * o.s.sc() * 4]);
    }
    h
}

/// What goes between the halves of a dispatch.
#[derive(Clone, Copy, Debug)]
enum Between {
    Nothing,
    /// A barrier on the communicator (another collective).
    Barrier,
    /// Rank-dependent host work (the ranks reach the receive half at different times).
    Sleep,
}

fn between(comm: Comm, o: &Obj, b: Between) {
    match b {
        Between::Nothing => {}
        Between::Barrier => {
            let st = symmalloc::ffi::symm_barrier(comm, o.dev.s());
            assert_eq!(
                st,
                OK,
                "rank {}: barrier between the halves: {}",
                o.rank,
                err()
            );
        }
        Between::Sleep => {
            std::thread::sleep(std::time::Duration::from_millis((o.rank as u64 * 3) % 7))
        }
    }
}

/// A split dispatch of `c` (checked against the reference like a one-call one); `b` between the
/// halves.
fn split_dispatch(comm: Comm, o: &Obj, c: &Case, b: Between) -> Dispatched {
    let (s, w, me) = (o.s, o.w, o.rank);
    let what = format!("rank {me}/{w} {s:?} {c:?} split ({b:?} between)");
    let all: Vec<Inputs> = (0..w).map(|r| rank_inputs(&s, c, w, r)).collect();
    let staged = stage(o, &all[me], c.k, c.idx64);
    poison_recv(o);
    expect_ok(
        o,
        dispatch_send(o, &staged.a),
        &format!("dispatch_send {what}"),
    );
    between(comm, o, b);
    expect_ok(o, dispatch_recv(o), &format!("dispatch_recv {what}"));
    let recv = read_recv(o);
    check_recv(o, c, &all, &recv, &what);
    Dispatched { all, staged, recv }
}

/// A split combine of `eo` into a fresh y; `b` between the halves. Returns y.
fn split_combine(comm: Comm, o: &Obj, n: usize, eo: &Buf, b: Between, what: &str) -> Vec<u8> {
    let y = Buf::new(o.dev, n * o.s.h * 2);
    o.dev.fill(y.p, y.bytes, POISON);
    let st = symm_moe_combine_send(o.moe, eo.ptr(), y_ptr(&y, n), o.dev.s());
    expect_ok(o, st, &format!("combine_send {what}"));
    between(comm, o, b);
    expect_ok(
        o,
        symm_moe_combine_recv(o.moe, o.dev.s()),
        &format!("combine_recv {what}"),
    );
    y.get()
}

fn one_call_combine(o: &Obj, n: usize, eo: &Buf, what: &str) -> Vec<u8> {
    let y = Buf::new(o.dev, n * o.s.h * 2);
    o.dev.fill(y.p, y.bytes, POISON);
    let st = symm_moe_combine(o.moe, eo.ptr(), y_ptr(&y, n), o.dev.s());
    expect_ok(o, st, &format!("combine {what}"));
    y.get()
}

/// Over shapes (bf16 and FP8, a grid cap), routings, index types and ragged token counts: the
/// one-call dispatch + combine, then the same case through the halves with something between
/// them, then the two mixes (split dispatch + one-call combine, one-call dispatch + split
/// combine): every receive buffer and y the same bit for bit (and y the contract's). Returns
/// the cases run.
pub fn split_matches_one_call(comm: Comm, dev: Dev, w: usize, seed: u64) -> usize {
    let mut capped = Shape::new(8, 256, 4, experts(w, 8), false);
    capped.num_sms = 1;
    let shapes = [
        Shape::new(16, 256, 4, experts(w, 8), false),
        Shape::new(8, 256, 2, experts(w, 6), true),
        capped,
    ];
    let routes = [Route::Random, Route::Holes, Route::Sparse, Route::Hot(0)];
    let betweens = [Between::Nothing, Between::Barrier, Between::Sleep];
    let mut cases = 0;
    for (si, &s) in shapes.iter().enumerate() {
        let o = create(comm, s, dev);
        for (ri, &route) in routes.iter().enumerate() {
            let i = si * routes.len() + ri;
            let mut c = Case::new(seed ^ ((i as u64) << 20) ^ 0x5b1, s.t, s.topk, route);
            c.idx64 = i % 2 == 1;
            c.ragged = i % 3 == 2;
            if i % 5 == 4 {
                c.k = s.topk - 1;
            }
            let b = betweens[i % betweens.len()];
            // The pair experts are for bf16 payloads.
            let kind = if s.fp8 {
                Expert::Scale
            } else {
                KINDS[i % KINDS.len()]
            };
            let what = format!("{s:?} {c:?}");
            // The one-call reference.
            let d1 = dispatch_checked(&o, &c, 0);
            let n = d1.all[o.rank].n;
            let eo = Buf::with(o.dev, &expert_out(&o, kind, &d1.recv));
            let y1 = one_call_combine(&o, n, &eo, &what);
            check_y(&o, &c, kind, &d1.all[o.rank], &y1, "one-call combine");
            // Split dispatch + split combine.
            let d2 = split_dispatch(comm, &o, &c, b);
            assert!(
                filled(&o, &d2.recv) == filled(&o, &d1.recv),
                "rank {} {what}: the split dispatch's receive buffers differ",
                o.rank
            );
            let y2 = split_combine(comm, &o, n, &eo, b, &what);
            assert!(
                y2 == y1,
                "rank {} {what}: split y differs from one-call y",
                o.rank
            );
            // Split dispatch + one-call combine.
            let d3 = split_dispatch(comm, &o, &c, Between::Nothing);
            assert!(
                filled(&o, &d3.recv) == filled(&o, &d1.recv),
                "{what}: mix 1"
            );
            assert!(one_call_combine(&o, n, &eo, &what) == y1, "{what}: mix 1 y");
            // One-call dispatch + split combine.
            let d4 = dispatch_checked(&o, &c, 0);
            assert!(
                filled(&o, &d4.recv) == filled(&o, &d1.recv),
                "{what}: mix 2"
            );
            let y4 = split_combine(comm, &o, n, &eo, Between::Nothing, &what);
            assert!(y4 == y1, "rank {} {what}: mix 2 y", o.rank);
            cases += 1;
        }
    }
    cases
}

/// `rounds` split dispatches, each followed by 2 to 4 split combines with different experts,
/// each checked bit for bit (combine_send, combine_recv, then the next pair at once).
pub fn split_repeated_combines(comm: Comm, dev: Dev, w: usize, seed: u64, rounds: u64) -> u64 {
    let o = create(comm, super::repeat::repeat_shape(w), dev);
    let mut made = 0;
    for i in 0..rounds {
        let route = [Route::Random, Route::Holes, Route::Hot(0), Route::Sparse][i as usize % 4];
        let mut c = Case::new(seed ^ (i << 24) ^ 0x3d1, o.s.t, 4, route);
        c.idx64 = i % 2 == 0;
        let d = split_dispatch(comm, &o, &c, Between::Nothing);
        let n = d.all[o.rank].n;
        let count = 2 + (i as usize % 3);
        let kinds: Vec<Expert> = (0..count).map(|j| KINDS[(i as usize + j) % 4]).collect();
        let ps = prepare(&o, &d, &kinds);
        for (j, p) in ps.iter().enumerate() {
            let st = symm_moe_combine_send(o.moe, p.eo.ptr(), y_ptr(&p.y, n), o.dev.s());
            expect_ok(&o, st, &format!("round {i} combine_send {j}"));
            let st = symm_moe_combine_recv(o.moe, o.dev.s());
            expect_ok(&o, st, &format!("round {i} combine_recv {j}"));
        }
        check_all(&o, &c, &d, &ps, &format!("round {i} (split)"));
        made += count as u64;
    }
    made
}

/// Two objects on one communicator, two micro-batches interleaved as two-batch overlap runs
/// them: A send, B send, A recv, B recv, A combine send, B combine send, A combine recv, B
/// combine recv; each result checked against the reference. Returns the rounds.
pub fn two_batch_overlap(comm: Comm, dev: Dev, w: usize, seed: u64, rounds: u64) -> u64 {
    let s = Shape::new(8, 256, 4, experts(w, 8), false);
    let objs = [create(comm, s, dev), create(comm, s, dev)];
    for i in 0..rounds {
        let cs: Vec<Case> = (0..2u64)
            .map(|b| Case::new(seed ^ (i << 24) ^ (b << 8) ^ 0x7b0, s.t, 4, Route::Random))
            .collect();
        let all: Vec<Vec<Inputs>> = (0..2)
            .map(|b| (0..w).map(|r| rank_inputs(&s, &cs[b], w, r)).collect())
            .collect();
        let staged: Vec<Staged> = (0..2)
            .map(|b| stage(&objs[b], &all[b][objs[b].rank], 4, false))
            .collect();
        for (b, o) in objs.iter().enumerate() {
            poison_recv(o);
            expect_ok(
                o,
                dispatch_send(o, &staged[b].a),
                &format!("round {i} send {b}"),
            );
        }
        let mut recvs = Vec::new();
        for (b, o) in objs.iter().enumerate() {
            expect_ok(o, dispatch_recv(o), &format!("round {i} recv {b}"));
            let r = read_recv(o);
            check_recv(o, &cs[b], &all[b], &r, &format!("round {i} batch {b}"));
            recvs.push(r);
        }
        let kinds = [KINDS[i as usize % 4], KINDS[(i as usize + 1) % 4]];
        let eos: Vec<Buf> = (0..2)
            .map(|b| Buf::with(dev, &expert_out(&objs[b], kinds[b], &recvs[b])))
            .collect();
        let n = all[0][objs[0].rank].n;
        let ys: Vec<Buf> = (0..2).map(|_| Buf::new(dev, n * s.h * 2)).collect();
        for (b, o) in objs.iter().enumerate() {
            o.dev.fill(ys[b].p, ys[b].bytes, POISON);
            let st = symm_moe_combine_send(o.moe, eos[b].ptr(), y_ptr(&ys[b], n), o.dev.s());
            expect_ok(o, st, &format!("round {i} combine_send {b}"));
        }
        for (b, o) in objs.iter().enumerate() {
            let st = symm_moe_combine_recv(o.moe, o.dev.s());
            expect_ok(o, st, &format!("round {i} combine_recv {b}"));
            let me = &all[b][o.rank];
            check_y(
                o,
                &cs[b],
                kinds[b],
                me,
                &ys[b].get(),
                &format!("round {i} batch {b}"),
            );
        }
    }
    rounds
}

/// A call out of order: refused at the call on this rank (INVALID_ARGUMENT with `needle`),
/// nothing submitted.
fn refused(o: &Obj, st: symm_status_t, needle: &str, what: &str) {
    let msg = err();
    assert_eq!(st, INVALID, "rank {} {what}: {msg}", o.rank);
    assert!(
        msg.contains(needle),
        "rank {} {what}: {msg:?} lacks {needle:?}",
        o.rank
    );
}

/// Every out-of-order call, on every rank alike, refused naming what was expected; the pending
/// half then completes correctly. Then a send one rank refuses (its bad k): it returns its own
/// error with nothing pending, the others' receive halves name it; then a combine send one rank
/// refuses (NULL expert_out). After each, a split dispatch + combine is correct.
pub fn split_misuse(comm: Comm, dev: Dev, w: usize, seed: u64) {
    // A NULL object, and the probe's NULL output: refused naming them.
    let (nul, p, sm) = (null_mut(), null_mut(), dev.s());
    let null = |st: symm_status_t, what: &str| {
        assert!(
            st == INVALID && err().contains("moe is NULL"),
            "{what}: {}",
            err()
        );
    };
    null(
        symm_moe_dispatch_send(nul, p, null_mut(), p, 0, null_mut(), 0, 1, sm),
        "send",
    );
    null(symm_moe_dispatch_recv(nul, sm), "recv");
    null(
        symm_moe_combine_send(nul, p, null_mut(), sm),
        "combine_send",
    );
    null(symm_moe_combine_recv(nul, sm), "combine_recv");
    let mut out = [0u64; SYMM_MOE_PROBE_WORDS as usize];
    null(symm_moe_probe(nul, out.as_mut_ptr(), out.len()), "probe");
    let s = Shape::new(8, 256, 4, experts(w, 8), false);
    let o = create(comm, s, dev);
    let st = symm_moe_probe(o.moe, null_mut(), out.len());
    assert!(
        st == INVALID && err().contains("symm_moe_probe: out is NULL"),
        "{}",
        err()
    );
    let me = o.rank;
    let c = Case::new(seed ^ 0x6e5, s.t, 4, Route::Random);
    let kind = Expert::Scale;
    let no_d =
        "symm_moe_dispatch_recv: no dispatch was sent; expected symm_moe_dispatch_send first";
    let no_c = "symm_moe_combine_recv: no combine was sent; expected symm_moe_combine_send first";
    refused(&o, dispatch_recv(&o), no_d, "recv before any send");
    refused(
        &o,
        symm_moe_combine_recv(o.moe, sm),
        no_c,
        "combine_recv first",
    );
    let y0 = Buf::new(dev, s.t * s.h * 2);
    let eo0 = Buf::new(dev, o.l * o.r * s.h * 2);
    refused(
        &o,
        symm_moe_combine_send(o.moe, eo0.ptr(), y0.ptr(), sm),
        "symm_moe_combine_send: no dispatch on this object yet",
        "combine_send before any dispatch",
    );
    // A dispatch sent: every other call but its receive half is refused.
    let all: Vec<Inputs> = (0..w).map(|r| rank_inputs(&s, &c, w, r)).collect();
    let st = stage(&o, &all[me], c.k, c.idx64);
    poison_recv(&o);
    expect_ok(&o, dispatch_send(&o, &st.a), "dispatch_send");
    let want = "symm_moe_dispatch_send was called and its receive half was not; expected \
                symm_moe_dispatch_recv first";
    let a = st.a;
    refused(&o, dispatch_send(&o, &a), want, "a second dispatch_send");
    refused(
        &o,
        dispatch(&o, &a),
        want,
        "dispatch while a send is pending",
    );
    let eo = symm_moe_combine_send(o.moe, eo0.ptr(), y0.ptr(), sm);
    refused(&o, eo, want, "combine_send before dispatch_recv");
    refused(
        &o,
        symm_moe_combine(o.moe, eo0.ptr(), y0.ptr(), sm),
        want,
        "combine",
    );
    refused(&o, symm_moe_combine_recv(o.moe, sm), want, "combine_recv");
    expect_ok(&o, dispatch_recv(&o), "the pending dispatch_recv");
    let recv = read_recv(&o);
    check_recv(&o, &c, &all, &recv, "after the refusals");
    refused(&o, dispatch_recv(&o), no_d, "a second dispatch_recv");
    // A combine sent: likewise.
    let n = all[me].n;
    let eo = Buf::with(dev, &expert_out(&o, kind, &recv));
    let y = Buf::new(dev, n * s.h * 2);
    dev.fill(y.p, y.bytes, POISON);
    let st2 = symm_moe_combine_send(o.moe, eo.ptr(), y_ptr(&y, n), sm);
    expect_ok(&o, st2, "combine_send");
    let want = "symm_moe_combine_send was called and its receive half was not; expected \
                symm_moe_combine_recv first";
    refused(
        &o,
        symm_moe_combine_send(o.moe, eo.ptr(), y.ptr(), sm),
        want,
        "combine_send x2",
    );
    refused(
        &o,
        symm_moe_combine(o.moe, eo.ptr(), y.ptr(), sm),
        want,
        "combine",
    );
    refused(&o, dispatch_send(&o, &a), want, "dispatch_send");
    refused(&o, dispatch(&o, &a), want, "dispatch");
    refused(&o, dispatch_recv(&o), want, "dispatch_recv");
    expect_ok(
        &o,
        symm_moe_combine_recv(o.moe, sm),
        "the pending combine_recv",
    );
    check_y(&o, &c, kind, &all[me], &y.get(), "after the refusals");
    refused(
        &o,
        symm_moe_combine_recv(o.moe, sm),
        no_c,
        "a second combine_recv",
    );
    drop(st);

    // A send one rank refuses (k = 0): nothing pending there, the peers' receive names it.
    let bad = 1 % w;
    let c2 = Case::new(seed ^ 0x6e6, s.t, 4, Route::Random);
    let all: Vec<Inputs> = (0..w).map(|r| rank_inputs(&s, &c2, w, r)).collect();
    let st = stage(&o, &all[me], 4, false);
    let mut a = st.a;
    poison_recv(&o);
    if me == bad {
        a.k = 0;
        expect(
            &o,
            dispatch_send(&o, &a),
            INVALID,
            &["k = 0".into()],
            "refused send",
        );
        refused(&o, dispatch_recv(&o), no_d, "recv after a refused send");
    } else {
        expect_ok(&o, dispatch_send(&o, &a), "send beside a refused one");
        let needle = format!("rank {bad} passed k = 0");
        expect(
            &o,
            dispatch_recv(&o),
            INVALID,
            &[needle],
            "recv of a refused dispatch",
        );
        refused(
            &o,
            dispatch_recv(&o),
            no_d,
            "a second recv of a refused dispatch",
        );
    }
    assert_nothing_landed(&o, "a refused split dispatch");
    drop(st);
    let d = split_dispatch(comm, &o, &c2, Between::Nothing);
    // A combine send one rank refuses (NULL expert_out); then the retry.
    let n = d.all[me].n;
    let eo = Buf::with(dev, &expert_out(&o, kind, &d.recv));
    let y = Buf::new(dev, n * s.h * 2);
    dev.fill(y.p, y.bytes, POISON);
    if me == bad {
        let st = symm_moe_combine_send(o.moe, null_mut(), y_ptr(&y, n), sm);
        expect(
            &o,
            st,
            INVALID,
            &["expert_out is NULL".into()],
            "refused combine_send",
        );
        refused(
            &o,
            symm_moe_combine_recv(o.moe, sm),
            no_c,
            "recv after a refused send",
        );
    } else {
        let st = symm_moe_combine_send(o.moe, eo.ptr(), y_ptr(&y, n), sm);
        expect_ok(&o, st, "combine_send beside a refused one");
        let needle = format!("rank {bad} refused the combine");
        let st = symm_moe_combine_recv(o.moe, sm);
        expect(
            &o,
            st,
            INVALID,
            &[needle],
            "combine_recv of a refused combine",
        );
        assert!(
            y.get().iter().all(|&b| b == 0),
            "rank {me}: y after a refused combine"
        );
    }
    let y2 = split_combine(comm, &o, n, &eo, Between::Nothing, "the retry");
    check_y(&o, &c2, kind, &d.all[me], &y2, "the retried split combine");
}

/// The clock probe: refused on an object without it (and with a bad word count); on one with
/// it, after a split and a one-call dispatch + combine, the words in phase order, epochs
/// counted.
pub fn probe_words(comm: Comm, dev: Dev, w: usize, seed: u64) {
    let s = Shape::new(8, 256, 4, experts(w, 8), false);
    let plain = create(comm, s, dev);
    let mut out = [0u64; SYMM_MOE_PROBE_WORDS as usize];
    let st = symm_moe_probe(plain.moe, out.as_mut_ptr(), out.len());
    refused(
        &plain,
        st,
        "the clock probe is off",
        "probe of a plain object",
    );
    drop(plain);
    let mut cfg = s.config();
    cfg.flags = SYMM_MOE_FLAG_PROBE;
    let mut moe = null_mut();
    let st = symm_moe_create_config(comm, &cfg, &mut moe);
    assert_eq!(st, OK, "create with the probe: {}", err());
    let (st, lay) = layout_of(moe, SYMM_MOE_LAYOUT_VERSION, layout_size());
    assert_eq!(st, OK, "{}", err());
    let l = s.e as usize / w;
    let o = Obj {
        moe,
        s,
        w,
        rank: lay.rank as usize,
        l,
        r: w * s.t,
        lay,
        dev,
    };
    let st = symm_moe_probe(o.moe, out.as_mut_ptr(), 3);
    refused(&o, st, "words 3; expected 16", "probe with 3 words");
    for (i, split) in [(0u64, true), (1, false)] {
        let c = Case::new(seed ^ 0x9b0 ^ i, s.t, 4, Route::Random);
        let d = if split {
            split_dispatch(comm, &o, &c, Between::Sleep)
        } else {
            dispatch_checked(&o, &c, 0)
        };
        let n = d.all[o.rank].n;
        let eo = Buf::with(dev, &expert_out(&o, Expert::Scale, &d.recv));
        let y = if split {
            split_combine(comm, &o, n, &eo, Between::Sleep, "probe")
        } else {
            one_call_combine(&o, n, &eo, "probe")
        };
        check_y(&o, &c, Expert::Scale, &d.all[o.rank], &y, "probe");
        let out = probe_read(
            o.moe,
            o.dev,
            &format!("rank {} call {i} (split {split})", o.rank),
        );
        let what = format!("rank {} call {i} (split {split}): {out:?}", o.rank);
        // Block 0 records start, routed, receive start and wait done, the grid's last block
        // staged, published (or pushed) and the end. In the one-call form block 0 may start
        // (and, a few ns apart, end) its wait before the last block recorded publishing: the
        // receive start follows it only across two launches.
        let chain = |ws: &[usize]| probe_in_order(&out, ws);
        assert!(
            chain(&[0, 1, 2, 3]) && chain(&[1, 4, 5, 6]) && chain(&[2, 5]),
            "dispatch: {what}"
        );
        assert!(
            chain(&[8, 9, 12]) && chain(&[8, 10, 11, 12]),
            "combine: {what}"
        );
        if split {
            assert!(chain(&[3, 4, 5]) && chain(&[9, 10]), "halves: {what}");
        }
        assert!(out[6] <= out[8], "the combine after the dispatch: {what}");
        assert_eq!(
            (out[7], out[13], out[14], out[15]),
            (i + 1, i + 1, 0, 0),
            "{what}"
        );
        if split && !o.dev.gpu {
            // The host's sleep between the halves shows between published and receive start.
            let pause = (o.rank as u64 * 3) % 7;
            assert!(out[4] - out[3] >= pause * 1_000_000, "{what}");
        }
    }
}
