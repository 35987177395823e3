//! MoE dispatch and combine (docs/moe.md) on GPUs, one process per GPU or `SYMM_TEST_RANKS=N`
//! with `SYMMALLOC_SHARED_GPU=1` on fewer (run on the device machine; `#[ignore]`d, so
//! `cargo test` lists them as not run). The scenarios of tests/moe_host.rs on device memory
//! (tests/common/moe/: the reference sweep, changing routing, arrival order, a split
//! child, every error, create arguments, a dead peer), where the kernels report what only the
//! routing shows at the next call or `symm_moe_check` after a stream sync. Then CUDA graphs:
//! dispatch, an expert on the device (the rows copied, each element pair read as fp32 doubled
//! 1 + e % 3 times: tests/common/moe/mod.rs `Expert::Pairs`) and combine captured once and
//! replayed with new routing written into the same buffers before each replay. Repeated
//! combines of one dispatch (tests/common/moe/repeat.rs) eagerly, back to back on the stream,
//! and a refused combine retried; and in a graph, one dispatch and two combines with different
//! device experts, both ys checked after every replay. The split halves
//! (tests/common/moe/split.rs) eagerly, a receive half on another stream than its send, and
//! dispatch + combine through the halves inside a CUDA graph with new routing per replay.

mod common;
use common::moe::cases::*;
use common::moe::edges::*;
use common::moe::errors::*;
use common::moe::quant::*;
use common::moe::repeat::*;
use common::moe::split::*;
use common::moe::*;
use common::*;
use std::ptr::null_mut;
use symmalloc::cuda::{mem, util};
use symmalloc::ffi::moe::*;
use symmalloc::ffi::moe_calls::*;

/// Runs `name` on one rank per GPU (or SYMM_TEST_RANKS); every rank must succeed and print its
/// "rank R:" line.
fn run_gpu(name: &str, env: &[(&str, &str)], dead: usize) -> Vec<std::process::Output> {
    let world = gpu_world(name);
    let outs = run_ranks(name, world, env, &seed().to_string());
    assert_all_ok(&outs);
    assert_ran(&outs, name, dead);
    for o in &outs {
        for l in String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.starts_with("rank "))
        {
            println!("{l}");
        }
    }
    outs
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_dispatch_and_combine_match_the_reference() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        let (cases, hash) = sweep(comm, dev, w, seed);
        destroy(comm);
        println!("rank {r}: outputs hash {hash:016x}; {cases} cases correct");
        return;
    }
    let outs = run_gpu("gpu_moe_dispatch_and_combine_match_the_reference", &[], 0);
    assert_same_output_hash(&outs);
}

/// FP8 quantized inside the dispatch kernel (tests/common/moe/quant.rs): every scale and e4m3
/// byte the kernel writes, in both scale layouts, with and without UE8M0, equals the kernels'
/// arithmetic mirrored on the host (the host backend's bytes) and the float64 reference as the
/// host test checks it; the pre-quantized path in the column-major layout; the new fields'
/// refusals and `x_scales` refused on a quantizing object.
#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_fp8_quantized_in_the_dispatch() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        let (rows, steps) = quantized(comm, dev, w, seed);
        quant_errors(comm, dev, w, r, seed);
        destroy(comm);
        println!("rank {r}: {rows} quantized rows exact ({steps} bytes one step from float64 at a midpoint)");
        return;
    }
    run_gpu("gpu_moe_fp8_quantized_in_the_dispatch", &[], 0);
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_routing_changing_every_call() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        let calls = epochs(comm, dev, w, seed, reps(48));
        destroy(comm);
        println!("rank {r}: {calls} calls correct");
        return;
    }
    run_gpu("gpu_moe_routing_changing_every_call", &[], 0);
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_arrival_order_and_a_split_child() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        let cases = arrival(comm, dev, w, seed);
        split_child(comm, dev, w, r, seed);
        destroy(comm);
        println!("rank {r}: {cases} cases the same bit for bit in two arrival orders");
        return;
    }
    run_gpu("gpu_moe_arrival_order_and_a_split_child", &[], 0);
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_errors_are_reported_on_every_rank_and_leave_it_usable() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        errors(comm, dev, w, seed);
        create_errors(comm, dev, w, r, seed);
        destroy(comm);
        println!("rank {r}: every error reported as expected");
        return;
    }
    let name = "gpu_moe_errors_are_reported_on_every_rank_and_leave_it_usable";
    run_gpu(name, &[], 0);
}

/// The one-wait protocol's edges on GPUs (tests/common/moe/edges.rs): grids capped by
/// `num_sms` to 1 and 3 blocks (many tokens per block, blocks with none), one expert receiving
/// every row, zero tokens, dispatches back to back before one combine, create's config words.
#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_protocol_edges_and_num_sms() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        let cases = edges(comm, dev, w, seed);
        destroy(comm);
        println!("rank {r}: {cases} edge cases correct");
        return;
    }
    run_gpu("gpu_moe_protocol_edges_and_num_sms", &[], 0);
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_a_dead_peer_times_out_naming_it() {
    if let Some(c) = child() {
        let (comm, dev, w, _, seed) = rank_setup(&c, Dev::cuda);
        dead_peer(comm, dev, w, seed, 2.0);
        destroy(comm);
        return;
    }
    let env = [("SYMMALLOC_TIMEOUT_S", "2")];
    run_gpu("gpu_moe_a_dead_peer_times_out_naming_it", &env, 1);
}

/// The pair expert on the device (`Expert::Pairs(shift)`): the landed rows copied into `eo`, then
/// each local expert's part doubled 1 + (e + shift) % 3 times as fp32 words (stream-ordered).
fn pairs_on_device(o: &Obj, eo: &Buf, shift: usize) {
    let (dev, s) = (o.dev, o.s);
    let bytes = (o.l * o.r * s.row()) as u64;
    mem::copy_async(dev.device, eo.p, o.lay.recv_x as u64, bytes, dev.stream).unwrap();
    for le in 0..o.l {
        let e = o.rank * o.l + le;
        let part = eo.p + (le * o.r * s.h * 2) as u64;
        let words = (o.r * s.h / 2) as u64;
        for _ in 0..1 + (e + shift) % 3 {
            util::saxpy(dev.device, dev.stream, 1.0, part, part, words).unwrap();
        }
    }
}

/// Captures dispatch + the pair expert + combine once, then replays it with new inputs and
/// routing written into the same buffers each time; every replay's receive buffers and y are
/// checked as an eager call's. Eager calls after the replays still work (the device's call
/// counters moved with the replays).
fn graph_rank(c: &Child) {
    let (comm, dev, w, r, seed) = rank_setup(c, Dev::cuda);
    let s = Shape::new(64, 256, 4, experts(w, 8), false);
    let o = create(comm, s, dev);
    let (n, k, rows) = (s.t, s.topk, o.l * o.r);
    let x = Buf::new(dev, n * s.row());
    let idx = Buf::new(dev, n * k as usize * 4);
    let wts = Buf::new(dev, n * k as usize * 4);
    let eo = Buf::new(dev, rows * s.h * 2);
    let y = Buf::new(dev, n * s.h * 2);
    util::capture_begin(dev.device, dev.stream).unwrap();
    let a = Args {
        x: x.ptr(),
        sc: null_mut(),
        idx: idx.ptr(),
        it: SYMM_INDEX_INT32,
        w: wts.ptr() as _,
        n,
        k,
    };
    assert_eq!(dispatch(&o, &a), OK, "captured dispatch: {}", err());
    pairs_on_device(&o, &eo, 0);
    let st = symm_moe_combine(o.moe, eo.ptr(), y.ptr(), dev.s());
    assert_eq!(st, OK, "captured combine: {}", err());
    let graph = util::capture_end(dev.device, dev.stream).unwrap();
    let routes = [Route::Random, Route::Holes, Route::Hot(1), Route::Sparse];
    let replays = reps(40);
    for i in 0..replays {
        let c = Case::new(seed ^ (i << 16), n, k, routes[i as usize % 4]);
        let all: Vec<Inputs> = (0..w).map(|src| rank_inputs(&s, &c, w, src)).collect();
        let me = &all[r];
        dev.put(x.p, &me.x);
        dev.put(idx.p, &me.idx_bytes(false));
        dev.put(wts.p, &f32_bytes(&me.w));
        poison_recv(&o);
        dev.fill(y.p, y.bytes, POISON);
        graph.launch(dev.stream).unwrap();
        dev.sync();
        assert_eq!(symm_moe_check(o.moe), OK, "replay {i}: {}", err());
        let what = format!("rank {r} replay {i}");
        check_recv(&o, &c, &all, &read_recv(&o), &what);
        check_y(&o, &c, Expert::Pairs(0), me, &y.get(), &what);
    }
    drop(graph);
    for i in 0..4 {
        let c = Case::new(seed ^ 0xeaa0 ^ i, n, k, routes[i as usize]);
        run_case(&o, &c, Expert::Scale, [0, 0]);
    }
    drop(o);
    destroy(comm);
    println!("rank {r}: {replays} graph replays and 4 eager calls after them correct");
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_graph_replays_follow_new_routing() {
    if let Some(c) = child() {
        return graph_rank(&c);
    }
    run_gpu("gpu_moe_graph_replays_follow_new_routing", &[], 0);
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_repeated_combines_and_a_refused_one_retried() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        let made = repeated_combines(comm, dev, w, seed, reps(48));
        let rounds = refused_combine_retried(comm, dev, w, seed, reps(24));
        destroy(comm);
        println!("rank {r}: {made} repeated combines and {rounds} refused ones retried correct");
        return;
    }
    run_gpu(
        "gpu_moe_repeated_combines_and_a_refused_one_retried",
        &[],
        0,
    );
}

/// Captures one dispatch and two combines of it (the pair expert with shifts 0 and 1 on the
/// device, between them nothing but the second expert) once, replays it with new routing; both
/// ys are checked after every replay (the second combine must not reach the first's landing
/// buffer or flags on a slower rank), then eager calls still work.
fn graph_repeat_rank(c: &Child) {
    let (comm, dev, w, r, seed) = rank_setup(c, Dev::cuda);
    let s = repeat_shape(w);
    let o = create(comm, s, dev);
    let (n, k, rows) = (s.t, s.topk, o.l * o.r);
    let x = Buf::new(dev, n * s.row());
    let idx = Buf::new(dev, n * k as usize * 4);
    let wts = Buf::new(dev, n * k as usize * 4);
    let eo = [Buf::new(dev, rows * s.h * 2), Buf::new(dev, rows * s.h * 2)];
    let y = [Buf::new(dev, n * s.h * 2), Buf::new(dev, n * s.h * 2)];
    util::capture_begin(dev.device, dev.stream).unwrap();
    let a = Args {
        x: x.ptr(),
        sc: null_mut(),
        idx: idx.ptr(),
        it: SYMM_INDEX_INT32,
        w: wts.ptr() as _,
        n,
        k,
    };
    assert_eq!(dispatch(&o, &a), OK, "captured dispatch: {}", err());
    pairs_on_device(&o, &eo[0], 0);
    pairs_on_device(&o, &eo[1], 1);
    for i in 0..2 {
        let st = symm_moe_combine(o.moe, eo[i].ptr(), y[i].ptr(), dev.s());
        assert_eq!(st, OK, "captured combine {i}: {}", err());
    }
    let graph = util::capture_end(dev.device, dev.stream).unwrap();
    let routes = [Route::Random, Route::Holes, Route::Hot(1), Route::Sparse];
    let replays = reps(40);
    for i in 0..replays {
        let c = Case::new(seed ^ (i << 16) ^ 0x9e9, n, k, routes[i as usize % 4]);
        let all: Vec<Inputs> = (0..w).map(|src| rank_inputs(&s, &c, w, src)).collect();
        let me = &all[r];
        dev.put(x.p, &me.x);
        dev.put(idx.p, &me.idx_bytes(false));
        dev.put(wts.p, &f32_bytes(&me.w));
        for b in &y {
            dev.fill(b.p, b.bytes, POISON);
        }
        graph.launch(dev.stream).unwrap();
        dev.sync();
        assert_eq!(symm_moe_check(o.moe), OK, "replay {i}: {}", err());
        for (j, b) in y.iter().enumerate() {
            let what = format!("rank {r} replay {i} combine {j}");
            check_y(&o, &c, Expert::Pairs(j as u32), me, &b.get(), &what);
        }
    }
    drop(graph);
    let made = repeated_combines(comm, dev, w, seed ^ 0x51, 4);
    drop(o);
    destroy(comm);
    println!("rank {r}: {replays} graph replays of two combines and {made} eager ones after them correct");
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_graph_replays_of_two_combines_of_one_dispatch() {
    if let Some(c) = child() {
        return graph_repeat_rank(&c);
    }
    run_gpu(
        "gpu_moe_graph_replays_of_two_combines_of_one_dispatch",
        &[],
        0,
    );
}

/// The split scenarios of tests/moe_split_host.rs on GPUs (the halves equal to the one-call
/// forms bit for bit with a barrier or a pause between them, two objects interleaved, repeated
/// combines through the halves, every misuse, the clock probe's %globaltimer words), then each
/// receive half on a second stream (the library orders it after its send half).
#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_split_halves_match_the_one_call_forms() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        let cases = split_matches_one_call(comm, dev, w, seed);
        let rounds = two_batch_overlap(comm, dev, w, seed, reps(12));
        let made = split_repeated_combines(comm, dev, w, seed, reps(16));
        split_misuse(comm, dev, w, seed);
        probe_words(comm, dev, w, seed);
        let other = other_stream_rank(comm, dev, w, seed);
        destroy(comm);
        println!(
            "rank {r}: {cases} split cases, {rounds} overlapped rounds, {made} split combines, \
             {other} receives on another stream correct"
        );
        return;
    }
    run_gpu("gpu_moe_split_halves_match_the_one_call_forms", &[], 0);
}

/// Sends on the object's stream, receives on a second one (eager: the library puts an event
/// between them); the results checked after the second stream's work.
fn other_stream_rank(comm: Comm, dev: Dev, w: usize, seed: u64) -> u64 {
    let s = Shape::new(32, 256, 4, experts(w, 8), false);
    let o = create(comm, s, dev);
    let other = util::stream_create(dev.device).unwrap();
    let on_other = Dev {
        stream: other,
        ..dev
    };
    let rounds = reps(8);
    for i in 0..rounds {
        let c = Case::new(seed ^ (i << 12) ^ 0x0a5, s.t, 4, Route::Random);
        let all: Vec<Inputs> = (0..w).map(|src| rank_inputs(&s, &c, w, src)).collect();
        let me = &all[o.rank];
        let st = stage(&o, me, 4, false);
        poison_recv(&o);
        expect_ok(&o, dispatch_send(&o, &st.a), "send");
        let rc = symm_moe_dispatch_recv(o.moe, on_other.s());
        assert_eq!(rc, OK, "recv on another stream: {}", err());
        on_other.sync();
        let recv = read_recv(&o);
        check_recv(&o, &c, &all, &recv, &format!("round {i}"));
        let eo = Buf::with(dev, &expert_out(&o, Expert::Scale, &recv));
        let y = Buf::new(dev, me.n * s.h * 2);
        dev.fill(y.p, y.bytes, POISON);
        let st2 = symm_moe_combine_send(o.moe, eo.ptr(), y.ptr(), on_other.s());
        assert_eq!(st2, OK, "combine_send: {}", err());
        assert_eq!(symm_moe_combine_recv(o.moe, dev.s()), OK, "{}", err());
        dev.sync();
        assert_eq!(symm_moe_check(o.moe), OK, "round {i}: {}", err());
        check_y(&o, &c, Expert::Scale, me, &y.get(), &format!("round {i}"));
    }
    rounds
}

/// Captures dispatch send, other work (the pair expert's copy of the last rows into a scratch
/// buffer), dispatch receive, the pair expert, combine send, combine receive once; replays it
/// with new routing; every replay's rows and y checked, then eager split calls still work.
fn graph_split_rank(c: &Child) {
    let (comm, dev, w, r, seed) = rank_setup(c, Dev::cuda);
    let s = Shape::new(64, 256, 4, experts(w, 8), false);
    let o = create(comm, s, dev);
    let (n, k, rows) = (s.t, s.topk, o.l * o.r);
    let x = Buf::new(dev, n * s.row());
    let idx = Buf::new(dev, n * k as usize * 4);
    let wts = Buf::new(dev, n * k as usize * 4);
    let eo = Buf::new(dev, rows * s.h * 2);
    let scratch = Buf::new(dev, rows * s.h * 2);
    let y = Buf::new(dev, n * s.h * 2);
    let a = Args {
        x: x.ptr(),
        sc: null_mut(),
        idx: idx.ptr(),
        it: SYMM_INDEX_INT32,
        w: wts.ptr() as _,
        n,
        k,
    };
    util::capture_begin(dev.device, dev.stream).unwrap();
    assert_eq!(dispatch_send(&o, &a), OK, "captured send: {}", err());
    pairs_on_device(&o, &scratch, 2); // work between the halves
    assert_eq!(dispatch_recv(&o), OK, "captured recv: {}", err());
    pairs_on_device(&o, &eo, 0);
    let st = symm_moe_combine_send(o.moe, eo.ptr(), y.ptr(), dev.s());
    assert_eq!(st, OK, "captured combine send: {}", err());
    let st = symm_moe_combine_recv(o.moe, dev.s());
    assert_eq!(st, OK, "captured combine recv: {}", err());
    let graph = util::capture_end(dev.device, dev.stream).unwrap();
    let routes = [Route::Random, Route::Holes, Route::Hot(1), Route::Sparse];
    let replays = reps(40);
    for i in 0..replays {
        let c = Case::new(seed ^ (i << 16) ^ 0x5e1, n, k, routes[i as usize % 4]);
        let all: Vec<Inputs> = (0..w).map(|src| rank_inputs(&s, &c, w, src)).collect();
        let me = &all[r];
        dev.put(x.p, &me.x);
        dev.put(idx.p, &me.idx_bytes(false));
        dev.put(wts.p, &f32_bytes(&me.w));
        poison_recv(&o);
        dev.fill(y.p, y.bytes, POISON);
        graph.launch(dev.stream).unwrap();
        dev.sync();
        assert_eq!(symm_moe_check(o.moe), OK, "replay {i}: {}", err());
        let what = format!("rank {r} split replay {i}");
        check_recv(&o, &c, &all, &read_recv(&o), &what);
        check_y(&o, &c, Expert::Pairs(0), me, &y.get(), &what);
    }
    drop(graph);
    let made = split_repeated_combines(comm, dev, w, seed ^ 0x77, 4);
    drop(o);
    destroy(comm);
    println!("rank {r}: {replays} graph replays of the split halves and {made} eager split combines after them correct");
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_split_halves_in_a_cuda_graph() {
    if let Some(c) = child() {
        return graph_split_rank(&c);
    }
    run_gpu("gpu_moe_split_halves_in_a_cuda_graph", &[], 0);
}

/// Throughput mode (docs/moe.md, "Throughput mode", kernels/moe_tp.cu): the host tests'
/// scenarios (tests/common/moe/tp.rs) on device memory: the reference sweep (uniform, skewed,
/// every token to one rank, FP8), repeated combines, every error (reported at the next call or
/// `symm_moe_check` after a sync), create's mode checks, the clock probe's %globaltimer words.
#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_throughput_mode_matches_the_reference() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        let (cases, hash) = common::moe::tp::tp_sweep(comm, dev, w, seed);
        let made = common::moe::tp::tp_repeated(comm, dev, w, seed, 6);
        let grids = common::moe::tp::tp_grids(comm, dev, w, seed);
        common::moe::tp_errors::tp_errors(comm, dev, w, seed);
        common::moe::tp_errors::tp_create_errors(comm, dev, w, r);
        common::moe::tp::tp_probe_words(comm, dev, w, seed);
        destroy(comm);
        println!(
            "rank {r}: outputs hash {hash:016x}; {cases} cases, {made} repeated calls and {grids} \
             cases on set grids correct"
        );
        return;
    }
    let outs = run_gpu("gpu_moe_throughput_mode_matches_the_reference", &[], 0);
    assert_same_output_hash(&outs);
}

/// The throughput mode's FP8 options (tests/common/moe/tp_quant.rs): bf16 x quantized inside
/// the dispatch kernel, every scale and e4m3 byte exact against the host arithmetic and within
/// one step of float64 at midpoints, row-major and column-major TMA scales, UE8M0, the caller's
/// FP8 with column-major scales, `x_scales` refused on a quantizing object.
#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_throughput_fp8_quantized_in_the_dispatch() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        let (rows, steps) = common::moe::tp_quant::tp_quantized(comm, dev, w, seed);
        common::moe::tp_quant::tp_quant_errors(comm, dev, w, seed);
        destroy(comm);
        println!("rank {r}: {rows} rows exact ({steps} bytes one step from float64 at a midpoint)");
        return;
    }
    run_gpu("gpu_moe_throughput_fp8_quantized_in_the_dispatch", &[], 0);
}

/// The throughput mode's split halves (tests/common/moe/tp_split.rs): the send and receive
/// kernels give what the one-call kernels give with work between them (a grid of one block
/// too), two objects interleaved, repeated split combines, misuse and a refused send half; then
/// the four halves captured into one CUDA graph with other work between them, replayed with new
/// routing (bf16 and the caller's FP8), every replay's receive buffers and y checked.
#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_moe_throughput_split_halves() {
    if let Some(c) = child() {
        let (comm, dev, w, r, seed) = rank_setup(&c, Dev::cuda);
        let cases = common::moe::tp_split::tp_split_matches_one_call(comm, dev, w, seed);
        let made = common::moe::tp_split::tp_two_batch_overlap(comm, dev, w, seed, 4);
        common::moe::tp_split::tp_split_misuse(comm, dev, w, seed);
        let replays = tp_graph_split(comm, dev, w, seed);
        destroy(comm);
        println!(
            "rank {r}: {cases} split cases, {made} interleaved calls and {replays} graph replays \
             correct"
        );
        return;
    }
    run_gpu("gpu_moe_throughput_split_halves", &[], 0);
}

/// The throughput halves in one captured graph (dispatch send, a copy between the halves,
/// dispatch receive, combine send, combine receive), replayed with new routing: the inputs and
/// the expert rows (what the caller's experts would leave for the received rows, computed here
/// from every rank's inputs) are written before each replay. Returns the replays.
fn tp_graph_split(comm: Comm, dev: Dev, w: usize, seed: u64) -> u64 {
    use common::moe::tp::*;
    let mut replays = 0;
    for s in [
        Shape::new(32, 256, 4, (4 * w) as u32, false),
        Shape::new(16, 256, 4, experts(w, 8), true),
    ] {
        let o = tp_create(comm, s, dev);
        let (n, k, rows) = (s.t, s.topk, w * s.t);
        let x = Buf::new(dev, n * s.row());
        let sc = Buf::new(dev, (n * s.sc() * 4).max(16));
        let idx = Buf::new(dev, n * k as usize * 4);
        let wts = Buf::new(dev, n * k as usize * 4);
        let eo = Buf::new(dev, rows * s.h * 2);
        let scratch = Buf::new(dev, rows * s.h * 2);
        let y = Buf::new(dev, n * s.h * 2);
        let scp = if s.fp8 {
            sc.ptr() as *const f32
        } else {
            null_mut()
        };
        util::capture_begin(dev.device, dev.stream).unwrap();
        let st = symm_moe_dispatch_send(
            o.moe,
            x.ptr(),
            scp,
            idx.ptr(),
            SYMM_INDEX_INT32,
            wts.ptr() as _,
            n,
            k,
            dev.s(),
        );
        assert_eq!(st, OK, "captured send: {}", err());
        // Work between the halves: a copy on the same stream.
        mem::copy_async(dev.device, scratch.p, eo.p, eo.bytes as u64, dev.stream).unwrap();
        assert_eq!(
            symm_moe_dispatch_recv(o.moe, dev.s()),
            OK,
            "captured recv: {}",
            err()
        );
        let st = symm_moe_combine_send(o.moe, eo.ptr(), y.ptr(), dev.s());
        assert_eq!(st, OK, "captured combine send: {}", err());
        assert_eq!(
            symm_moe_combine_recv(o.moe, dev.s()),
            OK,
            "captured combine recv: {}",
            err()
        );
        let graph = util::capture_end(dev.device, dev.stream).unwrap();
        let routes = [Route::Random, Route::Holes, Route::Hot(1), Route::Sparse];
        for i in 0..reps(20) {
            let c = Case::new(seed ^ (i << 16) ^ 0x7e1, n, k, routes[i as usize % 4]);
            let all: Vec<Inputs> = (0..w).map(|src| rank_inputs(&s, &c, w, src)).collect();
            let me = &all[o.rank];
            dev.put(x.p, &me.x);
            if s.fp8 {
                dev.put(sc.p, &f32_bytes(&me.scales));
            }
            dev.put(idx.p, &me.idx_bytes(false));
            dev.put(wts.p, &f32_bytes(&me.w));
            // The expert rows of this replay's received rows (want_recv's order), as the
            // caller's experts would leave them.
            let want = want_recv(&o, &all, o.rank);
            let rows_out = tp_expert_out(&o, &all, &want, 0);
            dev.put(eo.p, &rows_out.get());
            dev.fill(y.p, y.bytes, POISON);
            graph.launch(dev.stream).unwrap();
            dev.sync();
            assert_eq!(symm_moe_check(o.moe), OK, "replay {i}: {}", err());
            let what = format!("rank {} throughput split replay {i} {s:?}", o.rank);
            check_tp_recv(&o, &all, &what);
            let got: Vec<u16> = y.get()[..me.n * s.h * 2]
                .chunks(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            assert!(
                got == want_y(&o, &all, 0),
                "{what}: y differs from the contract's"
            );
            replays += 1;
        }
        drop(graph);
    }
    replays
}
