//! Staging that only some ranks do, with one process per rank on the host backend: a rank whose
//! buffer is outside the symmetric heap stages it through the communicator's scratch, and when a
//! peer's buffer is in the heap the call is asymmetric. Every rank must be told so at once
//! (SYMM_ERR_NOT_SYMMETRIC, naming which rank staged), not wait for the timeout, and the
//! communicator must then run a correct call. All-reduce, the fused call, reduce-scatter and
//! all-gather, with the heap buffer's segment already shared or new, and the scratch new or
//! already shared.

use crate::common;
use common::*;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::time::{Duration, Instant};
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

/// The timeout the ranks run under; a call that fails must fail well before it.
const TIMEOUT_S: &str = "5";
const PROMPT: Duration = Duration::from_secs(2);

/// Elements of each call (fp32 for the plain collectives, bf16 for the fused call): 4 MiB of
/// fp32, more than the room left in the segment that holds the communicator's internal block,
/// so a scratch for it is a new segment.
const N: usize = 1 << 20;
const HIDDEN: usize = 64;

struct Bufs {
    comm: *mut symm_comm_t,
    rank: i32,
    world: i32,
    /// Heap blocks of BYTES: the input, the output, the fused call's residual, out, weight.
    x: *mut c_void,
    y: *mut c_void,
    res: *mut c_void,
    out: *mut c_void,
    w: *mut c_void,
    /// Plain memory of the same size (16-byte aligned), outside the heap.
    plain: Vec<u128>,
    plain_out: Vec<u128>,
}

/// Bytes of each buffer: the largest extent (N fp32 times 2 ranks).
const BYTES: usize = 8 << 20;

impl Bufs {
    fn new(c: &Child, comm: *mut symm_comm_t) -> Self {
        let m = || {
            let p = symm_malloc(BYTES, c.rank, null_mut());
            assert!(!p.is_null(), "{}", err());
            p
        };
        let b = Bufs {
            comm,
            rank: c.rank,
            world: c.world,
            x: m(),
            y: m(),
            res: m(),
            out: m(),
            w: m(),
            plain: vec![0; BYTES / 16],
            plain_out: vec![0; BYTES / 16],
        };
        // SAFETY: w is a live block of BYTES bytes; HIDDEN bf16 ones.
        unsafe {
            for j in 0..HIDDEN {
                write_elem(b.w as *mut u8, SYMM_BF16, j, 1.0);
            }
        }
        b
    }

    fn plain(&mut self) -> *mut c_void {
        self.plain.as_mut_ptr() as _
    }

    fn plain_out(&mut self) -> *mut c_void {
        self.plain_out.as_mut_ptr() as _
    }

    /// The collective `what` with `send` (and a recv of the same kind: in the heap when `send`
    /// is, else outside it), every input element set to 1.
    fn call(&mut self, what: &str, staged: bool) -> symm_status_t {
        let (send, recv) = if staged {
            (self.plain(), self.plain_out())
        } else {
            (self.x, self.y)
        };
        let world = self.world as usize;
        // SAFETY: send holds BYTES bytes, more than any call below reads.
        unsafe {
            for i in 0..N * world {
                let (dt, p) = if what == "fused" {
                    (SYMM_BF16, send as *mut u8)
                } else {
                    (SYMM_FP32, send as *mut u8)
                };
                if (i + 1) * 4 <= BYTES {
                    write_elem(p, dt, i, 1.0);
                }
            }
        }
        match what {
            "all_reduce" => {
                symm_all_reduce(self.comm, send, recv, N, SYMM_FP32, SYMM_SUM, null_mut())
            }
            "reduce_scatter" => {
                symm_reduce_scatter(self.comm, send, recv, N, SYMM_FP32, SYMM_SUM, null_mut())
            }
            "all_gather" => symm_all_gather(self.comm, send, recv, N, SYMM_FP32, null_mut()),
            "fused" => symm_all_reduce_add_rms_norm(
                self.comm,
                send,
                self.res,
                self.w,
                self.out,
                N / HIDDEN,
                HIDDEN,
                1e-5,
                SYMM_BF16,
                null_mut(),
            ),
            _ => unreachable!("{what}"),
        }
    }

    /// A call every rank makes alike must succeed.
    fn ok(&mut self, what: &str, staged: bool, when: &str) {
        let st = self.call(what, staged);
        assert_eq!(
            st,
            symm_status_t::SYMM_SUCCESS,
            "rank {}: {what} ({when}, staged {staged}) on every rank: {}",
            self.rank,
            err()
        );
    }

    /// Rank `stager` stages, the others do not: every rank fails at once, told which rank
    /// staged.
    fn asymmetric(&mut self, what: &str, stager: i32, when: &str) {
        let staged = self.rank == stager;
        let needle = format!("rank {stager} staged this collective");
        self.disagree(what, staged, when, &needle);
    }

    /// A call the ranks disagree on (this rank stages when `staged`): NOT_SYMMETRIC at once,
    /// with `needle` in the message.
    fn disagree(&mut self, what: &str, staged: bool, when: &str, needle: &str) {
        let t = Instant::now();
        let st = self.call(what, staged);
        let took = t.elapsed();
        let e = err();
        assert_eq!(
            st,
            symm_status_t::SYMM_ERR_NOT_SYMMETRIC,
            "rank {}: {what} ({when}), after {took:?}: {e}",
            self.rank
        );
        assert!(
            took < PROMPT,
            "rank {}: {what} ({when}) took {took:?} to fail",
            self.rank
        );
        assert!(
            e.contains(needle),
            "rank {}: {what} ({when}): expected {needle:?} in: {e}",
            self.rank
        );
    }
}

/// For one collective (the test's argument): the asymmetric call in each state of the segments,
/// each followed by calls every rank makes alike, which must work.
fn one_stager_rank(c: Child) {
    let what = c.arg.clone();
    let comm = init(&c);
    let mut b = Bufs::new(&c, comm);
    // The heap buffers' segments shared; rank 1's scratch new.
    b.ok(&what, false, "warm-up");
    b.asymmetric(&what, 1, "scratch new, heap shared");
    b.ok(&what, false, "after the scratch-new failure");
    // Every rank stages (scratch made and shared everywhere), then only rank 1 does.
    b.ok(&what, true, "all staged");
    b.asymmetric(&what, 1, "scratch shared, heap shared");
    b.ok(&what, true, "all staged again");
    b.ok(&what, false, "after the scratch-shared failure");
    // A new heap segment on the ranks that do not stage, the scratch already shared.
    let big = BYTES;
    let fresh = symm_malloc(big, c.rank, null_mut());
    assert!(!fresh.is_null(), "{}", err());
    let keep = b.x;
    b.x = fresh;
    b.asymmetric(&what, 1, "heap new, scratch shared");
    b.ok(&what, false, "after the heap-new failure");
    b.x = keep;
    // No rank stages, but only rank 0's buffer that peers touch (the input; all-gather's
    // output) is in a segment new to the peers.
    let fresh0 = symm_malloc(big, c.rank, null_mut());
    assert!(!fresh0.is_null(), "{}", err());
    let keep_y = b.y;
    if c.rank == 0 {
        if what == "all_gather" {
            b.y = fresh0;
        } else {
            b.x = fresh0;
        }
    }
    let needle = "rank 0 touches a segment for the first time";
    b.disagree(&what, false, "heap new on rank 0 only", needle);
    (b.x, b.y) = (keep, keep_y);
    b.ok(&what, false, "after the one-sided new segment");
    // Rank 0 stages this time, into a scratch rank 0 already shared.
    b.asymmetric(&what, 0, "rank 0 stages");
    b.ok(&what, false, "at the end");
    b.ok(&what, true, "at the end");
    for p in [fresh, fresh0] {
        symm_free(p, big, c.rank, null_mut());
    }
    for p in [b.x, b.y, b.res, b.out, b.w] {
        symm_free(p, BYTES, c.rank, null_mut());
    }
    destroy(comm);
    println!(
        "rank {}: {what}: one-sided staging reported at once",
        c.rank
    );
}

fn run(test: &str, what: &str) {
    assert_all_ok(&run_ranks(
        test,
        2,
        &[HOST, ("SYMMALLOC_TIMEOUT_S", TIMEOUT_S)],
        what,
    ));
}

#[test]
fn all_reduce_staged_on_one_rank_fails_at_once_on_every_rank() {
    if let Some(c) = child() {
        return one_stager_rank(c);
    }
    run(
        "all_reduce_staged_on_one_rank_fails_at_once_on_every_rank",
        "all_reduce",
    );
}

#[test]
fn fused_call_staged_on_one_rank_fails_at_once_on_every_rank() {
    if let Some(c) = child() {
        return one_stager_rank(c);
    }
    run(
        "fused_call_staged_on_one_rank_fails_at_once_on_every_rank",
        "fused",
    );
}

#[test]
fn reduce_scatter_staged_on_one_rank_fails_at_once_on_every_rank() {
    if let Some(c) = child() {
        return one_stager_rank(c);
    }
    run(
        "reduce_scatter_staged_on_one_rank_fails_at_once_on_every_rank",
        "reduce_scatter",
    );
}

#[test]
fn all_gather_staged_on_one_rank_fails_at_once_on_every_rank() {
    if let Some(c) = child() {
        return one_stager_rank(c);
    }
    run(
        "all_gather_staged_on_one_rank_fails_at_once_on_every_rank",
        "all_gather",
    );
}
