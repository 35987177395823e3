//! Groups (several communicators per GPU): what `symm_comm_split` costs against a fresh
//! `symm_comm_init` of the same ranks, and an all-reduce on a child against the same all-reduce on a standalone communicator
//! over the same ranks. Starts its ranks itself; rank 0's tables go to stdout with each target's
//! verdict (bench/RESULTS.md, "Groups").
//!
//! 1. Creation: `SYMM_BENCH_WORLD` ranks (default 4; on fewer GPUs they share them, as
//!    `SYMMALLOC_SHARED_GPU=1` allows) hold a world communicator; REPS times (default 20), a
//!    fresh init over a new id, then a split of the world, each timed on the host after a
//!    barrier, both destroyed again. Median per rank; target: split <= 1/5 of init. Runs on the
//!    host backend too (`SYMMALLOC_BACKEND=host`).
//! 2. A child against a standalone communicator (CUDA only): one rank per GPU (a single rank on
//!    a one-GPU machine: ranks sharing a GPU time-slice, so their timings mean nothing). The
//!    world, its child (split, one color) and a fresh communicator over the same ranks, each with
//!    a buffer from its own arena. Per size, ROUNDS rounds (default 15) alternate which goes first;
//!    a round times 500 eager in-place bf16 sums on each, then 25 replays of a graph of 20 on
//!    each (CUDA events, after a barrier). Reported: the medians of each, and the median of the
//!    rounds' child / standalone ratios; target: the graphed ratio within 2%.
//!    `SYMM_BENCH_CROSS=1` adds a graphed table of each communicator on the other's buffer and
//!    the parent on its own: whether a difference follows the communicator or the buffer.
//!
//! Run: cargo run --release --example groups_bench

// The integration tests' helpers (ids, checked calls, split, destroy).
#[path = "../tests/common/mod.rs"]
mod common;

use common::{destroy, err, new_id_hex, ok as check, split, Comm};
use std::process::Command;
use std::ptr::null_mut;
use std::time::Instant;
use symmalloc::cuda::{self, util};
use symmalloc::ffi::groups::*;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?}: expected a whole number")),
        Err(_) => default,
    }
}

fn init(world: i32, rank: i32, device: i32, hex: &str) -> Comm {
    let mut id = symm_unique_id_t { internal: [0; 128] };
    for (i, b) in id.internal.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as _;
    }
    let mut comm = null_mut();
    check(symm_comm_init(&mut comm, world, rank, device, &id), "init");
    comm
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 6 && args[1] == "--child" {
        let (rank, world) = (args[3].parse().unwrap(), args[4].parse().unwrap());
        return match args[2].as_str() {
            "create" => create_rank(rank, world, &args[5]),
            _ => speed_rank(rank, world, &args[5]),
        };
    }
    let host = host_backend();
    let gpus = if host {
        0
    } else {
        cuda::driver()
            .unwrap_or_else(|e| {
                eprintln!(
                    "groups_bench needs a GPU or SYMMALLOC_BACKEND=host: {}",
                    e.message
                );
                std::process::exit(1)
            })
            .devices
            .len()
    };
    let world = env_usize("SYMM_BENCH_WORLD", 4).max(1);
    let reps = env_usize("REPS", 20).max(1);
    let shared = !host && world > gpus;
    println!(
        "split against a fresh init of the same {world} ranks ({}), median of {reps}, us",
        if host {
            "host backend".to_string()
        } else if shared {
            format!("sharing {gpus} GPU(s)")
        } else {
            "one rank per GPU".to_string()
        }
    );
    let ids: Vec<String> = (0..=reps).map(|_| new_id_hex()).collect();
    let outs = run("create", world, shared, &ids.join(","));
    let mut worst: f64 = 0.0;
    for l in outs.iter().flat_map(|o| o.lines()) {
        if let Some(r) = l.strip_prefix("create ") {
            println!("{r}");
            worst = worst.max(r.rsplit("= ").next().unwrap().trim().parse().unwrap());
        }
    }
    println!(
        "target split <= 0.2 x init (every rank): worst {worst:.3} -> {}",
        if worst <= 0.2 { "met" } else { "missed" }
    );
    if host {
        println!("child against standalone: CUDA only (the host backend times the CPU's copies)");
        return;
    }
    let n = gpus.min(world).max(1);
    println!();
    println!(
        "all-reduce (bf16 sum, in place) on a child against a standalone communicator, {n} rank(s), one per GPU; us per call, medians of {} rounds",
        env_usize("ROUNDS", 15)
    );
    let ids = [new_id_hex(), new_id_hex()].join(",");
    let outs = run("speed", n, false, &ids);
    println!(
        "{:>4} | {:>9} | {:>11} {:>11} {:>7} | {:>11} {:>11} {:>7}",
        "rank", "size", "eager child", "standalone", "ratio", "graph child", "standalone", "ratio"
    );
    let mut worst: f64 = 0.0;
    for l in outs.iter().flat_map(|o| o.lines()) {
        if let Some(r) = l.strip_prefix("speed ") {
            println!("{r}");
            let g: f64 = r.rsplit(' ').next().unwrap().parse().unwrap();
            worst = worst.max((g - 1.0).abs());
        }
    }
    println!(
        "target graphed child / standalone within 2% (every rank and size): worst {:.1}% -> {}",
        worst * 100.0,
        if worst <= 0.02 { "met" } else { "missed" }
    );
    let cross: Vec<&str> = outs
        .iter()
        .flat_map(|o| o.lines())
        .filter_map(|l| l.strip_prefix("cross "))
        .collect();
    if !cross.is_empty() {
        println!();
        println!("SYMM_BENCH_CROSS: graphed, each communicator on each one's buffer (and the parent on its own); us per call, medians");
        println!(
            "{:>4} | {:>9} | {:>12} {:>12} {:>12} {:>12} {:>12}",
            "rank",
            "size",
            "child, own",
            "stand., own",
            "child, st.'s",
            "stand., ch.'s",
            "parent, own"
        );
        for r in cross {
            println!("{r}");
        }
    }
}

/// Runs `world` ranks of `phase` and returns their stdout; exits with a failing rank's output.
fn run(phase: &str, world: usize, shared: bool, arg: &str) -> Vec<String> {
    let exe = std::env::current_exe().unwrap();
    let kids: Vec<_> = (0..world)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args(["--child", phase, &r.to_string(), &world.to_string(), arg])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            if shared {
                c.env("SYMMALLOC_SHARED_GPU", "1");
            } else if phase == "speed" {
                c.env("SYMMALLOC_SHARED_GPU", "0");
            }
            c.spawn().unwrap()
        })
        .collect();
    let outs: Vec<_> = kids
        .into_iter()
        .map(|k| k.wait_with_output().unwrap())
        .collect();
    for (r, o) in outs.iter().enumerate() {
        if !o.status.success() {
            eprintln!(
                "{phase} rank {r} failed ({:?}):\n{}{}",
                o.status,
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            std::process::exit(1);
        }
    }
    outs.iter()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .collect()
}

fn host_backend() -> bool {
    std::env::var("SYMMALLOC_BACKEND").is_ok_and(|v| v == "host")
}

/// The device of `rank`: the host backend's stand-in, or the rank's GPU (modulo the GPUs).
fn device(rank: usize) -> i32 {
    if host_backend() {
        return rank as i32;
    }
    (rank % cuda::driver().unwrap().devices.len().max(1)) as i32
}

fn create_rank(rank: usize, world: usize, arg: &str) {
    let ids: Vec<&str> = arg.split(',').collect();
    let (r, w, dev) = (rank as i32, world as i32, device(rank));
    let parent = init(w, r, dev, ids[0]);
    let (mut inits, mut splits) = (Vec::new(), Vec::new());
    // Every rank starts each timing together: the barrier, then (on CUDA, where it is a kernel
    // on the default stream) the host waits for it.
    let on_cuda = !host_backend();
    let meet = || {
        check(symm_barrier(parent, null_mut()), "barrier");
        if on_cuda {
            util::stream_sync(dev, 0).unwrap();
        }
    };
    for id in &ids[1..] {
        meet();
        let t = Instant::now();
        let fresh = init(w, r, dev, id);
        inits.push(t.elapsed().as_secs_f64() * 1e6);
        meet();
        let t = Instant::now();
        let child = split(parent, 0, r);
        splits.push(t.elapsed().as_secs_f64() * 1e6);
        destroy(child);
        destroy(fresh);
    }
    let (i, s) = (median(inits), median(splits));
    println!(
        "create rank {rank}: fresh init {i:.0}, split {s:.0}; split / init = {:.3}",
        s / i
    );
    destroy(parent);
}

/// `comm`'s in-place bf16 sum of `n` elements at `p` on `stream`, checked.
fn all_reduce(comm: Comm, p: u64, n: usize, stream: u64, what: &str) {
    check(
        symm_all_reduce(comm, p as _, p as _, n, SYMM_BF16, SYMM_SUM, stream as _),
        what,
    );
}

/// `n` bf16 of `comm`'s arena, 1.0 everywhere (sums stay finite over every call).
fn ones(comm: Comm, n: usize, dev: i32, stream: u64) -> u64 {
    let p = symm_comm_malloc(comm, n * 2, stream as _) as u64;
    assert!(p != 0, "symm_comm_malloc: {}", err());
    util::htod_async(dev, p, &0x3f80u16.to_le_bytes().repeat(n), stream).unwrap();
    p
}

/// A graph of 20 of `comm`'s all-reduces of `n` bf16 at `p`.
fn graph_of(comm: Comm, p: u64, n: usize, dev: i32, stream: u64) -> util::Graph {
    util::capture_begin(dev, stream).unwrap();
    for _ in 0..20 {
        all_reduce(comm, p, n, stream, "all-reduce under capture");
    }
    util::capture_end(dev, stream).unwrap()
}

/// One timing of `comm`'s all-reduce of `n` bf16 at `p`: eager (500 calls) or a graph of 20
/// replayed 25 times; us per call.
fn time_one(
    comm: Comm,
    dev: i32,
    stream: u64,
    p: u64,
    n: usize,
    graph: Option<&util::Graph>,
) -> f64 {
    let timer = util::Timer::new(dev).unwrap();
    check(symm_barrier(comm, stream as _), "barrier");
    timer.start(stream).unwrap();
    let calls = match graph {
        Some(g) => {
            for _ in 0..25 {
                g.launch(stream).unwrap();
            }
            25 * 20
        }
        None => {
            for _ in 0..500 {
                all_reduce(comm, p, n, stream, "all-reduce");
            }
            500
        }
    };
    timer.stop_ms(stream).unwrap() as f64 * 1e3 / calls as f64
}

fn speed_rank(rank: usize, world: usize, arg: &str) {
    let ids: Vec<&str> = arg.split(',').collect();
    let (r, w, dev) = (rank as i32, world as i32, rank as i32);
    let parent = init(w, r, dev, ids[0]);
    let child = split(parent, 0, r);
    let fresh = init(w, r, dev, ids[1]);
    let stream = util::stream_create(dev).unwrap();
    let rounds = env_usize("ROUNDS", 15).max(1);
    for &n in &[4096usize, 128 << 10, 2 << 20] {
        let comms = [child, fresh];
        let bufs: Vec<u64> = comms
            .iter()
            .map(|&k| {
                let p = ones(k, n, dev, stream);
                // One eager call first: a buffer's first call shares its segment (host work
                // that a capture should not be the first to do).
                all_reduce(k, p, n, stream, "all-reduce");
                p
            })
            .collect();
        util::stream_sync(dev, stream).unwrap();
        let graphs: Vec<util::Graph> = (0..2)
            .map(|k| graph_of(comms[k], bufs[k], n, dev, stream))
            .collect();
        // A warm-up round, then `rounds` timed ones; the order alternates by round, the same on
        // every rank.
        let (mut e, mut g) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
        for round in 0..=rounds {
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            let mut te = [0.0; 2];
            let mut tg = [0.0; 2];
            for &k in &order {
                te[k] = time_one(comms[k], dev, stream, bufs[k], n, None);
                tg[k] = time_one(comms[k], dev, stream, bufs[k], n, Some(&graphs[k]));
            }
            if round > 0 {
                for k in 0..2 {
                    e[k].push(te[k]);
                    g[k].push(tg[k]);
                }
            }
        }
        if std::env::var_os("SYMM_BENCH_CROSS").is_some() {
            cross(
                rank,
                parent,
                [child, fresh],
                &bufs,
                (dev, stream),
                n,
                rounds,
            );
        }
        let ratio =
            |v: &[Vec<f64>; 2]| median(v[0].iter().zip(&v[1]).map(|(a, b)| a / b).collect());
        println!(
            "speed {rank:>4} | {:>5} KiB | {:>11.2} {:>11.2} {:>7.3} | {:>11.2} {:>11.2} {:>7.3}",
            n * 2 / 1024,
            median(e[0].clone()),
            median(e[1].clone()),
            ratio(&e),
            median(g[0].clone()),
            median(g[1].clone()),
            ratio(&g)
        );
        drop(graphs);
        util::stream_sync(dev, stream).unwrap();
        symm_comm_free(child, bufs[0] as _, n * 2, stream as _);
        symm_comm_free(fresh, bufs[1] as _, n * 2, stream as _);
    }
    util::stream_sync(dev, stream).unwrap();
    destroy(child);
    destroy(fresh);
    destroy(parent);
}

/// SYMM_BENCH_CROSS: whether a difference follows the communicator or the buffer. Graphed, the
/// child and the standalone communicator each on its own buffer and on the other's (any heap
/// memory symmetric over a communicator's ranks serves it), and the parent on a buffer of its
/// own arena; rotated order per round; one line of medians.
fn cross(
    rank: usize,
    parent: Comm,
    comms: [Comm; 2],
    bufs: &[u64],
    (dev, stream): (i32, u64),
    n: usize,
    rounds: usize,
) {
    let pb = ones(parent, n, dev, stream);
    let combos = [
        (comms[0], bufs[0]),
        (comms[1], bufs[1]),
        (comms[0], bufs[1]),
        (comms[1], bufs[0]),
        (parent, pb),
    ];
    for &(c, p) in &combos {
        all_reduce(c, p, n, stream, "all-reduce");
    }
    util::stream_sync(dev, stream).unwrap();
    let graphs: Vec<util::Graph> = combos
        .iter()
        .map(|&(c, p)| graph_of(c, p, n, dev, stream))
        .collect();
    let mut t: Vec<Vec<f64>> = vec![Vec::new(); combos.len()];
    for round in 0..=rounds {
        for i in 0..combos.len() {
            let k = (i + round) % combos.len();
            let (c, p) = combos[k];
            let v = time_one(c, dev, stream, p, n, Some(&graphs[k]));
            if round > 0 {
                t[k].push(v);
            }
        }
    }
    let m: Vec<String> = t
        .into_iter()
        .map(|v| format!("{:>12.2}", median(v)))
        .collect();
    println!(
        "cross {:>4} | {:>5} KiB | {}",
        rank,
        n * 2 / 1024,
        m.join(" ")
    );
    drop(graphs);
    util::stream_sync(dev, stream).unwrap();
    symm_comm_free(parent, pb as _, n * 2, stream as _);
}
