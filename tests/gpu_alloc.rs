//! Allocator and kernel tests on a real GPU (CUDA backend). Without a GPU each test prints
//! "SKIPPED ...: no GPU" and returns; they run on the device machine (bench/RESULTS.md, "GPU test suite").

mod common;
use common::*;
use std::ptr::null_mut;
use symmalloc::cuda::util;
use symmalloc::ffi::*;
use symmalloc::heap::cuda_backend::CudaBackend;
use symmalloc::heap::pools::{self, PoolId};
use symmalloc::heap::Allocator;

fn f32s(v: &[f32]) -> &[u8] {
    // SAFETY: plain f32 data.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) }
}

fn read_f32(device: i32, ptr: u64, n: usize) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    util::dtoh(device, &mut b, ptr).unwrap();
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_malloc_write_read_free() {
    gpus("gpu_malloc_write_read_free");
    for size in [512usize, 4096, 1 << 20, 3 << 20, 64 << 20] {
        let p = symm_malloc(size, 0, null_mut());
        assert!(!p.is_null(), "{}", err());
        let data: Vec<u8> = (0..size).map(|i| (i * 131 + 7) as u8).collect();
        util::htod(0, p as u64, &data).unwrap();
        let mut back = vec![0u8; size];
        util::dtoh(0, &mut back, p as u64).unwrap();
        assert!(back == data, "size {size}: read back differs");
        symm_free(p, size, 0, null_mut());
        assert_eq!(err(), "");
    }
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_random_sequences_on_cuda_memory() {
    gpus("gpu_random_sequences_on_cuda_memory");
    let a = Allocator::new(Box::new(CudaBackend::new().unwrap())).unwrap();
    let mut rng = Rng::new(seed());
    let mut live: Vec<(u64, u64, u8)> = Vec::new();
    for step in 0..400 {
        if live.is_empty() || rng.below(100) < 55 {
            let size = if rng.below(5) == 0 {
                (1 << 20) + rng.below(30 << 20)
            } else {
                1 + rng.below(256 << 10)
            };
            let p = a.malloc_in(size, 0, 0, pools::DEFAULT_POOL).unwrap();
            let pat = (step % 250) as u8 + 1;
            let n = size.min(8192) as usize;
            util::htod(0, p, &vec![pat; n]).unwrap();
            util::htod(0, p + size - n as u64, &vec![pat; n]).unwrap();
            live.push((p, size, pat));
        } else {
            let (p, size, pat) = live.swap_remove(rng.below(live.len() as u64) as usize);
            let n = size.min(8192) as usize;
            for at in [p, p + size - n as u64] {
                let mut b = vec![0u8; n];
                util::dtoh(0, &mut b, at).unwrap();
                assert!(
                    b.iter().all(|&x| x == pat),
                    "block {p:#x} was overwritten: overlap"
                );
            }
            a.free(p, size, 0, 0).unwrap();
        }
        a.validate(0).unwrap();
        let mut v: Vec<(u64, u64)> = live.iter().map(|&(p, s, _)| (p, s)).collect();
        v.sort();
        assert!(v.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
    }
    for (p, size, _) in live {
        a.free(p, size, 0, 0).unwrap();
    }
    a.empty_cache().unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!(
        (s.allocated_bytes, s.reserved_bytes, s.segments),
        (0, 0, 0),
        "{s:?}"
    );
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_embedded_kernel_runs_on_a_stream() {
    gpus("gpu_embedded_kernel_runs_on_a_stream");
    let n = 100_003usize;
    let x = symm_malloc(n * 4, 0, null_mut()) as u64;
    let y = symm_malloc(n * 4, 0, null_mut()) as u64;
    let mut rng = Rng::new(seed());
    let xs: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
    let ys: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
    util::htod(0, x, f32s(&xs)).unwrap();
    util::htod(0, y, f32s(&ys)).unwrap();
    let s = util::stream_create(0).unwrap();
    util::saxpy(0, s, 3.0, x, y, n as u64).unwrap();
    util::stream_sync(0, s).unwrap();
    let out = read_f32(0, y, n);
    for i in 0..n {
        assert!(
            (out[i] - (3.0 * xs[i] + ys[i])).abs() <= 1e-6,
            "y[{i}] = {}",
            out[i]
        );
    }
    symm_free(x as _, n * 4, 0, null_mut());
    symm_free(y as _, n * 4, 0, null_mut());
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_graph_that_allocates_computes_and_frees() {
    gpus("gpu_graph_that_allocates_computes_and_frees");
    let n = 65_536usize;
    let s = util::stream_create(0).unwrap();
    let x = symm_malloc(n * 4, 0, s as _) as u64;
    let y = symm_malloc(n * 4, 0, s as _) as u64;
    let before = stats(0);
    // Capture: allocate a temporary in a private pool (as PyTorch does for graphs), compute
    // y = 2x + y through it, free it.
    let pool = PoolId(77, 1);
    util::capture_begin(0, s).unwrap();
    pools::begin(0, pool).unwrap();
    let t = symm_malloc(n * 4, 0, s as _) as u64;
    assert_ne!(t, 0, "{}", err());
    util::saxpy(0, s, 0.0, x, t, n as u64).unwrap(); // t = t (no-op pass, keeps t in the graph)
    util::saxpy(0, s, 2.0, x, y, n as u64).unwrap();
    symm_free(t as _, n * 4, 0, s as _);
    pools::end(0, pool).unwrap();
    let graph = util::capture_end(0, s).unwrap();
    let mut rng = Rng::new(seed());
    for replay in 0..1000 {
        let xs: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        let ys: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        util::htod_async(0, x, f32s(&xs), s).unwrap();
        util::htod_async(0, y, f32s(&ys), s).unwrap();
        graph.launch(s).unwrap();
        util::stream_sync(0, s).unwrap();
        if replay % 100 == 0 || replay == 999 {
            let out = read_f32(0, y, n);
            for i in 0..n {
                let want = 2.0 * xs[i] + ys[i];
                assert!(
                    (out[i] - want).abs() <= 1e-6,
                    "replay {replay} y[{i}] = {} (x {} y {}), expected {want}",
                    out[i],
                    xs[i],
                    ys[i]
                );
            }
        }
    }
    drop(graph);
    symm_release_pool(0, 77, 1);
    let after = stats(0);
    assert_eq!(
        after.active_blocks, before.active_blocks,
        "graph's temporary leaked"
    );
    assert_eq!(after.allocated_bytes, before.allocated_bytes);
    symm_free(x as _, n * 4, 0, s as _);
    symm_free(y as _, n * 4, 0, s as _);
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_cross_stream_reuse_waits_for_the_old_stream() {
    gpus("gpu_cross_stream_reuse_waits_for_the_old_stream");
    let n = 1 << 22;
    let (s1, s2) = (
        util::stream_create(0).unwrap(),
        util::stream_create(0).unwrap(),
    );
    let z = symm_malloc(n * 4, 0, s2 as _) as u64;
    let x = symm_malloc(n * 4, 0, s1 as _) as u64;
    let y = symm_malloc(n * 4, 0, s1 as _) as u64;
    util::htod(0, z, f32s(&vec![1.0; n])).unwrap();
    util::htod(0, x, f32s(&vec![1.0; n])).unwrap();
    util::htod(0, y, f32s(&vec![0.0; n])).unwrap();
    // Queue a lot of work on s1 that reads x, free x on s1, and reuse it on s2 at once.
    for _ in 0..50 {
        util::saxpy(0, s1, 1.0, x, y, n as u64).unwrap();
    }
    symm_free(x as _, n * 4, 0, s1 as _);
    let x2 = symm_malloc(n * 4, 0, s2 as _) as u64;
    assert_eq!(
        x2, x,
        "the block is reused (deterministically) by the other stream"
    );
    // Overwrite on s2 (x2 += 100 * z): must wait for s1's 50 reads of the old contents.
    util::saxpy(0, s2, 100.0, z, x2, n as u64).unwrap();
    symm_record_stream(x2 as _, s1 as _);
    util::stream_sync(0, s2).unwrap();
    util::stream_sync(0, s1).unwrap();
    let out = read_f32(0, y, n);
    assert!(
        out.iter().all(|&v| v == 50.0),
        "y = {} (reads raced with the reuse)",
        out[0]
    );
    symm_free(x2 as _, n * 4, 0, s2 as _);
    symm_free(y as _, n * 4, 0, s1 as _);
    symm_free(z as _, n * 4, 0, s2 as _);
}

/// Graph replay of y = 2x + y with x, y from `alloc`; uploads sync (htod) or on the stream.
fn graph_replays(alloc: &dyn Fn(usize) -> u64, async_upload: bool) -> Result<(), String> {
    let n = 65_536usize;
    let s = util::stream_create(0).unwrap();
    let (x, y) = (alloc(n * 4), alloc(n * 4));
    util::capture_begin(0, s).unwrap();
    util::saxpy(0, s, 2.0, x, y, n as u64).unwrap();
    let graph = util::capture_end(0, s).unwrap();
    let mut rng = Rng::new(seed());
    for replay in 0..300 {
        let xs: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        let ys: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        if async_upload {
            util::htod_async(0, x, f32s(&xs), s).unwrap();
            util::htod_async(0, y, f32s(&ys), s).unwrap();
        } else {
            util::htod(0, x, f32s(&xs)).unwrap();
            util::htod(0, y, f32s(&ys)).unwrap();
        }
        graph.launch(s).unwrap();
        util::stream_sync(0, s).unwrap();
        let out = read_f32(0, y, n);
        let bad = (0..n)
            .filter(|&i| (out[i] - (2.0 * xs[i] + ys[i])).abs() > 1e-6)
            .count();
        if bad > 0 {
            return Err(format!("replay {replay}: {bad} wrong elements"));
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_graph_replay_experiment() {
    gpus("gpu_graph_replay_experiment");
    let sym = |b: usize| symm_malloc(b, 0, null_mut()) as u64;
    let raw = |b: usize| util::raw_alloc(0, b).unwrap();
    for (name, alloc, async_upload) in [
        (
            "symmalloc, sync upload",
            &sym as &dyn Fn(usize) -> u64,
            false,
        ),
        ("cuMemAlloc, sync upload", &raw, false),
        ("symmalloc, stream upload", &sym, true),
        ("cuMemAlloc, stream upload", &raw, true),
    ] {
        println!(
            "EXPERIMENT {name}: {:?}",
            graph_replays(alloc, async_upload)
        );
    }
}

/// `symm_empty_cache` gives a freed block's segment back only after the work queued on it has
/// finished: `cuMemUnmap` and `cuMemRelease` do not wait, so without the wait the kernels below
/// would read unmapped memory (an illegal-address fault at the stream sync).
#[test]
#[ignore = "needs GPUs: run with --include-ignored on a GPU machine"]
fn gpu_empty_cache_waits_for_queued_work() {
    gpus("gpu_empty_cache_waits_for_queued_work");
    let n = 1 << 24; // 64 MiB of f32: a segment of its own
    let s1 = util::stream_create(0).unwrap();
    let x = symm_malloc(n * 4, 0, s1 as _) as u64;
    let y = symm_malloc(n * 4, 0, s1 as _) as u64;
    util::htod(0, x, f32s(&vec![1.0; n])).unwrap();
    util::htod(0, y, f32s(&vec![0.0; n])).unwrap();
    for _ in 0..50 {
        util::saxpy(0, s1, 1.0, x, y, n as u64).unwrap(); // milliseconds of reads of x
    }
    let released = stats(0).physical_releases;
    symm_free(x as _, n * 4, 0, s1 as _);
    symm_empty_cache();
    assert!(
        stats(0).physical_releases > released,
        "x's segment went back"
    );
    util::stream_sync(0, s1).unwrap();
    let out = read_f32(0, y, n);
    assert!(out.iter().all(|&v| v == 50.0), "y = {}", out[0]);
    symm_free(y as _, n * 4, 0, s1 as _);
}
