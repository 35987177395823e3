//! Plain memory operations the communicator needs: device memset and copies, and a small
//! host-mapped word the kernels write errors into.

use super::driver::{check, CtxGuard};
use crate::error::Result;
use cudarc::driver::sys;

pub fn memset_sync(device: i32, ptr: u64, value: u8, bytes: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: ptr..ptr+bytes is device memory of ours, mapped for this device.
    check(
        unsafe { sys::cuMemsetD8_v2(ptr, value, bytes as usize) },
        "cuMemsetD8",
    )?;
    // SAFETY: plain synchronisation of the current context.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}

pub fn copy_async(device: i32, dst: u64, src: u64, bytes: u64, stream: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: both ranges are device-accessible memory of `bytes` bytes (checked by callers);
    // the stream is the caller's.
    check(
        unsafe { sys::cuMemcpyAsync(dst, src, bytes as usize, stream as sys::CUstream) },
        "cuMemcpyAsync",
    )
}

/// A 4-byte word of pinned host memory mapped into the device's address space.
pub struct MappedWord {
    pub host: *mut u32,
    pub device_ptr: u64,
}

// SAFETY: the word is plain pinned memory; all access is volatile through raw pointers.
unsafe impl Send for MappedWord {}

impl MappedWord {
    pub fn new(device: i32) -> Result<Self> {
        let _ctx = CtxGuard::new(device)?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: valid out-pointer; 64 bytes requested.
        check(
            unsafe { sys::cuMemHostAlloc(&mut p, 64, flags) },
            "cuMemHostAlloc",
        )?;
        // SAFETY: p points at 64 writable bytes just allocated.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, 64) };
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: p is a DEVICEMAP allocation; valid out-pointer.
        check(
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0) },
            "cuMemHostGetDevicePointer",
        )?;
        Ok(MappedWord {
            host: p as *mut u32,
            device_ptr: d,
        })
    }
}

impl Drop for MappedWord {
    fn drop(&mut self) {
        // SAFETY: host came from cuMemHostAlloc and is freed once.
        unsafe { sys::cuMemFreeHost(self.host as *mut std::ffi::c_void) };
    }
}

/// Waits for all work on the device (used before a communicator frees what kernels use).
pub fn sync_device(device: i32) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: plain synchronisation of the current context.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}
