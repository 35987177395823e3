//! The split MoE API (docs/moe.md, "Split halves") on the host backend, one process per rank at
//! 2, 4 and 8 ranks, through the C ABI: the halves equal to the one-call forms bit for bit, with
//! a barrier, a sleep or a second object's micro-batch between them; repeated combines through
//! the halves; every out-of-order call refused on every rank (the object usable after); a send
//! one rank refuses; the clock probe. The scenarios: tests/common/moe/split.rs (tests/gpu_moe.rs
//! runs them on GPUs).

use crate::common;
use common::moe::split::*;
use common::moe::*;
use common::*;
use std::ptr::null_mut;
use symmalloc::ffi::moe_calls::*;

fn at_2_4_8(name: &str) {
    let seed = seed().to_string();
    for w in [2, 4, 8] {
        let t = std::time::Instant::now();
        let outs = run_ranks(name, w, &[HOST, SMALL_LL], &seed);
        assert_all_ok(&outs);
        assert_ran(&outs, name, 0);
        eprintln!("{name}: {w} ranks in {:.1} s", t.elapsed().as_secs_f64());
    }
}

#[test]
fn split_halves_match_the_one_call_forms_bit_for_bit() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let cases = split_matches_one_call(comm, dev, w, seed);
        destroy(comm);
        println!("rank {r}: {cases} cases the same bit for bit through the halves");
        return;
    }
    at_2_4_8("split_halves_match_the_one_call_forms_bit_for_bit");
}

/// Two-batch overlap (two objects' halves interleaved) and repeated combines through the halves;
/// twice per world, as a race shows in some runs only.
#[test]
fn interleaved_micro_batches_and_repeated_split_combines() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let rounds = two_batch_overlap(comm, dev, w, seed, 6);
        let made = split_repeated_combines(comm, dev, w, seed, 8);
        destroy(comm);
        println!("rank {r}: {rounds} overlapped rounds, {made} split combines correct");
        return;
    }
    for _ in 0..2 {
        at_2_4_8("interleaved_micro_batches_and_repeated_split_combines");
    }
}

#[test]
fn out_of_order_calls_are_refused_everywhere_and_the_object_stays_usable() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        split_misuse(comm, dev, w, seed);
        probe_words(comm, dev, w, seed);
        destroy(comm);
        println!("rank {r}: every misuse refused; the probe read in phase order");
        return;
    }
    at_2_4_8("out_of_order_calls_are_refused_everywhere_and_the_object_stays_usable");
}

/// Host backend only: a split combine after a failed dispatch is refused at its send half on
/// every rank (nothing pending after it), and the next split pair works.
#[test]
fn a_failed_split_dispatch_leaves_nothing_to_combine() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let o = create(comm, Shape::new(8, 64, 2, experts(w, 4), false), dev);
        let mut inp = rank_inputs(&o.s, &Case::new(seed, 8, 2, Route::Random), w, r);
        if r == 0 {
            inp.idx[0] = -3;
        }
        let st = stage(&o, &inp, 2, false);
        assert_eq!(dispatch_send(&o, &st.a), OK, "{}", err());
        let d = dispatch_recv(&o);
        expect(
            &o,
            d,
            INVALID,
            &["rank 0: topk_idx[0][0] = -3".into()],
            "bad",
        );
        let y = Buf::new(dev, 8 * 64 * 2);
        for _ in 0..2 {
            let st = symm_moe_combine_send(o.moe, y.ptr(), y.ptr(), null_mut());
            assert_eq!(st, INVALID, "rank {r}");
            assert!(err().contains("the last dispatch failed"), "{}", err());
            let st = symm_moe_combine_recv(o.moe, null_mut());
            assert!(
                st == INVALID && err().contains("no combine was sent"),
                "{}",
                err()
            );
        }
        for i in 0..3 {
            let c = Case::new(seed ^ i, 8 - i as usize, 2, Route::Holes);
            run_case(&o, &c, Expert::Scale, [0, 0]);
        }
        drop(o);
        destroy(comm);
        println!("rank {r}: split combine refused after the failed dispatch; 3 good pairs after");
        return;
    }
    at_2_4_8("a_failed_split_dispatch_leaves_nothing_to_combine");
}
