//! Frees on another thread (host backend, no GPU): PyTorch's backward frees on autograd's
//! thread what the forward allocated on the main thread, a path `alloc_bench`'s same-thread
//! pairs never take. Per size: 48 blocks allocated on this thread, then freed on this thread or
//! handed to a second thread that frees them (`free_block`, PyTorch's raw_delete), 3,000 rounds
//! after 50 of warm-up; µs per block, p50 / p99 over rounds (each round's mean of 48), the
//! freeing thread timing its own loop so the handoff is not counted.
//!
//!     cargo run --release --example xthread_bench
//!
//! bench/NOTES.md, "Global mode: the bimodal step", has the figures and what they are for.

use std::sync::mpsc;
use std::time::Instant;
use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::Allocator;

const N: usize = 48;
const ROUNDS: usize = 3000;
const WARM: usize = 50;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn row(name: &str, size: u64, mut m: Vec<f64>, mut f: Vec<f64>) {
    let us = 1e6 / N as f64;
    println!(
        "{size:>8} | {name:<13} | {:>6.3} / {:>6.3} | {:>6.3} / {:>6.3}",
        pct(&mut m, 0.5) * us,
        pct(&mut m, 0.99) * us,
        pct(&mut f, 0.5) * us,
        pct(&mut f, 0.99) * us
    );
}

/// N blocks of `size` from this thread: the blocks, and the seconds it took.
fn alloc_round(a: &Allocator, size: u64) -> (Vec<u64>, f64) {
    let t = Instant::now();
    let v = (0..N)
        .map(|_| a.malloc(size, 0, 0).expect("malloc"))
        .collect();
    (v, t.elapsed().as_secs_f64())
}

/// Frees `v` on the calling thread: the seconds it took.
fn free_all(a: &Allocator, v: Vec<u64>) -> f64 {
    let t = Instant::now();
    for p in v {
        a.free_block(p).expect("free");
    }
    t.elapsed().as_secs_f64()
}

/// ROUNDS timed (malloc, free) rounds of `round` after WARM untimed ones.
fn timed(mut round: impl FnMut() -> (f64, f64)) -> (Vec<f64>, Vec<f64>) {
    (0..WARM).for_each(|_| {
        round();
    });
    (0..ROUNDS).map(|_| round()).unzip()
}

fn main() {
    let a: &'static Allocator = Box::leak(Box::new(
        Allocator::new(Box::new(HostBackend)).expect("host backend"),
    ));
    println!("   bytes | free on      | malloc p50 / p99 us | free p50 / p99 us");
    for size in [512u64, 64 << 10, 1 << 20, 8 << 20] {
        let (m, f) = timed(|| {
            let (v, took) = alloc_round(a, size);
            (took, free_all(a, v))
        });
        row("same thread", size, m, f);
        let (tx, rx) = mpsc::channel::<Vec<u64>>();
        let (done_tx, done_rx) = mpsc::channel::<f64>();
        let worker = std::thread::spawn(move || {
            for v in rx {
                done_tx.send(free_all(a, v)).expect("send");
            }
        });
        let (m, f) = timed(|| {
            let (v, took) = alloc_round(a, size);
            tx.send(v).expect("send");
            (took, done_rx.recv().expect("recv"))
        });
        drop(tx);
        worker.join().expect("worker");
        row("other thread", size, m, f);
    }
}
