//! The fused all-reduce + residual + RMSNorm with one process per rank on the host backend:
//! against a float64 reference, residual updated in place, every rank's bytes identical (each
//! rank prints a hash of its outputs, the parent compares them), x staged from outside the heap
//! too; then the errors, each naming the value.

use crate::common;
use common::*;
use std::ptr::null_mut;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

const EPS: f32 = 1e-5;

fn cases_rank(c: Child) {
    let comm = init(&c);
    let seed: u64 = c.arg.parse().unwrap();
    let world = c.world;
    let mut hash = 0xcbf29ce484222325u64;
    let mut case = 0u64;
    for dtype in [SYMM_BF16, SYMM_FP16] {
        for &(tokens, hidden) in &[(1usize, 8usize), (3, 64), (5, 4096)] {
            for staged in [false, true] {
                case += 1;
                let s = seed.wrapping_add(case * 104_729);
                let n = tokens * hidden;
                let bytes = n * 2;
                let x = symm_malloc(bytes, c.rank, null_mut()) as *mut u8;
                let res = symm_malloc(bytes, c.rank, null_mut()) as *mut u8;
                let out = symm_malloc(bytes, c.rank, null_mut()) as *mut u8;
                let w = symm_malloc(hidden * 2, c.rank, null_mut()) as *mut u8;
                let mut outside = vec![0u128; bytes.div_ceil(16)]; // 16-byte aligned
                let xp = if staged {
                    outside.as_mut_ptr() as *mut u8
                } else {
                    x
                };
                // Every rank's residual and weight are the same (as in a replicated model).
                // SAFETY: each pointer holds the elements written.
                unsafe {
                    for i in 0..n {
                        write_elem(xp, dtype, i, input(s, c.rank, i));
                        write_elem(res, dtype, i, input(s ^ 1, 100, i));
                    }
                    for j in 0..hidden {
                        write_elem(w, dtype, j, 0.5 + input(s ^ 2, 200, j).abs() / 4.0);
                    }
                    std::ptr::write_bytes(out, 0xFF, bytes);
                }
                let st = symm_all_reduce_add_rms_norm(
                    comm,
                    xp as _,
                    res as _,
                    w as _,
                    out as _,
                    tokens,
                    hidden,
                    EPS,
                    dtype,
                    null_mut(),
                );
                assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
                let (mut num_r, mut num_o, mut den_r, mut den_o) = (0f64, 0f64, 0f64, 0f64);
                for t in 0..tokens {
                    let r: Vec<f64> = (0..hidden)
                        .map(|j| {
                            let i = t * hidden + j;
                            (0..world)
                                .map(|q| rounded(dtype, input(s, q, i)))
                                .sum::<f64>()
                                + rounded(dtype, input(s ^ 1, 100, i))
                        })
                        .collect();
                    let ms = r.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
                    let inv = 1.0 / (ms + EPS as f64).sqrt();
                    for (j, rv) in r.iter().enumerate() {
                        let i = t * hidden + j;
                        let wv = rounded(dtype, 0.5 + input(s ^ 2, 200, j).abs() / 4.0);
                        let want_o = rv * inv * wv;
                        // SAFETY: res and out hold n elements.
                        let (got_r, got_o) = unsafe {
                            (
                                read_elem(res, dtype, i) as f64,
                                read_elem(out, dtype, i) as f64,
                            )
                        };
                        assert!(got_o.is_finite(), "element {i} of out not written");
                        num_r += (got_r - rv).powi(2);
                        den_r += rv * rv;
                        num_o += (got_o - want_o).powi(2);
                        den_o += want_o * want_o;
                    }
                }
                let (er, eo) = ((num_r / den_r).sqrt(), (num_o / den_o).sqrt());
                let what = format!("dtype {dtype} tokens {tokens} hidden {hidden} staged {staged}");
                assert!(
                    er <= tolerance(dtype) && eo <= tolerance(dtype),
                    "{what}: residual {er}, out {eo}"
                );
                // SAFETY: as above.
                for b in unsafe {
                    std::slice::from_raw_parts(res, bytes)
                        .iter()
                        .chain(std::slice::from_raw_parts(out, bytes))
                } {
                    hash = (hash ^ *b as u64).wrapping_mul(0x100000001b3);
                }
                for (p, len) in [(x, bytes), (res, bytes), (out, bytes), (w, hidden * 2)] {
                    symm_free(p as _, len, c.rank, null_mut());
                }
            }
        }
    }
    // Errors, named, and nothing runs.
    let p = symm_malloc(1 << 16, c.rank, null_mut());
    let q = symm_malloc(1 << 16, c.rank, null_mut());
    let r = symm_malloc(1 << 16, c.rank, null_mut());
    let w = symm_malloc(1 << 12, c.rank, null_mut());
    let call = |x, res, out, hidden, eps, dtype| {
        symm_all_reduce_add_rms_norm(comm, x, res, w, out, 2, hidden, eps, dtype, null_mut())
    };
    assert_eq!(
        call(p, q, r, 12, EPS, SYMM_BF16),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("hidden 12 is not supported; expected a multiple of 8 from 8 to 16384"));
    assert_eq!(
        call(p, q, r, 32768, EPS, SYMM_BF16),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        call(p, q, r, 64, EPS, SYMM_FP32),
        symm_status_t::SYMM_ERR_UNSUPPORTED
    );
    assert_eq!(
        call(p, q, r, 64, -1.0, SYMM_BF16),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("eps -1"), "{}", err());
    assert_eq!(
        call(p, q, p, 64, EPS, SYMM_BF16),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(
        err().contains("out") && err().contains("overlaps x"),
        "{}",
        err()
    );
    // SAFETY: 2 bytes into a live block: misaligned on purpose.
    let odd = unsafe { (q as *mut u8).add(2) } as *mut std::ffi::c_void;
    assert_eq!(
        call(p, odd, r, 64, EPS, SYMM_BF16),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(
        err().contains("residual") && err().contains("16-byte aligned"),
        "{}",
        err()
    );
    // Still usable: a good call after the refusals.
    assert_eq!(
        call(p, q, r, 64, EPS, SYMM_BF16),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
    for (b, len) in [(p, 1 << 16), (q, 1 << 16), (r, 1 << 16), (w, 1 << 12)] {
        symm_free(b, len, c.rank, null_mut());
    }
    destroy(comm);
    println!("rank {}: outputs hash {hash:016x}", c.rank);
}

#[test]
fn fused_rms_norm_matches_reference_and_is_identical_on_every_rank() {
    if let Some(c) = child() {
        return cases_rank(c);
    }
    let seed = seed();
    for world in [2, 3] {
        let outs = run_ranks(
            "fused_rms_norm_matches_reference_and_is_identical_on_every_rank",
            world,
            &[HOST],
            &seed.to_string(),
        );
        assert_all_ok(&outs);
        assert_same_output_hash(&outs);
    }
}
