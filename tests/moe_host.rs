//! MoE dispatch and combine (docs/moe.md) on the host backend, one process per rank at 2, 4 and
//! 8 ranks, through the C ABI (`symm_moe_*`): against every rank's inputs regenerated from the
//! seeds (the receive buffers exactly; y bit for bit against the contract's fixed-order fp32
//! sum and within bf16 rounding of the float64 one), over shapes, routings, token counts and
//! index types; many epochs of changing routing; arrival order; a split child as the EP group;
//! every error (naming the rank and the value, the object usable after); bad and mismatched
//! create arguments; a dead peer; repeated combines of one dispatch and a refused combine
//! retried. The scenarios: tests/common/moe/ (tests/gpu_moe.rs
//! runs them on GPUs).

use crate::common;
use common::moe::cases::*;
use common::moe::edges::*;
use common::moe::errors::*;
use common::moe::quant::*;
use common::moe::repeat::*;
use common::moe::*;
use common::*;
use std::ptr::null_mut;
use symmalloc::ffi::moe_calls::*;

/// Runs `name` at 2, 4 and 8 ranks on the host backend with the same seed; returns the outputs.
fn at_2_4_8(name: &str, env: &[(&str, &str)]) -> Vec<Vec<std::process::Output>> {
    let seed = seed().to_string();
    let mut all = Vec::new();
    for w in [2, 4, 8] {
        let t = std::time::Instant::now();
        let mut e = vec![HOST, SMALL_LL];
        e.extend_from_slice(env);
        let outs = run_ranks(name, w, &e, &seed);
        assert_all_ok(&outs);
        assert_ran(&outs, name, name.contains("dead_peer") as usize);
        eprintln!("{name}: {w} ranks in {:.1} s", t.elapsed().as_secs_f64());
        all.push(outs);
    }
    all
}

#[test]
fn dispatch_and_combine_match_the_reference_at_2_4_8_ranks() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let (cases, hash) = sweep(comm, dev, w, seed);
        destroy(comm);
        println!("rank {r}: outputs hash {hash:016x}; {cases} cases correct");
        return;
    }
    for outs in at_2_4_8(
        "dispatch_and_combine_match_the_reference_at_2_4_8_ranks",
        &[],
    ) {
        // The case where every rank passes the same inputs: the same y on every rank.
        assert_same_output_hash(&outs);
    }
}

#[test]
fn routing_changing_every_call_for_many_epochs() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let calls = epochs(comm, dev, w, seed, 48);
        destroy(comm);
        println!("rank {r}: {calls} calls correct");
        return;
    }
    at_2_4_8("routing_changing_every_call_for_many_epochs", &[]);
}

#[test]
fn results_do_not_depend_on_arrival_order_and_a_split_child_works() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let cases = arrival(comm, dev, w, seed);
        split_child(comm, dev, w, r, seed);
        destroy(comm);
        println!("rank {r}: {cases} cases the same bit for bit in two arrival orders");
        return;
    }
    at_2_4_8(
        "results_do_not_depend_on_arrival_order_and_a_split_child_works",
        &[],
    );
}

#[test]
fn every_error_names_the_rank_and_the_value_and_leaves_the_object_usable() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        errors(comm, dev, w, seed);
        create_errors(comm, dev, w, r, seed);
        destroy(comm);
        println!("rank {r}: every error reported as expected");
        return;
    }
    at_2_4_8(
        "every_error_names_the_rank_and_the_value_and_leaves_the_object_usable",
        &[],
    );
}

/// Several combines of one dispatch back to back, each y its own (docs/moe.md, "Repeated
/// combines"); the whole run three times per world, as a race shows in some runs only.
#[test]
fn repeated_combines_of_one_dispatch_each_give_their_own_result() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let made = repeated_combines(comm, dev, w, seed, 12);
        destroy(comm);
        println!("rank {r}: {made} combines correct");
        return;
    }
    for _ in 0..3 {
        at_2_4_8(
            "repeated_combines_of_one_dispatch_each_give_their_own_result",
            &[],
        );
    }
}

/// A combine one rank refuses, then retried at once: every other rank names the refusing rank,
/// then the retry succeeds everywhere; three runs per world.
#[test]
fn a_refused_combine_names_the_rank_everywhere_and_a_retry_succeeds() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let rounds = refused_combine_retried(comm, dev, w, seed, 12);
        destroy(comm);
        println!("rank {r}: {rounds} refused combines named and retried");
        return;
    }
    for _ in 0..3 {
        at_2_4_8(
            "a_refused_combine_names_the_rank_everywhere_and_a_retry_succeeds",
            &[],
        );
    }
}

/// The one-wait protocol's edges and `num_sms` (tests/common/moe/edges.rs): grids of 1 and 3
/// blocks, one expert receiving every row, zero tokens, dispatches back to back before one
/// combine, a version 1 config struct, a nonzero reserved word, mismatched `num_sms`.
#[test]
fn protocol_edges_and_num_sms_at_2_4_8_ranks() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let cases = edges(comm, dev, w, seed);
        destroy(comm);
        println!("rank {r}: {cases} edge cases correct");
        return;
    }
    at_2_4_8("protocol_edges_and_num_sms_at_2_4_8_ranks", &[]);
}

/// Host backend only: a combine after a dispatch that failed is refused on every rank (the
/// kernels keep their own word), and one rank's combine refusal does not stop the next call.
#[test]
fn a_failed_dispatch_leaves_nothing_to_combine_and_the_next_pair_works() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let o = create(comm, Shape::new(8, 64, 2, experts(w, 4), false), dev);
        let mut inp = rank_inputs(&o.s, &Case::new(seed, 8, 2, Route::Random), w, r);
        if r == 0 {
            inp.idx[0] = -3;
        }
        let st = stage(&o, &inp, 2, false);
        let d = dispatch(&o, &st.a);
        expect(
            &o,
            d,
            INVALID,
            &["rank 0: topk_idx[0][0] = -3".into()],
            "bad",
        );
        let y = Buf::new(dev, 8 * 64 * 2);
        for _ in 0..2 {
            let st = symm_moe_combine(o.moe, y.ptr(), y.ptr(), null_mut());
            assert_eq!(st, INVALID, "rank {r}");
            assert!(err().contains("the last dispatch failed"), "{}", err());
        }
        for i in 0..4 {
            let c = Case::new(seed ^ i, 8 - i as usize, 2, Route::Holes);
            run_case(&o, &c, Expert::Scale, [0, 0]);
        }
        drop(o);
        destroy(comm);
        println!("rank {r}: combine refused after the failed dispatch; 4 good pairs after");
        return;
    }
    at_2_4_8(
        "a_failed_dispatch_leaves_nothing_to_combine_and_the_next_pair_works",
        &[],
    );
}

/// FP8 quantized inside the dispatch (tests/common/moe/quant.rs): bf16 x to e4m3 rows and fp32
/// scales, row-major and column-major TMA-aligned, with and without UE8M0, against the float64
/// reference and the kernels' arithmetic bit for bit; the pre-quantized path in the
/// column-major layout; the new fields' refusals. At 1 rank too (the quantizing dispatch then
/// stages its own rows).
#[test]
fn fp8_quantized_in_the_dispatch_matches_the_float64_reference_in_every_layout() {
    const NAME: &str =
        "fp8_quantized_in_the_dispatch_matches_the_float64_reference_in_every_layout";
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let (rows, steps) = quantized(comm, dev, w, seed);
        quant_errors(comm, dev, w, r, seed);
        destroy(comm);
        println!("rank {r}: {rows} quantized rows exact ({steps} bytes one step from float64 at a midpoint)");
        return;
    }
    let mut all = vec![run_ranks(NAME, 1, &[HOST, SMALL_LL], &seed().to_string())];
    assert_all_ok(&all[0]);
    assert_ran(&all[0], NAME, 0);
    all.extend(at_2_4_8(NAME, &[]));
    for o in all.iter().flatten() {
        let out = String::from_utf8_lossy(&o.stdout);
        for l in out.lines().filter_map(|l| l.find("rank ").map(|i| &l[i..])) {
            eprintln!("{l}");
        }
    }
}

#[test]
fn a_dead_peer_times_out_naming_it() {
    if let Some(c) = child() {
        let (comm, dev, w, _, seed) = rank_setup(&c, Dev::host);
        dead_peer(comm, dev, w, seed, 1.0);
        destroy(comm);
        return;
    }
    let outs = at_2_4_8(
        "a_dead_peer_times_out_naming_it",
        &[("SYMMALLOC_TIMEOUT_S", "1")],
    );
    for o in &outs {
        let named = o
            .iter()
            .filter(|o| String::from_utf8_lossy(&o.stdout).contains("the dead peer was named"))
            .count();
        assert_eq!(named, o.len() - 1, "every live rank names the dead one");
    }
}
