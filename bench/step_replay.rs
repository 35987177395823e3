//! A training step's allocations and frees, replayed on host memory with their threads (no
//! GPU): the sequence symmalloc's C++ allocator recorded on the device
//! (`bench/step_probe.py global --ext-profile --ext-trace FILE`, a build of the C++ allocator
//! with -DSYMM_TORCH_PROFILE: CSV `t_ns,dur_ns,inner_ns,tid,op,ptr,size,stream`), run again
//! through the heap's own calls (`malloc` on the recorded stream, `free_block`) in the recorded
//! order, each on a thread of its own standing for the recorded one (PyTorch's main thread and
//! autograd's), so the thread caches and the frees on another thread take the paths they took.
//!
//!     cargo run --release --example step_replay -- FILE [--reps 30] [--one-thread]
//!
//! Every thread walks the sequence and runs its own events when the one before has finished
//! (spinning between: the interleaving is the recorded one); a thread times its own call only,
//! so the handoff is not counted. The threads live through every repetition, as the process's
//! do through its steps. A free of a block allocated before the recording began is skipped;
//! blocks still live at the end of a repetition are freed then, untimed, so every repetition
//! starts from the same heap. Prints per recorded thread and call: calls and µs per repetition
//! (one repetition is the whole recording), `device us` (the same calls' time inside
//! libsymmalloc on the device, from the recording: the figure to compare with µs per
//! repetition), and mean, p50, p99 and max µs per call, over every repetition but the first.
//! `--one-thread` runs every call on one thread (no cross-thread frees, no spinning: for
//! `perf stat -e instructions:u` where the machine has counters, which then counts the heap's
//! work and the parsing alone). Then the heap's reserved memory and segments at the end, and
//! its peak allocated memory. bench/NOTES.md, "Global mode's host cost: the allocator's share",
//! has the figures and what they are for.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;
use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::Allocator;

struct Event {
    tid: i64,
    alloc: bool,
    ptr: u64,
    size: u64,
    stream: u64,
    device_ns: u64,
}

fn parse(text: &str) -> Vec<Event> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        assert!(
            f.len() == 8,
            "line {}: expected 8 fields, got {line:?}",
            i + 1
        );
        let num = |k: usize| -> u64 {
            f[k].parse()
                .unwrap_or_else(|_| panic!("line {}: field {k} {:?}", i + 1, f[k]))
        };
        out.push(Event {
            tid: f[3].parse().expect("tid"),
            alloc: f[4] == "a",
            ptr: num(5),
            size: num(6),
            stream: num(7),
            device_ns: num(2),
        });
    }
    out
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let file = args
        .get(1)
        .filter(|a| !a.starts_with("--"))
        .expect("usage: step_replay FILE [--reps N]");
    let reps: usize = args
        .iter()
        .position(|a| a == "--reps")
        .map(|i| args[i + 1].parse().expect("--reps N"))
        .unwrap_or(30);
    let mut events = parse(&std::fs::read_to_string(file).expect("read the trace"));
    if args.iter().any(|a| a == "--one-thread") {
        // Every call on one thread: no spinning, so `perf stat` counts the heap's work.
        events.iter_mut().for_each(|e| e.tid = 0);
    }
    let mut tids: Vec<i64> = events.iter().map(|e| e.tid).collect();
    tids.sort_unstable();
    tids.dedup();
    let a = Allocator::new(Box::new(HostBackend)).expect("host heap");
    // The allocation each free frees (None: allocated before the recording began).
    let mut at: HashMap<u64, usize> = HashMap::new();
    let mut alloc_of = vec![None; events.len()];
    for (i, e) in events.iter().enumerate() {
        if e.alloc {
            at.insert(e.ptr, i);
        } else {
            alloc_of[i] = at.remove(&e.ptr);
        }
    }
    let left: Vec<usize> = at.into_values().collect(); // live at the end of a repetition
                                                       // One thread per recorded thread, all walking the sequence: each runs its own events once
                                                       // `next` reaches them (spinning between), timing the call alone.
    let next = AtomicUsize::new(0);
    let addr: Vec<AtomicU64> = (0..events.len()).map(|_| AtomicU64::new(0)).collect();
    let n = events.len() + 1; // the events, then the end of a repetition (the first thread's)
    let per: Vec<Vec<(bool, f64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = tids
            .iter()
            .map(|&tid| {
                let (a, next, addr, events, alloc_of, left) =
                    (&a, &next, &addr, &events, &alloc_of, &left);
                let first = tid == tids[0];
                s.spawn(move || {
                    let mut mine = Vec::new();
                    for rep in 0..reps {
                        let wait = |i: usize| {
                            while next.load(Ordering::Acquire) != rep * n + i {
                                std::hint::spin_loop();
                            }
                        };
                        for (i, e) in events.iter().enumerate() {
                            if e.tid != tid {
                                continue;
                            }
                            wait(i);
                            if e.alloc {
                                let t = Instant::now();
                                let p = a.malloc(e.size, 0, e.stream).expect("malloc");
                                let s = t.elapsed().as_secs_f64();
                                if rep > 0 {
                                    mine.push((true, s));
                                }
                                addr[i].store(p, Ordering::Relaxed);
                            } else if let Some(j) = alloc_of[i] {
                                let p = addr[j].load(Ordering::Relaxed);
                                let t = Instant::now();
                                a.free_block(p).expect("free");
                                let s = t.elapsed().as_secs_f64();
                                if rep > 0 {
                                    mine.push((false, s));
                                }
                            }
                            next.store(rep * n + i + 1, Ordering::Release);
                        }
                        if first {
                            wait(n - 1);
                            for &j in left.iter() {
                                a.free_block(addr[j].load(Ordering::Relaxed))
                                    .expect("free what the recording left live");
                            }
                            next.store((rep + 1) * n, Ordering::Release);
                        }
                    }
                    mine
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("replay thread"))
            .collect()
    });
    // (tid, alloc) -> seconds per call, over the timed repetitions.
    let mut times: HashMap<(i64, bool), Vec<f64>> = HashMap::new();
    for (k, &tid) in tids.iter().enumerate() {
        for &(alloc, s) in &per[k] {
            times.entry((tid, alloc)).or_default().push(s);
        }
    }
    let timed = (reps - 1).max(1) as f64;
    let st = a.stats(0).expect("stats");
    println!(
        "{} events, {} threads, {reps} repetitions (the first untimed); the heap at the end: \
         {:.1} MiB reserved, {} segments, peak allocated {:.1} MiB; segments made {}, given \
         back {}\n",
        events.len(),
        tids.len(),
        st.reserved_bytes as f64 / 1048576.0,
        st.segments,
        st.peak_allocated_bytes as f64 / 1048576.0,
        st.physical_creates,
        st.physical_releases
    );
    println!(
        "thread   | call  | calls/rep | us/rep  | device us | mean us | p50 us | p99 us | max us"
    );
    for &tid in &tids {
        for alloc in [true, false] {
            let Some(v) = times.get_mut(&(tid, alloc)) else {
                continue;
            };
            let device_us: f64 = events
                .iter()
                .filter(|e| e.tid == tid && e.alloc == alloc)
                .map(|e| e.device_ns as f64 / 1e3)
                .sum();
            let total: f64 = v.iter().sum();
            let n = v.len() as f64;
            let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
            println!(
                "{tid:<8} | {:<5} | {:>9.0} | {:>7.1} | {:>9.1} | {:>7.3} | {:>6.3} | {:>6.3} | {:>6.1}",
                if alloc { "alloc" } else { "free" },
                n / timed,
                total * 1e6 / timed,
                device_us,
                total * 1e6 / n,
                p50 * 1e6,
                p99 * 1e6,
                v.last().copied().unwrap_or(0.0) * 1e6
            );
        }
    }
}
