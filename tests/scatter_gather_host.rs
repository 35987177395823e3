//! Reduce-scatter and all-gather with one process per rank on the host backend (real shared
//! memory, real sockets): against a float64 reference (reduce-scatter) and bit for bit
//! (all-gather), out of place, in place by NCCL's rule and staged from outside the heap, for
//! odd and even counts, every type and op, 2 to 4 ranks; then the errors: mismatched counts on
//! every rank, overlapping buffers, bad types, a NULL communicator.

use crate::common;
use common::*;
use std::ptr::null_mut;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Layout {
    Apart,
    InPlace,
    Staged,
}

fn cases_rank(c: Child) {
    let comm = init(&c);
    let seed: u64 = c.arg.parse().unwrap();
    let (rank, world) = (c.rank as usize, c.world as usize);
    let before = stats(c.rank);
    let mut case = 0u64;
    let mut staged_calls = 0;
    for &count in &[1usize, 7, 8, 9, 1031, 4099] {
        for (dtype, es) in dtypes() {
            for op in [SYMM_SUM, SYMM_MAX, SYMM_MIN, u32::MAX] {
                // u32::MAX: all-gather (no op)
                for place in [Layout::Apart, Layout::InPlace, Layout::Staged] {
                    case += 1;
                    let s = seed.wrapping_add(case * 7919);
                    let gather = op == u32::MAX;
                    let (send_n, recv_n) = if gather {
                        (count, world * count)
                    } else {
                        (world * count, count)
                    };
                    let big = world * count * es;
                    let heap = symm_malloc(big, c.rank, null_mut()) as *mut u8;
                    let other = symm_malloc(big, c.rank, null_mut()) as *mut u8;
                    assert!(!heap.is_null() && !other.is_null(), "{}", err());
                    let mut outside = vec![0u8; big]; // staged: the input is not in the heap
                                                      // SAFETY: every pointer below stays inside a live block of `big` bytes.
                    let (send, recv) = unsafe {
                        match (place, gather) {
                            (Layout::Apart, _) => (heap, other),
                            (Layout::InPlace, false) => (heap, heap.add(rank * count * es)),
                            (Layout::InPlace, true) => (heap.add(rank * count * es), heap),
                            (Layout::Staged, _) => (outside.as_mut_ptr(), other),
                        }
                    };
                    // SAFETY: send holds send_n elements, recv recv_n (see above).
                    unsafe {
                        if place != Layout::InPlace {
                            std::ptr::write_bytes(recv, 0xFF, recv_n * es); // NaN poison
                        }
                        for i in 0..send_n {
                            write_elem(send, dtype, i, input(s, c.rank, i));
                        }
                    }
                    let st = if gather {
                        symm_all_gather(comm, send as _, recv as _, count, dtype, null_mut())
                    } else {
                        symm_reduce_scatter(
                            comm,
                            send as _,
                            recv as _,
                            count,
                            dtype,
                            op,
                            null_mut(),
                        )
                    };
                    assert_eq!(
                        st,
                        symm_status_t::SYMM_SUCCESS,
                        "count {count} dtype {dtype} op {op} {place:?}: {}",
                        err()
                    );
                    staged_calls += (place == Layout::Staged) as u64;
                    for i in 0..recv_n {
                        // SAFETY: recv holds recv_n elements.
                        let got = unsafe { read_elem(recv, dtype, i) } as f64;
                        let want = if gather {
                            rounded(dtype, input(s, (i / count) as i32, i % count))
                        } else {
                            let vals = (0..world)
                                .map(|r| rounded(dtype, input(s, r as i32, rank * count + i)));
                            match op {
                                SYMM_SUM => vals.sum(),
                                SYMM_MAX => vals.fold(f64::MIN, f64::max),
                                _ => vals.fold(f64::MAX, f64::min),
                            }
                        };
                        let ok = if gather || op != SYMM_SUM {
                            got == want // a copy, or a pick: exact
                        } else {
                            (got - want).abs() <= tolerance(dtype) * want.abs().max(1.0)
                        };
                        assert!(
                            ok,
                            "rank {rank} count {count} dtype {dtype} op {op} {place:?} \
                             element {i}: {got} vs {want}"
                        );
                    }
                    symm_free(heap as _, big, c.rank, null_mut());
                    symm_free(other as _, big, c.rank, null_mut());
                    drop(outside);
                }
            }
        }
    }
    let after = stats(c.rank);
    assert_eq!(
        after.staged_collectives - before.staged_collectives,
        staged_calls,
        "every staged call is counted"
    );
    destroy(comm);
    println!("rank {rank}: {case} reduce-scatter / all-gather cases correct");
}

#[test]
fn reduce_scatter_and_all_gather_match_reference_on_2_to_4_ranks() {
    if let Some(c) = child() {
        return cases_rank(c);
    }
    let seed = seed();
    for world in 2..=4 {
        assert_all_ok(&run_ranks(
            "reduce_scatter_and_all_gather_match_reference_on_2_to_4_ranks",
            world,
            &[HOST],
            &seed.to_string(),
        ));
    }
}

fn errors_rank(c: Child) {
    let comm = init(&c);
    let p = symm_malloc(1 << 16, c.rank, null_mut());
    let q = symm_malloc(1 << 16, c.rank, null_mut());
    // A first call shares the segments; then the ranks disagree on the count: every rank is
    // told (by the call's own descriptor check), none hangs, and the next call works.
    let st = symm_all_gather(comm, p, q, 16, SYMM_FP32, null_mut());
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    let n = if c.rank == 0 { 16 } else { 32 };
    let st = symm_reduce_scatter(comm, p, q, n, SYMM_FP32, SYMM_SUM, null_mut());
    assert_eq!(st, symm_status_t::SYMM_ERR_NOT_SYMMETRIC, "{}", err());
    assert!(
        err().contains("other buffer offsets, count, type"),
        "{}",
        err()
    );
    let st = symm_all_gather(comm, p, q, 16, SYMM_FP32, null_mut());
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "usable after: {}", err());
    // Overlap that is not in place, on every rank alike: refused before any communication.
    // SAFETY: 4 bytes into a live 64 KiB block.
    let shifted = unsafe { (p as *mut u8).add(4) } as *mut std::ffi::c_void;
    let st = symm_reduce_scatter(comm, p, shifted, 16, SYMM_FP32, SYMM_SUM, null_mut());
    assert_eq!(st, symm_status_t::SYMM_ERR_INVALID_ARGUMENT, "{}", err());
    assert!(err().contains("overlap; in place means recv = send + rank * recv_count"));
    let st = symm_all_gather(comm, shifted, p, 16, SYMM_FP32, null_mut());
    assert_eq!(st, symm_status_t::SYMM_ERR_INVALID_ARGUMENT);
    assert!(
        err().contains("send = recv + rank * send_count"),
        "{}",
        err()
    );
    // Bad arguments name what is wrong.
    assert_eq!(
        symm_all_gather(comm, p, q, 16, 9, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("dtype 9 is not a symm_dtype_t"), "{}", err());
    assert_eq!(
        symm_reduce_scatter(comm, p, q, 16, SYMM_FP32, 7, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("op 7 is not a symm_op_t"), "{}", err());
    assert_eq!(
        symm_reduce_scatter(comm, null_mut(), q, 16, SYMM_FP32, SYMM_SUM, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        symm_reduce_scatter(comm, p, q, usize::MAX / 2, SYMM_FP32, SYMM_SUM, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("overflows"), "{}", err());
    assert_eq!(
        symm_all_gather(null_mut(), p, q, 16, SYMM_FP32, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    // Count 0 is a no-op, not an error.
    assert_eq!(
        symm_all_gather(comm, p, q, 0, SYMM_FP32, null_mut()),
        symm_status_t::SYMM_SUCCESS
    );
    symm_free(p, 1 << 16, c.rank, null_mut());
    symm_free(q, 1 << 16, c.rank, null_mut());
    destroy(comm);
}

#[test]
fn scatter_gather_errors_are_clear_and_leave_the_communicator_usable() {
    if let Some(c) = child() {
        return errors_rank(c);
    }
    assert_all_ok(&run_ranks(
        "scatter_gather_errors_are_clear_and_leave_the_communicator_usable",
        2,
        &[HOST, ("SYMMALLOC_TIMEOUT_S", "10")],
        "",
    ));
}
