//! The edges of the one-wait dispatch protocol (docs/moe.md, "Protocol") and of `num_sms`,
//! checked exactly (receive buffers and y) on every rank: grids capped to 1 and 3 blocks
//! (chunks of many tokens per block, blocks with no tokens), one expert receiving every row
//! (R exactly full), zero tokens on every rank and on some, several dispatches before one
//! combine (the parity of the lists and staged rows), a refused dispatch then the same call
//! retried; at create a version 1 config struct, a nonzero reserved word, and `num_sms` that
//! differs between ranks.

use super::errors::refuse;
use super::*;
use crate::common::Comm;

fn capped(comm: Comm, dev: Dev, w: usize, num_sms: u32) -> Obj {
    let mut s = Shape::new(64, 128, 4, experts(w, 8), false);
    s.num_sms = num_sms;
    create(comm, s, dev)
}

/// Runs the cases on objects of 1 and 3 blocks and on the default grid; returns how many ran.
pub fn edges(comm: Comm, dev: Dev, w: usize, seed: u64) -> usize {
    let mut ran = 0;
    for num_sms in [1u32, 3, 0] {
        let o = capped(comm, dev, w, num_sms);
        let t = o.s.t;
        let cs = |i: u64| seed ^ ((num_sms as u64) << 40) ^ i.wrapping_mul(0x9E37_79B9);
        let cases = [
            // Every token of every rank to expert 0 (slot t % k): W * T rows, R exactly.
            Case::new(cs(1), t, 1, Route::Hot(0)),
            Case::new(cs(2), t, 4, Route::Hot(o.s.e - 1)).i64(),
            // Nobody sends anything; then only some ranks do.
            Case::new(cs(3), 0, 4, Route::Random),
            Case::new(cs(4), t, 4, Route::Random).ragged(),
            Case::new(cs(5), 1, 1, Route::Random),
            Case::new(cs(6), t - 1, 3, Route::Holes),
        ];
        for c in &cases {
            run_case(&o, c, Expert::Scale, [0, 0]);
            ran += 1;
        }
        // Three dispatches, then a combine of the last: the parities of the lists and staged
        // rows alternate under a peer that may be a call ahead.
        for i in 0..3u64 {
            dispatch_checked(
                &o,
                &Case::new(cs(10 + i), t / 2 + i as usize, 4, Route::Random),
                0,
            );
            ran += 1;
        }
        run_case(
            &o,
            &Case::new(cs(20), t, 4, Route::Sparse),
            Expert::Scale,
            [0, 0],
        );
        ran += 1;
    }
    create_edges(comm, dev, w);
    ran
}

/// The last rank refuses a dispatch (k = 0): every rank fails naming it, nothing lands; the
/// same call then goes through everywhere, and so does the pair after it.
fn refused_then_retried(o: &Obj, seed: u64) -> usize {
    let (w, me, last) = (o.w, o.rank, o.w - 1);
    let c = Case::new(seed, o.s.t, 4, Route::Random);
    let all: Vec<Inputs> = (0..w).map(|r| rank_inputs(&o.s, &c, w, r)).collect();
    let staged = stage(o, &all[me], c.k, c.idx64);
    let mut bad = staged.a;
    if me == last {
        bad.k = 0;
    }
    let own = "k = 0".to_string();
    let named = format!("rank {last} passed k = 0");
    let needle = if me == last { own } else { named };
    expect(
        o,
        dispatch(o, &bad),
        INVALID,
        &[needle],
        "a refused dispatch",
    );
    assert!(
        read_recv(o).counts.iter().all(|&n| n == 0),
        "rank {me}: a refused dispatch leaves no rows"
    );
    let d = dispatch_checked(o, &c, 0);
    drop(d);
    run_case(o, &c, Expert::Scale, [0, 0]);
    2
}

/// A version 1 `symm_moe_config_t` (without `num_sms`) is read as `num_sms` 0; a nonzero
/// reserved word and a `num_sms` that differs between ranks fail on every rank.
fn create_edges(comm: Comm, dev: Dev, w: usize) {
    let rank = {
        let o = capped(comm, dev, w, 0);
        o.rank
    };
    let good = Shape::new(8, 128, 4, experts(w, 8), false);
    let mut v1 = good.config();
    v1.version = 1;
    v1.size = std::mem::offset_of!(symm_moe_config_t, num_sms) as u32;
    v1.num_sms = 7; // past `size`: never read
    let mut m = std::ptr::null_mut();
    let st = symm_moe_create_config(comm, &v1, &mut m);
    assert_eq!(st, OK, "a version 1 config: {}", err());
    assert_eq!(symm_moe_destroy(m), OK, "{}", err());
    let mut bad = good.config();
    bad.reserved = 1;
    let invalid = symm_status_t::SYMM_ERR_INVALID_ARGUMENT;
    refuse(
        comm,
        good,
        Some(bad),
        invalid,
        &["reserved 0x1; expected 0".into()],
    );
    let mut mine = good.config();
    mine.num_sms = if rank == 0 { 2 } else { 0 };
    let ns = symm_status_t::SYMM_ERR_NOT_SYMMETRIC;
    refuse(
        comm,
        good,
        Some(mine),
        ns,
        &["num_sms 2".into(), "num_sms 0".into()],
    );
}
