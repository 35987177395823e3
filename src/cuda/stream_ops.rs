//! Stream memory operations (`cuStreamWriteValue*`, `cuStreamWaitValue*`):
//! writes and waits that the GPU's front end executes in stream order, with no kernel and no
//! SM. Capturable (they become memory-operation nodes of a graph). Used by the p2p signals
//! (comm/p2p.rs); the wait is unbounded, so the library itself only uses it in benchmarks.

use super::driver::{check, CtxGuard};
use crate::error::Result;
use cudarc::driver::sys;

/// After the stream's earlier work: stores `word` (u32) at `word_addr`, then `value` (u64) at
/// `value_addr`, the second behind a memory barrier (the driver's "similar to
/// __threadfence_system(), scoped to the stream"), so whoever sees `value` also sees the
/// stream's earlier writes. Two stream memory operations, no kernel. (One cuStreamBatchMemOp of
/// the same two writes was refused with CUDA_ERROR_INVALID_VALUE on an H100, driver 580.159.)
pub fn write_u32_then_u64(
    device: i32,
    stream: u64,
    word_addr: u64,
    word: u32,
    value_addr: u64,
    value: u64,
) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: word_addr is a device-accessible 4-byte word (the caller's checked signal pad);
    // the stream is the caller's.
    check(
        unsafe {
            sys::cuStreamWriteValue32_v2(
                stream as sys::CUstream,
                word_addr,
                word,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER as u32,
            )
        },
        "cuStreamWriteValue32",
    )?;
    write_u64(device, stream, value_addr, value)
}

/// After the stream's earlier work: stores `value` at `addr` behind a memory barrier.
pub fn write_u64(device: i32, stream: u64, addr: u64, value: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: addr is a device-accessible 8-byte word (checked by the caller); the stream is
    // the caller's.
    check(
        unsafe {
            sys::cuStreamWriteValue64_v2(
                stream as sys::CUstream,
                addr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        },
        "cuStreamWriteValue64",
    )
}

/// Holds the stream until the u64 at `addr` is >= `value` (unsigned). Unbounded: a value that
/// never comes holds the stream for good, so the library's own waits are kernels
/// (bench/NOTES.md, "Signals and waits"); this one is for measuring against them.
pub fn wait_geq_u64(device: i32, stream: u64, addr: u64, value: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: addr is a device-accessible 8-byte word (checked by the caller); the stream is
    // the caller's.
    check(
        unsafe {
            sys::cuStreamWaitValue64_v2(
                stream as sys::CUstream,
                addr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        },
        "cuStreamWaitValue64",
    )
}
