//! MoE dispatch and combine in throughput mode (docs/moe.md, "Throughput mode") on the host
//! backend, one process per rank at 1, 2, 4 and 8 ranks, through the C ABI: the receive buffers
//! exactly and y bit for bit against every rank's inputs regenerated from the seed (and within
//! bf16 rounding of a float64 sum), uniform and skewed routings (every token to one rank,
//! several experts of one rank per token), the same y on every rank and run, repeated
//! combines, every error on every rank with the object usable after, create's checks of the
//! mode, the clock probe. The scenarios: tests/common/moe/tp.rs and tp_errors.rs.

use crate::common;
use common::moe::tp::*;
use common::moe::tp_errors::*;
use common::moe::*;
use common::*;

/// Runs `name` at 1, 2, 4 and 8 ranks on the host backend with the same seed; returns the
/// outputs.
fn at_2_4_8(name: &str) -> Vec<Vec<std::process::Output>> {
    let seed = seed().to_string();
    let mut all = Vec::new();
    for w in [1, 2, 4, 8] {
        let t = std::time::Instant::now();
        let outs = run_ranks(name, w, &[HOST, SMALL_LL], &seed);
        assert_all_ok(&outs);
        assert_ran(&outs, name, 0);
        eprintln!("{name}: {w} ranks in {:.1} s", t.elapsed().as_secs_f64());
        all.push(outs);
    }
    all
}

#[test]
fn throughput_dispatch_and_combine_match_the_reference_at_2_4_8_ranks() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let (cases, hash) = tp_sweep(comm, dev, w, seed);
        let grids = tp_grids(comm, dev, w, seed);
        destroy(comm);
        println!(
            "rank {r}: outputs hash {hash:016x}; {cases} cases and {grids} on set grids correct"
        );
        return;
    }
    for outs in at_2_4_8("throughput_dispatch_and_combine_match_the_reference_at_2_4_8_ranks") {
        assert_same_output_hash(&outs);
    }
}

/// Three runs per world: a race between a combine's staging and a peer's reads of the
/// previous one shows in some runs only.
#[test]
fn throughput_repeated_combines_each_give_their_own_result() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let made = tp_repeated(comm, dev, w, seed, 8);
        destroy(comm);
        println!("rank {r}: {made} dispatches and combines correct");
        return;
    }
    for _ in 0..3 {
        at_2_4_8("throughput_repeated_combines_each_give_their_own_result");
    }
}

/// FP8 options (tests/common/moe/tp_quant.rs): bf16 x quantized in the dispatch, row-major and
/// column-major scales, UE8M0; the caller's FP8 with column-major scales; `x_scales` refused on
/// a quantizing object.
#[test]
fn throughput_fp8_quantized_in_the_dispatch_and_column_major_scales() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let (rows, steps) = common::moe::tp_quant::tp_quantized(comm, dev, w, seed);
        common::moe::tp_quant::tp_quant_errors(comm, dev, w, seed);
        destroy(comm);
        println!("rank {r}: {rows} rows exact ({steps} bytes one step from float64 at a midpoint)");
        return;
    }
    at_2_4_8("throughput_fp8_quantized_in_the_dispatch_and_column_major_scales");
}

/// The split halves (tests/common/moe/tp_split.rs): the same results as the one-call forms with
/// work between the halves, two objects interleaved, repeated combines, misuse.
#[test]
fn throughput_split_halves_match_the_one_call_forms() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        let cases = common::moe::tp_split::tp_split_matches_one_call(comm, dev, w, seed);
        let made = common::moe::tp_split::tp_two_batch_overlap(comm, dev, w, seed, 4);
        common::moe::tp_split::tp_split_misuse(comm, dev, w, seed);
        destroy(comm);
        println!("rank {r}: {cases} split cases and {made} interleaved calls correct");
        return;
    }
    at_2_4_8("throughput_split_halves_match_the_one_call_forms");
}

#[test]
fn throughput_errors_name_the_rank_everywhere_and_leave_the_object_usable() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        tp_errors(comm, dev, w, seed);
        tp_create_errors(comm, dev, w, r);
        destroy(comm);
        println!("rank {r}: every error reported as expected");
        return;
    }
    at_2_4_8("throughput_errors_name_the_rank_everywhere_and_leave_the_object_usable");
}

#[test]
fn throughput_a_dead_peer_times_out_naming_it() {
    if let Some(c) = child() {
        let (comm, dev, w, _, seed) = rank_setup(&c, Dev::host);
        tp_dead_peer(comm, dev, w, seed, 1.0);
        destroy(comm);
        return;
    }
    let name = "throughput_a_dead_peer_times_out_naming_it";
    let seed = seed().to_string();
    for w in [2, 4] {
        let outs = run_ranks(
            name,
            w,
            &[HOST, SMALL_LL, ("SYMMALLOC_TIMEOUT_S", "1")],
            &seed,
        );
        assert_all_ok(&outs);
        assert_ran(&outs, name, 1);
        let named = outs
            .iter()
            .filter(|o| String::from_utf8_lossy(&o.stdout).contains("the dead peer was named"))
            .count();
        assert_eq!(named, w as usize - 1, "every live rank names the dead one");
    }
}

#[test]
fn throughput_clock_probe_records_the_phases_in_order() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::host);
        tp_probe_words(comm, dev, w, seed);
        destroy(comm);
        println!("rank {r}: the probe read in phase order");
        return;
    }
    at_2_4_8("throughput_clock_probe_records_the_phases_in_order");
}
