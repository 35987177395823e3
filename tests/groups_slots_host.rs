//! Split slots on the host backend, one process per rank (src/comm/group/slots.rs): a split carves
//! its children's internal blocks out of a slot of its parent's block (no segment made, none
//! mapped), falls back to the child's own block when no slot is free on every parent rank (all
//! taken, or one still held by a child on some rank), gives the slot back at destroy (a peer's
//! copy then reports the destroy), and a carved child outlives its parent. Also: with
//! `SYMMALLOC_SPLIT_SLOTS=0` every child makes its own block; and a split whose ranks bet on
//! different slots or arena offsets (split.rs) runs the rounds that decide them. Which way each
//! communicator was made is read from its `SYMMALLOC_DEBUG=INFO` line.

use crate::common;
use common::*;
use std::ptr::null_mut;
use symmalloc::ffi::groups::*;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

const INFO: (&str, &str) = ("SYMMALLOC_DEBUG", "INFO");

/// (rank, world size) in `comm`.
fn rank_world(comm: Comm) -> (usize, usize) {
    let mut i = symm_comm_info_t::default();
    ok(
        symm_comm_info(comm, &mut i, std::mem::size_of::<symm_comm_info_t>()),
        "symm_comm_info",
    );
    (i.rank as usize, i.world_size as usize)
}

/// (segments, peer mappings) of the device now.
fn footprint(device: i32) -> (u64, u64) {
    let s = stats(device);
    (s.segments, s.peer_mappings)
}

/// All-reduces (every algorithm) and an all-gather on `comm`, buffers from its arena, values
/// small integers (exact in fp32), checked; `label` names the communicator in failures.
fn exercise(comm: Comm, label: &str) {
    let (r, n) = rank_world(comm);
    for count in [1usize, 1031] {
        let bytes = count * 4;
        let a = symm_comm_malloc(comm, bytes, null_mut()) as *mut f32;
        let b = symm_comm_malloc(comm, bytes * n, null_mut()) as *mut f32;
        assert!(!a.is_null() && !b.is_null(), "{label}: {}", err());
        for algo in [
            SYMM_ALGO_AUTO,
            SYMM_ALGO_ONE_SHOT,
            SYMM_ALGO_TWO_SHOT,
            SYMM_ALGO_ONE_SHOT_LL,
        ] {
            // SAFETY: a holds count floats, b count * n, both live host memory.
            unsafe {
                for k in 0..count {
                    a.add(k).write((k % 7) as f32 + 1.0);
                    b.add(k).write(-1.0);
                }
            }
            let st = symm_all_reduce_algo(
                comm,
                algo,
                a as _,
                b as _,
                count,
                SYMM_FP32,
                SYMM_SUM,
                null_mut(),
            );
            ok(st, label);
            for k in 0..count {
                // SAFETY: as above.
                let got = unsafe { b.add(k).read() };
                let want = ((k % 7) as f32 + 1.0) * n as f32;
                assert_eq!(got, want, "{label}: all-reduce algo {algo} element {k}");
            }
        }
        // SAFETY: as above.
        unsafe {
            for k in 0..count {
                a.add(k).write((r * 1000 + k % 13) as f32);
            }
        }
        ok(
            symm_all_gather(comm, a as _, b as _, count, SYMM_FP32, null_mut()),
            label,
        );
        for q in 0..n {
            for k in 0..count {
                // SAFETY: as above.
                let got = unsafe { b.add(q * count + k).read() };
                let want = (q * 1000 + k % 13) as f32;
                assert_eq!(got, want, "{label}: all-gather rank {q} element {k}");
            }
        }
        symm_comm_free(comm, a as _, bytes, null_mut());
        symm_comm_free(comm, b as _, bytes * n, null_mut());
        assert!(err().is_empty(), "{label}: symm_comm_free: {}", err());
    }
    ok(symm_barrier(comm, null_mut()), label);
}

fn carve_rank(c: Child) {
    // The heap (and its release log's descriptor) exists before the first count.
    let p = symm_malloc(4096, c.device, null_mut());
    symm_free(p, 4096, c.device, null_mut());
    let start = (open_fds(), footprint(c.device));
    let world = init(&c);
    let base = footprint(c.device);
    // The world's one slot (SYMMALLOC_SPLIT_SLOTS=1) is free on every rank: the child's
    // internal block is carved from it, no segment made, none mapped.
    let a = split(world, c.rank / 2, c.rank);
    assert_eq!(
        footprint(c.device),
        base,
        "a carved child made or mapped memory"
    );
    // The slot is held: the next split makes its own blocks, as every child did before slots.
    let b = split(world, c.rank % 2, c.rank);
    let fallback = footprint(c.device);
    assert!(
        fallback.0 > base.0 && fallback.1 > base.1,
        "a child without a slot made no block: {base:?} then {fallback:?}"
    );
    exercise(a, "carved");
    exercise(b, "own block, slots exhausted");
    destroy(b);
    // Rank 0 destroys its carved child; its pair's copy on rank 1 sees it and refuses.
    if c.rank == 0 {
        destroy(a);
    }
    ok(symm_barrier(world, null_mut()), "barrier");
    if c.rank == 1 {
        let st = symm_barrier(a, null_mut());
        assert_eq!(st, symm_status_t::SYMM_ERR_PEER, "{}", err());
        assert!(
            err().contains("rank 0 destroyed its communicator"),
            "{}",
            err()
        );
    }
    // The slot is free on rank 0 only: not on every rank, so the split falls back.
    let before = footprint(c.device);
    let d = split(world, 0, c.rank);
    assert!(
        footprint(c.device).0 > before.0,
        "a slot still held on other ranks was carved again"
    );
    exercise(d, "own block, slot held on some ranks");
    destroy(d);
    if c.rank != 0 {
        destroy(a);
    }
    // Free on every rank again: carved again.
    let before = footprint(c.device);
    let e = split(world, c.rank / 2, -c.rank);
    assert_eq!(
        footprint(c.device),
        before,
        "the freed slot was not carved again"
    );
    // The child outlives its parent: the block stays for it.
    destroy(world);
    exercise(e, "carved child without its parent");
    // A carved child has no slots: its own child makes its own block.
    let grand = split(e, 0, 0);
    exercise(grand, "a carved child's child");
    destroy(grand);
    destroy(e);
    // Everything went: descriptors, segments and mappings as before the world.
    let end = (open_fds(), footprint(c.device));
    assert!(
        end == start,
        "(fds, (segments, peer mappings)) before {start:?}, after {end:?}"
    );
}

/// The creation lines of a rank's `SYMMALLOC_DEBUG=INFO` output.
fn creations(stderr: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(stderr)
        .lines()
        .filter(|l| l.contains("arena claimed in"))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_split_carves_its_child_from_a_free_slot_else_makes_its_own_block() {
    if let Some(c) = child() {
        return carve_rank(c);
    }
    let outs = run_ranks(
        "a_split_carves_its_child_from_a_free_slot_else_makes_its_own_block",
        4,
        &[HOST, SMALL_LL, INFO, ("SYMMALLOC_SPLIT_SLOTS", "1")],
        "",
    );
    assert_all_ok(&outs);
    // The world reserved its slot, two children were carved from it, three made their own.
    for (r, o) in outs.iter().enumerate() {
        let made = creations(&o.stderr);
        let count = |what: &str| made.iter().filter(|l| l.contains(what)).count();
        assert_eq!(made.len(), 6, "rank {r}: {made:#?}");
        assert_eq!(count("with 1 split slot(s) of"), 1, "rank {r}: {made:#?}");
        assert_eq!(
            count("carved from split slot 0 of its parent's"),
            2,
            "rank {r}: {made:#?}"
        );
        assert_eq!(count("internal block made in"), 3, "rank {r}: {made:#?}");
        // Both carved children were readied by their ranks' bets (split.rs), no round of
        // their own.
        assert_eq!(
            count("readied before the split's first round (no new memory, no round)"),
            2,
            "rank {r}: {made:#?}"
        );
    }
}

fn no_slots_rank(c: Child) {
    let world = init(&c);
    let base = footprint(c.device);
    let a = split(world, c.rank / 2, c.rank);
    assert!(footprint(c.device).0 > base.0, "a child made no block");
    exercise(a, "own block, no slots");
    destroy(a);
    destroy(world);
}

#[test]
fn without_split_slots_every_child_makes_its_own_block() {
    if let Some(c) = child() {
        return no_slots_rank(c);
    }
    let outs = run_ranks(
        "without_split_slots_every_child_makes_its_own_block",
        2,
        &[HOST, SMALL_LL, INFO, ("SYMMALLOC_SPLIT_SLOTS", "0")],
        "",
    );
    assert_all_ok(&outs);
    for (r, o) in outs.iter().enumerate() {
        let made = creations(&o.stderr);
        assert!(
            made.len() == 2 && made.iter().all(|l| l.contains("internal block made in")),
            "rank {r}: {made:#?}"
        );
    }
}

/// Rank 0 destroys its copy of a carved child that rank 1 keeps: rank 0 then has that child's
/// slot and the top of its heap (the child's arena) free, rank 1 not. A split now finds the two
/// ranks bet on different slots and arena offsets (split.rs, the bet): what they bet goes back,
/// the claim round and the carve round decide, and the child, carved from the slot free on
/// both, works.
fn unlike_rank(c: Child) {
    let world = init(&c);
    let x = split(world, 0, c.rank);
    if c.rank == 0 {
        destroy(x);
    }
    ok(symm_barrier(world, null_mut()), "barrier");
    let before = footprint(c.device);
    let y = split(world, 0, c.rank);
    assert_eq!(
        footprint(c.device),
        before,
        "carved: no memory made or mapped"
    );
    exercise(y, "bets unlike, rounds run");
    destroy(y);
    if c.rank != 0 {
        destroy(x);
    }
    // Alike again: the next child is made from the bets alone.
    let z = split(world, 0, c.rank);
    exercise(z, "bets alike again");
    destroy(z);
    destroy(world);
}

#[test]
fn a_split_whose_ranks_bet_unlike_runs_its_rounds() {
    if let Some(c) = child() {
        return unlike_rank(c);
    }
    let outs = run_ranks(
        "a_split_whose_ranks_bet_unlike_runs_its_rounds",
        2,
        &[HOST, SMALL_LL, INFO, ("SYMMALLOC_SPLIT_SLOTS", "2")],
        "",
    );
    assert_all_ok(&outs);
    for (r, o) in outs.iter().enumerate() {
        let made = creations(&o.stderr);
        assert_eq!(made.len(), 4, "rank {r}: {made:#?}");
        let bet = |l: &String| {
            l.contains("(before the split's first round)")
                && l.contains("readied before the split's first round")
        };
        assert!(bet(&made[1]), "rank {r}, x: {}", made[1]);
        assert!(
            !made[2].contains("before the split's first round")
                && made[2].contains("carved from split slot 1 of its parent's (no new memory)"),
            "rank {r}, y: {}",
            made[2]
        );
        assert!(bet(&made[3]), "rank {r}, z: {}", made[3]);
    }
}
