//! C ABI types. Enumerations that C passes *in* are plain `uint32_t` typedefs with named
//! constants, so an out-of-range value is a checked error instead of undefined behaviour in
//! Rust; the status enum only ever flows out. Names are fixed by the project's contract (the C
//! ABI the README describes); values and fields are only ever appended. The checked conversions
//! from these C values to the library's own types are guard.rs's (every entry point's boundary).
#![allow(non_camel_case_types)]

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
