//! Symmetric memory you program yourself, on GPUs (run on the device machine; `#[ignore]`d, see
//! docs/development.md, "GPU runs"): rendezvous and peer views, put/signal/wait around a ring with fresh
//! data every round (destinations poisoned before each), the same captured into CUDA graphs,
//! the device view, and bounded waits: alone on one rank and on a peer that died (the stream is
//! released and the next call names the slot and the peer). Every rank on its own GPU, or
//! `SYMM_TEST_RANKS=N` with `SYMMALLOC_SHARED_GPU=1` on fewer.

mod common;
use common::*;
use std::ffi::c_void;
use std::ptr::null_mut;
use symmalloc::comm::device_comm::*;
use symmalloc::cuda::util;
use symmalloc::ffi::p2p::*;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

const OK: symm_status_t = symm_status_t::SYMM_SUCCESS;

fn ok(st: symm_status_t, c: &Child, what: &str) {
    assert_eq!(st, OK, "rank {} {what}: {}", c.rank, err());
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn read(device: i32, p: u64, n: usize) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    util::dtoh(device, &mut b, p).unwrap();
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

struct Ring {
    n: usize,
    buf: u64,
    src: u64,
    stream: u64,
}

impl Ring {
    fn slice(&self, r: usize) -> u64 {
        self.buf + (r * self.n * 4) as u64
    }
}

/// One round: fresh data into `src`, put into the next rank's slice `me`, signal slot `me`
/// with `v`, wait for slot `prev` = v. Enqueued only (captured, when the stream captures).
fn enqueue_round(c: &Child, comm: *mut symm_comm_t, g: &Ring, v: u64) {
    let w = c.world as usize;
    let me = c.rank as usize;
    let (next, prev) = ((me + 1) % w, (me + w - 1) % w);
    let s = g.stream as *mut CUstream_st;
    let dst = g.slice(me) as *mut c_void;
    ok(
        symm_put(comm, next as i32, dst, g.src as _, g.n * 4, s),
        c,
        "put",
    );
    ok(symm_signal(comm, next as i32, me as u32, v, s), c, "signal");
    ok(symm_wait(comm, prev as u32, v, s), c, "wait");
}

/// Checks the slice `prev` holds prev's data of `seed`, then poisons it and acknowledges on
/// slot 64 + me (prev may then overwrite it), waiting for next's acknowledgement.
fn check_and_ack(c: &Child, comm: *mut symm_comm_t, g: &Ring, seed: u64, ack: u64) {
    let w = c.world as usize;
    let me = c.rank as usize;
    let (next, prev) = ((me + 1) % w, (me + w - 1) % w);
    util::stream_sync(c.device, g.stream).unwrap();
    let got = read(c.device, g.slice(prev), g.n);
    for (i, v) in got.iter().enumerate() {
        assert_eq!(
            v.to_bits(),
            input(seed, prev as i32, i).to_bits(),
            "rank {me}: element {i} from rank {prev}, seed {seed}"
        );
    }
    // Stream-ordered (the stream does not wait for the legacy stream, and a pageable copy may
    // land after cuMemcpyHtoD returns); the buffer lives until the stream syncs below.
    let poison = vec![0xffu8; g.n * 4];
    util::htod_async(c.device, g.slice(prev), &poison, g.stream).unwrap();
    let s = g.stream as *mut CUstream_st;
    ok(
        symm_signal(comm, prev as i32, 64 + me as u32, ack, s),
        c,
        "ack",
    );
    ok(
        symm_wait(comm, 64 + next as u32, ack, s),
        c,
        "wait for the ack",
    );
    util::stream_sync(c.device, g.stream).unwrap();
}

fn ring(c: &Child) {
    let comm = init(c);
    let w = c.world as usize;
    let n = 65_537usize;
    let stream = util::stream_create(c.device).unwrap();
    let bytes = n * 4 * w;
    let buf = symm_malloc(bytes, c.device, stream as _) as u64;
    let src = util::raw_alloc(c.device, n * 4).unwrap(); // a source outside the heap
    assert!(buf != 0, "{}", err());
    ok(symm_rendezvous(comm, buf as _, bytes), c, "rendezvous");
    let g = Ring {
        n,
        buf,
        src,
        stream,
    };
    // Peer views agree with the device view.
    let mut d = DeviceComm::default();
    ok(
        symm_comm_device(comm, &mut d, std::mem::size_of::<DeviceComm>()),
        c,
        "symm_comm_device",
    );
    assert_eq!((d.world, d.rank), (c.world, c.rank));
    for r in 0..c.world {
        let mut q: *mut c_void = null_mut();
        ok(symm_peer_ptr(comm, buf as _, r, &mut q), c, "peer_ptr");
        let own = d.heap_bases[c.rank as usize];
        assert_eq!(q as u64, d.heap_bases[r as usize] + (buf - own));
    }
    // One seed for every rank (each rank checks another's data): the parent's.
    let seed: u64 = c.arg.parse().expect("the parent passes the seed");
    let rounds = reps(50);
    for round in 1..=rounds {
        let data = f32s(
            &(0..n)
                .map(|i| input(seed + round, c.rank, i))
                .collect::<Vec<_>>(),
        );
        util::htod_async(c.device, src, &data, stream).unwrap();
        enqueue_round(c, comm, &g, round);
        check_and_ack(c, comm, &g, seed + round, round);
    }
    // Captured: each graph carries its own values (a captured signal stores the same value at
    // every replay), so every graph here is launched once, with values above the eager ones.
    for k in 1..=3u64 {
        let data = f32s(
            &(0..n)
                .map(|i| input(seed + 1000 + k, c.rank, i))
                .collect::<Vec<_>>(),
        );
        util::htod_async(c.device, src, &data, stream).unwrap();
        util::capture_begin(c.device, stream).unwrap();
        enqueue_round(c, comm, &g, rounds + k);
        let graph = util::capture_end(c.device, stream).unwrap();
        graph.launch(stream).unwrap();
        check_and_ack(c, comm, &g, seed + 1000 + k, rounds + k);
    }
    println!(
        "rank {}: {} eager and 3 graphed rounds correct",
        c.rank, rounds
    );
    ok(symm_barrier(comm, stream as _), c, "barrier");
    util::stream_sync(c.device, stream).unwrap();
    symm_free(buf as _, bytes, c.device, stream as _);
    util::raw_free(c.device, src).unwrap();
    destroy(comm);
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_p2p_ring_eager_and_graphed() {
    if let Some(c) = child() {
        return ring(&c);
    }
    let world = gpu_world("gpu_p2p_ring_eager_and_graphed");
    let s = seed().to_string();
    assert_all_ok(&run_ranks("gpu_p2p_ring_eager_and_graphed", world, &[], &s));
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_p2p_one_rank_ring_and_a_wait_nobody_answers() {
    if let Some(c) = child() {
        ring(&c);
        // Alone, nobody raises slot 11: the wait gives up after the timeout, the stream goes
        // on, and the next call names the slot.
        let comm = init(&c);
        let stream = util::stream_create(c.device).unwrap();
        let t = std::time::Instant::now();
        ok(symm_wait(comm, 11, 1, stream as _), &c, "enqueue the wait");
        util::stream_sync(c.device, stream).unwrap();
        let took = t.elapsed().as_secs_f64();
        assert!(
            (1.0..10.0).contains(&took),
            "the wait held the stream {took} s"
        );
        let st = symm_signal(comm, 0, 0, 1, stream as _);
        assert_eq!(st, symm_status_t::SYMM_ERR_TIMEOUT, "{}", err());
        let e = err();
        assert!(e.contains("signal slot 11 stayed at 0"), "{e}");
        assert!(e.contains("no rank has raised it"), "{e}");
        destroy(comm);
        return;
    }
    gpus("gpu_p2p_one_rank_ring_and_a_wait_nobody_answers");
    assert_all_ok(&run_ranks(
        "gpu_p2p_one_rank_ring_and_a_wait_nobody_answers",
        1,
        &[("SYMMALLOC_TIMEOUT_S", "1")],
        &seed().to_string(),
    ));
}

#[test]
#[ignore = "needs GPUs (2, or SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1)"]
fn gpu_p2p_a_wait_on_a_dead_peer_releases_the_stream_and_names_it() {
    if let Some(c) = child() {
        let comm = init(&c);
        let stream = util::stream_create(c.device).unwrap();
        if c.rank != 0 {
            ok(symm_signal(comm, 0, 9, 1, stream as _), &c, "signal");
            util::stream_sync(c.device, stream).unwrap();
            // SAFETY: ends this process at once: no destroy, no exit handlers.
            unsafe { libc::_exit(0) };
        }
        ok(
            symm_wait(comm, 9, 1, stream as _),
            &c,
            "the signal that came",
        );
        let t = std::time::Instant::now();
        ok(symm_wait(comm, 9, 2, stream as _), &c, "enqueue the wait");
        util::stream_sync(c.device, stream).unwrap();
        let took = t.elapsed().as_secs_f64();
        assert!(took < 15.0, "the wait held the stream {took} s");
        let st = symm_put(comm, 0, null_mut(), null_mut(), 0, stream as _);
        assert_eq!(st, OK, "a put of 0 bytes does nothing, reports nothing");
        let st = symm_signal(comm, 0, 0, 1, stream as _);
        assert_eq!(st, symm_status_t::SYMM_ERR_TIMEOUT, "{}", err());
        let e = err();
        assert!(
            e.contains("signal slot 9 stayed at 1, below the awaited 2"),
            "{e}"
        );
        assert!(e.contains("rank 1 raised it last"), "{e}");
        // Later calls say it again; queued collectives return at once.
        let st = symm_barrier(comm, stream as _);
        assert_eq!(st, symm_status_t::SYMM_ERR_TIMEOUT, "{}", err());
        destroy(comm);
        println!("rank 0: the wait gave up after {took:.1} s and named slot 9");
        return;
    }
    let world = gpu_world("gpu_p2p_a_wait_on_a_dead_peer_releases_the_stream_and_names_it");
    let outs = run_ranks(
        "gpu_p2p_a_wait_on_a_dead_peer_releases_the_stream_and_names_it",
        world.min(2),
        &[("SYMMALLOC_TIMEOUT_S", "2")],
        "",
    );
    assert_all_ok(&outs);
}
