//! All-reduce latency through the C ABI alone (no Python): what a C++ engine calling
//! `symm_all_reduce_algo` sees, eager and CUDA-graphed, bf16 sum, each algorithm. Starts one
//! process per GPU itself. Complements bench/allreduce.py, whose eager figures include the
//! Python/ctypes call.
//!
//! Each figure is the median over 30 repetitions of the mean of 20 back-to-back calls, timed
//! with CUDA events after warm-up; ranks meet at a `symm_barrier` and a host sync before each
//! repetition. Results are checked first against a float64 reference on random data.
//!
//! A second table gives the host's side of an eager AUTO call: the CPU time to enqueue one
//! `symm_all_reduce_algo` (median of 30 x mean of 20), next to launching an empty kernel through
//! the same launch wrapper and through bare cuLaunchKernel. Eager latency is the larger of this
//! and the kernel's own time.
//!
//! Run: cargo run --release --example allreduce_c

use std::process::Command;
use std::time::Instant;
use symmalloc::comm::convert::{bf16_to_f32, f32_to_bf16};
use symmalloc::cuda::{self, util};
use symmalloc::ffi::{self, types::*};

const SIZES: [usize; 11] = [
    8 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    256 << 20,
];
const ALGOS: [(symm_algo_t, &str); 4] = [
    (SYMM_ALGO_AUTO, "auto"),
    (SYMM_ALGO_ONE_SHOT_LL, "one_shot_ll"),
    (SYMM_ALGO_ONE_SHOT, "one_shot"),
    (SYMM_ALGO_TWO_SHOT, "two_shot"),
];
const K: usize = 20;
const REPS: usize = 30;

fn last_error() -> String {
    // SAFETY: symm_last_error returns a valid NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(ffi::symm_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn ok(st: symm_status_t, what: &str) {
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{what}: {}", last_error());
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 5 && args[1] == "--child" {
        return child(args[2].parse().unwrap(), args[3].parse().unwrap(), &args[4]);
    }
    let drv = cuda::driver().unwrap_or_else(|e| {
        eprintln!("allreduce_c needs GPUs: {}", e.message);
        std::process::exit(1)
    });
    // SYMM_BENCH_WORLD=N runs N ranks (N = 1 times the kernels' local work alone on one GPU,
    // with no NVLink traffic: a tuning aid, not a collective's latency).
    let gpus = drv.devices.len().min(8);
    let world = match std::env::var("SYMM_BENCH_WORLD") {
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if (1..=gpus).contains(&n) => n,
            _ => {
                eprintln!("SYMM_BENCH_WORLD={v:?}: expected 1..={gpus} ranks");
                std::process::exit(1)
            }
        },
        Err(_) if gpus < 2 => {
            eprintln!("allreduce_c needs 2 or more GPUs, found {gpus}");
            std::process::exit(1)
        }
        Err(_) => gpus,
    };
    let mut id = symm_unique_id_t { internal: [0; 128] };
    ok(ffi::symm_get_unique_id(&mut id), "symm_get_unique_id");
    let hex: String = id
        .internal
        .iter()
        .map(|&c| format!("{:02x}", c as u8))
        .collect();
    let exe = std::env::current_exe().unwrap();
    // SYMM_BENCH_RANK0_WRAP runs rank 0 alone under a wrapper (a profiler such as ncu), so the
    // other ranks' kernels run unprofiled and concurrently with the profiled one.
    let wrap = std::env::var("SYMM_BENCH_RANK0_WRAP").unwrap_or_default();
    let kids: Vec<_> = (0..world)
        .map(|r| {
            let mut words: Vec<String> = match r {
                0 => wrap.split_whitespace().map(str::to_string).collect(),
                _ => Vec::new(),
            };
            words.push(exe.display().to_string());
            Command::new(&words[0])
                .args(&words[1..])
                .args(["--child", &r.to_string(), &world.to_string(), &hex])
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start rank {r} with {words:?}: {e}"))
        })
        .collect();
    let mut good = true;
    for mut k in kids {
        good &= k.wait().map(|s| s.success()).unwrap_or(false);
    }
    std::process::exit(if good { 0 } else { 1 });
}

/// Rank `r`'s element `i`: pseudo-random, reproducible on every rank for the reference.
fn input(r: usize, i: usize, salt: u64) -> f32 {
    let mut x = (i as u64 ^ (r as u64) << 40 ^ salt << 20).wrapping_mul(0x9e3779b97f4a7c15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58476d1ce4e5b9);
    x ^= x >> 32;
    (x % 4096) as f32 / 512.0 - 4.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// With SYMM_BENCH_PIN=1, rank r runs on cores 4r+4 .. 4r+7 (bench/tail.py pins its Python ranks
/// the same way, so the eager comparison sees the same host conditions).
fn pin(rank: i32) {
    if std::env::var("SYMM_BENCH_PIN").as_deref() != Ok("1") {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it; the call
    // changes only this process's affinity.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in 4 * rank as usize + 4..4 * rank as usize + 8 {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn child(rank: i32, world: i32, hex: &str) {
    pin(rank);
    let mut id = symm_unique_id_t { internal: [0; 128] };
    for (i, c) in id.internal.iter_mut().enumerate() {
        *c = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as _;
    }
    let mut comm = std::ptr::null_mut();
    ok(
        ffi::symm_comm_init(&mut comm, world, rank, rank, &id),
        "symm_comm_init",
    );
    let stream = util::stream_create(rank).unwrap();
    let timer = util::Timer::new(rank).unwrap();
    let ll_max = symmalloc::config::ll_bytes(world as usize).unwrap();
    if rank == 0 {
        println!(
            "bf16 sum, {world} ranks, C ABI; us per call, median of {REPS} x mean of {K} calls"
        );
        println!(
            "{:>9} | {:>21} | {:>21} | {:>21} | {:>21}",
            "size", "auto eager/graph", "one_shot_ll", "one_shot", "two_shot"
        );
    }
    // SYMM_BENCH_MIN_BYTES / SYMM_BENCH_MAX_BYTES narrow the sweep (tuning and profiling runs).
    let limit = |name: &str, default: usize| -> usize {
        std::env::var(name)
            .ok()
            .and_then(|v| symmalloc::config::parse_size(&v))
            .map_or(default, |v| v as usize)
    };
    let (min_bytes, max_bytes) = (
        limit("SYMM_BENCH_MIN_BYTES", 0),
        limit("SYMM_BENCH_MAX_BYTES", usize::MAX),
    );
    // SYMM_BENCH_ALGOS (e.g. "auto,two_shot") narrows the algorithms (the eager comparison of
    // bench/tail.py needs AUTO alone).
    let algos = std::env::var("SYMM_BENCH_ALGOS").unwrap_or_default();
    let wanted = |name: &str| algos.is_empty() || algos.split(',').any(|a| a.trim() == name);
    let mut host_rows = Vec::new();
    for &bytes in SIZES
        .iter()
        .filter(|&&b| (min_bytes..=max_bytes).contains(&b))
    {
        let n = bytes / 2;
        let buf = ffi::symm_malloc(bytes, rank, stream as _);
        assert!(!buf.is_null(), "{}", last_error());
        let mut cells = Vec::new();
        for (salt, &(algo, name)) in ALGOS.iter().enumerate() {
            let salt = salt as u64 + bytes as u64;
            let skip_one_shot = algo == SYMM_ALGO_ONE_SHOT && bytes > (4 << 20);
            if (algo == SYMM_ALGO_ONE_SHOT_LL && bytes as u64 > ll_max)
                || skip_one_shot
                || !wanted(name)
            {
                cells.push("-".to_string());
                continue;
            }
            // Correctness on random data: every rank's input is a known function of (rank, i).
            let vals: Vec<u16> = (0..n)
                .map(|i| f32_to_bf16(input(rank as usize, i, salt)))
                .collect();
            let host: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            let call = || {
                ok(
                    ffi::symm_all_reduce_algo(
                        comm,
                        algo,
                        buf,
                        buf,
                        n,
                        SYMM_BF16,
                        SYMM_SUM,
                        stream as _,
                    ),
                    "all_reduce",
                )
            };
            util::htod_async(rank, buf as u64, &host, stream).unwrap();
            call();
            util::stream_sync(rank, stream).unwrap();
            let mut out = vec![0u8; bytes];
            util::dtoh(rank, &mut out, buf as u64).unwrap();
            for i in (0..n).step_by(97) {
                let want: f64 = (0..world as usize)
                    .map(|r| bf16_to_f32(f32_to_bf16(input(r, i, salt))) as f64)
                    .sum();
                let got = bf16_to_f32(u16::from_le_bytes([out[2 * i], out[2 * i + 1]])) as f64;
                assert!(
                    (got - want).abs() <= 0.02 * want.abs().max(1.0),
                    "size {bytes} algo {algo} i {i}: {got} vs {want}"
                );
            }
            let time = |run: &dyn Fn()| -> f64 {
                for _ in 0..3 {
                    run();
                }
                let mut v = Vec::new();
                for _ in 0..REPS {
                    ok(ffi::symm_barrier(comm, stream as _), "barrier");
                    util::stream_sync(rank, stream).unwrap();
                    timer.start(stream).unwrap();
                    run();
                    v.push(timer.stop_ms(stream).unwrap() as f64 * 1000.0 / K as f64);
                }
                median(v)
            };
            let eager = time(&|| (0..K).for_each(|_| call()));
            if algo == SYMM_ALGO_AUTO {
                // CPU time per enqueue: the calls return before their kernels run.
                let mut v = Vec::new();
                for _ in 0..REPS {
                    ok(ffi::symm_barrier(comm, stream as _), "barrier");
                    util::stream_sync(rank, stream).unwrap();
                    let t0 = Instant::now();
                    (0..K).for_each(|_| call());
                    v.push(t0.elapsed().as_secs_f64() * 1e6 / K as f64);
                    util::stream_sync(rank, stream).unwrap();
                }
                host_rows.push((bytes, median(v)));
            }
            util::capture_begin(rank, stream).unwrap();
            (0..K).for_each(|_| call());
            let graph = util::capture_end(rank, stream).unwrap();
            let graphed = time(&|| graph.launch(stream).unwrap());
            drop(graph);
            cells.push(format!("{eager:8.1} / {graphed:8.1}"));
        }
        ffi::symm_free(buf, bytes, rank, stream as _);
        if rank == 0 {
            println!(
                "{:>9} | {}",
                label(bytes),
                cells
                    .iter()
                    .map(|c| format!("{c:>21}"))
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
        }
    }
    if rank == 0 && !host_rows.is_empty() {
        let (wrapped, bare) = launch_floor(rank, stream);
        println!(
            "\nhost side of an eager AUTO call, us per call: empty kernel through the launch \
             wrapper {wrapped:.2}, through bare cuLaunchKernel {bare:.2}"
        );
        for (bytes, us) in host_rows {
            println!("{:>9} | symm_all_reduce_algo enqueue {us:.2}", label(bytes));
        }
    }
    ok(ffi::symm_comm_destroy(comm), "destroy");
}

fn label(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// CPU time per launch of the self-test kernel with no work (n = 0): through
/// `cuda::module::launch` (context push/pop around cuLaunchKernel, as every collective) and
/// through bare cuLaunchKernel under a context pushed once.
fn launch_floor(device: i32, stream: u64) -> (f64, f64) {
    use cudarc::driver::sys;
    use symmalloc::cuda::module;
    let f = module::function(device, symmalloc::cuda::util::SELFTEST_SAXPY).unwrap();
    let args = util::SaxpyArgs {
        x: 0,
        y: 0,
        n: 0,
        a: 0.0,
        reserved: 0.0,
    };
    let per_call = |launch: &dyn Fn()| -> f64 {
        let mut v = Vec::new();
        for _ in 0..REPS {
            util::stream_sync(device, stream).unwrap();
            let t0 = Instant::now();
            (0..K).for_each(|_| launch());
            v.push(t0.elapsed().as_secs_f64() * 1e6 / K as f64);
        }
        util::stream_sync(device, stream).unwrap();
        median(v)
    };
    let wrapped = per_call(&|| module::launch(device, f, 1, 256, stream, &args).unwrap());
    let _ctx = symmalloc::cuda::CtxGuard::new(device).unwrap();
    let raw = f.raw() as sys::CUfunction;
    let bare = per_call(&|| {
        let mut params = [&args as *const util::SaxpyArgs as *mut std::ffi::c_void];
        // SAFETY: params points at one argument laid out as the kernel's SaxpyArgs; the
        // context is current (pushed above) and the stream is this rank's.
        let r = unsafe {
            sys::cuLaunchKernel(
                raw,
                1,
                1,
                1,
                256,
                1,
                1,
                0,
                stream as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuLaunchKernel");
    });
    (wrapped, bare)
}
