//! Placement is a function of the call sequence only: two processes run the same random
//! sequence of malloc/free/pool calls with different random sleeps between calls (and one with
//! a busy second thread) and must produce identical offset traces.

use crate::common;
use common::*;
use std::ptr::null_mut;
use symmalloc::ffi::*;

fn trace(seed: u64, sleep_seed: u64) -> String {
    let mut rng = Rng::new(seed);
    let mut sleeper = Rng::new(sleep_seed);
    let base = symmalloc::heap::global().unwrap().heap(0).unwrap().base();
    let mut live: Vec<(u64, usize)> = Vec::new();
    let mut out = String::new();
    for step in 0..400 {
        if sleeper.below(4) == 0 {
            std::thread::sleep(std::time::Duration::from_micros(sleeper.below(2000)));
        }
        match rng.below(10) {
            0..=5 => {
                let cap = if rng.below(5) == 0 {
                    30 << 20
                } else {
                    200 << 10
                };
                let size = 1 + rng.below(cap) as usize;
                let stream = (rng.below(3) * 0x100) as *mut _;
                let p = symm_malloc(size, 0, stream) as u64;
                assert_ne!(p, 0);
                out += &format!("{step} malloc {size} -> {:#x}\n", p - base);
                live.push((p, size));
            }
            6..=8 if !live.is_empty() => {
                let (p, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
                symm_free(p as _, size, 0, (rng.below(3) * 0x100) as *mut _);
            }
            _ => {
                symm_begin_pool(0, 5, rng.below(2));
                let p = symm_malloc(4096, 0, null_mut()) as u64;
                out += &format!("{step} pool malloc -> {:#x}\n", p - base);
                symm_free(p as _, 4096, 0, null_mut());
                symm_end_pool(0, 5, 0);
                symm_end_pool(0, 5, 1);
            }
        }
    }
    out
}

#[test]
fn two_processes_same_sequence_same_offsets() {
    if let Some(c) = child() {
        // A second thread keeps the process busy in one child, to perturb timing further.
        if c.rank == 1 {
            std::thread::spawn(|| loop {
                std::hint::black_box((0..10_000u64).sum::<u64>());
            });
        }
        let (seed, sleep_seed): (u64, u64) = {
            let mut it = c.arg.split(',');
            (
                it.next().unwrap().parse().unwrap(),
                c.rank as u64 * 7919 + 1,
            )
        };
        let t = trace(seed, sleep_seed);
        std::fs::write(
            std::env::var("SYMM_TEST_OUT").unwrap() + &format!("/trace{}", c.rank),
            t,
        )
        .unwrap();
        return;
    }
    let dir = std::env::temp_dir().join(format!("symm-det-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let outs = run_ranks(
        "two_processes_same_sequence_same_offsets",
        2,
        &[
            ("SYMMALLOC_BACKEND", "host"),
            ("SYMM_TEST_OUT", dir.to_str().unwrap()),
        ],
        &format!("{},", seed()),
    );
    assert_all_ok(&outs);
    let a = std::fs::read_to_string(dir.join("trace0")).unwrap();
    let b = std::fs::read_to_string(dir.join("trace1")).unwrap();
    assert!(a.lines().count() > 100, "trace too short");
    assert!(
        a == b,
        "offset traces differ:\n{}",
        first_difference(&a, &b)
    );
}

fn first_difference(a: &str, b: &str) -> String {
    a.lines()
        .zip(b.lines())
        .find(|(x, y)| x != y)
        .map_or("(lengths differ)".into(), |(x, y)| format!("{x}\n{y}"))
}
