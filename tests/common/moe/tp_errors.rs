//! The throughput mode's error scenarios (docs/moe.md, "Throughput mode", "Errors"): bad
//! arguments on one rank named on every other, bad routing named on every rank, a refused
//! combine retried, a combine after a failed dispatch (host backend), create's checks of the
//! mode; the object usable after each. Run by tests/moe_tp_host.rs and tests/gpu_moe.rs.

use super::tp::*;
use super::{rank_inputs, Buf, Case, Dev, Inputs, Route, Shape, INVALID};
use crate::common::{err, Comm, OK};
use std::ptr::null_mut;
use symmalloc::ffi::moe::*;
use symmalloc::ffi::moe_calls::*;
use symmalloc::ffi::types::*;

/// The outcome of a call on this rank: its status, or on CUDA (where the kernels record what
/// only the routing or a peer shows) the status `symm_moe_check` reports after a sync.
fn outcome(o: &Tp, st: symm_status_t) -> symm_status_t {
    if st == OK && o.dev.gpu {
        o.dev.sync();
        return symm_moe_check(o.moe);
    }
    st
}

fn expect_tp(rank: usize, st: symm_status_t, want: symm_status_t, needle: &str, what: &str) {
    let e = err();
    assert_eq!(st, want, "rank {rank} {what}: {e}");
    assert!(
        e.contains(needle),
        "rank {rank} {what}: {e:?} lacks {needle:?}"
    );
}

/// Every error: bad arguments on one rank (named on every other), bad routing (named on every
/// rank), a refused combine retried, a combine after a failed dispatch; a good case after each.
pub fn tp_errors(comm: Comm, dev: Dev, w: usize, seed: u64) {
    let s = Shape::new(8, 128, 4, (4 * w) as u32, false);
    let o = tp_create(comm, s, dev);
    let me = o.rank;
    let last = w - 1;
    let good = Case::new(seed, 8, 4, Route::Random);
    let mut n = 0;
    let mut ok_case = |what: &str| {
        n += 1;
        tp_case(&o, &Case::new(seed ^ n, 8, 4, Route::Random), what);
    };
    // k = 0 on the last rank.
    let inp = rank_inputs(&s, &good, w, me);
    let mut bufs = Vec::new();
    let k = if me == last { 0 } else { 4 };
    let st = outcome(&o, tp_dispatch(&o, &inp, k, false, &mut bufs));
    let needle = if me == last {
        "k = 0".to_string()
    } else {
        format!("rank {last} passed k = 0")
    };
    expect_tp(me, st, INVALID, &needle, "k = 0");
    ok_case("after k = 0");
    // num_tokens above T on rank 0.
    let mut big = rank_inputs(&s, &good, w, me);
    if me == 0 {
        big.n = 9;
        big.x.extend(vec![0u8; s.row()]);
        big.idx.extend([0, 1, 2, 3]);
        big.w.extend([0.5; 4]);
    }
    let st = outcome(&o, tp_dispatch(&o, &big, 4, false, &mut bufs));
    let needle = if me == 0 {
        "num_tokens 9 is above max_tokens_per_rank 8".to_string()
    } else {
        "rank 0 passed num_tokens 9".to_string()
    };
    expect_tp(me, st, INVALID, &needle, "too many tokens");
    ok_case("after too many tokens");
    // An expert out of range on rank 0, a duplicate on the last rank: the lowest rank wins.
    let mut bad = rank_inputs(&s, &good, w, me);
    if me == 0 {
        bad.idx[2 * 4 + 1] = 999;
    }
    if me == last {
        bad.idx[5 * 4 + 2] = bad.idx[5 * 4];
    }
    let st = outcome(&o, tp_dispatch(&o, &bad, 4, false, &mut bufs));
    let needle = "rank 0: topk_idx[2][1] = 999 is out of range";
    expect_tp(me, st, INVALID, needle, "out of range");
    let y = Buf::new(dev, 8 * s.h * 2);
    let eo = Buf::new(dev, w * s.t * s.h * 2);
    if !dev.gpu {
        // Host backend only: the kernels keep their own word (a combine after a failed
        // dispatch writes zeros there).
        let st = symm_moe_combine(o.moe, eo.ptr(), y.ptr(), dev.s());
        let what = "combine after a failed dispatch";
        expect_tp(me, st, INVALID, "the last dispatch failed", what);
    }
    ok_case("after out of range");
    let mut dup = rank_inputs(&s, &good, w, me);
    if me == last {
        dup.idx[5 * 4 + 2] = dup.idx[5 * 4];
    }
    let st = outcome(&o, tp_dispatch(&o, &dup, 4, false, &mut bufs));
    let needle = format!("rank {last}: topk_idx[5][2] = ");
    expect_tp(me, st, INVALID, &needle, "duplicate");
    expect_tp(me, st, INVALID, "repeats an expert", "duplicate");
    ok_case("after duplicate");
    // Two bad entries on one rank, in different tokens (different blocks of a GPU grid, which
    // route their own chunks): the first in token order is named, not the later out of range.
    let mut two = rank_inputs(&s, &good, w, me);
    if me == last {
        two.idx[6 * 4 + 3] = 999;
        two.idx[4 + 2] = two.idx[4 + 1];
    }
    let st = outcome(&o, tp_dispatch(&o, &two, 4, false, &mut bufs));
    let needle = format!("rank {last}: topk_idx[1][2] = ");
    expect_tp(me, st, INVALID, &needle, "two bad entries");
    expect_tp(me, st, INVALID, "repeats an expert", "two bad entries");
    ok_case("after two bad entries");
    // A combine rank 0 refuses (expert_out NULL), then the retry.
    let c = Case::new(seed ^ 99, 8, 4, Route::Holes);
    let all: Vec<Inputs> = (0..w).map(|r| rank_inputs(&s, &c, w, r)).collect();
    let st = tp_dispatch(&o, &all[me], 4, false, &mut bufs);
    assert_eq!(st, OK, "{}", err());
    let want = check_tp_recv(&o, &all, "before the refused combine");
    let eo = tp_expert_out(&o, &all, &want, 0);
    let p = if me == 0 { null_mut() } else { eo.ptr() };
    let st = outcome(&o, symm_moe_combine(o.moe, p, y.ptr(), dev.s()));
    let needle = if me == 0 {
        "expert_out is NULL"
    } else {
        "rank 0 refused the combine"
    };
    expect_tp(me, st, INVALID, needle, "refused combine");
    tp_combine_checked(&o, &all, &want, 0, "the retried combine");
    // The wrong layout call for the mode.
    let (st, _) = super::layout_of(o.moe, SYMM_MOE_LAYOUT_VERSION, super::layout_size());
    expect_tp(
        me,
        st,
        INVALID,
        "created in throughput mode",
        "symm_moe_layout",
    );
}

/// Create: a bad mode, max_recv_per_expert in throughput mode, a nonzero mode_reserved,
/// different modes on different ranks; a version 2 struct is a low-latency object; the
/// low-latency object refuses symm_moe_tp_layout; the 1 GiB bound of the formula.
pub fn tp_create_errors(comm: Comm, dev: Dev, w: usize, rank: usize) {
    let good = Shape::new(8, 128, 4, (4 * w) as u32, false);
    let cfg = |f: &dyn Fn(&mut symm_moe_config_t)| {
        let mut c = tp_config(&good);
        f(&mut c);
        Some(c)
    };
    use super::errors::refuse;
    refuse(
        comm,
        good,
        cfg(&|c| c.mode = 2),
        INVALID,
        &["mode 2 is not a mode".into()],
    );
    let r = "max_recv_per_expert 5 is for the low-latency mode".to_string();
    refuse(
        comm,
        good,
        cfg(&|c| c.max_recv_per_expert = 5),
        INVALID,
        &[r],
    );
    let r = "mode_reserved 0x1; expected 0".to_string();
    refuse(comm, good, cfg(&|c| c.mode_reserved = 1), INVALID, &[r]);
    let ns = symm_status_t::SYMM_ERR_NOT_SYMMETRIC;
    let mixed = cfg(&|c| c.mode = (rank == 0) as u32);
    if w > 1 {
        refuse(
            comm,
            good,
            mixed,
            ns,
            &["rank 0: ".into(), "mode 1".into(), "mode 0".into()],
        );
    }
    // A version 2 struct (no mode group): low latency.
    let mut v2 = good.config();
    v2.version = 2;
    v2.size = std::mem::offset_of!(symm_moe_config_t, input) as u32;
    v2.mode = SYMM_MOE_THROUGHPUT; // past `size`: never read
    let mut m = null_mut();
    let st = symm_moe_create_config(comm, &v2, &mut m);
    assert_eq!(st, OK, "a version 2 config: {}", err());
    let (st, _) = super::layout_of(m, SYMM_MOE_LAYOUT_VERSION, super::layout_size());
    assert_eq!(
        st,
        OK,
        "a version 2 config makes a low-latency object: {}",
        err()
    );
    let (st, _) = tp_layout_of(m);
    expect_tp(
        rank,
        st,
        INVALID,
        "created in low latency mode",
        "symm_moe_tp_layout",
    );
    assert_eq!(symm_moe_destroy(m), OK, "{}", err());
    let o = tp_create(comm, good, dev);
    let mut bad: symm_moe_tp_layout_t = o.lay;
    bad.size -= 8;
    let st = symm_moe_tp_layout(o.moe, &mut bad);
    let needle = format!(
        "out->size {}; expected version 2 (SYMM_MOE_TP_LAYOUT_VERSION) and size {}",
        bad.size, o.lay.size
    );
    expect_tp(rank, st, INVALID, &needle, "tp layout size");
    // A version 1 query of a version 2 size, and version 2 of the version 1 size: refused.
    for (v, size) in [(1, o.lay.size), (2, 152)] {
        bad.version = v;
        bad.size = size;
        let st = symm_moe_tp_layout(o.moe, &mut bad);
        let needle = format!("out->version {v}, out->size {size}");
        expect_tp(rank, st, INVALID, &needle, "tp layout version");
    }
}

/// A peer that dies after a good call (the last rank): the next dispatch fails on every live
/// rank with symm_status_t::SYMM_ERR_TIMEOUT naming it, within the communicator's timeout (`timeout_s`), and
/// the next call says so again.
pub fn tp_dead_peer(comm: Comm, dev: Dev, w: usize, seed: u64, timeout_s: f64) {
    let s = Shape::new(8, 128, 4, (4 * w) as u32, false);
    let o = tp_create(comm, s, dev);
    tp_case(
        &o,
        &Case::new(seed, 8, 4, Route::Random),
        "before the peer dies",
    );
    if o.rank == w - 1 {
        dev.sync();
        // SAFETY: ends this process at once: no destroy, no exit handlers.
        unsafe { libc::_exit(0) };
    }
    let inp = rank_inputs(&s, &Case::new(seed ^ 1, 8, 4, Route::Random), w, o.rank);
    let mut bufs = Vec::new();
    let t0 = std::time::Instant::now();
    let st = outcome(&o, tp_dispatch(&o, &inp, 4, false, &mut bufs));
    let took = t0.elapsed().as_secs_f64();
    let msg = err();
    assert_eq!(
        st,
        symm_status_t::SYMM_ERR_TIMEOUT,
        "rank {}: {msg}",
        o.rank
    );
    assert!(
        msg.contains(&format!("rank {} did not arrive", w - 1)),
        "{msg}"
    );
    assert!(
        msg.contains("throughput mode") && !msg.contains("  "),
        "{msg:?}"
    );
    assert!(
        took >= 0.8 * timeout_s && took < timeout_s + 10.0,
        "gave up after {took:.1} s (timeout {timeout_s} s)"
    );
    assert_eq!(
        symm_moe_check(o.moe),
        symm_status_t::SYMM_ERR_TIMEOUT,
        "the next call: {}",
        err()
    );
    println!(
        "rank {}: the dead peer was named after {took:.1} s: {msg}",
        o.rank
    );
}
