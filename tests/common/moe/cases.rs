//! The MoE scenarios of correct use both backends run (tests/moe_host.rs, tests/gpu_moe.rs),
//! each on every rank of a communicator: the reference sweep (shapes x cases), many epochs of
//! changing routing, arrival order, a split child as the EP group.

use super::*;
use crate::common::{destroy, fnv, split, Comm, Rng};

/// The reference sweep: four shapes (bf16 and FP8 at T = 128 with topk 8; one local expert per
/// rank; topk 16), each with its cases (k = 1, 2, 8 and k < topk; 1, 7 and T tokens and
/// ragged counts; int32 and int64 indices; experts and a rank with no token; one expert full).
/// Returns the cases run and the hash of y of the case where every rank passes the same inputs
/// (the parent compares it across ranks).
pub fn sweep(comm: Comm, dev: Dev, w: usize, seed: u64) -> (usize, u64) {
    let shapes = [
        Shape::new(128, 256, 8, experts(w, 16), false),
        Shape::new(128, 256, 8, experts(w, 16), true),
        Shape::new(7, 64, 2, w as u32, false),
        Shape::new(8, 16, 16, experts(w, 32), false),
    ];
    let (mut ran, mut hash) = (0, 0);
    for (si, s) in shapes.iter().enumerate() {
        let o = create(comm, *s, dev);
        let (t, e) = (s.t, s.e);
        let cs = |i: u64| seed ^ ((si as u64) << 56) ^ i.wrapping_mul(0x9E37_79B9);
        use Route::*;
        let cases = match si {
            0 | 1 => vec![
                Case::new(cs(1), 1, 1, Random),
                Case::new(cs(2), 7, 2, Random).i64(),
                Case::new(cs(3), t, 8, Random),
                Case::new(cs(4), t, 8, Hot(e - 1)).i64(),
                Case::new(cs(5), 7, 8, Holes),
                Case::new(cs(6), t, 2, Sparse).i64(),
                Case::new(cs(7), 7, 5, Random),
                Case::new(cs(8), t, 3, Holes).ragged(),
                Case::new(cs(9), 1, 8, Sparse).i64(),
                Case::new(cs(10), t, 1, Hot(0)),
            ],
            2 => vec![
                Case::new(cs(1), 7, 1, Random),
                Case::new(cs(2), 7, 2, Hot(0)),
                Case::new(cs(3), 1, 2, Holes).i64(),
                Case::new(cs(4), 7, 2, Sparse).ragged(),
            ],
            _ => vec![
                Case::new(cs(1), 8, 16, Random),
                Case::new(cs(2), 8, 3, Holes).i64(),
                Case::new(cs(3), 8, 16, Hot(e - 1)),
                Case::new(cs(4), 5, 16, Sparse).ragged(),
            ],
        };
        for c in &cases {
            run_case(&o, c, Expert::Scale, [0, 0]);
            ran += 1;
        }
        if si == 0 {
            let mut c = Case::new(cs(99), 64, 4, Random);
            c.same = true;
            hash = fnv(&run_case(&o, &c, Expert::Scale, [0, 0]).y);
            ran += 1;
        }
    }
    (ran, hash)
}

/// A random case for an object (n up to T, any k, any route, either index type).
fn random_case(s: &Shape, seed: u64) -> Case {
    let mut g = Rng::new(seed);
    let route = match g.below(4) {
        0 => Route::Random,
        1 => Route::Holes,
        2 => Route::Sparse,
        _ => Route::Hot(g.below(s.e as u64) as u32),
    };
    let n = g.below(s.t as u64 + 1) as usize;
    let mut c = Case::new(seed, n, 1 + g.below(s.topk as u64) as u32, route);
    c.idx64 = g.below(2) == 1;
    c.ragged = g.below(3) == 0;
    c
}

/// `epochs` calls with the routing, token count and k changing every call, on two objects of
/// one communicator in turn (bf16 every call, FP8 every fourth): both counts-row parities many
/// times over. Returns the calls made.
pub fn epochs(comm: Comm, dev: Dev, w: usize, seed: u64, epochs: u64) -> u64 {
    let a = create(comm, Shape::new(32, 128, 4, experts(w, 16), false), dev);
    let b = create(comm, Shape::new(16, 256, 3, experts(w, 8), true), dev);
    let mut calls = 0;
    for i in 0..epochs {
        let s = seed ^ (i << 32);
        run_case(&a, &random_case(&a.s, s), Expert::Scale, [0, 0]);
        calls += 1;
        if i % 4 == 3 {
            run_case(&b, &random_case(&b.s, s ^ 1), Expert::Scale, [0, 0]);
            calls += 1;
        }
    }
    calls
}

/// Each case twice: at once, then with one rank late to the dispatch and another late to the
/// combine (rows arrive in another order): y and the receive buffers bit for bit the same.
pub fn arrival(comm: Comm, dev: Dev, w: usize, seed: u64) -> usize {
    let o = create(comm, Shape::new(64, 256, 4, experts(w, 8), false), dev);
    let routes = [Route::Random, Route::Holes, Route::Hot(0), Route::Sparse];
    for (i, route) in routes.into_iter().enumerate() {
        let mut c = Case::new(seed ^ ((i as u64 + 1) << 20), 64, 4, route);
        c.idx64 = i % 2 == 1;
        let first = run_case(&o, &c, Expert::Scale, [0, 0]);
        let late = [
            if o.rank == i % w { 40 } else { 0 },
            if o.rank == (i + 1) % w { 40 } else { 0 },
        ];
        let again = run_case(&o, &c, Expert::Scale, late);
        assert!(
            first == again,
            "rank {} case {i}: another arrival order changed the result",
            o.rank
        );
    }
    routes.len()
}

/// A split child (ranks of one parity) as the EP group, its object and one on the parent used
/// in turn; the child's layout names the child's world and rank.
pub fn split_child(comm: Comm, dev: Dev, w: usize, rank: usize, seed: u64) {
    let child = split(comm, (rank % 2) as i32, rank as i32);
    let cw = (w + 1 - rank % 2) / 2;
    let oc = create(child, Shape::new(16, 128, 4, experts(cw, 8), false), dev);
    assert_eq!((oc.w, oc.rank), (cw, rank / 2), "the child's layout");
    let ow = create(comm, Shape::new(16, 128, 4, experts(w, 8), false), dev);
    for i in 0..6u64 {
        let s = seed ^ (i << 24);
        run_case(&oc, &random_case(&oc.s, s), Expert::Scale, [0, 0]);
        run_case(&ow, &random_case(&ow.s, s ^ 7), Expert::Scale, [0, 0]);
    }
    drop(oc);
    drop(ow);
    destroy(child);
}
