//! Signals, waits and puts (`symm_signal`, `symm_wait`, `symm_put`): what each mechanism costs,
//! to choose between a one-thread kernel and stream memory operations (bench/NOTES.md, "Signals
//! and waits"). Starts one process per rank itself; `SYMM_BENCH_WORLD=1` (default with one GPU)
//! or `2` (with `SYMMALLOC_SHARED_GPU=1` the two ranks share one GPU).
//!
//! Tables (rank 0 prints them; us, median over repetitions of the mean over back-to-back rounds,
//! timed with CUDA events on rank 0's stream after a host-synchronized start):
//! 1. a round: at 1 rank, signal self then wait for it; at 2 ranks, a ping-pong (rank 0 signals
//!    rank 1 and waits for its answer; rank 1 waits, then answers); eager and graphed (the rounds
//!    in one graph, values baked in, a fresh slot pair per repetition), for each pair of
//!    mechanisms: signal by kernel or by stream write, wait by the bounded kernel or by
//!    cuStreamWaitValue64 (unbounded, measured for comparison only);
//! 2. the host's enqueue cost of each call (ns, wall clock over 2000 calls, waits already
//!    satisfied);
//! 3. a put of 8 B to 64 MiB into the peer (self at 1 rank): us per put and GB/s.
//!
//! Run: cargo run --release --example p2p_bench

use std::process::Command;
use std::time::Instant;
use symmalloc::comm::signal_pad::{SignalVia, WaitVia};
use symmalloc::comm::Communicator;
use symmalloc::cuda::{self, util};
use symmalloc::ipc::UniqueId;

/// Rounds per timing and timings per figure (fewer at 2 ranks sharing a GPU, where a round trip
/// is two time slices).
fn k_reps(world: usize) -> (usize, usize) {
    if world == 1 {
        (100, 10)
    } else {
        (20, 5)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 5 && args[1] == "--child" {
        return child(args[2].parse().unwrap(), args[3].parse().unwrap(), &args[4]);
    }
    let gpus = cuda::driver()
        .unwrap_or_else(|e| {
            eprintln!("p2p_bench needs a GPU: {}", e.message);
            std::process::exit(1)
        })
        .devices
        .len();
    let world: usize = std::env::var("SYMM_BENCH_WORLD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if gpus >= 2 { 2 } else { 1 });
    assert!((1..=2).contains(&world), "SYMM_BENCH_WORLD: 1 or 2");
    let hex: String = UniqueId::generate()
        .unwrap()
        .to_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let exe = std::env::current_exe().unwrap();
    let kids: Vec<_> = (0..world)
        .map(|r| {
            Command::new(&exe)
                .args(["--child", &r.to_string(), &world.to_string(), &hex])
                .spawn()
                .unwrap()
        })
        .collect();
    let good = kids
        .into_iter()
        .all(|mut k| k.wait().map(|s| s.success()).unwrap_or(false));
    std::process::exit(if good { 0 } else { 1 });
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

struct Rank {
    comm: Box<Communicator>,
    rank: usize,
    world: usize,
    device: i32,
    stream: u64,
    timer: util::Timer,
    /// The next fresh slot pair.
    slot: u32,
}

impl Rank {
    /// Every rank's stream idle and every rank here.
    fn sync(&mut self) {
        util::stream_sync(self.device, self.stream).unwrap();
        self.comm.barrier(self.stream).unwrap();
        util::stream_sync(self.device, self.stream).unwrap();
    }

    /// One round of the table's pattern with value `v` on slots (a, b).
    fn round(&mut self, sig: SignalVia, wait: WaitVia, a: u32, b: u32, v: u64) {
        let s = self.stream;
        let c = &mut self.comm;
        if self.world == 1 {
            c.signal_via(sig, 0, a, v, s).unwrap();
            c.wait_via(wait, a, v, s).unwrap();
        } else if self.rank == 0 {
            c.signal_via(sig, 1, a, v, s).unwrap();
            c.wait_via(wait, b, v, s).unwrap();
        } else {
            c.wait_via(wait, a, v, s).unwrap();
            c.signal_via(sig, 0, b, v, s).unwrap();
        }
    }

    /// us per round, eager and graphed.
    fn rounds(&mut self, sig: SignalVia, wait: WaitVia) -> (f64, f64) {
        let (k, reps) = k_reps(self.world);
        let (mut eager, mut graph) = (Vec::new(), Vec::new());
        for _ in 0..reps + 1 {
            let (a, b) = (self.slot, self.slot + 1);
            self.slot += 2;
            self.sync();
            self.timer.start(self.stream).unwrap();
            for i in 1..=k as u64 {
                self.round(sig, wait, a, b, i);
            }
            eager.push(self.timer.stop_ms(self.stream).unwrap() as f64 * 1e3 / k as f64);
            // The same rounds captured (values past the eager ones), launched once.
            util::capture_begin(self.device, self.stream).unwrap();
            for i in 1..=k as u64 {
                self.round(sig, wait, a, b, k as u64 + i);
            }
            let g = util::capture_end(self.device, self.stream).unwrap();
            self.sync();
            self.timer.start(self.stream).unwrap();
            g.launch(self.stream).unwrap();
            graph.push(self.timer.stop_ms(self.stream).unwrap() as f64 * 1e3 / k as f64);
        }
        // The first repetition warms up (module load, first capture).
        (median(eager[1..].to_vec()), median(graph[1..].to_vec()))
    }

    /// A put of fresh data, a signal by `sig`, the receiver's wait and its check of every byte
    /// (rank world-1 receives from rank 0; at one rank, from itself): delivery in order.
    fn check(&mut self, sig: SignalVia, buf: u64, src: u64, bytes: usize, salt: u8) -> bool {
        let slot = self.slot;
        self.slot += 1;
        let data: Vec<u8> = (0..bytes)
            .map(|i| (i as u8).wrapping_mul(31) ^ salt)
            .collect();
        let (sender, receiver) = (0, self.world - 1);
        self.sync();
        if self.rank == receiver {
            util::htod(self.device, buf, &vec![0u8; bytes]).unwrap();
        }
        self.sync();
        let s = self.stream;
        if self.rank == sender {
            util::htod(self.device, src, &data).unwrap();
            let c = &mut self.comm;
            c.put(receiver as i64, buf, src, bytes as u64, s).unwrap();
            c.signal_via(sig, receiver as i64, slot, 1, s).unwrap();
        }
        let mut good = true;
        if self.rank == receiver {
            self.comm.wait_via(WaitVia::Kernel, slot, 1, s).unwrap();
            util::stream_sync(self.device, s).unwrap();
            let mut got = vec![0u8; bytes];
            util::dtoh(self.device, &mut got, buf).unwrap();
            good = got == data;
        }
        self.sync();
        good
    }
}

fn child(rank: usize, world: usize, hex: &str) {
    let bytes: Vec<u8> = (0..128)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let id = UniqueId::from_bytes(&bytes.try_into().unwrap()).unwrap();
    let gpus = cuda::driver().unwrap().devices.len();
    let device = (rank % gpus) as i32;
    let comm = Communicator::init(world as i32, rank as i32, device, &id).unwrap();
    let stream = util::stream_create(device).unwrap();
    let timer = util::Timer::new(device).unwrap();
    let mut r = Rank {
        comm,
        rank,
        world,
        device,
        stream,
        timer,
        slot: 0,
    };
    let name = &cuda::driver().unwrap().device(device).unwrap().name;
    let (k, reps) = k_reps(world);
    // Whether stream memory operations take the pads (every rank gets the same answer).
    let probe = r.slot;
    r.slot += 1;
    let sw = r
        .comm
        .signal_via(SignalVia::StreamWrite, rank as i64, probe, 1, stream);
    let stream_ok = sw.is_ok();
    if let (0, Err(e)) = (rank, &sw) {
        println!("stream write refused, its rows are skipped: {}", e.message);
    }
    r.sync();
    // Delivery and order first: a put of 4 MiB of fresh bytes, then a signal by each mechanism.
    let alloc = symmalloc::heap::global().unwrap();
    let max = 64usize << 20;
    let dst = alloc.malloc(max as u64, device, stream).unwrap();
    let src = alloc.malloc(max as u64, device, stream).unwrap();
    r.comm.rendezvous(dst, max as u64).unwrap();
    for (sig, label, on) in [
        (SignalVia::Kernel, "kernel", true),
        (SignalVia::StreamWrite, "stream write", stream_ok),
    ] {
        if on {
            let good = (0..3u8).all(|i| r.check(sig, dst, src, 4 << 20, i));
            if rank == world - 1 {
                let verdict = if good { "ok" } else { "WRONG" };
                println!(
                    "put 4 MiB + signal ({label}) + wait, checked byte for byte x3: {verdict}"
                );
            }
        }
    }
    if rank == 0 {
        println!(
            "p2p_bench: {world} rank(s) on {gpus} GPU(s) ({name}); us per {}, median of {reps} x \
             mean of {k}",
            if world == 1 {
                "signal+wait on self"
            } else {
                "ping-pong round trip"
            }
        );
        println!("{:<28} | {:>9} | {:>9}", "signal / wait", "eager", "graph");
    }
    let combos = [
        (SignalVia::Kernel, WaitVia::Kernel, "kernel / kernel"),
        (
            SignalVia::StreamWrite,
            WaitVia::Kernel,
            "stream write / kernel",
        ),
        (
            SignalVia::Kernel,
            WaitVia::StreamWait,
            "kernel / stream wait",
        ),
        (
            SignalVia::StreamWrite,
            WaitVia::StreamWait,
            "stream write / stream wait",
        ),
    ];
    for (sig, wait, label) in combos {
        if sig == SignalVia::StreamWrite && !stream_ok {
            continue;
        }
        let (e, g) = r.rounds(sig, wait);
        if rank == 0 {
            println!("{label:<28} | {e:>9.2} | {g:>9.2}");
        }
    }
    r.sync();

    // Host enqueue cost: waits already satisfied (value 0), signals to self's... own slot.
    if rank == 0 {
        let slot = r.slot;
        let n = 2000;
        let mut cost = |what: &str, f: &mut dyn FnMut(&mut Communicator)| {
            util::stream_sync(device, stream).unwrap();
            let t = Instant::now();
            for _ in 0..n {
                f(&mut r.comm);
            }
            let ns = t.elapsed().as_nanos() as f64 / n as f64;
            util::stream_sync(device, stream).unwrap();
            println!("enqueue {what:<22}: {ns:>7.0} ns");
        };
        cost("signal (kernel)", &mut |c| {
            c.signal_via(SignalVia::Kernel, 0, slot, 1, stream).unwrap()
        });
        if stream_ok {
            cost("signal (stream write)", &mut |c| {
                c.signal_via(SignalVia::StreamWrite, 0, slot, 1, stream)
                    .unwrap()
            });
        }
        cost("wait (kernel)", &mut |c| {
            c.wait_via(WaitVia::Kernel, slot, 0, stream).unwrap()
        });
        cost("wait (stream wait)", &mut |c| {
            c.wait_via(WaitVia::StreamWait, slot, 0, stream).unwrap()
        });
    }
    r.sync();

    // Puts into the peer (self at 1 rank).
    let peer = (rank + 1) % world;
    if rank == 0 {
        println!("{:>9} | {:>10} | {:>8}", "put bytes", "us", "GB/s");
    }
    for bytes in [8usize, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20] {
        let n = if bytes >= 16 << 20 { 10 } else { 100 };
        let mut t = Vec::new();
        for _ in 0..reps + 1 {
            r.sync();
            if rank == 0 {
                r.timer.start(stream).unwrap();
                for _ in 0..n {
                    r.comm
                        .put(peer as i64, dst, src, bytes as u64, stream)
                        .unwrap();
                }
                t.push(r.timer.stop_ms(stream).unwrap() as f64 * 1e3 / n as f64);
            }
        }
        if rank == 0 {
            let us = median(t[1..].to_vec());
            println!("{bytes:>9} | {us:>10.2} | {:>8.1}", bytes as f64 / us / 1e3);
        }
    }
    r.sync();
    alloc.free(dst, max as u64, device, stream).unwrap();
    alloc.free(src, max as u64, device, stream).unwrap();
    r.comm.destroy().unwrap();
}
