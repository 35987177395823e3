//! Allocator benchmark: malloc+free pair latency (p50/p99, 1 and 8 threads, 512 B to 64 MiB)
//! for symmalloc's cache against the driver's cuMemAlloc, cuMemAllocAsync (stream-ordered pool)
//! and raw cuMemCreate+map; and reserved/allocated at the peak of a replayed transformer
//! training-step trace. PyTorch's caching allocator (torch.empty + del) is measured in the same
//! run by bench/alloc_torch.py, which this program starts after its own rows (python3 with torch
//! must be on PATH; the column says why when it is not). One table. Needs a GPU.
//!
//! Run from the repository root: cargo run --release --example alloc_bench
//! (SYMM_BENCH_TORCH_SCRIPT names the script when run from elsewhere.)

use cudarc::driver::sys;
use std::collections::HashMap;
use std::time::Instant;
use symmalloc::cuda::{self, CtxGuard};
use symmalloc::heap::{self, pools};

// The replays of PyTorch allocator traces (`--replay`, `--replay-capture`).
mod replay;

const SIZES: [u64; 6] = [512, 4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20];

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p) as usize]
}

/// Per-pair latency in microseconds of `pair`, `iters` times, on `threads` threads that start
/// timing together (after their warm-up), so the threads really contend.
fn measure(threads: usize, iters: usize, pair: impl Fn(usize) + Sync) -> (f64, f64) {
    let start = std::sync::Barrier::new(threads);
    let all: Vec<Vec<f64>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let (pair, start) = (&pair, &start);
                s.spawn(move || {
                    let _ctx = HOST_ONLY.get().is_none().then(|| CtxGuard::new(0).unwrap());
                    for _ in 0..iters / 10 {
                        pair(t);
                    }
                    start.wait();
                    (0..iters)
                        .map(|_| {
                            let t0 = Instant::now();
                            pair(t);
                            t0.elapsed().as_secs_f64() * 1e6
                        })
                        .collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut v: Vec<f64> = all.into_iter().flatten().collect();
    (pct(&mut v, 0.5), pct(&mut v, 0.99))
}

/// One cached malloc+free pair of `size` bytes on `stream`, device 0, the default pool.
fn pair(a: &heap::Allocator, size: u64, stream: u64) {
    let p = a.malloc_in(size, 0, stream, pools::DEFAULT_POOL).unwrap();
    a.free(p, size, 0, stream).unwrap();
}

/// The host CPU's model name (Linux), for the table's header: pair costs follow the CPU.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn check(r: sys::CUresult, what: &str) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// Set by `--pairs-only`: the symmalloc pair column alone, on whichever backend
/// `SYMMALLOC_BACKEND` names (no CUDA call of the benchmark's own).
static HOST_ONLY: std::sync::OnceLock<()> = std::sync::OnceLock::new();

fn main() {
    if std::env::args().any(|a| a == "--pairs-only") {
        HOST_ONLY.set(()).unwrap();
        let a = heap::global().unwrap();
        println!(
            "symmalloc cached malloc+free pair, us p50 / p99, {} backend",
            a.backend().name()
        );
        // The host backend takes any stream value. The CUDA backend hands streams to the driver
        // (capture checks, waits before a release), so it gets real ones: a made-up handle
        // there is undefined behaviour in the driver (it crashed at the first heap growth).
        let streams: Vec<u64> = if a.backend().name() == "cuda" {
            let _ctx = CtxGuard::new(0).unwrap();
            (0..8)
                .map(|_| cuda::util::stream_create(0).unwrap())
                .collect()
        } else {
            (1..=8).map(|t| 0x1000 * t).collect()
        };
        // What one clock-read pair adds to every per-pair figure below.
        let (clock50, clock99) = measure(1, 20_000, |_| {});
        println!(
            "host CPU: {}; a clock read pair alone: {clock50:.3} / {clock99:.3}",
            cpu_model()
        );
        for &size in &SIZES {
            for threads in [1usize, 8] {
                let iters = if threads == 1 { 20_000 } else { 5_000 };
                let (p50, p99) = measure(threads, iters, |t| pair(a, size, streams[t]));
                println!("{size:>10} {threads:>2} | {p50:.3} / {p99:.3}");
            }
            // One thread, a million pairs under one clock read: the mean without the timer's grain.
            let t0 = Instant::now();
            for _ in 0..1_000_000 {
                pair(a, size, streams[0]);
            }
            println!(
                "{size:>10}  1 | mean {:.1} ns",
                t0.elapsed().as_nanos() as f64 / 1e6
            );
        }
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--replay") {
        let file = args.get(i + 1).expect("--replay FILE");
        return replay::shared_pool(heap::global().unwrap(), file);
    }
    if let Some(i) = args.iter().position(|a| a == "--replay-capture") {
        let file = args.get(i + 1).expect("--replay-capture FILE");
        return replay::capture(file);
    }
    if std::env::args().any(|a| a == "--trace-only") {
        // The trace replay alone, on whichever backend SYMMALLOC_BACKEND names (host works
        // without a GPU: placement is the same, only the memory differs).
        return trace_replay(heap::global().unwrap());
    }
    let drv = match cuda::driver() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("alloc_bench needs a GPU: {}", e.message);
            std::process::exit(1);
        }
    };
    println!(
        "allocator benchmark on {} ({} GPU(s))",
        drv.devices[0].name,
        drv.devices.len()
    );
    let a = heap::global().unwrap();
    let streams: Vec<u64> = (0..32)
        .map(|_| cuda::util::stream_create(0).unwrap())
        .collect();
    let gran = cuda::vmm::granularity(0).unwrap() as u64;
    let mut rows = Vec::new();
    // 32 threads too where the machine has the cores for them (one stream each).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let counts: Vec<usize> = if cores >= 32 {
        vec![1, 8, 32]
    } else {
        println!("32 threads: not run ({cores} cores here)");
        vec![1, 8]
    };
    for &size in &SIZES {
        for &threads in &counts {
            let iters = if threads == 1 { 20_000 } else { 5_000 };
            let sym = measure(threads, iters, |t| pair(a, size, streams[t]));
            // Every thread on one stream (a stream shared by the threads of a server).
            let shared = measure(threads, iters, |_| pair(a, size, streams[0]));
            let raw_iters = if size >= (8 << 20) { 200 } else { 1000 };
            let alloc = measure(threads, raw_iters, |_| {
                let mut p = 0;
                // SAFETY: plain allocate/free pair under the thread's current context.
                unsafe {
                    check(sys::cuMemAlloc_v2(&mut p, size as usize), "cuMemAlloc");
                    check(sys::cuMemFree_v2(p), "cuMemFree");
                }
            });
            let asyncp = measure(threads, iters / 4, |t| {
                let mut p = 0;
                let s = streams[t] as sys::CUstream;
                // SAFETY: stream-ordered allocate/free pair on a live stream.
                unsafe {
                    check(
                        sys::cuMemAllocAsync(&mut p, size as usize, s),
                        "cuMemAllocAsync",
                    );
                    check(sys::cuMemFreeAsync(p, s), "cuMemFreeAsync");
                }
            });
            let create = measure(threads, raw_iters / 2, |_| {
                let len = size.next_multiple_of(gran);
                let h = cuda::vmm::create(0, len).unwrap();
                let va = cuda::vmm::reserve(0, len, gran).unwrap();
                cuda::vmm::map(0, va, len, h).unwrap();
                cuda::vmm::unmap(0, va, len).unwrap();
                cuda::vmm::unreserve(0, va, len).unwrap();
                cuda::vmm::release(h).unwrap();
            });
            rows.push((size, threads, sym, shared, alloc, asyncp, create));
        }
    }
    let torch = torch_rows();
    if let Err(why) = &torch {
        println!("torch column: not measured: {why}");
    }
    let (clock50, clock99) = measure(1, 20_000, |_| {});
    println!(
        "\nmalloc+free pair latency, us (p50 / p99), per thread; host CPU: {}; a clock read pair alone: {clock50:.3} / {clock99:.3}",
        cpu_model()
    );
    println!(
        "{:>8} {:>3} | {:>17} | {:>17} | {:>17} | {:>17} | {:>17} | {:>17} | create/symm p50",
        "size",
        "thr",
        "symmalloc cached",
        "symm shared strm",
        "cuMemAlloc",
        "cuMemAllocAsync",
        "cuMemCreate+map",
        "torch.empty+del"
    );
    for (size, th, s, sh, a1, a2, c) in &rows {
        let t = match torch.as_ref().ok().and_then(|m| m.get(&(*size, *th))) {
            Some((p50, p99)) => format!("{p50:>7.2} / {p99:>7.2}"),
            None => "-".to_string(),
        };
        let label = if *size >= 1 << 20 {
            format!("{} MiB", size >> 20)
        } else if *size >= 1024 {
            format!("{} KiB", size >> 10)
        } else {
            format!("{size} B")
        };
        println!(
            "{label:>8} {th:>3} | {:>7.3} / {:>7.3} | {:>7.3} / {:>7.3} | {:>7.2} / {:>7.2} | {:>7.3} / {:>7.3} | {:>7.1} / {:>7.1} | {t:>17} | {:>8.0}x",
            s.0, s.1, sh.0, sh.1, a1.0, a1.1, a2.0, a2.1, c.0, c.1, c.0 / s.0
        );
    }
    trace_replay(a);
}

/// (size, threads) -> (p50, p99) in us.
type Column = HashMap<(u64, usize), (f64, f64)>;

/// PyTorch's caching allocator on the same GPU, from bench/alloc_torch.py run now, after this
/// process's own measurements.
fn torch_rows() -> Result<Column, String> {
    let script = std::env::var("SYMM_BENCH_TORCH_SCRIPT")
        .unwrap_or_else(|_| "bench/alloc_torch.py".to_string());
    if !std::path::Path::new(&script).is_file() {
        return Err(format!(
            "{script} not found (run from the repository root or set SYMM_BENCH_TORCH_SCRIPT)"
        ));
    }
    let sizes: Vec<String> = SIZES.iter().map(|s| s.to_string()).collect();
    let out = std::process::Command::new("python3")
        .args([&script, "--lines", "--sizes", &sizes.join(",")])
        .output()
        .map_err(|e| format!("cannot start python3: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "{script} failed ({}): {}",
            out.status,
            err.lines().last().unwrap_or("no output")
        ));
    }
    let mut rows = HashMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        if let ["torch", size, threads, p50, p99] = w[..] {
            let parsed = (size.parse(), threads.parse(), p50.parse(), p99.parse());
            if let (Ok(s), Ok(t), Ok(a), Ok(b)) = parsed {
                rows.insert((s, t), (a, b));
                continue;
            }
        }
        return Err(format!("{script} printed an unexpected line: {line:?}"));
    }
    Ok(rows)
}

/// A transformer training step: forward keeps each layer's activations, backward frees them in
/// reverse order while allocating and freeing gradient temporaries, then the optimizer's
/// scratch. Sizes follow a 7B-like layer (hidden 4096, 4 micro-batch x 2048 tokens, bf16);
/// a little jitter (+-10%) per step models varying sequence packing. Weights and optimizer
/// state are allocated once. Replayed for 5 steps; reports the peak reserved/allocated ratio.
fn trace_replay(a: &heap::Allocator) {
    let tokens: u64 = 4 * 2048;
    let hidden: u64 = 4096;
    let layers = 8;
    let mut rng = 0x1234_5678u64;
    let mut jitter = |x: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (x as f64 * (0.9 + (rng % 1000) as f64 / 5000.0)) as u64 / 512 * 512 + 512
    };
    let dev = 0;
    let s = 0u64;
    let mut live: Vec<(u64, u64)> = Vec::new();
    // Persistent: weights (4*h*h + 3*h*4h per layer, bf16) and grads.
    for _ in 0..layers {
        for sz in [4 * hidden * hidden * 2, 3 * hidden * 4 * hidden * 2] {
            live.push((a.malloc_in(sz, dev, s, pools::DEFAULT_POOL).unwrap(), sz));
        }
    }
    let mut peak_ratio: f64 = 0.0;
    let mut peak_alloc = 0;
    let mut peak_res = 0;
    for _step in 0..5 {
        let mut acts: Vec<Vec<(u64, u64)>> = Vec::new();
        for _ in 0..layers {
            let mut keep = Vec::new();
            for sz in [
                tokens * hidden * 2,
                tokens * hidden * 2,
                tokens * 4 * hidden * 2,
                tokens * 4 * hidden * 2,
                tokens * 32 * 4,
            ] {
                let sz = jitter(sz);
                keep.push((a.malloc_in(sz, dev, s, pools::DEFAULT_POOL).unwrap(), sz));
            }
            // transient small tensors (norm stats, masks)
            for _ in 0..6 {
                let sz = jitter(tokens * 8);
                let p = a.malloc_in(sz, dev, s, pools::DEFAULT_POOL).unwrap();
                a.free(p, sz, dev, s).unwrap();
            }
            acts.push(keep);
        }
        let st = a.stats(dev).unwrap();
        peak_ratio = peak_ratio.max(st.reserved_bytes as f64 / st.allocated_bytes as f64);
        peak_alloc = peak_alloc.max(st.allocated_bytes);
        peak_res = peak_res.max(st.reserved_bytes);
        for keep in acts.into_iter().rev() {
            let g = jitter(tokens * 4 * hidden * 2);
            let gp = a.malloc_in(g, dev, s, pools::DEFAULT_POOL).unwrap();
            for (p, sz) in keep.into_iter().rev() {
                a.free(p, sz, dev, s).unwrap();
            }
            a.free(gp, g, dev, s).unwrap();
        }
        let opt = 2 * hidden * hidden * 4;
        let op = a.malloc_in(opt, dev, s, pools::DEFAULT_POOL).unwrap();
        a.free(op, opt, dev, s).unwrap();
    }
    let st = a.stats(dev).unwrap();
    println!(
        "\ntrace replay (8 layers, 5 steps): peak allocated {:.2} GiB, peak reserved {:.2} GiB, reserved/allocated at peak {:.3}; segments created {}, released {}",
        peak_alloc as f64 / (1u64 << 30) as f64,
        peak_res as f64 / (1u64 << 30) as f64,
        peak_ratio,
        st.physical_creates,
        st.physical_releases
    );
    for (p, sz) in live {
        a.free(p, sz, dev, s).unwrap();
    }
}
