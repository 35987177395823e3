//! The C entry point of the fused all-reduce + residual + RMSNorm with an FP8 output
//! (kernels/quant.cuh; docs/DESIGN.md, "Quantized output"). Arguments are checked by the same
//! code as the bf16 call's (comm/call.rs), with the output's and the scale's own rules.

use super::types::*;
use super::{stream_of, with_comm};
use crate::comm::call::{QuantOut, Rms};
use std::ffi::c_void;

use super::guard::guard_status;

/// All-reduce + residual add + RMSNorm with an FP8 e4m3 output, for FP8 GEMMs: as
/// `symm_all_reduce_add_rms_norm` (`residual` updated alike), but the output is
/// `out_q[t, h] = e4m3(y[t, h] / s)` (one byte per element, round to nearest even, saturated to
/// +-448, NaN stays NaN) from the kernel's fp32 `y = r * rsqrt(mean(r^2) + eps) * weight`, with
/// `s` as `quant` says (SYMM_QUANT_FP8_STATIC: `scale[0]`, read; PER_TOKEN: `scale[t]`, written;
/// PER_GROUP_128: `scale[t * hidden / 128 + g]`, written, `hidden % 128 == 0`). bf16 or fp16
/// inputs; `out_q` 8-byte and `scale` 4-byte aligned; no two buffers may overlap. Every rank gets
/// the same bits, and a row's bits do not depend on the call's row count. Stream-ordered and
/// capturable (a static scale is read at every replay).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn symm_all_reduce_add_rms_norm_quant(
    comm: *mut super::symm_comm_t,
    x: *const c_void,
    residual: *mut c_void,
    weight: *const c_void,
    out_q: *mut c_void,
    scale: *mut f32,
    tokens: usize,
    hidden: usize,
    eps: f32,
    dtype: symm_dtype_t,
    quant: symm_quant_t,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_all_reduce_add_rms_norm_quant", || {
        let dtype = super::guard::dtype(dtype)?;
        let mode = super::guard::quant(quant)?;
        let rms = Rms {
            residual: residual as u64,
            weight: weight as u64,
            out: out_q as u64,
            tokens: tokens as u64,
            hidden: hidden as u64,
            eps,
            quant: Some(QuantOut {
                mode,
                scale: scale as u64,
            }),
        };
        with_comm(comm, |c| {
            c.all_reduce_add_rms_norm(x as u64, rms, dtype, stream_of(stream))
        })
    })
}
