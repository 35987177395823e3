//! Repeated combines of one dispatch (docs/moe.md, "Repeated combines"), the scenarios both
//! backends run: several combines of one dispatch issued back to back with different experts,
//! each `y` checked bit for bit once all were issued (a later combine must not reach an
//! earlier one's landing buffer or flags on a slower rank); and a combine one rank refuses,
//! retried at once: every other rank names the refusing rank (y zeros), then the retry and the
//! combine after it are correct on every rank. Both race only when one rank runs ahead of
//! another, so each runs many rounds.

use super::*;
use std::ptr::null_mut;

/// The experts the repeats apply: four different outputs for every row (bf16 payloads).
pub const KINDS: [Expert; 4] = [
    Expert::Scale,
    Expert::Pairs(0),
    Expert::Pairs(1),
    Expert::Pairs(2),
];

/// The object both scenarios use: enough tokens and hidden that a combine's sum takes a while.
pub fn repeat_shape(w: usize) -> Shape {
    Shape::new(64, 512, 4, experts(w, 8), false)
}

/// One combine's buffers: the expert's output for every landed row and a poisoned y.
pub struct Pending {
    pub kind: Expert,
    pub eo: Buf,
    pub y: Buf,
}

/// The buffers of one combine per kind, made before any of them is issued (so the combines
/// themselves go back to back).
pub fn prepare(o: &Obj, d: &Dispatched, kinds: &[Expert]) -> Vec<Pending> {
    let n = d.all[o.rank].n;
    kinds
        .iter()
        .map(|&kind| {
            let eo = Buf::with(o.dev, &expert_out(o, kind, &d.recv));
            let y = Buf::new(o.dev, n * o.s.h * 2);
            o.dev.fill(y.p, y.bytes, POISON);
            Pending { kind, eo, y }
        })
        .collect()
}

/// Issues the combines back to back (no synchronization between them); the statuses.
pub fn issue(o: &Obj, n: usize, ps: &[Pending]) -> Vec<symm_status_t> {
    ps.iter()
        .map(|p| {
            let yp = if n == 0 { null_mut() } else { p.y.ptr() };
            symm_moe_combine(o.moe, p.eo.ptr(), yp, o.dev.s())
        })
        .collect()
}

/// Checks every combine's y bit for bit against its own expert, and that the ys differ from
/// each other (so a y that took another combine's rows could not pass).
pub fn check_all(o: &Obj, c: &Case, d: &Dispatched, ps: &[Pending], what: &str) {
    let me = &d.all[o.rank];
    let ys: Vec<Vec<u8>> = ps.iter().map(|p| p.y.get()).collect();
    for (i, (p, y)) in ps.iter().zip(&ys).enumerate() {
        check_y(
            o,
            c,
            p.kind,
            me,
            y,
            &format!("{what}: combine {i} ({:?})", p.kind),
        );
    }
    if me.n > 0 && me.idx.iter().any(|&e| e >= 0) {
        for i in 0..ys.len() {
            for j in 0..i {
                assert!(
                    ys[i] != ys[j],
                    "rank {} {what}: combines {j} and {i} gave the same y; the test cannot tell \
                     them apart",
                    o.rank
                );
            }
        }
    }
}

/// `rounds` dispatches, each followed by 2 to 4 combines with different experts issued back to
/// back, every y checked afterwards; then the dispatch + combine pair after them. Returns the
/// combines made.
pub fn repeated_combines(comm: Comm, dev: Dev, w: usize, seed: u64, rounds: u64) -> u64 {
    let o = create(comm, repeat_shape(w), dev);
    let mut made = 0;
    for i in 0..rounds {
        let route = [Route::Random, Route::Holes, Route::Hot(0), Route::Sparse][i as usize % 4];
        let mut c = Case::new(seed ^ (i << 24) ^ 0x2c0b, o.s.t, 4, route);
        c.idx64 = i % 2 == 1;
        c.ragged = i % 5 == 4;
        let d = dispatch_checked(&o, &c, 0);
        let n = d.all[o.rank].n;
        let count = 2 + (i as usize % 3);
        let kinds: Vec<Expert> = (0..count).map(|j| KINDS[(i as usize + j) % 4]).collect();
        let ps = prepare(&o, &d, &kinds);
        let sts = issue(&o, n, &ps);
        for (j, &st) in sts.iter().enumerate() {
            expect_ok(&o, st, &format!("round {i} combine {j}"));
        }
        check_all(&o, &c, &d, &ps, &format!("round {i}"));
        made += count as u64;
    }
    let c = Case::new(seed ^ 0xa11, o.s.t, 4, Route::Random);
    run_case(&o, &c, Expert::Scale, [0, 0]);
    made + 1
}

/// `rounds` dispatches, each followed by a combine that rank `i % w` refuses (NULL
/// expert_out): it returns its own error, every other rank names it with y zeros; then at once
/// the retry and one more combine (different experts, back to back), both correct on every
/// rank. Returns the rounds made.
pub fn refused_combine_retried(comm: Comm, dev: Dev, w: usize, seed: u64, rounds: u64) -> u64 {
    let o = create(comm, repeat_shape(w), dev);
    for i in 0..rounds {
        let bad = i as usize % w;
        let c = Case::new(seed ^ (i << 24) ^ 0x7e7, o.s.t, 4, Route::Random);
        let d = dispatch_checked(&o, &c, 0);
        let n = d.all[o.rank].n;
        let what = format!("round {i} (rank {bad} refuses)");
        let refused = prepare(&o, &d, &[KINDS[i as usize % 4]]);
        let ep = if o.rank == bad {
            null_mut()
        } else {
            refused[0].eo.ptr()
        };
        let st = symm_moe_combine(o.moe, ep, refused[0].y.ptr(), o.dev.s());
        let needle = if o.rank == bad {
            "expert_out is NULL".to_string()
        } else {
            format!("rank {bad} refused the combine")
        };
        expect(&o, st, INVALID, &[needle], &what);
        if o.rank != bad {
            assert!(
                refused[0].y.get().iter().all(|&b| b == 0),
                "rank {} {what}: y after the refused combine is not zeros",
                o.rank
            );
        }
        let kinds = [KINDS[(i as usize + 1) % 4], KINDS[(i as usize + 2) % 4]];
        let ps = prepare(&o, &d, &kinds);
        let sts = issue(&o, n, &ps);
        for (j, &st) in sts.iter().enumerate() {
            expect_ok(&o, st, &format!("{what}: retry {j}"));
        }
        check_all(&o, &c, &d, &ps, &format!("{what}: the retries"));
    }
    rounds
}
