//! Replays of PyTorch allocator traces into symmalloc's heap, on host memory (no GPU):
//! PyTorch's own request sequence (`torch.cuda.memory._record_memory_history`, written by
//! `bench/global_memory.py` as lines `action size addr stream`, plus `mark NAME` lines at its
//! phase boundaries), this heap's placement, and the memory each side created. Placement
//! depends only on sizes, streams, pools and which streams are capturing, so host memory
//! answers for the GPU's (bench/NOTES.md, "The allocator").
//!
//! `shared_pool` (`alloc_bench --replay FILE`): every request into one pool on one stream (the
//! trace of the ten shared-pool graphs' first capture, `global_memory.py --record`).
//! `capture` (`alloc_bench --replay-capture FILE`): a whole process, its streams kept, the
//! default pool before the `capture` mark and a capture pool on the capturing stream after it
//! (`global_memory.py --record-capture`: the eager steps, then the same step captured),
//! `empty_cache` where `torch.cuda.graph` calls it, and the capturing stream marked as such,
//! so the heap obeys CUDA's capture rules as it does on the GPU.

use std::collections::HashMap;
use symmalloc::heap::backend::Stream;
use symmalloc::heap::{self, pools};

// The host backend with CUDA's capture rules, the one tests/heap_pools.rs uses.
#[path = "../tests/support/capture_backend.rs"]
mod capture_backend;
use capture_backend::capture_backend;

const MIB: f64 = (1u64 << 20) as f64;
/// The row of `--replay-capture` after `torch.cuda.graph`'s `empty_cache`.
const EMPTIED: &str = "capture, after empty_cache";

/// One line of a trace: an allocator event, or a phase mark.
enum Line {
    Event {
        action: String,
        size: u64,
        addr: u64,
        stream: u64,
    },
    Mark(String),
}

fn parse(text: &str) -> Vec<Line> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                ["mark", name] => Some(Line::Mark(name.to_string())),
                [action, size, addr, rest @ ..] => Some(Line::Event {
                    action: action.to_string(),
                    size: size.parse().ok()?,
                    addr: u64::from_str_radix(addr.trim_start_matches("0x"), 16).ok()?,
                    stream: rest
                        .first()
                        .and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok())
                        .unwrap_or(0),
                }),
                _ => None,
            }
        })
        .collect()
}

/// `--replay FILE`: every request of the trace into one pool of `a` on one stream: the memory
/// PyTorch's allocator created for the same requests against what this heap creates.
pub fn shared_pool(a: &heap::Allocator, file: &str) {
    let text = std::fs::read_to_string(file).expect("the trace file");
    let pool = pools::PoolId(1, 7);
    let (dev, s) = (0, 1u64);
    let mut live: HashMap<u64, (u64, u64)> = HashMap::new();
    let (mut torch_created, mut torch_now, mut torch_peak) = (0u64, 0u64, 0u64);
    let (mut requests, mut peak_res, mut peak_alloc) = (0u64, 0u64, 0u64);
    let base = a.stats(dev).map(|st| st.reserved_bytes).unwrap_or(0);
    a.begin_pool(dev, pool, None).expect("begin_pool");
    for line in parse(&text) {
        let Line::Event {
            action, size, addr, ..
        } = line
        else {
            continue;
        };
        match action.as_str() {
            "segment_alloc" => {
                torch_created += size;
                torch_now += size;
                torch_peak = torch_peak.max(torch_now);
            }
            "segment_free" => torch_now = torch_now.saturating_sub(size),
            "alloc" => {
                let p = a.malloc_in(size, dev, s, pool).expect("malloc");
                live.insert(addr, (p, size));
                requests += 1;
                let st = a.stats(dev).unwrap();
                peak_res = peak_res.max(st.reserved_bytes - base);
                peak_alloc = peak_alloc.max(st.allocated_bytes);
            }
            "free_completed" => {
                if let Some((p, sz)) = live.remove(&addr) {
                    a.free(p, sz, dev, s).expect("free");
                }
            }
            _ => {}
        }
    }
    let st = a.stats(dev).unwrap();
    println!(
        "replayed {requests} requests of {file}: PyTorch's allocator created {:.0} MiB of segments; \
         this heap created {:.0} MiB in the pool (peak reserved {:.0} MiB, peak allocated {:.0} \
         MiB, {} segments)",
        torch_created as f64 / MIB,
        (st.reserved_bytes - base) as f64 / MIB,
        peak_res as f64 / MIB,
        peak_alloc as f64 / MIB,
        st.segments
    );
}

/// `--replay-capture FILE`: the trace of a whole process (module header), phase by phase: what
/// PyTorch's allocator held in segments at each mark and at the end against this heap's
/// reserved bytes, and the capture's growth on each side (global_memory.py's "capture after
/// eager: device memory added" counts the same thing on the device).
pub fn capture(file: &str) {
    let text = std::fs::read_to_string(file).expect("the trace file");
    let (a, seen) = capture_backend();
    let dev = 0;
    let pool = pools::PoolId(1, 9);
    // Streams as PyTorch passed them: on the device the heap sees the legacy default stream as
    // 0 too (an id shifted by one here placed the eager steps differently before 795c2a4).
    let mut live: HashMap<u64, (u64, u64, Stream)> = HashMap::new();
    let (mut torch_now, mut requests) = (0u64, 0u64);
    let mut capture: Option<Option<Stream>> = None; // inside the capture: its stream, once seen
    let mut rows: Vec<(String, u64, u64)> = Vec::new();
    let row = |rows: &mut Vec<(String, u64, u64)>, name: &str, torch: u64, a: &heap::Allocator| {
        rows.push((
            name.to_string(),
            torch,
            a.stats(dev).unwrap().reserved_bytes,
        ));
    };
    for line in parse(&text) {
        match line {
            Line::Mark(name) => {
                row(&mut rows, &name, torch_now, &a);
                match name.as_str() {
                    // torch.cuda.graph empties the cache before it captures (global mode
                    // reaches symmalloc's empty_cache through the pool hooks).
                    "capture" => {
                        a.empty_cache().expect("empty_cache");
                        row(&mut rows, EMPTIED, torch_now, &a);
                        capture = Some(None);
                    }
                    "capture_end" => {
                        capture = None;
                        seen.lock().unwrap().capturing.clear();
                    }
                    _ => {}
                }
            }
            Line::Event {
                action,
                size,
                addr,
                stream,
            } => match action.as_str() {
                "segment_alloc" => torch_now += size,
                "segment_free" => torch_now = torch_now.saturating_sub(size),
                "alloc" => {
                    let s = stream;
                    // The capture's stream: the first to allocate after the mark (the
                    // backward, on autograd's thread, allocates on the same stream).
                    if let Some(None) = capture {
                        // PyTorch's empty_cache events follow the mark: its side of the row is
                        // what it holds at the capture's first request.
                        if let Some(r) = rows.iter_mut().find(|r| r.0 == EMPTIED) {
                            r.1 = torch_now;
                        }
                        capture = Some(Some(s));
                        seen.lock().unwrap().capturing.insert(s);
                    }
                    let into = if capture == Some(Some(s)) {
                        pool
                    } else {
                        pools::DEFAULT_POOL
                    };
                    let p = a.malloc_in(size, dev, s, into).expect("malloc");
                    live.insert(addr, (p, size, s));
                    requests += 1;
                }
                "free_completed" => {
                    if let Some((p, sz, s)) = live.remove(&addr) {
                        a.free(p, sz, dev, s).expect("free");
                    }
                }
                _ => {}
            },
        }
    }
    row(&mut rows, "end", torch_now, &a);
    println!("replayed {requests} requests of {file}; MiB held in segments at each mark:");
    println!("{:>28} | {:>9} | {:>9}", "mark", "PyTorch", "symmalloc");
    for (name, t, s) in &rows {
        println!(
            "{name:>28} | {:>9.0} | {:>9.0}",
            *t as f64 / MIB,
            *s as f64 / MIB
        );
    }
    let at = |n: &str| rows.iter().find(|r| r.0 == n);
    // global_memory.py's "capture after eager: device memory added": from before the side
    // stream's warm-up steps to the end of the capture.
    if let (Some(b), Some(e)) = (at("after_eager"), at("capture_end")) {
        println!(
            "capture after eager (capture_end - after_eager): PyTorch {:+.0} MiB, symmalloc {:+.0} MiB",
            (e.1 as f64 - b.1 as f64) / MIB,
            (e.2 as f64 - b.2 as f64) / MIB
        );
    }
    // Of which: what the default pool keeps through empty_cache (segments holding live eager
    // tensors), and what the capture's pool grows by.
    if let (Some(m), Some(e)) = (at(EMPTIED), at("capture_end")) {
        println!(
            "kept through empty_cache: PyTorch {:.0} MiB, symmalloc {:.0} MiB; the capture's pool \
             (capture_end - after empty_cache): PyTorch {:+.0} MiB, symmalloc {:+.0} MiB",
            m.1 as f64 / MIB,
            m.2 as f64 / MIB,
            (e.1 as f64 - m.1 as f64) / MIB,
            (e.2 as f64 - m.2 as f64) / MIB
        );
    }
    let broken = &seen.lock().unwrap().broken;
    if !broken.is_empty() {
        println!(
            "calls that would have broken the capture on CUDA: {}",
            broken.join(", ")
        );
    }
    if let Err(e) = a.validate(dev) {
        println!("heap validation failed: {e}");
    }
}
