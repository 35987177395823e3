//! The MoE error scenarios both backends run (tests/moe_host.rs, tests/gpu_moe.rs): every
//! error of docs/moe.md, "Errors" (each followed by a good dispatch + combine), bad and
//! mismatched create arguments, the layout call's checks, and a peer that died.

use super::*;
use crate::common::{err, Comm, OK};
use std::ptr::null_mut;
use symmalloc::ffi::moe::*;
use symmalloc::ffi::moe_calls::*;
use symmalloc::ffi::types::*;

/// How a dispatch fails: every rank may spoil its inputs (`inp`, given its rank), rank `bad`
/// its arguments (`arg`); `bad` must then read `own` in its error, every other rank `others`.
struct Fail<'a> {
    bad: usize,
    inp: &'a dyn Fn(usize, &mut Inputs),
    arg: &'a dyn Fn(&mut Args),
    own: String,
    others: String,
}

impl<'a> Fail<'a> {
    /// Rank `bad`'s arguments are refused: its own message, and the others' naming it.
    fn arg(bad: usize, arg: &'a dyn Fn(&mut Args), own: &str, others: &str) -> Fail<'a> {
        let (own, others) = (own.to_string(), others.to_string());
        let inp = &|_, _: &mut Inputs| {};
        Fail {
            bad,
            inp,
            arg,
            own,
            others,
        }
    }
    /// A routing only the kernels see: the same message on every rank.
    fn inp(bad: usize, inp: &'a dyn Fn(usize, &mut Inputs), msg: &str) -> Fail<'a> {
        let (own, others) = (msg.to_string(), msg.to_string());
        Fail {
            bad,
            inp,
            arg: &|_| {},
            own,
            others,
        }
    }
}

/// A dispatch that fails as `f` says: every rank learns INVALID_ARGUMENT with its message;
/// nothing lands anywhere; on the host backend a combine is then refused; and `good` (a
/// dispatch + combine) passes.
fn failing(o: &Obj, c: &Case, good: &Case, f: Fail, what: &str) {
    let mut mine = rank_inputs(&o.s, c, o.w, o.rank);
    (f.inp)(o.rank, &mut mine);
    let st = stage(o, &mine, c.k, c.idx64);
    let mut a = st.a;
    if o.rank == f.bad {
        (f.arg)(&mut a);
    }
    poison_recv(o);
    let needle = if o.rank == f.bad { f.own } else { f.others };
    expect(o, dispatch(o, &a), INVALID, &[needle], what);
    assert_nothing_landed(o, what);
    if !o.dev.gpu {
        let eo = Buf::new(o.dev, o.l * o.r * o.s.h * 2);
        let y = Buf::new(o.dev, o.s.t * o.s.h * 2);
        let st = symm_moe_combine(o.moe, eo.ptr(), y.ptr(), o.dev.s());
        assert_eq!(st, INVALID, "{what}: combine after it");
        assert!(err().contains("the last dispatch failed"), "{}", err());
    }
    run_case(o, good, Expert::Scale, [0, 0]);
}

/// A combine where rank `bad` spoils its arguments (`eo`, `y` offsets or NULL): `bad` learns
/// `own`, the others that it refused, with y all zeros; then a good case passes.
fn failing_combine(
    o: &Obj,
    c: &Case,
    bad: usize,
    eo_null: bool,
    y_null: bool,
    eo_off: u64,
    own: &str,
) {
    let d = dispatch_checked(o, c, 0);
    let n = d.all[o.rank].n;
    let eo = Buf::with(o.dev, &expert_out(o, Expert::Scale, &d.recv));
    let y = Buf::new(o.dev, n * o.s.h * 2);
    o.dev.fill(y.p, y.bytes, POISON);
    let (mut ep, mut yp) = (eo.ptr(), y.ptr());
    if o.rank == bad {
        ep = if eo_null {
            null_mut()
        } else {
            (eo.p + eo_off) as _
        };
        yp = if y_null { null_mut() } else { yp };
    }
    let st = symm_moe_combine(o.moe, ep, yp, o.dev.s());
    let others = format!("rank {bad} refused the combine");
    let needle = if o.rank == bad {
        own.to_string()
    } else {
        others
    };
    expect(o, st, INVALID, &[needle], own);
    if o.rank != bad {
        assert!(
            y.get().iter().all(|&b| b == 0),
            "rank {}: y after a refused combine",
            o.rank
        );
    }
    run_case(
        o,
        &Case {
            seed: c.seed ^ 0xdef,
            ..*c
        },
        Expert::Scale,
        [0, 0],
    );
}

fn null_handle_and_stale_handle(comm: Comm, dev: Dev, w: usize) {
    let (nul, p) = (null_mut(), null_mut());
    let s = dev.s();
    let st = symm_moe_dispatch(nul, p, null_mut(), p, 0, null_mut(), 0, 1, s);
    assert!(st == INVALID && err().contains("moe is NULL"), "{}", err());
    let st = symm_moe_combine(nul, p, null_mut(), s);
    assert!(st == INVALID && err().contains("moe is NULL"), "{}", err());
    assert!(symm_moe_check(nul) == INVALID && err().contains("moe is NULL"));
    let (st, _) = layout_of(nul, SYMM_MOE_LAYOUT_VERSION, layout_size());
    assert!(st == INVALID && err().contains("moe is NULL"), "{}", err());
    assert_eq!(symm_moe_destroy(nul), OK, "destroying NULL does nothing");
    let mut m = null_mut();
    let st = symm_moe_create(comm, 4, 64, 2, experts(w, 2), SYMM_MOE_BF16, 0, &mut m);
    assert_eq!(st, OK, "{}", err());
    // One registry of handles (ffi/handles.rs), each with its kind: a live moe object is not a
    // communicator, nor a live communicator a moe object.
    let st = symmalloc::ffi::symm_barrier(m.cast(), dev.s());
    assert!(
        st == INVALID && err().contains("is not a live communicator"),
        "{}",
        err()
    );
    let st = symm_moe_check(comm.cast());
    assert!(
        st == INVALID && err().contains("is not a live moe object"),
        "{}",
        err()
    );
    assert_eq!(symm_moe_destroy(m), OK, "{}", err());
    let st = symm_moe_check(m);
    assert!(
        st == INVALID && err().contains("is not a live moe object"),
        "{}",
        err()
    );
    let st = symm_moe_destroy(m);
    assert!(
        st == INVALID && err().contains("is not a live moe object"),
        "{}",
        err()
    );
}

/// Every error of docs/moe.md, "Errors", each followed by a good dispatch + combine.
pub fn errors(comm: Comm, dev: Dev, w: usize, seed: u64) {
    null_handle_and_stale_handle(comm, dev, w);
    let o = create(comm, Shape::new(16, 128, 4, experts(w, 8), false), dev);
    let (t, k, e) = (o.s.t, o.s.topk, o.s.e as i64);
    let (bad, ku) = (w - 1, k as usize);
    // Combine before any dispatch: refused at the call, on every rank.
    let eo = Buf::new(dev, o.l * o.r * o.s.h * 2);
    let st = symm_moe_combine(o.moe, eo.ptr(), eo.ptr(), dev.s());
    let before = ["no dispatch on this object yet".to_string()];
    expect(&o, st, INVALID, &before, "combine first");
    let c = Case::new(seed, t, k, Route::Random);
    let good = Case::new(seed ^ 0xabc, t, k, Route::Holes);
    // Refusals: the rank's own message names the value, the others' name the rank.
    let sh = &o.s;
    let many = |r: usize, i: &mut Inputs| {
        if r == bad {
            *i = rank_inputs(sh, &Case { n: t + 1, ..c }, w, bad)
        }
    };
    let own = format!(
        "num_tokens {} is above max_tokens_per_rank {t} (rank {bad})",
        t + 1
    );
    let mut f = Fail::arg(
        bad,
        &|_| {},
        &own,
        &format!("rank {bad} passed num_tokens {}", t + 1),
    );
    f.inp = &many;
    failing(&o, &c, &good, f, "too many tokens");
    let own = format!("k = {} (rank {bad}); expected 1..={k}", k + 1);
    let others = format!("rank {bad} passed k = {}", k + 1);
    let above = |a: &mut Args| a.k = k + 1;
    failing(
        &o,
        &c,
        &good,
        Fail::arg(bad, &above, &own, &others),
        "k above topk",
    );
    let f = Fail::arg(0, &|a| a.k = 0, "k = 0 (rank 0)", "rank 0 passed k = 0");
    failing(&o, &c, &good, f, "k = 0");
    let refused = format!("rank {bad} refused the dispatch");
    let spoils: [(ArgSpoil, &str, bool); 7] = [
        (&|a| a.x = null_mut(), "symm_moe_dispatch: x is NULL", false),
        (&|a| a.idx = null_mut(), "topk_idx is NULL", false),
        (&|a| a.w = null_mut(), "topk_weights is NULL", false),
        (&|a| a.it = 7, "idx_dtype 7 is not an index type", false),
        (
            &|a| a.x = (a.x as u64 + 2) as _,
            "is not 16-byte aligned",
            false,
        ),
        (
            &|a| a.idx = (a.idx as u64 + 4) as _,
            "is not 8-byte aligned",
            true,
        ),
        (&|a| a.sc = a.w, "given for a bf16 payload", false),
    ];
    for (spoil, msg, i64) in spoils {
        let c = Case { idx64: i64, ..c };
        failing(&o, &c, &good, Fail::arg(bad, spoil, msg, &refused), msg);
    }
    // Routing errors: every rank reports the same, naming the rank, the entry and the value.
    let at = |rank: usize, f: IdxSpoil| {
        move |r: usize, i: &mut Inputs| {
            if r == rank {
                f(&mut i.idx, ku, e)
            }
        }
    };
    let range = format!("out of range; expected -1 or 0..{e} (num_experts)");
    let v = rank_inputs(&o.s, &c, w, bad).idx[5 * ku];
    let cases: [(Case, usize, IdxSpoil, String); 4] = [
        (
            c,
            bad,
            |x, k, e| x[3 * k + 1] = e,
            format!("rank {bad}: topk_idx[3][1] = {e} is {range}"),
        ),
        (
            c.i64(),
            bad,
            |x, k, _| x[2 * k] = 1 << 40,
            format!("rank {bad}: topk_idx[2][0] = {} is {range}", 1i64 << 40),
        ),
        (
            c,
            0,
            |x, _, _| x[3] = -2,
            format!("rank 0: topk_idx[0][3] = -2 is {range}"),
        ),
        (
            c,
            bad,
            |x, k, _| x[5 * k + 2] = x[5 * k],
            format!("rank {bad}: topk_idx[5][2] = {v} repeats an expert of an earlier slot"),
        ),
    ];
    for (c, r, f, msg) in cases {
        failing(&o, &c, &good, Fail::inp(r, &at(r, f), &msg), "routing");
    }
    // Two bad entries on rank 0, one on the last rank: the lowest rank's lowest t * K + k wins.
    let two = move |r: usize, i: &mut Inputs| {
        if r == 0 {
            i.idx[6 * ku] = -7;
            i.idx[2 * ku + 3] = e + 5;
        } else if r == bad {
            i.idx[1] = i.idx[0];
        }
    };
    let msg = format!("rank 0: topk_idx[2][3] = {} is out of range", e + 5);
    failing(
        &o,
        &c,
        &good,
        Fail::inp(0, &two, &msg),
        "lowest rank, lowest entry",
    );
    // Combine refusals.
    failing_combine(&o, &c, bad, true, false, 0, "expert_out is NULL");
    failing_combine(&o, &c, 0, false, true, 0, "y is NULL");
    failing_combine(&o, &c, bad, false, false, 8, "is not 16-byte aligned");
    drop(o);
    // FP8 without scales.
    let f8 = create(comm, Shape::new(8, 128, 2, experts(w, 4), true), dev);
    let c = Case::new(seed ^ 5, 8, 2, Route::Random);
    let own = "x_scales is NULL for an FP8 payload";
    let f = Fail::arg(bad, &|a| a.sc = null_mut(), own, &refused);
    failing(&f8, &c, &c, f, "FP8 without scales");
    drop(f8);
    capacity(comm, dev, w, seed);
}

/// A change to one rank's arguments; to a routing (`idx`, k, E).
type ArgSpoil<'a> = &'a dyn Fn(&mut Args);
type IdxSpoil = fn(&mut Vec<i64>, usize, i64);

/// R = 3 (`symm_moe_create_config`): the last expert gets 2 rows from every rank (an error
/// naming it, on every rank), then exactly 3 (a full expert, correct).
fn capacity(comm: Comm, dev: Dev, w: usize, seed: u64) {
    let mut s = Shape::new(4, 128, 2, 2 * w as u32, false);
    s.max_recv = 3;
    let o = create(comm, s, dev);
    let last = 2 * w as i64 - 1;
    // Every other expert gets at most 3 rows in both tables.
    fn over(w: usize, r: usize, t: usize, _: usize) -> i64 {
        let last = 2 * w as i64 - 1;
        if t < 2 {
            last
        } else {
            (r * 4 + t) as i64 % last
        }
    }
    fn fill(w: usize, r: usize, t: usize, _: usize) -> i64 {
        let last = 2 * w as i64 - 1;
        if t * w + r < 3 {
            last
        } else {
            (r * 4 + t) as i64 % last
        }
    }
    let c = Case::new(seed ^ 3, 4, 1, Route::Table(over));
    let msg = format!(
        "expert {last} (local expert 1 of rank {}) would receive {} rows; expected at most \
         max_recv_per_expert = 3",
        w - 1,
        2 * w
    );
    let full = Case::new(seed ^ 4, 4, 1, Route::Table(fill));
    failing(&o, &c, &full, Fail::inp(0, &|_, _| {}, &msg), "capacity");
    if o.rank == w - 1 {
        assert_eq!(
            read_recv(&o).counts[1],
            3,
            "the last expert is exactly full"
        );
    }
}

/// One `symm_moe_create` (or `_config` with `cfg`) that every rank must see fail with `want`
/// and every needle; `*out` stays NULL.
pub fn refuse(
    comm: Comm,
    s: Shape,
    cfg: Option<symm_moe_config_t>,
    want: symm_status_t,
    needles: &[String],
) {
    let mut m = std::ptr::dangling_mut::<symm_moe_t>();
    let st = match cfg {
        Some(c) => symm_moe_create_config(comm, &c, &mut m),
        None => symm_moe_create(
            comm,
            s.t,
            s.h,
            s.topk,
            s.e,
            s.dtype(),
            s.max_recv as u32,
            &mut m,
        ),
    };
    let e = err();
    assert_eq!(st, want, "{s:?} {cfg:?}: {e}");
    assert!(
        m.is_null(),
        "a failed create leaves NULL: {s:?} {cfg:?}: {e}"
    );
    for n in needles {
        assert!(e.contains(n.as_str()), "{s:?}: {e:?} lacks {n:?}");
    }
}

/// Bad create arguments (every rank alike: each names the value) and configurations that differ
/// between ranks (SYMM_ERR_NOT_SYMMETRIC on every rank, naming both); then a good object works.
/// `Shape::max_recv` carries `flags` for `symm_moe_create` here.
pub fn create_errors(comm: Comm, dev: Dev, w: usize, rank: usize, seed: u64) {
    let good = Shape::new(8, 128, 4, experts(w, 8), false);
    let with = |f: &dyn Fn(&mut Shape)| {
        let mut s = good;
        f(&mut s);
        s
    };
    let e = good.e;
    let bad: Vec<(Shape, String)> = vec![
        (
            with(&|s| s.e = e + 1),
            format!(
                "num_experts {} must be a positive multiple of the communicator's {w} ranks",
                e + 1
            ),
        ),
        (with(&|s| s.e = 0), "num_experts 0 must be".into()),
        (with(&|s| s.e = experts(w, 1025)), "at most 1024".into()),
        (
            with(&|s| s.h = 12),
            "hidden 12 does not fit bf16 rows of 16-byte vectors; expected a multiple of 8".into(),
        ),
        (with(&|s| s.h = 0), "hidden 0 does not fit".into()),
        (
            with(&|s| (s.h, s.fp8) = (144, true)),
            "hidden 144 is not a multiple of 128".into(),
        ),
        (
            with(&|s| (s.h, s.fp8) = (8, true)),
            "hidden 8 does not fit fp8 rows".into(),
        ),
        (
            with(&|s| s.topk = 0),
            "topk 0 is out of range; expected 1..=16".into(),
        ),
        (
            with(&|s| s.topk = 17),
            "topk 17 is out of range; expected 1..=16".into(),
        ),
        (
            with(&|s| s.max_recv = 2),
            "flags 0x2 are not supported; expected 0 or SYMM_MOE_FLAG_PROBE (0x1)".into(),
        ),
        (
            with(&|s| s.t = 0),
            "max_tokens_per_rank 0 is out of range".into(),
        ),
    ];
    for (s, n) in &bad {
        refuse(comm, *s, None, INVALID, std::slice::from_ref(n));
    }
    let mut m = null_mut();
    let st = symm_moe_create(comm, 8, 128, 4, e, 2, 0, &mut m);
    assert!(
        st == INVALID && err().contains("dtype 2 is not a payload type"),
        "{}",
        err()
    );
    let cfg = |f: &dyn Fn(&mut symm_moe_config_t)| {
        let mut c = good.config();
        f(&mut c);
        Some(c)
    };
    let most = 8 * w as u64;
    let above = format!(
        "max_recv_per_expert {} is above world x max_tokens_per_rank = {most}",
        most + 1
    );
    refuse(
        comm,
        good,
        cfg(&|c| c.max_recv_per_expert = most + 1),
        INVALID,
        &[above],
    );
    let v = "config version 4, size".to_string();
    refuse(comm, good, cfg(&|c| c.version = 4), INVALID, &[v]);
    // Version 1's size under version 3 (and the reverse) is another layout: refused.
    let v1_size = std::mem::offset_of!(symm_moe_config_t, num_sms) as u32;
    let v = format!("config version 3, size {v1_size}");
    refuse(comm, good, cfg(&|c| c.size = v1_size), INVALID, &[v]);
    refuse(
        comm,
        good,
        cfg(&|c| c.version = 1),
        INVALID,
        &["config version 1, size".into()],
    );
    refuse(
        comm,
        good,
        cfg(&|c| c.size = 8),
        INVALID,
        &["size 8; expected version 3".into()],
    );
    let st = symm_moe_create_config(comm, null_mut(), &mut m);
    assert!(
        st == INVALID && err().contains("config is NULL"),
        "{}",
        err()
    );
    // One rank cannot read its request (a config of another version; `out` NULL): every rank
    // fails at once naming it (it still takes part in the agreement), none waits for a timeout.
    let last = w - 1;
    let own_v = cfg(&|c| c.version = if rank == last { 4 } else { 3 });
    let named = format!("rank {last}: symm_moe_create_config: config version 4");
    let needle = if rank == last {
        "config version 4".to_string()
    } else {
        named
    };
    let t0 = std::time::Instant::now();
    refuse(comm, good, own_v, INVALID, &[needle]);
    let mut m1: *mut symm_moe_t = null_mut();
    let out = if rank == last {
        null_mut()
    } else {
        &mut m1 as *mut _
    };
    let st = symm_moe_create(comm, 8, 128, 4, e, 0, 0, out);
    let want = if rank == last {
        "out is NULL".to_string()
    } else {
        format!("rank {last}: symm_moe_create: out is NULL")
    };
    assert!(
        st == INVALID && err().contains(&want) && m1.is_null(),
        "{}",
        err()
    );
    assert!(
        t0.elapsed().as_secs_f64() < 5.0,
        "one rank's unreadable request failed the others at once, not after a timeout ({:?})",
        t0.elapsed()
    );
    let st = symm_moe_create(comm, 8, 128, 4, e, 0, 0, null_mut());
    assert!(st == INVALID && err().contains("out is NULL"), "{}", err());
    let st = symm_moe_create(null_mut(), 8, 128, 4, e, 0, 0, &mut m);
    assert!(st == INVALID && err().contains("comm is NULL"), "{}", err());
    // Buffers larger than the arena: out of memory on every rank, naming the setting.
    let huge = Shape::new(1 << 20, 4096, 1, w as u32, false);
    let oom = symm_status_t::SYMM_ERR_OUT_OF_MEMORY;
    refuse(comm, huge, None, oom, &["SYMMALLOC_COMM_ARENA_SIZE".into()]);
    // Different configurations: every rank is told, with every rank's values.
    let ns = symm_status_t::SYMM_ERR_NOT_SYMMETRIC;
    let mine = with(&|s| s.h = if rank == 0 { 256 } else { 128 });
    let both = [
        "every rank must pass the same values".to_string(),
        "rank 0: max_tokens_per_rank 8, hidden 256".into(),
        format!("rank {}: max_tokens_per_rank 8, hidden 128", w - 1),
    ];
    refuse(comm, mine, None, ns, &both);
    let r = if rank == w - 1 { 5 } else { 0 };
    let needles = [
        "max_recv_per_expert 5".to_string(),
        "max_recv_per_expert 0".into(),
    ];
    refuse(
        comm,
        good,
        cfg(&|c| c.max_recv_per_expert = r),
        ns,
        &needles,
    );
    // One rank's configuration is also invalid: still NOT_SYMMETRIC, on every rank.
    let mine = with(&|s| s.topk = if rank == 0 { 17 } else { 4 });
    refuse(comm, mine, None, ns, &["topk 17".into()]);
    let o = create(comm, good, dev);
    run_case(
        &o,
        &Case::new(seed, 8, 4, Route::Random),
        Expert::Scale,
        [0, 0],
    );
    layout_errors(&o);
}

/// `symm_moe_layout`'s version and size handling (the fields: `create`).
fn layout_errors(o: &Obj) {
    let size = layout_size();
    for (v, s, needle) in [
        (3, size, "out->version 3"),
        (0, size, "out->version 0"),
        (1, size - 8, "out->size"),
        (1, size + 8, "out->size"),
    ] {
        let (st, l) = layout_of(o.moe, v, s);
        assert!(
            st == INVALID && err().contains(needle),
            "{v} {s}: {}",
            err()
        );
        assert!(l.recv_x.is_null(), "nothing written");
    }
    let st = symm_moe_layout(o.moe, null_mut());
    assert!(st == INVALID && err().contains("out is NULL"), "{}", err());
}

/// The last rank dies after a good call; every other rank's next dispatch fails with
/// SYMM_ERR_TIMEOUT naming it within the communicator's timeout (`timeout_s`), and says so
/// again at the next call.
pub fn dead_peer(comm: Comm, dev: Dev, w: usize, seed: u64, timeout_s: f64) {
    let o = create(comm, Shape::new(8, 128, 2, experts(w, 4), false), dev);
    let c = Case::new(seed, 8, 2, Route::Random);
    run_case(&o, &c, Expert::Scale, [0, 0]);
    if o.rank == w - 1 {
        dev.sync();
        // SAFETY: ends this process at once: no destroy, no exit handlers.
        unsafe { libc::_exit(0) };
    }
    let st = stage(&o, &rank_inputs(&o.s, &c, w, o.rank), 2, false);
    let t0 = std::time::Instant::now();
    let first = dispatch(&o, &st.a);
    let (got, msg) = outcome(&o, first);
    let took = t0.elapsed().as_secs_f64();
    let timeout = symm_status_t::SYMM_ERR_TIMEOUT;
    assert_eq!(got, timeout, "rank {}: {msg}", o.rank);
    assert!(msg.contains(&format!("rank {}", w - 1)), "{msg}");
    assert!(
        !msg.contains("  "),
        "a run of spaces in the message: {msg:?}"
    );
    assert!(
        took >= 0.8 * timeout_s && took < timeout_s + 10.0,
        "gave up after {took:.1} s (timeout {timeout_s} s)"
    );
    let st = symm_moe_check(o.moe);
    assert_eq!(st, timeout, "the next call: {}", err());
    println!(
        "rank {}: the dead peer was named after {took:.1} s: {msg}",
        o.rank
    );
}
