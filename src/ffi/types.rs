//! C ABI types. Enumerations that C passes *in* are plain `uint32_t` typedefs with named
//! constants, so an out-of-range value is a checked error instead of undefined behaviour in
//! Rust; the status enum only ever flows out. Names are fixed by the project's contract (the C
//! ABI the README describes); values and fields are only ever appended. The checked conversions
//! from these C values to the library's own types live here too.
#![allow(non_camel_case_types)]

use crate::comm::algo::{Algo, DType, Quant, ReduceOp};
use crate::error::{Error, Result};
use std::ffi::c_char;

/// Result of every status-returning function.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum symm_status_t {
    SYMM_SUCCESS = 0,
    SYMM_ERR_INVALID_ARGUMENT = 1,
    SYMM_ERR_OUT_OF_MEMORY = 2,
    SYMM_ERR_CUDA = 3,
    SYMM_ERR_NO_DEVICE = 4,
    SYMM_ERR_NOT_SYMMETRIC = 5,
    SYMM_ERR_PEER = 6,
    SYMM_ERR_TIMEOUT = 7,
    SYMM_ERR_UNSUPPORTED = 8,
    SYMM_ERR_INTERNAL = 9,
}

/// Element type of a collective.
pub type symm_dtype_t = u32;
pub const SYMM_BF16: symm_dtype_t = 0;
pub const SYMM_FP16: symm_dtype_t = 1;
pub const SYMM_FP32: symm_dtype_t = 2;

/// Reduction operation.
pub type symm_op_t = u32;
pub const SYMM_SUM: symm_op_t = 0;
pub const SYMM_MAX: symm_op_t = 1;
pub const SYMM_MIN: symm_op_t = 2;

/// All-reduce algorithm.
pub type symm_algo_t = u32;
pub const SYMM_ALGO_AUTO: symm_algo_t = 0;
pub const SYMM_ALGO_ONE_SHOT: symm_algo_t = 1;
pub const SYMM_ALGO_TWO_SHOT: symm_algo_t = 2;
pub const SYMM_ALGO_MULTIMEM: symm_algo_t = 3;
/// One-shot without barriers (flags carried in the data), for messages up to
/// `SYMMALLOC_LL_BYTES` (default 4 MiB for 2 ranks, 1 MiB for 3-4, 256 KiB for 5-8).
pub const SYMM_ALGO_ONE_SHOT_LL: symm_algo_t = 4;

/// The FP8 (e4m3) output of `symm_all_reduce_add_rms_norm_quant`: where its scale comes from.
pub type symm_quant_t = u32;
/// One fp32 scale `s`, read from device memory by the kernel (a captured graph reads it at every
/// replay): `out_q = e4m3(y / s)`. An `s` that is not finite and > 0 makes every byte NaN.
pub const SYMM_QUANT_FP8_STATIC: symm_quant_t = 0;
/// A scale per row, written to `scale[tokens]`: `s_t = max(amax_t / 448, FLT_MIN)`.
pub const SYMM_QUANT_FP8_PER_TOKEN: symm_quant_t = 1;
/// A scale per 128 consecutive elements of a row (`hidden % 128 == 0`), the same formula over
/// the group, written row-major: `scale[t * (hidden / 128) + g]` for elements
/// `[g * 128, (g + 1) * 128)` of row t (a `[tokens, hidden / 128]` fp32 array; DeepGEMM-style
/// GEMMs that take the scales column-major want its transpose).
pub const SYMM_QUANT_FP8_PER_GROUP_128: symm_quant_t = 2;

/// Opaque bytes that identify one job; send them to every rank by any means.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct symm_unique_id_t {
    pub internal: [c_char; 128],
}

/// The driver's `CUstream` (`cudaStream_t`); spelled `struct CUstream_st *` in the header.
/// Opaque: never dereferenced.
pub struct CUstream_st {
    _opaque: [u8; 0],
}

/// A `symm_dtype_t` from C, checked.
pub fn dtype(v: symm_dtype_t) -> Result<DType> {
    match v {
        SYMM_BF16 => Ok(DType::Bf16),
        SYMM_FP16 => Ok(DType::Fp16),
        SYMM_FP32 => Ok(DType::Fp32),
        _ => Err(Error::invalid(format!(
            "dtype {v} is not a symm_dtype_t; expected SYMM_BF16 (0), SYMM_FP16 (1) or SYMM_FP32 (2)"
        ))),
    }
}

/// A `symm_op_t` from C, checked.
pub fn op(v: symm_op_t) -> Result<ReduceOp> {
    match v {
        SYMM_SUM => Ok(ReduceOp::Sum),
        SYMM_MAX => Ok(ReduceOp::Max),
        SYMM_MIN => Ok(ReduceOp::Min),
        _ => Err(Error::invalid(format!(
            "op {v} is not a symm_op_t; expected SYMM_SUM (0), SYMM_MAX (1) or SYMM_MIN (2)"
        ))),
    }
}

/// A `symm_algo_t` from C, checked.
pub fn algo(v: symm_algo_t) -> Result<Algo> {
    match v {
        SYMM_ALGO_AUTO => Ok(Algo::Auto),
        SYMM_ALGO_ONE_SHOT => Ok(Algo::OneShot),
        SYMM_ALGO_TWO_SHOT => Ok(Algo::TwoShot),
        SYMM_ALGO_MULTIMEM => Ok(Algo::Multimem),
        SYMM_ALGO_ONE_SHOT_LL => Ok(Algo::OneShotLL),
        _ => Err(Error::invalid(format!(
            "algo {v} is not a symm_algo_t; expected SYMM_ALGO_AUTO (0), ONE_SHOT (1), \
             TWO_SHOT (2), MULTIMEM (3) or ONE_SHOT_LL (4)"
        ))),
    }
}

/// A `symm_quant_t` from C, checked.
pub fn quant(v: symm_quant_t) -> Result<Quant> {
    match v {
        SYMM_QUANT_FP8_STATIC => Ok(Quant::Static),
        SYMM_QUANT_FP8_PER_TOKEN => Ok(Quant::PerToken),
        SYMM_QUANT_FP8_PER_GROUP_128 => Ok(Quant::PerGroup128),
        _ => Err(Error::invalid(format!(
            "quant {v} is not a symm_quant_t; expected SYMM_QUANT_FP8_STATIC (0), \
             SYMM_QUANT_FP8_PER_TOKEN (1) or SYMM_QUANT_FP8_PER_GROUP_128 (2)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_values_are_named() {
        assert_eq!(algo(4).unwrap(), Algo::OneShotLL);
        assert!(dtype(7).unwrap_err().message.contains("dtype 7"));
        assert!(op(3).unwrap_err().message.contains("op 3"));
        assert!(algo(9).unwrap_err().message.contains("algo 9"));
        assert_eq!(quant(2).unwrap(), Quant::PerGroup128);
        assert!(quant(3).unwrap_err().message.contains("quant 3"));
    }
}
